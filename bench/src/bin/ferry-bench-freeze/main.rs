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

mod migrate;
mod report;
mod row;

use migrate::*;
use report::*;
use row::*;

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
