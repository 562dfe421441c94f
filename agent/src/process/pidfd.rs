//! Process descriptors (pidfds): a handle on one process that a reused PID
//! cannot redirect.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// A pidfd of process `pid` (close-on-exec).
pub fn open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a PID and flags and returns a new descriptor
    // or -1; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor the kernel just gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Sends SIGKILL to the process behind `pidfd` (`ESRCH` once it exited).
pub fn send_kill(pidfd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: pidfd_send_signal takes a descriptor, a signal number, a
    // null siginfo (the kernel fills in a kill(2)-like one) and flags; no
    // memory of ours is passed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// SIGKILLs process `pid` and all its descendants, each by a pidfd opened
/// before any is killed (a killed parent's children would be reparented
/// out of the tree's reach, and a PID may be reused once reaped). Returns
/// the root's error, if the root could not be killed for another reason
/// than being gone.
pub fn kill_tree(pid: i32) -> io::Result<()> {
    let tree: Vec<(i32, io::Result<OwnedFd>)> = super::process_tree(pid)
        .into_iter()
        .map(|p| (p, open(p)))
        .collect();
    let mut root = Ok(());
    for (p, fd) in &tree {
        let killed = match fd {
            Ok(fd) => send_kill(fd.as_fd()),
            Err(e) => Err(io::Error::from_raw_os_error(
                e.raw_os_error().unwrap_or(libc::EIO),
            )),
        };
        match killed {
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(e) if *p == pid => root = Err(e),
            Err(e) => tracing::warn!(pid = p, error = %e, "killing a task of the tree"),
            Ok(()) => {}
        }
    }
    root
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_pidfd_kills_its_process_and_then_finds_it_gone() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let fd = open(child.id() as i32).expect("pidfd_open");
        send_kill(fd.as_fd()).expect("SIGKILL");
        let status = child.wait().expect("wait");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        // Reaped: the pidfd now names no process (not whoever reuses the
        // PID).
        let e = send_kill(fd.as_fd()).expect_err("gone");
        assert_eq!(e.raw_os_error(), Some(libc::ESRCH));
    }

    #[test]
    fn a_tree_is_killed_whole() {
        // A shell with a child of its own: both go, the child too (killing
        // the shell alone would leave it, reparented).
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & wait"])
            .spawn()
            .expect("sh");
        let root = sh.id() as i32;
        let child = (0..200)
            .find_map(|_| {
                let tree = super::super::process_tree(root);
                if tree.len() < 2 {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                tree.get(1).copied()
            })
            .expect("the shell's child");
        let child_fd = open(child).expect("pidfd of the child");
        kill_tree(root).expect("kill_tree");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(sh.wait().unwrap().signal(), Some(libc::SIGKILL));
        // The child, reparented and reaped by whoever adopts it, is gone or
        // dying: a signal to it finds it dead (a zombie still takes
        // signals without effect, so its state is what tells).
        let state = (0..200).find_map(|_| {
            let s = std::fs::read_to_string(format!("/proc/{child}/stat")).ok();
            match s
                .as_deref()
                .and_then(|s| s.rsplit(") ").next())
                .and_then(|r| r.chars().next())
            {
                None | Some('Z') | Some('X') => Some(()),
                _ => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    None
                }
            }
        });
        assert!(state.is_some(), "the child survived");
        drop(child_fd);
    }
}
