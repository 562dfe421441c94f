//! ferryd: the ferry agent of one node.

#![warn(clippy::too_many_lines)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use ferry_agent::api::{ControlService, PeerService, control_routes};
use ferry_agent::config::Config;
use ferry_agent::dataplane::filter::EbpfPortFilter;
use ferry_agent::error_chain::error_chain;
use ferry_agent::node::{Node, NodeParts};
use ferry_agent::security::authz::AuthLayer;
use ferry_proto::v1::balance_server::BalanceServer;
use ferry_proto::v1::control_server::ControlServer;
use ferry_proto::v1::peer_server::PeerServer;
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

/// `--version`: the build profile too, which benchmarks state with their
/// figures (optimised or not changes them several-fold).
#[cfg(debug_assertions)]
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (debug build)");
#[cfg(not(debug_assertions))]
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (release build)");

#[derive(Debug, Parser)]
#[command(
    name = "ferryd",
    version = VERSION,
    about = "The ferry agent: live migration of processes with their connections"
)]
struct Args {
    /// Configuration file (TOML).
    #[arg(long, short, default_value = "/etc/ferry/ferryd.toml")]
    config: PathBuf,
    /// Check a configuration file (default: the --config one) and the CRIU
    /// it names, print what ferryd would run with, and exit: 0 if it is
    /// valid, 1 with the offending field named if not.
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    check_config: Option<Option<PathBuf>>,
    /// Probe what this host's kernel and this agent's privileges offer
    /// ferry (userfaultfd write-protect, PAGEMAP_SCAN, BPF iterators,
    /// capabilities, ...), print it with what ferry does without each,
    /// and exit: 0 if ferryd can run here, 1 if not. With the --config
    /// file there (the default one or another), its `features_off` count
    /// as missing, as they do for the agent.
    #[arg(long)]
    check: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Installs a restored process's pre-copied pages from the page store
    /// (ferryd starts it for a migration, with its control socket at
    /// descriptor 3, over which the stores and the plan come; not for use
    /// by hand).
    Fill {
        /// Where the filler logs.
        #[arg(long)]
        log: PathBuf,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(Command::Fill { log }) = &args.command {
        return fill(log);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match main_exec(args) {
        Ok(()) => ExitCode::SUCCESS,
        // Said once, on stderr (the log's stream too, so not logged as
        // well), each cause once: a parse error's own text already holds
        // its source's.
        Err(e) => {
            eprintln!("ferryd: {}", error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// `ferryd fill`: logs to its own file (its stderr is /dev/null), exits 0
/// once every page is in.
fn fill(log: &Path) -> ExitCode {
    match std::fs::File::create(log) {
        Ok(file) => tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "info".into()),
            )
            .with_ansi(false)
            .with_writer(std::sync::Mutex::new(file))
            .init(),
        Err(e) => eprintln!("ferryd fill: {}: {e}", log.display()),
    }
    match ferry_agent::fill::filler::main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

fn main_exec(args: Args) -> Result<()> {
    if args.check {
        let features_off = if args.config.exists() {
            Config::load(&args.config)?.features_off
        } else {
            Vec::new()
        };
        let host = ferry_agent::host_features::host(&features_off);
        if !features_off.is_empty() {
            println!(
                "features_off in {}: {}",
                args.config.display(),
                features_off.join(", ")
            );
        }
        print!("{}", host.table());
        if !host.runnable() {
            anyhow::bail!("this host lacks what ferryd needs to run (the NO lines above)");
        }
        return Ok(());
    }
    if let Some(file) = args.check_config {
        return check_config(file.as_deref().unwrap_or(&args.config));
    }
    let config = Config::load(&args.config)?;
    // What ferryd cannot do without (BTF, the privileges of its eBPF
    // programs), refused before anything is touched, naming it; the
    // answers stay cached for the migrations (`host_features::host`).
    let host = ferry_agent::host_features::host(&config.features_off);
    if !host.runnable() {
        let missing: Vec<String> = host
            .missing()
            .filter(|f| f.required)
            .map(|f| format!("{} [{}] ({})", f.name, f.key, f.without))
            .collect();
        anyhow::bail!(
            "this host lacks what ferryd needs to run (kernel {}): {}; `ferryd --check` lists everything",
            host.kernel,
            missing.join("; ")
        );
    }
    check_addresses(&config)?;
    // Before any thread exists: room for the descriptors of a thousand
    // connections taken or rebuilt inside a freeze (sockstate).
    match ferry_agent::sockstate::prepare_descriptor_table(8192) {
        Ok(n) => tracing::debug!(descriptors = n, "descriptor table prepared"),
        Err(e) => tracing::warn!(error = %e, "could not prepare the descriptor table"),
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(serve(config))
}

/// The public address on the public interface and the cluster address on
/// the cluster interface (`ferry-network node` puts them there): refused
/// at start, naming both, if either is missing, before a filter is
/// attached to an interface that would never see the address's packets.
/// A public IPv6 address may be on `lo` instead, where `ferry-network`
/// puts it so that no node answers neighbour solicitations for it.
fn check_addresses(config: &Config) -> Result<()> {
    let addresses: Vec<(String, std::net::IpAddr)> = nix::ifaddrs::getifaddrs()
        .context("listing this host's addresses")?
        .filter_map(|a| {
            let address = a.address.as_ref()?;
            let ip = match (address.as_sockaddr_in(), address.as_sockaddr_in6()) {
                (Some(v4), _) => std::net::IpAddr::V4(v4.ip()),
                (None, Some(v6)) => std::net::IpAddr::V6(v6.ip()),
                (None, None) => return None,
            };
            Some((a.interface_name, ip))
        })
        .collect();
    match address_missing(config, &addresses) {
        Some(why) => anyhow::bail!(why),
        None => Ok(()),
    }
}

/// The first configured address not where it belongs among `addresses`
/// (interface, address), said for the operator; None: all are there.
fn address_missing(config: &Config, addresses: &[(String, std::net::IpAddr)]) -> Option<String> {
    let public = &config.public.interface;
    let cluster = &config.cluster.interface;
    let wanted = [
        ("public", "address", public, Some(config.public.address)),
        (
            "public",
            "address6",
            public,
            config.public.address6.map(Into::into),
        ),
        ("cluster", "address", cluster, Some(config.cluster.address)),
    ];
    for (section, key, interface, address) in wanted {
        let Some(address) = address else { continue };
        let on = |(i, a): &&(String, std::net::IpAddr)| {
            *a == address && (i == interface || (section == "public" && a.is_ipv6() && i == "lo"))
        };
        if !addresses.iter().any(|e| on(&e)) {
            let has: Vec<String> = addresses
                .iter()
                .filter(|(i, _)| i == interface)
                .map(|(_, a)| a.to_string())
                .collect();
            return Some(format!(
                "[{section}] {key} {address} is not on interface {interface} ({}); `ferry-network node` puts the addresses in place (docs/deploy.md)",
                if has.is_empty() {
                    "it has no address here, or does not exist".to_owned()
                } else {
                    format!("it has {}", has.join(", "))
                }
            ));
        }
    }
    None
}

/// What this host lacks of what ferry uses, said once at start (all of it:
/// `ferryd --check`), from the answers ferryd's start probed and kept
/// (`host_features::host`), so that no migration probes again (the BTF is
/// megabytes; the soft-dirty probe walks ferryd's own page tables).
fn log_host_features(features_off: Vec<String>) {
    std::thread::spawn(move || {
        // Through the cache: the first migration finds the probes done.
        let host = ferry_agent::host_features::host(&features_off);
        for f in host.missing() {
            tracing::warn!(
                feature = f.name,
                used_for = f.used_for,
                without = f.without,
                kernel = %host.kernel,
                "this host lacks a feature ferry uses (or features_off turns it off)"
            );
        }
    });
}

/// `--check-config`: nothing starts; the verdict goes to stdout.
fn check_config(path: &Path) -> Result<()> {
    use ferry_agent::check;
    let checked = check::check(path)?;
    let criu = check::probe_criu(path, &checked.config)?;
    let text = format!(
        "{}: valid\n\n{}CRIU version  {criu}\n\n\
         # The configuration ferryd would run with, every default filled in:\n{}",
        path.display(),
        checked.summary,
        checked.effective
    );
    use std::io::Write as _;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        // `ferryd --check-config | head`: the reader has what it wanted.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("writing to stdout"),
    }
}

async fn serve(config: Config) -> Result<()> {
    ferry_agent::engine::fault_point::announce();
    log_host_features(config.features_off.clone());
    check_criu(&config);
    prepare_work_dir(&config)?;
    raise_pipe_max_size();
    let (filter, translator) = attach_data_plane(&config).await?;
    let tls = load_tls(&config)?;
    // In this (the node's) network namespace: replayed packets enter here.
    let replayer = ferry_ebpf::Replayer::new().context("opening the packet replay socket")?;
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    // Membership (SWIM), before the node: its conductor runs on it.
    let membership = start_membership(&config, tls.as_ref(), &shutdown_rx).await?;
    let node = Node::build(NodeParts {
        config: config.clone(),
        filter: Box::new(EbpfPortFilter(filter)),
        replayer: Box::new(replayer),
        flows: Box::new(ferry_agent::dataplane::translation::EbpfFlowRules(
            translator,
        )),
        tls: tls.clone(),
        membership: membership.clone(),
        criu: Arc::new(ferry_agent::criu::InstalledCriu(config.criu_path.clone())),
        links: None,
    });
    // procfs, a file and BPF maps: off the runtime.
    let adopted = {
        let supervisor = node.supervisor.clone();
        tokio::task::spawn_blocking(move || supervisor.readopt()).await?
    };
    if adopted > 0 {
        tracing::info!(adopted, "processes of the earlier agent managed again");
    }
    // Distributed servers of the earlier agent: served again, confirmed by
    // their chains once the APIs serve (groups::saved).
    match node.groups.restore().await {
        Ok(0) => {}
        Ok(groups) => tracing::info!(groups, "groups of the earlier agent served again"),
        Err(e) => tracing::warn!(error = %e, "restoring the groups of the earlier agent"),
    }
    // Migrations the earlier agent left half done: settled from the
    // journal before anything else migrates.
    ferry_agent::engine::recover(&node.engine).await;
    let reconciler = spawn_reconciler(&node, shutdown_rx.clone());
    if let Some(membership) = &membership {
        forward_membership_changes(&node, membership);
    }
    let conductor_task = spawn_conductor(&node, &shutdown_rx);
    let metrics_task = spawn_metrics(&node, &shutdown_rx).await?;
    let handoff =
        ferry_agent::groups::local::bind_socket(&config.handoff_socket).with_context(|| {
            format!(
                "binding the handoff socket {}",
                config.handoff_socket.display()
            )
        })?;
    ferry_agent::groups::local::serve(
        node.groups.clone(),
        handoff,
        tokio::runtime::Handle::current(),
    )
    .context("serving the handoff socket")?;
    // Distributed servers: heartbeats along each group's chain, view
    // changes, the sweep of ended connections. Ends with the runtime.
    tokio::spawn(node.groups.clone().watch());
    serve_apis(&node, tls.as_ref(), shutdown_tx, shutdown_rx).await?;
    let _ = reconciler.await;
    if let Some(t) = conductor_task {
        let _ = t.await;
    }
    if let Some(t) = metrics_task {
        let _ = t.await;
    }
    if let Err(e) = std::fs::remove_file(&config.control_socket) {
        tracing::warn!(error = %e, "removing the control socket");
    }
    if let Err(e) = std::fs::remove_file(&config.handoff_socket) {
        tracing::warn!(error = %e, "removing the handoff socket");
    }
    // Dropping the last reference closes file descriptors only: the pinned
    // programs stay attached and keep owning the ports of the managed
    // processes, which run on; the next agent adopts them again.
    drop(node);
    tracing::info!("ferryd stopped");
    Ok(())
}

/// Says which CRIU migrations will use, and what it lacks. Not fatal: the
/// agent still answers; migrations report the reason.
fn check_criu(config: &Config) {
    match ferry_agent::criu::probe_version(&config.criu_path) {
        Ok(v) => {
            tracing::info!(version = %v, path = %config.criu_path.display(), "CRIU found");
            let missing = ferry_agent::criu::missing_patches(&config.criu_path);
            if !missing.is_empty() {
                tracing::warn!(
                    missing = %missing.join("; "),
                    "CRIU lacks ferry's patches (`cargo xtask setup` builds it with them); what each is for is named"
                );
            }
        }
        // Not fatal: the agent still answers; migrations report the reason.
        Err(e) => tracing::warn!(error = %e, "CRIU unusable; migrations will be refused"),
    }
}

/// The work directory: created, root only, and checked to be on tmpfs;
/// CRIU's cache of kernel probes beside it.
fn prepare_work_dir(config: &Config) -> Result<()> {
    std::fs::create_dir_all(&config.work_dir)
        .with_context(|| format!("creating work_dir {}", config.work_dir.display()))?;
    // Root only, the whole tree: migration images (process memory, socket
    // state) are written below it, and a directory created with the umask's
    // mode, even for a moment, must not let anyone else in on the way.
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&config.work_dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("making work_dir {} root only", config.work_dir.display()))?;
    }
    warn_if_not_tmpfs(&config.work_dir);
    // Nothing migrates before this ferryd serves: a migration's directory
    // is what a killed ferryd left.
    ferry_agent::engine::sweep_left_behind(&config.work_dir);
    prepare_criu_cache(config);
    prepare_vma_flags(config);
    Ok(())
}

fn raise_pipe_max_size() {
    // Post-copy: CRIU moves lazy pages through 4 MiB pipes, which this
    // agent (without CAP_SYS_RESOURCE) gets only up to fs.pipe-max-size;
    // below it the transfer breaks half-way and the migrated process is
    // lost. Raised here, once, logged: the setting only caps how large an
    // unprivileged pipe may grow (still bounded by pipe-user-pages-soft).
    // A post-copy migration re-checks it on both nodes and is refused
    // with FAILED_PRECONDITION if it is still too low.
    match ferry_agent::criu::lazy::raise_pipe_max_size() {
        Ok(Some(old)) => tracing::info!(
            from = old,
            to = ferry_agent::criu::lazy::PIPE_MAX_SIZE_NEEDED,
            "raised fs.pipe-max-size for post-copy (CRIU lazy pages)"
        ),
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(error = %e, "could not raise fs.pipe-max-size; post-copy will be refused")
        }
    }
}

/// The ownership filter on the public interface and the in-cluster
/// translator on the cluster interface, attached to their pinned maps.
async fn attach_data_plane(
    config: &Config,
) -> Result<(ferry_ebpf::OwnershipFilter, ferry_ebpf::Translator)> {
    // Pinned maps and links: a restarted agent finds the ports still owned
    // and the translations still in place, and swaps its programs in.
    let pins = config.pin_dir();
    let bpffs = std::path::Path::new(ferry_ebpf::pin::BPFFS);
    if pins.starts_with(bpffs) {
        // Some systems do not mount it; elsewhere the pin dir must already
        // lie on a bpffs (the test harness mounts one per node).
        ferry_ebpf::pin::mount_bpffs(bpffs).context("mounting bpffs")?;
    }
    let iface = config.public.interface.clone();
    let ownership_pins = ferry_ebpf::pin::PinDir::new(pins.join("ownership"));
    let filter = tokio::task::spawn_blocking(move || {
        ferry_ebpf::OwnershipFilter::attach_pinned(&iface, &ownership_pins)
    })
    .await?
    .with_context(|| {
        format!(
            "attaching the ownership filter to {}",
            config.public.interface
        )
    })?;
    tracing::info!(interface = %config.public.interface, "ownership filter attached");

    // In-cluster connections of migrated processes are rewritten (peer's
    // node) or held (destination) on the cluster interface.
    let cluster_iface = config.cluster.interface.clone();
    let translate_pins = ferry_ebpf::pin::PinDir::new(pins.join("translate"));
    let translator = tokio::task::spawn_blocking(move || {
        ferry_ebpf::Translator::attach_pinned(&cluster_iface, &translate_pins)
    })
    .await?
    .with_context(|| {
        format!(
            "attaching the in-cluster translator to {}",
            config.cluster.interface
        )
    })?;
    tracing::info!(interface = %config.cluster.interface, "in-cluster translator attached");

    Ok((filter, translator))
}

/// Certificates before anything listens: a node that cannot prove who it
/// is serves nothing rather than serving in plaintext.
fn load_tls(config: &Config) -> Result<Option<ferry_agent::security::TlsMaterial>> {
    let tls = match &config.tls {
        Some(t) => {
            let m = ferry_agent::security::TlsMaterial::load(t, &config.node)
                .context("loading [tls]")?;
            tracing::info!(
                ca = %t.ca.display(),
                cert = %t.cert.display(),
                tokens = t.tokens.len(),
                membership_authenticated = m.membership_key.is_some(),
                "TLS on: mutual TLS on the peer port, authenticated control API on TCP"
            );
            Some(m)
        }
        None => {
            tracing::warn!(
                "no [tls] in the config: the peer port, the control API on TCP and membership \
                 are plaintext and unauthenticated; anyone on the cluster network can push a \
                 migration, read process memory or join (see docs/api.md, Security)"
            );
            None
        }
    };

    Ok(tls)
}

async fn start_membership(
    config: &Config,
    tls: Option<&ferry_agent::security::TlsMaterial>,
    shutdown: &watch::Receiver<bool>,
) -> Result<Option<Arc<ferry_agent::membership::Membership>>> {
    if !config.membership.enabled {
        if config.balancer.enabled {
            tracing::warn!("[balancer] enabled needs [membership] enabled: the balancer stays off");
        }
        return Ok(None);
    }
    let membership = ferry_agent::membership::Membership::start(
        config,
        tls.and_then(|t| t.membership_key.as_deref()),
        shutdown.clone(),
    )
    .await
    .context("starting membership")?;
    Ok(Some(membership))
}

/// Keeps ownership in step with what the processes hold (every 500 ms),
/// and removes the translations of closed connections (every 5 s).
fn spawn_reconciler(node: &Arc<Node>, mut stop: watch::Receiver<bool>) -> JoinHandle<()> {
    let node = node.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        let mut ticks = 0u64;
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    if let Err(e) = node.ports.refresh().await {
                        tracing::warn!(error = %e, "reconciling port ownership");
                    }
                    ticks += 1;
                    if ticks.is_multiple_of(10) {
                        remove_closed_translations(&node.dataplane).await;
                    }
                }
                _ = stop.changed() => break,
            }
        }
    })
}

/// Membership changes into the node's event stream.
fn forward_membership_changes(node: &Node, membership: &ferry_agent::membership::Membership) {
    let (events, mut changes) = (node.events.clone(), membership.changes());
    tokio::spawn(async move {
        use tokio::sync::broadcast::error::RecvError;
        loop {
            match changes.recv().await {
                Ok(c) => events.publish(ferry_proto::v1::cluster_event::Event::Membership(
                    ferry_proto::v1::MembershipChange {
                        member: c.name,
                        state: c.state.as_str().into(),
                        previous: c
                            .previous
                            .map(|p| p.as_str().to_owned())
                            .unwrap_or_default(),
                    },
                )),
                Err(RecvError::Lagged(n)) => {
                    tracing::warn!(missed = n, "membership changes not all forwarded as events")
                }
                Err(RecvError::Closed) => return,
            }
        }
    });
}

/// The balancer's conductor, when membership runs.
fn spawn_conductor(node: &Node, shutdown: &watch::Receiver<bool>) -> Option<JoinHandle<()>> {
    let config = &node.config;
    node.conductor.clone().map(|conductor| {
        tracing::info!(enabled = config.balancer.enabled, "conductor started");
        let events = node.events.clone();
        tokio::spawn(ferry_agent::conductor::run(
            conductor,
            Duration::from_millis(config.balancer.period_ms),
            shutdown.clone(),
            move |decision| {
                events.publish(ferry_proto::v1::cluster_event::Event::Balancer(decision))
            },
        ))
    })
}

/// `/metrics` on `[metrics] listen`, if set.
async fn spawn_metrics(
    node: &Arc<Node>,
    shutdown: &watch::Receiver<bool>,
) -> Result<Option<JoinHandle<()>>> {
    let Some(addr) = node.config.metrics.listen else {
        return Ok(None);
    };
    let listener = ferry_agent::metrics::bind(addr).await?;
    tracing::info!(%addr, "metrics served at /metrics");
    Ok(Some(tokio::spawn(ferry_agent::metrics::serve(
        listener,
        ferry_agent::metrics::registry(node),
        shutdown.clone(),
    ))))
}

/// Serves Peer (with Balance and forwarded Control calls) on the peer
/// port, Control on the Unix socket and, if set, on TCP, until SIGTERM or
/// SIGINT.
async fn serve_apis(
    node: &Arc<Node>,
    tls: Option<&ferry_agent::security::TlsMaterial>,
    shutdown_tx: watch::Sender<bool>,
    shutdown_rx: watch::Receiver<bool>,
) -> Result<()> {
    let config = &node.config;
    let peer_listener = tokio::net::TcpListener::bind(config.cluster.peer_listen)
        .await
        .with_context(|| format!("binding the peer port {}", config.cluster.peer_listen))?;
    let control_listener = bind_control_socket(&config.control_socket)?;
    tracing::info!(
        node = %config.node,
        peer = %config.cluster.peer_listen,
        control = %config.control_socket.display(),
        "ferryd serving"
    );
    let peer_srv = serve_peer(node, tls, peer_listener, shutdown_rx.clone())?;
    // Control with health and reflection, on the Unix socket and on TCP.
    let (control_routes, health) = control_routes(ControlService::new(node.clone()))
        .context("building the control services")?;
    health.set_serving(true).await;
    let control_srv = tonic::transport::Server::builder()
        .add_routes(control_routes.clone())
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(control_listener),
            wait_for(shutdown_rx.clone()),
        );
    // On TCP: with [tls], TLS and a role per call (certificate or token).
    let mut control_builder = tonic::transport::Server::builder();
    if let (Some(m), Some(_)) = (tls, config.control_listen) {
        control_builder = control_builder
            .tls_config(m.control_server())
            .context("the control listener's TLS configuration")?;
    }
    let control_auth = tls.map(|m| AuthLayer::control(m.tokens.clone()));
    let control_tcp = {
        let rx = shutdown_rx.clone();
        let addr = config.control_listen;
        async move {
            let Some(addr) = addr else { return Ok(()) };
            control_builder
                .layer(tower::util::option_layer(control_auth))
                .add_routes(control_routes)
                .serve_with_shutdown(addr, wait_for(rx))
                .await
        }
    };

    let signals = async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        // Health checkers see the agent going before the listeners close.
        health.set_serving(false).await;
        // Endless streams (WatchEvents) end, or the servers' graceful
        // shutdown would wait for them forever.
        node.events.close();
        let _ = shutdown_tx.send(true);
        Ok::<_, std::io::Error>(())
    };
    // After the signal the servers drain their calls; a peer that died
    // holding a connection open never answers the graceful shutdown's
    // ping, so the wait is bounded.
    let servers = async { tokio::join!(peer_srv, control_srv, control_tcp) };
    let grace = {
        let mut rx = shutdown_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        }
    };
    let bounded = async {
        tokio::select! {
            done = servers => Some(done),
            () = grace => None,
        }
    };
    let (done, s) = tokio::join!(bounded, signals);
    s.context("signal handling")?;
    match done {
        Some((p, c, t)) => {
            p.context("peer service")?;
            c.context("control service")?;
            t.context("control service (TCP)")?;
        }
        None => tracing::warn!(
            grace_ms = SHUTDOWN_GRACE.as_millis() as u64,
            "connections still open after the shutdown's grace: closed"
        ),
    }
    Ok(())
}

/// The peer port: Peer, Groups, Balance and forwarded Control calls, over mutual
/// TLS with `[tls]`.
fn serve_peer(
    node: &Arc<Node>,
    tls: Option<&ferry_agent::security::TlsMaterial>,
    listener: tokio::net::TcpListener,
    shutdown: watch::Receiver<bool>,
) -> Result<impl std::future::Future<Output = Result<(), tonic::transport::Error>>> {
    let mut peer_builder = tonic::transport::Server::builder();
    if let Some(m) = tls {
        peer_builder = peer_builder
            .tls_config(m.peer_server())
            .context("the peer port's TLS configuration")?;
    }
    let (interval, timeout) =
        ferry_agent::cluster::keepalive(Duration::from_secs(node.config.peer_timeout_secs));
    Ok(peer_builder
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(interval))
        .http2_keepalive_timeout(Some(timeout))
        // After the handshake (CA-signed client certificate): a node's.
        .layer(tower::util::option_layer(tls.map(|_| AuthLayer::peer())))
        .add_service(
            PeerServer::new(PeerService::new(node.engine.clone()))
                .max_decoding_message_size(16 << 20)
                .max_encoding_message_size(16 << 20),
        )
        .add_service(ferry_proto::v1::groups_server::GroupsServer::new(
            ferry_agent::groups::service::GroupsService::new(node.groups.clone()),
        ))
        .add_service(BalanceServer::new(
            ferry_agent::conductor::BalanceService::new(
                node.cordon.clone(),
                node.conductor.clone(),
            ),
        ))
        // Control calls forwarded by other agents (any node answers for
        // the cluster): behind the same node check as Peer.
        .add_service(
            ControlServer::new(ControlService::new(node.clone()))
                .max_decoding_message_size(16 << 20)
                .max_encoding_message_size(16 << 20),
        )
        .serve_with_incoming_shutdown(
            // The builder's tcp_nodelay applies only to listeners tonic
            // binds itself: set it on every accepted connection, or a
            // small answer waits for the peer's delayed ACK (~40 ms) while
            // another stream of the connection (the images) is in flight.
            tokio_stream::StreamExt::map(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                // TLS over a read buffer (ferry_agent::peer_io): the pages
                // of a post-copy and the images arrive in large reads.
                |conn| {
                    conn.and_then(|c| {
                        c.set_nodelay(true)?;
                        Ok(ferry_agent::peer_io::BufferedTcp::new(c))
                    })
                },
            ),
            wait_for(shutdown),
        ))
}

/// How long the servers may take to finish their calls after SIGTERM.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

async fn wait_for(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// The control socket is the local root-only door to the agent.
fn bind_control_socket(path: &Path) -> Result<tokio::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => tracing::info!(path = %path.display(), "removed a stale control socket"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
    }
    let listener = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("binding the control socket {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("restricting {}", path.display()))?;
    Ok(listener)
}

/// Learns, in the background, how to hand CRIU the mappings' flags
/// (`criu::vmflags`: a BPF program to load and probe mappings to make),
/// so that no migration does it between its last pre-copy round and the
/// freeze, while the process dirties more pages. Nothing here is fatal:
/// without it CRIU reads smaps.
fn prepare_vma_flags(config: &Config) {
    if !ferry_agent::criu::has_patch(&config.criu_path, ferry_agent::criu::VMA_FLAGS_MARK) {
        return;
    }
    tokio::task::spawn_blocking(|| match ferry_agent::criu::vmflags::available() {
        Ok(()) => tracing::info!("the mappings' flags go to CRIU without smaps' page walk"),
        Err(why) => tracing::info!(%why, "CRIU reads the mappings' flags from smaps"),
    });
}

/// Readies CRIU's cache of kernel probes and fills it in the background,
/// so that no restore probes the kernel inside a freeze (`criu::cache`).
/// Nothing here is fatal: without the cache migrations only take longer.
fn prepare_criu_cache(config: &Config) {
    let dir = &config.criu_cache_dir;
    match ferry_agent::criu::prepare_cache_dir(dir) {
        Ok(ferry_agent::criu::CacheDir::Usable) => {}
        Ok(ferry_agent::criu::CacheDir::NotTmpfs) => {
            tracing::warn!(
                criu_cache_dir = %dir.display(),
                "criu_cache_dir is not on tmpfs, so CRIU keeps no cache of its kernel probes: \
                 every restore probes the kernel again inside the freeze"
            );
            return;
        }
        Err(e) => {
            tracing::warn!(error = %e, "CRIU's cache of kernel probes cannot be kept");
            return;
        }
    }
    if ferry_agent::criu::cache_present(dir) {
        return;
    }
    let (criu, work) = (config.criu_path.clone(), config.work_dir.clone());
    let dir = dir.clone();
    tokio::task::spawn_blocking(move || match ferry_agent::criu::warm(&criu, &work) {
        Ok(verdict) if ferry_agent::criu::cache_present(&dir) => {
            tracing::info!(%verdict, criu_cache_dir = %dir.display(), "CRIU's kernel probes cached")
        }
        Ok(verdict) => tracing::warn!(
            %verdict,
            criu_cache_dir = %dir.display(),
            "CRIU left no cache in criu_cache_dir: is it the directory CRIU was built with (RUNDIR)?"
        ),
        Err(e) => tracing::warn!(error = %e, "warming CRIU's cache"),
    });
}

fn warn_if_not_tmpfs(dir: &Path) {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    match nix::sys::statfs::statfs(dir) {
        Ok(s) if s.filesystem_type().0 == TMPFS_MAGIC => {}
        Ok(_) => tracing::warn!(
            work_dir = %dir.display(),
            "work_dir is not on tmpfs: writing images to disk lengthens the freeze"
        ),
        Err(e) => tracing::warn!(error = %e, "statfs on work_dir"),
    }
}

/// Translations of in-cluster connections that closed: gone after a linger
/// that covers TIME_WAIT's last segments.
async fn remove_closed_translations(dataplane: &std::sync::Arc<ferry_agent::dataplane::DataPlane>) {
    const LINGER: Duration = Duration::from_secs(60);
    let dataplane = dataplane.clone();
    match tokio::task::spawn_blocking(move || dataplane.flows().remove_closed(LINGER)).await {
        Ok(Ok(removed)) => {
            for rule in removed {
                tracing::info!(%rule, "translation of a closed connection removed");
            }
        }
        Ok(Err(e)) => tracing::warn!(error = %e, "removing closed translations"),
        Err(e) => tracing::warn!(error = %e, "translation cleanup task"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_public_ipv6_address_may_be_on_lo_and_nothing_else_may() {
        let text = r#"
node = "node1"
work_dir = "/run/ferry/work"
[public]
interface = "pub0"
address = "198.18.0.100"
address6 = "2001:2::100"
[cluster]
interface = "clu0"
address = "198.19.0.1"
peer_listen = "198.19.0.1:7100"
"#;
        let config = Config::parse(text, Path::new("x")).unwrap();
        let at = |list: &[(&str, &str)]| -> Vec<(String, std::net::IpAddr)> {
            list.iter()
                .map(|(i, a)| (i.to_string(), a.parse().unwrap()))
                .collect()
        };
        let v4 = [("pub0", "198.18.0.100"), ("clu0", "198.19.0.1")];
        for v6 in [("pub0", "2001:2::100"), ("lo", "2001:2::100")] {
            let mut all = v4.to_vec();
            all.push(v6);
            assert_eq!(address_missing(&config, &at(&all)), None, "{v6:?}");
        }
        let mut all = v4.to_vec();
        all.push(("clu0", "2001:2::100"));
        let why = address_missing(&config, &at(&all)).unwrap();
        assert!(
            why.starts_with("[public] address6 2001:2::100 is not on interface pub0"),
            "{why}"
        );
        // IPv4 on lo is not the public interface's.
        let why = address_missing(
            &config,
            &at(&[("lo", "198.18.0.100"), ("clu0", "198.19.0.1")]),
        )
        .unwrap();
        assert!(why.starts_with("[public] address 198.18.0.100"), "{why}");
    }
}
