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

use std::os::fd::AsFd;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::process;

use super::EngineError;
use crate::sockstate::sys::{self, get_int, pidfd_getfd, set_int};

/// Clears TCP_REPAIR on every TCP socket of the tree that has it set;
/// returns how many.
fn leave_repair_mode(tree: &[i32]) -> Result<u32, EngineError> {
    let mut fixed = 0;
    for &pid in tree {
        let pidfd = match crate::process::pidfd::open(pid) {
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
            let sock = pidfd_getfd(pidfd.as_fd(), n)
                .map_err(EngineError::io(format!("pidfd_getfd({pid}, {n})")))?;
            if get_int(sock.as_fd(), libc::SOL_SOCKET, libc::SO_PROTOCOL).ok()
                != Some(libc::IPPROTO_TCP)
            {
                continue;
            }
            // Only sockets CRIU left in repair mode: clearing it on others
            // would reset their SO_REUSEADDR.
            if get_int(sock.as_fd(), libc::SOL_TCP, libc::TCP_REPAIR).unwrap_or(0) == 0 {
                continue;
            }
            // TCP_REPAIR_OFF: leave repair mode, send a window probe.
            set_int(
                sock.as_fd(),
                libc::SOL_TCP,
                sys::TCP_REPAIR,
                sys::REPAIR_OFF,
            )
            .map_err(EngineError::io(format!(
                "clearing TCP_REPAIR on {pid} fd {n}"
            )))?;
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
            Err(e) => return Err(EngineError::Resume(format!("SIGCONT {p}: {e}"))),
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
            return Err(EngineError::Resume(format!(
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
