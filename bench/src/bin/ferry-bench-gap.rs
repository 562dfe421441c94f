//! `cargo xtask bench gap`: what clients see of a migration, with ferry's
//! capture and replay against plain CRIU with drop-and-retransmit
//! (`[dataplane] capture = false`), in one run.
//!
//! Per mode: a 2-node cluster, the DVE server (`ferry-dve-server`, TCP and
//! UDP echo on one port), and for every migration fresh clients: `--tcp`
//! DVE connections sending 256 bytes every 50 ms (the zone clients of
//! Gerofi et al. (DVE)) and `--udp` players sending sequence-numbered
//! datagrams at 20 Hz (its OpenArena setup). The server moves node1 ->
//! node2 -> node1 ... `--runs` times. Per migration, measured at the
//! clients:
//!
//! - gap: the longest silence a client saw (the last echo from the source
//!   to the first from the destination; it includes up to one 50 ms send
//!   interval), median over the TCP connections, and the worst of all TCP
//!   and UDP clients;
//! - UDP datagrams lost and duplicated;
//! - RSTs and ICMP unreachables that reached a client (packet socket), and
//!   connections reset (`TcpEstabResets`);
//! - the clients' TCP retransmitted segments and retransmission timeouts
//!   (`TcpRetransSegs`, `TcpExtTCPTimeouts`).
//!
//! Prints one row per migration, then medians per mode; writes them as CSV
//! and Markdown to `--out` (default `target/bench/gap`).

use std::fmt::Write as _;
use std::net::SocketAddrV4;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use ferry_bench::stats::{median, median_unsorted};
use ferry_integration::answer_watch::AnswerWatch;
use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{migrate, run, wait_for_process};
use ferry_integration::nstat::Nstat;
use ferry_integration::workload::{SeqClient, UdpClients};
use ferry_proto::v1::MigrationOutcome;

const PORT: u16 = 7000;
const INTERVAL: Duration = Duration::from_millis(50);

#[derive(Debug, Parser)]
#[command(
    name = "ferry-bench-gap",
    about = "client-perceived migration gap: capture/replay vs drop"
)]
struct Args {
    /// Migrations per mode.
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// TCP DVE connections.
    #[arg(long, default_value_t = 64)]
    tcp: usize,
    /// UDP players.
    #[arg(long, default_value_t = 24)]
    udp: usize,
    /// Where the CSV and Markdown tables go.
    #[arg(long, default_value = "target/bench/gap")]
    out: PathBuf,
    /// Also run the same clients without migrating ("no migration"), for
    /// what the clients and the server lose by themselves at this load.
    #[arg(long)]
    baseline: bool,
}

/// How long a baseline round stands in for a migration: about what one
/// takes from request to report at 1024 connections here.
const BASELINE_PAUSE: Duration = Duration::from_millis(800);

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Capture,
    Drop,
    /// The same clients, no migration.
    Baseline,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Capture => "capture+replay",
            Mode::Drop => "drop+retransmit",
            Mode::Baseline => "no migration",
        }
    }
}

#[derive(Debug, Clone)]
struct Row {
    mode: Mode,
    run: usize,
    freeze_ms: f64,
    tcp_gap_median_ms: f64,
    gap_max_ms: f64,
    udp_lost: u64,
    /// Datagrams the destination's stack dropped for a full socket buffer
    /// (`UdpRcvbufErrors` in its namespace across the migration): where
    /// the lost ones went, if there.
    udp_rcvbuf_drops: u64,
    udp_duplicates: u64,
    answers: usize,
    resets: u64,
    retrans_segs: u64,
    timeouts: u64,
    replayed: u64,
}

const HEADER: [&str; 13] = [
    "mode",
    "run",
    "freeze_ms",
    "tcp_gap_median_ms",
    "gap_max_ms",
    "udp_lost",
    "udp_rcvbuf_drops",
    "udp_dup",
    "rst_icmp_seen",
    "conn_resets",
    "tcp_retrans_segs",
    "tcp_timeouts",
    "replayed",
];

impl Row {
    fn cells(&self) -> Vec<String> {
        vec![
            self.mode.name().to_owned(),
            self.run.to_string(),
            format!("{:.1}", self.freeze_ms),
            format!("{:.1}", self.tcp_gap_median_ms),
            format!("{:.1}", self.gap_max_ms),
            self.udp_lost.to_string(),
            self.udp_rcvbuf_drops.to_string(),
            self.udp_duplicates.to_string(),
            self.answers.to_string(),
            self.resets.to_string(),
            self.retrans_segs.to_string(),
            self.timeouts.to_string(),
            self.replayed.to_string(),
        ]
    }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if let Some(reason) = ferry_integration::skip_reason() {
        eprintln!("bench gap needs {reason}");
        return std::process::ExitCode::FAILURE;
    }
    match bench(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench gap failed: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn modes(args: &Args) -> Vec<Mode> {
    let mut modes = vec![Mode::Capture, Mode::Drop];
    if args.baseline {
        modes.push(Mode::Baseline);
    }
    modes
}

fn bench(args: &Args) -> Result<()> {
    if args.runs == 0 || args.tcp == 0 {
        bail!("--runs and --tcp must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    println!(
        "bench gap: {} migrations per mode; {} TCP clients (256 B / 50 ms), {} UDP players (20 Hz)\n",
        args.runs, args.tcp, args.udp
    );
    println!("{}", HEADER.join("\t"));
    let mut rows = Vec::new();
    for mode in modes(args) {
        let mut spec = ClusterSpec::new(2, 2);
        if mode == Mode::Drop {
            spec.capture = false;
        }
        let cluster = Cluster::start(spec).context("cluster")?;
        rt.block_on(migrations(&cluster, mode, args, &mut rows))?;
    }
    let report = tables(&rows, args);
    println!("\n{report}");
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let mut csv = HEADER.join(",") + "\n";
    for r in &rows {
        csv += &(r.cells().join(",") + "\n");
    }
    std::fs::write(args.out.join("gap.csv"), csv)?;
    std::fs::write(args.out.join("gap.md"), &report)?;
    println!("written: {0}/gap.csv, {0}/gap.md", args.out.display());
    Ok(())
}

async fn migrations(cluster: &Cluster, mode: Mode, args: &Args, rows: &mut Vec<Row>) -> Result<()> {
    let nodes = ["node1", "node2"];
    let mut here = 0;
    let mut control = cluster.control(nodes[here]).await?;
    let server = vec![
        ferry_integration::bin_path("ferry-dve-server")
            .display()
            .to_string(),
        "--port".into(),
        PORT.to_string(),
    ];
    let mut pid = run(&mut control, server).await;
    // Its UDP port claimed too: until then no node takes the players'
    // datagrams, which would count as lost.
    wait_for_process(&mut control, pid, |p| {
        p.tcp_listening == 1 && p.udp_sockets == 1
    })
    .await;
    let target = SocketAddrV4::new(cluster.public_addr(), PORT);
    let clients = [cluster.netns_path("client1"), cluster.netns_path("client2")];
    for run in 0..args.runs {
        let tcp = SeqClient::start(clients[0].clone(), target, args.tcp, INTERVAL, 256)?;
        let udp = UdpClients::start(clients[1].clone(), target, args.udp, INTERVAL, 96)?;
        tcp.wait_until_flowing(Duration::from_secs(20))?;
        udp.wait_for_echoes(args.udp as u64 * 10, Duration::from_secs(10))
            .map_err(anyhow::Error::msg)?;
        let watches = [
            AnswerWatch::start(clients[0].clone())?,
            AnswerWatch::start(clients[1].clone())?,
        ];
        let before = [Nstat::read(&clients[0])?, Nstat::read(&clients[1])?];
        // Where the server's receive buffers are counted: the node it
        // moves to (the one it stays on, without a migration).
        let to_netns = cluster.netns_path(if mode == Mode::Baseline {
            nodes[here]
        } else {
            nodes[1 - here]
        });
        let to_before = Nstat::read(&to_netns)?;

        let tcp_before = tcp.verified_per_connection();

        let (freeze_ms, replayed) = if mode == Mode::Baseline {
            tokio::time::sleep(BASELINE_PAUSE).await;
            (0.0, 0)
        } else {
            let to = nodes[1 - here];
            let (report, status) = migrate(&mut control, pid, to)
                .await
                .context("starting the migration")?;
            if status.is_some() || report.outcome != MigrationOutcome::Committed as i32 {
                bail!(
                    "{} run {run}: migration failed: {status:?} {}",
                    mode.name(),
                    report.error
                );
            }
            here = 1 - here;
            pid = report.destination_pid;
            control = cluster.control(nodes[here]).await?;
            wait_for_process(&mut control, pid, |p| p.state == "running").await;
            (
                report.freeze_time_us as f64 / 1e3,
                report.replay.map(|r| r.replayed).unwrap_or(0),
            )
        };

        tcp.wait_until_each_passes(&tcp_before, 20, Duration::from_secs(30))?;
        let seen = udp.echoed();
        udp.wait_for_echoes(seen + args.udp as u64 * 20, Duration::from_secs(30))
            .map_err(anyhow::Error::msg)?;
        let after = [Nstat::read(&clients[0])?, Nstat::read(&clients[1])?];
        let to_after = Nstat::read(&to_netns)?;
        // The watches end before the clients close their connections: the
        // server's answers to the clients' own teardown are not the
        // migration's doing.
        let mut seen_answers = Vec::new();
        for w in watches {
            seen_answers.extend(w.stop()?.answers);
        }
        let tcp_report = tcp.stop();
        let udp_report = udp.stop()?;
        if !seen_answers.is_empty() {
            let shown: Vec<_> = seen_answers.iter().take(5).collect();

            eprintln!(
                "{} run {run}: answers at the clients: {shown:?}",
                mode.name()
            );
        }
        let answers = seen_answers.len();
        let d0 = after[0].since(&before[0]);
        let d1 = after[1].since(&before[1]);

        let mut gaps: Vec<f64> = tcp_report
            .connections
            .iter()
            .filter_map(|c| c.max_gap.as_ref())
            .map(|g| g.duration.as_secs_f64() * 1e3)
            .collect();
        gaps.sort_by(f64::total_cmp);
        let tcp_max = gaps.last().copied().unwrap_or(0.0);
        let row = Row {
            mode,
            run,
            freeze_ms,
            tcp_gap_median_ms: median(&gaps),
            gap_max_ms: tcp_max.max(udp_report.max_gap().as_secs_f64() * 1e3),
            udp_lost: udp_report.lost(),
            udp_rcvbuf_drops: to_after.since(&to_before).get("UdpRcvbufErrors")?,
            udp_duplicates: udp_report.duplicates(),
            answers,
            resets: d0.get("TcpEstabResets")? + d1.get("TcpEstabResets")?,
            retrans_segs: d0.get("TcpRetransSegs")?,
            timeouts: d0.get("TcpExtTCPTimeouts")?,
            replayed,
        };
        if !tcp_report.failures().is_empty() {
            bail!(
                "{} run {run}: TCP streams failed: {:?}",
                mode.name(),
                tcp_report.failures()
            );
        }
        println!("{}", row.cells().join("\t"));
        rows.push(row);
    }
    Ok(())
}

fn median_of(rows: &[&Row], f: impl Fn(&Row) -> f64) -> f64 {
    let v: Vec<f64> = rows.iter().map(|r| f(r)).collect();
    median_unsorted(&v)
}

/// The per-mode medians (and worst cases) as a Markdown table.
fn tables(rows: &[Row], args: &Args) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "Medians over {} migrations per mode ({} TCP DVE clients at 20 msg/s of 256 B, {} UDP players at 20 Hz; worst case in brackets).\n",
        args.runs, args.tcp, args.udp
    );
    let _ = writeln!(
        t,
        "| mode | freeze (ms) | TCP gap, median client (ms) | worst gap, any client (ms) | UDP lost | of which rcvbuf full | UDP dup | RST/ICMP at clients | conn. resets | TCP retrans. segs | TCP RTOs |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|---|---|---|---|---|");
    for mode in [Mode::Capture, Mode::Drop, Mode::Baseline] {
        let rs: Vec<&Row> = rows.iter().filter(|r| r.mode == mode).collect();
        if rs.is_empty() {
            continue;
        }
        let worst = |f: &dyn Fn(&Row) -> f64| rs.iter().map(|r| f(r)).fold(0.0, f64::max);
        let _ = writeln!(
            t,
            "| {} | {:.1} [{:.1}] | {:.1} [{:.1}] | {:.1} [{:.1}] | {} [{}] | {} [{}] | {} [{}] | {} [{}] | {} [{}] | {} [{}] | {} [{}] |",
            mode.name(),
            median_of(&rs, |r| r.freeze_ms),
            worst(&|r| r.freeze_ms),
            median_of(&rs, |r| r.tcp_gap_median_ms),
            worst(&|r| r.tcp_gap_median_ms),
            median_of(&rs, |r| r.gap_max_ms),
            worst(&|r| r.gap_max_ms),
            median_of(&rs, |r| r.udp_lost as f64),
            worst(&|r| r.udp_lost as f64),
            median_of(&rs, |r| r.udp_rcvbuf_drops as f64),
            worst(&|r| r.udp_rcvbuf_drops as f64),
            median_of(&rs, |r| r.udp_duplicates as f64),
            worst(&|r| r.udp_duplicates as f64),
            median_of(&rs, |r| r.answers as f64),
            worst(&|r| r.answers as f64),
            median_of(&rs, |r| r.resets as f64),
            worst(&|r| r.resets as f64),
            median_of(&rs, |r| r.retrans_segs as f64),
            worst(&|r| r.retrans_segs as f64),
            median_of(&rs, |r| r.timeouts as f64),
            worst(&|r| r.timeouts as f64),
        );
    }
    let _ = writeln!(
        t,
        "\nReproduce: `cargo xtask bench gap -- --runs {} --tcp {} --udp {}{}` (root; 2 cores here).",
        args.runs,
        args.tcp,
        args.udp,
        if args.baseline { " --baseline" } else { "" }
    );
    t
}
