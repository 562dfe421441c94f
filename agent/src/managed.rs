//! Processes under this node's management.
//!
//! A managed process is the init of its own PID namespace and the leader of
//! its own session. That is what lets CRIU move it: restoring it on another
//! node needs no particular PID to be free there (a process in the node's
//! PID namespace would need its old PID, which the stopped source copy still
//! holds until the commit), and CRIU refuses a process whose session leader
//! is outside its PID namespace.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::ownership::PortState;
use crate::process::{self, PortKey, SocketSummary};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Started by `ferry run` on this node.
    Run,
    /// Arrived by migration.
    MigratedIn { migration_id: String, from: String },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lifecycle {
    Running,
    /// Claimed by an outgoing migration; `stage` says what its ports do.
    MigratingOut {
        migration_id: String,
        stage: OutStage,
    },
}

/// Where an outgoing migration is, as far as the process's ports go (see
/// the hand-over table in `ownership`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutStage {
    /// Prepared, still running and served as usual.
    Live,
    /// Running; what it receives is logged, since the destination is about
    /// to capture too.
    Recording,
    /// Stopped for the dump: nothing in or out; incoming packets kept
    /// (`capture`) or dropped.
    Frozen { capture: bool },
    /// Resuming after an abort: outgoing packets pass, incoming ones are
    /// still kept while the captured ones are replayed.
    Resuming,
    /// Post-copy, from just before the Commit: the destination owns the
    /// ports; the stopped copy here only backs CRIU's page server until
    /// every page is on the destination. No ports.
    PagesOnly,
}

#[derive(Debug, Clone)]
pub struct ManagedProcess {
    pub pid: i32,
    pub argv: Vec<String>,
    pub origin: Origin,
    pub lifecycle: Lifecycle,
    pub sockets: SocketSummary,
}

#[derive(Debug, Default)]
pub struct Registry {
    procs: BTreeMap<i32, ManagedProcess>,
}

impl Registry {
    pub fn insert(&mut self, p: ManagedProcess) {
        self.procs.insert(p.pid, p);
    }

    pub fn remove(&mut self, pid: i32) -> Option<ManagedProcess> {
        self.procs.remove(&pid)
    }

    pub fn get(&self, pid: i32) -> Option<&ManagedProcess> {
        self.procs.get(&pid)
    }

    pub fn get_mut(&mut self, pid: i32) -> Option<&mut ManagedProcess> {
        self.procs.get_mut(&pid)
    }

    pub fn iter(&self) -> impl Iterator<Item = &ManagedProcess> {
        self.procs.values()
    }

    pub fn len(&self) -> usize {
        self.procs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.procs.is_empty()
    }

    /// Re-reads the sockets of every running process, dropping the ones
    /// that are gone. Processes in a migration keep the ports they had when
    /// it started: those are what the migration moves.
    pub fn refresh(&mut self) {
        let mut gone = Vec::new();
        for p in self.procs.values_mut() {
            if p.lifecycle != Lifecycle::Running {
                continue;
            }
            match process::sockets_of_tree(&process::process_tree(p.pid)) {
                Ok(s) => p.sockets = s,
                Err(process::ProcessError::NotFound { .. }) => gone.push(p.pid),
                Err(e) => tracing::warn!(pid = p.pid, error = %e, "reading sockets"),
            }
            if matches!(process::inspect(p.pid), Ok(i) if i.state == 'Z' || i.state == 'X') {
                gone.push(p.pid);
            }
        }
        for pid in gone {
            tracing::info!(pid, "managed process exited");
            self.procs.remove(&pid);
        }
    }

    /// The port ownership the processes call for.
    pub fn desired_ports(&self) -> BTreeMap<PortKey, PortState> {
        let mut out = BTreeMap::new();
        for p in self.procs.values() {
            let state = match p.lifecycle {
                Lifecycle::Running => PortState::Owned,
                Lifecycle::MigratingOut { stage, .. } => match stage {
                    OutStage::Live => PortState::Owned,
                    OutStage::Recording => PortState::Recording,
                    OutStage::Frozen { capture: true } => PortState::Capturing,
                    OutStage::Frozen { capture: false } => PortState::Frozen,
                    OutStage::Resuming => PortState::Releasing,
                    OutStage::PagesOnly => continue,
                },
            };
            for port in &p.sockets.ports {
                out.insert(*port, state);
            }
        }
        out
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("argv is empty: give the program to run")]
    EmptyArgv,
    #[error("cannot start {program:?}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("{program:?} exited at once with {status}")]
    ExitedAtOnce { program: String, status: String },
    #[error("the new process of {program:?} did not appear within {waited:?}")]
    NoChild { program: String, waited: Duration },
}

/// Starts `argv` in a new PID namespace as a session leader, with stdio on
/// /dev/null (CRIU cannot move pipes to ferryd), and returns the PID of the
/// program (the namespace's init) and the `unshare` wrapper that is its
/// parent, which the caller must reap.
pub async fn spawn(argv: &[String]) -> Result<(i32, tokio::process::Child), SpawnError> {
    let program = argv.first().ok_or(SpawnError::EmptyArgv)?.clone();
    if program.is_empty() {
        return Err(SpawnError::EmptyArgv);
    }
    // `unshare --fork` makes the program PID 1 of the new namespace; no
    // `--kill-child`: a parent-death signal would be restored by CRIU and
    // kill the process on the destination as soon as CRIU exits. `setsid`
    // does not fork here (the child is not a group leader), so the PID is
    // the program's.
    let mut cmd = tokio::process::Command::new("unshare");
    cmd.args(["--pid", "--fork", "setsid"])
        .args(argv)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(false);
    // SAFETY: the closure runs in the child between fork and exec and
    // makes one system call, close_range, which is async-signal-safe; it
    // touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            // Descriptors ferryd inherited without close-on-exec (a lock
            // its starter held, say) must not follow the managed process:
            // CRIU refuses to dump a process holding a file lock, and would
            // drag anything else along. Marked close-on-exec rather than
            // closed, so that the spawn's own exec-error pipe still works.
            const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
            if libc::syscall(
                libc::SYS_close_range,
                3 as libc::c_uint,
                libc::c_uint::MAX,
                CLOSE_RANGE_CLOEXEC,
            ) == -1
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut wrapper = cmd.spawn().map_err(|source| SpawnError::Spawn {
        program: program.clone(),
        source,
    })?;
    let wrapper_pid = wrapper.id().unwrap_or(0) as i32;
    let children = format!("/proc/{wrapper_pid}/task/{wrapper_pid}/children");
    let waited = Duration::from_secs(5);
    let deadline = Instant::now() + waited;
    loop {
        if let Ok(list) = std::fs::read_to_string(&children)
            && let Some(pid) = list.split_whitespace().find_map(|c| c.parse::<i32>().ok())
        {
            return Ok((pid, wrapper));
        }
        if let Ok(Some(status)) = wrapper.try_wait() {
            return Err(SpawnError::ExitedAtOnce {
                program,
                status: status.to_string(),
            });
        }
        if Instant::now() > deadline {
            let _ = wrapper.start_kill();
            return Err(SpawnError::NoChild { program, waited });
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// The unit tests run as root (`cargo xtask test`): a new PID
    /// namespace needs it.
    #[tokio::test]
    async fn descriptors_ferryd_inherited_do_not_follow_a_managed_process() {
        let file = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: dup of a descriptor this test owns; the copy has no
        // close-on-exec flag, like one ferryd inherited from its starter.
        let inherited = unsafe { libc::dup(file.as_raw_fd()) };
        assert!(inherited > 2);
        let (pid, mut wrapper) = spawn(&["sleep".into(), "30".into()]).await.unwrap();
        // The program runs once /proc lists its command line as sleep's.
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
            .map(|c| !c.starts_with("sleep"))
            .unwrap_or(true)
        {
            assert!(Instant::now() < deadline, "sleep never ran");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let fds: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = wrapper.wait().await;
        // SAFETY: closes the duplicate made above, owned by this test.
        unsafe { libc::close(inherited) };
        assert_eq!(fds, [0, 1, 2], "the managed process holds more than stdio");
    }
}
