//! The command line: global options, commands and their flags (clap), and
//! the flags' values as the API's enums.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use ferry_proto::v1 as pb;

#[derive(Debug, Parser)]
#[command(
    name = "ferry",
    version,
    about = "Live-migrate processes with their connections across a ferry cluster"
)]
pub(crate) struct Args {
    /// The local agent's control socket.
    #[arg(long, env = "FERRY_SOCKET", default_value = ferry_agent::config::DEFAULT_CONTROL_SOCKET, global = true)]
    pub(crate) socket: PathBuf,
    /// A remote agent's Control API on TCP ("198.19.0.1:7200") instead of
    /// the local socket; always over TLS, checked against `--ca`.
    #[arg(long, env = "FERRY_AGENT", global = true)]
    pub(crate) agent: Option<String>,
    /// With --agent: the node whose certificate the agent presents
    /// (default: the host part of --agent).
    #[arg(long, env = "FERRY_AGENT_NAME", global = true)]
    pub(crate) agent_name: Option<String>,
    /// With --agent: the cluster CA's certificate (`ferry cert ca`).
    #[arg(long, env = "FERRY_CA", global = true)]
    pub(crate) ca: Option<PathBuf>,
    /// With --agent: a client certificate and its key (`ferry cert
    /// client`), whose role decides what may be done.
    #[arg(long, env = "FERRY_CERT", global = true, requires = "key")]
    pub(crate) cert: Option<PathBuf>,
    #[arg(long, env = "FERRY_KEY", global = true, requires = "cert")]
    pub(crate) key: Option<PathBuf>,
    /// With --agent: a bearer token (`ferry cert token`) instead of a
    /// client certificate.
    #[arg(long, env = "FERRY_TOKEN", global = true, hide_env_values = true)]
    pub(crate) token: Option<String>,
    /// The node a command is about, when not the agent's own: the agent
    /// forwards the call there (ps, run, migrate, report, dataplane,
    /// balancer, cancel, drain, cordon).
    #[arg(long, global = true, value_name = "NODE")]
    pub(crate) node: Option<String>,
    /// Machine-readable output (JSON).
    #[arg(long, global = true)]
    pub(crate) json: bool,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// The cluster's nodes, whether they answer, their kernels and the
    /// kernel features each lacks.
    Nodes {
        /// Every feature of every node, present or not (`ferryd --check`
        /// on each).
        #[arg(long)]
        features: bool,
    },
    /// Processes managed by this node (or --node's), with their ports and
    /// connections.
    Ps {
        /// Every node's processes.
        #[arg(long)]
        all: bool,
    },
    /// Start a command under ferry's management on this node.
    Run {
        /// Stay with the process until it ends, wherever it moves: pass on
        /// SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1/2, and exit as it did
        /// (for a systemd unit's ExecStart=).
        #[arg(long)]
        foreground: bool,
        /// Give it an IPC namespace of its own, so that its System V
        /// shared memory, semaphores and message queues move with it
        /// (PostgreSQL needs it); each freeze then costs ~2 ms more.
        #[arg(long)]
        ipc_namespace: bool,
        /// Run it as this user (name or uid) with the user's groups,
        /// instead of ferryd's.
        #[arg(long)]
        user: Option<String>,
        #[arg(trailing_var_arg = true, required = true, value_name = "CMD")]
        argv: Vec<String>,
    },
    /// Put a running process under management: it must be the init of its
    /// own PID namespace and lead its session (`unshare --pid --fork
    /// setsid CMD`), with no terminal and no pipe to a process outside.
    Adopt {
        pid: i32,
        /// Then stay with it as `run --foreground` does.
        #[arg(long)]
        foreground: bool,
    },
    /// Wait for a managed process to end, wherever it moves; exit as it
    /// did.
    Wait { pid: i32 },
    /// Send a signal to a managed process, on the node that manages it.
    Signal {
        pid: i32,
        /// A name (TERM, SIGHUP) or a number.
        #[arg(long, short = 's', default_value = "TERM")]
        signal: String,
    },
    /// Migrate a managed process to another node.
    Migrate(MigrateArgs),
    /// The report of a migration that ran from this node.
    Report { migration_id: String },
    /// Stop a migration before the destination restores the process: it
    /// rolls back and the process runs on at the source.
    Cancel { migration_id: String },
    /// Empty this node (or --node) for maintenance: cordon it, then move
    /// its processes one by one to the least loaded other nodes.
    Drain {
        /// Stop the drain running on the node instead: no further process
        /// moves, the migration under way rolls back; it stays cordoned.
        #[arg(long, conflicts_with_all = ["strategy", "sockets"])]
        cancel: bool,
        /// How memory moves (as for migrate).
        #[arg(long, value_parser = ["total-copy", "pre-copy", "queued-pre-copy", "post-copy", "assisted-post-copy"])]
        strategy: Option<String>,
        /// How TCP connections move (as for migrate).
        #[arg(long, value_parser = ["collective", "incremental", "iterative"])]
        sockets: Option<String>,
    },
    /// Cordon this node (or --node): it takes no incoming migration,
    /// balancer offer or new process; `--off` lifts it.
    Cordon {
        #[arg(long)]
        off: bool,
    },
    /// Hand one connection of a distributed server's group from the node
    /// serving it (this node, or --node) to another member's server.
    Handoff {
        /// The group's port.
        #[arg(long)]
        port: u16,
        /// The client's end of the connection, ADDRESS:PORT.
        #[arg(long)]
        remote: String,
        /// The member that takes it.
        #[arg(long)]
        to: String,
        /// First wait up to this long for the client to acknowledge
        /// everything sent.
        #[arg(long, default_value_t = 0)]
        drain_ms: u32,
    },
    /// Distributed servers: a port of the cluster's address served by a
    /// group of nodes, connections handed between them one by one.
    Group {
        #[command(subcommand)]
        action: GroupAction,
    },
    /// Follow the cluster's events: migrations, membership, balancer
    /// decisions, cordons and drains (Ctrl-C ends).
    Events {
        /// Only the agent's own node's events.
        #[arg(long)]
        this_node_only: bool,
    },
    /// This node's data plane: packet counters and port states.
    #[command(visible_alias = "dp")]
    Dataplane,
    /// Make the cluster's CA, node and client certificates and tokens
    /// (no agent needed; every file is written mode 0600).
    #[command(subcommand)]
    Cert(CertCommand),
    /// Writes this node's ferryd.toml from what differs between nodes
    /// (docs/deploy.md): its name, interfaces, addresses, peers and
    /// certificates; checked as ferryd reads it.
    Init(InitArgs),
    /// The automatic load balancer: `show` (default), `on`, `off`, or
    /// `set KEY=VALUE...` with policy keys such as transfer.threshold=1.2.
    Balancer {
        #[command(subcommand)]
        action: Option<BalancerAction>,
    },
}

/// `ferry init`'s arguments.
#[derive(Debug, clap::Args)]
pub(crate) struct InitArgs {
    /// This node's name (unique in the cluster).
    #[arg(long)]
    pub(crate) node: String,
    /// The interface on the clients' segment.
    #[arg(long, value_name = "IFACE")]
    pub(crate) public_interface: String,
    /// The cluster's shared address (the same on every node), IPv4 or
    /// IPv6.
    #[arg(long, value_name = "ADDRESS")]
    pub(crate) public_address: std::net::IpAddr,
    /// A dual-stack cluster's shared IPv6 address, beside an IPv4
    /// --public-address.
    #[arg(long, value_name = "ADDRESS")]
    pub(crate) public_address6: Option<std::net::Ipv6Addr>,
    /// The interface on the cluster network.
    #[arg(long, value_name = "IFACE")]
    pub(crate) cluster_interface: String,
    /// This node's own address on the cluster network.
    #[arg(long, value_name = "ADDRESS")]
    pub(crate) cluster_address: std::net::IpAddr,
    /// Another node, NAME=ADDRESS[:PORT] (its cluster address); repeat
    /// for each.
    #[arg(long = "peer", value_name = "NAME=ADDRESS[:PORT]")]
    pub(crate) peers: Vec<String>,
    /// The Peer API's port (every node's).
    #[arg(long, default_value_t = 7100)]
    pub(crate) peer_port: u16,
    /// The certificates' directory: ca.crt, membership.key, NODE.crt and
    /// NODE.key (`ferry cert ca` and `ferry cert node`).
    #[arg(long, value_name = "DIR", required_unless_present = "no_tls")]
    pub(crate) tls_dir: Option<PathBuf>,
    /// No [tls]: agents talk in plaintext, unauthenticated (a test
    /// network only).
    #[arg(long, conflicts_with = "tls_dir")]
    pub(crate) no_tls: bool,
    #[arg(long, default_value = "/var/lib/ferry")]
    pub(crate) work_dir: PathBuf,
    #[arg(long, default_value = "/opt/ferry/criu/bin/criu")]
    pub(crate) criu: PathBuf,
    #[arg(long, default_value = "/run/ferry/control.sock")]
    pub(crate) control_socket: PathBuf,
    /// Where to write it ("-": standard output).
    #[arg(long, default_value = "/etc/ferry/ferryd.toml")]
    pub(crate) out: PathBuf,
    /// Replace an existing file.
    #[arg(long)]
    pub(crate) force: bool,
}

/// `ferry migrate`'s arguments, in a struct of their own so that they pass
/// to the command's function as one value.
#[derive(Debug, clap::Args)]
pub(crate) struct MigrateArgs {
    pub(crate) pid: i32,
    /// Destination node.
    #[arg(long)]
    pub(crate) to: String,
    /// How TCP connections move: "collective" (all in one batch, by
    /// ferryd), "incremental" (collective, with their addresses and
    /// options read before the freeze and a setsockopt watch saying
    /// which to read again) or "iterative" (CRIU's, one by one);
    /// default: the agent's `[migration] sockets`.
    #[arg(long, value_parser = ["collective", "incremental", "iterative"])]
    pub(crate) sockets: Option<String>,
    /// How memory moves: "total-copy" (all in the freeze), "pre-copy"
    /// or "queued-pre-copy" (rounds while the process runs),
    /// "post-copy" (the process resumes on the destination at once,
    /// its pages follow), "assisted-post-copy" (one live pass, then
    /// post-copy of what was written since); default: the agent's
    /// `[migration] strategy`.
    #[arg(long, value_parser = ["total-copy", "pre-copy", "queued-pre-copy", "post-copy", "assisted-post-copy"])]
    pub(crate) strategy: Option<String>,
    /// Pre-copy: freeze once the pages left would take at most this
    /// many milliseconds (default: `[migration] downtime_budget_ms`).
    #[arg(long)]
    pub(crate) downtime_budget_ms: Option<u32>,
    /// Pre-copy: the most rounds (default: `[migration] max_rounds`).
    #[arg(long)]
    pub(crate) max_rounds: Option<u32>,
    /// Pre-copy: slow the process down while it writes faster than
    /// its pages cross ("auto" or "off"; default: `[migration]
    /// throttle`).
    #[arg(long, value_parser = ["auto", "off"])]
    pub(crate) throttle: Option<String>,
    /// Drain before freeze: with the process stopped and its packets
    /// still flowing, wait at most this many ms for its TCP send queues
    /// to empty before its ports are cut off (at most 2000; default 0,
    /// off). Pays where queues are large against the link.
    #[arg(long)]
    pub(crate) drain_ms: Option<u32>,
}

#[derive(Debug, Subcommand)]
pub(crate) enum CertCommand {
    /// A new cluster CA: DIR/ca.crt, DIR/ca.key (keep it off the nodes) and
    /// DIR/membership.key (every node's `[tls] membership_key`).
    Ca {
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// The cluster's name, in the CA's common name.
        #[arg(long, default_value = "cluster")]
        name: String,
        #[arg(long, default_value_t = 3650)]
        days: u32,
        /// Replace existing files.
        #[arg(long)]
        force: bool,
    },
    /// A node's certificate: OUT/NAME.crt and OUT/NAME.key, for its
    /// `[tls] cert` and `key`.
    Node {
        /// The node's name, as in its `node =`.
        #[arg(long)]
        name: String,
        /// Its addresses (cluster, control_listen), for clients that dial
        /// an address; repeat or separate with commas.
        #[arg(long, value_delimiter = ',')]
        ip: Vec<std::net::IpAddr>,
        /// The CA directory (`ferry cert ca --out`).
        #[arg(long, value_name = "DIR")]
        ca: PathBuf,
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        #[arg(long, default_value_t = 825)]
        days: u32,
        #[arg(long)]
        force: bool,
    },
    /// A Control API client's certificate with a role: OUT/NAME.crt and
    /// OUT/NAME.key.
    Client {
        #[arg(long, value_parser = ["observer", "operator"])]
        role: String,
        /// Who holds it (its common name, in the agents' logs).
        #[arg(long)]
        name: String,
        #[arg(long, value_name = "DIR")]
        ca: PathBuf,
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        #[arg(long, default_value_t = 825)]
        days: u32,
        #[arg(long)]
        force: bool,
    },
    /// A Control API bearer token: prints the token (give it to the
    /// client) and the `[[tls.tokens]]` entry (for every node's config).
    Token {
        #[arg(long, value_parser = ["observer", "operator"])]
        role: String,
        #[arg(long)]
        name: String,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum GroupAction {
    /// Create a group: every member (the contact node included) joins it,
    /// or none does.
    Create {
        /// The TCP port of the cluster's address the group serves.
        #[arg(long)]
        port: u16,
        /// The node that takes new connections.
        #[arg(long)]
        contact: String,
        /// The nodes that take over from the contact node, in order
        /// (repeat, or comma-separated).
        #[arg(long = "backup", value_delimiter = ',')]
        backups: Vec<String>,
        /// The other members (repeat, or comma-separated).
        #[arg(long = "member", value_delimiter = ',')]
        members: Vec<String>,
        /// How new connections are placed on the members (`ferry_place`).
        #[arg(long, value_parser = ["round-robin", "least-connections"], default_value = "round-robin")]
        placement: String,
    },
    /// The groups as the agent's node sees them: members and roles, its
    /// server processes, and the connections it decides one by one with
    /// who serves each.
    List,
    /// Delete the group on a port on every member.
    Delete {
        #[arg(long)]
        port: u16,
    },
    /// A node joins a running group (the contact node commits the new
    /// view with its backups).
    Add {
        #[arg(long)]
        port: u16,
        /// The node that joins.
        #[arg(long = "member", value_name = "NODE")]
        node: String,
        /// Also as a backup, after the last one.
        #[arg(long)]
        backup: bool,
    },
    /// A node leaves a running group (refused while it serves connections:
    /// hand them off first).
    Remove {
        #[arg(long)]
        port: u16,
        /// The node that leaves.
        #[arg(long = "member", value_name = "NODE")]
        node: String,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum BalancerAction {
    /// Loads, candidates, decisions and migrations as this node sees them.
    Show,
    On,
    Off,
    /// Change policy values: `ferry balancer set transfer.average_gap=0.3 transfer.calm_down_ms=5000`.
    Set {
        #[arg(required = true, value_name = "KEY=VALUE")]
        settings: Vec<String>,
    },
}

pub(crate) fn strategy_arg(s: Option<&str>) -> pb::Strategy {
    match s {
        Some("total-copy") => pb::Strategy::TotalCopy,
        Some("pre-copy") => pb::Strategy::PreCopy,
        Some("queued-pre-copy") => pb::Strategy::QueuedPreCopy,
        Some("post-copy") => pb::Strategy::PostCopy,
        Some("assisted-post-copy") => pb::Strategy::AssistedPostCopy,
        _ => pb::Strategy::Unspecified,
    }
}

pub(crate) fn sockets_arg(s: Option<&str>) -> pb::SocketMigration {
    match s {
        Some("collective") => pb::SocketMigration::Collective,
        Some("incremental") => pb::SocketMigration::Incremental,
        Some("iterative") => pb::SocketMigration::Iterative,
        _ => pb::SocketMigration::Unspecified,
    }
}
