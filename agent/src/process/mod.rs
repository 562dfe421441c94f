//! What ferryd reads about a process from procfs: identity, process tree,
//! and the sockets it holds.

mod sockets;
mod stat;
mod unix_diag;
mod vet;

pub use sockets::{PortKey, SocketSummary, Transport, sockets_of_tree};
pub use stat::{ProcessInfo, inspect, process_tree};
pub use unix_diag::unix_peers;
pub use vet::{Obstacle, adoption_obstacles, descriptor_obstacles};

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
