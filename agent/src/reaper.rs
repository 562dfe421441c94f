//! Waiting for the exit of a child that tokio did not spawn.

use std::os::fd::{FromRawFd, OwnedFd};

use tokio::io::unix::AsyncFd;

/// Waits (without a thread) until process `pid` exits; if it is this
/// process's child, reaps it and returns its wait status (None for a
/// process that is not our child: only its parent learns how it ended). A
/// pidfd becomes readable when its process exits.
pub async fn wait_exit(pid: i32) -> std::io::Result<Option<i32>> {
    // SAFETY: pidfd_open takes a PID and flags and returns a new descriptor
    // or -1; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, libc::O_NONBLOCK) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // SAFETY: the AsyncFd owns the OwnedFd, which stays open and refers to
    // the same pidfd until the AsyncFd is dropped.
    let afd = unsafe { AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE) }
        .map_err(|e| e.into_parts().1)?;
    let _ready = afd.readable().await?;
    let mut status = 0;
    // SAFETY: waitpid with a valid pointer to a local; for a PID that is
    // not our child it fails with ECHILD and touches nothing.
    let reaped = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    Ok((reaped == pid).then_some(status))
}
