//! A throw-away PostgreSQL server in a network namespace, for the test that
//! migrates a process holding a database session (`ferry-pg-session`).
//!
//! Debian's server binaries (`/usr/lib/postgresql/<version>/bin`, the
//! `postgresql` package that `cargo xtask setup` installs) run as the
//! `postgres` OS user on a fresh data directory in a temp dir, listening on
//! one address of the test networks (198.18.0.0/15) with `trust`
//! authentication for those networks. The Debian package's own cluster and
//! service are never used.
//!
//! ```no_run
//! use std::net::{Ipv4Addr, SocketAddrV4};
//! use ferry_integration::postgres::PostgresServer;
//! # fn f(cluster: &ferry_integration::Cluster) -> Result<(), Box<dyn std::error::Error>> {
//! let addr = SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 12), 5432);
//! let pg = PostgresServer::start(&cluster.netns_path("client2"), addr)?;
//! let pids = pg.query("SELECT pid FROM pg_stat_activity WHERE application_name = 'ferry-pg-session'")?;
//! # Ok(()) }
//! ```

use std::fs::File;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::{Gid, Pid, Uid, User};

use crate::cmd::{self, CmdError};
use crate::netns::{self, NetNsError};
use crate::reap::TEMPDIR_PREFIX;

/// Where Debian installs the server, one directory per major version.
pub const PG_LIB_DIR: &str = "/usr/lib/postgresql";
/// The OS user (and database superuser) everything runs as.
pub const PG_USER: &str = "postgres";
/// The default port.
pub const PG_PORT: u16 = 5432;

/// How long the server may take to accept connections after it starts.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a fast shutdown may take before the server is SIGKILLed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Lines of the server log quoted in errors and after a panic.
const LOG_TAIL_LINES: usize = 30;

#[derive(Debug, thiserror::Error)]
pub enum PostgresError {
    #[error(
        "no PostgreSQL server under {PG_LIB_DIR}/<version>/bin: install the `postgresql` package (cargo xtask setup)"
    )]
    NotInstalled,
    #[error("looking up the `{PG_USER}` OS user: {0}")]
    User(String),
    #[error("{0} is outside the test networks 198.18.0.0/15")]
    AddrOutOfRange(IpAddr),
    #[error("preparing {path}: {source}")]
    Prepare {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("initdb failed: {0}")]
    Initdb(CmdError),
    #[error("starting postgres in {netns}: {source}")]
    Spawn {
        netns: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "postgres on {addr} exited ({status}) before accepting connections; log tail:\n{log_tail}"
    )]
    Exited {
        addr: SocketAddr,
        status: ExitStatus,
        log_tail: String,
    },
    #[error(
        "postgres on {addr} did not accept connections within {timeout:?} (pg_isready: {last}); log tail:\n{log_tail}"
    )]
    NotReady {
        addr: SocketAddr,
        timeout: Duration,
        last: String,
        log_tail: String,
    },
    #[error("running pg_isready: {0}")]
    Probe(#[from] NetNsError),
    #[error("waiting for postgres: {0}")]
    Wait(std::io::Error),
    #[error("query failed: {0}")]
    Query(CmdError),
}

/// A running PostgreSQL server; stopped and its data removed on drop (also
/// when a test panics).
///
/// The server gets `PR_SET_PDEATHSIG`: it shuts down when the THREAD that
/// started it exits, so a killed test leaves no server behind. Start it on
/// the test's own thread (not inside [`netns::run_in`]) and keep it there.
#[derive(Debug)]
pub struct PostgresServer {
    child: Option<Child>,
    addr: SocketAddr,
    netns: PathBuf,
    bin: PathBuf,
    user: User,
    /// Temp dir owned by `postgres`: `data/`, the Unix socket, `postgres.log`.
    dir: Option<tempfile::TempDir>,
}

impl PostgresServer {
    /// Creates a data directory, starts `postgres` listening on `addr` in
    /// the network namespace at `netns` (e.g. [`crate::Cluster::netns_path`])
    /// and waits until it accepts TCP connections there.
    pub fn start(netns: &Path, addr: impl Into<SocketAddr>) -> Result<Self, PostgresError> {
        let mut server = Self::prepared(netns, addr.into())?;
        server.initdb()?;
        server.spawn()?;
        server.wait_ready()?;
        Ok(server)
    }

    /// Its temp dir, owned by `postgres`; nothing in it yet.
    fn prepared(netns: &Path, addr: SocketAddr) -> Result<Self, PostgresError> {
        if !in_test_networks(addr.ip()) {
            return Err(PostgresError::AddrOutOfRange(addr.ip()));
        }
        let bin = find_bin_dir(Path::new(PG_LIB_DIR)).ok_or(PostgresError::NotInstalled)?;
        let user = User::from_name(PG_USER)
            .map_err(|e| PostgresError::User(e.to_string()))?
            .ok_or_else(|| PostgresError::User("no such user".into()))?;

        // Named like the clusters' temp dirs, so `reap::reap_stale` removes
        // it after a test that died without dropping the server.
        let dir = tempfile::Builder::new()
            .prefix(&format!("{TEMPDIR_PREFIX}{}-pg-", std::process::id()))
            .tempdir()
            .map_err(|source| PostgresError::Prepare {
                path: std::env::temp_dir(),
                source,
            })?;
        std::os::unix::fs::chown(dir.path(), Some(user.uid.as_raw()), Some(user.gid.as_raw()))
            .map_err(|source| PostgresError::Prepare {
                path: dir.path().to_owned(),
                source,
            })?;

        Ok(Self {
            child: None,
            addr,
            netns: netns.to_owned(),
            bin,
            user,
            dir: Some(dir),
        })
    }

    /// A data directory for a server that ferry runs (`ferry run`, with
    /// [`Self::managed_argv`]) on a node whose network namespace is at
    /// `netns`, answering on `addr` (the cluster's public address) once
    /// [`Self::wait_ready`] says so. Nothing is started here; the data
    /// directory goes on drop, the server is the test's to stop.
    pub fn prepare_managed(
        netns: &Path,
        addr: impl Into<SocketAddr>,
    ) -> Result<Self, PostgresError> {
        let addr = addr.into();
        let server = Self::prepared(netns, addr)?;
        server.initdb()?;
        Ok(server)
    }

    /// The command line of this server under `ferry run --user postgres`
    /// (`RunProcessRequest.user` [`PG_USER`]: the managed PID is the
    /// postmaster's), listening on every address of its node and on its
    /// Unix socket, its log in [`Self::log_path`] (its own logger
    /// process: a managed process's standard output is /dev/null).
    pub fn managed_argv(&self) -> Vec<String> {
        let mut argv = Vec::new();
        argv.push(self.bin.join("postgres").display().to_string());
        argv.extend(self.server_args("*"));
        argv.extend(
            [
                "logging_collector=on".to_owned(),
                format!("log_directory={}", self.dir().display()),
                "log_filename=postgres.log".to_owned(),
            ]
            .into_iter()
            .flat_map(|setting| ["-c".to_owned(), setting]),
        );
        argv
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The network namespace it runs in.
    pub fn netns(&self) -> &Path {
        &self.netns
    }

    /// PID of the postmaster.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn dir(&self) -> &Path {
        self.dir.as_ref().expect("dir present until drop").path()
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir().join("data")
    }

    /// The directory of the server's Unix socket (what `psql -h` takes).
    pub fn socket_dir(&self) -> PathBuf {
        self.dir().to_owned()
    }

    /// The server's stderr (`log_connections` and `log_disconnections` are
    /// on, so a reconnect shows there).
    pub fn log_path(&self) -> PathBuf {
        self.dir().join("postgres.log")
    }

    /// The last `lines` lines of the server log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Runs `sql` with `psql -X -At` as the `postgres` user over the Unix
    /// socket (no namespace needed) and returns its output without the
    /// final newline: one line per row, columns separated by `|`.
    pub fn query(&self, sql: &str) -> Result<String, PostgresError> {
        let mut psql = self.as_postgres(self.bin.join("psql"));
        psql.args(["-X", "-At", "-v", "ON_ERROR_STOP=1", "-h"])
            .arg(self.socket_dir())
            .args(["-p", &self.addr.port().to_string()])
            .args(["-U", PG_USER, "-d", "postgres", "-c", sql]);
        let out = cmd::run(&mut psql).map_err(PostgresError::Query)?;
        let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
        if text.ends_with('\n') {
            text.pop();
        }
        Ok(text)
    }

    /// A command of the server's bin dir that runs as `postgres` with a
    /// clean environment, from the temp dir (the test's cwd may not be
    /// readable by that user).
    fn as_postgres(&self, program: PathBuf) -> Command {
        let mut c = Command::new(program);
        c.env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("LC_ALL", "C")
            .current_dir(self.dir())
            .uid(self.user.uid.as_raw())
            .gid(self.user.gid.as_raw());
        c
    }

    fn initdb(&self) -> Result<(), PostgresError> {
        let data = self.data_dir();
        let mut initdb = self.as_postgres(self.bin.join("initdb"));
        initdb
            .arg("-D")
            .arg(&data)
            .args(["-U", PG_USER, "--auth=trust", "--no-locale", "-E", "UTF8"])
            .arg("--no-sync");
        cmd::run(&mut initdb).map_err(PostgresError::Initdb)?;
        // Replaces initdb's (loopback only): the Unix socket for `query`,
        // the test networks over TCP.
        let hba = data.join("pg_hba.conf");
        std::fs::write(
            &hba,
            "# ferry-integration: written by PostgresServer\n\
             local all all trust\n\
             host all all 198.18.0.0/15 trust\n\
             host all all 2001:2::/48 trust\n",
        )
        .map_err(|source| PostgresError::Prepare {
            path: hba.clone(),
            source,
        })?;
        std::os::unix::fs::chown(
            &hba,
            Some(self.user.uid.as_raw()),
            Some(self.user.gid.as_raw()),
        )
        .map_err(|source| PostgresError::Prepare { path: hba, source })
    }

    fn spawn(&mut self) -> Result<(), PostgresError> {
        let log_path = self.log_path();
        let log = File::create(&log_path).map_err(|source| PostgresError::Prepare {
            path: log_path.clone(),
            source,
        })?;
        let log_err = log.try_clone().map_err(|source| PostgresError::Prepare {
            path: log_path,
            source,
        })?;
        let mut postgres = Command::new(self.bin.join("postgres"));
        postgres
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("LC_ALL", "C")
            .current_dir(self.dir())
            .args(self.server_args(&self.addr.ip().to_string()))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            // Its own process group: the SIGKILL fallback reaches the
            // backends too.
            .process_group(0);

        let ns = File::open(&self.netns).map_err(|source| PostgresError::Spawn {
            netns: self.netns.clone(),
            source,
        })?;
        let ns_fd = ns.as_raw_fd();
        let uid = self.user.uid;
        let gid = self.user.gid;
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the forked child before exec and only
        // makes async-signal-safe syscalls (setns, setgroups, setgid, setuid,
        // prctl, getppid) on values copied in; `ns` stays open in the child
        // because it outlives `spawn` below.
        unsafe {
            postgres.pre_exec(move || enter_and_drop_privileges(ns_fd, uid, gid, parent));
        }
        let child = postgres.spawn().map_err(|source| PostgresError::Spawn {
            netns: self.netns.clone(),
            source,
        })?;
        drop(ns);
        self.child = Some(child);
        Ok(())
    }

    /// The server's arguments after its binary: the data directory,
    /// `listen` as its addresses, the port, the Unix socket in the temp
    /// dir, no durability (a test's data), connections logged.
    fn server_args(&self, listen: &str) -> Vec<String> {
        let mut args = vec!["-D".to_owned(), self.data_dir().display().to_string()];
        for setting in [
            format!("listen_addresses={listen}"),
            format!("port={}", self.addr.port()),
            format!("unix_socket_directories={}", self.dir().display()),
            "fsync=off".into(),
            "full_page_writes=off".into(),
            "synchronous_commit=off".into(),
            "log_connections=on".into(),
            "log_disconnections=on".into(),
        ] {
            args.push("-c".into());
            args.push(setting);
        }
        args
    }

    /// Polls `pg_isready` over TCP inside the namespace: it does the
    /// protocol's startup and tells "accepting" from "starting up". A
    /// server this started that exits first is reported as such.
    pub fn wait_ready(&mut self) -> Result<(), PostgresError> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait().map_err(PostgresError::Wait)?
            {
                return Err(PostgresError::Exited {
                    addr: self.addr,
                    status,
                    log_tail: self.log_tail(LOG_TAIL_LINES),
                });
            }
            let mut probe = Command::new(self.bin.join("pg_isready"));
            probe
                .args(["-h", &self.addr.ip().to_string()])
                .args(["-p", &self.addr.port().to_string()])
                .args(["-U", PG_USER, "-d", "postgres", "-t", "2"]);
            let out = netns::output_in(&self.netns, probe)?;
            if out.status.success() {
                return Ok(());
            }
            let last = format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stdout).trim()
            );
            if Instant::now() >= deadline {
                return Err(PostgresError::NotReady {
                    addr: self.addr,
                    timeout: START_TIMEOUT,
                    last,
                    log_tail: self.log_tail(LOG_TAIL_LINES),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Fast shutdown (SIGINT: sessions are terminated; postgres's SIGTERM
    /// is "smart" shutdown, which would wait for every client to leave),
    /// then SIGKILL to the whole process group after [`STOP_TIMEOUT`], and
    /// removes the temp dir. Idempotent; never panics, problems are printed.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        let status = self.child.take().and_then(|mut child| {
            let pid = Pid::from_raw(child.id() as i32);
            if let Ok(None) = child.try_wait() {
                // Not reaped yet, so the PID cannot have been reused.
                let _ = kill(pid, Signal::SIGINT);
            }
            let deadline = Instant::now() + STOP_TIMEOUT;
            loop {
                match child.try_wait() {
                    Ok(Some(status)) => return Some(status),
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Ok(None) => break,
                    Err(e) => {
                        eprintln!("ferry-integration: waiting for postgres: {e}");
                        break;
                    }
                }
            }
            eprintln!(
                "ferry-integration: postgres on {} did not stop within {STOP_TIMEOUT:?}; killing it",
                self.addr
            );
            let _ = killpg(pid, Signal::SIGKILL);
            child.wait().ok()
        });
        if let Some(dir) = self.dir.take() {
            let path = dir.path().to_owned();
            if let Err(e) = dir.close() {
                eprintln!("ferry-integration: removing {}: {e}", path.display());
            }
        }
        status
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        if std::thread::panicking() && self.dir.is_some() {
            eprintln!(
                "---- test panicked: postgres log ({}), last {LOG_TAIL_LINES} lines ----\n{}",
                self.log_path().display(),
                self.log_tail(LOG_TAIL_LINES)
            );
        }
        self.stop();
    }
}

/// Runs in the forked child: into the namespace (needs root), then down to
/// the `postgres` user, then ask to be shut down with the parent thread.
fn enter_and_drop_privileges(
    ns_fd: libc::c_int,
    uid: Uid,
    gid: Gid,
    parent: libc::pid_t,
) -> std::io::Result<()> {
    let check = |r: libc::c_int| {
        if r == -1 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    let groups = [gid.as_raw()];
    // SAFETY: plain syscalls on integers and a live one-element array.
    unsafe {
        check(libc::setns(ns_fd, libc::CLONE_NEWNET))?;
        check(libc::setgroups(1, groups.as_ptr()))?;
        check(libc::setgid(gid.as_raw()))?;
        check(libc::setuid(uid.as_raw()))?;
        // After setuid, which clears the parent-death signal. SIGQUIT is
        // postgres's immediate shutdown.
        check(libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGQUIT as libc::c_ulong,
        ))?;
        if libc::getppid() != parent {
            return Err(std::io::Error::other(
                "the test exited while postgres started",
            ));
        }
    }
    Ok(())
}

/// Whether `ip` is in 198.18.0.0/15 or 2001:2::/48, the benchmarking
/// ranges the harness's networks use.
pub fn in_test_networks(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, _, _] = v4.octets();
            a == 198 && b & 0xfe == 18
        }
        IpAddr::V6(v6) => v6.segments()[..3] == [0x2001, 2, 0],
    }
}

/// The bin dir of the newest major version under `lib` that has a server.
fn find_bin_dir(lib: &Path) -> Option<PathBuf> {
    std::fs::read_dir(lib)
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|e| {
            let version: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").is_file().then_some((version, bin))
        })
        .max_by_key(|(v, _)| *v)
        .map(|(_, bin)| bin)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn only_test_network_addresses() {
        assert!(in_test_networks(Ipv4Addr::new(198, 18, 0, 100).into()));
        assert!(in_test_networks(Ipv4Addr::new(198, 19, 255, 1).into()));
        assert!(!in_test_networks(Ipv4Addr::new(198, 20, 0, 1).into()));
        assert!(!in_test_networks(Ipv4Addr::new(198, 17, 0, 1).into()));
        assert!(!in_test_networks(Ipv4Addr::LOCALHOST.into()));
        assert!(in_test_networks("2001:2:0:1::3".parse().unwrap()));
        assert!(!in_test_networks("2001:db8::3".parse().unwrap()));
        assert!(
            !in_test_networks("2001:2:1::3".parse().unwrap()),
            "outside the /48"
        );
    }

    #[test]
    fn picks_the_newest_version_with_a_server() {
        let lib = tempfile::tempdir().unwrap();
        for (v, server) in [("13", true), ("15", true), ("16", false), ("x", true)] {
            let bin = lib.path().join(v).join("bin");
            std::fs::create_dir_all(&bin).unwrap();
            if server {
                std::fs::write(bin.join("postgres"), "").unwrap();
            }
        }
        assert_eq!(find_bin_dir(lib.path()), Some(lib.path().join("15/bin")));
        assert_eq!(find_bin_dir(&lib.path().join("none")), None);
    }
}
