//! ferry: the command line of a ferry cluster, over the local agent's
//! Control API.

#![warn(clippy::too_many_lines)]

use std::path::PathBuf;
use std::process::ExitCode;

mod drain;
mod events;
mod follow;
mod progress;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use ferry_proto::v1::control_client::ControlClient;
use ferry_proto::v1::{
    self as pb, GetDataPlaneRequest, GetMigrationRequest, ListNodesRequest, ListProcessesRequest,
    MigrateRequest, MigrationReport, RunProcessRequest, migration_event,
};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, Parser)]
#[command(
    name = "ferry",
    version,
    about = "Live-migrate processes with their connections across a ferry cluster"
)]
struct Args {
    /// The local agent's control socket.
    #[arg(long, env = "FERRY_SOCKET", default_value = ferry_agent::config::DEFAULT_CONTROL_SOCKET, global = true)]
    socket: PathBuf,
    /// A remote agent's Control API on TCP ("198.19.0.1:7200") instead of
    /// the local socket; always over TLS, checked against `--ca`.
    #[arg(long, env = "FERRY_AGENT", global = true)]
    agent: Option<String>,
    /// With --agent: the node whose certificate the agent presents
    /// (default: the host part of --agent).
    #[arg(long, env = "FERRY_AGENT_NAME", global = true)]
    agent_name: Option<String>,
    /// With --agent: the cluster CA's certificate (`ferry cert ca`).
    #[arg(long, env = "FERRY_CA", global = true)]
    ca: Option<PathBuf>,
    /// With --agent: a client certificate and its key (`ferry cert
    /// client`), whose role decides what may be done.
    #[arg(long, env = "FERRY_CERT", global = true, requires = "key")]
    cert: Option<PathBuf>,
    #[arg(long, env = "FERRY_KEY", global = true, requires = "cert")]
    key: Option<PathBuf>,
    /// With --agent: a bearer token (`ferry cert token`) instead of a
    /// client certificate.
    #[arg(long, env = "FERRY_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
    /// The node a command is about, when not the agent's own: the agent
    /// forwards the call there (ps, run, migrate, report, dataplane,
    /// balancer, cancel, drain, cordon).
    #[arg(long, global = true, value_name = "NODE")]
    node: Option<String>,
    /// Machine-readable output (JSON).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The cluster's nodes and whether they answer.
    Nodes,
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
    Migrate {
        pid: i32,
        /// Destination node.
        #[arg(long)]
        to: String,
        /// How TCP connections move: "collective" (all in one batch, by
        /// ferryd), "incremental" (collective, with their addresses and
        /// options read before the freeze and a setsockopt watch saying
        /// which to read again) or "iterative" (CRIU's, one by one);
        /// default: the agent's `[migration] sockets`.
        #[arg(long, value_parser = ["collective", "incremental", "iterative"])]
        sockets: Option<String>,
        /// How memory moves: "total-copy" (all in the freeze), "pre-copy"
        /// or "queued-pre-copy" (rounds while the process runs),
        /// "post-copy" (the process resumes on the destination at once,
        /// its pages follow), "assisted-post-copy" (one live pass, then
        /// post-copy of what was written since); default: the agent's
        /// `[migration] strategy`.
        #[arg(long, value_parser = ["total-copy", "pre-copy", "queued-pre-copy", "post-copy", "assisted-post-copy"])]
        strategy: Option<String>,
        /// Pre-copy: freeze once the pages left would take at most this
        /// many milliseconds (default: `[migration] downtime_budget_ms`).
        #[arg(long)]
        downtime_budget_ms: Option<u32>,
        /// Pre-copy: the most rounds (default: `[migration] max_rounds`).
        #[arg(long)]
        max_rounds: Option<u32>,
        /// Pre-copy: slow the process down while it writes faster than
        /// its pages cross ("auto" or "off"; default: `[migration]
        /// throttle`).
        #[arg(long, value_parser = ["auto", "off"])]
        throttle: Option<String>,
        /// Drain before freeze: with the process stopped and its packets
        /// still flowing, wait at most this many ms for its TCP send queues
        /// to empty before its ports are cut off (at most 2000; default 0,
        /// off). Pays where queues are large against the link.
        #[arg(long)]
        drain_ms: Option<u32>,
    },
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
    /// The automatic load balancer: `show` (default), `on`, `off`, or
    /// `set KEY=VALUE...` with policy keys such as transfer.threshold=1.2.
    Balancer {
        #[command(subcommand)]
        action: Option<BalancerAction>,
    },
}

#[derive(Debug, Subcommand)]
enum CertCommand {
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
enum BalancerAction {
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

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ferry: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(main_exec(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Adds the bearer token, if any, to every call.
#[derive(Debug, Clone)]
struct BearerToken(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

type Client = ControlClient<tonic::service::interceptor::InterceptedService<Channel, BearerToken>>;

/// The local agent over its Unix socket, or a remote one over TLS.
async fn connect(args: &Args) -> Result<Client> {
    let Some(agent) = &args.agent else {
        return Ok(ControlClient::with_interceptor(
            connect_local(args.socket.clone()).await?,
            BearerToken(None),
        ));
    };
    let ca = args
        .ca
        .as_ref()
        .context("--agent needs --ca: the cluster CA's certificate")?;
    let name = match &args.agent_name {
        Some(n) => n.clone(),
        None => agent
            .rsplit_once(':')
            .map(|(h, _)| h.to_owned())
            .unwrap_or_else(|| agent.clone()),
    };
    let read = |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let mut tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(read(ca)?))
        .domain_name(name);
    if let (Some(cert), Some(key)) = (&args.cert, &args.key) {
        tls = tls.identity(tonic::transport::Identity::from_pem(
            read(cert)?,
            read(key)?,
        ));
    }
    let token = match &args.token {
        Some(t) => Some(
            format!("Bearer {t}")
                .parse()
                .context("--token: not a valid header value")?,
        ),
        None => None,
    };
    if args.cert.is_none() && token.is_none() {
        bail!("--agent needs credentials: --cert and --key, or --token");
    }
    let channel = Endpoint::from_shared(format!("https://{agent}"))
        .with_context(|| format!("--agent {agent:?}"))?
        .tls_config(tls)?
        .connect_timeout(std::time::Duration::from_secs(5))
        .connect()
        .await
        .with_context(|| format!("connecting to the agent at {agent}"))?;
    Ok(ControlClient::with_interceptor(channel, BearerToken(token)))
}

async fn connect_local(socket: PathBuf) -> Result<Channel> {
    let path = socket.clone();
    // The URI is required by the API but unused: the connector dials the
    // Unix socket.
    let channel = Endpoint::try_from("http://ferryd.local")?
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                tokio::net::UnixStream::connect(path)
                    .await
                    .map(TokioIo::new)
            }
        }))
        .await
        .with_context(|| {
            format!(
                "connecting to ferryd at {} (is it running? is this root?)",
                socket.display()
            )
        })?;
    Ok(channel)
}

/// "TERM", "SIGTERM" or "15" as a signal number.
fn signal_number(s: &str) -> Result<i32> {
    if let Ok(n) = s.parse::<i32>() {
        return Ok(n);
    }
    let name = s.to_ascii_uppercase();
    let name = if name.starts_with("SIG") {
        name
    } else {
        format!("SIG{name}")
    };
    name.parse::<nix::sys::signal::Signal>()
        .map(|s| s as i32)
        .map_err(|_| anyhow::anyhow!("--signal: {s:?} is not a signal name or number"))
}

pub(crate) fn status_error(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", s.code(), s.message())
}

/// `ferry cert ...`: files only, no agent.
fn cert(cmd: CertCommand, as_json: bool) -> Result<()> {
    use ferry_agent::security::Role;
    use ferry_agent::security::certs::{self, Ca};
    let role = |r: &str| Role::parse(r).context("--role: observer or operator");
    let mut written: Vec<PathBuf> = Vec::new();
    let mut config = String::new();
    match cmd {
        CertCommand::Ca {
            out,
            name,
            days,
            force,
        } => {
            written = Ca::generate(&name, days)?.write(&out, force)?;
            config = format!(
                "[tls]\nca = {:?}\nmembership_key = {:?}\n",
                out.join(certs::CA_CERT),
                out.join(certs::MEMBERSHIP_KEY)
            );
        }
        CertCommand::Node {
            name,
            ip,
            ca,
            out,
            days,
            force,
        } => {
            let (cert, key) = Ca::load(&ca)?
                .node(&name, &ip, days)?
                .write(&out, &name, force)?;
            config = format!("cert = {cert:?}\nkey = {key:?}\n");
            written.extend([cert, key]);
        }
        CertCommand::Client {
            role: r,
            name,
            ca,
            out,
            days,
            force,
        } => {
            let (cert, key) = Ca::load(&ca)?
                .client(&name, role(&r)?, days)?
                .write(&out, &name, force)?;
            written.extend([cert, key]);
        }
        CertCommand::Token { role: r, name } => {
            let role = role(&r)?;
            let (token, digest) = certs::new_token();
            if as_json {
                println!(
                    "{}",
                    json!({"name": name, "role": role.as_str(), "token": token, "sha256": digest})
                );
            } else {
                println!("token: {token}");
                println!(
                    "\n# for every node's ferryd.toml:\n[[tls.tokens]]\nname = {name:?}\nrole = \"{role}\"\nsha256 = \"{digest}\""
                );
            }
            return Ok(());
        }
    }
    if as_json {
        println!("{}", json!({ "written": written }));
    } else {
        for p in &written {
            println!("wrote {}", p.display());
        }
        if !config.is_empty() {
            println!("\n# for ferryd.toml:\n{config}");
        }
    }
    Ok(())
}

async fn main_exec(mut args: Args) -> Result<()> {
    // Taken out so that `args` stays whole for connect().
    let command = std::mem::replace(&mut args.command, Command::Nodes);
    let command = match command {
        Command::Cert(c) => return cert(c, args.json),
        c => c,
    };
    let mut client = connect(&args).await?;
    let node = args.node.clone().unwrap_or_default();
    match command {
        Command::Cert(_) => unreachable!("handled above"),
        Command::Nodes => {
            let nodes = client
                .list_nodes(ListNodesRequest {})
                .await
                .map_err(status_error)?
                .into_inner()
                .nodes;
            if args.json {
                let v: Vec<_> = nodes.iter().map(|n| json!({
                    "name": n.name, "peer_address": n.peer_address, "self": n.is_self,
                    "reachable": n.reachable, "peer_protocol_version": n.peer_protocol_version,
                    "managed_processes": n.managed_processes, "error": n.error,
                    "membership_state": n.membership_state, "load": if n.has_load { json!(n.load) } else { json!(null) },
                    "load_age_ms": n.load_age_ms, "candidate": n.candidate, "cordoned": n.cordoned,
                })).collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!(
                    "{:<16} {:<22} {:<10} {:<8} {:>7} {:>9} {:>9}  NOTE",
                    "NODE", "PEER ADDRESS", "STATE", "SWIM", "LOAD", "PROTOCOL", "MANAGED"
                );
                for n in nodes {
                    let state = if n.reachable { "up" } else { "down" };
                    let mut note = if n.is_self {
                        "this node".to_owned()
                    } else if n.candidate {
                        format!("balancer candidate {}", n.error)
                    } else {
                        n.error
                    };
                    if n.cordoned {
                        note = format!("cordoned; {note}");
                    }
                    let load = if n.has_load {
                        format!("{:.2}", n.load)
                    } else {
                        "-".into()
                    };
                    println!(
                        "{:<16} {:<22} {:<10} {:<8} {:>7} {:>9} {:>9}  {}",
                        n.name,
                        n.peer_address,
                        state,
                        n.membership_state,
                        load,
                        n.peer_protocol_version,
                        n.managed_processes,
                        note
                    );
                }
            }
        }
        Command::Ps { all } => {
            let r = client
                .list_processes(ListProcessesRequest {
                    node: node.clone(),
                    all_nodes: all,
                })
                .await
                .map_err(status_error)?
                .into_inner();
            if args.json {
                let v: Vec<_> = r.processes.iter().map(|p| json!({
                    "pid": p.pid, "argv": p.argv, "ports": p.ports.iter().map(port_str).collect::<Vec<_>>(),
                    "tcp_listening": p.tcp_listening, "tcp_established": p.tcp_established,
                    "udp_sockets": p.udp_sockets, "state": p.state, "origin": p.origin,
                    "port_conflicts": p.port_conflicts, "node": p.node,
                })).collect();
                println!(
                    "{}",
                    serde_json::to_string_pretty(
                        &json!({"node": r.node, "processes": v, "unreachable": r.unreachable})
                    )?
                );
            } else {
                println!(
                    "{:<12} {:>8} {:<10} {:<12} {:<18} {:>6} {:>6} {:>4}  COMMAND",
                    "NODE", "PID", "STATE", "ORIGIN", "PORTS", "LISTEN", "ESTAB", "UDP"
                );
                for p in r.processes {
                    let ports = p.ports.iter().map(port_str).collect::<Vec<_>>().join(",");
                    println!(
                        "{:<12} {:>8} {:<10} {:<12} {:<18} {:>6} {:>6} {:>4}  {}",
                        p.node,
                        p.pid,
                        p.state,
                        p.origin,
                        ports,
                        p.tcp_listening,
                        p.tcp_established,
                        p.udp_sockets,
                        p.argv.join(" ")
                    );
                    for c in &p.port_conflicts {
                        println!("{:>21} refused: {c}; its packets go there", "");
                    }
                }
                for u in &r.unreachable {
                    eprintln!("not listed: {u}");
                }
            }
        }
        Command::Run { argv, foreground } => {
            let signals = if foreground {
                Some(follow::Signals::catch()?)
            } else {
                None
            };
            let started = client
                .run_process(RunProcessRequest {
                    argv,
                    node: node.clone(),
                })
                .await
                .map_err(status_error)?
                .into_inner();
            if let Some(signals) = signals {
                let exit = follow::follow(&mut client, started.node, started.pid, signals).await?;
                follow::end_like(&exit);
            }
            if args.json {
                println!("{}", json!({ "pid": started.pid, "node": started.node }));
            } else {
                println!("{}", started.pid);
            }
        }
        Command::Adopt { pid, foreground } => {
            let signals = if foreground {
                Some(follow::Signals::catch()?)
            } else {
                None
            };
            let p = client
                .adopt_process(pb::AdoptProcessRequest {
                    pid,
                    node: node.clone(),
                })
                .await
                .map_err(status_error)?
                .into_inner();
            if let Some(signals) = signals {
                eprintln!("ferry: adopted PID {} on {}", p.pid, p.node);
                let exit = follow::follow(&mut client, p.node, p.pid, signals).await?;
                follow::end_like(&exit);
            }
            let ports = p.ports.iter().map(port_str).collect::<Vec<_>>();
            if args.json {
                println!(
                    "{}",
                    json!({ "pid": p.pid, "node": p.node, "argv": p.argv, "ports": ports })
                );
            } else {
                println!(
                    "adopted PID {} on {}: {} (ports: {})",
                    p.pid,
                    p.node,
                    p.argv.join(" "),
                    if ports.is_empty() {
                        "none".into()
                    } else {
                        ports.join(",")
                    }
                );
            }
        }
        Command::Wait { pid } => {
            let exit =
                follow::follow(&mut client, node.clone(), pid, follow::Signals::none()).await?;
            follow::end_like(&exit);
        }
        Command::Signal { pid, signal } => {
            let number = signal_number(&signal)?;
            let r = client
                .signal_process(pb::SignalProcessRequest {
                    pid,
                    signal: number,
                    node: node.clone(),
                })
                .await
                .map_err(status_error)?
                .into_inner();
            if !args.json {
                println!("signal {number} sent to PID {pid} on {}", r.node);
            }
        }
        Command::Migrate {
            pid,
            to,
            sockets,
            strategy,
            downtime_budget_ms,
            max_rounds,
            throttle,
            drain_ms,
        } => {
            let throttle = match throttle.as_deref() {
                Some("auto") => pb::PrecopyThrottle::Auto,
                Some("off") => pb::PrecopyThrottle::Off,
                _ => pb::PrecopyThrottle::Unspecified,
            };
            let sockets = sockets_arg(sockets.as_deref());
            let strategy = strategy_arg(strategy.as_deref());
            let mut stream = client
                .migrate(MigrateRequest {
                    pid,
                    destination_node: to,
                    strategy: strategy as i32,
                    sockets: sockets as i32,
                    downtime_budget_ms: downtime_budget_ms.unwrap_or(0),
                    max_rounds: max_rounds.unwrap_or(0),
                    throttle: throttle as i32,
                    source_node: node.clone(),
                    drain_send_queues_ms: drain_ms.unwrap_or(0),
                })
                .await
                .map_err(status_error)?
                .into_inner();
            let mut report = None;
            let mut progress = progress::Line::new(!args.json);
            loop {
                match stream.message().await {
                    Ok(Some(ev)) => match ev.event {
                        Some(migration_event::Event::Started(s)) => progress.note(&format!(
                            "migration {} of PID {}: {} -> {}",
                            s.migration_id, s.pid, s.source_node, s.destination_node
                        )),
                        Some(migration_event::Event::Progress(p)) => progress.phase(&p),
                        Some(migration_event::Event::Report(r)) => report = Some(r),
                        None => {}
                    },
                    Ok(None) => break,
                    Err(s) => {
                        progress.done();
                        if let Some(r) = &report {
                            print_report(r, args.json)?;
                        }
                        return Err(status_error(s));
                    }
                }
            }
            progress.done();
            match report {
                Some(r) => print_report(&r, args.json)?,
                None => bail!("the agent ended the migration stream without a report"),
            }
        }
        Command::Dataplane => {
            let d = client
                .get_data_plane(GetDataPlaneRequest { node: node.clone() })
                .await
                .map_err(status_error)?
                .into_inner();
            print_data_plane(&d, args.json)?;
        }
        Command::Balancer { action } => {
            let b = match action.unwrap_or(BalancerAction::Show) {
                BalancerAction::Show => {
                    client
                        .get_balancer(pb::GetBalancerRequest { node: node.clone() })
                        .await
                }
                BalancerAction::On => {
                    client
                        .set_balancer(pb::SetBalancerRequest {
                            enabled: Some(true),
                            settings: vec![],
                            node: node.clone(),
                        })
                        .await
                }
                BalancerAction::Off => {
                    client
                        .set_balancer(pb::SetBalancerRequest {
                            enabled: Some(false),
                            settings: vec![],
                            node: node.clone(),
                        })
                        .await
                }
                BalancerAction::Set { settings } => {
                    let mut parsed = Vec::new();
                    for s in settings {
                        let Some((k, v)) = s.split_once('=') else {
                            bail!("{s:?}: give KEY=VALUE, e.g. transfer.threshold=1.2");
                        };
                        parsed.push(pb::PolicySetting {
                            key: k.trim().to_owned(),
                            value: v.trim().to_owned(),
                        });
                    }
                    client
                        .set_balancer(pb::SetBalancerRequest {
                            enabled: None,
                            settings: parsed,
                            node: node.clone(),
                        })
                        .await
                }
            }
            .map_err(status_error)?
            .into_inner();
            print_balancer(&b, args.json)?;
        }
        Command::Report { migration_id } => {
            let r = client
                .get_migration(GetMigrationRequest {
                    migration_id,
                    node: node.clone(),
                })
                .await
                .map_err(status_error)?
                .into_inner();
            print_report(&r, args.json)?;
        }
        Command::Cancel { migration_id } => {
            let r = client
                .cancel_migration(pb::CancelMigrationRequest {
                    migration_id,
                    node: node.clone(),
                })
                .await
                .map_err(status_error)?
                .into_inner();
            print_report(&r, args.json)?;
        }
        Command::Cordon { off } => {
            let r = client
                .set_cordon(pb::SetCordonRequest {
                    node: node.clone(),
                    cordoned: !off,
                })
                .await
                .map_err(status_error)?
                .into_inner();
            if args.json {
                println!("{}", json!({"node": r.node, "cordoned": r.cordoned}));
            } else if r.cordoned {
                println!("{} is cordoned", r.node);
            } else {
                println!("{} takes work again", r.node);
            }
        }
        Command::Drain { cancel: true, .. } => {
            let f = client
                .cancel_drain(pb::CancelDrainRequest { node: node.clone() })
                .await
                .map_err(status_error)?
                .into_inner();
            if args.json {
                println!(
                    "{}",
                    json!({"node": f.node, "moved": f.moved, "remaining": f.remaining,
                           "cancelled_by": f.cancelled_by})
                );
            } else {
                println!(
                    "drain of {} stopped: {} moved, {} stay{}",
                    f.node,
                    f.moved,
                    f.remaining.len(),
                    if f.remaining.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", f.remaining.join("; "))
                    }
                );
            }
        }
        Command::Drain {
            strategy, sockets, ..
        } => {
            let stream = client
                .drain_node(pb::DrainNodeRequest {
                    node: node.clone(),
                    strategy: strategy_arg(strategy.as_deref()) as i32,
                    sockets: sockets_arg(sockets.as_deref()) as i32,
                    downtime_budget_ms: 0,
                })
                .await
                .map_err(status_error)?
                .into_inner();
            drain::follow(stream, args.json).await?;
        }
        Command::Events { this_node_only } => {
            let mut stream = client
                .watch_events(pb::WatchEventsRequest { this_node_only })
                .await
                .map_err(status_error)?
                .into_inner();
            while let Some(ev) = stream.message().await.map_err(status_error)? {
                if args.json {
                    println!("{}", events::to_json(&ev));
                } else {
                    println!("{}", events::line(&ev));
                }
            }
        }
    }
    Ok(())
}

fn print_balancer(b: &pb::Balancer, as_json: bool) -> Result<()> {
    let stats = b.stats.unwrap_or_default();
    if as_json {
        let v = json!({
            "node": b.node, "enabled": b.enabled, "local_load": b.local_load,
            "export_load": b.export_load, "cpus": b.cpus, "last_decision": b.last_decision,
            "calm_down_remaining_ms": b.calm_down_remaining_ms,
            "peers": b.peers.iter().map(|p| json!({"node": p.node, "load": p.load, "age_ms": p.age_ms})).collect::<Vec<_>>(),
            "processes": b.processes.iter().map(|p| json!({"pid": p.pid, "load": p.load, "resident_ms": p.resident_ms, "migratable": p.migratable, "argv": p.argv})).collect::<Vec<_>>(),
            "migrations": b.migrations.iter().map(|m| json!({
                "migration_id": m.migration_id, "source_pid": m.source_pid, "destination_pid": m.destination_pid,
                "argv": m.argv, "from": m.from_node, "to": m.to_node, "at_unix_ms": m.at_unix_ms,
                "committed": m.committed, "error": m.error,
            })).collect::<Vec<_>>(),
            "stats": {
                "ticks": stats.ticks, "offers_sent": stats.offers_sent, "offers_accepted": stats.offers_accepted,
                "offers_refused": stats.offers_refused, "offers_timed_out": stats.offers_timed_out,
                "migrations_committed": stats.migrations_committed, "migrations_aborted": stats.migrations_aborted,
                "incoming_accepted": stats.incoming_accepted, "incoming_refused": stats.incoming_refused,
                "gossip_received": stats.gossip_received, "gossip_stale_dropped": stats.gossip_stale_dropped,
                "gossip_future_dated": stats.gossip_future_dated,
            },
            "policy_toml": b.policy_toml,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "balancer of {}: {}",
        b.node,
        if b.enabled { "on" } else { "off" }
    );
    println!(
        "  load {:.2} (export {:.2}) on {} CPUs; last turn: {}",
        b.local_load, b.export_load, b.cpus, b.last_decision
    );
    if b.calm_down_remaining_ms > 0 {
        println!("  calming down for {} ms more", b.calm_down_remaining_ms);
    }
    println!(
        "  offers {} sent, {} accepted, {} refused, {} timed out; migrations {} committed, {} aborted; incoming {} accepted, {} refused",
        stats.offers_sent,
        stats.offers_accepted,
        stats.offers_refused,
        stats.offers_timed_out,
        stats.migrations_committed,
        stats.migrations_aborted,
        stats.incoming_accepted,
        stats.incoming_refused
    );
    println!("peers (export load as believed here):");
    for p in &b.peers {
        println!("  {:<16} {:>8.2}  {:>6} ms old", p.node, p.load, p.age_ms);
    }
    println!("processes:");
    for p in &b.processes {
        println!(
            "  {:>8} {:>8.2}  resident {:>8} ms{}  {}",
            p.pid,
            p.load,
            p.resident_ms,
            if p.migratable { "" } else { " (moving)" },
            p.argv.join(" ")
        );
    }
    if !b.migrations.is_empty() {
        println!("migrations started here:");
        for m in &b.migrations {
            println!(
                "  PID {} -> {} PID {}  {}{}",
                m.source_pid,
                m.to_node,
                m.destination_pid,
                if m.committed { "committed" } else { "aborted" },
                if m.error.is_empty() {
                    String::new()
                } else {
                    format!(": {}", m.error)
                }
            );
        }
    }
    println!("policy:");
    for line in b.policy_toml.lines() {
        println!("  {line}");
    }
    Ok(())
}

fn port_str(p: &pb::Port) -> String {
    let proto = match pb::Protocol::try_from(p.protocol) {
        Ok(pb::Protocol::Tcp) => "tcp",
        Ok(pb::Protocol::Udp) => "udp",
        _ => "?",
    };
    format!("{}/{}", p.port, proto)
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

fn print_report(r: &MigrationReport, as_json: bool) -> Result<()> {
    let outcome = match pb::MigrationOutcome::try_from(r.outcome) {
        Ok(pb::MigrationOutcome::Committed) => "committed",
        Ok(pb::MigrationOutcome::Aborted) => "aborted",
        Ok(pb::MigrationOutcome::Lost) => "lost",
        _ => "unknown",
    };
    let sockets = match pb::SocketMigration::try_from(r.sockets) {
        Ok(pb::SocketMigration::Collective) => "collective",
        Ok(pb::SocketMigration::Iterative) => "iterative",
        Ok(pb::SocketMigration::Incremental) => "incremental",
        _ => "unknown",
    };
    let strategy = match pb::Strategy::try_from(r.strategy) {
        Ok(pb::Strategy::TotalCopy) => "total-copy",
        Ok(pb::Strategy::PreCopy) => "pre-copy",
        Ok(pb::Strategy::QueuedPreCopy) => "queued-pre-copy",
        Ok(pb::Strategy::PostCopy) => "post-copy",
        Ok(pb::Strategy::AssistedPostCopy) => "assisted-post-copy",
        _ => "unknown",
    };
    if as_json {
        let mut v = json!({
            "migration_id": r.migration_id, "outcome": outcome, "error": r.error,
            "strategy": strategy, "source_node": r.source_node, "destination_node": r.destination_node,
            "source_pid": r.source_pid, "destination_pid": r.destination_pid,
            "preparation_time_ms": ms(r.preparation_time_us), "freeze_time_ms": ms(r.freeze_time_us),
            "post_processing_time_ms": ms(r.post_processing_time_us), "total_time_ms": ms(r.total_time_us),
            "image_bytes": r.image_bytes, "image_files": r.image_files, "bytes_transferred": r.bytes_transferred,
            "tcp_established": r.tcp_established, "tcp_listening": r.tcp_listening, "udp_sockets": r.udp_sockets,
            "ports": r.ports.iter().map(port_str).collect::<Vec<_>>(),
            "phases": r.phases.iter().map(|p| json!({"phase": p.phase, "ms": ms(p.duration_us)})).collect::<Vec<_>>(),
            "freeze_parts": r.freeze_parts.iter().map(|p| json!({"part": p.phase, "ms": ms(p.duration_us)})).collect::<Vec<_>>(),
            "resumed_on_source": r.resumed_on_source, "started_at_unix_ms": r.started_at_unix_ms,
            "capture": r.capture,
            "memory_tracking": r.memory_tracking, "convergence": r.convergence,
            "throttled_to_percent": r.throttled_to_percent,
            "dumped_pages": r.dumped_pages, "freeze_pages": r.freeze_pages, "precopied_pages": r.precopied_pages,
            "postcopy_pages": r.postcopy_pages,
            "rounds": r.rounds.iter().map(|x| json!({
                "round": x.round, "written_pages": x.written_pages, "sent_pages": x.sent_pages,
                "sent_bytes": x.sent_bytes, "delayed_pages": x.delayed_pages, "ms": ms(x.duration_us),
            })).collect::<Vec<_>>(),
            "socket_migration": sockets, "socket_migration_note": r.sockets_note,
            "replay": r.replay.as_ref().map(|s| json!({
                "captured": s.captured, "replayed": s.replayed,
                "skipped_delivered": s.skipped_delivered, "failed": s.failed,
                "replay_time_ms": ms(s.replay_time_us),
            })),
        });
        // Apart: one more field in the literal above is past json!'s
        // recursion limit.
        v["connections_preread"] = json!(r.connections_preread);
        v["connections_read_in_freeze"] = json!(r.connections_read_in_freeze);
        v["connections_staged"] = json!(r.connections_staged);
        v["drain_time_ms"] = json!(ms(r.drain_time_us));
        v["drain_bytes_at_start"] = json!(r.drain_bytes_at_start);
        v["drain_bytes_left"] = json!(r.drain_bytes_left);
        if let Some(s) = &r.replay {
            v["replay"]["carried"] = json!(s.carried);
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("migration {}  {}", r.migration_id, outcome);
    println!(
        "  {} PID {} -> {} PID {}",
        r.source_node, r.source_pid, r.destination_node, r.destination_pid
    );
    println!("  strategy            {strategy}");
    if !r.rounds.is_empty() {
        println!(
            "  preparation time    {:>10.1} ms  ({} rounds, {}; dirty pages by {})",
            ms(r.preparation_time_us),
            r.rounds.len(),
            r.convergence,
            r.memory_tracking
        );
        for x in &r.rounds {
            println!(
                "    round {:>3}  {:>8} written  {:>8} sent  {:>8} delayed  {:>8.1} ms",
                x.round,
                x.written_pages,
                x.sent_pages,
                x.delayed_pages,
                ms(x.duration_us)
            );
        }
        println!(
            "  pages in freeze     {} of {} dumped ({} pre-copied)",
            r.freeze_pages, r.dumped_pages, r.precopied_pages
        );
    }
    println!("  freeze time         {:>10.1} ms", ms(r.freeze_time_us));
    if r.strategy == pb::Strategy::PostCopy as i32
        || r.strategy == pb::Strategy::AssistedPostCopy as i32
    {
        println!(
            "  post-processing     {:>10.1} ms  ({} pages after the resume, {} of them from the live pass)",
            ms(r.post_processing_time_us),
            r.postcopy_pages,
            r.postcopy_local_pages
        );
        println!(
            "  delay after resume  {:>10.1} ms  ({} page faults waited for)",
            ms(r.postcopy_fault_wait_us),
            r.postcopy_faults
        );
    }
    println!("  total time          {:>10.1} ms", ms(r.total_time_us));
    println!(
        "  bytes transferred   {:>10}  ({} image files)",
        r.bytes_transferred, r.image_files
    );
    println!(
        "  sockets             {} established, {} listening, {} UDP; ports {}",
        r.tcp_established,
        r.tcp_listening,
        r.udp_sockets,
        r.ports.iter().map(port_str).collect::<Vec<_>>().join(",")
    );
    println!("  socket migration    {sockets}");
    if r.sockets == pb::SocketMigration::Incremental as i32 {
        println!(
            "                      {} connections read before the freeze, {} read whole in it, \
             {} rebuilt on sockets opened before it",
            r.connections_preread, r.connections_read_in_freeze, r.connections_staged
        );
    }
    if !r.sockets_note.is_empty() {
        println!("                      ({})", r.sockets_note);
    }
    if r.drain_time_us > 0 || r.drain_bytes_at_start > 0 {
        println!(
            "  drain before freeze {:>10.1} ms  ({} bytes queued, {} left)",
            ms(r.drain_time_us),
            r.drain_bytes_at_start,
            r.drain_bytes_left
        );
    }
    match (&r.replay, r.capture) {
        (Some(s), _) => println!(
            "  packets in freeze   {} captured, {} replayed, {} already delivered, {} failed ({:.1} ms); {} unread UDP datagrams carried",
            s.captured,
            s.replayed,
            s.skipped_delivered,
            s.failed,
            ms(s.replay_time_us),
            s.carried
        ),
        (None, false) => println!("  packets in freeze   dropped (capture off)"),
        (None, true) => {}
    }
    println!("  phases:");
    for p in &r.phases {
        println!("    {:<10} {:>10.1} ms", p.phase, ms(p.duration_us));
    }
    if !r.freeze_parts.is_empty() {
        println!("  the freeze, part by part:");
        for p in &r.freeze_parts {
            println!("    {:<30} {:>10.1} ms", p.phase, ms(p.duration_us));
        }
    }
    if !r.error.is_empty() {
        println!("  error: {}", r.error);
        if r.resumed_on_source {
            println!("  the process was resumed on {}", r.source_node);
        }
        if r.outcome == pb::MigrationOutcome::Lost as i32 {
            println!("  the process runs nowhere: post-copy could not complete its memory");
        }
    }
    Ok(())
}

fn print_data_plane(d: &pb::DataPlane, as_json: bool) -> Result<()> {
    let c = d.counters.unwrap_or_default();
    let rows = [
        ("passed", c.passed, "to owned ports, delivered"),
        (
            "dropped_not_owned",
            c.dropped_not_owned,
            "to other nodes' ports",
        ),
        (
            "dropped_frozen",
            c.dropped_frozen,
            "to frozen ports, not captured",
        ),
        (
            "passed_other",
            c.passed_other,
            "ARP, ICMP, IPv6, later fragments",
        ),
        ("egress_blocked", c.egress_blocked, "from frozen ports"),
        ("captured", c.captured, "kept while a process moved"),
        ("capture_lost", c.capture_lost, "capture ring full"),
        (
            "recorded",
            c.recorded,
            "delivered and logged before a freeze",
        ),
        ("replayed", c.replayed, "captured, then replayed here"),
        (
            "skipped_delivered",
            c.skipped_delivered,
            "captured, delivered on the source",
        ),
        ("replay_failed", c.replay_failed, "captured, replay failed"),
        ("translated", c.translated, "in-cluster packets rewritten"),
        ("held", c.held, "in-cluster packets held until a commit"),
    ];
    let ports: Vec<(String, &str)> = d
        .ports
        .iter()
        .map(|p| {
            (
                p.port.as_ref().map(port_str).unwrap_or_default(),
                p.state.as_str(),
            )
        })
        .collect();
    if as_json {
        let mut counters = serde_json::Map::new();
        for (name, v, _) in rows {
            counters.insert(name.to_owned(), json!(v));
        }
        let v = json!({
            "node": d.node, "interface": d.interface, "counters": counters,
            "ports": ports.iter().map(|(p, s)| json!({"port": p, "state": s})).collect::<Vec<_>>(),
            "cluster_interface": d.cluster_interface, "translations": d.translations,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("data plane of {} on {}", d.node, d.interface);
    for (name, v, what) in rows {
        println!("  {name:<18} {v:>12}  {what}");
    }
    println!("ports:");
    if ports.is_empty() {
        println!("  (none)");
    }
    for (p, s) in ports {
        println!("  {p:<12} {s}");
    }
    println!("in-cluster rules on {}:", d.cluster_interface);
    if d.translations.is_empty() {
        println!("  (none)");
    }
    for t in &d.translations {
        println!("  {t}");
    }
    Ok(())
}

fn strategy_arg(s: Option<&str>) -> pb::Strategy {
    match s {
        Some("total-copy") => pb::Strategy::TotalCopy,
        Some("pre-copy") => pb::Strategy::PreCopy,
        Some("queued-pre-copy") => pb::Strategy::QueuedPreCopy,
        Some("post-copy") => pb::Strategy::PostCopy,
        Some("assisted-post-copy") => pb::Strategy::AssistedPostCopy,
        _ => pb::Strategy::Unspecified,
    }
}

fn sockets_arg(s: Option<&str>) -> pb::SocketMigration {
    match s {
        Some("collective") => pb::SocketMigration::Collective,
        Some("incremental") => pb::SocketMigration::Incremental,
        Some("iterative") => pb::SocketMigration::Iterative,
        _ => pb::SocketMigration::Unspecified,
    }
}
