//! Looking at sockets inside a namespace, to tell which node holds a
//! connection.

use std::net::SocketAddr;
use std::path::Path;

use crate::netns::{self, NetNsError};

#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error(transparent)]
    NetNs(#[from] NetNsError),
    #[error("reading /proc/thread-self/net/tcp or tcp6: {0}")]
    Read(std::io::Error),
    #[error("unparsable line in /proc/net/tcp: {0:?}")]
    Parse(String),
    #[error("{op} of process {pid}: {source}")]
    Process {
        op: &'static str,
        pid: i32,
        source: std::io::Error,
    },
}

/// TCP states as numbered in `include/net/tcp_states.h`.
pub const TCP_ESTABLISHED: u8 = 1;
pub const TCP_LISTEN: u8 = 10;

/// One row of `/proc/net/tcp` or `tcp6`; an IPv4-mapped IPv6 address (a
/// dual-stack socket's IPv4 peer) as the IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpEntry {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    pub state: u8,
    pub inode: u64,
}

/// All IPv4 and IPv6 TCP sockets of the namespace at `netns_path`. Read
/// on a thread inside the namespace: `/proc/thread-self/net` shows the
/// reading thread's namespace.
pub fn tcp_sockets(netns_path: &Path) -> Result<Vec<TcpEntry>, InspectError> {
    let (v4, v6) = netns::run_in(netns_path, || {
        (
            std::fs::read_to_string("/proc/thread-self/net/tcp"),
            std::fs::read_to_string("/proc/thread-self/net/tcp6"),
        )
    })?;
    let mut all = parse_proc_net_tcp(&v4.map_err(InspectError::Read)?)?;
    all.extend(parse_proc_net_tcp(&v6.map_err(InspectError::Read)?)?);
    Ok(all)
}

/// The processes holding a descriptor of each socket inode in `inodes`,
/// as "PID (command)", found by reading every process's `/proc/PID/fd`.
/// A socket no descriptor names (a TIME_WAIT, an orphan) has no entry.
pub fn socket_holders(
    inodes: &std::collections::BTreeSet<u64>,
) -> std::collections::BTreeMap<u64, Vec<String>> {
    let mut found = std::collections::BTreeMap::<u64, Vec<String>>::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Some(inode) = std::fs::read_link(fd.path()).ok().and_then(|l| {
                l.to_str()?
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .parse::<u64>()
                    .ok()
            }) else {
                continue;
            };
            if inodes.contains(&inode) {
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                found
                    .entry(inode)
                    .or_default()
                    .push(format!("{pid} ({})", comm.trim()));
            }
        }
    }
    found
}

/// Peers of the ESTABLISHED sockets whose local port is `local_port`.
pub fn established_peers(
    netns_path: &Path,
    local_port: u16,
) -> Result<Vec<SocketAddr>, InspectError> {
    Ok(tcp_sockets(netns_path)?
        .into_iter()
        .filter(|e| e.state == TCP_ESTABLISHED && e.local.port() == local_port)
        .map(|e| e.remote)
        .collect())
}

pub fn parse_proc_net_tcp(text: &str) -> Result<Vec<TcpEntry>, InspectError> {
    text.lines()
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .map(|line| parse_line(line).ok_or_else(|| InspectError::Parse(line.to_owned())))
        .collect()
}

// "  0: 0100007F:1B58 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 ..."
fn parse_line(line: &str) -> Option<TcpEntry> {
    let f: Vec<&str> = line.split_whitespace().collect();
    Some(TcpEntry {
        local: ferry_agent::inet::of_proc_net(f.get(1)?)?,
        remote: ferry_agent::inet::of_proc_net(f.get(2)?)?,
        state: u8::from_str_radix(f.get(3)?, 16).ok()?,
        inode: f.get(9)?.parse().ok()?,
    })
}

/// Every socket descriptor of process `pid`, duplicated into this process
/// (`pidfd_getfd`): the same sockets, to ask or set options on. Descriptors
/// closed meanwhile are left out.
pub fn sockets_of(pid: i32) -> Result<Vec<std::os::fd::OwnedFd>, InspectError> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let err = |op| move |source| InspectError::Process { op, pid, source };
    // SAFETY: a plain system call; a returned descriptor is new and ours.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(err("pidfd_open")(std::io::Error::last_os_error()));
    }
    // SAFETY: pidfd_open returned a new descriptor, owned from here on.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    let mut sockets = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).map_err(err("listing the fds"))? {
        let entry = entry.map_err(err("listing the fds"))?;
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if !target.to_string_lossy().starts_with("socket:[") {
            continue;
        }
        let Ok(n) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        // SAFETY: a plain system call; a returned descriptor is new and ours.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), n, 0) };
        if fd >= 0 {
            // SAFETY: pidfd_getfd returned a new descriptor.
            sockets.push(unsafe { OwnedFd::from_raw_fd(fd as i32) });
        }
    }
    Ok(sockets)
}

/// Process `pid`'s descriptor table: each descriptor's number and what it
/// is, as /proc/PID/fd links it, without the inode numbers that differ
/// between nodes ("socket", "pipe", "anon_inode:[pidfd]", a path...), and
/// its flags as /proc/PID/fdinfo gives them (octal: the file's status
/// flags, O_NONBLOCK among them, and O_CLOEXEC for the descriptor's
/// close-on-exec), e.g. "socket flags 02004002". A migrated process must
/// come back with exactly the table it had.
pub fn descriptor_table(pid: i32) -> Result<std::collections::BTreeMap<i32, String>, InspectError> {
    let err = |op| move |source| InspectError::Process { op, pid, source };
    let mut table = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).map_err(err("listing the fds"))? {
        let entry = entry.map_err(err("listing the fds"))?;
        let Ok(n) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let target = target.to_string_lossy().into_owned();
        let kind = match target.split_once(":[") {
            Some((kind, rest)) if rest.trim_end_matches(']').parse::<u64>().is_ok() => {
                kind.to_owned()
            }
            _ => target,
        };
        // Gone since the listing: left out, like a link that cannot be read.
        let Ok(info) = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{n}")) else {
            continue;
        };
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .map_or("?", str::trim);
        table.insert(n, format!("{kind} flags {flags}"));
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_endian = "little")]
    fn parses_proc_net_tcp() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 00000000:1B58 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0000000000000000 100 0 0 10 0\n\
   1: 640012C6:1B58 0B0012C6:A3F2 01 00000000:00000000 00:00000000 00000000     0        0 4243 1 0000000000000000 20 4 30 10 -1\n";
        let v = parse_proc_net_tcp(text).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].state, TCP_LISTEN);
        assert_eq!(v[0].local, "0.0.0.0:7000".parse().unwrap());
        assert_eq!(v[1].state, TCP_ESTABLISHED);
        assert_eq!(v[1].local, "198.18.0.100:7000".parse().unwrap());
        assert_eq!(v[1].remote, "198.18.0.11:41970".parse().unwrap());
        assert_eq!(v[1].inode, 4243);
    }
}
