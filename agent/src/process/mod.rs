//! What ferryd reads about a process from procfs: identity, process tree,
//! and the sockets it holds.

pub mod memory;
pub mod nice;
pub mod pidfd;
pub mod privileges;
mod sock_diag;
mod sockets;
mod stat;
mod unix_diag;
mod unrecorded;
mod vet;

pub use sockets::{
    BadPort, Listeners, PendingConnections, PortKey, SocketSummary, Transport, sockets_of_tree,
    sockets_of_trees,
};
pub use stat::{ProcessInfo, inspect, process_tree, state_of, wait_group_stopped};
pub use unix_diag::unix_peers;
pub use unrecorded::{CopyState, ticks_now, unrecorded_copies};
pub use vet::{Obstacle, descriptor_obstacles, shape_obstacles};

/// Errors reading a process's state from procfs.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("no process with PID {pid}")]
    NotFound { pid: i32 },
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot parse {path}: {reason}")]
    Parse { path: String, reason: String },
}

/// Marks every descriptor above stdio close-on-exec (close_range), so that
/// descriptors this process inherited without the flag (a lock its starter
/// held, a jobserver pipe) do not follow into a program it starts: CRIU
/// refuses to dump a process holding a file lock, and adoption refuses a
/// pipe shared with the outside. Marked rather than closed, so that an
/// exec-error pipe still works. One system call, async-signal-safe: meant
/// for the child between fork and exec (`pre_exec`).
pub fn close_inherited_on_exec() -> std::io::Result<()> {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: close_range takes three integers and touches no memory.
    let r = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            CLOSE_RANGE_CLOEXEC,
        )
    };
    if r == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The inode of a descriptor whose link (/proc/PID/fd/N) reads
/// `socket:[<inode>]`.
fn socket_inode(target: &str) -> Option<u64> {
    target
        .strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

fn read_proc(path: &str, pid: i32) -> Result<String, ProcessError> {
    std::fs::read_to_string(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => ProcessError::NotFound { pid },
        _ if source.raw_os_error() == Some(libc::ESRCH) => ProcessError::NotFound { pid },
        _ => ProcessError::Io {
            path: path.to_owned(),
            source,
        },
    })
}
