//! `cargo xtask soak [-- ARGS]`: one server moved again and again across
//! three nodes while 256 TCP clients (every byte checked), 24 UDP players
//! at 20 Hz and a PostgreSQL session keep it busy
//! ([`ferry_integration::soak`]), bounded by a migration count (default
//! 1,000) and a time limit. Strategy and socket mode are drawn per
//! migration from a seeded generator; the seed is printed, and `--seed`
//! repeats a run.
//!
//! Prints every migration as it ends, then lost bytes and datagrams (must
//! be 0), the freeze's distribution per strategy, each agent's memory,
//! descriptors and threads over the run with its memory slope (a leak
//! shows as a slope), and what the migrations left behind (must be
//! nothing). Writes `soak.csv`, `agents.csv` and `soak.md` to `--out`
//! (default `target/bench/soak`). Fails when anything was lost or left.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use ferry_bench::stats::{median, percentile};
use ferry_integration::soak::{STRATEGIES, SoakMigration, SoakReport, SoakSpec, run_soak};
use ferry_proto::v1::MigrationOutcome;

#[derive(Debug, Parser)]
#[command(
    name = "ferry-bench-soak",
    about = "a server migrated again and again across 3 nodes under load"
)]
struct Args {
    /// Migrations at most.
    #[arg(long, default_value_t = 1000)]
    migrations: usize,
    /// Minutes at most (the migration under way then finishes).
    #[arg(long, default_value_t = 120)]
    minutes: u64,
    /// The draws' seed (default: from the clock; printed either way).
    #[arg(long)]
    seed: Option<u64>,
    /// TCP clients.
    #[arg(long, default_value_t = 256)]
    tcp: usize,
    /// UDP players.
    #[arg(long, default_value_t = 24)]
    udp: usize,
    /// Sample the agents every this many migrations.
    #[arg(long, default_value_t = 10)]
    sample_every: usize,
    #[arg(long, default_value = "target/bench/soak")]
    out: PathBuf,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if let Some(reason) = ferry_integration::skip_reason() {
        eprintln!("bench soak needs {reason}");
        return std::process::ExitCode::FAILURE;
    }
    match soak(&args) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("bench soak: something was lost or left behind (above)");
            std::process::ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("bench soak failed: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn soak(args: &Args) -> Result<bool> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    });
    let spec = SoakSpec {
        migrations: args.migrations,
        time_limit: Duration::from_secs(args.minutes * 60),
        seed,
        tcp: args.tcp,
        udp: args.udp,
        sample_every: args.sample_every,
    };
    println!(
        "bench soak: seed {seed}; at most {} migrations or {} min; {} TCP clients (256 B / 50 ms, every byte checked), {} UDP players (20 Hz), a PostgreSQL session\n",
        spec.migrations, args.minutes, spec.tcp, spec.udp
    );
    println!("n\tfrom\tto\tstrategy\tsockets\toutcome\tfreeze_ms\terror");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let cluster = ferry_integration::soak::cluster()?;
    let report = rt.block_on(run_soak(&cluster, &spec, |m| {
        println!("{}", row(m).join("\t"))
    }))?;
    drop(cluster);
    let summary = summary(&report);
    println!("\n{summary}");
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let mut csv = String::from("n,from,to,strategy,sockets,outcome,freeze_ms,error\n");
    for m in &report.migrations {
        csv += &(row(m).join(",") + "\n");
    }
    std::fs::write(args.out.join("soak.csv"), csv)?;
    let mut agents = String::from("after,node,rss_kib,descriptors,threads\n");
    for s in &report.samples {
        let _ = writeln!(
            agents,
            "{},{},{},{},{}",
            s.after, s.node, s.rss_kib, s.descriptors, s.threads
        );
    }
    std::fs::write(args.out.join("agents.csv"), agents)?;
    std::fs::write(args.out.join("soak.md"), &summary)?;
    println!(
        "written: {0}/soak.csv, {0}/agents.csv, {0}/soak.md",
        args.out.display()
    );
    Ok(report.is_clean())
}

fn row(m: &SoakMigration) -> Vec<String> {
    vec![
        m.n.to_string(),
        m.from.clone(),
        m.to.clone(),
        m.strategy.as_str_name().to_owned(),
        m.sockets.as_str_name().to_owned(),
        m.outcome.as_str_name().to_owned(),
        format!("{:.1}", m.freeze_ms),
        m.error.replace([',', '\t', '\n'], " "),
    ]
}

fn summary(r: &SoakReport) -> String {
    let mut s = String::new();
    let committed = r
        .migrations
        .iter()
        .filter(|m| m.outcome == MigrationOutcome::Committed && m.error.is_empty())
        .count();
    let _ = writeln!(
        s,
        "## Soak: seed {}, {} migrations in {:.1} min, {committed} committed and checked\n",
        r.seed,
        r.migrations.len(),
        r.elapsed.as_secs_f64() / 60.0
    );
    let _ = writeln!(
        s,
        "| TCP bytes sent | verified | connections failed | UDP datagrams sent | lost | corrupt | database queries (one session) |\n|---:|---:|---:|---:|---:|---:|---:|\n| {} | {} | {} | {} | {} | {} | {} |\n",
        r.tcp_sent_bytes,
        r.tcp_verified_bytes,
        r.tcp_failures.len(),
        r.udp_sent,
        r.udp_lost,
        r.udp_corrupt,
        r.db_queries_ok,
    );
    let _ = writeln!(
        s,
        "Freeze per strategy (ms):\n\n| strategy | migrations | median | p95 | p99 | max |\n|---|---:|---:|---:|---:|---:|"
    );
    for strategy in STRATEGIES {
        let mut f: Vec<f64> = r
            .migrations
            .iter()
            .filter(|m| m.strategy == strategy && m.outcome == MigrationOutcome::Committed)
            .map(|m| m.freeze_ms)
            .collect();
        if f.is_empty() {
            continue;
        }
        f.sort_by(f64::total_cmp);
        let _ = writeln!(
            s,
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} |",
            strategy.as_str_name(),
            f.len(),
            median(&f),
            percentile(&f, 95.0),
            percentile(&f, 99.0),
            f.last().copied().unwrap_or(0.0)
        );
    }
    let _ = writeln!(
        s,
        "\nAgents (first and last sample; resident memory's slope, KiB per 100 migrations, over all samples and over the second half):\n\n| node | RSS first (KiB) | RSS last | slope | slope, 2nd half | descriptors first | last | threads first | last |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (node, slope, late) in r.rss_slopes() {
        let mine: Vec<_> = r.samples.iter().filter(|x| x.node == node).collect();
        let (Some(a), Some(b)) = (mine.first(), mine.last()) else {
            continue;
        };
        let _ = writeln!(
            s,
            "| {node} | {} | {} | {slope:.1} | {late:.1} | {} | {} | {} | {} |",
            a.rss_kib, b.rss_kib, a.descriptors, b.descriptors, a.threads, b.threads
        );
    }
    let _ = writeln!(s, "\nLeft behind: {}", r.leftovers.len());
    for l in &r.leftovers {
        let _ = writeln!(s, "- {l}");
    }
    for f in &r.tcp_failures {
        let _ = writeln!(s, "- TCP: {f}");
    }
    s
}
