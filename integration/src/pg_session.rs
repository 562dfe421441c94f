//! The status of `ferry-pg-session` (one PostgreSQL session held for the
//! process's whole life), read from a client namespace: what tests and
//! benches check to know that the very same session survived a migration.

use std::io::Read;
use std::net::{SocketAddrV4, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::netns::run_in;

/// The arguments of `ferry-pg-session` after its path: one session to
/// the PostgreSQL server at `pg` (user and database `postgres`), a query
/// every 50 ms, its status served at `serve`.
pub fn args(pg: impl Into<std::net::SocketAddr>, serve: SocketAddrV4) -> Vec<String> {
    let pg: std::net::SocketAddr = pg.into();
    [
        "--pg",
        &pg.to_string(),
        "--user",
        "postgres",
        "--database",
        "postgres",
        "--serve",
        &serve.to_string(),
        "--interval-ms",
        "50",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// The session's status line (see `ferry-pg-session`'s docs).
#[derive(Debug, Clone, PartialEq)]
pub struct SessionStatus {
    pub backend_pid: i64,
    pub client_addr: String,
    pub client_port: i64,
    pub queries_ok: u64,
    pub queries_failed: u64,
    pub last_counter: i64,
    pub last_error: Option<String>,
}

/// Reads the status once, connecting from `netns` to `target` (the
/// shared public address: whichever node owns the port answers).
pub fn session_status(netns: &Path, target: SocketAddrV4) -> Result<SessionStatus, String> {
    let line = run_in(netns, move || {
        let mut s = TcpStream::connect_timeout(&target.into(), Duration::from_secs(2))
            .map_err(|e| format!("connect {target}: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))
            .map_err(|e| format!("read timeout: {e}"))?;
        let mut line = String::new();
        s.read_to_string(&mut line)
            .map_err(|e| format!("read {target}: {e}"))?;
        Ok::<_, String>(line)
    })
    .map_err(|e| e.to_string())??;
    let v: serde_json::Value =
        serde_json::from_str(line.trim()).map_err(|e| format!("{line:?}: {e}"))?;
    let num = |k: &str| {
        v[k].as_i64()
            .ok_or_else(|| format!("{k} missing in {line}"))
    };
    Ok(SessionStatus {
        backend_pid: num("backend_pid")?,
        client_addr: v["client_addr"].as_str().unwrap_or_default().to_owned(),
        client_port: num("client_port")?,
        queries_ok: num("queries_ok")? as u64,
        queries_failed: num("queries_failed")? as u64,
        last_counter: num("last_counter")?,
        last_error: v["last_error"].as_str().map(str::to_owned),
    })
}

/// Waits until the session has answered `n` more queries than `since`;
/// the last status or error read when `timeout` passes.
pub fn wait_for_queries(
    netns: &Path,
    target: SocketAddrV4,
    since: u64,
    n: u64,
    timeout: Duration,
) -> Result<SessionStatus, String> {
    let deadline = Instant::now() + timeout;
    let mut last = Err("no status yet".to_owned());
    while Instant::now() < deadline {
        last = session_status(netns, target);
        if let Ok(s) = &last
            && s.queries_ok >= since + n
        {
            return Ok(s.clone());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!(
        "the session did not answer {n} more queries than {since} in {timeout:?}: {last:?}"
    ))
}
