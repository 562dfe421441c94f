//! `cargo xtask bench algorithms`: the memory-transfer algorithms side by
//! side (Noack (2003), tables 5.1, 5.3 and 5.6), over cluster links shaped
//! to 10 Mb/s, 100 Mb/s and 1 Gb/s (`tbf` on every node's cluster
//! interface).
//!
//! The processes, all `ferry-memwriter`, which checks after every migration
//! that its memory is exactly what it wrote (a mismatch stops the bench):
//!
//! - `getpid`: a light-weight process calling getpid(2) in a loop;
//! - `rma`: 4 MiB written at random, as fast as it can (no pause);
//! - `reference`: 100 KiB, all of it written over and over, with
//!   computation (the pattern) in between;
//! - `big`: `--big-mib` MiB (default 1024) with `--big-writes-per-ms` page
//!   writes per millisecond, 90 % of them to 5 % of the pages; only on the
//!   links in `--big-links` (default 1gbit: a GiB takes 15 minutes at
//!   10 Mb/s).
//!
//! Each process moves node1 -> node2 -> node1 ..., `--runs` times per
//! strategy, strategies interleaved. Per migration: preparation, down
//! (freeze), post-processing and total time, bytes sent, pre-copy rounds
//! and why they ended. Prints one table per process and link with medians,
//! next to Noack's figures where the thesis has them; writes CSV, Markdown
//! and an SVG plot of the downtimes to `--out` (default
//! `target/bench/algorithms`).

use std::fmt::Write as _;
use std::net::SocketAddrV4;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use ferry_bench::run::strategy_of;
use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{migrate_request, run, wait_for_process};
use ferry_integration::workload::request_line;
use ferry_proto::v1::{MigrateRequest, MigrationOutcome, MigrationReport};

#[derive(Debug, Parser)]
#[command(
    name = "ferry-bench-algorithms",
    about = "total copy vs pre-copy vs queued pre-copy over shaped links"
)]
struct Args {
    /// Migrations per process, link and strategy.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Link rates (tc syntax), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "10mbit,100mbit,1gbit")]
    links: Vec<String>,
    /// Processes, comma-separated (getpid, rma, reference, big).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "getpid,rma,reference,big"
    )]
    processes: Vec<String>,
    /// Strategies, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "total-copy,pre-copy,queued-pre-copy,post-copy,assisted-post-copy"
    )]
    strategies: Vec<String>,
    /// Pre-copy's downtime budget in ms (0: the agent's default).
    #[arg(long, default_value_t = 0)]
    downtime_budget_ms: u32,
    /// Pre-copy's throttle: "auto", "off" (default: the agent's).
    #[arg(long, value_parser = ["auto", "off"])]
    throttle: Option<String>,
    #[arg(long, default_value_t = 1024)]
    big_mib: usize,
    #[arg(long, default_value_t = 5)]
    big_writes_per_ms: u32,
    /// Links the big process runs on.
    #[arg(long, value_delimiter = ',', default_value = "1gbit")]
    big_links: Vec<String>,
    #[arg(long, default_value = "target/bench/algorithms")]
    out: PathBuf,
}

/// A table of Noack (2003): its name, and (preparation, down,
/// post-processing, total) in ms by strategy.
type NoackTable = (&'static str, [(&'static str, [f64; 4]); 3]);

/// Noack (2003)'s figures for the process and link the thesis measured.
fn noack_figures(process: &str, link: &str) -> Option<NoackTable> {
    match (process, link) {
        ("getpid", "1gbit") => Some((
            "table 5.1",
            [
                ("total-copy", [0.0, 2.6, 0.0, 2.6]),
                ("pre-copy", [1.9, 1.0, 0.0, 2.9]),
                ("queued-pre-copy", [0.9, 1.8, 0.0, 2.7]),
            ],
        )),
        ("rma", "1gbit") => Some((
            "table 5.3",
            [
                ("total-copy", [0.0, 82.9, 0.0, 82.9]),
                ("pre-copy", [365.5, 58.0, 0.0, 423.5]),
                ("queued-pre-copy", [36.1, 56.3, 0.0, 92.4]),
            ],
        )),
        ("reference", "10mbit") => Some((
            "table 5.6",
            [
                ("total-copy", [0.0, 88.5, 0.0, 88.5]),
                ("pre-copy", [52.4, 36.5, 0.0, 88.9]),
                ("queued-pre-copy", [37.1, 51.4, 0.0, 88.5]),
            ],
        )),
        _ => None,
    }
}

/// The writer's arguments for a process kind.
fn writer_args(args: &Args, process: &str) -> Result<Vec<String>> {
    let a: Vec<String> = match process {
        "getpid" => vec!["--mode", "getpid", "--kib", "16", "--busy"]
            .into_iter()
            .map(String::from)
            .collect(),
        "rma" => vec![
            "--kib",
            "4096",
            "--writes-per-ms",
            "64",
            "--hot-percent",
            "100",
            "--busy",
        ]
        .into_iter()
        .map(String::from)
        .collect(),
        "reference" => vec![
            "--kib",
            "100",
            "--writes-per-ms",
            "25",
            "--hot-percent",
            "100",
        ]
        .into_iter()
        .map(String::from)
        .collect(),
        "big" => vec![
            "--mib".to_owned(),
            args.big_mib.to_string(),
            "--writes-per-ms".to_owned(),
            args.big_writes_per_ms.to_string(),
        ],
        other => bail!("unknown process {other:?}"),
    };
    Ok(a)
}

#[derive(Debug, Clone)]
struct Row {
    link: String,
    process: String,
    strategy: String,
    run: usize,
    preparation_ms: f64,
    down_ms: f64,
    post_ms: f64,
    total_ms: f64,
    bytes: u64,
    rounds: usize,
    freeze_pages: u64,
    dumped_pages: u64,
    convergence: String,
    /// The freeze's parts, "name ms; ...".
    freeze_parts: String,
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One command to the writer on `port`, from client1.
fn ask(cluster: &Cluster, port: u16, command: &str) -> Result<String> {
    let target = SocketAddrV4::new(cluster.public_addr(), port);
    Ok(request_line(
        &cluster.netns_path("client1"),
        target,
        command,
        Duration::from_secs(60),
    )?)
}

/// Shapes every node's cluster interface to `rate` (token bucket, a burst
/// of 10 ms at that rate).
fn shape(cluster: &Cluster, rate: &str) -> Result<()> {
    let bits = parse_rate(rate)?;
    let burst = (bits / 8 / 100).max(16 * 1024);
    for node in cluster.node_names() {
        let ns = cluster.netns_path(&node);
        let status = std::process::Command::new("nsenter")
            .arg(format!("--net={}", ns.display()))
            .args([
                "tc", "qdisc", "replace", "dev", "clu0", "root", "tbf", "rate", rate,
            ])
            .args(["burst", &burst.to_string(), "latency", "100ms"])
            .status()
            .context("running tc")?;
        if !status.success() {
            bail!("tc tbf on {node}'s clu0 failed: {status}");
        }
    }
    Ok(())
}

fn parse_rate(rate: &str) -> Result<u64> {
    let (num, mul) = if let Some(n) = rate.strip_suffix("gbit") {
        (n, 1_000_000_000)
    } else if let Some(n) = rate.strip_suffix("mbit") {
        (n, 1_000_000)
    } else if let Some(n) = rate.strip_suffix("kbit") {
        (n, 1_000)
    } else {
        bail!("{rate:?}: give a rate like 10mbit or 1gbit");
    };
    Ok(num.parse::<u64>().context("rate")? * mul)
}

fn row_of(link: &str, process: &str, strategy: &str, run: usize, r: &MigrationReport) -> Row {
    Row {
        link: link.to_owned(),
        process: process.to_owned(),
        strategy: strategy.to_owned(),
        run,
        preparation_ms: ms(r.preparation_time_us),
        down_ms: ms(r.freeze_time_us),
        post_ms: ms(r.post_processing_time_us),
        total_ms: ms(r.total_time_us),
        bytes: r.bytes_transferred,
        rounds: r.rounds.len(),
        freeze_pages: r.freeze_pages,
        dumped_pages: r.dumped_pages,
        convergence: r.convergence.clone(),
        freeze_parts: r
            .freeze_parts
            .iter()
            .filter(|p| p.duration_us >= 1000)
            .map(|p| format!("{} {:.0}", p.phase, ms(p.duration_us)))
            .collect::<Vec<_>>()
            .join("; "),
    }
}

async fn bench_process(
    cluster: &Cluster,
    args: &Args,
    link: &str,
    process: &str,
    port: u16,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let mut controls = [
        cluster.control("node1").await?,
        cluster.control("node2").await?,
    ];
    let mut argv = vec![
        ferry_integration::bin_path("ferry-memwriter")
            .to_string_lossy()
            .into_owned(),
        "--port".into(),
        port.to_string(),
    ];
    argv.extend(writer_args(args, process)?);
    let mut pid = run(&mut controls[0], argv).await;
    wait_for_process(&mut controls[0], pid, |p| p.tcp_listening == 1).await;
    let mut on = 0usize;
    for run_no in 0..args.runs {
        for strategy in &args.strategies {
            let to = 1 - on;
            let (report, status) = migrate_request(
                &mut controls[on],
                MigrateRequest {
                    pid,
                    destination_node: format!("node{}", to + 1),
                    strategy: strategy_of(strategy)? as i32,
                    downtime_budget_ms: args.downtime_budget_ms,
                    throttle: match args.throttle.as_deref() {
                        Some("auto") => ferry_proto::v1::PrecopyThrottle::Auto,
                        Some("off") => ferry_proto::v1::PrecopyThrottle::Off,
                        _ => ferry_proto::v1::PrecopyThrottle::Unspecified,
                    } as i32,
                    ..Default::default()
                },
            )
            .await?;
            if let Some(s) = status {
                bail!("{process} over {link}, {strategy}: migration failed: {s:?}\n{report:#?}");
            }
            if report.outcome != MigrationOutcome::Committed as i32 {
                bail!("{process} over {link}, {strategy}: not committed: {report:#?}");
            }
            let check = ask(cluster, port, "check")?;
            if !check.starts_with("ok") {
                bail!(
                    "{process} over {link}, {strategy}: memory check after the migration: {check}"
                );
            }
            let row = row_of(link, process, strategy, run_no, &report);
            println!(
                "{:<7} {:<9} {:<15} run {:>2}: prep {:>9.1}  down {:>8.1}  total {:>9.1} ms  {:>11} B  {} rounds {} [{}]",
                row.link,
                row.process,
                row.strategy,
                row.run,
                row.preparation_ms,
                row.down_ms,
                row.total_ms,
                row.bytes,
                row.rounds,
                row.convergence,
                row.freeze_parts
            );
            rows.push(row);
            pid = report.destination_pid;
            on = to;
        }
    }
    // Gone for good: a process the agents manage, killed by PID.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    ferry_integration::managed::wait_until_gone(pid);
    Ok(())
}

fn tables(rows: &[Row], args: &Args) -> String {
    let mut md = String::new();
    for process in &args.processes {
        for link in &args.links {
            let of: Vec<&Row> = rows
                .iter()
                .filter(|r| &r.process == process && &r.link == link)
                .collect();
            if of.is_empty() {
                continue;
            }
            let _ = writeln!(
                md,
                "\n### {process}, {link} (medians of {} runs, ms)\n",
                args.runs
            );
            let noack = noack_figures(process, link);
            let _ = writeln!(
                md,
                "| strategy | preparation | down | post-processing | total | bytes | rounds | pages in freeze |{}",
                noack
                    .map(|(t, _)| format!(" Noack (2003) {t}: prep / down / post / total |"))
                    .unwrap_or_default()
            );
            let _ = writeln!(
                md,
                "|---|---:|---:|---:|---:|---:|---:|---:|{}",
                if noack.is_some() { "---:|" } else { "" }
            );
            for strategy in &args.strategies {
                let s: Vec<&&Row> = of.iter().filter(|r| &r.strategy == strategy).collect();
                if s.is_empty() {
                    continue;
                }
                let m = |f: fn(&Row) -> f64| median(s.iter().map(|r| f(r)).collect());
                let noack_cell = noack
                    .and_then(|(_, fig)| fig.iter().find(|(n, _)| n == strategy).map(|(_, v)| *v))
                    .map(|v| format!(" {} / {} / {} / {} |", v[0], v[1], v[2], v[3]))
                    // A strategy the thesis's table lacks (post-copy here).
                    .unwrap_or_else(|| {
                        if noack.is_some() {
                            " – |".into()
                        } else {
                            String::new()
                        }
                    });
                let _ = writeln!(
                    md,
                    "| {strategy} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} of {:.0} |{noack_cell}",
                    m(|r| r.preparation_ms),
                    m(|r| r.down_ms),
                    m(|r| r.post_ms),
                    m(|r| r.total_ms),
                    m(|r| r.bytes as f64),
                    m(|r| r.rounds as f64),
                    m(|r| r.freeze_pages as f64),
                    m(|r| r.dumped_pages as f64),
                );
            }
        }
    }
    md
}

/// Grouped bars of the median downtime: one panel per process, one group
/// per link, one bar per strategy.
fn plot(rows: &[Row], args: &Args) -> String {
    let colors = ["#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee"];
    let panel_w = 360.0;
    let panel_h = 240.0;
    let procs: Vec<&String> = args
        .processes
        .iter()
        .filter(|p| rows.iter().any(|r| &r.process == *p))
        .collect();
    let width = panel_w * procs.len().max(1) as f64 + 40.0;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n",
        panel_h + 80.0
    );
    for (pi, process) in procs.iter().enumerate() {
        let x0 = 20.0 + pi as f64 * panel_w;
        let meds: Vec<(String, String, f64)> = args
            .links
            .iter()
            .flat_map(|l| args.strategies.iter().map(move |s| (l.clone(), s.clone())))
            .map(|(l, s)| {
                let v = median(
                    rows.iter()
                        .filter(|r| &r.process == *process && r.link == l && r.strategy == s)
                        .map(|r| r.down_ms)
                        .collect(),
                );
                (l, s, v)
            })
            .collect();
        let max = meds
            .iter()
            .map(|m| m.2)
            .filter(|v| v.is_finite())
            .fold(1.0f64, f64::max);
        let _ = writeln!(
            svg,
            "<text x=\"{}\" y=\"16\" font-weight=\"bold\">{process}: downtime (ms), max {max:.0}</text>",
            x0
        );
        let group_w = (panel_w - 40.0) / args.links.len().max(1) as f64;
        let bar_w = group_w / (args.strategies.len() as f64 + 1.0);
        for (li, link) in args.links.iter().enumerate() {
            let gx = x0 + 10.0 + li as f64 * group_w;
            let _ = writeln!(
                svg,
                "<text x=\"{}\" y=\"{}\">{link}</text>",
                gx + bar_w * 0.5,
                panel_h + 40.0
            );
            for (si, strategy) in args.strategies.iter().enumerate() {
                let v = meds
                    .iter()
                    .find(|m| &m.0 == link && &m.1 == strategy)
                    .map(|m| m.2)
                    .unwrap_or(f64::NAN);
                if !v.is_finite() {
                    continue;
                }
                let h = v / max * panel_h;
                let _ = writeln!(
                    svg,
                    "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\"><title>{strategy} {v:.1} ms</title></rect>",
                    gx + si as f64 * bar_w,
                    25.0 + panel_h - h,
                    bar_w * 0.9,
                    h,
                    colors[si % colors.len()]
                );
            }
        }
    }
    for (si, strategy) in args.strategies.iter().enumerate() {
        let _ = writeln!(
            svg,
            "<rect x=\"{}\" y=\"{}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{}\" y=\"{}\">{strategy}</text>",
            20.0 + si as f64 * 140.0,
            panel_h + 55.0,
            colors[si % colors.len()],
            34.0 + si as f64 * 140.0,
            panel_h + 64.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn main() -> Result<()> {
    let args = Args::parse();
    for s in &args.strategies {
        strategy_of(s)?;
    }
    let rt = ferry_integration::managed::runtime();
    let mut rows = Vec::new();
    for link in &args.links {
        let cluster = Cluster::start(ClusterSpec::new(2, 1)).context("starting the cluster")?;
        shape(&cluster, link)?;
        for (i, process) in args.processes.iter().enumerate() {
            if process == "big" && !args.big_links.contains(link) {
                continue;
            }
            let port = 7400 + i as u16;
            rt.block_on(bench_process(
                &cluster, &args, link, process, port, &mut rows,
            ))?;
        }
    }
    std::fs::create_dir_all(&args.out)?;
    let mut csv = String::from(
        "link,process,strategy,run,preparation_ms,down_ms,post_processing_ms,total_ms,bytes,rounds,freeze_pages,dumped_pages,convergence,freeze_parts\n",
    );
    for r in &rows {
        let _ = writeln!(
            csv,
            "{},{},{},{},{:.3},{:.3},{:.3},{:.3},{},{},{},{},{},\"{}\"",
            r.link,
            r.process,
            r.strategy,
            r.run,
            r.preparation_ms,
            r.down_ms,
            r.post_ms,
            r.total_ms,
            r.bytes,
            r.rounds,
            r.freeze_pages,
            r.dumped_pages,
            r.convergence,
            r.freeze_parts
        );
    }
    std::fs::write(args.out.join("algorithms.csv"), csv)?;
    let md = tables(&rows, &args);
    std::fs::write(args.out.join("algorithms.md"), &md)?;
    std::fs::write(args.out.join("algorithms.svg"), plot(&rows, &args))?;
    println!("{md}");
    println!("written to {}", args.out.display());
    Ok(())
}
