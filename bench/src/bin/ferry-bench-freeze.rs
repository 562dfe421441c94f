//! `cargo xtask bench freeze`: the freeze at scale (Gerofi et al. (DVE),
//! Fig. 5b/5c), for each way of moving TCP connections, over a sweep of
//! connection counts.
//!
//! Per connection count: a 3-node cluster (capture and replay on), the DVE
//! server (`ferry-dve-server`, TCP and UDP echo on one port), `--tcp`
//! DVE clients sending 256 bytes every 50 ms and `--udp` players at 20 Hz,
//! fresh for every migration. The server holds one session to a
//! PostgreSQL server on node3 (Debian's, started here): its child
//! `ferry-pg-session` queries it every 50 ms, and every migration must
//! keep that very session (same backend PID, no failed query); `--db
//! false` leaves it out. Then, per `--udp-only` count, a UDP server alone
//! (the OpenArena setup of Gerofi et al. (DVE)): that many players, no TCP
//! client. The server moves node1 -> node2 -> node1 ..., `--runs` times per
//! socket mode:
//!
//! - iterative: CRIU's own path, one connection at a time, one image file
//!   per connection;
//! - collective: ferryd reads every connection's state in one batch and
//!   sends it in one message; the destination rebuilds them all before
//!   CRIU restores the rest (`ferry_agent::sockstate`);
//! - incremental: collective, with the connections' addresses and options
//!   read before the freeze (a setsockopt watch says which to read again
//!   in it, `sockstate::preread`).
//!
//! - pause (only when asked for): no migration; the server is stopped
//!   where it runs (SIGSTOP, SIGCONT) as long as the incremental freeze
//!   measured at that count: the control for what the clients' catch-up
//!   after a freeze of that length costs on this rig by itself.
//!
//! Per migration: the freeze and its parts (from the migration report),
//! bytes sent while frozen, the median client's gap and the worst one,
//! each client's gap beyond its send interval (median and p99 over
//! clients), the destination's replay after the resume (its duration and
//! packets, from the report), TCP retransmission timeouts at the clients,
//! UDP datagrams lost, and packets the machine's input backlog dropped
//! meanwhile and during the replay. The bench raises that backlog
//! (`net.core.netdev_max_backlog`, machine-wide, given back after) to
//! `--input-backlog` so that the rig's own veth pairs and bridges do not
//! drop packets at thousands of clients. Prints one row per migration,
//! then medians and p95 per count and mode; writes CSV (with the build
//! profile), Markdown and an SVG chart of the freeze against the
//! connection count to `--out` (default `target/bench/freeze`).

use std::fmt::Write as _;
use std::net::SocketAddrV4;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use ferry_agent::engine::precopy::MemoryStrategy;
use ferry_bench::softnet::{BacklogSize, backlog_drops};
use ferry_bench::stats::{median, median_unsorted, percentile};
use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{migrate_request, run, wait_for_process};
use ferry_integration::nstat::Nstat;
use ferry_integration::pg_session::{SessionStatus, wait_for_queries};
use ferry_integration::postgres::{PG_PORT, PostgresServer};
use ferry_integration::workload::{SeqClient, UdpClients};
use ferry_proto::v1::{MigrateRequest, MigrationOutcome, MigrationReport, SocketMigration};

const PORT: u16 = 7000;
/// Where the database session's status is served.
const SESSION_PORT: u16 = 7300;
const INTERVAL: Duration = Duration::from_millis(50);
/// The mode that stops the server in place instead of moving it.
const PAUSE: &str = "pause";
/// The bystander servers' ports, on node1 and node2.
const BYSTANDER_PORTS: [u16; 2] = [7400, 7401];
const BYSTANDER_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug, Parser)]
#[command(
    name = "ferry-bench-freeze",
    about = "freeze time at scale: iterative, collective and incremental socket migration"
)]
struct Args {
    /// Migrations per connection count and mode.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// TCP connection counts, comma-separated (none: `--tcp=`).
    #[arg(long, default_value = "16,64,256,1024,4096", value_parser = counts)]
    tcp: Counts,
    /// UDP players beside them.
    #[arg(long, default_value_t = 24)]
    udp: usize,
    /// UDP player counts of the UDP-only server, comma-separated (none:
    /// `--udp-only=`).
    #[arg(long, default_value = "24,1024", value_parser = counts)]
    udp_only: Counts,
    /// The server's session to PostgreSQL on node3.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    db: bool,
    /// Socket modes, comma-separated (iterative, collective, incremental),
    /// and `pause`: no migration, the server stopped where it runs
    /// (SIGSTOP, SIGCONT) as long as `--pause-ms` says, the control for
    /// what the clients' catch-up after a freeze of that length costs on
    /// this rig.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "iterative,collective,incremental"
    )]
    modes: Vec<String>,
    /// Bulk streams beside them (16 KiB messages, back to back, echoed):
    /// what keeps the server's send queues full.
    #[arg(long, default_value_t = 0)]
    bulk: usize,
    /// Drain before freeze: the most ms each migration waits for the
    /// server's send queues to empty (0: off).
    #[arg(long, default_value_t = 0)]
    drain_ms: u32,
    /// Established connections of other processes on each of node1 and
    /// node2 (an echo server on each that stays there, a thread per
    /// connection, with that many idle clients, one 64-byte message each
    /// every 10 s): what a node's other services hold beside the migrating
    /// one. The freeze should not grow with them.
    #[arg(long, default_value_t = 0)]
    bystanders: usize,
    /// Memory strategy of every migration: total-copy (the default),
    /// pre-copy or queued-pre-copy (the pages then cross before the
    /// freeze, which carries only those written since).
    #[arg(long, default_value = "total-copy", value_parser = strategy)]
    strategy: MemoryStrategy,
    /// The machine's input backlog (`net.core.netdev_max_backlog`, packets
    /// per CPU) while the bench runs, given back its value after: the
    /// rig's veth pairs and bridges deliver through it, and at thousands
    /// of clients the default 1000 drops packets of the rig's own traffic.
    /// 0: leave the machine's setting (what a host left at its default
    /// does).
    #[arg(long, default_value_t = 32768)]
    input_backlog: u32,
    #[arg(long, default_value = "target/bench/freeze")]
    out: PathBuf,
    /// How long the `pause` mode stops the server, ms (0: as long as the
    /// median freeze of the incremental migrations measured so far at this
    /// count, else of any mode's, 100 before the first).
    #[arg(long, default_value_t = 0)]
    pause_ms: u64,
    /// CRIU's log level in every agent (4: each step with its time, for
    /// reading where a dump or restore goes; it slows both). With
    /// `FERRY_TEST_LOG_DIR` set the logs are kept there.
    #[arg(long)]
    criu_log_level: Option<u8>,
    /// Migrate nothing: draw `--out`/freeze.svg again from the freeze.csv
    /// of an earlier run (its counts, modes and runs).
    #[arg(long)]
    replot: Option<PathBuf>,
}

/// A comma-separated list of counts that may be empty.
#[derive(Debug, Clone)]
struct Counts(Vec<usize>);

/// A `--strategy` value, by the agent's name for it: one whose freeze
/// carries what is left of the memory (post-copy's carries none, and is
/// not comparable).
fn strategy(s: &str) -> Result<MemoryStrategy, String> {
    [
        MemoryStrategy::TotalCopy,
        MemoryStrategy::PreCopy,
        MemoryStrategy::QueuedPreCopy,
    ]
    .into_iter()
    .find(|m| m.name() == s)
    .ok_or_else(|| format!("{s:?}: total-copy, pre-copy or queued-pre-copy"))
}

fn counts(s: &str) -> Result<Counts, String> {
    s.split(',')
        .filter(|c| !c.trim().is_empty())
        .map(|c| c.trim().parse().map_err(|e| format!("{c:?}: {e}")))
        .collect::<Result<_, _>>()
        .map(Counts)
}

#[derive(Debug, Clone)]
struct Row {
    tcp: usize,
    udp: usize,
    mode: &'static str,
    run: usize,
    freeze_ms: f64,
    dump_ms: f64,
    transfer_ms: f64,
    restore_ms: f64,
    replay_ms: f64,
    frozen_bytes: u64,
    image_files: u32,
    gap_median_ms: f64,
    gap_max_ms: f64,
    rtos: u64,
    udp_lost: u64,
    /// Drain before freeze: its wait, the bytes queued when it began and
    /// those it left.
    drain_ms: f64,
    drain_start: u64,
    drain_left: u64,
    /// Bytes of the connections' send queues the freeze carried.
    send_queues: u64,
    /// Packets the machine's input backlog dropped meanwhile (the test
    /// rig's veth pairs, not ferry: `softnet::backlog_drops`).
    backlog_drops: u64,
    /// Over the TCP clients, each one's longest silence less the send
    /// interval (what the migration added to what a client waits anyway):
    /// median and p99.
    gap_beyond_median_ms: f64,
    gap_beyond_p99_ms: f64,
    /// The destination's replay of the captured packets, from its first
    /// packet to the ports passing packets again (after the resume, so not
    /// in the freeze), how many packets it replayed and the input
    /// backlog's drops meanwhile (`ReplayStats`).
    replay_duration_ms: f64,
    replayed: u64,
    replay_backlog_drops: u64,
    /// Every part of the freeze the migration report names, in its order.
    parts: Vec<(String, f64)>,
}

const HEADER: [&str; 27] = [
    "tcp",
    "udp",
    "mode",
    "run",
    "freeze_ms",
    "dump_ms",
    "transfer_ms",
    "restore_ms",
    "replay_ms",
    "bytes_in_freeze",
    "image_files",
    "tcp_gap_median_ms",
    "gap_max_ms",
    "tcp_rtos",
    "udp_lost",
    "drain_ms",
    "drain_start_bytes",
    "drain_left_bytes",
    "send_queue_bytes_in_freeze",
    "backlog_drops",
    "profile",
    "gap_beyond_interval_median_ms",
    "gap_beyond_interval_p99_ms",
    "replay_duration_ms",
    "replayed_packets",
    "replay_backlog_drops",
    "replay_packets_per_ms",
];

impl Row {
    fn cells(&self) -> Vec<String> {
        vec![
            self.tcp.to_string(),
            self.udp.to_string(),
            self.mode.to_owned(),
            self.run.to_string(),
            format!("{:.1}", self.freeze_ms),
            format!("{:.1}", self.dump_ms),
            format!("{:.1}", self.transfer_ms),
            format!("{:.1}", self.restore_ms),
            format!("{:.1}", self.replay_ms),
            self.frozen_bytes.to_string(),
            self.image_files.to_string(),
            format!("{:.1}", self.gap_median_ms),
            format!("{:.1}", self.gap_max_ms),
            self.rtos.to_string(),
            self.udp_lost.to_string(),
            format!("{:.1}", self.drain_ms),
            self.drain_start.to_string(),
            self.drain_left.to_string(),
            self.send_queues.to_string(),
            self.backlog_drops.to_string(),
            ferry_bench::run::profile().to_owned(),
            format!("{:.1}", self.gap_beyond_median_ms),
            format!("{:.1}", self.gap_beyond_p99_ms),
            format!("{:.1}", self.replay_duration_ms),
            self.replayed.to_string(),
            self.replay_backlog_drops.to_string(),
            format!("{:.0}", self.replay_rate()),
        ]
    }
}

impl Row {
    /// Packets replayed per millisecond of the replay (0 without one).
    fn replay_rate(&self) -> f64 {
        if self.replay_duration_ms > 0.0 {
            self.replayed as f64 / self.replay_duration_ms
        } else {
            0.0
        }
    }
}

fn mode_of(name: &str) -> Result<(&'static str, SocketMigration)> {
    match name {
        "iterative" => Ok(("iterative", SocketMigration::Iterative)),
        "collective" => Ok(("collective", SocketMigration::Collective)),
        "incremental" => Ok(("incremental", SocketMigration::Incremental)),
        PAUSE => Ok((PAUSE, SocketMigration::Unspecified)),
        other => bail!("--modes: {other:?} is not iterative, collective, incremental or {PAUSE}"),
    }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if let Some(csv) = &args.replot {
        return match replot(csv, &args.out) {
            Ok(svg) => {
                println!("written: {}", svg.display());
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("bench freeze --replot failed: {e:#}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    if let Some(reason) = ferry_integration::skip_reason() {
        eprintln!("bench freeze needs {reason}");
        return std::process::ExitCode::FAILURE;
    }
    match bench(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench freeze failed: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Draws the chart of a saved freeze.csv (its `tcp`, `mode`, `run` and
/// `freeze_ms` columns; the UDP-only rows, tcp 0, are not on it).
fn replot(csv: &std::path::Path, out: &std::path::Path) -> Result<PathBuf> {
    let text =
        std::fs::read_to_string(csv).with_context(|| format!("reading {}", csv.display()))?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().context("an empty CSV")?.split(',').collect();
    let col = |name: &str| {
        header
            .iter()
            .position(|h| *h == name)
            .with_context(|| format!("{}: no column {name}", csv.display()))
    };
    let (tcp, mode, run, freeze) = (col("tcp")?, col("mode")?, col("run")?, col("freeze_ms")?);
    let mut freezes = Vec::new();
    let (mut counts, mut modes, mut runs) = (Vec::new(), Vec::<String>::new(), 0);
    for (i, line) in lines.enumerate() {
        let cells: Vec<&str> = line.split(',').collect();
        let cell = |c: usize| {
            cells
                .get(c)
                .copied()
                .with_context(|| format!("{} line {}: too few columns", csv.display(), i + 2))
        };
        let n: usize = cell(tcp)?.parse().context("tcp")?;
        let r: usize = cell(run)?.parse().context("run")?;
        let ms: f64 = cell(freeze)?.parse().context("freeze_ms")?;
        let m = cell(mode)?.to_owned();
        if n == 0 || m == PAUSE {
            continue;
        }
        if !counts.contains(&n) {
            counts.push(n);
        }
        if !modes.contains(&m) {
            modes.push(m.clone());
        }
        runs = runs.max(r + 1);
        freezes.push((n, m, ms));
    }
    let modes: Vec<&str> = modes.iter().map(String::as_str).collect();
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let svg = out.join("freeze.svg");
    std::fs::write(&svg, plot(&freezes, &counts, &modes, runs))?;
    Ok(svg)
}

fn bench(args: &Args) -> Result<()> {
    if args.runs == 0 || args.tcp.0.contains(&0) || args.udp_only.0.contains(&0) {
        bail!("--runs and every --tcp and --udp-only count must be at least 1");
    }
    if args.tcp.0.is_empty() && args.udp_only.0.is_empty() {
        bail!("nothing to measure: --tcp and --udp-only are both empty");
    }
    let modes = args
        .modes
        .iter()
        .map(|m| mode_of(m))
        .collect::<Result<Vec<_>>>()?;
    let backlog = if args.input_backlog > 0 {
        Some(BacklogSize::at_least(args.input_backlog)?)
    } else {
        None
    };
    let backlog_size = match &backlog {
        Some(b) => b.packets(),
        None => BacklogSize::current()?,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    println!(
        "{} build; the machine's input backlog: {backlog_size} packets per CPU",
        ferry_bench::run::profile()
    );
    println!(
        "bench freeze: {} migrations per count and mode; TCP clients {:?} (256 B / 50 ms) with {} UDP players (20 Hz){}; UDP-only servers with {:?} players\n",
        args.runs,
        args.tcp.0,
        args.udp,
        if args.db {
            " and a database session"
        } else {
            ""
        },
        args.udp_only.0
    );
    println!("{}", HEADER.join("\t"));
    let mut rows = Vec::new();
    let scenarios = args
        .tcp
        .0
        .iter()
        .map(|&tcp| (tcp, args.udp))
        .chain(args.udp_only.0.iter().map(|&udp| (0, udp)));
    for (tcp, udp) in scenarios {
        // One cluster per count: the modes alternate migration by
        // migration on it, so both see the same machine state.
        let mut spec = ClusterSpec::new(3, 2);
        if let Some(level) = args.criu_log_level {
            spec.extra_config = format!("criu_log_level = {level}\n");
        }
        let cluster = Cluster::start(spec).context("cluster")?;
        let db = if args.db && tcp > 0 {
            let addr = SocketAddrV4::new(cluster.node_cluster_addr("node3"), PG_PORT);
            Some(PostgresServer::start(&cluster.netns_path("node3"), addr).context("PostgreSQL")?)
        } else {
            None
        };
        let scenario = Scenario {
            tcp,
            udp,
            db: db.as_ref().map(|d| d.addr()),
        };
        rt.block_on(migrations(&cluster, scenario, &modes, args, &mut rows))?;
    }
    let report = tables(&rows, args, &modes, backlog_size);
    println!("\n{report}");
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let mut csv = HEADER.join(",") + "\n";
    for r in &rows {
        csv += &(r.cells().join(",") + "\n");
    }
    std::fs::write(args.out.join("freeze.csv"), csv)?;
    let mut parts_csv = String::from("tcp,udp,mode,run,part,ms\n");
    for r in &rows {
        for (part, ms) in &r.parts {
            let _ = writeln!(
                parts_csv,
                "{},{},{},{},\"{part}\",{ms:.2}",
                r.tcp, r.udp, r.mode, r.run
            );
        }
    }
    std::fs::write(args.out.join("freeze_parts.csv"), parts_csv)?;
    std::fs::write(args.out.join("freeze.md"), &report)?;
    let freezes: Vec<_> = rows
        .iter()
        .filter(|r| r.tcp > 0 && r.mode != PAUSE)
        .map(|r| (r.tcp, r.mode.to_owned(), r.freeze_ms))
        .collect();
    let mode_names: Vec<&str> = modes
        .iter()
        .map(|(m, _)| *m)
        .filter(|m| *m != PAUSE)
        .collect();
    std::fs::write(
        args.out.join("freeze.svg"),
        plot(&freezes, &args.tcp.0, &mode_names, args.runs),
    )?;
    println!(
        "written: {0}/freeze.csv, {0}/freeze_parts.csv, {0}/freeze.md, {0}/freeze.svg",
        args.out.display()
    );
    Ok(())
}

/// How long the `pause` mode stops the server: `--pause-ms`, or the median
/// freeze of the incremental migrations measured so far in `scenario`,
/// else of any mode's, 100 ms before the first.
fn pause_length(args: &Args, rows: &[Row], scenario: Scenario) -> Duration {
    if args.pause_ms > 0 {
        return Duration::from_millis(args.pause_ms);
    }
    let measured = |mode: fn(&str) -> bool| -> Vec<f64> {
        rows.iter()
            .filter(|r| r.tcp == scenario.tcp && r.udp == scenario.udp && mode(r.mode))
            .map(|r| r.freeze_ms)
            .collect()
    };
    let mut freezes = measured(|m| m == "incremental");
    if freezes.is_empty() {
        freezes = measured(|m| m != PAUSE);
    }
    if freezes.is_empty() {
        Duration::from_millis(100)
    } else {
        Duration::from_secs_f64(median_unsorted(&freezes) / 1e3)
    }
}

/// Stops the server where it runs for `length` (SIGSTOP, SIGCONT): what a
/// freeze of that length costs the clients without a migration. The
/// report holds only the freeze, as measured here.
async fn pause(pid: i32, length: Duration) -> Result<MigrationReport> {
    let signal = |sig: libc::c_int| {
        // SAFETY: kill(2) takes plain integers; `pid` is the bench's own
        // server, run through the agent on this machine.
        if unsafe { libc::kill(pid, sig) } != 0 {
            bail!(
                "signal {sig} to the server {pid}: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    };
    let started = std::time::Instant::now();
    signal(libc::SIGSTOP)?;
    tokio::time::sleep(length).await;
    signal(libc::SIGCONT)?;
    Ok(MigrationReport {
        freeze_time_us: started.elapsed().as_micros() as u64,
        ..Default::default()
    })
}

fn part(report: &MigrationReport, prefix: &str) -> f64 {
    report
        .freeze_parts
        .iter()
        .filter(|p| p.phase.starts_with(prefix))
        .fold(0.0, |sum, p| sum + p.duration_us as f64 / 1e3)
}

/// What one cluster of the sweep serves.
#[derive(Debug, Clone, Copy)]
struct Scenario {
    /// DVE clients (0: a UDP-only server).
    tcp: usize,
    udp: usize,
    /// The PostgreSQL server the DVE server holds a session to.
    db: Option<SocketAddrV4>,
}

async fn migrations(
    cluster: &Cluster,
    scenario: Scenario,
    modes: &[(&'static str, SocketMigration)],
    args: &Args,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let Scenario {
        tcp: tcp_count,
        udp: udp_count,
        db,
    } = scenario;
    let nodes = ["node1", "node2"];
    let mut here = 0;
    let mut control = cluster.control(nodes[here]).await?;
    let mut server = vec![
        ferry_integration::bin_path("ferry-dve-server")
            .display()
            .to_string(),
        "--port".into(),
        PORT.to_string(),
    ];
    let session_target = SocketAddrV4::new(cluster.public_addr(), SESSION_PORT);
    if let Some(db) = db {
        server.extend([
            "--".into(),
            ferry_integration::bin_path("ferry-pg-session")
                .display()
                .to_string(),
            "--pg".into(),
            db.to_string(),
            "--serve".into(),
            session_target.to_string(),
            "--interval-ms".into(),
            "50".into(),
        ]);
    }
    let listening = if db.is_some() { 2 } else { 1 };
    let mut pid = run(&mut control, server).await;
    // Its UDP port claimed too: until then no node takes the players'
    // datagrams, which would count as lost.
    wait_for_process(&mut control, pid, |p| {
        p.tcp_listening == listening && p.udp_sockets >= 1
    })
    .await;
    let target = SocketAddrV4::new(cluster.public_addr(), PORT);
    let clients = [cluster.netns_path("client1"), cluster.netns_path("client2")];
    let session_ok = |s: &SessionStatus, first: &SessionStatus| -> Result<()> {
        if s.backend_pid != first.backend_pid || s.queries_failed != 0 || s.last_error.is_some() {
            bail!("the database session did not survive: {s:?} (first {first:?})");
        }
        Ok(())
    };
    let session_first = match db {
        Some(_) => Some(
            wait_for_queries(&clients[0], session_target, 0, 5, Duration::from_secs(30))
                .map_err(anyhow::Error::msg)?,
        ),
        None => None,
    };
    let bystanders = if args.bystanders > 0 && tcp_count > 0 {
        Some(Bystanders::start(cluster, &nodes, &clients[1], args.bystanders).await?)
    } else {
        None
    };
    for run in 0..args.runs {
        // The server moves node1 -> node2 -> node1 ...: with an even number
        // of modes in a fixed order, each mode would always move the same
        // way. Every other run takes them in reverse, so each mode moves
        // both ways.
        let order: Vec<_> = if run % 2 == 1 && modes.len().is_multiple_of(2) {
            modes.iter().rev().copied().collect()
        } else {
            modes.to_vec()
        };
        for (mode_name, mode) in order {
            let tcp = (tcp_count > 0)
                .then(|| SeqClient::start(clients[0].clone(), target, tcp_count, INTERVAL, 256))
                .transpose()?;
            let udp = UdpClients::start(clients[1].clone(), target, udp_count, INTERVAL, 96)?;
            let bulk = (args.bulk > 0 && tcp_count > 0)
                .then(|| {
                    SeqClient::start(clients[1].clone(), target, args.bulk, Duration::ZERO, 16384)
                })
                .transpose()?;
            if let Some(tcp) = &tcp {
                tcp.wait_until_flowing(Duration::from_secs(30))?;
            }
            if let Some(b) = &bulk {
                b.wait_until_flowing(Duration::from_secs(30))?;
            }
            let bulk_before = bulk.as_ref().map(|b| b.verified_per_connection());
            udp.wait_for_echoes(udp_count as u64 * 10, Duration::from_secs(10))
                .map_err(anyhow::Error::msg)?;
            let before = Nstat::read(&clients[0])?;
            let drops_before = backlog_drops()?;
            let tcp_before = tcp.as_ref().map(|t| t.verified_per_connection());
            let session_before = match &session_first {
                Some(first) => {
                    let s = wait_for_queries(
                        &clients[0],
                        session_target,
                        0,
                        1,
                        Duration::from_secs(10),
                    )
                    .map_err(anyhow::Error::msg)?;
                    session_ok(&s, first)?;
                    Some(s)
                }
                None => None,
            };

            let report = if mode_name == PAUSE {
                let length = pause_length(args, rows, scenario);
                pause(pid, length).await?
            } else {
                let to = nodes[1 - here];
                let (report, status) = migrate_request(
                    &mut control,
                    MigrateRequest {
                        pid,
                        destination_node: to.into(),
                        strategy: args.strategy.to_pb() as i32,
                        sockets: mode as i32,
                        drain_send_queues_ms: args.drain_ms,
                        ..Default::default()
                    },
                )
                .await
                .context("starting the migration")?;
                if status.is_some() || report.outcome != MigrationOutcome::Committed as i32 {
                    bail!(
                        "{tcp_count} connections, {mode_name}, run {run}: migration failed: {status:?} {}",
                        report.error
                    );
                }
                if report.sockets != mode as i32 {
                    bail!(
                        "{tcp_count} connections, run {run}: asked for {mode_name}, got {} ({})",
                        report.sockets,
                        report.sockets_note
                    );
                }
                here = 1 - here;
                pid = report.destination_pid;
                control = cluster.control(nodes[here]).await?;
                wait_for_process(&mut control, pid, |p| p.state == "running").await;
                report
            };

            if let (Some(tcp), Some(before)) = (&tcp, &tcp_before) {
                tcp.wait_until_each_passes(before, 20, Duration::from_secs(30))?;
            }
            if let (Some(first), Some(before)) = (&session_first, &session_before) {
                let s = wait_for_queries(
                    &clients[0],
                    session_target,
                    before.queries_ok,
                    5,
                    Duration::from_secs(30),
                )
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("{tcp_count} connections, {mode_name}, run {run}"))?;
                session_ok(&s, first)?;
            }
            if let (Some(b), Some(before)) = (&bulk, &bulk_before) {
                b.wait_until_each_passes(before, 200, Duration::from_secs(30))?;
            }
            let seen = udp.echoed();
            udp.wait_for_echoes(seen + udp_count as u64 * 20, Duration::from_secs(30))
                .map_err(anyhow::Error::msg)?;
            let after = Nstat::read(&clients[0])?;
            let drops = backlog_drops()?.saturating_sub(drops_before);
            let tcp_report = tcp.map(|t| t.stop());
            if let Some(b) = bulk {
                let r = b.stop();
                if !r.failures().is_empty() {
                    bail!(
                        "{tcp_count} connections, {mode_name}, run {run}: bulk streams failed: {:?}",
                        r.failures()
                    );
                }
            }
            let udp_report = udp.stop()?;
            if let Some(r) = &tcp_report
                && !r.failures().is_empty()
            {
                bail!(
                    "{tcp_count} connections, {mode_name}, run {run}: TCP streams failed: {:?}",
                    r.failures()
                );
            }
            let mut gaps: Vec<f64> = tcp_report
                .iter()
                .flat_map(|r| &r.connections)
                .filter_map(|c| c.max_gap.as_ref())
                .map(|g| g.duration.as_secs_f64() * 1e3)
                .collect();
            gaps.sort_by(f64::total_cmp);
            let interval_ms = INTERVAL.as_secs_f64() * 1e3;
            let beyond: Vec<f64> = gaps.iter().map(|g| (g - interval_ms).max(0.0)).collect();
            let replay = report.replay.unwrap_or_default();
            let row = Row {
                tcp: tcp_count,
                udp: udp_count,
                mode: mode_name,
                run,
                freeze_ms: report.freeze_time_us as f64 / 1e3,
                dump_ms: part(&report, "dump"),
                transfer_ms: part(&report, "transfer"),
                restore_ms: part(&report, "restore"),
                replay_ms: part(&report, "commit: replay"),
                frozen_bytes: report.bytes_transferred,
                image_files: report.image_files,
                gap_median_ms: median(&gaps),
                gap_max_ms: gaps
                    .last()
                    .copied()
                    .unwrap_or(0.0)
                    .max(udp_report.max_gap().as_secs_f64() * 1e3),
                rtos: after.since(&before).get("TcpExtTCPTimeouts")?,
                udp_lost: udp_report.lost(),
                drain_ms: report.drain_time_us as f64 / 1e3,
                drain_start: report.drain_bytes_at_start,
                drain_left: report.drain_bytes_left,
                send_queues: report.tcp_send_queue_bytes,
                backlog_drops: drops,
                gap_beyond_median_ms: median(&beyond),
                gap_beyond_p99_ms: percentile(&beyond, 99.0),
                replay_duration_ms: replay.replay_time_us as f64 / 1e3,
                replayed: replay.replayed,
                replay_backlog_drops: replay.input_backlog_drops,
                parts: report
                    .freeze_parts
                    .iter()
                    .map(|p| (p.phase.clone(), p.duration_us as f64 / 1e3))
                    .collect(),
            };
            println!("{}", row.cells().join("\t"));
            rows.push(row);
        }
    }
    if let Some(b) = bystanders {
        b.stop()?;
    }
    Ok(())
}

/// Other processes' connections on the migrating server's nodes: an echo
/// server on each of node1 and node2 (never migrated; a thread per
/// connection, so that idle connections cost no CPU, unlike the DVE
/// server's poll over all of them) and idle clients.
struct Bystanders {
    clients: Vec<SeqClient>,
}

impl Bystanders {
    async fn start(
        cluster: &Cluster,
        nodes: &[&str; 2],
        netns: &std::path::Path,
        each: usize,
    ) -> Result<Self> {
        let mut clients = Vec::new();
        for (node, port) in nodes.iter().zip(BYSTANDER_PORTS) {
            let mut control = cluster.control(node).await?;
            let server = vec![
                ferry_integration::bin_path("ferry-echo-server")
                    .display()
                    .to_string(),
                "--port".into(),
                port.to_string(),
            ];
            let pid = run(&mut control, server).await;
            wait_for_process(&mut control, pid, |p| p.tcp_listening == 1).await;
            let target = SocketAddrV4::new(cluster.public_addr(), port);
            let c = SeqClient::start(netns, target, each, BYSTANDER_INTERVAL, 64)
                .with_context(|| format!("{each} bystander connections to {node}"))?;
            c.wait_until_flowing(Duration::from_secs(30))?;
            clients.push(c);
        }
        println!(
            "bystanders: {each} established connections of another server on each of {}",
            nodes.join(" and ")
        );
        Ok(Self { clients })
    }

    /// Every bystander connection carried every byte, untouched by the
    /// migrations beside it.
    fn stop(self) -> Result<()> {
        for c in self.clients {
            let r = c.stop();
            if !r.failures().is_empty() {
                bail!("bystander connections failed: {:?}", r.failures());
            }
        }
        Ok(())
    }
}

/// The freeze's median and p95 against the number of connections, a line
/// for each per mode (Gerofi et al. (DVE), Fig. 5b/5c).
/// `freezes`: (TCP connections, mode, freeze in ms) per migration.
fn plot(freezes: &[(usize, String, f64)], counts: &[usize], modes: &[&str], runs: usize) -> String {
    use ferry_policy::sim::svg::{Chart, Series};
    let mut series = Vec::new();
    for &mode in modes {
        let mut medians = Vec::new();
        let mut p95s = Vec::new();
        for &tcp in counts {
            let mut v: Vec<f64> = freezes
                .iter()
                .filter(|(n, m, _)| *n == tcp && m == mode)
                .map(|(_, _, ms)| *ms)
                .collect();
            if v.is_empty() {
                continue;
            }
            v.sort_by(f64::total_cmp);
            medians.push((tcp as f64, median(&v)));
            p95s.push((tcp as f64, percentile(&v, 95.0)));
        }
        series.push(Series {
            name: format!("{mode}, median"),
            points: medians,
        });
        series.push(Series {
            name: format!("{mode}, p95"),
            points: p95s,
        });
    }
    Chart {
        title: format!("Freeze time by established TCP connections ({runs} migrations each)"),
        x_label: "established TCP connections".into(),
        y_label: "freeze (ms)".into(),
        y_range: None,
        x_log2: true,
        series,
    }
    .render()
}

fn tables(
    rows: &[Row],
    args: &Args,
    modes: &[(&'static str, SocketMigration)],
    backlog_size: u32,
) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "{} migrations per connection count and mode, {} build ({} UDP players beside the TCP clients{}{}); medians, p95 of the freeze. The gap beyond the interval is each client's longest silence less its 50 ms send interval; the replay runs after the resume, outside the freeze; backlog drops are the machine's input backlog's ({backlog_size} packets per CPU) over the whole migration (in brackets: during the destination's replay).\n",
        args.runs,
        ferry_bench::run::profile(),
        args.udp,
        if args.db {
            ", and the server's session to PostgreSQL on another node, kept through every migration"
        } else {
            ""
        },
        if args.bystanders > 0 {
            format!(
                "; {} established connections of another server on each of the two nodes",
                args.bystanders
            )
        } else {
            String::new()
        }
    );
    let _ = writeln!(
        t,
        "| TCP conns | mode | freeze median (ms) | freeze p95 (ms) | dump | transfer | restore | bytes in freeze | image files | TCP gap, median client (ms) | gap beyond the interval, median / p99 client (ms) | worst gap (ms) | replay after the resume (ms) | packets replayed | TCP RTOs | UDP lost | backlog drops (in the replay) |"
    );
    let _ = writeln!(
        t,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for &tcp in &args.tcp.0 {
        for &(mode, _) in modes {
            let rs: Vec<&Row> = rows
                .iter()
                .filter(|r| r.tcp == tcp && r.mode == mode)
                .collect();
            if rs.is_empty() {
                continue;
            }
            let m = Summary::of(&rs);
            if mode == PAUSE {
                let _ = writeln!(
                    t,
                    "| {tcp} | {mode} (in place) | {:.1} | {:.1} | - | - | - | - | - | {:.1} | {:.1} / {:.1} | {:.1} | - | - | {:.0} | {:.0} | {:.0} |",
                    m.freeze,
                    m.freeze_p95,
                    m.gap_median,
                    m.gap_beyond_median,
                    m.gap_beyond_p99,
                    m.gap_max,
                    m.rtos,
                    m.udp_lost,
                    m.backlog_drops,
                );
                continue;
            }
            let _ = writeln!(
                t,
                "| {tcp} | {mode} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.1} | {:.1} / {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} | {:.0} ({:.0}) |",
                m.freeze,
                m.freeze_p95,
                m.dump,
                m.transfer,
                m.restore,
                m.bytes,
                m.image_files,
                m.gap_median,
                m.gap_beyond_median,
                m.gap_beyond_p99,
                m.gap_max,
                m.replay_duration,
                m.replayed,
                m.rtos,
                m.udp_lost,
                m.backlog_drops,
                m.replay_backlog_drops,
            );
        }
    }
    udp_table(&mut t, rows, args, modes);
    parts_table(&mut t, rows, args, modes);
    let list = |v: &[usize]| {
        v.iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let _ = writeln!(
        t,
        "\nReproduce: `cargo xtask bench freeze -- --runs {} --tcp={} --udp {} --udp-only={} --db {} --bulk {} --bystanders {} --drain-ms {} --modes {} --strategy {} --input-backlog {}` (root; 2 cores here).",
        args.runs,
        list(&args.tcp.0),
        args.udp,
        list(&args.udp_only.0),
        args.db,
        args.bulk,
        args.bystanders,
        args.drain_ms,
        args.modes.join(","),
        args.strategy.name(),
        args.input_backlog
    );
    t
}

/// The medians of one count and mode's migrations, and the p95 of their
/// freeze.
struct Summary {
    freeze: f64,
    freeze_p95: f64,
    dump: f64,
    transfer: f64,
    restore: f64,
    bytes: f64,
    image_files: f64,
    gap_median: f64,
    gap_max: f64,
    rtos: f64,
    udp_lost: f64,
    backlog_drops: f64,
    gap_beyond_median: f64,
    gap_beyond_p99: f64,
    replay_duration: f64,
    replayed: f64,
    replay_backlog_drops: f64,
}

impl Summary {
    fn of(rs: &[&Row]) -> Self {
        let med = |f: fn(&Row) -> f64| {
            let v: Vec<f64> = rs.iter().map(|r| f(r)).collect();
            median_unsorted(&v)
        };
        let freezes: Vec<f64> = rs.iter().map(|r| r.freeze_ms).collect();
        Self {
            freeze: med(|r| r.freeze_ms),
            freeze_p95: percentile(&freezes, 95.0),
            dump: med(|r| r.dump_ms),
            transfer: med(|r| r.transfer_ms),
            restore: med(|r| r.restore_ms),
            bytes: med(|r| r.frozen_bytes as f64),
            image_files: med(|r| r.image_files as f64),
            gap_median: med(|r| r.gap_median_ms),
            gap_max: med(|r| r.gap_max_ms),
            rtos: med(|r| r.rtos as f64),
            udp_lost: med(|r| r.udp_lost as f64),
            backlog_drops: med(|r| r.backlog_drops as f64),
            gap_beyond_median: med(|r| r.gap_beyond_median_ms),
            gap_beyond_p99: med(|r| r.gap_beyond_p99_ms),
            replay_duration: med(|r| r.replay_duration_ms),
            replayed: med(|r| r.replayed as f64),
            replay_backlog_drops: med(|r| r.replay_backlog_drops as f64),
        }
    }
}

/// The UDP-only server's rows: no TCP client, so no TCP gap or RTO.
fn udp_table(t: &mut String, rows: &[Row], args: &Args, modes: &[(&'static str, SocketMigration)]) {
    if args.udp_only.0.is_empty() {
        return;
    }
    let _ = writeln!(
        t,
        "\nThe UDP server alone (players at 20 Hz, no TCP client), medians, p95 of the freeze:\n"
    );
    let _ = writeln!(
        t,
        "| UDP players | mode | freeze median (ms) | freeze p95 (ms) | dump | transfer | restore | bytes in freeze | worst gap (ms) | replay after the resume (ms) | packets replayed | UDP lost | backlog drops (in the replay) |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for &udp in &args.udp_only.0 {
        for &(mode, _) in modes {
            let rs: Vec<&Row> = rows
                .iter()
                .filter(|r| r.tcp == 0 && r.udp == udp && r.mode == mode)
                .collect();
            if rs.is_empty() {
                continue;
            }
            let m = Summary::of(&rs);
            if mode == PAUSE {
                let _ = writeln!(
                    t,
                    "| {udp} | {mode} (in place) | {:.1} | {:.1} | - | - | - | - | {:.1} | - | - | {:.0} | {:.0} |",
                    m.freeze, m.freeze_p95, m.gap_max, m.udp_lost, m.backlog_drops,
                );
                continue;
            }
            let _ = writeln!(
                t,
                "| {udp} | {mode} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} ({:.0}) |",
                m.freeze,
                m.freeze_p95,
                m.dump,
                m.transfer,
                m.restore,
                m.bytes,
                m.gap_max,
                m.replay_duration,
                m.replayed,
                m.udp_lost,
                m.backlog_drops,
                m.replay_backlog_drops,
            );
        }
    }
}

/// Medians of every part of the freeze, one column per count and mode: the
/// main table folds them into dump, transfer, restore and replay.
fn parts_table(
    t: &mut String,
    rows: &[Row],
    args: &Args,
    modes: &[(&'static str, SocketMigration)],
) {
    let mut names: Vec<&str> = Vec::new();
    for r in rows {
        for (name, _) in &r.parts {
            if !names.contains(&name.as_str()) {
                names.push(name);
            }
        }
    }
    let columns: Vec<(usize, &str)> = args
        .tcp
        .0
        .iter()
        .flat_map(|&tcp| modes.iter().map(move |&(mode, _)| (tcp, mode)))
        .filter(|&(tcp, mode)| mode != PAUSE && rows.iter().any(|r| r.tcp == tcp && r.mode == mode))
        .collect();
    if names.is_empty() || columns.is_empty() {
        return;
    }
    let _ = writeln!(t, "\nParts of the freeze, medians (ms):\n");
    let _ = write!(t, "| part |");
    for (tcp, mode) in &columns {
        let _ = write!(t, " {tcp} {mode} |");
    }
    let _ = writeln!(t, "\n|---|{}", "---:|".repeat(columns.len()));
    for name in names {
        let _ = write!(t, "| {name} |");
        for &(tcp, mode) in &columns {
            let mut v: Vec<f64> = rows
                .iter()
                .filter(|r| r.tcp == tcp && r.mode == mode)
                .map(|r| {
                    r.parts
                        .iter()
                        .filter(|(n, _)| n == name)
                        .map(|(_, ms)| ms)
                        .sum()
                })
                .collect();
            v.sort_by(f64::total_cmp);
            let _ = write!(t, " {:.1} |", median(&v));
        }
        let _ = writeln!(t);
    }
}
