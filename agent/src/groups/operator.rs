//! The operator's handoff (`ferry handoff`, `Control.HandoffConnection`):
//! ferryd finds the group's server process that holds a connection, takes
//! a duplicate of its descriptor (`pidfd_getfd`) and hands the connection
//! off as if the process had asked. The process is not told: its own
//! descriptor stays in repair mode (inert: reads wait, writes fail, closing
//! sends nothing).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use super::donor::HandedOff;
use super::{Groups, GroupsError, managed_root};
use crate::dataplane::Flow;

impl Groups {
    /// Hands `flow`, held by a server of its group on this node, to `to`.
    pub async fn handoff_held(
        self: &Arc<Self>,
        flow: Flow,
        to: String,
        drain: Duration,
    ) -> Result<(i32, HandedOff), GroupsError> {
        let servers: Vec<i32> = self
            .servers(flow.local_port)
            .iter()
            .map(|s| s.pid)
            .collect();
        if servers.is_empty() {
            return Err(GroupsError::NoServer {
                port: flow.local_port,
                node: self.node.clone(),
            });
        }
        let (pid, fd) = tokio::task::spawn_blocking(move || take_connection(flow, &servers))
            .await
            .map_err(|e| GroupsError::Internal(e.to_string()))??;
        tracing::info!(%flow, pid, %to, "an operator hands a connection off");
        let done = self.handoff(pid, fd, to, drain, Vec::new()).await?;
        Ok((pid, done))
    }
}

/// The inode of the TCP socket of `flow` in this network namespace.
fn inode_of(flow: Flow) -> Result<u64, GroupsError> {
    for table in super::chain::TCP_TABLES {
        let text = match std::fs::read_to_string(table) {
            Ok(text) => text,
            // No IPv6 in this kernel: no tcp6 table.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(GroupsError::Internal(format!("{table}: {e}"))),
        };
        if let Some(inode) = find_inode(&text, flow) {
            return Ok(inode);
        }
    }
    Err(GroupsError::NotAConnection(format!(
        "no connection {flow} on this node"
    )))
}

/// `flow`'s socket inode in a /proc/net/tcp or tcp6 text (not a
/// listener's).
fn find_inode(text: &str, flow: Flow) -> Option<u64> {
    super::chain::tcp_entries(text)
        .find(|e| !e.listening && e.local.port() == flow.local_port && e.remote == flow.remote)
        .map(|e| e.inode)
}

/// A duplicate of the descriptor of `flow`'s socket in a process of the
/// trees of `servers`, and that process.
fn take_connection(flow: Flow, servers: &[i32]) -> Result<(i32, OwnedFd), GroupsError> {
    let inode = inode_of(flow)?;
    let link = format!("socket:[{inode}]");
    let procs =
        std::fs::read_dir("/proc").map_err(|e| GroupsError::Internal(format!("/proc: {e}")))?;
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        if managed_root(servers, pid).is_none() {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if std::fs::read_link(fd.path()).is_ok_and(|t| t.as_os_str() == link.as_str()) {
                let Some(num) = fd.file_name().to_str().and_then(|n| n.parse().ok()) else {
                    continue;
                };
                let pidfd = crate::process::pidfd::open(pid)
                    .map_err(|e| GroupsError::Internal(format!("pidfd of {pid}: {e}")))?;
                let dup = crate::sockstate::sys::pidfd_getfd(pidfd.as_fd(), num).map_err(|e| {
                    GroupsError::Internal(format!("descriptor {num} of {pid}: {e}"))
                })?;
                return Ok((pid, dup));
            }
        }
    }
    Err(GroupsError::NotAConnection(format!(
        "connection {flow} is held by no server of its group on this node"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_is_found_by_its_ends_and_a_listener_never() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   \
            0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0000000000000000 100 0 0 10 0\n   \
            1: 640012C6:1F90 0B0012C6:9D2C 01 00000000:00000000 00:00000000 00000000     0        0 222 1 0000000000000000 20 4 30 10 -1\n";
        let flow = |remote: &str| Flow::new(remote.parse().unwrap(), 8080);
        assert_eq!(find_inode(text, flow("198.18.0.11:40236")), Some(222));
        assert_eq!(find_inode(text, flow("198.18.0.11:40237")), None);
        assert_eq!(find_inode(text, flow("0.0.0.0:0")), None);
        // /proc/net/tcp6: an IPv6 client, and an IPv4 one of a dual-stack
        // listener (::ffff:198.18.0.12), each found by its own address.
        let text6 = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   \
            0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 333 1 0000000000000000 100 0 0 10 0\n   \
            1: 02000120000000000000000000010000:1F90 02000120000000000000000011000000:9D2C 01 00000000:00000000 00:00000000 00000000     0        0 444 1 0000000000000000 20 4 30 10 -1\n   \
            2: 0000000000000000FFFF0000640012C6:1F90 0000000000000000FFFF00000C0012C6:9D2D 01 00000000:00000000 00:00000000 00000000     0        0 555 1 0000000000000000 20 4 30 10 -1\n";
        assert_eq!(find_inode(text6, flow("[2001:2::11]:40236")), Some(444));
        assert_eq!(find_inode(text6, flow("198.18.0.12:40237")), Some(555));
        assert_eq!(find_inode(text6, flow("[::]:0")), None);
    }
}
