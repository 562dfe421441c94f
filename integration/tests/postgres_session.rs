//! Self-test of the PostgreSQL pieces of the session-migration test: a
//! `PostgresServer` in a namespace of its own and `ferry-pg-session`
//! holding one session to it, read through its status line. No cluster, no
//! agent. Root only; skipped with a reason otherwise.
//!
//! `cargo build -p ferry-integration --bins &&
//!  cargo test -p ferry-integration --test postgres_session -- --nocapture`

use std::io::Read;
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferry_integration::cmd;
use ferry_integration::netns::{self, NetNs};
use ferry_integration::postgres::{PG_PORT, PostgresServer};
use ferry_integration::reap;

const ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 250, 1);
const STATUS_PORT: u16 = 7300;

/// `$FERRY_BIN_DIR/ferry-pg-session` when set, else the one cargo built
/// for this test.
fn session_bin() -> PathBuf {
    match std::env::var_os("FERRY_BIN_DIR") {
        Some(d) if !d.is_empty() => ferry_integration::bin_path("ferry-pg-session"),
        _ => PathBuf::from(env!("CARGO_BIN_EXE_ferry-pg-session")),
    }
}

fn session_cmd() -> Command {
    let mut cmd = Command::new(session_bin());
    cmd.args(["--pg", &format!("{ADDR}:{PG_PORT}")])
        .args(["--user", "postgres", "--database", "postgres"])
        .args(["--serve", &format!("{ADDR}:{STATUS_PORT}")])
        .args(["--interval-ms", "50", "--linger-ms", "3000"])
        .stdin(Stdio::null());
    cmd
}

/// A namespace with `ADDR/24` on its loopback; on drop every process left
/// in it is killed, then it is deleted.
struct TestNs(NetNs);

impl TestNs {
    fn create() -> Self {
        let ns = Self(
            NetNs::create(&format!(
                "{}{}-pgt",
                ferry_integration::reap::NETNS_PREFIX,
                std::process::id()
            ))
            .unwrap(),
        );
        cmd::ip_batch(
            Some(ns.0.name()),
            &[
                "link set lo up".into(),
                format!("addr add {ADDR}/24 dev lo"),
            ],
        )
        .unwrap();
        ns
    }

    fn path(&self) -> PathBuf {
        self.0.path()
    }
}

impl Drop for TestNs {
    fn drop(&mut self) {
        let left = reap::kill_all_in(&[self.0.name()], Duration::from_secs(5));
        if !left.is_empty() {
            eprintln!("processes {left:?} survived SIGKILL in {}", self.0.name());
        }
    }
}

/// One status line of `ferry-pg-session`, read from inside the namespace.
fn try_status(ns: &Path) -> std::io::Result<serde_json::Value> {
    let line = netns::run_in(ns, || {
        let mut s = TcpStream::connect_timeout(
            &SocketAddrV4::new(ADDR, STATUS_PORT).into(),
            Duration::from_secs(2),
        )?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut line = String::new();
        s.read_to_string(&mut line)?;
        std::io::Result::Ok(line)
    })
    .unwrap()?;
    assert!(line.ends_with('\n'), "one whole line: {line:?}");
    Ok(serde_json::from_str(&line).unwrap_or_else(|e| panic!("status {line:?}: {e}")))
}

fn status(ns: &Path) -> serde_json::Value {
    try_status(ns).unwrap_or_else(|e| panic!("reading the status: {e}"))
}

#[test]
fn pg_session_keeps_one_backend_and_reports_it() {
    if !ferry_integration::can_run("pg_session_keeps_one_backend_and_reports_it") {
        return;
    }
    // Dropped in reverse: the session, the server, then the namespace.
    let ns = TestNs::create();

    // No server yet: a clear error and exit status 2, no retrying.
    let mut cmd = session_cmd();
    cmd.stderr(Stdio::piped());
    let out = netns::spawn_in(&ns.path(), cmd)
        .unwrap()
        .into_inner()
        .wait_with_output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("connecting"), "{stderr}");

    let pg = PostgresServer::start(&ns.path(), SocketAddrV4::new(ADDR, PG_PORT)).unwrap();
    assert_eq!(pg.query("SELECT 1 + 1").unwrap(), "2");

    let mut session = netns::spawn_in(&ns.path(), session_cmd()).unwrap();

    // Until five queries went through; refused while it is starting.
    let deadline = Instant::now() + Duration::from_secs(20);
    let first = loop {
        if let Some(exit) = session.try_wait().unwrap() {
            panic!(
                "ferry-pg-session exited ({exit}); server log:\n{}",
                pg.log_tail(20)
            );
        }
        match try_status(&ns.path()) {
            Ok(s) if s["queries_ok"].as_u64().unwrap() >= 5 => break s,
            Ok(s) => assert!(Instant::now() < deadline, "no 5 queries in 20 s: {s}"),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                assert!(Instant::now() < deadline, "status never served: {e}");
            }
            Err(e) => panic!("reading the status: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!("status: {first}");
    assert!(first["last_error"].is_null(), "{first}");
    assert_eq!(first["queries_failed"], 0, "{first}");
    assert_eq!(first["client_addr"], ADDR.to_string(), "{first}");
    let pid = first["backend_pid"].as_i64().unwrap();
    let port = first["client_port"].as_i64().unwrap();
    assert!(port > 0, "{first}");

    let activity = pg
        .query(
            "SELECT pid, client_addr, client_port FROM pg_stat_activity \
             WHERE application_name = 'ferry-pg-session'",
        )
        .unwrap();
    assert_eq!(
        activity,
        format!("{pid}|{ADDR}|{port}"),
        "pg_stat_activity disagrees with {first}"
    );

    // Same backend, counter moving on.
    let mut last_counter = first["last_counter"].as_u64().unwrap();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(200));
        let s = status(&ns.path());
        assert_eq!(s["backend_pid"], pid, "{s}");
        assert_eq!(s["client_port"], port, "{s}");
        let counter = s["last_counter"].as_u64().unwrap();
        assert!(
            counter > last_counter,
            "counter stuck at {last_counter}: {s}"
        );
        assert_eq!(s["queries_ok"], counter, "{s}");
        assert!(s["last_error"].is_null(), "{s}");
        last_counter = counter;
    }

    // A killed backend ends the session for good: the error is recorded,
    // nothing reconnects, the process exits non-zero.
    assert_eq!(
        pg.query(&format!("SELECT pg_terminate_backend({pid})"))
            .unwrap(),
        "t"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let ended = loop {
        let s = status(&ns.path());
        if !s["last_error"].is_null() {
            break s;
        }
        assert!(Instant::now() < deadline, "termination not noticed: {s}");
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("after pg_terminate_backend: {ended}");
    let error = ended["last_error"].as_str().unwrap();
    assert!(error.contains("57P01"), "{ended}");
    assert_eq!(ended["backend_pid"], pid, "{ended}");
    let count = pg
        .query("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'ferry-pg-session'")
        .unwrap();
    assert_eq!(count, "0", "ferry-pg-session reconnected");
    let deadline = Instant::now() + Duration::from_secs(10);
    let exit = loop {
        if let Some(exit) = session.try_wait().unwrap() {
            break exit;
        }
        assert!(Instant::now() < deadline, "still running after the linger");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(exit.code(), Some(1), "{exit}");
}
