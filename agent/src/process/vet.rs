//! Whether a running process can be put under ferry's management: what
//! ferry needs of it (the shape `ferry run` gives a process) and what would
//! make CRIU refuse to dump it, or restore it broken, as ferry runs CRIU.
//! All read from procfs and sock_diag, with the process running: nothing
//! here stops or touches it.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};

use super::{ProcessError, ProcessInfo, inspect, process_tree, read_proc, socket_inode};

/// One reason ferry cannot manage a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Obstacle {
    /// Not PID 1 of a PID namespace one level below ferryd's. A process in
    /// the node's PID namespace would need its PID free on the
    /// destination; CRIU restores a namespace's init with a new namespace.
    NotNamespaceInit { nspid: Vec<i32> },
    /// A namespace other than the PID namespace differs from ferryd's:
    /// ferry moves processes that live in the node's network, mount, ...
    /// namespaces (its data plane owns the node's ports).
    OwnNamespace { kind: &'static str },
    /// A session or process group led by a process outside the tree
    /// (CRIU needs --shell-job for that, which would tie it to a terminal).
    LeaderOutside {
        pid: i32,
        what: &'static str,
        leader: i32,
    },
    /// A controlling terminal, or a terminal on a descriptor: it cannot
    /// follow the process to another node.
    Terminal { pid: i32, what: String },
    /// A pipe or FIFO that a process outside the tree holds too: CRIU
    /// would restore only the tree's end, and the other side would be cut
    /// (the process's writes to it would fail with EPIPE).
    SharedPipe { pid: i32, fd: i32, inode: u64 },
    /// A Unix socket connected to a socket outside the tree, which CRIU
    /// refuses to dump (ferry does not run it with --ext-unix-sk).
    UnixPeerOutside { pid: i32, fd: i32, inode: u64 },
    /// A socket that a process outside the tree holds too (inherited from a
    /// supervisor, passed over a Unix socket, taken by pidfd). CRIU sees
    /// only the tree's descriptors and would move the socket; the outside
    /// copy would stay on this node, and its close there would reset the
    /// peer of a connection that lives on elsewhere.
    SharedSocket {
        pid: i32,
        fd: i32,
        inode: u64,
        holder: i32,
    },
    /// A socket of a family CRIU cannot dump.
    UnsupportedSocket { inode: u64, family: i32 },
    /// A POSIX or flock lock, which CRIU refuses to dump without
    /// --file-locks.
    FileLock { pid: i32 },
    /// A task of another user than ferryd's, whose resource limits the
    /// configured CRIU cannot read (`prlimit()` needs CAP_SYS_RESOURCE,
    /// which ferryd lacks; see [`super::privileges`]).
    OtherUsersLimits { pid: i32, uid: u32 },
    /// A task attached to System V shared memory of the node's IPC
    /// namespace, which CRIU refuses to dump (it moves such segments only
    /// with an IPC namespace of the process's own).
    NodeSysvShm { pid: i32, key: u32 },
    /// The tree's own IPC namespace holds a process outside the tree too,
    /// which would lose it.
    IpcNamespaceShared { holder: i32 },
    /// A hard resource limit of a task above the destination's, which
    /// lacks CAP_SYS_RESOURCE: CRIU's restore cannot raise it there, and
    /// it ignores the refusal (the task would run with the destination
    /// agent's limits instead of its own).
    LimitAboveDestination {
        pid: i32,
        limit: String,
        hard: u64,
        theirs: u64,
        node: String,
    },
}

impl fmt::Display for Obstacle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Obstacle::NotNamespaceInit { nspid } => write!(
                f,
                "it is not the init of its own PID namespace (NSpid {nspid:?}): start it with `ferry run`, or `unshare --pid --fork setsid CMD` with stdio on files"
            ),
            Obstacle::OwnNamespace { kind } => {
                write!(f, "its {kind} namespace is not the node's (ferryd's)")
            }
            Obstacle::LeaderOutside { pid, what, leader } => write!(
                f,
                "PID {pid}'s {what} leader {leader} is outside the process tree"
            ),
            Obstacle::Terminal { pid, what } => write!(
                f,
                "PID {pid} has a terminal ({what}), which cannot follow it to another node"
            ),
            Obstacle::SharedPipe { pid, fd, inode } => write!(
                f,
                "PID {pid}'s descriptor {fd} is a pipe or FIFO (inode {inode}) shared with a process outside the tree; after a migration its other end would be gone"
            ),
            Obstacle::UnixPeerOutside { pid, fd, inode } => write!(
                f,
                "PID {pid}'s descriptor {fd} is a Unix socket (inode {inode}) connected to a process outside the tree"
            ),
            Obstacle::SharedSocket {
                pid,
                fd,
                inode,
                holder,
            } => write!(
                f,
                "PID {pid}'s descriptor {fd} is a socket (inode {inode}) shared with PID {holder} outside the tree, whose copy would stay behind on this node"
            ),
            Obstacle::UnsupportedSocket { inode, family } => write!(
                f,
                "socket:[{inode}] is of family {family}, which CRIU cannot migrate (only IPv4, IPv6, Unix, netlink and packet)"
            ),
            Obstacle::FileLock { pid } => write!(
                f,
                "PID {pid} holds a file lock, which CRIU does not migrate as ferry runs it"
            ),
            Obstacle::OtherUsersLimits { pid, uid } => write!(
                f,
                "PID {pid} runs as user {uid}, whose resource limits the configured CRIU cannot read without CAP_SYS_RESOURCE, which ferryd lacks: install ferry's CRIU (`cargo xtask setup`, it reads them from procfs) or give ferryd CAP_SYS_RESOURCE"
            ),
            Obstacle::NodeSysvShm { pid, key } => write!(
                f,
                "PID {pid} is attached to System V shared memory (key {key:#x}) of the node's IPC namespace, which CRIU moves only with an IPC namespace of the process's own: start it with `ferry run --ipc-namespace`, which gives it one"
            ),
            Obstacle::IpcNamespaceShared { holder } => write!(
                f,
                "its IPC namespace holds PID {holder} outside the process tree too, which would lose it"
            ),
            Obstacle::LimitAboveDestination {
                pid,
                limit,
                hard,
                theirs,
                node,
            } => write!(
                f,
                "PID {pid}'s hard limit \"{limit}\" ({}) is above {node}'s ({}), and {node}'s agent lacks CAP_SYS_RESOURCE to raise it: the process would lose its limits there (lower the process's hard limit, or raise ferryd's on {node})",
                limit_text(*hard),
                limit_text(*theirs)
            ),
        }
    }
}

/// A limit as /proc/PID/limits writes it.
fn limit_text(v: u64) -> String {
    if v == u64::MAX {
        "unlimited".to_owned()
    } else {
        v.to_string()
    }
}

/// The namespaces a managed process shares with ferryd: all but PID and
/// IPC (`ferry run` gives it both; its IPC namespace moves with it, see
/// [`super::privileges::ipc_obstacles`]).
const SHARED_NAMESPACES: &[&str] = &["net", "mnt", "uts", "user", "cgroup", "time"];

/// The `NSpid:` line of /proc/PID/status: the process's PID in each PID
/// namespace it is in, outermost first.
fn nspid(pid: &str) -> Result<Vec<i32>, ProcessError> {
    let path = format!("/proc/{pid}/status");
    let status = read_proc(&path, pid.parse().unwrap_or(0))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .map(|v| {
            v.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .ok_or_else(|| ProcessError::Parse {
            path,
            reason: "no NSpid line".into(),
        })
}

/// An open descriptor: (number, link target, inode, pipe or FIFO?).
type Descriptor = (i32, String, u64, bool);

/// The open descriptors of `pid`.
fn descriptors(pid: i32) -> Vec<Descriptor> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let fd = e.file_name().to_str()?.parse().ok()?;
            let target = std::fs::read_link(e.path()).ok()?;
            let meta = std::fs::metadata(e.path()).ok()?;
            Some((
                fd,
                target.to_string_lossy().into_owned(),
                meta.ino(),
                meta.file_type().is_fifo(),
            ))
        })
        .collect()
}

/// Processes outside a tree that hold one of its pipes or sockets, by
/// inode.
#[derive(Debug, Default)]
struct OutsideHolders {
    pipes: HashMap<u64, BTreeSet<i32>>,
    sockets: HashMap<u64, BTreeSet<i32>>,
}

/// Every process but `members` holding one of `pipes` as a pipe or FIFO,
/// or one of `sockets`. A scan of every process's descriptors (before the
/// freeze, with the process running): the only way to see who holds the
/// other copy. ferryd's own copies of a tree's sockets (taken by pidfd to
/// read or drain its connections) are its own to close, and not counted.
fn outside_holders(
    members: &HashSet<i32>,
    pipes: &HashSet<u64>,
    sockets: &HashSet<u64>,
) -> OutsideHolders {
    let mut out = OutsideHolders::default();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return out;
    };
    let ferryd = std::process::id() as i32;
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if members.contains(&pid) {
            continue;
        }
        let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for e in dir.flatten() {
            let Ok(target) = std::fs::read_link(e.path()) else {
                continue;
            };
            if let Some(ino) = target.to_str().and_then(socket_inode) {
                if pid != ferryd && sockets.contains(&ino) {
                    out.sockets.entry(ino).or_default().insert(pid);
                }
                continue;
            }
            // Only a pipe's or FIFO's inode can be one of `pipes`; the
            // stat is skipped when the tree has none.
            if pipes.is_empty() {
                continue;
            }
            if let Ok(meta) = std::fs::metadata(e.path())
                && meta.file_type().is_fifo()
                && pipes.contains(&meta.ino())
            {
                out.pipes.entry(meta.ino()).or_default().insert(pid);
            }
        }
    }
    out
}

/// The processes of `tree` that hold a file lock, from /proc/locks.
fn lock_holders(tree: &HashSet<i32>) -> BTreeSet<i32> {
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    // "1: POSIX  ADVISORY  WRITE 4242 00:2a:1234 0 EOF"; blocked waiters
    // ("1: -> POSIX ...") hold nothing.
    locks
        .lines()
        .filter(|l| !l.contains("->"))
        .filter_map(|l| l.split_whitespace().nth(4)?.parse::<i32>().ok())
        .filter(|pid| tree.contains(pid))
        .collect()
}

/// What in `tree`'s descriptors and locks ferry could not migrate: pipes
/// and FIFOs shared with outside processes, sockets shared with them,
/// terminals, Unix sockets with a peer outside, file locks (sockets of
/// families CRIU cannot dump are found by the caller).
/// `unix_peers` is [`super::unix_peers`]'s answer (one dump for the whole
/// check).
pub fn descriptor_obstacles(tree: &[i32], unix_peers: &HashMap<u64, u64>) -> Vec<Obstacle> {
    let members: HashSet<i32> = tree.iter().copied().collect();
    let mut found = Vec::new();
    let fds: Vec<(i32, Vec<Descriptor>)> =
        tree.iter().map(|&pid| (pid, descriptors(pid))).collect();
    let tree_sockets: HashSet<u64> = fds
        .iter()
        .flat_map(|(_, d)| d.iter())
        .filter_map(|(_, t, _, _)| socket_inode(t))
        .collect();
    let pipes: HashSet<u64> = fds
        .iter()
        .flat_map(|(_, d)| d.iter())
        .filter(|(_, _, _, fifo)| *fifo)
        .map(|(_, _, ino, _)| *ino)
        .collect();
    let holders = outside_holders(&members, &pipes, &tree_sockets);
    let mut reported = HashSet::new();
    for (pid, list) in &fds {
        for (fd, target, ino, fifo) in list {
            if *fifo {
                if holders.pipes.contains_key(ino) && reported.insert(*ino) {
                    found.push(Obstacle::SharedPipe {
                        pid: *pid,
                        fd: *fd,
                        inode: *ino,
                    });
                }
            } else if target.starts_with("/dev/pts/")
                || target == "/dev/ptmx"
                || target.starts_with("/dev/tty")
                || target == "/dev/console"
            {
                found.push(Obstacle::Terminal {
                    pid: *pid,
                    what: format!("descriptor {fd} is {target}"),
                });
            } else if let Some(holder) = socket_inode(target)
                .and_then(|i| holders.sockets.get(&i))
                .and_then(|h| h.first())
                && reported.insert(*ino)
            {
                found.push(Obstacle::SharedSocket {
                    pid: *pid,
                    fd: *fd,
                    inode: *ino,
                    holder: *holder,
                });
            } else if target.starts_with("socket:")
                && let Some(peer) = unix_peers.get(ino)
                && !tree_sockets.contains(peer)
                && reported.insert(*ino)
            {
                found.push(Obstacle::UnixPeerOutside {
                    pid: *pid,
                    fd: *fd,
                    inode: *ino,
                });
            }
        }
    }
    for pid in lock_holders(&members) {
        found.push(Obstacle::FileLock { pid });
    }
    found
}

/// The process `pid` as ferry would adopt it, or what in its shape keeps
/// it from being managed (its PID namespace, namespaces, session and
/// process group, terminal); its descriptors are judged apart
/// ([`descriptor_obstacles`], for migrations too). `Err` is for a process
/// that is not there (or procfs failing); one that is there comes back
/// with every obstacle, so that the caller can fix them in one go.
pub fn shape_obstacles(pid: i32) -> Result<(ProcessInfo, Vec<Obstacle>), ProcessError> {
    let info = inspect(pid)?;
    if info.state == 'Z' || info.state == 'X' || info.kernel_thread {
        return Err(ProcessError::NotFound { pid });
    }
    let mut found = Vec::new();

    let theirs = nspid(&pid.to_string())?;
    let ours = nspid("self")?;
    if theirs.len() != ours.len() + 1 || theirs.last() != Some(&1) {
        found.push(Obstacle::NotNamespaceInit { nspid: theirs });
    }
    for kind in SHARED_NAMESPACES {
        let mine = std::fs::read_link(format!("/proc/self/ns/{kind}"));
        let its = std::fs::read_link(format!("/proc/{pid}/ns/{kind}"));
        // A kernel without that namespace type has the link for nobody.
        if let (Ok(mine), Ok(its)) = (mine, its)
            && mine != its
        {
            found.push(Obstacle::OwnNamespace { kind });
        }
    }

    let tree = process_tree(pid);
    let members: HashSet<i32> = tree.iter().copied().collect();
    for &p in &tree {
        let Ok(i) = inspect(p) else { continue };
        for (what, leader) in [("session", i.session), ("process group", i.pgrp)] {
            if !members.contains(&leader) {
                found.push(Obstacle::LeaderOutside {
                    pid: p,
                    what,
                    leader,
                });
            }
        }
        if i.tty_nr != 0 {
            found.push(Obstacle::Terminal {
                pid: p,
                what: format!(
                    "controlling terminal {}:{}",
                    (i.tty_nr >> 8) & 0xfff,
                    (i.tty_nr & 0xff) | ((i.tty_nr >> 12) & 0xfff00)
                ),
            });
        }
    }
    Ok((info, found))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use std::process::{Command, Stdio};

    /// A child of this test, killed and reaped when dropped.
    struct Child(std::process::Child);

    impl Drop for Child {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// `cmd` without the descriptors the test binary inherited (a
    /// jobserver pipe, say), which are shared with the outside.
    fn without_inherited(mut cmd: Command) -> Command {
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure makes one async-signal-safe system call
        // between fork and exec.
        unsafe { cmd.pre_exec(super::super::close_inherited_on_exec) };
        cmd
    }

    #[test]
    fn a_process_in_the_node_pid_namespace_is_not_adoptable() {
        let child = Child(
            Command::new("sleep")
                .arg("30")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let (_, found) = shape_obstacles(child.0.id() as i32).unwrap();
        assert!(
            found
                .iter()
                .any(|o| matches!(o, Obstacle::NotNamespaceInit { .. })),
            "{found:?}"
        );
        // Its session is this test's: led from outside.
        assert!(
            found.iter().any(|o| matches!(
                o,
                Obstacle::LeaderOutside {
                    what: "session",
                    ..
                }
            )),
            "{found:?}"
        );
    }

    #[test]
    fn pipes_to_outside_and_unix_peers_outside_are_found() {
        let (mine, theirs) = UnixStream::pair().unwrap();
        let mut cmd = Command::new("sleep");
        cmd.arg("30")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(std::os::fd::OwnedFd::from(theirs)));
        let child = Child(cmd.spawn().unwrap());
        let pid = child.0.id() as i32;
        // Another test's child, between its fork and its exec, holds a copy
        // of this test's descriptors for a moment: the socket then looks
        // shared with it rather than connected outside. Asked again until
        // that passes (bounded).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let found = loop {
            let peers = super::super::unix_peers().unwrap();
            let found = descriptor_obstacles(&[pid], &peers);
            let settled = found
                .iter()
                .any(|o| matches!(o, Obstacle::UnixPeerOutside { fd: 2, .. }));
            if settled || std::time::Instant::now() > deadline {
                break found;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        assert!(
            found
                .iter()
                .any(|o| matches!(o, Obstacle::SharedPipe { fd: 1, .. })),
            "{found:?}"
        );
        assert!(
            found
                .iter()
                .any(|o| matches!(o, Obstacle::UnixPeerOutside { fd: 2, .. })),
            "{found:?}"
        );
        drop(mine);
    }

    #[test]
    fn a_socket_shared_with_a_process_outside_the_tree_is_found() {
        // Two processes hold one listening socket on their stdin (as under
        // a supervisor that passes it on); this test lets go of its own
        // copy, which would not count anyway: it stands where ferryd does.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let inode = std::fs::metadata(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&listener)
        ))
        .unwrap()
        .ino();
        let holding = |fd: std::os::fd::OwnedFd| {
            let mut cmd = Command::new("sleep");
            cmd.arg("30")
                .stdin(Stdio::from(fd))
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            Child(without_inherited(cmd).spawn().unwrap())
        };
        let inside = holding(listener.try_clone().unwrap().into());
        let outside = holding(listener.into());
        let (inside_pid, outside_pid) = (inside.0.id() as i32, outside.0.id() as i32);
        let peers = super::super::unix_peers().unwrap();

        let found = descriptor_obstacles(&[inside_pid], &peers);
        assert!(
            found.contains(&Obstacle::SharedSocket {
                pid: inside_pid,
                fd: 0,
                inode,
                holder: outside_pid,
            }),
            "{found:?}"
        );
        // Both in the tree: the socket moves whole. A child another test
        // thread is spawning holds this process's descriptors, the
        // listener's copy among them, from its fork to its exec: a holder
        // outside for that moment, so the scan is asked again until none
        // is left (a real holder stays, and the test fails).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let found = descriptor_obstacles(&[inside_pid, outside_pid], &peers);
            let shared: Vec<_> = found
                .iter()
                .filter(|o| matches!(o, Obstacle::SharedSocket { .. }))
                .collect();
            if shared.is_empty() {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{shared:?}");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    #[test]
    fn a_pipe_and_a_socket_pair_inside_the_tree_are_fine() {
        // sh holds both ends of its pipeline's pipe until it forks; the
        // tree (sh and its two children) holds every end.
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "sleep 30 | sleep 31"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = Child(without_inherited(cmd).spawn().unwrap());
        let pid = child.0.id() as i32;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while process_tree(pid).len() < 3 {
            assert!(
                std::time::Instant::now() < deadline,
                "the pipeline never started"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let peers = super::super::unix_peers().unwrap();
        let found = descriptor_obstacles(&process_tree(pid), &peers);
        assert!(
            !found
                .iter()
                .any(|o| matches!(o, Obstacle::SharedPipe { .. })),
            "{found:?}"
        );
        // The sleeps themselves are not killed by dropping sh.
        for p in process_tree(pid).into_iter().skip(1) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(p),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}
