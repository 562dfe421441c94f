//! The sockets of a process tree, from /proc/PID/fd and the protocol tables
//! in /proc/PID/net (which show the process's own network namespace).

use std::collections::{BTreeMap, BTreeSet, HashSet};

use super::{ProcessError, read_proc};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Transport {
    Tcp,
    Udp,
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Transport::Tcp => "tcp",
            Transport::Udp => "udp",
        })
    }
}

/// A port on the node's public address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortKey {
    pub transport: Transport,
    pub port: u16,
}

impl std::fmt::Display for PortKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.port, self.transport)
    }
}

/// A `Port` of the API that names no TCP or UDP port.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadPort(String);

impl PortKey {
    /// The API's form.
    pub fn to_pb(&self) -> ferry_proto::v1::Port {
        use ferry_proto::v1::Protocol;
        ferry_proto::v1::Port {
            protocol: match self.transport {
                Transport::Tcp => Protocol::Tcp as i32,
                Transport::Udp => Protocol::Udp as i32,
            },
            port: u32::from(self.port),
        }
    }

    /// From the API's form: TCP or UDP, and a port from 1 to 65535.
    pub fn from_pb(p: &ferry_proto::v1::Port) -> Result<Self, BadPort> {
        use ferry_proto::v1::Protocol;
        let transport = match Protocol::try_from(p.protocol) {
            Ok(Protocol::Tcp) => Transport::Tcp,
            Ok(Protocol::Udp) => Transport::Udp,
            _ => {
                return Err(BadPort(format!(
                    "protocol {} is neither TCP nor UDP",
                    p.protocol
                )));
            }
        };
        let port = u16::try_from(p.port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| BadPort(format!("{} is not a port number", p.port)))?;
        Ok(Self { transport, port })
    }
}

/// What sockets a process tree holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SocketSummary {
    pub tcp_listening: u32,
    pub tcp_established: u32,
    /// TCP sockets in other states (SYN_SENT, FIN_WAIT, CLOSE_WAIT, ...).
    pub tcp_other: u32,
    pub udp: u32,
    /// Local ports of all of them: the ports this node must own for the
    /// process to receive its traffic.
    pub ports: BTreeSet<PortKey>,
    /// Addresses of the peers of its connected TCP sockets (IPv4-mapped
    /// ones as IPv4).
    pub tcp_peers: BTreeSet<std::net::IpAddr>,
}

const TCP_ESTABLISHED: u8 = 0x01;
const TCP_SYN_RECV: u8 = 0x03;
const TCP_LISTEN: u8 = 0x0A;

/// The inodes of the sockets any process in `tree` holds (its root must
/// exist; a descendant may exit while we look).
fn socket_inodes(tree: &[i32]) -> Result<HashSet<u64>, ProcessError> {
    let Some(&root) = tree.first() else {
        return Ok(HashSet::new());
    };
    let mut inodes = HashSet::new();
    for &pid in tree {
        let dir = format!("/proc/{pid}/fd");
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(_) if pid != root => continue,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ProcessError::NotFound { pid });
            }
            Err(source) => return Err(ProcessError::Io { path: dir, source }),
        };
        for entry in entries.flatten() {
            if let Ok(target) = std::fs::read_link(entry.path())
                && let Some(ino) = target.to_str().and_then(super::socket_inode)
            {
                inodes.insert(ino);
            }
        }
    }
    Ok(inodes)
}

/// The protocol tables of a network namespace, in /proc/PID/net.
const TCP_TABLES: [&str; 2] = ["tcp", "tcp6"];
const ALL_TABLES: [&str; 4] = ["tcp", "tcp6", "udp", "udp6"];

/// Every entry of `tables` (names in /proc/ROOT/net) of `root`'s network
/// namespace, with the table it came from. Each read walks the kernel's
/// whole hash table and prints every socket of the namespace (~5 ms for
/// 1024 connections here): read only what is needed.
fn table_entries(
    root: i32,
    tables: &[&'static str],
) -> Result<Vec<(&'static str, TableEntry)>, ProcessError> {
    let mut out = Vec::new();
    for &table in tables {
        let path = format!("/proc/{root}/net/{table}");
        let text = match read_proc(&path, root) {
            Ok(t) => t,
            // IPv6 may be disabled in a namespace.
            Err(ProcessError::NotFound { .. }) if table.ends_with('6') => continue,
            Err(e) => return Err(e),
        };
        out.extend(parse_table(&text).into_iter().map(|e| (table, e)));
    }
    Ok(out)
}

/// Summarises the TCP and UDP sockets held by any process in `tree`.
pub fn sockets_of_tree(tree: &[i32]) -> Result<SocketSummary, ProcessError> {
    let Some(&root) = tree.first() else {
        return Ok(SocketSummary::default());
    };
    let inodes = socket_inodes(tree)?;
    Ok(NamespaceSockets::read(root)?.summary(&inodes))
}

/// [`sockets_of_tree`] for several trees (each root first), with one read
/// of the socket tables per network namespace instead of one per tree:
/// every read lists every socket of the namespace, the other services'
/// too.
pub fn sockets_of_trees(trees: &[Vec<i32>]) -> Vec<Result<SocketSummary, ProcessError>> {
    let mut tables: BTreeMap<u64, Result<NamespaceSockets, String>> = BTreeMap::new();
    trees
        .iter()
        .map(|tree| {
            let Some(&root) = tree.first() else {
                return Ok(SocketSummary::default());
            };
            let inodes = socket_inodes(tree)?;
            let Some(ns) = netns_of(&root.to_string()) else {
                return Err(ProcessError::NotFound { pid: root });
            };
            // A failed read is told to each tree of the namespace (as a
            // string: the error is not Clone), and not tried again.
            let read = tables
                .entry(ns)
                .or_insert_with(|| NamespaceSockets::read(root).map_err(|e| e.to_string()));
            match read {
                Ok(t) => Ok(t.summary(&inodes)),
                Err(reason) => Err(ProcessError::Io {
                    path: format!("/proc/{root}/net"),
                    source: std::io::Error::other(reason.clone()),
                }),
            }
        })
        .collect()
}

/// The inode of a process's network namespace (`pid`: a PID or "self").
fn netns_of(pid: &str) -> Option<u64> {
    std::fs::metadata(format!("/proc/{pid}/ns/net"))
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .ok()
}

/// Whether `root` is in ferryd's network namespace, where sock_diag
/// answers for it.
fn in_our_netns(root: i32) -> bool {
    let ours = netns_of("self");
    ours.is_some() && ours == netns_of(&root.to_string())
}

/// Every TCP and UDP socket of one network namespace.
struct NamespaceSockets(Vec<(Transport, TableEntry)>);

impl NamespaceSockets {
    /// Those of `root`'s namespace: from sock_diag where that is ferryd's
    /// (a binary dump, about three times cheaper than procfs's text for
    /// the same sockets), from /proc/ROOT/net otherwise.
    fn read(root: i32) -> Result<Self, ProcessError> {
        if in_our_netns(root) {
            Self::from_sock_diag()
        } else {
            Self::from_procfs(root)
        }
    }

    fn from_procfs(root: i32) -> Result<Self, ProcessError> {
        let entries = table_entries(root, &ALL_TABLES)?
            .into_iter()
            .map(|(table, e)| {
                let transport = if table.starts_with("tcp") {
                    Transport::Tcp
                } else {
                    Transport::Udp
                };
                (transport, e)
            })
            .collect();
        Ok(Self(entries))
    }

    /// Those of ferryd's own network namespace.
    fn from_sock_diag() -> Result<Self, ProcessError> {
        let mut entries = Vec::new();
        for (transport, protocol) in [
            (Transport::Tcp, libc::IPPROTO_TCP),
            (Transport::Udp, libc::IPPROTO_UDP),
        ] {
            for family in [libc::AF_INET, libc::AF_INET6] {
                let Some(found) =
                    diag_sockets(family, protocol, super::sock_diag::ALL_STATES, || {
                        format!("sock_diag ({transport}, family {family})")
                    })?
                else {
                    continue;
                };
                entries.extend(found.into_iter().map(|e| {
                    let entry = TableEntry {
                        local_port: e.local_port,
                        remote: e.remote,
                        state: e.state,
                        inode: u64::from(e.inode),
                        accept_queue: if transport == Transport::Tcp && e.state == TCP_LISTEN {
                            e.rqueue
                        } else {
                            0
                        },
                    };
                    (transport, entry)
                }));
            }
        }
        Ok(Self(entries))
    }

    /// What the sockets of `inodes` are.
    fn summary(&self, inodes: &HashSet<u64>) -> SocketSummary {
        let mut summary = SocketSummary::default();
        for (transport, entry) in &self.0 {
            if !inodes.contains(&entry.inode) {
                continue;
            }
            match transport {
                Transport::Tcp => match entry.state {
                    TCP_LISTEN => summary.tcp_listening += 1,
                    TCP_ESTABLISHED => summary.tcp_established += 1,
                    _ => summary.tcp_other += 1,
                },
                Transport::Udp => summary.udp += 1,
            }
            if *transport == Transport::Tcp
                && entry.state != TCP_LISTEN
                && let Some(ip) = entry.remote
                && !ip.is_unspecified()
            {
                summary.tcp_peers.insert(ip);
            }
            if entry.local_port != 0 {
                summary.ports.insert(PortKey {
                    transport: *transport,
                    port: entry.local_port,
                });
            }
        }
        summary
    }
}

/// The listening TCP sockets of a process tree: inode, and port.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listeners {
    root: i32,
    by_inode: BTreeMap<u64, u16>,
    /// The tables they are in ("tcp" for IPv4, "tcp6" for IPv6 and
    /// dual-stack ones, whose handshakes show there too).
    tables: Vec<&'static str>,
    /// The tree is in ferryd's network namespace: its queues are read with
    /// sock_diag, asking for listeners and handshakes only. procfs prints
    /// every socket of the namespace for each look (~5 ms at a thousand
    /// connections).
    same_netns: bool,
}

impl Listeners {
    /// Those of `tree` now (its root first).
    pub fn of_tree(tree: &[i32]) -> Result<Self, ProcessError> {
        let Some(&root) = tree.first() else {
            return Ok(Self::default());
        };
        let inodes = socket_inodes(tree)?;
        let mut by_inode = BTreeMap::new();
        let mut tables = Vec::new();
        let same_netns = in_our_netns(root);
        let listening = if same_netns {
            listening_by_sock_diag()?
        } else {
            listening_by_procfs(root)?
        };
        for (table, inode, port) in listening {
            if inodes.contains(&inode) {
                by_inode.insert(inode, port);
                if !tables.contains(&table) {
                    tables.push(table);
                }
            }
        }
        Ok(Self {
            root,
            by_inode,
            tables,
            same_netns,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.by_inode.is_empty()
    }

    /// What waits on them now: connections in their accept queues, and
    /// handshakes under way on their ports (SYN_RECV).
    pub fn pending(&self) -> Result<PendingConnections, ProcessError> {
        let mut pending = PendingConnections::default();
        if self.is_empty() {
            return Ok(pending);
        }
        let ports: BTreeSet<u16> = self.by_inode.values().copied().collect();
        let mut add = |state: u8, local_port: u16, inode: u64, accept_queue: u32| {
            if state == TCP_LISTEN && accept_queue > 0 {
                if let Some(port) = self.by_inode.get(&inode) {
                    *pending.queued.entry(*port).or_default() += accept_queue;
                }
            } else if state == TCP_SYN_RECV && ports.contains(&local_port) {
                *pending.handshakes.entry(local_port).or_default() += 1;
            }
        };
        if self.same_netns {
            for table in &self.tables {
                let family = if *table == "tcp" {
                    libc::AF_INET
                } else {
                    libc::AF_INET6
                };
                let states = (1 << TCP_LISTEN) | (1 << TCP_SYN_RECV);
                let found = super::sock_diag::inet_sockets(family, libc::IPPROTO_TCP, states)
                    .map_err(|source| ProcessError::Io {
                        path: format!("sock_diag ({table})"),
                        source,
                    })?;
                for e in found {
                    add(e.state, e.local_port, u64::from(e.inode), e.rqueue);
                }
            }
        } else {
            for (_, e) in table_entries(self.root, &self.tables)? {
                add(e.state, e.local_port, e.inode, e.accept_queue);
            }
        }
        Ok(pending)
    }
}

/// sock_diag's sockets of ferryd's namespace in `states`; `None` for IPv6
/// where it is off (procfs then has no tcp6 or udp6). `what` names the
/// read in an error.
fn diag_sockets(
    family: i32,
    protocol: i32,
    states: u32,
    what: impl Fn() -> String,
) -> Result<Option<Vec<super::sock_diag::InetDiagEntry>>, ProcessError> {
    match super::sock_diag::inet_sockets(family, protocol, states) {
        Ok(found) => Ok(Some(found)),
        Err(e)
            if family == libc::AF_INET6
                && matches!(
                    e.raw_os_error(),
                    Some(libc::ENOENT | libc::EAFNOSUPPORT | libc::EINVAL)
                ) =>
        {
            Ok(None)
        }
        Err(source) => Err(ProcessError::Io {
            path: what(),
            source,
        }),
    }
}

/// The listening TCP sockets of `root`'s network namespace: table, inode
/// and port.
fn listening_by_procfs(root: i32) -> Result<Vec<(&'static str, u64, u16)>, ProcessError> {
    Ok(table_entries(root, &TCP_TABLES)?
        .into_iter()
        .filter(|(_, e)| e.state == TCP_LISTEN)
        .map(|(table, e)| (table, e.inode, e.local_port))
        .collect())
}

/// The listening TCP sockets of ferryd's network namespace: table, inode
/// and port. sock_diag asked for listeners alone walks only the kernel's
/// listening hash; procfs walks its whole established hash, shared by
/// every namespace, even for an empty table (~4 ms a table on this
/// machine), and this read comes between pre-copy's last round and the
/// freeze, where every page the process writes joins the freeze.
fn listening_by_sock_diag() -> Result<Vec<(&'static str, u64, u16)>, ProcessError> {
    let mut out = Vec::new();
    for (table, family) in [("tcp", libc::AF_INET), ("tcp6", libc::AF_INET6)] {
        let Some(found) = diag_sockets(family, libc::IPPROTO_TCP, 1 << TCP_LISTEN, || {
            format!("sock_diag ({table} listeners)")
        })?
        else {
            continue;
        };
        out.extend(
            found
                .into_iter()
                .filter(|e| e.state == TCP_LISTEN)
                .map(|e| (table, u64::from(e.inode), e.local_port)),
        );
    }
    Ok(out)
}

/// Connections of a tree's listening sockets that a dump would find
/// half-way, by port: CRIU can move neither.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PendingConnections {
    /// Connections waiting in the listener's accept queue.
    pub queued: BTreeMap<u16, u32>,
    /// Handshakes under way (SYN_RECV).
    pub handshakes: BTreeMap<u16, u32>,
}

impl PendingConnections {
    pub fn is_empty(&self) -> bool {
        self.queued.is_empty() && self.handshakes.is_empty()
    }
}

impl std::fmt::Display for PendingConnections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        for (port, n) in &self.queued {
            parts.push(format!(
                "port {port}: {n} connection(s) in the accept queue"
            ));
        }
        for (port, n) in &self.handshakes {
            parts.push(format!("port {port}: {n} handshake(s) under way"));
        }
        f.write_str(&parts.join(", "))
    }
}

#[derive(Debug, PartialEq, Eq)]
struct TableEntry {
    local_port: u16,
    /// The peer's address (an IPv4-mapped one as IPv4).
    remote: Option<std::net::IpAddr>,
    state: u8,
    inode: u64,
    /// Of a listening socket: the connections in its accept queue (the
    /// table's rx_queue, which for a listener is its backlog).
    accept_queue: u32,
}

/// Parses /proc/net/{tcp,tcp6,udp,udp6}: after a header line, one socket a
/// line: `sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...`,
/// addresses as HEXADDR:HEXPORT.
fn parse_table(text: &str) -> Vec<TableEntry> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local = f.get(1)?;
            let port = u16::from_str_radix(local.rsplit(':').next()?, 16).ok()?;
            let state = u8::from_str_radix(f.get(3)?, 16).ok()?;
            let inode = f.get(9)?.parse().ok()?;
            let accept_queue = if state == TCP_LISTEN {
                f.get(4)
                    .and_then(|q| q.split_once(':'))
                    .and_then(|(_, rx)| u32::from_str_radix(rx, 16).ok())
                    .unwrap_or(0)
            } else {
                0
            };
            let remote = f
                .get(2)
                .and_then(|r| crate::inet::of_proc_net(r))
                .map(|a| a.ip());
            Some(TableEntry {
                local_port: port,
                remote,
                state,
                inode,
                accept_queue,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_net_tcp_lines() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 00000000:1B58 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 14376 1 0000000000000000 100 0 0 10 0\n   1: 640012C6:1B58 010012C6:D5FA 01 00000000:00000000 00:00000000 00000000     0        0 14380 1 0000000000000000 20 4 30 10 -1\n";
        let e = parse_table(text);
        assert_eq!(
            e,
            vec![
                TableEntry {
                    local_port: 7000,
                    remote: Some(std::net::Ipv4Addr::UNSPECIFIED.into()),
                    state: TCP_LISTEN,
                    inode: 14376,
                    accept_queue: 0,
                },
                TableEntry {
                    local_port: 7000,
                    // 010012C6 as printed on a little-endian host.
                    remote: Some(std::net::Ipv4Addr::new(198, 18, 0, 1).into()),
                    state: TCP_ESTABLISHED,
                    inode: 14380,
                    accept_queue: 0,
                },
            ]
        );
    }

    /// sock_diag, asked for listeners alone, finds the same ones as
    /// procfs, in the same tables (an IPv6 one in "tcp6").
    #[test]
    fn sock_diag_and_procfs_find_the_same_listeners() {
        let v4 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let v6 = std::net::TcpListener::bind("[::1]:0").ok();
        let me = std::process::id() as i32;
        let ours = socket_inodes(&[me]).unwrap();
        let mine = |mut found: Vec<(&'static str, u64, u16)>| {
            found.retain(|(_, inode, _)| ours.contains(inode));
            found.sort();
            found
        };
        let by_diag = mine(listening_by_sock_diag().unwrap());
        let by_procfs = mine(listening_by_procfs(me).unwrap());
        assert_eq!(by_diag, by_procfs);
        let port = v4.local_addr().unwrap().port();
        assert!(by_diag.iter().any(|(t, _, p)| *t == "tcp" && *p == port));
        if let Some(v6) = v6 {
            let port = v6.local_addr().unwrap().port();
            assert!(by_diag.iter().any(|(t, _, p)| *t == "tcp6" && *p == port));
        }
    }

    /// A connection the kernel completed and the process has not yet
    /// accepted waits in the accept queue, and no longer once accepted;
    /// sock_diag and procfs say the same.
    #[test]
    fn a_connection_not_yet_accepted_is_pending_on_its_listener() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let by_diag = Listeners::of_tree(&[std::process::id() as i32]).unwrap();
        assert!(by_diag.same_netns);
        let by_procfs = Listeners {
            same_netns: false,
            ..by_diag.clone()
        };
        for listeners in [by_diag, by_procfs] {
            a_connection_waits_until_accepted(&l, &listeners);
        }
    }

    fn a_connection_waits_until_accepted(l: &std::net::TcpListener, listeners: &Listeners) {
        let port = l.local_addr().unwrap().port();
        assert!(listeners.by_inode.values().any(|p| *p == port));
        assert!(
            !listeners.pending().unwrap().queued.contains_key(&port),
            "nothing connected yet"
        );
        let _client = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let pending = listeners.pending().unwrap();
        assert_eq!(pending.queued.get(&port), Some(&1), "{pending}");
        assert!(
            pending
                .to_string()
                .contains(&format!("port {port}: 1 connection"))
        );
        let _accepted = l.accept().unwrap();
        assert!(
            !listeners.pending().unwrap().queued.contains_key(&port),
            "accepted"
        );
    }

    /// sock_diag and procfs describe the same sockets alike: a listener,
    /// both ends of a connection, an unconnected and a connected UDP
    /// socket, IPv4 and IPv6.
    #[test]
    fn sock_diag_and_procfs_summarise_alike() {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::MetadataExt;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let connected = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        connected.connect(udp.local_addr().unwrap()).unwrap();
        let l6 = std::net::TcpListener::bind("[::1]:0").ok();
        let mut fds = vec![
            l.as_raw_fd(),
            client.as_raw_fd(),
            server.as_raw_fd(),
            udp.as_raw_fd(),
            connected.as_raw_fd(),
        ];
        fds.extend(l6.as_ref().map(|l| l.as_raw_fd()));
        // Only this test's sockets: other tests' come and go meanwhile.
        let inodes: HashSet<u64> = fds
            .iter()
            .map(|fd| {
                std::fs::metadata(format!("/proc/self/fd/{fd}"))
                    .unwrap()
                    .ino()
            })
            .collect();
        let me = std::process::id() as i32;
        let by_diag = NamespaceSockets::from_sock_diag().unwrap().summary(&inodes);
        let by_procfs = NamespaceSockets::from_procfs(me).unwrap().summary(&inodes);
        assert_eq!(by_diag, by_procfs);
        let listeners = 1 + u32::from(l6.is_some());
        assert_eq!(
            (by_diag.tcp_listening, by_diag.tcp_established, by_diag.udp),
            (listeners, 2, 2)
        );
        assert_eq!(
            by_diag.tcp_peers,
            [std::net::IpAddr::from(std::net::Ipv4Addr::LOCALHOST)]
                .into_iter()
                .collect()
        );
        let port = |transport, port| PortKey { transport, port };
        assert!(
            by_diag
                .ports
                .contains(&port(Transport::Tcp, l.local_addr().unwrap().port()))
        );
        assert!(
            by_diag
                .ports
                .contains(&port(Transport::Udp, udp.local_addr().unwrap().port()))
        );
        // Several trees of one namespace: an answer for each, in order,
        // from the namespace's one read, each with this test's listener;
        // an empty tree has no sockets. (Each tree's descriptors are read
        // on their own, and other tests' sockets come and go between.)
        let answers = sockets_of_trees(&[vec![me], Vec::new(), vec![me]]);
        assert_eq!(answers.len(), 3);
        let listener = port(Transport::Tcp, l.local_addr().unwrap().port());
        for i in [0, 2] {
            assert!(answers[i].as_ref().unwrap().ports.contains(&listener));
        }
        assert_eq!(answers[1].as_ref().unwrap(), &SocketSummary::default());
    }

    #[test]
    fn finds_a_listening_socket_of_this_process() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let s = sockets_of_tree(&[std::process::id() as i32]).unwrap();
        assert!(s.tcp_listening >= 1);
        assert!(s.ports.contains(&PortKey {
            transport: Transport::Tcp,
            port
        }));
    }
}
