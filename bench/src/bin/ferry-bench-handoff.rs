//! `cargo xtask bench handoff`: the XtreemOS distributed servers' handoff
//! experiments on ferry.
//!
//! A 2-node group (contact node1, member node2) serves 1 MB downloads
//! (`ferry-group-server --mode download`): node1 sends the first 500 kB,
//! hands the connection to node2, which sends the rest. Each node's
//! uplink (its public and cluster interfaces' egress) is shaped to a
//! speed, as the seed's home agents' upstream links were.
//!
//! - **Table 1** (its handoff time decomposition): per speed, `--runs`
//!   downloads handed off at once after the last send; the mean of each
//!   phase as the donor's ferryd reports it, the bytes of the queues that
//!   crossed, and the client-perceived handoff (the longest silence the
//!   client saw during the download).
//! - **Fig. 2**: per speed of `--wait-speeds`, the client-perceived handoff
//!   against a fixed wait of the donor between its last send and the
//!   handoff (`--waits`), and ferry's own drain (`drain`: until the client
//!   acknowledged everything).
//!
//! - **Scale** (`--scale N`, 0 skips it): N keep-alive clients reach a
//!   3-node group (contact node1, its backup node2, member node3), and
//!   node1 hands each to node2 or node3 in turn after its first exchange;
//!   then node1 fails (agent and processes killed, links down). Reported:
//!   how long the handoffs took, how long until a new connection was
//!   served again (by node2, now the contact node), and how many of the N
//!   connections failed an exchange afterwards (must be 0).
//!
//! Every download's bytes and every echo are checked. Writes CSV, Markdown
//! and an SVG to `--out` (default `target/bench/handoff`).

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use ferry_bench::stats::mean;
use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::group::pattern;
use ferry_integration::managed::run;
use ferry_integration::netns;
use ferry_integration::topology::{CLUSTER_IFACE, PUBLIC_IFACE};
use ferry_proto::v1 as pb;

const PORT: u16 = 8080;
const SIZE: usize = 1_000_000;
const HALF: usize = 500_000;

#[derive(Debug, Parser)]
#[command(
    name = "ferry-bench-handoff",
    about = "the XtreemOS distributed servers' handoff experiments"
)]
struct Args {
    /// Downloads per speed for Table 1 (the seed: 100).
    #[arg(long, default_value_t = 100)]
    runs: usize,
    /// Uplink speeds for Table 1 (tc rates, or "unshaped").
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "unshaped,100mbit,2mbit,1500kbit,1mbit"
    )]
    speeds: Vec<String>,
    /// The donor's fixed waits for Fig. 2, in ms.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0,100,200,300,400,500,600,800,1000"
    )]
    waits: Vec<u64>,
    /// Uplink speeds for Fig. 2.
    #[arg(long, value_delimiter = ',', default_value = "2mbit,1500kbit,1mbit")]
    wait_speeds: Vec<String>,
    /// Downloads per wait for Fig. 2.
    #[arg(long, default_value_t = 10)]
    wait_runs: usize,
    #[arg(long, default_value = "target/bench/handoff")]
    out: PathBuf,
    /// Keep-alive clients of the scale experiment (the seed's question:
    /// 10,000); 0 skips it.
    #[arg(long, default_value_t = 10_000)]
    scale: usize,
    /// Only the scale experiment.
    #[arg(long)]
    scale_only: bool,
}

/// One download.
#[derive(Debug, Clone)]
struct Row {
    experiment: &'static str,
    speed: String,
    /// "0".."1000" (a fixed wait, ms) or "drain".
    wait: String,
    run: usize,
    /// The donor's phases, ms, in the order reported.
    phases: Vec<(String, f64)>,
    handoff_ms: f64,
    queued_bytes: u64,
    client_gap_ms: f64,
    download_ms: f64,
}

impl Row {
    fn phase(&self, name: &str) -> f64 {
        self.phases
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0.0, |(_, v)| *v)
    }
}

/// Shapes (or unshapes) every node's uplink: the egress of its public and
/// cluster interfaces.
fn shape(cluster: &Cluster, speed: &str) -> Result<()> {
    for node in cluster.node_names() {
        for dev in [PUBLIC_IFACE, CLUSTER_IFACE] {
            let mut tc = Command::new("nsenter");
            tc.arg(format!("--net={}", cluster.netns_path(&node).display()));
            if speed == "unshaped" {
                tc.args(["tc", "qdisc", "del", "dev", dev, "root"]);
                // Nothing to delete is fine.
                let _ = tc.output();
                continue;
            }
            tc.args([
                "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", speed, "burst",
                "16000", "latency", "2000ms",
            ]);
            let out = tc.output().context("running tc")?;
            if !out.status.success() {
                bail!(
                    "shaping {node}'s {dev} to {speed}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }
    Ok(())
}

/// One download as a plain client: the body checked, the longest silence
/// between two reads.
fn download(cluster: &Cluster, query: &str) -> Result<(f64, f64)> {
    let addr = SocketAddrV4::new(cluster.public_addr(), PORT);
    let query = query.to_owned();
    netns::run_in(
        &cluster.netns_path("client1"),
        move || -> Result<(f64, f64)> {
            let mut s = TcpStream::connect_timeout(&addr.into(), Duration::from_secs(5))?;
            s.set_read_timeout(Some(Duration::from_secs(30)))?;
            write!(s, "GET /{query} HTTP/1.0\r\n\r\n")?;
            let started = Instant::now();
            let mut body = Vec::with_capacity(SIZE + 256);
            let mut buf = vec![0u8; 64 * 1024];
            let mut last = None;
            let mut longest = Duration::ZERO;
            loop {
                let n = s.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                let now = Instant::now();
                if let Some(l) = last {
                    longest = longest.max(now - l);
                }
                last = Some(now);
                body.extend_from_slice(&buf[..n]);
            }
            let total = started.elapsed();
            let head_end = body
                .windows(4)
                .position(|w| w == b"\r\n\r\n")
                .context("no end to the answer's head")?
                + 4;
            let body = &body[head_end..];
            if body.len() != SIZE || body != pattern(0, SIZE).as_slice() {
                bail!(
                    "the download is not whole and in order ({} bytes)",
                    body.len()
                );
            }
            Ok((longest.as_secs_f64() * 1e3, total.as_secs_f64() * 1e3))
        },
    )?
}

/// The log line of the latest handoff.
fn last_handoff(log: &Path, seen: &mut usize) -> Result<serde_json::Value> {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        // Whole lines only: the server may be writing the next one.
        let lines: Vec<String> = std::fs::read_to_string(log)
            .unwrap_or_default()
            .split_inclusive('\n')
            .filter(|l| l.ends_with('\n'))
            .map(|l| l.trim_end().to_owned())
            .collect();
        if lines.len() > *seen {
            *seen = lines.len();
            return Ok(serde_json::from_str(&lines[lines.len() - 1])?);
        }
        if Instant::now() > until {
            bail!("no handoff logged");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn measure(
    cluster: &Cluster,
    log: &Path,
    seen: &mut usize,
    (experiment, speed, wait, run): (&'static str, &str, &str, usize),
) -> Result<Row> {
    let query = match wait {
        "drain" => "?drain=5000".to_owned(),
        w => format!("?wait={w}"),
    };
    let (client_gap_ms, download_ms) = download(cluster, &query)?;
    let h = last_handoff(log, seen)?;
    if h["outcome"] != "handed-off" {
        bail!("a handoff failed: {h}");
    }
    let phases = h["phases"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .map(|p| {
                    (
                        p["name"].as_str().unwrap_or("?").to_owned(),
                        p["us"].as_f64().unwrap_or(0.0) / 1e3,
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(Row {
        experiment,
        speed: speed.to_owned(),
        wait: wait.to_owned(),
        run,
        phases,
        handoff_ms: h["total_us"].as_f64().unwrap_or(0.0) / 1e3,
        queued_bytes: h["queued_bytes"].as_u64().unwrap_or(0),
        client_gap_ms,
        download_ms,
    })
}

const PHASES: [&str; 9] = [
    "drain",
    "prepare",
    "extract",
    "transfer",
    "rebuild (acceptor)",
    "record",
    "commit",
    "resume (acceptor)",
    "deliver (acceptor)",
];

fn table1(rows: &[Row], speeds: &[String]) -> String {
    let mut md = String::from("| phase (ms, means) |");
    for s in speeds {
        let _ = write!(md, " {s} |");
    }
    md.push_str("\n|---|");
    md.push_str(&"---:|".repeat(speeds.len()));
    md.push('\n');
    let cell = |speed: &str| -> Vec<&Row> {
        rows.iter()
            .filter(|r| r.experiment == "table1" && r.speed == speed)
            .collect()
    };
    let mut line = |name: &str, f: &dyn Fn(&Row) -> f64, digits: usize| {
        let _ = write!(md, "| {name} |");
        for s in speeds {
            let v: Vec<f64> = cell(s).iter().map(|r| f(r)).collect();
            let _ = write!(md, " {:.*} |", digits, mean(&v));
        }
        md.push('\n');
    };
    for p in PHASES {
        if p == "drain" {
            continue;
        }
        line(p, &|r: &Row| r.phase(p), 2);
    }
    line("**handoff, the donor's call**", &|r: &Row| r.handoff_ms, 2);
    line(
        "queued bytes that crossed",
        &|r: &Row| r.queued_bytes as f64,
        0,
    );
    line(
        "**client-perceived handoff** (longest silence)",
        &|r: &Row| r.client_gap_ms,
        2,
    );
    line("whole download", &|r: &Row| r.download_ms, 1);
    md
}

fn fig2(rows: &[Row], args: &Args) -> (String, String) {
    use ferry_policy::sim::svg::{Chart, Series};
    let mut md = String::from("| wait before the handoff |");
    for s in &args.wait_speeds {
        let _ = write!(md, " {s}: client-perceived (ms) | queued bytes |");
    }
    md.push_str("\n|---|");
    md.push_str(&"---:|---:|".repeat(args.wait_speeds.len()));
    md.push('\n');
    let waits: Vec<String> = args
        .waits
        .iter()
        .map(u64::to_string)
        .chain(std::iter::once("drain".to_owned()))
        .collect();
    for w in &waits {
        let label = if w == "drain" {
            "ferry's drain (until acknowledged)".to_owned()
        } else {
            format!("{w} ms")
        };
        let _ = write!(md, "| {label} |");
        for s in &args.wait_speeds {
            let cell: Vec<&Row> = rows
                .iter()
                .filter(|r| r.experiment == "fig2" && &r.speed == s && &r.wait == w)
                .collect();
            let gap: Vec<f64> = cell.iter().map(|r| r.client_gap_ms).collect();
            let queued: Vec<f64> = cell.iter().map(|r| r.queued_bytes as f64).collect();
            let _ = write!(md, " {:.1} | {:.0} |", mean(&gap), mean(&queued));
        }
        md.push('\n');
    }
    let series = args
        .wait_speeds
        .iter()
        .map(|s| Series {
            name: s.clone(),
            points: args
                .waits
                .iter()
                .map(|w| {
                    let gap: Vec<f64> = rows
                        .iter()
                        .filter(|r| {
                            r.experiment == "fig2" && &r.speed == s && r.wait == w.to_string()
                        })
                        .map(|r| r.client_gap_ms)
                        .collect();
                    (*w as f64, mean(&gap))
                })
                .collect(),
        })
        .collect();
    let svg = Chart {
        title: format!(
            "client-perceived handoff against the donor's wait ({}, means)",
            ferry_bench::run::profile()
        ),
        x_label: "the donor's wait after its last send, ms".into(),
        y_label: "client-perceived handoff, ms".into(),
        y_range: None,
        x_log2: false,
        series,
    }
    .render();
    (md, svg)
}

fn csv(rows: &[Row]) -> String {
    let mut out = String::from(
        "experiment,speed,wait,run,profile,handoff_ms,queued_bytes,client_gap_ms,download_ms",
    );
    for p in PHASES {
        let _ = write!(out, ",{}_ms", p.split(' ').next().unwrap_or(p));
    }
    out.push('\n');
    let profile = ferry_bench::run::profile();
    for r in rows {
        let _ = write!(
            out,
            "{},{},{},{},{profile},{:.3},{},{:.3},{:.3}",
            r.experiment,
            r.speed,
            r.wait,
            r.run,
            r.handoff_ms,
            r.queued_bytes,
            r.client_gap_ms,
            r.download_ms
        );
        for p in PHASES {
            let _ = write!(out, ",{:.3}", r.phase(p));
        }
        out.push('\n');
    }
    out
}

/// One echo exchange of `msg` on `s`.
fn echo(s: &mut TcpStream, msg: &[u8]) -> std::io::Result<()> {
    s.write_all(msg)?;
    let mut back = vec![0; msg.len()];
    s.read_exact(&mut back)?;
    if back != msg {
        return Err(std::io::Error::other("the echo differs"));
    }
    Ok(())
}

/// The scale experiment; its Markdown.
fn scale(n: usize) -> Result<String> {
    ferry_integration::group::raise_nofile();
    let cluster = Cluster::start(ClusterSpec::new(3, 1)).context("starting the cluster")?;
    let rt = ferry_integration::managed::runtime();
    let server = ferry_integration::bin_path("ferry-group-server")
        .to_string_lossy()
        .into_owned();
    rt.block_on(async {
        let mut c: Vec<_> = Vec::new();
        for node in ["node1", "node2", "node3"] {
            c.push(cluster.control(node).await?);
        }
        c[0].create_group(pb::CreateGroupRequest {
            group: Some(pb::Group {
                port: u32::from(PORT),
                contact: "node1".into(),
                backups: vec!["node2".into()],
                members: vec!["node3".into()],
                ..Default::default()
            }),
        })
        .await?;
        let argv = |extra: &[&str]| -> Vec<String> {
            [
                server.as_str(),
                "--port",
                &PORT.to_string(),
                "--mode",
                "echo",
            ]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
        };
        run(
            &mut c[0],
            argv(&["--handoff-after", "8", "--to", "node2,node3"]),
        )
        .await;
        run(&mut c[1], argv(&[])).await;
        run(&mut c[2], argv(&[])).await;
        for cl in c.iter_mut() {
            let until = Instant::now() + Duration::from_secs(20);
            while cl
                .list_groups(pb::ListGroupsRequest {})
                .await?
                .into_inner()
                .groups
                .iter()
                .all(|g| g.server_pids.is_empty())
            {
                if Instant::now() > until {
                    bail!("no group server registered");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    let addr = SocketAddrV4::new(cluster.public_addr(), PORT);
    let client = cluster.netns_path("client1");
    let started = Instant::now();
    let mut conns = netns::run_in(&client, move || -> Result<Vec<TcpStream>> {
        ferry_integration::group::raise_nofile();
        let mut conns = Vec::with_capacity(n);
        for i in 0..n {
            let mut s = TcpStream::connect_timeout(&addr.into(), Duration::from_secs(10))?;
            s.set_read_timeout(Some(Duration::from_secs(30)))?;
            echo(&mut s, format!("{i:08}").as_bytes())?;
            conns.push(s);
        }
        Ok(conns)
    })??;
    let connected = started.elapsed();
    let taken = rt.block_on(async {
        let until = Instant::now() + Duration::from_secs(600);
        loop {
            let mut taken = 0;
            for node in ["node2", "node3"] {
                let mut c = cluster.control(node).await?;
                taken += c
                    .list_groups(pb::ListGroupsRequest {})
                    .await?
                    .into_inner()
                    .groups
                    .iter()
                    .map(|g| g.handoffs_taken)
                    .sum::<u64>();
            }
            if taken as usize >= n || Instant::now() > until {
                return Ok::<_, anyhow::Error>(taken);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })?;
    let handed = started.elapsed();
    println!("scale: {n} connections opened in {connected:?}, {taken} handed off by {handed:?}");
    let before_fail = conns
        .iter_mut()
        .map(|s| echo(s, b"before-f").is_err())
        .filter(|failed| *failed)
        .count();
    cluster.fail_node("node1")?;
    let failed = Instant::now();
    let served_again = netns::run_in(&client, move || -> Result<Duration> {
        loop {
            let ok = TcpStream::connect_timeout(&addr.into(), Duration::from_millis(200))
                .and_then(|mut s| {
                    s.set_read_timeout(Some(Duration::from_millis(500)))?;
                    echo(&mut s, b"new-conn")
                })
                .is_ok();
            if ok {
                return Ok(failed.elapsed());
            }
            if failed.elapsed() > Duration::from_secs(30) {
                bail!("no new connection served within 30 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    })??;
    let lost = conns
        .iter_mut()
        .map(|s| echo(s, b"after-fa").is_err())
        .filter(|failed| *failed)
        .count();
    println!(
        "scale: node1 failed; new connections served again after {served_again:?}; {lost} of {n} connections lost ({before_fail} failed before)"
    );
    Ok(format!(
        "## Scale: {n} keep-alive clients, then the contact node fails ({})\n\n\
         | keep-alive connections | handed off (to node2 or node3) | handoffs done after | \
         new connections served again after node1 failed | connections lost |\n\
         |---:|---:|---:|---:|---:|\n\
         | {n} | {taken} | {:.1} s | {:.0} ms | {} |\n",
        ferry_bench::run::profile(),
        handed.as_secs_f64(),
        served_again.as_secs_f64() * 1e3,
        lost + before_fail,
    ))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let profile = ferry_bench::run::profile();
    println!("binaries: {profile} profile");
    if args.scale_only {
        let md = scale(args.scale)?;
        println!("\n{md}");
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("handoff-scale.md"), &md)?;
        return Ok(());
    }
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).context("starting the cluster")?;
    let log = cluster.dir().join("handoffs.jsonl");
    let rt = ferry_integration::managed::runtime();
    rt.block_on(async {
        let mut c1 = cluster.control("node1").await?;
        let mut c2 = cluster.control("node2").await?;
        c1.create_group(pb::CreateGroupRequest {
            group: Some(pb::Group {
                port: u32::from(PORT),
                contact: "node1".into(),
                members: vec!["node2".into()],
                ..Default::default()
            }),
        })
        .await?;
        let server = ferry_integration::bin_path("ferry-group-server")
            .to_string_lossy()
            .into_owned();
        let common = |extra: &[&str]| -> Vec<String> {
            [
                server.as_str(),
                "--port",
                &PORT.to_string(),
                "--mode",
                "download",
                "--size",
                &SIZE.to_string(),
            ]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
        };
        run(
            &mut c1,
            common(&[
                "--handoff-after",
                &HALF.to_string(),
                "--to",
                "node2",
                "--log",
                &log.to_string_lossy(),
            ]),
        )
        .await;
        run(&mut c2, common(&[])).await;
        for c in [&mut c1, &mut c2] {
            let until = Instant::now() + Duration::from_secs(20);
            loop {
                let groups = c
                    .list_groups(pb::ListGroupsRequest {})
                    .await?
                    .into_inner()
                    .groups;
                if groups.iter().any(|g| !g.server_pids.is_empty()) {
                    break;
                }
                if Instant::now() > until {
                    bail!("no group server registered");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    let mut rows = Vec::new();
    let mut seen = 0;
    for speed in &args.speeds {
        shape(&cluster, speed)?;
        for run in 0..args.runs {
            let r = measure(&cluster, &log, &mut seen, ("table1", speed, "0", run))?;
            println!(
                "table1 {speed:>9} run {run:>3}: handoff {:>8.2} ms, queued {:>7} B, client gap {:>8.2} ms",
                r.handoff_ms, r.queued_bytes, r.client_gap_ms
            );
            rows.push(r);
        }
    }
    for speed in &args.wait_speeds {
        shape(&cluster, speed)?;
        let waits: Vec<String> = args
            .waits
            .iter()
            .map(u64::to_string)
            .chain(std::iter::once("drain".to_owned()))
            .collect();
        for w in &waits {
            for run in 0..args.wait_runs {
                let r = measure(&cluster, &log, &mut seen, ("fig2", speed, w, run))?;
                println!(
                    "fig2 {speed:>9} wait {w:>5}: queued {:>7} B, client gap {:>8.2} ms",
                    r.queued_bytes, r.client_gap_ms
                );
                rows.push(r);
            }
        }
    }
    shape(&cluster, "unshaped")?;
    std::fs::create_dir_all(&args.out)?;
    let mut md = String::new();
    if args.runs > 0 {
        let t1 = table1(&rows, &args.speeds);
        md += &format!(
            "## Table 1: the handoff's phases ({profile}, {} downloads per speed)\n\n{t1}\n",
            args.runs
        );
    }
    // An experiment not run (`--runs 0`, `--wait-runs 0`) gets no table
    // of zeros, and no plot.
    if args.wait_runs > 0 {
        let (f2, svg) = fig2(&rows, &args);
        md += &format!(
            "## Fig. 2: client-perceived handoff against the donor's wait ({profile}, {} downloads per cell)\n\n{f2}",
            args.wait_runs
        );
        std::fs::write(args.out.join("handoff.svg"), svg)?;
    }
    println!("\n{md}");
    std::fs::write(args.out.join("handoff.md"), &md)?;
    std::fs::write(args.out.join("handoff.csv"), csv(&rows))?;
    drop(cluster);
    if args.scale > 0 {
        let md = scale(args.scale)?;
        println!("\n{md}");
        std::fs::write(args.out.join("handoff-scale.md"), &md)?;
    }
    println!("written to {}", args.out.display());
    Ok(())
}
