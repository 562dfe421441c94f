//! `cargo xtask dve`: Gerofi et al. (DVE)'s virtual-environment experiment
//! (their §VI-C, Fig. 5d-f) live, on the namespace cluster with real
//! processes and real migrations.
//!
//! Five nodes, each given a CPU capacity by a cgroup (`[balancer]
//! cpu_cgroup`, `--cores-per-node` of the machine's 2 cores, so that the
//! machine can hold them and still run the agents, CRIU and the players);
//! one `ferry-zone-server` per zone of a 10x10 map (node i serves rows 2i
//! and 2i+1, 20 zones each), burning CPU in proportion to its players and
//! sending each of them 20 Hz updates over UDP; `ferry-dve-players` in the
//! client namespace, walking by the simulator's drift model (time scaled to
//! `--duration-s`: the paper's 15 minutes in 4 by default). The zone
//! servers' CPU per player is set so that each node starts at
//! `--start-load` of its capacity. Each run: balancing off, then on (ferry's
//! policies, docs/balancing.md, with the calm-down and residencies scaled
//! to the run).
//!
//! Output in `--out` (default `target/bench/dve`): `timeseries.csv` (every
//! node's load against its capacity and its zone servers, every 2 s, per
//! run), `migrations.csv` (each migration the balancers made, with its
//! freeze and the longest update gap its zone's players saw around it),
//! `summary.md`, and plots `cpu_off.svg`, `cpu_on.svg`, `zones_on.svg`
//! (the paper's Fig. 5e, 5f, 5d). Timings are what this machine measured,
//! never pass/fail.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::cpu_cgroup::CpuCgroup;
use ferry_integration::dve::{BASE_PORT, Gap, TICK};
use ferry_integration::managed::run;
use ferry_integration::topology::PUBLIC_ADDR;
use ferry_policy::sim::svg::{Chart, Series};
use ferry_proto::v1::{GetBalancerRequest, GetMigrationRequest};

const NODES: usize = 5;
const GRID: usize = 10;

#[derive(Debug, Parser)]
#[command(
    name = "ferry-bench-dve",
    about = "Gerofi et al. (DVE)'s virtual-environment experiment, live: zone servers, drifting players, balancing off and on"
)]
struct Args {
    #[arg(long, default_value_t = 500)]
    players: usize,
    /// Length of each run (balancing off, then on); the drift is scaled to it.
    #[arg(long, default_value_t = 240)]
    duration_s: u64,
    /// CPU capacity of each node (cores of this machine). Five nodes of 0.2
    /// give the zone servers one of the 2 cores and leave the other to the
    /// agents, CRIU and the players: at 0.3 each the machine saturated and
    /// migrations froze 48-98 ms instead of 33-70.
    #[arg(long, default_value_t = 0.2)]
    cores_per_node: f64,
    /// Each node's load at the start, against its capacity.
    #[arg(long, default_value_t = 0.7)]
    start_load: f64,
    /// Runs: "off", "on" or both, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "off,on")]
    runs: Vec<String>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, default_value = "target/bench/dve")]
    out: PathBuf,
}

/// ferry's policies (docs/balancing.md) with Gerofi et al.'s calm-down and
/// residency scaled from the paper's 15 minutes to the run, and a 5-point
/// gap to the average: a live node's load moves by 2-3 points from one
/// sample to the next here, and a move for less chases that noise.
fn config(args: &Args) -> String {
    let scale = args.duration_s as f64 / 900.0;
    let ms = |paper_ms: f64| ((paper_ms * scale) as u64).max(1_000);
    format!(
        r#"
[membership]
enabled = true
probe_period_ms = 500
suspect_to_down_ms = 2000

[policy.load]
decay = 0.5
stabilizer = 0.02
follow_migrations = true

[policy.transfer]
threshold = 0.9
average_gap = 0.05
calm_down_ms = {calm}
receiver_up_to_average = true
count_promised = true

[policy.location]
kind = "least_loaded"

[policy.selection]
min_residency_ms = {residency}
rehop_residency_ms = {residency}
"#,
        calm = ms(20_000.0),
        residency = ms(30_000.0),
    )
}

fn balancer_table(cgroup: &std::path::Path, balancing: bool) -> String {
    format!(
        "[balancer]\nenabled = {balancing}\nperiod_ms = 1000\ncpu_cgroup = \"{}\"\n",
        cgroup.display()
    )
}

/// One sample of the cluster.
struct Point {
    secs: f64,
    load: Vec<f64>,
    zones: Vec<usize>,
}

/// One migration a balancer made.
struct Moved {
    at_unix_ms: u64,
    zone: usize,
    from: String,
    to: String,
    freeze_ms: f64,
    /// The longest gap this zone's players saw that ended within 2 s after it.
    gap_ms: f64,
}

struct RunResult {
    name: String,
    points: Vec<Point>,
    moved: Vec<Moved>,
    longest_gap_ms: f64,
    gaps_over: usize,
}

fn zone_of(argv: &[String]) -> Option<usize> {
    let i = argv.iter().position(|a| a == "--zone")?;
    argv.get(i + 1)?.parse().ok()
}

async fn one_run(args: &Args, name: &str, balancing: bool) -> Result<RunResult> {
    let tag = format!("ferry-dve-{}-{name}", std::process::id());
    let cgroups: Vec<CpuCgroup> = (1..=NODES)
        .map(|n| CpuCgroup::create(&format!("{tag}-node{n}"), args.cores_per_node))
        .collect::<Result<_, _>>()
        .context("CPU cgroups for the nodes")?;
    let spec = ClusterSpec {
        extra_config: config(args),
        node_config: cgroups
            .iter()
            .enumerate()
            .map(|(i, c)| {
                (
                    format!("node{}", i + 1),
                    balancer_table(c.path(), balancing),
                )
            })
            .collect(),
        ..ClusterSpec::new(NODES, 1)
    };
    let cluster = Cluster::start(spec).context("cluster")?;
    let mut controls = Vec::new();
    for n in 1..=NODES {
        controls.push(cluster.control(&format!("node{n}")).await?);
    }
    // CPU per player per tick so that each node starts at start_load:
    // players/NODES players per node, 20 ticks a second.
    let per_node = args.players as f64 / NODES as f64;
    let ticks = 1.0 / TICK.as_secs_f64();
    let cpu_us = (args.start_load * args.cores_per_node * 1e6 / (per_node * ticks)) as u64;
    let server = ferry_integration::bin_path("ferry-zone-server");
    for zone in 0..GRID * GRID {
        let node = zone / GRID / (GRID / NODES);
        run(
            &mut controls[node],
            vec![
                server.display().to_string(),
                "--port".into(),
                (BASE_PORT + zone as u16).to_string(),
                "--zone".into(),
                zone.to_string(),
                "--cpu-per-player-us".into(),
                cpu_us.to_string(),
            ],
        )
        .await;
    }
    eprintln!("{name}: 100 zone servers up, {cpu_us} µs of CPU per player per tick");
    let report = tempfile::NamedTempFile::new()?;
    let mut cmd = Command::new(ferry_integration::bin_path("ferry-dve-players"));
    cmd.args([
        "--server",
        &PUBLIC_ADDR.to_string(),
        "--players",
        &args.players.to_string(),
        "--duration-s",
        &args.duration_s.to_string(),
        "--seed",
        &args.seed.to_string(),
        "--stats-every-s",
        "30",
        "--report",
    ])
    .arg(report.path());
    let client = cluster.client_names()[0].clone();
    let mut players = cluster.spawn_in(&client, cmd)?;
    let started = Instant::now();
    let mut points = Vec::new();
    while started.elapsed() < Duration::from_secs(args.duration_s) {
        let mut load = Vec::new();
        let mut zones = Vec::new();
        for c in controls.iter_mut() {
            let b = c
                .get_balancer(GetBalancerRequest::default())
                .await?
                .into_inner();
            load.push(b.local_load);
            zones.push(b.processes.len());
        }
        points.push(Point {
            secs: started.elapsed().as_secs_f64(),
            load,
            zones,
        });
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let exit = tokio::task::spawn_blocking(move || players.wait()).await??;
    anyhow::ensure!(exit.success(), "ferry-dve-players: {exit:?}");
    let text = std::fs::read_to_string(report.path())?;
    let r: serde_json::Value = serde_json::from_str(&text)?;
    let gaps: Vec<Gap> = r["gaps"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|g| {
                    Some(Gap {
                        at_unix_ms: g["at_unix_ms"].as_u64()?,
                        player: g["player"].as_u64()? as u32,
                        zone: g["zone"].as_u64()? as usize,
                        gap_ms: g["gap_ms"].as_f64()?,
                        seq_before: g["seq_before"].as_u64()?,
                        seq_after: g["seq_after"].as_u64()?,
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let mut moved = Vec::new();
    for c in controls.iter_mut() {
        let b = c
            .get_balancer(GetBalancerRequest::default())
            .await?
            .into_inner();
        for m in b.migrations.iter().filter(|m| m.committed) {
            let freeze_ms = match c
                .get_migration(GetMigrationRequest {
                    migration_id: m.migration_id.clone(),
                    ..Default::default()
                })
                .await
            {
                Ok(r) => r.into_inner().freeze_time_us as f64 / 1000.0,
                Err(_) => f64::NAN,
            };
            let zone = zone_of(&m.argv).unwrap_or(usize::MAX);
            let gap_ms = gaps
                .iter()
                .filter(|g| {
                    g.zone == zone
                        && g.at_unix_ms >= m.at_unix_ms
                        && g.at_unix_ms <= m.at_unix_ms + 2_000 + freeze_ms as u64
                })
                .map(|g| g.gap_ms)
                .fold(0.0, f64::max);
            moved.push(Moved {
                at_unix_ms: m.at_unix_ms,
                zone,
                from: m.from_node.clone(),
                to: m.to_node.clone(),
                freeze_ms,
                gap_ms,
            });
        }
    }
    moved.sort_by_key(|m| m.at_unix_ms);
    drop(controls);
    drop(cluster);
    drop(cgroups);
    Ok(RunResult {
        name: name.to_owned(),
        points,
        moved,
        longest_gap_ms: r["longest_gap_ms"].as_f64().unwrap_or(f64::NAN),
        gaps_over: gaps.len(),
    })
}

fn tail_mean(points: &[Point], from_secs: f64) -> Vec<f64> {
    let tail: Vec<&Point> = points.iter().filter(|p| p.secs >= from_secs).collect();
    (0..NODES)
        .map(|n| tail.iter().map(|p| p.load[n]).sum::<f64>() / tail.len().max(1) as f64)
        .collect()
}

fn chart(title: &str, y_label: &str, points: &[Point], f: impl Fn(&Point, usize) -> f64) -> Chart {
    Chart {
        title: title.into(),
        x_label: "seconds".into(),
        y_label: y_label.into(),
        y_range: None,
        x_log2: false,
        series: (0..NODES)
            .map(|n| Series {
                name: format!("node{}", n + 1),
                points: points.iter().map(|p| (p.secs, f(p, n))).collect(),
            })
            .collect(),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.out)?;
    let rt = ferry_integration::managed::runtime();
    let mut results = Vec::new();
    for name in &args.runs {
        let balancing = match name.as_str() {
            "off" => false,
            "on" => true,
            other => anyhow::bail!("--runs: {other:?} is neither off nor on"),
        };
        eprintln!(
            "run {name}: {} players for {} s",
            args.players, args.duration_s
        );
        results.push(rt.block_on(one_run(&args, name, balancing))?);
    }
    let mut series = String::from("run,secs");
    for n in 1..=NODES {
        write!(series, ",node{n}_load")?;
    }
    for n in 1..=NODES {
        write!(series, ",node{n}_zones")?;
    }
    series.push('\n');
    let mut migrations =
        String::from("run,at_unix_ms,zone,from,to,freeze_ms,longest_gap_after_ms\n");
    let mut md = format!(
        "Live DVE: {NODES} nodes of {} cores each, 100 zone servers, {} players, {} s per run ({} build), {}\n\n\
         | run | load per node, last third (of its capacity) | max-min | s with a node > 95 % | migrations | freeze ms (max) | longest update gap ms | gaps > 100 ms | longest gap after a migration ms |\n|---|---|---|---|---|---|---|---|---|\n",
        args.cores_per_node,
        args.players,
        args.duration_s,
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        humantime_now()
    );
    for r in &results {
        for p in &r.points {
            write!(series, "{},{:.1}", r.name, p.secs)?;
            for l in &p.load {
                write!(series, ",{l:.3}")?;
            }
            for z in &p.zones {
                write!(series, ",{z}")?;
            }
            series.push('\n');
        }
        for m in &r.moved {
            writeln!(
                migrations,
                "{},{},{},{},{},{:.1},{:.1}",
                r.name, m.at_unix_ms, m.zone, m.from, m.to, m.freeze_ms, m.gap_ms
            )?;
        }
        let tail = tail_mean(&r.points, args.duration_s as f64 * 2.0 / 3.0);
        let spread = tail.iter().cloned().fold(f64::MIN, f64::max)
            - tail.iter().cloned().fold(f64::MAX, f64::min);
        let hot = r
            .points
            .iter()
            .filter(|p| p.load.iter().any(|&l| l > 0.95))
            .count()
            * 2;
        writeln!(
            md,
            "| {} | {} | {:.0} pts | {hot} | {} | {:.1} | {:.1} | {} | {:.1} |",
            r.name,
            tail.iter()
                .map(|l| format!("{:.0} %", l * 100.0))
                .collect::<Vec<_>>()
                .join(" / "),
            spread * 100.0,
            r.moved.len(),
            r.moved.iter().map(|m| m.freeze_ms).fold(0.0, f64::max),
            r.longest_gap_ms,
            r.gaps_over,
            r.moved.iter().map(|m| m.gap_ms).fold(0.0, f64::max),
        )?;
        let cpu = chart(
            &format!(
                "Live DVE, balancing {}: each node's load against its capacity",
                r.name
            ),
            "load (share of the node's capacity)",
            &r.points,
            |p, n| p.load[n],
        );
        std::fs::write(args.out.join(format!("cpu_{}.svg", r.name)), cpu.render())?;
        let zones = chart(
            &format!("Live DVE, balancing {}: zone servers per node", r.name),
            "zone servers",
            &r.points,
            |p, n| p.zones[n] as f64,
        );
        std::fs::write(
            args.out.join(format!("zones_{}.svg", r.name)),
            zones.render(),
        )?;
    }
    std::fs::write(args.out.join("timeseries.csv"), series)?;
    std::fs::write(args.out.join("migrations.csv"), migrations)?;
    std::fs::write(args.out.join("summary.md"), &md)?;
    println!("{md}");
    println!("written to {}", args.out.display());
    Ok(())
}

fn humantime_now() -> String {
    let out = Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}
