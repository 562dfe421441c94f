//! An emulated single-IP cluster: router, nodes and clients as network
//! namespaces on this machine, one `ferryd` per node (see `topology` for the
//! wiring and DESIGN.md, "The cluster it runs on").
//!
//! Everything the cluster creates is owned by the [`Cluster`] value and torn
//! down by its `Drop`, also when a test panics or `start` fails half-way:
//! agents (SIGTERM, 5 s, SIGKILL), every other process in its namespaces,
//! the tmpfs work dirs, the namespaces, the temp dir.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ferry_agent::config::init::NodeInit;
use ferry_proto::v1::control_client::ControlClient;
use tempfile::TempDir;
use tonic::transport::Channel;

use crate::agent::{AgentError, AgentProcess, LOG_TAIL_LINES, log_tail};
use crate::agent_config::AgentConfig;
use crate::cmd::{self, CmdError};
use crate::inspect::{self, InspectError};
use crate::netns::{self, ChildGuard, NetNs, NetNsError};
use crate::peer::{PeerError, Reservation};
use crate::reap;
use crate::tls::ClusterTls;
use crate::tmpfs::{MountError, Tmpfs};
use crate::topology::Family;
use crate::{control, paths, topology};

mod agents;
mod link_cut;

pub use agents::StalledAgent;
pub use link_cut::LinkCutter;

#[derive(thiserror::Error)]
pub enum ClusterError {
    /// `Cluster::start` failed; everything it built is already gone.
    #[error("starting cluster {id}: {source}")]
    Start {
        id: String,
        source: Box<ClusterError>,
    },
    #[error("invalid cluster spec: {0}")]
    Spec(String),
    #[error(transparent)]
    NetNs(#[from] NetNsError),
    #[error(transparent)]
    Cmd(#[from] CmdError),
    #[error(transparent)]
    Mount(#[from] MountError),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error(transparent)]
    Inspect(#[from] InspectError),
    #[error(transparent)]
    Control(#[from] control::ControlError),
    #[error(transparent)]
    Peer(#[from] PeerError),
    #[error("{what}: not within {timeout:?}")]
    Timeout { what: String, timeout: Duration },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

/// Debug prints the message: tests `.expect()` cluster results, and the
/// agent's log tail is only readable with its line breaks intact.
impl std::fmt::Debug for ClusterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ClusterError {
    let what = what.into();
    move |source| ClusterError::Io { what, source }
}

/// What to build. `ClusterSpec { nodes: 3, clients: 2, ..Default::default() }`.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    pub nodes: usize,
    pub clients: usize,
    /// Start `ferryd` on every node (else only the network and the dirs).
    pub start_agents: bool,
    /// The agent binary; default `$FERRY_BIN_DIR/ferryd` or
    /// `<workspace>/target/debug/ferryd`.
    pub ferryd: Option<PathBuf>,
    /// CRIU for the agents; default `$FERRY_CRIU` or `/opt/ferry/criu/bin/criu`.
    pub criu_path: Option<PathBuf>,
    /// How long each agent may take to answer `ListNodes`.
    pub ready_timeout: Duration,
    /// Extra top-level lines for every `ferryd.toml` (`criu_log_level = 4`).
    pub extra_config: String,
    /// Extra top-level lines for one node's `ferryd.toml` (by name), after
    /// `extra_config`: an agent configured unlike the others.
    pub node_config: Vec<(String, String)>,
    /// Nodes (by name) whose agent's `[public]` names the IPv4 shared
    /// address only, though their network carries both: a node configured
    /// unlike the others.
    pub ipv4_only: Vec<String>,
    /// The cluster network's family (IPv4 by default; IPv6:
    /// 2001:2:0:1::<i>/64, the agents' Peer API and membership over it).
    pub cluster_family: Family,
    /// `[dataplane] capture` of every agent (false: the drop-and-retransmit
    /// baseline).
    pub capture: bool,
    /// Whether each agent's config lists the other nodes as `[[peers]]`
    /// (false: they must find each other through membership).
    pub static_peers: bool,
    /// Run the cluster with `[tls]` (on by default): a CA, node, client
    /// certificates and tokens made in `<dir>/tls` by `ferry cert`'s code,
    /// mutual TLS between agents, authenticated membership and control on
    /// TCP (see [`Cluster::tls`]).
    pub tls: bool,
    /// Nodes (by name) whose `[tls]` comes from another CA with another
    /// membership key: outsiders on the cluster network, for the tests
    /// that check they can neither join nor push a migration.
    pub tls_outsiders: Vec<String>,
}

impl Default for ClusterSpec {
    fn default() -> Self {
        Self {
            nodes: 2,
            clients: 1,
            start_agents: true,
            ferryd: None,
            criu_path: None,
            ready_timeout: Duration::from_secs(20),
            extra_config: String::new(),
            node_config: Vec::new(),
            ipv4_only: Vec::new(),
            cluster_family: Family::V4,
            capture: true,
            static_peers: true,
            tls: true,
            tls_outsiders: Vec::new(),
        }
    }
}

impl ClusterSpec {
    pub fn new(nodes: usize, clients: usize) -> Self {
        Self {
            nodes,
            clients,
            ..Self::default()
        }
    }

    /// The network, dirs and configs only: for testing the harness itself.
    pub fn without_agents(mut self) -> Self {
        self.start_agents = false;
        self
    }

    fn validate(&self) -> Result<(), ClusterError> {
        if !(1..=topology::MAX_NODES).contains(&self.nodes) {
            return Err(ClusterError::Spec(format!(
                "nodes must be 1..={}, not {}",
                topology::MAX_NODES,
                self.nodes
            )));
        }
        if self.clients > topology::MAX_CLIENTS {
            return Err(ClusterError::Spec(format!(
                "clients must be at most {}, not {}",
                topology::MAX_CLIENTS,
                self.clients
            )));
        }
        Ok(())
    }
}

/// One node: its namespace, directories and agent.
#[derive(Debug)]
struct Node {
    name: String,
    netns: NetNs,
    cluster_addr: IpAddr,
    dir: PathBuf,
    work: Option<Tmpfs>,
    /// The node's own bpffs, for its agent's pins.
    bpf: Option<Tmpfs>,
    config: PathBuf,
    control_socket: PathBuf,
    log: PathBuf,
    agent: Option<AgentProcess>,
}

#[derive(Debug)]
struct Client {
    name: String,
    netns: NetNs,
    addr: Ipv4Addr,
}

/// A running emulated cluster. Node names are `node1..nodeN`, client names
/// `client1..clientM`, and `router` names the router's namespace.
#[derive(Debug)]
pub struct Cluster {
    id: String,
    spec: ClusterSpec,
    ferryd: PathBuf,
    router: Option<NetNs>,
    nodes: Vec<Node>,
    clients: Vec<Client>,
    tmp: Option<TempDir>,
    tls: Option<ClusterTls>,
    torn_down: bool,
}

static REAP_STALE: Once = Once::new();
static NEXT_CLUSTER: AtomicUsize = AtomicUsize::new(0);

impl Cluster {
    /// Builds the network, mounts the work dirs, writes the configs and (if
    /// `spec.start_agents`) starts the agents and waits until each answers
    /// `ListNodes`. On error everything built so far is torn down and the
    /// agents' log tails are printed.
    pub fn start(spec: ClusterSpec) -> Result<Self, ClusterError> {
        spec.validate()?;
        REAP_STALE.call_once(reap::reap_stale);
        let pid = std::process::id();
        let id = format!(
            "{}{pid}-{}",
            reap::NETNS_PREFIX,
            NEXT_CLUSTER.fetch_add(1, Ordering::Relaxed)
        );
        let tmp = tempfile::Builder::new()
            .prefix(&format!("{}{pid}-", reap::TEMPDIR_PREFIX))
            .tempdir()
            .map_err(io_err("creating the cluster's temp dir"))?;
        let ferryd = spec
            .ferryd
            .clone()
            .unwrap_or_else(|| paths::bin_path("ferryd"));
        let mut cluster = Self {
            id,
            spec,
            ferryd,
            router: None,
            nodes: Vec::new(),
            clients: Vec::new(),
            tmp: Some(tmp),
            tls: None,
            torn_down: false,
        };
        let started = Instant::now();
        match cluster.build() {
            Ok(()) => {
                tracing::info!(
                    cluster = %cluster.id,
                    nodes = cluster.nodes.len(),
                    clients = cluster.clients.len(),
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "cluster up"
                );
                Ok(cluster)
            }
            Err(e) => {
                cluster.print_log_tails("cluster start failed");
                let id = cluster.id.clone();
                // Tear down what was built before reporting.
                drop(cluster);
                Err(ClusterError::Start {
                    id,
                    source: Box::new(e),
                })
            }
        }
    }

    fn build(&mut self) -> Result<(), ClusterError> {
        let router = self.create_netns("r")?;
        self.router = Some(router);
        for i in 1..=self.spec.nodes {
            let name = format!("node{i}");
            let netns = self.create_netns(&format!("n{i}"))?;
            let dir = self.dir().join(&name);
            self.nodes.push(Node {
                cluster_addr: match self.spec.cluster_family {
                    Family::V4 => topology::node_cluster_addr(i).into(),
                    Family::V6 => topology::node_cluster_addr6(i).into(),
                },
                config: dir.join("ferryd.toml"),
                control_socket: dir.join("control.sock"),
                log: dir.join("ferryd.log"),
                work: None,
                bpf: None,
                agent: None,
                name,
                netns,
                dir,
            });
        }
        for j in 1..=self.spec.clients {
            let netns = self.create_netns(&format!("c{j}"))?;
            self.clients.push(Client {
                name: format!("client{j}"),
                addr: topology::client_addr(j),
                netns,
            });
        }

        let node_ns: Vec<&str> = self.nodes.iter().map(|n| n.netns.name()).collect();
        let client_ns: Vec<&str> = self.clients.iter().map(|c| c.netns.name()).collect();
        let router_ns = self.router.as_ref().map(NetNs::name);
        cmd::ip_batch(router_ns, &topology::router_script(&node_ns, &client_ns))?;
        if let Some(router) = &self.router {
            bridge_without_netfilter(router)?;
        }
        for (i, n) in self.nodes.iter().enumerate() {
            ferry_network(
                n.netns.name(),
                &topology::node_network_args(i + 1, self.spec.cluster_family),
            )?;
        }
        for (j, c) in self.clients.iter().enumerate() {
            cmd::ip_batch(Some(c.netns.name()), &topology::client_script(j + 1))?;
            ferry_network(c.netns.name(), &topology::gateway_network_args())?;
            reuse_time_wait_ports(c.netns.name())?;
        }

        if self.spec.tls {
            let nodes: Vec<(String, IpAddr)> = self
                .nodes
                .iter()
                .map(|n| (n.name.clone(), n.cluster_addr))
                .collect();
            let tls = ClusterTls::generate(&self.dir().join("tls"), &nodes).map_err(|e| {
                ClusterError::Io {
                    what: "making the cluster's certificates".into(),
                    source: std::io::Error::other(e.to_string()),
                }
            })?;
            self.tls = Some(tls);
        }
        // The outsiders' CA knows only them.
        let outsiders = if self.spec.tls && !self.spec.tls_outsiders.is_empty() {
            let nodes: Vec<(String, IpAddr)> = self
                .nodes
                .iter()
                .filter(|n| self.spec.tls_outsiders.contains(&n.name))
                .map(|n| (n.name.clone(), n.cluster_addr))
                .collect();
            Some(
                ClusterTls::generate(&self.dir().join("tls-outsiders"), &nodes).map_err(|e| {
                    ClusterError::Io {
                        what: "making the outsiders' certificates".into(),
                        source: std::io::Error::other(e.to_string()),
                    }
                })?,
            )
        } else {
            None
        };
        let criu = self.spec.criu_path.clone().unwrap_or_else(paths::criu_path);
        let peers: Vec<(String, SocketAddr)> = self
            .nodes
            .iter()
            .map(|n| {
                let addr = SocketAddr::new(n.cluster_addr, topology::PEER_PORT);
                (n.name.clone(), addr)
            })
            .collect();
        for node in &mut self.nodes {
            std::fs::create_dir_all(&node.dir)
                .map_err(io_err(format!("creating {}", node.dir.display())))?;
            let work = Tmpfs::mount(&node.dir.join("work"))?;
            let bpf = Tmpfs::mount_bpffs(&node.dir.join("bpf"))?;
            let mut init = NodeInit::new(
                &node.name,
                (topology::PUBLIC_IFACE, topology::PUBLIC_ADDR.into()),
                (topology::CLUSTER_IFACE, node.cluster_addr),
            );
            init.public_address6 =
                (!self.spec.ipv4_only.contains(&node.name)).then_some(topology::PUBLIC_ADDR6);
            init.peer_port = topology::PEER_PORT;
            init.work_dir = work.path().to_owned();
            init.criu_path = criu.clone();
            init.control_socket = node.control_socket.clone();
            init.handoff_socket = node.dir.join("handoff.sock");
            init.peers = peers
                .iter()
                .filter(|(name, _)| self.spec.static_peers && *name != node.name)
                .map(|(name, address)| (name.clone(), *address))
                .collect();
            init.extra = self
                .spec
                .node_config
                .iter()
                .filter(|(name, _)| *name == node.name)
                .fold(self.spec.extra_config.clone(), |all, (_, lines)| {
                    all + "\n" + lines + "\n"
                });
            init.capture = self.spec.capture;
            init.pin_dir = Some(bpf.path().join("pins"));
            let tls = match &outsiders {
                Some(o) if self.spec.tls_outsiders.contains(&node.name) => Some(o),
                _ => self.tls.as_ref(),
            };
            init.tls_dir = tls.map(|t| t.dir().to_owned());
            let config = AgentConfig {
                init,
                tls_tokens: tls.map(ClusterTls::token_section).unwrap_or_default(),
            };
            node.work = Some(work);
            node.bpf = Some(bpf);
            let text = config
                .render()
                .map_err(|e| ClusterError::Spec(format!("{}'s ferryd.toml: {e}", node.name)))?;
            std::fs::write(&node.config, text)
                .map_err(io_err(format!("writing {}", node.config.display())))?;
        }

        if self.spec.start_agents {
            // Start all, then wait for each: they come up in parallel.
            for i in 0..self.nodes.len() {
                self.spawn_agent(i)?;
            }
            for node in &mut self.nodes {
                if let Some(agent) = node.agent.as_mut() {
                    agent.wait_ready(self.spec.ready_timeout)?;
                }
            }
        }
        Ok(())
    }

    /// Creates `<id>-<role>` with its IPv6 settings
    /// ([`topology::ipv6_settings`]).
    fn create_netns(&self, role: &str) -> Result<NetNs, ClusterError> {
        let ns = NetNs::create(&format!("{}-{role}", self.id))?;
        for (key, value) in topology::ipv6_settings(role == "r") {
            if let Err(e) = netns::set_sysctl(&ns.path(), key, value) {
                // A kernel without IPv6 has no such setting.
                tracing::debug!(netns = ns.name(), key, error = %e, "IPv6 setting");
            }
        }
        Ok(ns)
    }

    fn node(&self, name: &str) -> &Node {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name:?} in cluster {}", self.id))
    }

    fn node_index(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .position(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name:?} in cluster {}", self.id))
    }

    fn client(&self, name: &str) -> &Client {
        self.clients
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no client {name:?} in cluster {}", self.id))
    }

    /// The cluster's unique prefix (`fy<pid>-<n>`), also of its namespaces.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The cluster's temp dir (node dirs are `<dir>/nodeN`).
    pub fn dir(&self) -> &Path {
        self.tmp
            .as_ref()
            .map(TempDir::path)
            .expect("temp dir present until teardown")
    }

    pub fn node_names(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.name.clone()).collect()
    }

    pub fn client_names(&self) -> Vec<String> {
        self.clients.iter().map(|c| c.name.clone()).collect()
    }

    /// The names of every namespace this cluster made.
    pub fn netns_names(&self) -> Vec<String> {
        self.all_netns().map(|n| n.name().to_owned()).collect()
    }

    fn all_netns(&self) -> impl Iterator<Item = &NetNs> {
        self.router
            .iter()
            .chain(self.nodes.iter().map(|n| &n.netns))
            .chain(self.clients.iter().map(|c| &c.netns))
    }

    /// Limits every node's cluster interface (`clu0`) to `rate` (tc's
    /// units, "10mbit") with a `tbf` of `burst` bytes and `latency`
    /// ("400ms"); `None` takes the limit off again. Panics if tc fails.
    pub fn shape_cluster_links(&self, limit: Option<(&str, u32, &str)>) {
        for node in self.node_names() {
            let mut tc = Command::new("nsenter");
            tc.arg(format!("--net={}", self.netns_path(&node).display()));
            match limit {
                Some((rate, burst, latency)) => {
                    tc.args([
                        "tc", "qdisc", "replace", "dev", "clu0", "root", "tbf", "rate",
                    ])
                    .args([
                        rate,
                        "burst",
                        &burst.to_string(),
                        "latency",
                        latency,
                    ]);
                }
                None => {
                    tc.args(["tc", "qdisc", "del", "dev", "clu0", "root"]);
                }
            }
            let status = tc.status().expect("running tc");
            assert!(
                status.success(),
                "shaping {node}'s clu0 ({limit:?}): {status}"
            );
        }
    }

    /// `/run/netns/<ns>` of `node1`.., `client1`.. or `router`.
    pub fn netns_path(&self, name: &str) -> PathBuf {
        if name == "router" {
            return self.router.as_ref().expect("router namespace").path();
        }
        if let Some(n) = self.nodes.iter().find(|n| n.name == name) {
            return n.netns.path();
        }
        self.client(name).netns.path()
    }

    /// Inode of the node's namespace; compare with `/proc/<pid>/ns/net`.
    pub fn node_netns_inode(&self, node: &str) -> Result<u64, ClusterError> {
        Ok(self.node(node).netns.inode()?)
    }

    /// The node whose namespace the process `pid` is in, if any.
    pub fn node_of_pid(&self, pid: i32) -> Result<Option<String>, ClusterError> {
        let ino = match netns::inode_of(Path::new(&format!("/proc/{pid}/ns/net"))) {
            Ok(ino) => ino,
            Err(_) => return Ok(None),
        };
        for n in &self.nodes {
            if n.netns.inode()? == ino {
                return Ok(Some(n.name.clone()));
            }
        }
        Ok(None)
    }

    /// The shared public address (198.18.0.100).
    pub fn public_addr(&self) -> Ipv4Addr {
        topology::PUBLIC_ADDR
    }

    /// The node's IPv4 cluster address; panics on an IPv6 cluster network
    /// (see [`Self::node_cluster_ip`]).
    pub fn node_cluster_addr(&self, node: &str) -> Ipv4Addr {
        match self.node(node).cluster_addr {
            IpAddr::V4(v4) => v4,
            IpAddr::V6(v6) => panic!("{node}'s cluster address {v6} is IPv6"),
        }
    }

    /// The node's cluster address, of the cluster network's family.
    pub fn node_cluster_ip(&self, node: &str) -> IpAddr {
        self.node(node).cluster_addr
    }

    pub fn client_addr(&self, client: &str) -> Ipv4Addr {
        self.client(client).addr
    }

    /// The node's tmpfs work dir.
    pub fn work_dir(&self, node: &str) -> PathBuf {
        self.node(node).dir.join("work")
    }

    /// Fills the node's work dir: its tmpfs is capped at what it holds now,
    /// so that the next new page written there fails with `ENOSPC`
    /// (`full: false` lifts the cap). Returns the bytes it held.
    pub fn work_dir_full(&self, node: &str, full: bool) -> u64 {
        let dir = self.work_dir(node);
        let fs = nix::sys::statfs::statfs(&dir).expect("statfs of the work dir");
        let used = (fs.blocks() - fs.blocks_free()) * fs.block_size() as u64;
        crate::tmpfs::remount_size(&dir, full.then_some(used.max(fs.block_size() as u64)))
            .unwrap_or_else(|e| panic!("capping {node}'s work dir: {e}"));
        used
    }

    pub fn config_path(&self, node: &str) -> &Path {
        &self.node(node).config
    }

    pub fn control_socket(&self, node: &str) -> &Path {
        &self.node(node).control_socket
    }

    /// The node's handoff socket (distributed servers' processes reach
    /// their ferryd there; ferryd passes it to what it starts).
    pub fn handoff_socket(&self, node: &str) -> PathBuf {
        self.node(node).dir.join("handoff.sock")
    }

    /// The agent's stdout+stderr (`<dir>/nodeN/ferryd.log`, outside the work
    /// dir, which belongs to the agent).
    pub fn log_path(&self, node: &str) -> &Path {
        &self.node(node).log
    }

    pub fn log_tail(&self, node: &str, lines: usize) -> String {
        log_tail(&self.node(node).log, lines)
    }

    /// The agent's log so far as plain text (tracing's colour codes
    /// taken out, so that `key=value` reads as written); empty if
    /// unreadable.
    pub fn log_text(&self, node: &str) -> String {
        let raw = std::fs::read_to_string(&self.node(node).log).unwrap_or_default();
        let mut plain = String::with_capacity(raw.len());
        let mut chars = raw.chars();
        while let Some(c) = chars.next() {
            if c == '\x1b' {
                // CSI ... final letter
                for d in chars.by_ref() {
                    if d.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                plain.push(c);
            }
        }
        plain
    }

    /// A `Control` client for the node's agent, connected over its Unix
    /// socket.
    pub async fn control(&self, node: &str) -> Result<ControlClient<Channel>, ClusterError> {
        Ok(control::connect(&self.node(node).control_socket).await?)
    }

    /// A `Control` client that connects on first use and reconnects after
    /// an agent restart. Call inside a Tokio runtime.
    pub fn control_lazy(&self, node: &str) -> ControlClient<Channel> {
        control::lazy_client(&self.node(node).control_socket)
    }

    /// Host PID of the node's agent. Panics if it is not running.
    pub fn agent_pid(&self, node: &str) -> i32 {
        let pid = self
            .node(node)
            .agent
            .as_ref()
            .and_then(AgentProcess::pid)
            .unwrap_or_else(|| panic!("no agent runs on {node}"));
        pid as i32
    }

    /// The node's agent's Peer service address (`198.19.0.<i>:7100`).
    pub fn peer_addr(&self, node: &str) -> SocketAddrV4 {
        SocketAddrV4::new(self.node_cluster_addr(node), topology::PEER_PORT)
    }

    /// Takes `to`'s single incoming-migration slot the way `from`'s agent
    /// would (Peer `Hello` + `Prepare`, from `from`'s namespace); released
    /// with `Abort` when the reservation is dropped.
    pub fn reserve_destination(
        &self,
        from: &str,
        to: &str,
        migration_id: &str,
    ) -> Result<Reservation, ClusterError> {
        Ok(Reservation::reserve(
            &self.node(from).netns.path(),
            from,
            self.peer_addr(to),
            migration_id,
            self.tls.as_ref().map(|t| t.client(to, Some(from))),
        )?)
    }

    /// The cluster's certificates and tokens, when it runs with TLS.
    pub fn tls(&self) -> Option<&ClusterTls> {
        self.tls.as_ref()
    }

    /// True when the node's agent holds no incoming migration's files
    /// (`<work_dir>/incoming` is absent or empty).
    pub fn incoming_dir_is_empty(&self, node: &str) -> bool {
        match std::fs::read_dir(self.work_dir(node).join("incoming")) {
            Ok(mut entries) => entries.next().is_none(),
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        }
    }

    /// Peers of the ESTABLISHED TCP sockets on `local_port` in the node.
    /// Panics if the node's sockets cannot be read.
    pub fn established_tcp(&self, node: &str, local_port: u16) -> Vec<SocketAddr> {
        inspect::established_peers(&self.node(node).netns.path(), local_port)
            .unwrap_or_else(|e| panic!("sockets of {node}: {e}"))
    }

    /// The TCP connections on `local_port` in the node, in any state
    /// (closing ones too: a FIN_WAIT1 socket lingers for minutes), as
    /// (peer, state). Panics if the node's sockets cannot be read.
    pub fn tcp_connections_in_any_state(
        &self,
        node: &str,
        local_port: u16,
    ) -> Vec<(SocketAddr, u8)> {
        inspect::tcp_sockets(&self.node(node).netns.path())
            .unwrap_or_else(|e| panic!("sockets of {node}: {e}"))
            .into_iter()
            .filter(|e| e.state != inspect::TCP_LISTEN && e.local.port() == local_port)
            .map(|e| (e.remote, e.state))
            .collect()
    }

    /// The nodes holding an ESTABLISHED socket on `local_port` connected to
    /// `peer` (normally exactly one).
    pub fn nodes_holding(&self, peer: impl Into<SocketAddr>, local_port: u16) -> Vec<String> {
        let peer = peer.into();
        self.nodes
            .iter()
            .filter(|n| self.established_tcp(&n.name, local_port).contains(&peer))
            .map(|n| n.name.clone())
            .collect()
    }

    /// Whether something in the node listens on TCP `port`.
    pub fn is_listening(&self, node: &str, port: u16) -> Result<bool, ClusterError> {
        Ok(inspect::tcp_sockets(&self.node(node).netns.path())?
            .iter()
            .any(|e| e.state == inspect::TCP_LISTEN && e.local.port() == port))
    }

    /// Waits (polling every 20 ms) until something in the node listens on
    /// TCP `port`.
    pub fn wait_listening(
        &self,
        node: &str,
        port: u16,
        timeout: Duration,
    ) -> Result<(), ClusterError> {
        let deadline = Instant::now() + timeout;
        while !self.is_listening(node, port)? {
            if Instant::now() >= deadline {
                return Err(ClusterError::Timeout {
                    what: format!("a listener on {node} port {port}"),
                    timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Host PIDs of the processes in the node's namespace (agent included).
    /// Panics if `ip netns pids` fails.
    pub fn pids_in(&self, node: &str) -> Vec<i32> {
        self.node(node)
            .netns
            .pids()
            .unwrap_or_else(|e| panic!("processes of {node}: {e}"))
    }

    /// Spawns `cmd` in the namespace of a node, client or the router; the
    /// returned guard kills and reaps it when dropped.
    pub fn spawn_in(&self, name: &str, cmd: Command) -> Result<ChildGuard, ClusterError> {
        Ok(netns::spawn_in(&self.netns_path(name), cmd)?)
    }

    /// Starts `program args...` in the node's namespace, NOT under the
    /// agent's management, stdin from /dev/null; killed when the guard drops.
    pub fn spawn_in_node(
        &self,
        node: &str,
        program: &str,
        args: &[&str],
    ) -> Result<ChildGuard, ClusterError> {
        let mut cmd = Command::new(program);
        cmd.args(args).stdin(std::process::Stdio::null());
        Ok(netns::spawn_in(&self.node(node).netns.path(), cmd)?)
    }

    fn print_log_tails(&self, why: &str) {
        for n in &self.nodes {
            if n.log.exists() {
                eprintln!(
                    "---- {why}: ferryd log of {} ({}), last {LOG_TAIL_LINES} lines ----\n{}",
                    n.name,
                    n.log.display(),
                    log_tail(&n.log, LOG_TAIL_LINES)
                );
            }
        }
    }

    /// With `FERRY_TEST_LOG_DIR` set, keeps each node's logs (agent and the
    /// `*.log` files in its work dir, e.g. CRIU's) in
    /// `$FERRY_TEST_LOG_DIR/<cluster id>/<node>/`.
    fn save_logs(&self) {
        let Some(root) = std::env::var_os("FERRY_TEST_LOG_DIR").filter(|d| !d.is_empty()) else {
            return;
        };
        for n in &self.nodes {
            let dst = Path::new(&root).join(&self.id).join(&n.name);
            let result = std::fs::create_dir_all(&dst).and_then(|()| {
                if n.log.exists() {
                    std::fs::copy(&n.log, dst.join("ferryd.log"))?;
                }
                copy_logs(&n.dir.join("work"), &dst.join("work"), 4)
            });
            if let Err(e) = result {
                eprintln!("ferry-integration: saving logs of {}: {e}", n.name);
            }
        }
    }

    /// Tears everything down; idempotent, and never panics: problems are
    /// printed. Called by `Drop`.
    pub fn teardown(&mut self) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        if std::thread::panicking() {
            self.print_log_tails("test panicked");
        }

        // 1. Agents: SIGTERM to all at once, one shared 5 s grace period.
        let deadline = Instant::now() + Duration::from_secs(5);
        for n in &mut self.nodes {
            if let Some(agent) = n.agent.as_mut() {
                agent.terminate();
            }
        }
        for n in &mut self.nodes {
            if let Some(mut agent) = n.agent.take()
                && let Err(e) = agent.reap(deadline)
            {
                eprintln!("ferry-integration: {e}");
            }
        }

        // 2. Whatever else runs in our namespaces (workloads, restored
        //    processes, CRIU): SIGKILL until none is left.
        let names = self.netns_names();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let left = reap::kill_all_in(&names, Duration::from_secs(10));
        if !left.is_empty() {
            eprintln!("ferry-integration: processes {left:?} survived SIGKILL in {names:?}");
        }

        // 3. Logs out of the tmpfs before it goes.
        self.save_logs();

        // 4. Mounts; the bpffs last: it holds the pinned programs that
        //    filter the node's interfaces (gone with the namespaces anyway).
        for n in &mut self.nodes {
            for mut m in [n.work.take(), n.bpf.take()].into_iter().flatten() {
                if let Err(e) = m.unmount() {
                    eprintln!("ferry-integration: {e}");
                }
            }
        }

        // 5. Namespaces: endpoints first, the router (with the bridges) last.
        for ns in self
            .clients
            .iter_mut()
            .map(|c| &mut c.netns)
            .chain(self.nodes.iter_mut().map(|n| &mut n.netns))
            .chain(self.router.as_mut())
        {
            if let Err(e) = ns.delete() {
                eprintln!("ferry-integration: {e}");
            }
        }

        // 6. The temp dir.
        if let Some(tmp) = self.tmp.take() {
            let path = tmp.path().to_owned();
            if let Err(e) = tmp.close() {
                eprintln!("ferry-integration: removing {}: {e}", path.display());
            }
        }
        tracing::debug!(cluster = %self.id, "cluster torn down");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// Copies the `*.log` files below `src` to the same places below `dst`.
fn copy_logs(src: &Path, dst: &Path, depth: usize) -> std::io::Result<()> {
    let Ok(entries) = std::fs::read_dir(src) else {
        return Ok(());
    };
    for entry in entries {
        let entry = entry?;
        let path = entry.path();
        let kind = entry.file_type()?;
        if kind.is_dir() && depth > 0 {
            copy_logs(&path, &dst.join(entry.file_name()), depth - 1)?;
        } else if kind.is_file() && path.extension().is_some_and(|e| e == "log") {
            std::fs::create_dir_all(dst)?;
            std::fs::copy(&path, dst.join(entry.file_name()))?;
        }
    }
    Ok(())
}

/// Runs `packaging/ferry-network` with `args` inside namespace `netns`.
fn ferry_network(netns: &str, args: &[String]) -> Result<(), ClusterError> {
    cmd::run(
        Command::new("ip")
            .args(["netns", "exec", netns, "sh"])
            .arg(topology::network_script())
            .args(args),
    )?;
    Ok(())
}

/// The router is a switch: its bridges forward frames without passing
/// them through netfilter. Where the kernel has br_netfilter, a new
/// namespace starts with `bridge-nf-call-*` on, and every flooded frame
/// (each client's, once per node) then runs the IP hooks in the sender's
/// context, on the cores the nodes share, which a real cluster's switch
/// does not spend. (A/B at 1024 connections, 30 migrations each: the
/// freeze's median stayed 33.1 ms, its mean went 34.1 -> 33.1.)
fn bridge_without_netfilter(router: &NetNs) -> Result<(), ClusterError> {
    for key in [
        "net.bridge.bridge-nf-call-iptables",
        "net.bridge.bridge-nf-call-ip6tables",
        "net.bridge.bridge-nf-call-arptables",
    ] {
        if !Path::new("/proc/sys").join(key.replace('.', "/")).exists() {
            // No br_netfilter here: bridged frames skip netfilter already.
            continue;
        }
        netns::set_sysctl(&router.path(), key, "0")?;
    }
    Ok(())
}

/// A client namespace is one address opening connections to one server
/// address:port, over and over: a bench at 4096 connections starts nine
/// sets of them (three runs of three modes), and the ports of the closed
/// ones stay in TIME_WAIT for a minute. Reusing those ports for new
/// outgoing connections (timestamps tell the old segments apart) keeps the
/// load generator from running out of ports (EADDRNOTAVAIL at connect).
fn reuse_time_wait_ports(client: &str) -> Result<(), ClusterError> {
    cmd::run(Command::new("ip").args([
        "netns",
        "exec",
        client,
        "sysctl",
        "-q",
        "-w",
        "net.ipv4.tcp_tw_reuse=1",
    ]))?;
    Ok(())
}
