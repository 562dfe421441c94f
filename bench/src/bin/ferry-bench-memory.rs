//! `cargo xtask bench memory`: how the freeze, the total time, the window
//! after the resume and the destination's memory grow with the memory of the
//! process, per strategy (Noack (2003)'s five algorithms).
//!
//! The process is `ferry-memwriter` with a main region of `--sizes` MiB
//! (default 64, 1024, 4096), written at `--rates` pages per second (default
//! 0, 1,000, 20,000; 90 % of the writes to a hot 5 % of the pages), which
//! checks after every migration that all of its memory is what it wrote (a
//! mismatch stops the bench). A getpid(2) loop with almost no memory is the
//! reference the freeze is compared with (`--reference`).
//!
//! The process moves node1 -> node2 -> node1 ... `--runs` times per
//! strategy, strategies interleaved, over the cluster link unshaped and
//! shaped to 1 Gb/s (`--links`; `tbf` on each node's cluster interface).
//! Per migration: the freeze and its parts, the total time, the window after
//! the resume in which the process still depends on the source
//! (post-processing), pre-copy's pages left out of the dump and the time
//! the destination took to install them from its store after the resume
//! (local fill), bytes sent, the fill rate after the resume (post-copy's
//! from the source, pre-copy's from the store) and fault wait, and the
//! destination's peak extra memory twice: this bench's sample (the bytes
//! of its work directory, images and page store, plus the growth of its
//! agent's resident memory and the memory of the CRIU processes it runs,
//! every 20 ms from just before the migration to its end) and the
//! destination's own figure from the report.
//!
//! Writes `memory.csv` (one row per migration), `memory.md` (medians) and
//! `memory.svg` (median freeze against size, one line per strategy, at the
//! first write rate and link) to `--out` (default `target/bench/memory`).
//! Timings are what this machine measured, never pass/fail.

use std::fmt::Write as _;
use std::net::SocketAddrV4;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use ferry_bench::run::{freeze_parts, strategy_of};
use ferry_bench::stats::median_unsorted;
use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{migrate_request, wait_until_gone};
use ferry_integration::memwriter::MemWriter;
use ferry_integration::workload::request_line;
use ferry_proto::v1::{MigrateRequest, MigrationOutcome, MigrationReport};

#[derive(Debug, Parser)]
#[command(
    name = "ferry-bench-memory",
    about = "the freeze against the process's memory, per strategy"
)]
struct Args {
    /// Sizes of the written region, MiB, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64,1024,4096")]
    sizes: Vec<usize>,
    /// Page writes per second, comma-separated (0: a process that holds
    /// its memory and does not write it).
    #[arg(long, value_delimiter = ',', default_value = "0,1000,20000")]
    rates: Vec<u32>,
    /// Cluster links: "unshaped" or a tc rate ("1gbit"), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "unshaped,1gbit")]
    links: Vec<String>,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "total-copy,pre-copy,queued-pre-copy,post-copy,assisted-post-copy"
    )]
    strategies: Vec<String>,
    /// Migrations per size, rate, link and strategy.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Also migrate a getpid(2) loop with almost no memory, the reference
    /// the freeze is compared with (size 0 in the tables).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    reference: bool,
    /// Who moves post-copy's pages after the resume (`[migration]
    /// post_copy_pages` of every agent): "ferryd" or "criu".
    #[arg(long, default_value = "ferryd")]
    post_copy_pages: String,
    /// Whether pages cross compressed (`[migration] compression` of every
    /// agent): "off" (the default) or "lz4". The writer's pages
    /// are random: they do not compress.
    #[arg(long, default_value = "off", value_parser = ["off", "lz4"])]
    compression: String,
    /// Mutual TLS between the agents (the default, as deployed); `false`
    /// runs the cluster on plain TCP, to see what encryption costs.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    tls: bool,
    /// CRIU's log level on every node (4 keeps every log, with a timestamp
    /// per line, in the node's work dir; see `FERRY_TEST_LOG_DIR`).
    #[arg(long)]
    criu_log_level: Option<u8>,
    #[arg(long, default_value = "target/bench/memory")]
    out: PathBuf,
}

/// One migration.
#[derive(Debug, Clone)]
struct Row {
    size_mib: usize,
    write_rate: u32,
    link: String,
    strategy: String,
    run: usize,
    freeze_ms: f64,
    total_ms: f64,
    /// Post-processing: the process runs on the destination and still
    /// needs the source.
    window_ms: f64,
    bytes: u64,
    dest_peak_mib: f64,
    preparation_ms: f64,
    /// Pages sent before the freeze, and in it.
    precopied_pages: u64,
    freeze_pages: u64,
    /// Post-copy: pages that came after the resume, and from where.
    postcopy_pages: u64,
    postcopy_local_pages: u64,
    /// Pre-copy: pages left out of the dump, installed from the
    /// destination's store after the resume, and how long that took.
    left_out_pages: u64,
    local_fill_ms: f64,
    /// The rate of the fill after the resume, MB/s: post-copy's from the
    /// source, or pre-copy's from the store (0 without one).
    fill_mb_s: f64,
    /// Page faults answered after the resume, and their summed wait.
    faults: u64,
    fault_wait_ms: f64,
    /// The destination's own figure for its peak extra memory
    /// (`destination_peak_extra_bytes`), beside this bench's sample.
    dest_reported_peak_mib: f64,
    /// The freeze's parts, "name ms; ...".
    freeze_parts: String,
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

impl Row {
    fn of(
        (size_mib, write_rate, link): (usize, u32, &str),
        strategy: &str,
        run: usize,
        r: &MigrationReport,
        dest_peak: u64,
    ) -> Self {
        let window_ms = ms(r.post_processing_time_us);
        let local_fill_ms = ms(r.fill_time_us);
        let (fill_bytes, fill_ms) = if r.postcopy_pages > 0 {
            (r.postcopy_pages * 4096, window_ms)
        } else {
            (r.filled_pages * 4096, local_fill_ms)
        };
        Row {
            size_mib,
            write_rate,
            link: link.to_owned(),
            strategy: strategy.to_owned(),
            run,
            freeze_ms: ms(r.freeze_time_us),
            total_ms: ms(r.total_time_us),
            window_ms,
            bytes: r.bytes_transferred,
            dest_peak_mib: dest_peak as f64 / f64::from(1u32 << 20),
            preparation_ms: ms(r.preparation_time_us),
            precopied_pages: r.precopied_pages,
            freeze_pages: r.freeze_pages,
            postcopy_pages: r.postcopy_pages,
            postcopy_local_pages: r.postcopy_local_pages,
            left_out_pages: r.left_out_pages,
            local_fill_ms,
            fill_mb_s: if fill_ms > 0.0 && fill_bytes > 0 {
                fill_bytes as f64 / 1e6 / (fill_ms / 1000.0)
            } else {
                0.0
            },
            faults: r.postcopy_faults + r.fill_faults,
            fault_wait_ms: ms(r.postcopy_fault_wait_us + r.fill_fault_wait_us),
            dest_reported_peak_mib: r.destination_peak_extra_bytes as f64 / f64::from(1u32 << 20),
            freeze_parts: freeze_parts(r),
        }
    }
}

/// Bytes the files under `dir` occupy (allocated blocks, so a sparse file
/// counts what it holds).
fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}

/// A process's resident memory, bytes (0 if gone).
fn rss(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// The resident memory of the agent's CRIU children (the restore, the
/// lazy-pages daemon); not the restored process, which is not extra.
fn criu_children_rss(agent: i32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{agent}/task")) else {
        return 0;
    };
    let mut sum = 0;
    for t in tasks.flatten() {
        let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        for pid in children
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim() == "criu" {
                sum += rss(pid);
            }
        }
    }
    sum
}

/// Samples the destination's extra memory while a migration runs.
struct PeakSampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl PeakSampler {
    fn start(work_dir: PathBuf, agent: i32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let base_rss = rss(agent);
        let base_dir = dir_bytes(&work_dir);
        let thread = std::thread::spawn(move || {
            let mut peak = 0u64;
            loop {
                let now = dir_bytes(&work_dir).saturating_sub(base_dir)
                    + rss(agent).saturating_sub(base_rss)
                    + criu_children_rss(agent);
                peak = peak.max(now);
                if stopped.load(Ordering::Relaxed) {
                    return peak;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        PeakSampler { stop, thread }
    }

    fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or(0)
    }
}

/// One command to the writer on `port`, from client1.
fn ask(cluster: &Cluster, port: u16, command: &str) -> Result<String> {
    let target = SocketAddrV4::new(cluster.public_addr(), port);
    Ok(request_line(
        &cluster.netns_path("client1"),
        target,
        command,
        Duration::from_secs(120),
    )?)
}

/// The writer's arguments: size 0 is the getpid(2) loop.
fn writer_args(size_mib: usize, rate: u32) -> Vec<String> {
    if size_mib == 0 {
        return ["--mode", "getpid", "--kib", "16"]
            .map(String::from)
            .to_vec();
    }
    // The writer writes `--writes-per-ms` pages, then pauses 1 ms; a rate
    // below 1,000 pages/s is 0 here.
    vec![
        "--mib".into(),
        size_mib.to_string(),
        "--writes-per-ms".into(),
        (rate / 1000).to_string(),
    ]
}

async fn bench_process(
    cluster: &Cluster,
    args: &Args,
    (size_mib, rate, link): (usize, u32, &str),
    port: u16,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let mut controls = [
        cluster.control("node1").await?,
        cluster.control("node2").await?,
    ];
    let args_of_writer = writer_args(size_mib, rate);
    let mut pid = MemWriter { port }
        .start_with(
            &mut controls[0],
            &args_of_writer
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
        )
        .await;
    let mut on = 0usize;
    for run_no in 0..args.runs {
        for strategy in &args.strategies {
            let to = 1 - on;
            let dest = format!("node{}", to + 1);
            let sampler = PeakSampler::start(cluster.work_dir(&dest), cluster.agent_pid(&dest));
            let migrated = migrate_request(
                &mut controls[on],
                MigrateRequest {
                    pid,
                    destination_node: dest.clone(),
                    strategy: strategy_of(strategy)? as i32,
                    ..Default::default()
                },
            )
            .await;
            let peak = sampler.finish();
            let (report, status) = migrated?;
            let what = format!("{size_mib} MiB at {rate} pages/s over {link}, {strategy}");
            if let Some(s) = status {
                bail!("{what}: migration failed: {s:?}\n{report:#?}");
            }
            if report.outcome != MigrationOutcome::Committed as i32 {
                bail!("{what}: not committed: {report:#?}");
            }
            let check = ask(cluster, port, "check")?;
            if !check.starts_with("ok") {
                bail!("{what}: memory check after the migration: {check}");
            }
            let row = Row::of((size_mib, rate, link), strategy, run_no, &report, peak);
            println!(
                "{:>5} MiB {:>6}/s {:<8} {:<18} run {}: freeze {:>8.1}  total {:>9.1}  window {:>8.1} ms  {:>11} B  dest +{:>7.1} MiB [{}]",
                row.size_mib,
                row.write_rate,
                row.link,
                row.strategy,
                row.run,
                row.freeze_ms,
                row.total_ms,
                row.window_ms,
                row.bytes,
                row.dest_peak_mib,
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
    wait_until_gone(pid);
    Ok(())
}

const CSV_HEADER: &str = "size_mib,write_rate,link,strategy,run,profile,freeze_ms,total_ms,window_ms,bytes,dest_peak_mib,preparation_ms,precopied_pages,freeze_pages,postcopy_pages,postcopy_local_pages,left_out_pages,local_fill_ms,fill_mb_s,faults,fault_wait_ms,dest_reported_peak_mib,freeze_parts\n";

fn csv(rows: &[Row], profile: &str) -> String {
    let mut out = String::from(CSV_HEADER);
    for r in rows {
        let _ = writeln!(
            out,
            "{},{},{},{},{},{profile},{:.3},{:.3},{:.3},{},{:.1},{:.3},{},{},{},{},{},{:.3},{:.1},{},{:.3},{:.1},\"{}\"",
            r.size_mib,
            r.write_rate,
            r.link,
            r.strategy,
            r.run,
            r.freeze_ms,
            r.total_ms,
            r.window_ms,
            r.bytes,
            r.dest_peak_mib,
            r.preparation_ms,
            r.precopied_pages,
            r.freeze_pages,
            r.postcopy_pages,
            r.postcopy_local_pages,
            r.left_out_pages,
            r.local_fill_ms,
            r.fill_mb_s,
            r.faults,
            r.fault_wait_ms,
            r.dest_reported_peak_mib,
            r.freeze_parts
        );
    }
    out
}

/// The median of `f` over the rows of one cell.
fn med(rows: &[&Row], f: impl Fn(&Row) -> f64) -> f64 {
    median_unsorted(&rows.iter().map(|r| f(r)).collect::<Vec<_>>())
}

/// The freeze's parts of a cell: each part's median, the largest first.
fn parts(rows: &[&Row]) -> String {
    let mut names: Vec<String> = Vec::new();
    for r in rows {
        for p in r.freeze_parts.split("; ").filter(|p| !p.is_empty()) {
            let name = p.rsplit_once(' ').map_or(p, |(n, _)| n).to_owned();
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    let mut meds: Vec<(String, f64)> = names
        .into_iter()
        .map(|name| {
            let v = med(rows, |r| {
                r.freeze_parts
                    .split("; ")
                    .find_map(|p| p.rsplit_once(' ').filter(|(n, _)| *n == name))
                    .and_then(|(_, v)| v.parse().ok())
                    .unwrap_or(0.0)
            });
            (name, v)
        })
        .collect();
    meds.sort_by(|a, b| b.1.total_cmp(&a.1));
    meds.iter()
        .take(4)
        .map(|(n, v)| format!("{n} {v:.0}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn tables(rows: &[Row], args: &Args, profile: &str) -> String {
    let mut md = String::new();
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.size_mib).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for link in &args.links {
        for rate in &args.rates {
            let cell_rows: Vec<&Row> = rows
                .iter()
                .filter(|r| &r.link == link && (r.write_rate == *rate || r.size_mib == 0))
                .collect();
            if cell_rows.is_empty() {
                continue;
            }
            let _ = writeln!(
                md,
                "\n### {link}, {rate} written pages/s ({profile} build, medians of {} runs; size 0: the getpid loop)\n",
                args.runs
            );
            let _ = writeln!(
                md,
                "| MiB | strategy | freeze ms | freeze's largest parts, ms | total ms | window ms | local fill ms | MB sent | dest. peak MiB (sampled / reported) | fill MB/s | faults | fault wait ms |"
            );
            let _ = writeln!(
                md,
                "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
            );
            for size in &sizes {
                for strategy in &args.strategies {
                    let cell: Vec<&Row> = cell_rows
                        .iter()
                        .copied()
                        .filter(|r| r.size_mib == *size && &r.strategy == strategy)
                        .collect();
                    if cell.is_empty() {
                        continue;
                    }
                    let _ = writeln!(
                        md,
                        "| {size} | {strategy} | {:.1} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} / {:.0} | {:.0} | {:.0} | {:.1} |",
                        med(&cell, |r| r.freeze_ms),
                        parts(&cell),
                        med(&cell, |r| r.total_ms),
                        med(&cell, |r| r.window_ms),
                        med(&cell, |r| r.local_fill_ms),
                        med(&cell, |r| r.bytes as f64 / 1e6),
                        med(&cell, |r| r.dest_peak_mib),
                        med(&cell, |r| r.dest_reported_peak_mib),
                        med(&cell, |r| r.fill_mb_s),
                        med(&cell, |r| r.faults as f64),
                        med(&cell, |r| r.fault_wait_ms),
                    );
                }
            }
        }
    }
    md
}

/// Median freeze against size (log2 axis), one line per strategy, for the
/// first rate and link measured.
fn plot(rows: &[Row], args: &Args, profile: &str) -> String {
    use ferry_policy::sim::svg::{Chart, Series};
    let (Some(rate), Some(link)) = (args.rates.first(), args.links.first()) else {
        return String::new();
    };
    let series = args
        .strategies
        .iter()
        .map(|strategy| {
            let mut sizes: Vec<usize> = rows
                .iter()
                .filter(|r| r.size_mib > 0 && &r.strategy == strategy)
                .map(|r| r.size_mib)
                .collect();
            sizes.sort_unstable();
            sizes.dedup();
            let points = sizes
                .into_iter()
                .map(|size| {
                    let cell: Vec<&Row> = rows
                        .iter()
                        .filter(|r| {
                            r.size_mib == size
                                && &r.strategy == strategy
                                && r.write_rate == *rate
                                && &r.link == link
                        })
                        .collect();
                    (size as f64, med(&cell, |r| r.freeze_ms))
                })
                .collect();
            Series {
                name: strategy.clone(),
                points,
            }
        })
        .collect();
    Chart {
        title: format!(
            "freeze against memory, {rate} written pages/s, {link} ({profile}, medians)"
        ),
        x_label: "process memory, MiB".into(),
        y_label: "freeze, ms".into(),
        y_range: None,
        x_log2: true,
        series,
    }
    .render()
}

fn main() -> Result<()> {
    let args = Args::parse();
    for s in &args.strategies {
        strategy_of(s)?;
    }
    for link in &args.links {
        if link != "unshaped" && !link.ends_with("bit") {
            bail!("--links: {link:?} is neither \"unshaped\" nor a tc rate like 1gbit");
        }
    }
    if !["ferryd", "criu"].contains(&args.post_copy_pages.as_str()) {
        bail!(
            "--post-copy-pages: {:?} is neither \"ferryd\" nor \"criu\"",
            args.post_copy_pages
        );
    }
    let profile = ferry_bench::run::profile();
    println!(
        "binaries: {profile} profile; post-copy's pages by {}; TLS between the agents: {}",
        args.post_copy_pages,
        if args.tls { "on" } else { "off" }
    );
    let rt = ferry_integration::managed::runtime();
    let mut rows = Vec::new();
    for link in &args.links {
        let mut spec = ClusterSpec::new(2, 1);
        spec.tls = args.tls;
        // Top-level keys first: the TOML sections follow.
        let log_level = args
            .criu_log_level
            .map(|l| format!("criu_log_level = {l}\n"))
            .unwrap_or_default();
        spec.extra_config = format!(
            "{log_level}[migration]\npost_copy_pages = \"{}\"\ncompression = \"{}\"\n",
            args.post_copy_pages, args.compression
        );
        let cluster = Cluster::start(spec).context("starting the cluster")?;
        if link != "unshaped" {
            // A burst of 10 ms at 1 Gb/s.
            cluster.shape_cluster_links(Some((link, 1_250_000, "100ms")));
        }
        let mut cells: Vec<(usize, u32)> = Vec::new();
        if args.reference {
            cells.push((0, 0));
        }
        for size in &args.sizes {
            for rate in &args.rates {
                cells.push((*size, *rate));
            }
        }
        for (i, (size, rate)) in cells.into_iter().enumerate() {
            let port = 7500 + i as u16;
            rt.block_on(bench_process(
                &cluster,
                &args,
                (size, rate, link),
                port,
                &mut rows,
            ))?;
        }
    }
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("memory.csv"), csv(&rows, profile))?;
    let md = tables(&rows, &args, profile);
    std::fs::write(args.out.join("memory.md"), &md)?;
    std::fs::write(args.out.join("memory.svg"), plot(&rows, &args, profile))?;
    println!("{md}");
    println!(
        "\nReproduce: `cargo xtask bench memory -- --sizes {} --rates {} --links {} --strategies {} --runs {} --post-copy-pages {} --tls {} --compression {}` (root; {profile} build; 2 cores here).",
        join(&args.sizes),
        join(&args.rates),
        args.links.join(","),
        args.strategies.join(","),
        args.runs,
        args.post_copy_pages,
        args.tls,
        args.compression
    );
    println!("written to {}", args.out.display());
    Ok(())
}

fn join<T: ToString>(v: &[T]) -> String {
    v.iter().map(T::to_string).collect::<Vec<_>>().join(",")
}
