//! `cargo xtask bench redis`: the scenario issue 34 was found with, a real
//! in-memory database with a large data set, migrated while clients read
//! from it. Debian's Redis server runs under ferry with `--sizes` MiB of
//! data (`DEBUG POPULATE` of 1,000-byte values), and `--clients` clients in
//! the client namespace, one connection each, send `GET`s of random keys
//! during every migration, back to back or one every `--interval-ms`.
//! Per migration: the freeze, the longest any client waited for one answer
//! and the median client's longest wait (what users see), the time
//! the process still depends on the source (post-copy's window) and the
//! destination's peak extra memory; after each, `DEBUG DIGEST` of the
//! whole data set must match the one taken before, or the bench stops.
//!
//! Writes `redis.csv` and `redis.md` to `--out` (default
//! `target/bench/redis`). Timings are what this machine measured, never
//! pass/fail.

use std::fmt::Write as _;
use std::net::SocketAddrV4;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use clap::Parser;
use ferry_bench::run::{freeze_parts, strategy_of};
use ferry_bench::stats::median_unsorted;
use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{migrate_request, run, wait_for_process, wait_until_gone};
use ferry_integration::netns;
use ferry_integration::redis::{REDIS_SERVER, Redis};
use ferry_proto::v1::{MigrateRequest, MigrationOutcome};

const PORT: u16 = 7600;
const REDIS: Redis = Redis { port: PORT };

#[derive(Debug, Parser)]
#[command(
    name = "ferry-bench-redis",
    about = "a Redis server with a large data set, migrated while a client reads"
)]
struct Args {
    /// Data set sizes, MiB of values, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64,1024")]
    sizes: Vec<usize>,
    /// Cluster links: "unshaped" or a tc rate ("1gbit"), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1gbit")]
    links: Vec<String>,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "total-copy,pre-copy,post-copy"
    )]
    strategies: Vec<String>,
    /// Migrations per size, link and strategy.
    #[arg(long, default_value_t = 2)]
    runs: usize,
    /// Clients, one connection each.
    #[arg(long, default_value_t = 1)]
    clients: usize,
    /// Each client's pause between an answer and its next GET, ms (0:
    /// back to back).
    #[arg(long, default_value_t = 0)]
    interval_ms: u64,
    /// Pre-copy's throttle: "auto", "off" (default: the agent's).
    #[arg(long, value_parser = ["auto", "off"])]
    throttle: Option<String>,
    /// Whether pages cross compressed (`[migration] compression` of every
    /// agent): "off" (the default) or "lz4".
    #[arg(long, default_value = "off", value_parser = ["off", "lz4"])]
    compression: String,
    #[arg(long, default_value = "target/bench/redis")]
    out: PathBuf,
}

struct Row {
    size_mib: usize,
    link: String,
    strategy: String,
    run: usize,
    freeze_ms: f64,
    client_max_wait_ms: f64,
    /// The median over the clients of each one's longest wait.
    client_median_wait_ms: f64,
    /// When the longest wait of any client began, ms after the freeze
    /// began (negative: before), from the report's start and phases.
    worst_wait_from_freeze_ms: f64,
    client_answers: u64,
    window_ms: f64,
    left_out_pages: u64,
    dest_peak_mib: f64,
    freeze_parts: String,
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// One redis-cli command from client1; its output, trimmed.
fn redis(cluster: &Cluster, args: &[&str]) -> Result<String> {
    Ok(REDIS.cli(cluster, args)?)
}

/// Reads one reply to a GET: a bulk string ("$<n>" then n bytes) or nil.
async fn read_reply<R: tokio::io::AsyncBufRead + Unpin>(
    r: &mut R,
    line: &mut String,
) -> std::io::Result<()> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt};
    line.clear();
    if r.read_line(line).await? == 0 {
        return Err(std::io::Error::other("the server closed the connection"));
    }
    match line.trim_end().strip_prefix('$') {
        Some(n) if !n.starts_with('-') => {
            let n: usize = n
                .parse()
                .map_err(|_| std::io::Error::other(format!("bad reply {line:?}")))?;
            let mut body = vec![0u8; n + 2];
            r.read_exact(&mut body).await.map(|_| ())
        }
        Some(_) => Ok(()),
        None => Err(std::io::Error::other(format!("bad reply {line:?}"))),
    }
}

/// One client: GETs of random keys until stopped, each after the answer
/// to the last and `pause`; its longest wait for one answer, when that
/// wait began, and how many answers it got.
async fn client(
    stream: tokio::net::TcpStream,
    keys: usize,
    pause: Duration,
    mut rng: u64,
    stop: Arc<AtomicBool>,
) -> std::io::Result<(Duration, SystemTime, u64)> {
    use tokio::io::AsyncWriteExt;
    let (r, mut w) = stream.into_split();
    let mut r = tokio::io::BufReader::new(r);
    let (mut longest, mut longest_at, mut answers) = (Duration::ZERO, SystemTime::now(), 0u64);
    let mut line = String::new();
    while !stop.load(Ordering::Relaxed) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let (sent, sent_at) = (Instant::now(), SystemTime::now());
        w.write_all(format!("GET key:{}\r\n", rng % keys as u64).as_bytes())
            .await?;
        tokio::time::timeout(Duration::from_secs(60), read_reply(&mut r, &mut line))
            .await
            .map_err(|_| std::io::Error::other("no answer within 60 s"))??;
        if sent.elapsed() > longest {
            (longest, longest_at) = (sent.elapsed(), sent_at);
        }
        answers += 1;
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
    }
    Ok((longest, longest_at, answers))
}

/// What the clients saw during one migration: each one's longest wait,
/// and the answers they got in all.
struct Seen {
    longest: Vec<Duration>,
    /// The longest wait of all, and when it began.
    worst: (Duration, SystemTime),
    answers: u64,
}

/// `clients` clients in the namespace at `netns_path` (their sockets are
/// made on this thread, which is in it), until stopped.
fn readers(
    netns_path: PathBuf,
    target: SocketAddrV4,
    keys: usize,
    clients: usize,
    pause: Duration,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Result<Seen>> {
    std::thread::spawn(move || {
        netns::run_in(&netns_path, || -> Result<Seen> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                let mut tasks = tokio::task::JoinSet::new();
                for c in 0..clients {
                    let stream = tokio::net::TcpStream::connect(target).await?;
                    stream.set_nodelay(true)?;
                    let seed = 0x9e37_79b9u64.wrapping_add(c as u64 * 0x1234_5678_9abc);
                    tasks.spawn(client(stream, keys, pause, seed, stop.clone()));
                }
                let mut seen = Seen {
                    longest: Vec::with_capacity(clients),
                    worst: (Duration::ZERO, SystemTime::UNIX_EPOCH),
                    answers: 0,
                };
                while let Some(done) = tasks.join_next().await {
                    let (longest, at, answers) = done??;
                    if longest > seen.worst.0 {
                        seen.worst = (longest, at);
                    }
                    seen.longest.push(longest);
                    seen.answers += answers;
                }
                Ok(seen)
            })
        })?
    })
}

async fn bench_link(cluster: &Cluster, args: &Args, link: &str, rows: &mut Vec<Row>) -> Result<()> {
    let mut controls = [
        cluster.control("node1").await?,
        cluster.control("node2").await?,
    ];
    let dir = tempfile::tempdir()?;
    for &size in &args.sizes {
        let argv = REDIS.argv(dir.path());
        let mut pid = run(&mut controls[0], argv).await;
        wait_for_process(&mut controls[0], pid, |p| p.tcp_listening >= 1).await;
        let keys = size * 1024 * 1024 / 1000;
        let populated = redis(
            cluster,
            &["DEBUG", "POPULATE", &keys.to_string(), "key", "1000"],
        )?;
        if populated != "OK" {
            bail!("DEBUG POPULATE: {populated}");
        }
        let mut on = 0usize;
        for run_no in 0..args.runs {
            for strategy in &args.strategies {
                let digest = redis(cluster, &["DEBUG", "DIGEST"])?;
                let to = 1 - on;
                let stop = Arc::new(AtomicBool::new(false));
                let clients = readers(
                    cluster.netns_path("client1"),
                    SocketAddrV4::new(cluster.public_addr(), PORT),
                    keys,
                    args.clients,
                    Duration::from_millis(args.interval_ms),
                    stop.clone(),
                );
                // The clients are reading before the migration starts
                // (1,000 connect in well under a second here).
                tokio::time::sleep(Duration::from_millis(200 + args.clients as u64)).await;
                let migrated = migrate_request(
                    &mut controls[on],
                    MigrateRequest {
                        pid,
                        destination_node: format!("node{}", to + 1),
                        strategy: strategy_of(strategy)? as i32,
                        throttle: match args.throttle.as_deref() {
                            Some("auto") => ferry_proto::v1::PrecopyThrottle::Auto,
                            Some("off") => ferry_proto::v1::PrecopyThrottle::Off,
                            _ => ferry_proto::v1::PrecopyThrottle::Unspecified,
                        } as i32,
                        ..Default::default()
                    },
                )
                .await;
                // Until the post-copy window (if any) is surely over.
                tokio::time::sleep(Duration::from_millis(200)).await;
                stop.store(true, Ordering::Relaxed);
                let (report, status) = migrated?;
                let what = format!("{size} MiB over {link}, {strategy}, run {run_no}");
                if let Some(s) = status {
                    bail!("{what}: migration failed: {s:?}\n{report:#?}");
                }
                if report.outcome != MigrationOutcome::Committed as i32 {
                    bail!("{what}: not committed: {report:#?}");
                }
                let seen = clients
                    .join()
                    .map_err(|_| anyhow::anyhow!("{what}: the clients panicked"))?
                    .with_context(|| format!("{what}: the clients"))?;
                let waits: Vec<f64> = seen
                    .longest
                    .iter()
                    .map(|d| d.as_secs_f64() * 1000.0)
                    .collect();
                let after = redis(cluster, &["DEBUG", "DIGEST"])?;
                if after != digest {
                    bail!("{what}: the data set changed: digest {digest} before, {after} after");
                }
                let row = Row {
                    size_mib: size,
                    link: link.to_owned(),
                    strategy: strategy.clone(),
                    run: run_no,
                    freeze_ms: ms(report.freeze_time_us),
                    client_max_wait_ms: seen.worst.0.as_secs_f64() * 1000.0,
                    client_median_wait_ms: median_unsorted(&waits),
                    worst_wait_from_freeze_ms: {
                        // The freeze begins with the dump: the phases
                        // before it, in order, from the migration's start.
                        let before: u64 = report
                            .phases
                            .iter()
                            .take_while(|p| p.phase != "dump")
                            .map(|p| p.duration_us)
                            .sum();
                        let freeze_began =
                            report.started_at_unix_ms as f64 + before as f64 / 1000.0;
                        let worst = seen
                            .worst
                            .1
                            .duration_since(SystemTime::UNIX_EPOCH)
                            .unwrap_or_default()
                            .as_secs_f64()
                            * 1000.0;
                        worst - freeze_began
                    },
                    client_answers: seen.answers,
                    window_ms: ms(report.post_processing_time_us),
                    left_out_pages: report.left_out_pages,
                    dest_peak_mib: report.destination_peak_extra_bytes as f64
                        / f64::from(1u32 << 20),
                    freeze_parts: freeze_parts(&report),
                };
                println!(
                    "{:>5} MiB {:<8} {:<18} run {}: freeze {:>8.1} ms  longest wait {:>8.1} ms (from {:+.1} ms of the freeze; median client's {:.1} ms; {} answers)  window {:>8.1} ms  left out {:>7} pages  dest +{:>7.1} MiB  compressed {:.1} -> {:.1} MB  [{}]",
                    row.size_mib,
                    row.link,
                    row.strategy,
                    row.run,
                    row.freeze_ms,
                    row.client_max_wait_ms,
                    row.worst_wait_from_freeze_ms,
                    row.client_median_wait_ms,
                    row.client_answers,
                    row.window_ms,
                    row.left_out_pages,
                    row.dest_peak_mib,
                    report.compressed_page_bytes as f64 / 1e6,
                    report.compressed_to_bytes as f64 / 1e6,
                    row.freeze_parts
                );
                rows.push(row);
                pid = report.destination_pid;
                on = to;
            }
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        wait_until_gone(pid);
    }
    Ok(())
}

fn csv(rows: &[Row], args: &Args, profile: &str) -> String {
    let mut out = String::from(
        "size_mib,link,strategy,run,profile,clients,interval_ms,freeze_ms,client_max_wait_ms,worst_wait_from_freeze_ms,client_median_wait_ms,client_answers,window_ms,left_out_pages,dest_peak_mib,freeze_parts\n",
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{},{},{},{},{profile},{},{},{:.3},{:.3},{:.3},{:.3},{},{:.3},{},{:.1},\"{}\"",
            r.size_mib,
            r.link,
            r.strategy,
            r.run,
            args.clients,
            args.interval_ms,
            r.freeze_ms,
            r.client_max_wait_ms,
            r.worst_wait_from_freeze_ms,
            r.client_median_wait_ms,
            r.client_answers,
            r.window_ms,
            r.left_out_pages,
            r.dest_peak_mib,
            r.freeze_parts
        );
    }
    out
}

fn table(rows: &[Row], args: &Args, profile: &str) -> String {
    let mut md = String::from(
        "| data set MiB, link | strategy | freeze ms | longest wait ms (any client) | median client's longest wait ms | window ms | dest. peak MiB |\n|---|---|---:|---:|---:|---:|---:|\n",
    );
    for link in &args.links {
        for size in &args.sizes {
            for strategy in &args.strategies {
                let cell: Vec<&Row> = rows
                    .iter()
                    .filter(|r| &r.link == link && r.size_mib == *size && &r.strategy == strategy)
                    .collect();
                if cell.is_empty() {
                    continue;
                }
                let med = |f: fn(&Row) -> f64| {
                    median_unsorted(&cell.iter().map(|r| f(r)).collect::<Vec<_>>())
                };
                let _ = writeln!(
                    md,
                    "| {size}, {link} | {strategy} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} |",
                    med(|r| r.freeze_ms),
                    med(|r| r.client_max_wait_ms),
                    med(|r| r.client_median_wait_ms),
                    med(|r| r.window_ms),
                    med(|r| r.dest_peak_mib),
                );
            }
        }
    }
    let _ = writeln!(
        md,
        "\n({profile} build, medians of {} migrations; {} client(s), {})",
        args.runs,
        args.clients,
        if args.interval_ms == 0 {
            "GETs back to back".to_owned()
        } else {
            format!("a GET every {} ms after each answer", args.interval_ms)
        }
    );
    md
}

fn main() -> Result<()> {
    let args = Args::parse();
    for s in &args.strategies {
        strategy_of(s)?;
    }
    if !Redis::installed() {
        bail!("{REDIS_SERVER} is missing: `cargo xtask setup` installs Debian's redis-server");
    }
    let profile = ferry_bench::run::profile();
    println!("binaries: {profile} profile");
    let rt = ferry_integration::managed::runtime();
    let mut rows = Vec::new();
    for link in &args.links {
        if link != "unshaped" && !link.ends_with("bit") {
            bail!("--links: {link:?} is neither \"unshaped\" nor a tc rate like 1gbit");
        }
        let mut spec = ClusterSpec::new(2, 1);
        spec.extra_config = format!("[migration]\ncompression = \"{}\"\n", args.compression);
        let cluster = Cluster::start(spec).context("starting the cluster")?;
        if link != "unshaped" {
            cluster.shape_cluster_links(Some((link, 1_250_000, "100ms")));
        }
        rt.block_on(bench_link(&cluster, &args, link, &mut rows))?;
    }
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("redis.csv"), csv(&rows, &args, profile))?;
    let md = table(&rows, &args, profile);
    std::fs::write(args.out.join("redis.md"), &md)?;
    println!("\n{md}");
    println!(
        "Reproduce: `cargo xtask bench redis -- --sizes {} --links {} --strategies {} --runs {} --clients {} --interval-ms {} --compression {}{}` (root; {profile} build; 2 cores here).",
        args.sizes
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(","),
        args.links.join(","),
        args.strategies.join(","),
        args.runs,
        args.clients,
        args.interval_ms,
        args.compression,
        args.throttle
            .as_deref()
            .map(|t| format!(" --throttle {t}"))
            .unwrap_or_default()
    );
    Ok(())
}
