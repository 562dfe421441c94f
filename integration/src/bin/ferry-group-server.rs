//! A server of a distributed server's group, for ferry's tests and
//! benchmarks: it serves the group's port on its node and registers with
//! its ferryd (`ferry-handoff`) to take the connections handed to it.
//!
//! - `download`: an HTTP/1.0 download of `--size` bytes of
//!   `ferry_integration::group::pattern`; the node that takes the
//!   connection sends `--handoff-after` bytes and hands it to `--to` (after
//!   waiting `--drain-ms` for the client's acknowledgements), which sends
//!   the rest and closes: the XtreemOS distributed servers' handoff
//!   experiment (its Table 1 and Fig. 2).
//! - `echo`: echoes every byte; after `--handoff-after` bytes it hands the
//!   connection to `--to`, which echoes on.
//!
//! A failed handoff leaves the connection here, and this server goes on
//! with it. Each handoff appends a JSON line to `--log`: its outcome and
//! phases.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use ferry_handoff::{HandoffOptions, Server};
use ferry_integration::group::pattern;

#[derive(Debug, Clone, Parser)]
struct Args {
    #[arg(long)]
    port: u16,
    /// Address to listen on (`::` takes IPv6 and IPv4 clients alike).
    #[arg(long, default_value = "0.0.0.0")]
    bind: std::net::IpAddr,
    #[arg(long, value_parser = ["download", "echo"])]
    mode: String,
    /// Download size in bytes.
    #[arg(long, default_value_t = 1_000_000)]
    size: u64,
    /// Bytes this node sends (download) or echoes (echo) before handing
    /// a connection off; 0: never.
    #[arg(long, default_value_t = 0)]
    handoff_after: u64,
    /// The node to hand connections to; several, comma-separated: each in
    /// turn; `auto`: the one the group's placement policy chooses for each
    /// (`ferry_handoff::place`), this node included (then no handoff).
    #[arg(long)]
    to: Option<String>,
    #[arg(long, default_value_t = 0)]
    drain_ms: u64,
    /// Where each handoff's outcome is appended (a JSON line).
    #[arg(long)]
    log: Option<PathBuf>,
}

const CHUNK: usize = 16 * 1024;

/// Turns through `--to`'s nodes.
static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn main() -> Result<()> {
    let args = Arc::new(Args::parse());
    // Thousands of connections (the scale experiment): as many descriptors
    // as the hard limit allows.
    ferry_integration::group::raise_nofile();
    let listener = TcpListener::bind((args.bind, args.port))
        .with_context(|| format!("listening on port {}", args.port))?;
    // The group may be created after this server starts.
    let server = {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            match Server::serve(args.port) {
                Ok(s) => break s,
                Err(e) if Instant::now() < until => {
                    eprintln!("serve: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(e).context("registering as the group's server"),
            }
        }
    };
    let a = args.clone();
    std::thread::spawn(move || {
        loop {
            match server.accept() {
                Ok(h) => {
                    let a = a.clone();
                    std::thread::spawn(move || {
                        let offset = h
                            .state
                            .get(..8)
                            .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap()));
                        if let Err(e) = go_on(&a, h.stream, offset) {
                            eprintln!("a handed-off connection: {e}");
                        }
                    });
                }
                Err(e) => {
                    eprintln!("taking handed-off connections: {e}");
                    return;
                }
            }
        }
    });
    for conn in listener.incoming() {
        let conn = conn.context("accepting")?;
        let a = args.clone();
        std::thread::spawn(move || {
            if let Err(e) = serve_new(&a, conn) {
                eprintln!("a connection: {e}");
            }
        });
    }
    Ok(())
}

/// A new connection: serve it up to the handoff point, hand it off, and
/// go on with it if the handoff fails.
fn serve_new(a: &Args, mut conn: TcpStream) -> Result<()> {
    let mut done = 0u64;
    // A download's request may say how long to wait before the handoff:
    // `GET /?wait=MS` (a fixed wait, the XtreemOS distributed servers'
    // Fig. 2) or `GET /?drain=MS` (ferry's: until the client acknowledged
    // everything, at most that long).
    let (mut wait_ms, mut drain_ms) = (0, a.drain_ms);
    match a.mode.as_str() {
        "download" => {
            let mut reader = BufReader::new(conn.try_clone()?);
            let mut line = String::new();
            let mut first = true;
            loop {
                line.clear();
                if reader.read_line(&mut line)? == 0 || line == "\r\n" || line == "\n" {
                    break;
                }
                if std::mem::take(&mut first) {
                    (wait_ms, drain_ms) = query(&line, drain_ms);
                }
            }
            write!(
                conn,
                "HTTP/1.0 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\n\r\n",
                a.size
            )?;
            let until = if a.to.is_some() && a.handoff_after > 0 {
                a.handoff_after.min(a.size)
            } else {
                a.size
            };
            send_range(&mut conn, 0, until)?;
            done = until;
        }
        _ => {
            let limit = if a.to.is_some() && a.handoff_after > 0 {
                a.handoff_after
            } else {
                u64::MAX
            };
            let mut buf = vec![0u8; CHUNK];
            while done < limit {
                let want = (limit - done).min(CHUNK as u64) as usize;
                let n = conn.read(&mut buf[..want])?;
                if n == 0 {
                    return Ok(());
                }
                conn.write_all(&buf[..n])?;
                done += n as u64;
            }
        }
    }
    let placed;
    let to = match a.to.as_deref() {
        Some("auto") => {
            placed = ferry_handoff::place(a.port).context("placing the connection")?;
            (!placed.here).then_some(placed.node.as_str())
        }
        Some(list) => {
            let nodes: Vec<&str> = list.split(',').collect();
            let i = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(nodes[i % nodes.len()])
        }
        None => None,
    };
    if let Some(to) = to
        && a.handoff_after > 0
    {
        if wait_ms > 0 {
            std::thread::sleep(Duration::from_millis(wait_ms));
        }
        let options = HandoffOptions {
            drain: Duration::from_millis(drain_ms),
        };
        let started = Instant::now();
        match ferry_handoff::handoff(conn, to, &done.to_le_bytes(), &options) {
            Ok(h) => {
                log(
                    a,
                    &serde_json::json!({
                        "outcome": "handed-off",
                        "acceptor": h.acceptor,
                        "at": done,
                        "wait_ms": wait_ms,
                        "drain_ms": drain_ms,
                        "queued_bytes": h.queued_bytes,
                        "total_us": started.elapsed().as_micros() as u64,
                        "phases": h.phases.iter().map(|p| serde_json::json!({"name": p.name, "us": p.micros})).collect::<Vec<_>>(),
                    }),
                );
                return Ok(());
            }
            Err((back, e)) => {
                log(
                    a,
                    &serde_json::json!({"outcome": "failed", "at": done, "error": e.to_string()}),
                );
                conn = back;
            }
        }
    }
    go_on(a, conn, done)
}

/// The rest of a connection from `offset` on.
fn go_on(a: &Args, mut conn: TcpStream, offset: u64) -> Result<()> {
    match a.mode.as_str() {
        "download" => {
            send_range(&mut conn, offset, a.size)?;
            conn.shutdown(Shutdown::Write)?;
            // Until the client closes: closing with its bytes unread would
            // reset the connection.
            let mut sink = [0u8; 256];
            while conn.read(&mut sink)? > 0 {}
        }
        _ => {
            let mut buf = vec![0u8; CHUNK];
            loop {
                let n = conn.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                conn.write_all(&buf[..n])?;
            }
        }
    }
    Ok(())
}

/// `wait` and `drain` (milliseconds) from a request line's query.
fn query(request_line: &str, drain_default: u64) -> (u64, u64) {
    let (mut wait, mut drain) = (0, drain_default);
    let target = request_line.split_whitespace().nth(1).unwrap_or("");
    if let Some((_, q)) = target.split_once('?') {
        for kv in q.split('&') {
            match kv.split_once('=') {
                Some(("wait", v)) => wait = v.parse().unwrap_or(0),
                Some(("drain", v)) => drain = v.parse().unwrap_or(drain_default),
                _ => {}
            }
        }
    }
    (wait, drain)
}

fn send_range(conn: &mut TcpStream, from: u64, to: u64) -> Result<()> {
    let mut at = from;
    while at < to {
        let n = (to - at).min(CHUNK as u64) as usize;
        conn.write_all(&pattern(at, n))?;
        at += n as u64;
    }
    Ok(())
}

fn log(a: &Args, v: &serde_json::Value) {
    let Some(path) = &a.log else { return };
    let r = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        // One write of the whole line (O_APPEND): a reader never sees
        // half of one.
        .and_then(|mut f| f.write_all(format!("{v}\n").as_bytes()));
    if let Err(e) = r {
        eprintln!("{}: {e}", path.display());
    }
}
