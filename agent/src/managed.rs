//! Processes under this node's management.
//!
//! A managed process is the init of its own PID namespace and the leader of
//! its own session. That is what lets CRIU move it: restoring it on another
//! node needs no particular PID to be free there (a process in the node's
//! PID namespace would need its old PID, which the stopped source copy still
//! holds until the commit), and CRIU refuses a process whose session leader
//! is outside its PID namespace.

use std::collections::BTreeMap;

use ferry_proto::v1::ProcessExit;

use crate::ownership::PortState;
use crate::process::{self, PortKey, SocketSummary};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Started by `ferry run` on this node.
    Run,
    /// Running already, adopted by `ferry adopt` on this node.
    Adopted,
    /// Arrived by migration.
    MigratedIn { migration_id: String, from: String },
}

impl Origin {
    /// As the API says it ("run", "adopted", "migrated-in").
    pub fn name(&self) -> &'static str {
        match self {
            Origin::Run => "run",
            Origin::Adopted => "adopted",
            Origin::MigratedIn { .. } => "migrated-in",
        }
    }
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
    /// Running, the destination capturing (from Arm): logged as in
    /// `Recording`, and no new TCP connection starts here (a SYN is left
    /// to the destination).
    Armed,
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
    /// From just before the Commit (the other strategies): the
    /// destination owns the ports; the stopped copy here is killed once
    /// the destination answered the Commit. No ports.
    Released,
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
    /// Processes that died while a migration held them stopped (or
    /// resuming), with how: the migration decides what that means, and
    /// [`Self::refresh`] forgets them once it let go.
    died_in_migration: BTreeMap<i32, ProcessExit>,
}

impl Registry {
    pub fn insert(&mut self, p: ManagedProcess) {
        self.died_in_migration.remove(&p.pid);
        self.procs.insert(p.pid, p);
    }

    /// Process `pid` ended (its exit watcher saw it go). A process that
    /// was running, or running while a migration prepared, ended by itself:
    /// it is forgotten and returned, for the exit to be announced. One a
    /// migration holds stopped (or killed: the commit) is the migration's
    /// business; a process already forgotten (moved away) is nothing.
    pub fn ended(&mut self, pid: i32, exit: &ProcessExit) -> Option<ManagedProcess> {
        let by_itself = match &self.procs.get(&pid)?.lifecycle {
            Lifecycle::Running => true,
            Lifecycle::MigratingOut { stage, .. } => {
                matches!(
                    stage,
                    OutStage::Live | OutStage::Recording | OutStage::Armed
                )
            }
        };
        if by_itself {
            self.procs.remove(&pid)
        } else {
            self.died_in_migration.insert(pid, exit.clone());
            None
        }
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

    /// The running processes, whose sockets a refresh re-reads
    /// ([`read_sockets`], without the registry's lock).
    pub fn running(&self) -> Vec<i32> {
        self.procs
            .values()
            .filter(|p| p.lifecycle == Lifecycle::Running)
            .map(|p| p.pid)
            .collect()
    }

    /// Takes the sockets [`read_sockets`] read of the processes that are
    /// still running. Processes in a migration keep the ports they had
    /// when it started: those are what the migration moves, and a read
    /// made before it started is dropped. Returns the processes that died
    /// in a migration which has let go of them since (rolled back), now
    /// forgotten, with how they ended. A process that exits otherwise is
    /// forgotten by its exit watcher, which knows how it ended
    /// ([`Self::ended`]); a gone process only loses its sockets here.
    pub fn refresh(&mut self, read: Vec<SocketsRead>) -> Vec<(ManagedProcess, ProcessExit)> {
        for SocketsRead { pid, sockets } in read {
            let Some(p) = self.procs.get_mut(&pid) else {
                continue;
            };
            if p.lifecycle != Lifecycle::Running {
                continue;
            }
            match sockets {
                Ok(s) => p.sockets = s,
                Err(process::ProcessError::NotFound { .. }) => p.sockets = Default::default(),
                Err(e) => tracing::warn!(pid = p.pid, error = %e, "reading sockets"),
            }
        }
        let released: Vec<i32> = self
            .died_in_migration
            .keys()
            .copied()
            .filter(|pid| {
                self.procs
                    .get(pid)
                    .is_none_or(|p| p.lifecycle == Lifecycle::Running)
            })
            .collect();
        let mut gone = Vec::new();
        for pid in released {
            let exit = self.died_in_migration.remove(&pid);
            if let (Some(p), Some(exit)) = (self.procs.remove(&pid), exit) {
                tracing::info!(
                    pid,
                    "managed process died during a migration that rolled back"
                );
                gone.push((p, exit));
            }
        }
        gone
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
                    OutStage::Armed => PortState::Armed,
                    OutStage::Frozen { capture: true } => PortState::Capturing,
                    OutStage::Frozen { capture: false } => PortState::Frozen,
                    OutStage::Resuming => PortState::Releasing,
                    OutStage::PagesOnly | OutStage::Released => continue,
                },
            };
            for port in &p.sockets.ports {
                out.insert(*port, state);
            }
        }
        out
    }
}

/// One running process's sockets, read for [`Registry::refresh`].
pub struct SocketsRead {
    pub pid: i32,
    pub sockets: Result<process::SocketSummary, process::ProcessError>,
}

/// Reads the sockets of `pids`' process trees, with one read of the
/// socket tables per network namespace (they list every socket there, the
/// other services' too). Not under the registry's lock: a migration's
/// freeze takes that lock to cut its ports off, and these reads take
/// milliseconds per thousand sockets.
pub fn read_sockets(pids: Vec<i32>) -> Vec<SocketsRead> {
    let trees: Vec<Vec<i32>> = pids.iter().map(|&pid| process::process_tree(pid)).collect();
    pids.into_iter()
        .zip(process::sockets_of_trees(&trees))
        .map(|(pid, sockets)| SocketsRead { pid, sockets })
        .collect()
}

/// How a child ended, from its wait status.
pub fn exit_from_wait_status(status: i32) -> ProcessExit {
    if libc::WIFSIGNALED(status) {
        let signal = libc::WTERMSIG(status);
        ProcessExit {
            status_known: true,
            code: 0,
            signal,
            description: format!("killed by {}", signal_name(signal)),
        }
    } else {
        let code = libc::WEXITSTATUS(status);
        ProcessExit {
            status_known: true,
            code,
            signal: 0,
            description: format!("exited with {code}"),
        }
    }
}

/// An end whose status this agent cannot read, saying why.
pub fn exit_unknown(why: &str) -> ProcessExit {
    ProcessExit {
        status_known: false,
        code: 0,
        signal: 0,
        description: format!("ended, status unknown: {why}"),
    }
}

/// The signal a `SignalProcess` may send, or why not (naming the field).
pub fn signal_to_send(signal: i32) -> Result<nix::sys::signal::Signal, String> {
    use nix::sys::signal::Signal;
    let s = Signal::try_from(signal)
        .map_err(|_| format!("signal: {signal} is not a standard signal (1 to 31)"))?;
    if matches!(
        s,
        Signal::SIGSTOP | Signal::SIGTSTP | Signal::SIGTTIN | Signal::SIGTTOU | Signal::SIGCONT
    ) {
        return Err(format!(
            "signal: {} stops or continues the process, which ferry's migrations do themselves",
            s.as_str()
        ));
    }
    Ok(s)
}

/// Whether `signal` would reach managed process `pid`, which is the init
/// of its own PID namespace: the kernel delivers a signal from outside the
/// namespace to its init only if the init handles it (SIGKILL excepted),
/// and drops any other silently (pid_namespaces(7)). Err says why not.
pub fn signal_reaches(pid: i32, signal: nix::sys::signal::Signal) -> Result<(), String> {
    if signal == nix::sys::signal::Signal::SIGKILL {
        return Ok(());
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("pid: reading /proc/{pid}/status: {e}"))?;
    let caught = status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .ok_or_else(|| format!("pid: no SigCgt line in /proc/{pid}/status"))?;
    if caught & (1u64 << (signal as i32 - 1)) != 0 {
        return Ok(());
    }
    Err(format!(
        "signal: PID {pid} is the init of its own PID namespace and has no handler for {}, so the kernel would drop it; SIGKILL (9) ends it",
        signal.as_str()
    ))
}

/// "SIGTERM", or "signal 40" for one without a name.
pub fn signal_name(signal: i32) -> String {
    nix::sys::signal::Signal::try_from(signal)
        .map(|s| s.as_str().to_owned())
        .unwrap_or_else(|_| format!("signal {signal}"))
}

/// What in the descriptors of process tree `tree` ferry could not move,
/// found with it running (see [`process::descriptor_obstacles`]), and its
/// sockets of families CRIU cannot dump: what adoption and every
/// migration check, so that CRIU never refuses a dump after the freeze.
/// Blocking (procfs, a sock_diag dump, the tree's sockets).
pub fn tree_obstacles(tree: &[i32]) -> Result<Vec<process::Obstacle>, String> {
    let peers = process::unix_peers().map_err(|e| format!("listing Unix socket peers: {e}"))?;
    let mut found = process::descriptor_obstacles(tree, &peers);
    let unsupported = crate::sockstate::unsupported_sockets(tree).map_err(|e| e.to_string())?;
    found.extend(
        unsupported
            .into_iter()
            .map(|(inode, family)| process::Obstacle::UnsupportedSocket { inode, family }),
    );
    Ok(found)
}

/// Why a running process was not adopted (`ferry adopt`).
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("pid: no process {pid} runs on {node}")]
    NotFound { pid: i32, node: String },
    #[error("pid: {pid} is under management already")]
    AlreadyManaged { pid: i32 },
    #[error("pid: {pid} is ferryd itself")]
    Agent { pid: i32 },
    #[error("pid: {pid} cannot be managed by ferry: {}", .obstacles.iter().map(|o| o.to_string()).collect::<Vec<_>>().join("; "))]
    Obstacles {
        pid: i32,
        obstacles: Vec<process::Obstacle>,
    },
    #[error("reading process {pid}: {source}")]
    Process {
        pid: i32,
        source: process::ProcessError,
    },
    #[error("reading the descriptors of process {pid}: {reason}")]
    Sockets { pid: i32, reason: String },
}

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("argv is empty: give the program to run")]
    EmptyArgv,
    #[error("argv: {what} contains a NUL byte")]
    NulByte { what: String },
    #[error("cannot start {program:?}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
}

/// `program` as execve wants it: itself when it names a path, else the
/// first executable file of that name in `PATH` (looked up here, before
/// the clone: the child may only make async-signal-safe calls).
fn resolve(program: &str) -> Result<std::path::PathBuf, std::io::Error> {
    use std::os::unix::fs::PermissionsExt;
    if program.contains('/') {
        return Ok(program.into());
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no executable {program:?} in PATH"),
            )
        })
}

/// Starts `argv` as ferryd's child in a new PID namespace, as a session
/// leader, with stdio on /dev/null (CRIU cannot move pipes to ferryd),
/// and returns its PID. The program is the namespace's init and ferryd's
/// own child (like a process CRIU restores here), so that ferryd reads
/// its exit status; the caller watches it ([`crate::reaper::wait_exit`]).
/// No parent-death signal: CRIU would restore it, and the process would
/// die on the destination as soon as CRIU exits. Blocking only for an
/// exec's length.
pub fn spawn(argv: &[String]) -> Result<i32, SpawnError> {
    use std::ffi::CString;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;

    let program = argv.first().ok_or(SpawnError::EmptyArgv)?.clone();
    if program.is_empty() {
        return Err(SpawnError::EmptyArgv);
    }
    let failed = |source| SpawnError::Spawn {
        program: program.clone(),
        source,
    };
    let nul = |what: &str| SpawnError::NulByte { what: what.into() };
    let args: Vec<CString> = argv
        .iter()
        .map(|a| CString::new(a.as_bytes()).map_err(|_| nul(&format!("{a:?}"))))
        .collect::<Result<_, _>>()?;
    let path = resolve(&program).map_err(failed)?;
    let path = CString::new(path.as_os_str().as_bytes()).map_err(|_| nul("the program's path"))?;
    let mut arg_ptrs: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    arg_ptrs.push(std::ptr::null());
    let dev_null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(failed)?;
    // The exec-error pipe: close-on-exec, so that it reads as empty once
    // the exec succeeded, and holds the errno when it did not.
    let mut pipe = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two descriptors into a two-element array.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } == -1 {
        return Err(failed(std::io::Error::last_os_error()));
    }
    // SAFETY: both descriptors were just returned by pipe2 and are owned
    // here only.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };

    // struct clone_args (include/uapi/linux/sched.h), the fields up to
    // set_tid_size; the kernel takes the size it is given.
    #[repr(C)]
    #[derive(Default)]
    struct CloneArgs {
        flags: u64,
        pidfd: u64,
        child_tid: u64,
        parent_tid: u64,
        exit_signal: u64,
        stack: u64,
        stack_size: u64,
        tls: u64,
    }
    let args_for_clone = CloneArgs {
        flags: libc::CLONE_NEWPID as u64,
        exit_signal: libc::SIGCHLD as u64,
        ..Default::default()
    };
    let null_fd = dev_null.as_raw_fd();
    let err_fd = write_end.as_raw_fd();
    // SAFETY: clone3 without CLONE_VM and without a stack is fork: the
    // child gets a copy of this address space with only this thread. The
    // child branch below makes only async-signal-safe system calls on
    // memory prepared before the clone (no allocation, no lock), and ends
    // in execv or _exit.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args_for_clone as *const CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if pid == 0 {
        // The child: PID 1 of the new namespace.
        // SAFETY: see above; every pointer was made before the clone and
        // stays valid in the child's copy of the memory.
        unsafe {
            let fail = |err_fd: libc::c_int| -> ! {
                let errno = *libc::__errno_location();
                let bytes = errno.to_ne_bytes();
                libc::write(err_fd, bytes.as_ptr().cast(), bytes.len());
                libc::_exit(127)
            };
            if libc::setsid() == -1 {
                fail(err_fd);
            }
            for target in 0..3 {
                if libc::dup2(null_fd, target) == -1 {
                    fail(err_fd);
                }
            }
            if process::close_inherited_on_exec().is_err() {
                fail(err_fd);
            }
            libc::execv(path.as_ptr(), arg_ptrs.as_ptr());
            fail(err_fd)
        }
    }
    if pid < 0 {
        return Err(failed(std::io::Error::last_os_error()));
    }
    let pid = pid as i32;
    drop(write_end);
    drop(dev_null);
    // Empty: the exec happened (the pipe closed with it). Four bytes: the
    // errno of what failed, and the child is gone (reaped here).
    let mut errno = [0u8; 4];
    let mut got = 0;
    while got < errno.len() {
        // SAFETY: reads into the unfilled rest of a local array.
        let n = unsafe {
            libc::read(
                read_end.as_raw_fd(),
                errno[got..].as_mut_ptr().cast(),
                errno.len() - got,
            )
        };
        if n > 0 {
            got += n as usize;
        } else if n == 0
            || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
        {
            break;
        }
    }
    if got == errno.len() {
        let mut status = 0;
        // SAFETY: waitpid on our own child with a pointer to a local.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        return Err(failed(std::io::Error::from_raw_os_error(
            i32::from_ne_bytes(errno),
        )));
    }
    Ok(pid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::time::{Duration, Instant};

    /// The unit tests run as root (`cargo xtask test`): a new PID
    /// namespace needs it.
    #[tokio::test]
    async fn a_spawned_process_is_a_namespace_init_whose_end_ferryd_reads() {
        let pid = spawn(&["sh".into(), "-c".into(), "exit 4".into()]).unwrap();
        let status = crate::reaper::wait_exit(pid).await.unwrap();
        let exit = exit_from_wait_status(status.expect("our child"));
        assert_eq!((exit.code, exit.signal), (4, 0), "{exit:?}");

        let pid = spawn(&["sleep".into(), "30".into()]).unwrap();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let nspid = status.lines().find(|l| l.starts_with("NSpid:")).unwrap();
        assert!(nspid.trim_end().ends_with("\t1"), "{nspid:?}");
        let info = crate::process::inspect(pid).unwrap();
        assert_eq!((info.session, info.pgrp, info.tty_nr), (pid, pid, 0));
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        let exit = exit_from_wait_status(crate::reaper::wait_exit(pid).await.unwrap().unwrap());
        assert_eq!(exit.signal, libc::SIGKILL, "{exit:?}");

        let e = spawn(&["ferry-no-such-program".into()]).unwrap_err();
        assert!(
            matches!(&e, SpawnError::Spawn { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
            "{e}"
        );
        // Found but not executable: the exec's own error comes back.
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("not-a-program");
        std::fs::write(&plain, "data").unwrap();
        let e = spawn(&[plain.to_string_lossy().into_owned()]).unwrap_err();
        assert!(
            matches!(&e, SpawnError::Spawn { source, .. } if source.raw_os_error() == Some(libc::EACCES)),
            "{e}"
        );
        assert!(matches!(
            spawn(&["a\0b".into()]),
            Err(SpawnError::NulByte { .. })
        ));
    }

    fn process(pid: i32, lifecycle: Lifecycle) -> ManagedProcess {
        ManagedProcess {
            pid,
            argv: vec!["server".into()],
            origin: Origin::Run,
            lifecycle,
            sockets: Default::default(),
        }
    }

    #[test]
    fn a_copy_that_gave_up_its_ports_holds_none_until_it_goes() {
        let port = |port| PortKey {
            transport: process::Transport::Tcp,
            port,
        };
        let mut reg = Registry::default();
        for (pid, lifecycle) in [
            (10, Lifecycle::Running),
            (11, migrating(OutStage::Frozen { capture: true })),
            (12, migrating(OutStage::Released)),
            (13, migrating(OutStage::PagesOnly)),
        ] {
            let mut p = process(pid, lifecycle);
            p.sockets.ports.insert(port(pid as u16));
            reg.insert(p);
        }
        let ports = reg.desired_ports();
        assert_eq!(
            ports.into_iter().collect::<Vec<_>>(),
            vec![
                (port(10), PortState::Owned),
                (port(11), PortState::Capturing)
            ]
        );
        // Stopped by its migration: not forgotten when it dies by itself.
        let exit = exit_from_wait_status(libc::SIGKILL);
        assert!(reg.ended(12, &exit).is_none());
        assert_eq!(reg.len(), 4);
    }

    fn migrating(stage: OutStage) -> Lifecycle {
        Lifecycle::MigratingOut {
            migration_id: "m1".into(),
            stage,
        }
    }

    /// The sockets are read without the registry's lock: a process whose
    /// migration began meanwhile keeps the ports it had when it began.
    #[test]
    fn a_read_of_sockets_lands_only_on_processes_still_running() {
        let mut reg = Registry::default();
        reg.insert(process(10, Lifecycle::Running));
        reg.insert(process(11, Lifecycle::Running));
        reg.insert(process(12, migrating(OutStage::Live)));
        assert_eq!(reg.running(), vec![10, 11]);
        let read = |pid, port| SocketsRead {
            pid,
            sockets: Ok(process::SocketSummary {
                tcp_listening: 1,
                ports: [PortKey {
                    transport: process::Transport::Tcp,
                    port,
                }]
                .into_iter()
                .collect(),
                ..Default::default()
            }),
        };
        // 11's migration began after the read.
        reg.get_mut(11).unwrap().lifecycle = migrating(OutStage::Live);
        let gone = reg.refresh(vec![
            read(10, 7000),
            read(11, 7001),
            SocketsRead {
                pid: 13,
                sockets: Err(process::ProcessError::NotFound { pid: 13 }),
            },
        ]);
        assert!(gone.is_empty());
        assert_eq!(reg.get(10).unwrap().sockets.tcp_listening, 1);
        assert_eq!(reg.get(11).unwrap().sockets, Default::default());
        assert!(reg.get(13).is_none());
        // A process gone since the last read loses its sockets.
        reg.refresh(vec![SocketsRead {
            pid: 10,
            sockets: Err(process::ProcessError::NotFound { pid: 10 }),
        }]);
        assert_eq!(reg.get(10).unwrap().sockets, Default::default());
    }

    #[test]
    fn a_process_that_ends_by_itself_is_forgotten_one_a_migration_stopped_is_not() {
        let exit = exit_from_wait_status(3 << 8);
        let mut reg = Registry::default();
        reg.insert(process(10, Lifecycle::Running));
        reg.insert(process(11, migrating(OutStage::Live)));
        reg.insert(process(12, migrating(OutStage::Frozen { capture: true })));
        reg.insert(process(13, migrating(OutStage::PagesOnly)));
        assert_eq!(reg.ended(10, &exit).map(|p| p.pid), Some(10));
        // Died while its migration prepared: its own end.
        assert_eq!(reg.ended(11, &exit).map(|p| p.pid), Some(11));
        // Stopped by a migration: the migration's business, kept.
        assert!(reg.ended(12, &exit).is_none());
        assert!(reg.ended(13, &exit).is_none());
        assert!(reg.ended(99, &exit).is_none());
        assert_eq!(reg.len(), 2);
        // Still held by the migration: nothing to report yet.
        assert!(reg.refresh(Vec::new()).is_empty());
        // The migration rolled back: the dead process goes, with its end.
        reg.get_mut(12).unwrap().lifecycle = Lifecycle::Running;
        let gone = reg.refresh(Vec::new());
        assert_eq!(gone.len(), 1);
        assert_eq!((gone[0].0.pid, gone[0].1.code), (12, 3));
        assert!(reg.get(12).is_none());
        // A new process under a reused PID is not taken for the dead one.
        assert!(reg.ended(13, &exit).is_none());
        reg.remove(13);
        reg.insert(process(13, Lifecycle::Running));
        assert!(reg.refresh(Vec::new()).is_empty());
        assert!(reg.get(13).is_some());
    }

    #[test]
    fn exit_statuses_say_code_or_signal() {
        let e = exit_from_wait_status(7 << 8);
        assert!(e.status_known);
        assert_eq!(
            (e.code, e.signal, e.description.as_str()),
            (7, 0, "exited with 7")
        );
        let e = exit_from_wait_status(libc::SIGTERM);
        assert_eq!((e.code, e.signal), (0, libc::SIGTERM));
        assert_eq!(e.description, "killed by SIGTERM");
        assert!(!exit_unknown("adopted").status_known);
    }

    #[test]
    fn a_signal_reaches_a_namespace_init_only_if_it_handles_it() {
        use nix::sys::signal::Signal;
        // This test process handles none of these by default; the
        // runtime may catch others (SIGPIPE is ignored, not caught).
        let me = std::process::id() as i32;
        let e = signal_reaches(me, Signal::SIGUSR2).unwrap_err();
        assert!(e.contains("no handler for SIGUSR2"), "{e}");
        assert!(signal_reaches(me, Signal::SIGKILL).is_ok());
        extern "C" fn noop(_: libc::c_int) {}
        let action = nix::sys::signal::SigAction::new(
            nix::sys::signal::SigHandler::Handler(noop),
            nix::sys::signal::SaFlags::empty(),
            nix::sys::signal::SigSet::empty(),
        );
        // SAFETY: installs a handler that does nothing (async-signal-safe)
        // for a signal nothing else in the test binary uses.
        unsafe { nix::sys::signal::sigaction(Signal::SIGUSR2, &action) }.unwrap();
        assert!(signal_reaches(me, Signal::SIGUSR2).is_ok());
    }

    #[test]
    fn only_standard_signals_that_neither_stop_nor_continue_are_sent() {
        assert_eq!(
            signal_to_send(15).unwrap(),
            nix::sys::signal::Signal::SIGTERM
        );
        assert_eq!(
            signal_to_send(9).unwrap(),
            nix::sys::signal::Signal::SIGKILL
        );
        for refused in [0, -1, 32, 64, 1000, 19, 20, 21, 22, 18] {
            let e = signal_to_send(refused).unwrap_err();
            assert!(e.starts_with("signal: "), "{refused}: {e}");
        }
    }

    #[tokio::test]
    async fn descriptors_ferryd_inherited_do_not_follow_a_managed_process() {
        let file = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: dup of a descriptor this test owns; the copy has no
        // close-on-exec flag, like one ferryd inherited from its starter.
        let inherited = unsafe { libc::dup(file.as_raw_fd()) };
        assert!(inherited > 2);
        let pid = spawn(&["sleep".into(), "30".into()]).unwrap();
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
        crate::reaper::wait_exit(pid).await.unwrap();
        // SAFETY: closes the duplicate made above, owned by this test.
        unsafe { libc::close(inherited) };
        assert_eq!(fds, [0, 1, 2], "the managed process holds more than stdio");
    }
}
