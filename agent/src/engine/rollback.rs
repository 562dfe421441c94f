//! Putting a process that a failed migration stopped back to work on the
//! source.
//!
//! After `criu dump --leave-stopped` the process is stopped and its
//! established TCP sockets are still in repair mode (CRIU unlocks them only
//! when it resumes the process itself). A socket in repair mode neither
//! sends nor acknowledges anything, so they must leave repair mode before
//! the process runs again. ferry takes a duplicate of each socket with
//! pidfd_getfd(2) and clears TCP_REPAIR on it: that acts on the process's
//! own socket, and the kernel then sends a window probe, which restarts the
//! flow at once instead of after the peer's retransmission timeout.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::process;

use super::EngineError;

fn pidfd_open(pid: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a PID and flags and returns a new descriptor
    // or -1; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn pidfd_getfd(pidfd: &OwnedFd, target_fd: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number in the target
    // and flags (must be 0); it returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target_fd, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn getsockopt_int(fd: &OwnedFd, level: i32, name: i32) -> std::io::Result<i32> {
    let mut val: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: val and len point to properly sized, writable locals.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&mut val as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(val)
}

/// Clears TCP_REPAIR on every TCP socket of the tree that has it set;
/// returns how many.
fn leave_repair_mode(tree: &[i32]) -> Result<u32, EngineError> {
    let mut fixed = 0;
    for &pid in tree {
        let pidfd = match pidfd_open(pid) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => continue,
            Err(e) => return Err(EngineError::io(format!("pidfd_open({pid})"))(e)),
        };
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for entry in fds.flatten() {
            let is_socket = std::fs::read_link(entry.path())
                .map(|t| t.to_string_lossy().starts_with("socket:"))
                .unwrap_or(false);
            let Some(n) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<i32>().ok())
            else {
                continue;
            };
            if !is_socket {
                continue;
            }
            let sock = pidfd_getfd(&pidfd, n)
                .map_err(EngineError::io(format!("pidfd_getfd({pid}, {n})")))?;
            if getsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_PROTOCOL).ok()
                != Some(libc::IPPROTO_TCP)
            {
                continue;
            }
            // Only sockets CRIU left in repair mode: clearing it on others
            // would reset their SO_REUSEADDR.
            if getsockopt_int(&sock, libc::SOL_TCP, libc::TCP_REPAIR).unwrap_or(0) == 0 {
                continue;
            }
            let off: libc::c_int = 0; // TCP_REPAIR_OFF: leave repair mode, send a window probe
            // SAFETY: `off` is a live c_int and the length matches it.
            let r = unsafe {
                libc::setsockopt(
                    sock.as_raw_fd(),
                    libc::SOL_TCP,
                    libc::TCP_REPAIR,
                    (&off as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if r < 0 {
                return Err(EngineError::io(format!(
                    "clearing TCP_REPAIR on {pid} fd {n}"
                ))(std::io::Error::last_os_error()));
            }
            fixed += 1;
        }
    }
    Ok(fixed)
}

/// Resumes the stopped process tree rooted at `pid`: sockets out of repair
/// mode, then SIGCONT to every task, then a check that none is left stopped.
/// Blocking; the caller thaws the ports.
pub fn resume_on_source(pid: i32) -> Result<(), EngineError> {
    let tree = process::process_tree(pid);
    let repaired = leave_repair_mode(&tree)?;
    for &p in &tree {
        match kill(Pid::from_raw(p), Signal::SIGCONT) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
            Err(e) => return Err(EngineError::Internal(format!("SIGCONT {p}: {e}"))),
        }
    }
    // SIGCONT takes effect when the task is next scheduled; wait for it
    // (bounded) so the report can say the process runs again.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        let stopped: Vec<i32> = tree
            .iter()
            .copied()
            .filter(|p| {
                process::inspect(*p)
                    .map(|i| i.is_stopped())
                    .unwrap_or(false)
            })
            .collect();
        if stopped.is_empty() {
            break;
        }
        if std::time::Instant::now() > deadline {
            return Err(EngineError::Internal(format!(
                "tasks {stopped:?} still stopped after SIGCONT"
            )));
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    tracing::info!(
        pid,
        repaired_sockets = repaired,
        "process resumed on the source"
    );
    Ok(())
}
