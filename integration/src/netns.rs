//! Named network namespaces (`/run/netns/<name>`, as `ip netns` makes them)
//! and ways to run code and processes inside one.
//!
//! Only the NETWORK namespace is ever entered: `ip netns exec` also unshares
//! the mount namespace (to remount /sys), which makes CRIU refuse to dump,
//! and the agent must see the harness's tmpfs work dirs.

use std::fs::File;
use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

use nix::sched::{CloneFlags, setns};

use crate::cmd::{self, CmdError};

/// Where `ip netns` keeps its bind-mounted namespace handles.
pub const NETNS_RUN_DIR: &str = "/run/netns";

#[derive(Debug, thiserror::Error)]
pub enum NetNsError {
    #[error(transparent)]
    Cmd(#[from] CmdError),
    #[error("opening {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("entering network namespace {path}: {source}")]
    Enter { path: PathBuf, source: nix::Error },
    #[error("starting a thread: {0}")]
    Thread(std::io::Error),
    #[error("spawning `{command}` in {path}: {source}")]
    Spawn {
        command: String,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The handle path of the named namespace `name`.
pub fn path_of(name: &str) -> PathBuf {
    Path::new(NETNS_RUN_DIR).join(name)
}

/// A named network namespace, deleted on drop (or by [`NetNs::delete`]).
#[derive(Debug)]
pub struct NetNs {
    name: String,
    deleted: bool,
}

impl NetNs {
    /// `ip netns add NAME`.
    pub fn create(name: &str) -> Result<Self, NetNsError> {
        cmd::ip(["netns", "add", name])?;
        Ok(Self {
            name: name.to_owned(),
            deleted: false,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> PathBuf {
        path_of(&self.name)
    }

    /// The namespace's inode: equal to the `st_ino` of `/proc/<pid>/ns/net`
    /// of every process inside it.
    pub fn inode(&self) -> Result<u64, NetNsError> {
        inode_of(&self.path())
    }

    /// Host PIDs of the processes inside (`ip netns pids`).
    pub fn pids(&self) -> Result<Vec<i32>, NetNsError> {
        pids_in(&self.name)
    }

    /// `ip netns del NAME`; idempotent. The kernel frees the namespace once
    /// nothing (process, socket, fd) refers to it any more.
    pub fn delete(&mut self) -> Result<(), NetNsError> {
        if self.deleted {
            return Ok(());
        }
        self.deleted = true;
        cmd::ip(["netns", "del", &self.name])?;
        Ok(())
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if let Err(e) = self.delete() {
            eprintln!("ferry-integration: deleting netns {}: {e}", self.name);
        }
    }
}

/// The inode of a namespace handle (`/run/netns/x` or `/proc/<pid>/ns/net`).
pub fn inode_of(path: &Path) -> Result<u64, NetNsError> {
    std::fs::metadata(path)
        .map(|m| m.ino())
        .map_err(|source| NetNsError::Open {
            path: path.to_owned(),
            source,
        })
}

/// Host PIDs of the processes in the named namespace. Zombies are not
/// listed: they have already left their namespaces.
pub fn pids_in(name: &str) -> Result<Vec<i32>, NetNsError> {
    let out = cmd::ip(["netns", "pids", name])?;
    Ok(out
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect())
}

/// Names of all named namespaces (`ip netns list`).
pub fn list() -> Result<Vec<String>, NetNsError> {
    let out = cmd::ip(["netns", "list"])?;
    // Lines look like "name" or "name (id: 3)".
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect())
}

fn open(path: &Path) -> Result<File, NetNsError> {
    File::open(path).map_err(|source| NetNsError::Open {
        path: path.to_owned(),
        source,
    })
}

/// Puts the CURRENT THREAD into a network namespace and puts it back on
/// drop. Sockets created meanwhile stay in that namespace for their whole
/// life, whichever thread uses them later. Not `Send`: it must be dropped on
/// the thread it changed.
#[derive(Debug)]
pub struct NetNsGuard {
    original: File,
    _thread_bound: PhantomData<*const ()>,
}

impl NetNsGuard {
    pub fn enter(path: &Path) -> Result<Self, NetNsError> {
        // thread-self, not self: the process's main thread may be elsewhere.
        let original = open(Path::new("/proc/thread-self/ns/net"))?;
        let target = open(path)?;
        setns(target.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|source| NetNsError::Enter {
            path: path.to_owned(),
            source,
        })?;
        Ok(Self {
            original,
            _thread_bound: PhantomData,
        })
    }
}

impl Drop for NetNsGuard {
    fn drop(&mut self) {
        if let Err(e) = setns(self.original.as_fd(), CloneFlags::CLONE_NEWNET) {
            // A thread left in a test namespace would create its later
            // sockets there; fail loudly unless already unwinding.
            if std::thread::panicking() {
                eprintln!("ferry-integration: restoring the thread's network namespace: {e}");
            } else {
                panic!("restoring the thread's network namespace: {e}");
            }
        }
    }
}

/// Runs `f` on a fresh thread inside the namespace at `path` and returns its
/// result; a panic in `f` propagates. The calling thread never moves.
pub fn run_in<T, F>(path: &Path, f: F) -> Result<T, NetNsError>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    std::thread::scope(|s| {
        let handle = std::thread::Builder::new()
            .name("netns".into())
            .spawn_scoped(s, || {
                let _guard = NetNsGuard::enter(path)?;
                Ok(f())
            })
            .map_err(NetNsError::Thread)?;
        match handle.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// A child process that is killed and reaped when dropped, so that a failing
/// test leaves neither a running process nor a zombie behind.
#[derive(Debug)]
pub struct ChildGuard {
    child: Option<Child>,
}

impl ChildGuard {
    pub fn new(child: Child) -> Self {
        Self { child: Some(child) }
    }

    /// Gives up the guard: the caller now waits for the child.
    pub fn into_inner(mut self) -> Child {
        self.child.take().expect("child present until drop")
    }
}

impl std::ops::Deref for ChildGuard {
    type Target = Child;
    fn deref(&self) -> &Child {
        self.child.as_ref().expect("child present until drop")
    }
}

impl std::ops::DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut Child {
        self.child.as_mut().expect("child present until drop")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take()
            && let Ok(None) = child.try_wait()
        {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Spawns `cmd` with its network namespace set to `path` and everything
/// else (mounts, PID namespace, cgroup) inherited: `nsenter --net` semantics.
pub fn spawn_in(path: &Path, mut cmd: Command) -> Result<ChildGuard, NetNsError> {
    // Opened in the parent so the child only has to make one syscall; the fd
    // is close-on-exec and must stay open until `spawn` returns.
    let ns = open(path)?;
    let fd = ns.as_raw_fd();
    // SAFETY: the closure runs in the forked child before exec and only
    // calls setns(2), which is async-signal-safe, on an fd that is open in
    // the child because `ns` outlives `spawn` below.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(|source| NetNsError::Spawn {
        command: cmd::describe(&cmd),
        path: path.to_owned(),
        source,
    })?;
    drop(ns);
    Ok(ChildGuard::new(child))
}

/// Runs `cmd` to completion inside the namespace at `path`, returning its
/// output (non-zero exit is not an error here: the caller judges).
pub fn output_in(path: &Path, mut cmd: Command) -> Result<std::process::Output, NetNsError> {
    use std::process::Stdio;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let command = cmd::describe(&cmd);
    let child = spawn_in(path, cmd)?.into_inner();
    child
        .wait_with_output()
        .map_err(|source| NetNsError::Spawn {
            command,
            path: path.to_owned(),
            source,
        })
}

/// Writes a sysctl inside the namespace at `path`. `/proc/sys/net` resolves
/// against the writing thread's network namespace, so no remount is needed.
pub fn set_sysctl(path: &Path, key: &str, value: &str) -> Result<(), NetNsError> {
    let file = PathBuf::from("/proc/sys").join(key.replace('.', "/"));
    run_in(path, || std::fs::write(&file, value))?.map_err(|source| NetNsError::Open {
        path: file.clone(),
        source,
    })
}
