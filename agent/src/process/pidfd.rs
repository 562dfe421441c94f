//! Process descriptors (pidfds): a handle on one process that a reused PID
//! cannot redirect.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

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
}
