//! ferryd's TOML configuration. Every setting, commented, with its default:
//! `packaging/ferryd.toml.example` (a test keeps it complete); check a file
//! with `ferryd --check-config FILE`.
//!
//! ```toml
//! node = "node1"
//! work_dir = "/run/ferry/work"            # checkpoint images: put it on tmpfs
//! criu_path = "/opt/ferry/criu/bin/criu"
//! criu_cache_dir = "/dev/shm/ferry-criu"  # the RUNDIR that CRIU was built with
//! control_socket = "/run/ferry/control.sock"
//!
//! [public]                                # the shared, single-IP side
//! interface = "pub0"
//! address = "198.18.0.100"
//!
//! [cluster]                               # this node's own address
//! interface = "clu0"
//! address = "198.19.0.1"
//! peer_listen = "198.19.0.1:7100"
//!
//! [[peers]]
//! name = "node2"
//! address = "198.19.0.2:7100"
//! ```

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

mod choices;
pub mod init;

pub use choices::{Compression, MemoryStrategy, PostCopyPages, Role, SocketMigration};

/// Where `cargo xtask setup` installs CRIU.
pub const DEFAULT_CRIU_PATH: &str = "/opt/ferry/criu/bin/criu";
pub const DEFAULT_CONTROL_SOCKET: &str = "/run/ferry/control.sock";

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// This node's name, unique in the cluster.
    pub node: String,
    /// Checkpoint images and CRIU logs. tmpfs keeps disk I/O out of the freeze.
    pub work_dir: PathBuf,
    #[serde(default = "default_criu_path")]
    pub criu_path: PathBuf,
    /// Where CRIU keeps its cache of kernel probes: the RUNDIR it was built
    /// with (`/dev/shm/ferry-criu` for the CRIU `cargo xtask setup` builds,
    /// `/run` for a distribution's). The agent creates it (root only) and
    /// warms the cache at start-up; without a cache on tmpfs every restore
    /// probes the kernel again inside the freeze (see `criu::cache`).
    #[serde(default = "crate::criu::default_cache_dir")]
    pub criu_cache_dir: PathBuf,
    /// CRIU log verbosity (0-4); 4 is useful when a dump or restore fails.
    /// CRIU's logs of a failed migration are kept in `<work_dir>/logs`; at
    /// 4 those of every migration are, each step with its time.
    #[serde(default = "default_criu_log_level")]
    pub criu_log_level: i32,
    /// How long the source waits for the destination's answer to each step
    /// taken while the process is frozen (image transfer, restore) before
    /// it gives up, aborts and resumes the process. Also how long a Peer
    /// connection may go silent: each side pings every half of it and
    /// closes a connection whose ping is not answered within it, so that a
    /// cut link ends a pre-copy round or a post-copy's page stream (the
    /// pages then count as lost) within 1.5 times this.
    #[serde(default = "default_peer_timeout_secs")]
    pub peer_timeout_secs: u64,
    /// Control API for the local CLI: a Unix socket, root only.
    #[serde(default = "default_control_socket")]
    pub control_socket: PathBuf,
    /// Where server processes of distributed servers reach this agent to
    /// hand connections off and receive them (`ferry-handoff`, its C ABI):
    /// a Unix socket open to every local user (a caller must be a server
    /// ferryd manages); ferryd passes it to the processes it starts as
    /// `FERRY_HANDOFF_SOCKET`.
    #[serde(default = "default_handoff_socket")]
    pub handoff_socket: PathBuf,
    /// Control API on TCP as well (for remote schedulers), if set.
    #[serde(default)]
    pub control_listen: Option<SocketAddr>,
    pub public: PublicConfig,
    pub cluster: ClusterConfig,
    #[serde(default)]
    pub dataplane: DataPlaneConfig,
    #[serde(default)]
    pub peers: Vec<PeerConfig>,
    /// SWIM membership on the cluster network (off by default: then the
    /// static `[[peers]]` are the cluster).
    #[serde(default)]
    pub membership: MembershipConfig,
    /// The automatic load balancer (the conductor); off by default.
    #[serde(default)]
    pub balancer: BalancerConfig,
    /// The balancer's policies and thresholds (`ferry_policy::Config`:
    /// `[policy.transfer]`, `[policy.load]`, ...).
    #[serde(default)]
    pub policy: ferry_policy::Config,
    /// `[migration]`: how migrations started here move the process.
    #[serde(default)]
    pub migration: MigrationConfig,
    /// The Prometheus endpoint (off by default).
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// `[tls]`: mutual TLS between agents, authenticated Control API on
    /// TCP, authenticated membership. Without it everything is plaintext
    /// and unauthenticated, as before (ferryd warns).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsConfig>,
    /// Features of this host ferryd treats as missing though the kernel
    /// has them, by their keys (`ferryd --check` lists them and what ferry
    /// does without each): to try a fallback, or keep a feature out of
    /// use. Empty by default.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features_off: Vec<String>,
}

/// `[tls]`: the cluster's CA and this node's certificate (`ferry cert`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// The cluster CA's certificate (PEM): peers and Control clients must
    /// present a certificate it signed.
    pub ca: PathBuf,
    /// This node's certificate (PEM, `ferry cert node`): it must name this
    /// node.
    pub cert: PathBuf,
    /// Its private key (PEM); keep it 0600.
    pub key: PathBuf,
    /// The cluster's membership key (`membership.key` of `ferry cert ca`):
    /// every SWIM datagram and beacon is authenticated with it. Required
    /// when `[membership] enabled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub membership_key: Option<PathBuf>,
    /// Bearer tokens accepted on `control_listen`, besides client
    /// certificates (`ferry cert token`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<TokenConfig>,
}

impl TlsConfig {
    /// The first problem of the `[tls]` section: the field and why.
    fn problem(&self, membership_enabled: bool) -> Option<(String, String)> {
        for (field, p) in [
            ("tls.ca", &self.ca),
            ("tls.cert", &self.cert),
            ("tls.key", &self.key),
        ]
        .into_iter()
        .chain(
            self.membership_key
                .iter()
                .map(|p| ("tls.membership_key", p)),
        ) {
            if p.as_os_str().is_empty() {
                return Some((field.to_owned(), "must name a file".into()));
            }
        }
        if membership_enabled && self.membership_key.is_none() {
            return Some((
                "tls.membership_key".to_owned(),
                "required with [membership] enabled: without it anyone on the cluster \
                 network could join (the membership.key of `ferry cert ca`)"
                    .into(),
            ));
        }
        let mut names = std::collections::HashSet::new();
        for (i, t) in self.tokens.iter().enumerate() {
            if t.sha256.len() != 64 || !t.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Some((
                    format!("tls.tokens[{i}].sha256"),
                    "must be 64 hex digits, the SHA-256 of the token (`ferry cert token`)".into(),
                ));
            }
            if t.name.is_empty() || !names.insert(&t.name) {
                return Some((
                    format!("tls.tokens[{i}].name"),
                    format!("{:?} is empty or listed twice", t.name),
                ));
            }
        }
        None
    }
}

/// `[[tls.tokens]]`: one bearer token of the Control API.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    /// Who holds it, for logs and refusals.
    pub name: String,
    pub role: Role,
    /// SHA-256 of the token, hex (the token itself is not stored here).
    pub sha256: String,
}

/// `[migration]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MigrationConfig {
    /// How TCP connections move when a request does not say:
    /// "collective" (ferryd reads and rebuilds all established
    /// connections in one batch, `sockstate`), "incremental" (collective,
    /// with what does not move read before the freeze,
    /// `sockstate::preread`) or "iterative" (CRIU's own path, one
    /// connection at a time). Incremental: its freeze was the shortest in
    /// every comparison measured here (docs/results.md, "The freeze at 16
    /// to 4096 connections"; `cargo xtask bench freeze`); it falls back to collective by itself without cgroup v2,
    /// and collective to iterative for sockets it cannot move.
    pub sockets: SocketMigration,
    /// How memory moves when a request does not say: "total-copy" (all in
    /// the freeze), "pre-copy" or "queued-pre-copy" (rounds while the
    /// process runs, `engine::precopy`), "post-copy" (pages follow the
    /// resumed process, CRIU lazy pages), "assisted-post-copy" (one live
    /// pass, then post-copy of what was written since). Total copy until another one
    /// measurably wins here (docs/results.md, `cargo xtask bench algorithms`).
    pub strategy: MemoryStrategy,
    /// Pre-copy: the longest the pages left for the freeze may take to
    /// cross at the rate measured so far, in milliseconds (1..=60000);
    /// within it, rounds go on while they still halve what is left
    /// (`engine::precopy::Convergence`).
    pub downtime_budget_ms: u32,
    /// Pre-copy: freeze after this many rounds at most (1..=1000).
    pub max_rounds: u32,
    /// Pre-copy: slow down a process that writes faster than its pages
    /// cross (`engine::throttle`) when a request does not say. Off: its
    /// clients would see it slow without having asked.
    pub throttle: bool,
    /// The most memory an incoming migration may take on this node, in
    /// MiB: the process's resident set, plus its page store and images
    /// when the work dir is in memory (tmpfs). Unset: what the kernel says
    /// is available (MemAvailable) is the limit. A source whose process
    /// does not fit is refused at Prepare, before anything stops.
    pub incoming_memory_limit_mib: Option<u64>,
    /// Post-copy: who moves the pages after the resume, "ferryd" (the
    /// dump copies none; ferryd streams them from the stopped copy and the
    /// destination's page filler installs them) or "criu" (CRIU's page
    /// server and lazy-pages daemon). ferryd's falls back to CRIU's with a
    /// destination or a CRIU that lacks it.
    pub post_copy_pages: PostCopyPages,
    /// Whether pages cross the cluster link compressed: "lz4" (for links
    /// slower than the source compresses, pages that compress) or "off".
    /// Only with a destination that takes them.
    pub compression: Compression,
}

impl MigrationConfig {
    /// The first setting out of range: its field and why.
    fn problem(&self) -> Option<(&'static str, String)> {
        if !(1..=MAX_DOWNTIME_BUDGET_MS).contains(&self.downtime_budget_ms) {
            return Some((
                "migration.downtime_budget_ms",
                format!(
                    "{} is outside 1..={MAX_DOWNTIME_BUDGET_MS}",
                    self.downtime_budget_ms
                ),
            ));
        }
        if self.incoming_memory_limit_mib == Some(0) {
            return Some((
                "migration.incoming_memory_limit_mib",
                "must be > 0 (leave it unset for no limit but the kernel's)".into(),
            ));
        }
        if !(1..=MAX_PRECOPY_ROUNDS).contains(&self.max_rounds) {
            return Some((
                "migration.max_rounds",
                format!("{} is outside 1..={MAX_PRECOPY_ROUNDS}", self.max_rounds),
            ));
        }
        None
    }
}

/// The most a request or the config may ask for.
pub const MAX_DOWNTIME_BUDGET_MS: u32 = 60_000;
pub const MAX_PRECOPY_ROUNDS: u32 = 1000;
/// The longest drain before freeze a request may ask for: the wait is part
/// of the freeze.
pub const MAX_DRAIN_SEND_QUEUES_MS: u32 = 2000;

impl Default for MigrationConfig {
    fn default() -> Self {
        Self {
            sockets: SocketMigration::Incremental,
            strategy: MemoryStrategy::TotalCopy,
            downtime_budget_ms: 30,
            max_rounds: 10,
            throttle: false,
            incoming_memory_limit_mib: None,
            post_copy_pages: PostCopyPages::Ferryd,
            compression: Compression::Off,
        }
    }
}

/// `[metrics]`: Prometheus metrics over HTTP.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Where `GET /metrics` is served ("198.19.0.1:9464"); unset: nowhere.
    pub listen: Option<SocketAddr>,
}

/// `[membership]`: SWIM (foca) over UDP on the cluster address.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MembershipConfig {
    pub enabled: bool,
    /// UDP port on the cluster address, the same on every node.
    pub port: u16,
    /// Find the other nodes by a beacon to the cluster network's broadcast
    /// address (the `[[peers]]` are seeds either way).
    pub discovery: bool,
    /// Broadcast address for the beacon of an IPv4 cluster network;
    /// default: the cluster interface's broadcast address, or
    /// 255.255.255.255 if it has none. An IPv6 cluster network's beacon
    /// goes to the link's all-nodes group, ff02::1, on the cluster
    /// interface.
    pub broadcast: Option<Ipv4Addr>,
    pub beacon_interval_ms: u64,
    /// SWIM probe period: a failed node is suspected within about one.
    pub probe_period_ms: u64,
    /// How long a suspect has to refute before it is declared down.
    pub suspect_to_down_ms: u64,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            port: 7946,
            discovery: true,
            broadcast: None,
            beacon_interval_ms: 2_000,
            probe_period_ms: 500,
            suspect_to_down_ms: 2_000,
        }
    }
}

/// `[balancer]`: the conductor. Thresholds live in `[policy]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct BalancerConfig {
    pub enabled: bool,
    /// How often load is sampled, published and the policies run.
    pub period_ms: u64,
    /// How long the sender waits for a receiver's answer to an offer before
    /// it takes the next candidate.
    pub offer_timeout_ms: u64,
    /// A CPU cgroup (v2, or v1's `cpu` controller) the managed processes are
    /// kept in; its quota is the node's capacity, which loads are measured
    /// against. Unset: the machine's CPUs.
    pub cpu_cgroup: Option<PathBuf>,
}

impl Default for BalancerConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            period_ms: 1_000,
            offer_timeout_ms: 2_000,
            cpu_cgroup: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DataPlaneConfig {
    /// Capture the packets that arrive while a process is frozen and replay
    /// them where it resumes (the default). `false` drops them and leaves
    /// recovery to TCP retransmission, as plain CRIU does: the baseline of
    /// `cargo xtask bench gap`.
    #[serde(default = "default_true")]
    pub capture: bool,
    /// Where the eBPF maps and links are pinned (a directory on a bpffs,
    /// mounted there if needed), so that restarting `ferryd` neither opens
    /// nor closes a port nor drops a translation. Default
    /// `/sys/fs/bpf/ferry/<node>`. Names must not contain '.'.
    #[serde(default)]
    pub pin_dir: Option<std::path::PathBuf>,
}

impl Default for DataPlaneConfig {
    fn default() -> Self {
        Self {
            capture: true,
            pin_dir: None,
        }
    }
}

impl Config {
    /// The pin directory of the data plane (see [`DataPlaneConfig::pin_dir`]).
    pub fn pin_dir(&self) -> std::path::PathBuf {
        self.dataplane
            .pin_dir
            .clone()
            .unwrap_or_else(|| std::path::PathBuf::from("/sys/fs/bpf/ferry").join(&self.node))
    }
}

fn default_true() -> bool {
    true
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PublicConfig {
    /// Interface that carries the cluster's shared address; ferry's
    /// ownership filter is attached to it.
    pub interface: String,
    /// The shared address, IPv4 or IPv6.
    pub address: IpAddr,
    /// A dual-stack cluster's shared IPv6 address, beside an IPv4
    /// `address`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address6: Option<Ipv6Addr>,
}

impl PublicConfig {
    /// The shared addresses, one per family at most.
    pub fn addresses(&self) -> PublicAddresses {
        let mut a = PublicAddresses::default();
        match self.address {
            IpAddr::V4(v4) => a.v4 = Some(v4),
            IpAddr::V6(v6) => a.v6 = Some(v6),
        }
        if let Some(v6) = self.address6 {
            a.v6 = Some(v6);
        }
        a
    }
}

/// The cluster's shared public addresses: the same on every node, one of
/// each family at most.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PublicAddresses {
    pub v4: Option<Ipv4Addr>,
    pub v6: Option<Ipv6Addr>,
}

impl PublicAddresses {
    /// Whether `ip` is one of them (an IPv4-mapped IPv6 address, as a
    /// dual-stack socket shows an IPv4 one, as the IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match ip.to_canonical() {
            IpAddr::V4(v4) => self.v4 == Some(v4),
            IpAddr::V6(v6) => self.v6 == Some(v6),
        }
    }

    /// Each of them, IPv4 first.
    pub fn iter(&self) -> impl Iterator<Item = IpAddr> + use<> {
        self.v4
            .map(IpAddr::V4)
            .into_iter()
            .chain(self.v6.map(IpAddr::V6))
    }

    /// Each of them as text, IPv4 first: what `Peer.Hello` and
    /// `ListNodes` carry.
    pub fn to_strings(&self) -> Vec<String> {
        self.iter().map(|a| a.to_string()).collect()
    }
}

impl std::fmt::Display for PublicAddresses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let all: Vec<String> = self.iter().map(|a| a.to_string()).collect();
        f.write_str(&all.join(" and "))
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    pub interface: String,
    /// IPv4 or IPv6: the whole cluster network is of one family.
    pub address: IpAddr,
    /// Where the Peer service listens (agent to agent).
    pub peer_listen: SocketAddr,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    pub name: String,
    pub address: SocketAddr,
}

fn default_criu_path() -> PathBuf {
    PathBuf::from(DEFAULT_CRIU_PATH)
}
fn default_criu_log_level() -> i32 {
    2
}
fn default_peer_timeout_secs() -> u64 {
    60
}
fn default_control_socket() -> PathBuf {
    PathBuf::from(DEFAULT_CONTROL_SOCKET)
}

fn default_handoff_socket() -> PathBuf {
    PathBuf::from(ferry_handoff::DEFAULT_SOCKET)
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("{path}: {field}: {reason}")]
    Invalid {
        path: PathBuf,
        field: String,
        reason: String,
    },
}

impl Config {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        })?;
        config.validate(path)?;
        Ok(config)
    }

    fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let invalid = |field: &str, reason: String| ConfigError::Invalid {
            path: path.to_owned(),
            field: field.to_owned(),
            reason,
        };
        if !valid_node_name(&self.node) {
            return Err(invalid(
                "node",
                format!(
                    "{:?} is not a node name (1-64 characters of a-z, A-Z, 0-9, '-', '_', '.')",
                    self.node
                ),
            ));
        }
        for (field, p) in [
            ("work_dir", &self.work_dir),
            ("criu_cache_dir", &self.criu_cache_dir),
            ("handoff_socket", &self.handoff_socket),
        ] {
            if !p.is_absolute() {
                return Err(invalid(field, "must be an absolute path".into()));
            }
        }
        if self.public.address.is_ipv6() && self.public.address6.is_some() {
            return Err(invalid(
                "public.address6",
                "is for an IPv6 address beside an IPv4 `address`; `address` is IPv6 already".into(),
            ));
        }
        for (field, ip) in [
            ("public.address", Some(self.public.address)),
            ("public.address6", self.public.address6.map(IpAddr::V6)),
        ] {
            let Some(ip) = ip else { continue };
            let link_local = matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local());
            if ip.is_unspecified()
                || ip.is_multicast()
                || ip.is_loopback()
                || link_local
                || ip.to_canonical() != ip
            {
                return Err(invalid(
                    field,
                    format!("{ip} is not a unicast address a cluster can share"),
                ));
            }
        }
        if self.peer_timeout_secs == 0 {
            return Err(invalid("peer_timeout_secs", "must be at least 1".into()));
        }
        if !(0..=4).contains(&self.criu_log_level) {
            return Err(invalid("criu_log_level", "must be 0 to 4".into()));
        }
        for (i, key) in self.features_off.iter().enumerate() {
            if !crate::host_features::KEYS.contains(&key.as_str()) {
                return Err(invalid(
                    &format!("features_off[{i}]"),
                    format!(
                        "{key:?} is not a feature ferry probes (one of: {})",
                        crate::host_features::KEYS.join(", ")
                    ),
                ));
            }
        }
        if self.membership.enabled {
            let m = &self.membership;
            if m.port == 0 {
                return Err(invalid("membership.port", "must not be 0".into()));
            }
            for (field, v) in [
                ("membership.beacon_interval_ms", m.beacon_interval_ms),
                ("membership.probe_period_ms", m.probe_period_ms),
                ("membership.suspect_to_down_ms", m.suspect_to_down_ms),
            ] {
                if v == 0 {
                    return Err(invalid(field, "must be > 0".into()));
                }
            }
        }
        if self.balancer.period_ms == 0 {
            return Err(invalid("balancer.period_ms", "must be > 0".into()));
        }
        if self.balancer.offer_timeout_ms == 0 {
            return Err(invalid("balancer.offer_timeout_ms", "must be > 0".into()));
        }
        if let Some(cgroup) = &self.balancer.cpu_cgroup
            && !cgroup.is_absolute()
        {
            return Err(invalid(
                "balancer.cpu_cgroup",
                format!("{} is not an absolute path", cgroup.display()),
            ));
        }
        match self.policy.validate() {
            Ok(()) => {}
            Err(ferry_policy::PolicyError::InvalidField { field, reason }) => {
                return Err(invalid(&format!("policy.{field}"), reason));
            }
            Err(e) => return Err(invalid("policy", e.to_string())),
        }
        if let Some((field, reason)) = self.migration.problem() {
            return Err(invalid(field, reason));
        }
        if let Some(addr) = self.metrics.listen {
            if addr.port() == 0 {
                return Err(invalid(
                    "metrics.listen",
                    format!("{addr}: give a port Prometheus can be told (0 picks any)"),
                ));
            }
            if addr == self.cluster.peer_listen || Some(addr) == self.control_listen {
                return Err(invalid(
                    "metrics.listen",
                    format!("{addr} is already the peer or control address"),
                ));
            }
        }
        if let Some((field, reason)) = self
            .tls
            .as_ref()
            .and_then(|t| t.problem(self.membership.enabled))
        {
            return Err(invalid(&field, reason));
        }
        self.validate_families(&invalid)?;
        let mut seen = std::collections::HashSet::new();
        for (i, p) in self.peers.iter().enumerate() {
            if !valid_node_name(&p.name) {
                return Err(invalid(
                    &format!("peers[{i}].name"),
                    format!("{:?} is not a node name", p.name),
                ));
            }
            if p.name == self.node {
                return Err(invalid(
                    &format!("peers[{i}].name"),
                    format!("{:?} is this node's own name", p.name),
                ));
            }
            if !seen.insert(&p.name) {
                return Err(invalid(
                    &format!("peers[{i}].name"),
                    format!("{:?} is listed twice", p.name),
                ));
            }
        }
        Ok(())
    }

    /// One family on the cluster network: a peer of the other could
    /// neither be dialled from the cluster address nor take part in the
    /// in-cluster translation.
    fn validate_families(
        &self,
        invalid: &dyn Fn(&str, String) -> ConfigError,
    ) -> Result<(), ConfigError> {
        let family = |ip: IpAddr| if ip.is_ipv4() { "IPv4" } else { "IPv6" };
        let own = self.cluster.address;
        if own.is_ipv6() && self.membership.broadcast.is_some() {
            return Err(invalid(
                "membership.broadcast",
                "is an IPv4 broadcast address; an IPv6 cluster network's discovery beacons go to the link's all-nodes group (ff02::1) on the cluster interface".into(),
            ));
        }
        if self.cluster.peer_listen.is_ipv4() != own.is_ipv4() {
            return Err(invalid(
                "cluster.peer_listen",
                format!(
                    "{} is {}, the cluster address {own} is {}",
                    self.cluster.peer_listen,
                    family(self.cluster.peer_listen.ip()),
                    family(own)
                ),
            ));
        }
        for (i, p) in self.peers.iter().enumerate() {
            if p.address.is_ipv4() != own.is_ipv4() {
                return Err(invalid(
                    &format!("peers[{i}].address"),
                    format!(
                        "{} ({}) is {}, this node's cluster address {own} is {}: every node of a cluster is on one family of the cluster network",
                        p.address,
                        p.name,
                        family(p.address.ip()),
                        family(own)
                    ),
                ));
            }
        }
        Ok(())
    }

    pub fn peer(&self, name: &str) -> Option<&PeerConfig> {
        self.peers.iter().find(|p| p.name == name)
    }
}

pub(crate) fn valid_node_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
node = "node1"
work_dir = "/run/ferry/work"
[public]
interface = "pub0"
address = "198.18.0.100"
[cluster]
interface = "clu0"
address = "198.19.0.1"
peer_listen = "198.19.0.1:7100"
[[peers]]
name = "node2"
address = "198.19.0.2:7100"
"#;

    #[test]
    fn the_cluster_network_is_of_one_family() {
        let base = r#"
node = "node1"
work_dir = "/run/ferry/work"
[public]
interface = "pub0"
address = "2001:2::100"
[cluster]
interface = "clu0"
address = "198.19.0.1"
peer_listen = "198.19.0.1:7100"
[[peers]]
name = "node2"
address = "198.19.0.2:7100"
"#;
        let c = Config::parse(base, Path::new("x")).expect("an IPv6 public side");
        assert_eq!(c.public.addresses().v4, None);
        let refused = |text: &str| Config::parse(text, Path::new("x")).unwrap_err().to_string();
        let err = refused(&base.replace("198.19.0.2:7100", "[2001:2:0:1::2]:7100"));
        assert!(
            err.contains("peers[0].address") && err.contains("node2") && err.contains("IPv6"),
            "{err}"
        );
        let err = refused(&base.replace(
            "peer_listen = \"198.19.0.1:7100\"",
            "peer_listen = \"[::]:7100\"",
        ));
        assert!(err.contains("cluster.peer_listen"), "{err}");
        // An IPv6 cluster network, its peers IPv6 too.
        let v6 = base
            .replace("address = \"198.19.0.1\"", "address = \"2001:2:0:1::1\"")
            .replace("198.19.0.1:7100", "[2001:2:0:1::1]:7100")
            .replace("198.19.0.2:7100", "[2001:2:0:1::2]:7100");
        let c = Config::parse(&v6, Path::new("x")).expect("an IPv6 cluster network");
        assert_eq!(
            c.cluster.address,
            "2001:2:0:1::1".parse::<IpAddr>().unwrap()
        );
        let err = refused(&v6.replace("[2001:2:0:1::2]:7100", "198.19.0.2:7100"));
        assert!(err.contains("peers[0].address"), "{err}");
        let err = refused(&format!(
            "{v6}\n[membership]\nbroadcast = \"198.19.0.255\"\n"
        ));
        assert!(err.contains("membership.broadcast"), "{err}");
    }

    #[test]
    fn parses_a_full_config_with_defaults() {
        let c = Config::parse(GOOD, Path::new("x.toml")).unwrap();
        assert_eq!(c.node, "node1");
        assert_eq!(c.criu_path, PathBuf::from(DEFAULT_CRIU_PATH));
        assert_eq!(
            c.criu_cache_dir,
            PathBuf::from(crate::criu::DEFAULT_CACHE_DIR)
        );
        assert_eq!(c.peer("node2").unwrap().address.port(), 7100);
        assert!(c.peer("node3").is_none());
        assert!(
            !c.membership.enabled && !c.balancer.enabled,
            "off by default"
        );
        let on = format!(
            "{GOOD}\n[membership]\nenabled = true\n[balancer]\nenabled = true\n[policy.transfer]\ncalm_down_ms = 5000\n"
        );
        let c = Config::parse(&on, Path::new("x.toml")).unwrap();
        assert!(c.membership.enabled && c.balancer.enabled);
        assert_eq!(c.policy.transfer.calm_down_ms, 5000);
    }

    #[test]
    fn names_the_bad_field() {
        let bad = GOOD.replace("name = \"node2\"", "name = \"node1\"");
        let err = Config::parse(&bad, Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("peers[0].name"), "{err}");
        let bad = GOOD.replace("address = \"198.18.0.100\"", "address = \"nope\"");
        let err = Config::parse(&bad, Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("address"), "{err}");
        let bad = GOOD.replace("node = \"node1\"", "node = \"no de\"");
        let err = Config::parse(&bad, Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("node"), "{err}");
        let bad = GOOD.replace(
            "work_dir = \"/run/ferry/work\"",
            "work_dir = \"/run/ferry/work\"\ncriu_cache_dir = \"kdat\"",
        );
        let err = Config::parse(&bad, Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("criu_cache_dir"), "{err}");
        let bad = format!("{GOOD}\n[policy.transfer]\nthreshold = -1.0\n");
        let err = Config::parse(&bad, Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("policy.transfer.threshold"), "{err}");
        let bad = format!("{GOOD}\n[balancer]\nperiod_ms = 0\n");
        let err = Config::parse(&bad, Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("balancer.period_ms"), "{err}");
        // Every transfer mode of the policy crate runs in ferryd, pulls too.
        for mode in ["receiver_initiated", "symmetric"] {
            let good = format!("{GOOD}\n[policy.transfer]\nmode = \"{mode}\"\n");
            Config::parse(&good, Path::new("x.toml")).unwrap();
        }
        for (bad, field) in [
            (
                "[migration]\ndowntime_budget_ms = 0\n",
                "migration.downtime_budget_ms",
            ),
            ("[migration]\nmax_rounds = 1001\n", "migration.max_rounds"),
            (
                "[migration]\nincoming_memory_limit_mib = 0\n",
                "migration.incoming_memory_limit_mib",
            ),
            ("[migration]\nstrategy = \"post-it\"\n", "strategy"),
        ] {
            let err = Config::parse(&format!("{GOOD}\n{bad}"), Path::new("t.toml"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{err}");
        }
        let good = format!("{GOOD}\n[migration]\nstrategy = \"queued-pre-copy\"\nmax_rounds = 5\n");
        let cfg = Config::parse(&good, Path::new("t.toml")).unwrap();
        assert_eq!(cfg.migration.strategy, MemoryStrategy::QueuedPreCopy);
        assert_eq!(cfg.migration.downtime_budget_ms, 30);
        let bad = format!("{GOOD}\n[metrics]\nlisten = \"198.19.0.1:7100\"\n");
        let err = Config::parse(&bad, Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("metrics.listen"), "{err}");
        let bad = format!("{GOOD}\n[metrics]\nlisten = \"198.19.0.1:0\"\n");
        let err = Config::parse(&bad, Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("metrics.listen"), "{err}");
        let bad = format!("{GOOD}\nbogus = 1\n");
        assert!(Config::parse(&bad, Path::new("x.toml")).is_err());
    }
}
