//! The commands about managed processes: `ferry ps`, `run`, `adopt`, `wait`
//! and `signal`.

use anyhow::Result;
use ferry_proto::v1::{self as pb, ListProcessesRequest, RunProcessRequest};
use serde_json::json;

use crate::connection::{Client, status_error};
use crate::follow;
use crate::output::{port_str, print_processes};

pub(crate) async fn ps(client: &mut Client, node: String, all: bool, as_json: bool) -> Result<()> {
    let r = client
        .list_processes(ListProcessesRequest {
            node,
            all_nodes: all,
        })
        .await
        .map_err(status_error)?
        .into_inner();
    print_processes(r, as_json)
}

pub(crate) async fn run(
    client: &mut Client,
    request: RunProcessRequest,
    foreground: bool,
    as_json: bool,
) -> Result<()> {
    let signals = if foreground {
        Some(follow::Signals::catch()?)
    } else {
        None
    };
    let started = client
        .run_process(request)
        .await
        .map_err(status_error)?
        .into_inner();
    if let Some(signals) = signals {
        let exit = follow::follow(client, started.node, started.pid, signals).await?;
        follow::end_like(&exit);
    }
    if as_json {
        println!("{}", json!({ "pid": started.pid, "node": started.node }));
    } else {
        println!("{}", started.pid);
    }
    Ok(())
}

pub(crate) async fn adopt(
    client: &mut Client,
    node: String,
    pid: i32,
    foreground: bool,
    as_json: bool,
) -> Result<()> {
    let signals = if foreground {
        Some(follow::Signals::catch()?)
    } else {
        None
    };
    let p = client
        .adopt_process(pb::AdoptProcessRequest { pid, node })
        .await
        .map_err(status_error)?
        .into_inner();
    if let Some(signals) = signals {
        eprintln!("ferry: adopted PID {} on {}", p.pid, p.node);
        let exit = follow::follow(client, p.node, p.pid, signals).await?;
        follow::end_like(&exit);
    }
    let ports = p.ports.iter().map(port_str).collect::<Vec<_>>();
    if as_json {
        println!(
            "{}",
            json!({ "pid": p.pid, "node": p.node, "argv": p.argv, "ports": ports })
        );
    } else {
        println!(
            "adopted PID {} on {}: {} (ports: {})",
            p.pid,
            p.node,
            p.argv.join(" "),
            if ports.is_empty() {
                "none".into()
            } else {
                ports.join(",")
            }
        );
    }
    Ok(())
}

/// Follows the process wherever it moves, then ends as it did.
pub(crate) async fn wait(client: &mut Client, node: String, pid: i32) -> Result<()> {
    let exit = follow::follow(client, node, pid, follow::Signals::none()).await?;
    follow::end_like(&exit);
}

pub(crate) async fn signal(
    client: &mut Client,
    node: String,
    pid: i32,
    signal: &str,
    as_json: bool,
) -> Result<()> {
    let number = signal_number(signal)?;
    let r = client
        .signal_process(pb::SignalProcessRequest {
            pid,
            signal: number,
            node,
        })
        .await
        .map_err(status_error)?
        .into_inner();
    if !as_json {
        println!("signal {number} sent to PID {pid} on {}", r.node);
    }
    Ok(())
}

/// "TERM", "SIGTERM" or "15" as a signal number.
fn signal_number(s: &str) -> Result<i32> {
    if let Ok(n) = s.parse::<i32>() {
        return Ok(n);
    }
    let name = s.to_ascii_uppercase();
    let name = if name.starts_with("SIG") {
        name
    } else {
        format!("SIG{name}")
    };
    name.parse::<nix::sys::signal::Signal>()
        .map(|s| s as i32)
        .map_err(|_| anyhow::anyhow!("--signal: {s:?} is not a signal name or number"))
}
