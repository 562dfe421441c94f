//! Waiting for the exit of a child that tokio did not spawn.

use std::os::fd::{FromRawFd, OwnedFd};

use tokio::io::unix::AsyncFd;

/// Waits (without a thread) until child `pid` exits, then reaps it. A pidfd
/// becomes readable when its process exits.
pub async fn wait_exit(pid: i32) -> std::io::Result<()> {
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
    // SAFETY: waitpid on our own child with a valid pointer to a local.
    unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    Ok(())
}
