//! What keeps a running process from being managed (`ferry adopt`) or
//! moved: checked with it running, so that CRIU never refuses a dump after
//! the freeze.

use crate::process;

/// What in the descriptors of process tree `tree` ferry could not move,
/// found with it running (see [`process::descriptor_obstacles`]), its
/// System V IPC that cannot move ([`process::privileges::ipc_obstacles`])
/// and its sockets of families CRIU cannot dump: what adoption and every
/// migration check, so that CRIU never refuses a dump after the freeze.
/// Blocking (procfs, a sock_diag dump, the tree's sockets).
pub fn tree_obstacles(tree: &[i32]) -> Result<Vec<process::Obstacle>, String> {
    let peers = process::unix_peers().map_err(|e| format!("listing Unix socket peers: {e}"))?;
    let mut found = process::descriptor_obstacles(tree, &peers);
    found.extend(process::privileges::ipc_obstacles(tree));
    let unsupported = crate::sockstate::unsupported_sockets(tree).map_err(|e| e.to_string())?;
    found.extend(
        unsupported
            .into_iter()
            .map(|(inode, family)| process::Obstacle::UnsupportedSocket { inode, family }),
    );
    Ok(found)
}

/// Why a running process was not adopted (`ferry adopt`).
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("pid: no process {pid} runs on {node}")]
    NotFound { pid: i32, node: String },
    #[error("pid: {pid} is under management already")]
    AlreadyManaged { pid: i32 },
    #[error("pid: {pid} is ferryd itself")]
    Agent { pid: i32 },
    #[error("pid: {pid} cannot be managed by ferry: {}", .obstacles.iter().map(|o| o.to_string()).collect::<Vec<_>>().join("; "))]
    Obstacles {
        pid: i32,
        obstacles: Vec<process::Obstacle>,
    },
    #[error("reading process {pid}: {source}")]
    Process {
        pid: i32,
        source: process::ProcessError,
    },
    #[error("reading the descriptors of process {pid}: {reason}")]
    Sockets { pid: i32, reason: String },
}
