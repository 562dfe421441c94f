//! `cargo xtask demo`: a 3-node single-IP cluster in network namespaces, an
//! echo server with 16 live client connections, migrated node1 -> node2 ->
//! node3 with the `ferry` CLI, then the clients' verdict. Everything it made
//! is removed at the end, also on failure.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::workload::SeqClient;

const CONNECTIONS: usize = 16;

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo failed: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn ferry(cluster: &Cluster, node: &str, args: &[&str]) -> Result<String> {
    let bin = ferry_integration::bin_dir().join("ferry");
    println!("\n$ ferry {}    # on {node}", args.join(" "));
    let out = Command::new(&bin)
        .args(args)
        .env("FERRY_SOCKET", cluster.control_socket(node))
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{}", String::from_utf8_lossy(&out.stderr));
    print!("{stdout}");
    if !out.status.success() {
        bail!("ferry {} failed ({})", args.join(" "), out.status);
    }
    Ok(stdout)
}

fn run() -> Result<()> {
    if !ferry_integration::is_root() {
        bail!("the demo builds network namespaces and runs CRIU: run it as root");
    }
    println!(
        "Building a 3-node single-IP cluster (network namespaces; shared address 198.18.0.100)..."
    );
    let cluster = Cluster::start(ClusterSpec::new(3, 1)).context("starting the cluster")?;
    ferry(&cluster, "node1", &["nodes"])?;
    let echo = ferry_integration::bin_dir().join("ferry-echo-server");
    let echo = echo.to_string_lossy().into_owned();
    let pid: i32 = ferry(&cluster, "node1", &["run", "--", &echo, "--port", "7000"])?
        .trim()
        .parse()
        .context("PID from `ferry run`")?;
    cluster
        .wait_listening("node1", 7000, Duration::from_secs(10))
        .context("echo server listening")?;

    let target = SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 100), 7000);
    println!(
        "\nStarting {CONNECTIONS} client connections from client1, 256-byte messages every 50 ms each..."
    );
    let client = SeqClient::start(
        cluster.netns_path("client1"),
        target,
        CONNECTIONS,
        Duration::from_millis(50),
        256,
    )?;
    client.wait_until_flowing(Duration::from_secs(10))?;
    ferry(&cluster, "node1", &["ps"])?;

    ferry(
        &cluster,
        "node1",
        &["migrate", &pid.to_string(), "--to", "node2"],
    )?;
    let json = ferry(&cluster, "node2", &["ps", "--json"])?;
    let v: serde_json::Value = serde_json::from_str(&json)?;
    let pid2 = v["processes"][0]["pid"].as_i64().context("PID on node2")?;
    let mark = client.verified_per_connection();
    client.wait_until_each_passes(&mark, 10, Duration::from_secs(20))?;

    ferry(
        &cluster,
        "node2",
        &["migrate", &pid2.to_string(), "--to", "node3"],
    )?;
    let mark = client.verified_per_connection();
    client.wait_until_each_passes(&mark, 10, Duration::from_secs(20))?;
    ferry(&cluster, "node3", &["ps"])?;

    let report = client.stop();
    println!("\nWhat the clients saw:\n{report}");
    report.check_clean().map_err(anyhow::Error::msg)?;
    println!("\nEvery byte came back once and in order. Cleaning up.");
    Ok(())
}
