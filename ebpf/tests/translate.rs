//! The in-cluster address translation in the real kernel.
//!
//! Each test builds a small cluster network: a switch namespace with a
//! bridge, and three node namespaces on it, each with a veth `cl0`:
//! - peer (A3, 198.19.7.3): runs the translator, as the node of a migrated
//!   process's peer;
//! - old (A1, 198.19.7.1): where the process was; nothing listens there;
//! - new (A2, 198.19.7.2): where the process is now.
//!
//! The bridge ports never offload checksums, so every packet that crosses
//! the switch arrives at a node with its checksum computed in software and
//! is verified by the receiving stack (`InCsumErrors` counts failures): a
//! packet a socket receives had valid checksums on the wire. With
//! [`Checksums::Offloaded`] the nodes send with CHECKSUM_PARTIAL (the
//! translator fixes a pseudo-header seed that the switch's veth completes);
//! with [`Checksums::Software`] they send finished checksums (the
//! translator updates them incrementally). Needs root; skipped with a
//! reason otherwise.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::{
    Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket,
};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use aya::programs::{SchedClassifier, TcAttachType};
use ferry_ebpf::pin::{self, PinDir, PinError};
use ferry_ebpf::{DataPlaneError, Protocol, RuleAction, TranslationRule, Translator};

const PEER_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 7, 3);
const OLD_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 7, 1);
const NEW_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 7, 2);
/// The same nodes on an IPv6 cluster network (2001:2::/48, RFC 5180's
/// benchmarking prefix), for [`Net::new6`].
const PEER_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 7, 0, 0, 0, 3);
const OLD_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 7, 0, 0, 0, 1);
const NEW_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 7, 0, 0, 0, 2);
const PEER_MAC: [u8; 6] = [0x02, 0xfe, 0, 0, 0, 3];
const OLD_MAC: [u8; 6] = [0x02, 0xfe, 0, 0, 0, 1];
const NEW_MAC: [u8; 6] = [0x02, 0xfe, 0, 0, 0, 2];
const IFACE: &str = "cl0";
const TIMEOUT: Duration = Duration::from_secs(5);

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Skips the test (aya-style: a printed reason, not a failure) unless root.
macro_rules! require_root {
    () => {
        if !is_root() {
            eprintln!("skipped: needs root (network namespaces, eBPF, bpffs)");
            return;
        }
    };
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn v4(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

/// A rule's IPv4 address (these tests' rules are all IPv4).
fn as_v4(a: SocketAddr) -> SocketAddrV4 {
    match a {
        SocketAddr::V4(v4) => v4,
        SocketAddr::V6(v6) => panic!("{v6} is not IPv4"),
    }
}

/// Runs `f` on a thread that joined namespace `ns` (network only).
/// Sockets, netlink handles and tcx links it creates stay bound to that
/// namespace wherever they are used later.
fn within<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let fd = File::open(&path).expect("netns file");
        nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        f()
    })
    .join()
    .expect("thread in namespace")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Checksums {
    /// The nodes' veths offload checksums: sent packets are
    /// CHECKSUM_PARTIAL at tc egress.
    Offloaded,
    /// The nodes compute checksums in software.
    Software,
}

/// `ethtool -K <dev> tx on|off`, by ioctl (no ethtool on these machines),
/// in the calling thread's namespace.
fn set_tx_checksum(dev: &str, on: bool) {
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    #[repr(C)]
    struct IfreqData {
        name: [u8; libc::IFNAMSIZ],
        data: *mut EthtoolValue,
        pad: [u8; 16],
    }
    const ETHTOOL_STXCSUM: u32 = 0x17;
    const SIOCETHTOOL: libc::c_ulong = 0x8946;
    let sock = UdpSocket::bind("0.0.0.0:0").expect("socket for the ioctl");
    let mut value = EthtoolValue {
        cmd: ETHTOOL_STXCSUM,
        data: u32::from(on),
    };
    let mut ifr = IfreqData {
        name: [0; libc::IFNAMSIZ],
        data: &mut value,
        pad: [0; 16],
    };
    ifr.name[..dev.len()].copy_from_slice(dev.as_bytes());
    // SAFETY: SIOCETHTOOL reads an ifreq (IfreqData has its layout: a
    // NUL-terminated name, then the data pointer) and the ethtool_value it
    // points to; both are live locals for the duration of the call.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), SIOCETHTOOL, &mut ifr) };
    assert_eq!(
        rc,
        0,
        "ETHTOOL_STXCSUM on {dev}: {}",
        std::io::Error::last_os_error()
    );
}

/// The switch and the three nodes, deleted on drop, also when the test
/// panics.
struct Net {
    switch: String,
    peer: String,
    old: String,
    new: String,
}

impl Net {
    fn new(checksums: Checksums) -> Self {
        Self::build(checksums, false)
    }

    /// [`Net::new`] with IPv6 on, each node also at its `*_IP6` address
    /// (quiet: no duplicate address detection, no router solicitations).
    fn new6(checksums: Checksums) -> Self {
        Self::build(checksums, true)
    }

    fn build(checksums: Checksums, ipv6: bool) -> Self {
        // Unique per process and test: the tests run in parallel.
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let id = format!(
            "fx-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        // The guard exists before the first namespace, so a failure below
        // still removes whatever was created.
        let net = Net {
            switch: format!("{id}s"),
            peer: format!("{id}p"),
            old: format!("{id}o"),
            new: format!("{id}n"),
        };
        for ns in net.all() {
            ip(&["netns", "add", ns]);
            // No IPv6 unless asked for: no router solicitations or MLD
            // reports in the captures, and nothing but the test's own
            // traffic.
            within(ns, move || {
                for knob in ["all", "default"] {
                    let conf = format!("/proc/sys/net/ipv6/conf/{knob}");
                    if ipv6 {
                        let _ = std::fs::write(format!("{conf}/accept_dad"), "0");
                        let _ = std::fs::write(format!("{conf}/router_solicitations"), "0");
                    } else {
                        let _ = std::fs::write(format!("{conf}/disable_ipv6"), "1");
                    }
                }
            });
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        let sw = &net.switch;
        // br_netfilter is built in here and hands bridged IPv4 to
        // iptables, checking its header first: malformed packets would
        // never cross the switch. A switch does not look at IP.
        within(sw, || {
            for t in ["arptables", "iptables", "ip6tables"] {
                let _ = std::fs::write(format!("/proc/sys/net/bridge/bridge-nf-call-{t}"), "0");
            }
        });
        ip(&["-n", sw, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", sw, "link", "set", "br0", "up"]);
        for (ns, port, addr, addr6, mac) in [
            (&net.peer, "to-peer", PEER_IP, PEER_IP6, PEER_MAC),
            (&net.old, "to-old", OLD_IP, OLD_IP6, OLD_MAC),
            (&net.new, "to-new", NEW_IP, NEW_IP6, NEW_MAC),
        ] {
            let mac = mac
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":");
            ip(&[
                "-n", sw, "link", "add", port, "type", "veth", "peer", "name", IFACE, "netns", ns,
            ]);
            ip(&["-n", sw, "link", "set", port, "master", "br0", "up"]);
            ip(&["-n", ns, "link", "set", IFACE, "address", &mac]);
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", IFACE]);
            if ipv6 {
                let a = format!("{addr6}/64");
                ip(&["-n", ns, "addr", "add", &a, "dev", IFACE, "nodad"]);
            }
            ip(&["-n", ns, "link", "set", IFACE, "up"]);
            within(sw, move || set_tx_checksum(port, false));
            if checksums == Checksums::Software {
                within(ns, || set_tx_checksum(IFACE, false));
            }
        }
        net
    }

    fn all(&self) -> [&String; 4] {
        [&self.switch, &self.peer, &self.old, &self.new]
    }

    fn peer<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        within(&self.peer, f)
    }

    fn old<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        within(&self.old, f)
    }

    fn new_node<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        within(&self.new, f)
    }

    /// The translator on the peer's cluster interface.
    fn attach(&self) -> Translator {
        self.peer(|| Translator::attach(IFACE).expect("attach"))
    }

    fn attach_pinned(&self, pins: &PinDir) -> Result<Translator, DataPlaneError> {
        let pins = pins.clone();
        self.peer(move || Translator::attach_pinned(IFACE, &pins))
    }

    /// IDs of the tcx programs on `cl0` of `ns`, egress and ingress.
    fn tcx_programs(ns: &str) -> (Vec<u32>, Vec<u32>) {
        within(ns, || {
            let ids = |direction| {
                let (_, progs) = SchedClassifier::query_tcx(IFACE, direction).expect("query_tcx");
                progs.iter().map(|p| p.id()).collect::<Vec<_>>()
            };
            (ids(TcAttachType::Egress), ids(TcAttachType::Ingress))
        })
    }

    /// A counter of /proc/net/snmp (e.g. "Udp", "InCsumErrors") in `ns`.
    fn snmp(ns: &str, proto: &'static str, field: &'static str) -> u64 {
        within(ns, move || {
            // thread-self: /proc/self/net is the namespace of the main
            // thread, not of this one.
            let text = std::fs::read_to_string("/proc/thread-self/net/snmp").expect("snmp");
            let prefix = format!("{proto}:");
            let mut lines = text.lines().filter(|l| l.starts_with(&prefix));
            let (names, values) = (lines.next().unwrap(), lines.next().unwrap());
            let i = names
                .split_whitespace()
                .position(|n| n == field)
                .unwrap_or_else(|| panic!("no {field} in {names}"));
            values.split_whitespace().nth(i).unwrap().parse().unwrap()
        })
    }

    /// Neither receiving stack found a bad TCP or UDP checksum.
    #[track_caller]
    fn assert_no_checksum_errors(&self) {
        for ns in [&self.peer, &self.new] {
            for proto in ["Tcp", "Udp"] {
                assert_eq!(Self::snmp(ns, proto, "InCsumErrors"), 0, "{proto} in {ns}");
            }
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.all() {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// A bpffs instance of the test's own, unmounted on drop: whatever a test
/// leaves pinned in it goes with it, also when the test fails.
struct Bpffs {
    path: PathBuf,
}

impl Bpffs {
    fn new() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let fs = Bpffs {
            path: std::env::temp_dir().join(format!(
                "ferry-xl-bpffs-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            )),
        };
        assert!(pin::mount_bpffs(&fs.path).expect("mount bpffs"));
        // A second call finds it mounted.
        assert!(!pin::mount_bpffs(&fs.path).expect("bpffs check"));
        fs
    }

    fn pins(&self, name: &str) -> PinDir {
        PinDir::new(self.path.join("ferry").join(name))
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// Polls `cond` until it holds, failing the test after `TIMEOUT`.
#[track_caller]
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A TCP connection from exactly `local` (the rule names the peer socket's
/// port) to `remote`, made in the calling thread's namespace.
fn connect_from(local: SocketAddrV4, remote: SocketAddrV4) -> std::io::Result<TcpStream> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, setsockopt, socket, sockopt,
    };
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    // connect() gives up after SO_SNDTIMEO instead of two minutes of SYNs.
    setsockopt(
        &fd,
        sockopt::SendTimeout,
        &nix::sys::time::TimeVal::new(TIMEOUT.as_secs() as _, 0),
    )?;
    bind(fd.as_raw_fd(), &SockaddrIn::from(local))?;
    connect(fd.as_raw_fd(), &SockaddrIn::from(remote))?;
    let stream = TcpStream::from(fd);
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    Ok(stream)
}

/// The next connection on `listener` (of the new node), with the tests'
/// timeouts; fails after `TIMEOUT`.
fn accept(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let (server, from) = loop {
        match listener.accept() {
            Ok(s) => break s,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                assert!(Instant::now() < deadline, "no connection on the new node");
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    server.set_nonblocking(false).unwrap();
    server.set_read_timeout(Some(TIMEOUT)).unwrap();
    server.set_write_timeout(Some(TIMEOUT)).unwrap();
    (server, from)
}

/// Connects through the translator: the peer dials the OLD address from
/// `rule.local`, the new node's listener answers.
fn connect_translated(
    net: &Net,
    listener: &TcpListener,
    rule: TranslationRule,
) -> (TcpStream, TcpStream) {
    let client = net
        .peer(move || connect_from(as_v4(rule.local), as_v4(rule.remote)))
        .expect("connect to the old address");
    let (server, from) = accept(listener);
    // Both ends see what they expect: the peer the old node, the process
    // the peer's socket.
    assert_eq!(client.peer_addr().unwrap(), rule.remote);
    assert_eq!(client.local_addr().unwrap(), rule.local);
    assert_eq!(from, rule.local);
    assert_eq!(
        server.local_addr().unwrap(),
        SocketAddr::V4(v4(remote_new(&rule), rule.remote.port()))
    );
    (client, server)
}

/// Bytes no two offsets of which repeat in a short period, so that a
/// lost, duplicated or reordered segment shows.
fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed).to_le_bytes()[1])
        .collect()
}

/// Sends `len` bytes from `from` to `to` and checks every one of them.
#[track_caller]
fn stream_check(from: &TcpStream, to: &mut TcpStream, seed: u32, len: usize) {
    let data = pattern(seed, len);
    let mut writer = from.try_clone().unwrap();
    let sent = data.clone();
    let w = std::thread::spawn(move || writer.write_all(&sent));
    let mut got = vec![0u8; len];
    to.read_exact(&mut got).expect("reading the stream");
    w.join().unwrap().expect("writing the stream");
    assert!(got == data, "stream corrupted");
}

/// Waits for a read on a connection the other side reset.
#[track_caller]
/// Sends `bytes` where only the old node can get them and expects the
/// old node's reset. The reset may already be there when the write is
/// made: the peer's last delayed ACK, sent after the translation stopped,
/// also went to the old node and drew it. Either way, a packet of the
/// peer's went untranslated.
fn send_expecting_reset(s: &mut TcpStream, bytes: &[u8], what: &str) {
    match s.write_all(bytes) {
        Ok(()) => assert_reset(s, what),
        Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {}
        Err(e) => panic!("{what}: expected a reset, got {e:?}"),
    }
}

fn assert_reset(s: &mut TcpStream, what: &str) {
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        other => panic!("{what}: expected a reset, got {other:?}"),
    }
}

fn tcp_rule(local_port: u16, port: u16) -> TranslationRule {
    TranslationRule::translate(
        Protocol::Tcp,
        v4(PEER_IP, local_port),
        v4(OLD_IP, port),
        NEW_IP,
    )
}

fn udp_rule(local_port: u16, port: u16) -> TranslationRule {
    TranslationRule {
        protocol: Protocol::Udp,
        ..tcp_rule(local_port, port)
    }
}

/// A translate rule's new address.
fn remote_new(rule: &TranslationRule) -> Ipv4Addr {
    match rule.action {
        RuleAction::Translate {
            remote_new: std::net::IpAddr::V4(remote_new),
        } => remote_new,
        RuleAction::Translate { remote_new } => panic!("{remote_new} is not IPv4"),
        RuleAction::Hold => panic!("{rule} is a hold rule"),
    }
}

fn tcp_connection_is_served_by_the_new_node(checksums: Checksums) {
    let net = Net::new(checksums);
    let mut xl = net.attach();
    let listener = net.new_node(|| TcpListener::bind(v4(NEW_IP, 5000)).unwrap());

    // Without a rule the old node answers, where nothing listens.
    let err = net
        .peer(|| connect_from(v4(PEER_IP, 40001), v4(OLD_IP, 5000)))
        .expect_err("nothing listens on the old node");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");

    let rule = tcp_rule(40000, 5000);
    xl.add(rule).unwrap();
    let (mut client, mut server) = connect_translated(&net, &listener, rule);
    // Megabytes each way: TSO/GSO super-packets on the way out, GRO'd
    // (non-linear) ones on the way in.
    stream_check(&client, &mut server, 1, 4 << 20);
    stream_check(&server, &mut client, 2, 4 << 20);
    // Both ways at once.
    let mut c2 = client.try_clone().unwrap();
    let s2 = server.try_clone().unwrap();
    let back = std::thread::spawn(move || stream_check(&s2, &mut c2, 3, 1 << 20));
    stream_check(&client, &mut server, 4, 1 << 20);
    back.join().unwrap();

    let c = xl.counters().unwrap();
    assert!(c.translated_egress > 0 && c.translated_ingress > 0, "{c:?}");
    assert_eq!((c.malformed, c.dropped), (0, 0), "{c:?}");
    // IPv4 forwarding is off on the peer (as on most nodes), where
    // bpf_fib_lookup() refuses to answer: every translated packet went out
    // through bpf_redirect_neigh(), which works at tc egress of a veth.
    assert_eq!(c.neigh_redirects, c.translated_egress, "{c:?}");
    let state = xl.state(&rule).unwrap().expect("rule state");
    assert!(
        state.packets_egress > 0 && state.packets_ingress > 0,
        "{state:?}"
    );
    assert!(state.idle().is_some(), "{state:?}");
    assert!(!state.closed(), "{state:?}");
    let rules = xl.rules().unwrap();
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0].0, rule);
    net.assert_no_checksum_errors();
}

/// A TCP connection from exactly `local` to `remote`, either family, made
/// in the calling thread's namespace.
fn connect_from_any(local: SocketAddr, remote: SocketAddr) -> std::io::Result<TcpStream> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrStorage, bind, connect, setsockopt, socket,
        sockopt,
    };
    let family = if local.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    bind(fd.as_raw_fd(), &SockaddrStorage::from(local))?;
    connect(fd.as_raw_fd(), &SockaddrStorage::from(remote))?;
    Ok(TcpStream::from(fd))
}

/// `Udp6InCsumErrors` of /proc/net/snmp6 in `ns`: IPv6's UDP checksum
/// failures (TCP's are counted in the shared `Tcp` table).
fn udp6_checksum_errors(ns: &str) -> u64 {
    within(ns, || {
        let text = std::fs::read_to_string("/proc/thread-self/net/snmp6").expect("snmp6");
        text.lines()
            .find_map(|l| l.strip_prefix("Udp6InCsumErrors"))
            .map(|v| v.trim().parse().unwrap())
            .expect("Udp6InCsumErrors")
    })
}

/// IPv6 on the cluster network: the peer's connection to the old node's
/// address, and its datagrams (a fragmented one among them), reach the
/// new node, whose answers reach the peer as if from the old one; every
/// byte checked, and no checksum failed at either receiving stack. A hold
/// rule drops its IPv6 flow.
fn ipv6_flows_are_served_by_the_new_node(checksums: Checksums) {
    require_root!();
    let net = Net::new6(checksums);
    let mut xl = net.attach();
    let at = |ip: Ipv6Addr, port| SocketAddr::from((ip, port));
    let (listener, server) = net.new_node(move || {
        (
            TcpListener::bind(at(NEW_IP6, 7000)).unwrap(),
            UdpSocket::bind(at(NEW_IP6, 7003)).unwrap(),
        )
    });
    let tcp = TranslationRule::translate(
        Protocol::Tcp,
        at(PEER_IP6, 41000),
        at(OLD_IP6, 7000),
        NEW_IP6,
    );
    let udp = TranslationRule::translate(
        Protocol::Udp,
        at(PEER_IP6, 41001),
        at(OLD_IP6, 7003),
        NEW_IP6,
    );
    xl.add(tcp).unwrap();
    xl.add(udp).unwrap();
    assert_eq!(xl.rules().unwrap().len(), 2);

    // TCP, both ways.
    let mut client = net
        .peer(move || connect_from_any(at(PEER_IP6, 41000), at(OLD_IP6, 7000)))
        .expect("connect to the old address");
    let (mut served, from) = listener.accept().unwrap();
    assert_eq!(from, at(PEER_IP6, 41000));
    assert_eq!(served.local_addr().unwrap(), at(NEW_IP6, 7000));
    assert_eq!(client.peer_addr().unwrap(), at(OLD_IP6, 7000));
    let data: Vec<u8> = (0..256 * 1024u32).map(|i| (i * 7 % 251) as u8).collect();
    let writer = {
        let mut c = client.try_clone().unwrap();
        let data = data.clone();
        std::thread::spawn(move || c.write_all(&data).unwrap())
    };
    let mut got = vec![0u8; data.len()];
    served.read_exact(&mut got).unwrap();
    writer.join().unwrap();
    assert!(got == data, "the peer's bytes reached the new node changed");
    served.write_all(&data).unwrap();
    client.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut back = vec![0u8; data.len()];
    client.read_exact(&mut back).unwrap();
    assert!(
        back == data,
        "the new node's bytes reached the peer changed"
    );

    // UDP, a fragmented datagram (3000 bytes over a 1500-byte MTU) and a
    // small one, both ways; the peer's socket, connected to the old
    // address, takes only what comes from there.
    let peer_udp = net.peer(move || {
        let s = UdpSocket::bind(at(PEER_IP6, 41001)).unwrap();
        s.connect(at(OLD_IP6, 7003)).unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        s
    });
    server.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut buf = vec![0u8; 4096];
    for len in [3000usize, 40] {
        let d: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        peer_udp.send(&d).unwrap();
        let (n, from) = server
            .recv_from(&mut buf)
            .expect("the datagram at the new node");
        assert_eq!((&buf[..n], from), (&d[..], at(PEER_IP6, 41001)));
        server.send_to(&d, from).unwrap();
        let n = peer_udp.recv(&mut buf).expect("the answer at the peer");
        assert_eq!(&buf[..n], &d[..]);
    }
    let state = xl.state(&udp).unwrap().expect("the UDP rule");
    assert!(
        state.packets_egress >= 2 && state.packets_ingress >= 2,
        "{state:?}"
    );
    let c = xl.counters().unwrap();
    assert!(c.translated_egress > 0 && c.translated_ingress > 0, "{c:?}");
    assert_eq!((c.dropped, c.malformed), (0, 0), "{c:?}");
    net.assert_no_checksum_errors();
    for ns in [&net.peer, &net.new] {
        assert_eq!(udp6_checksum_errors(ns), 0, "{ns}");
    }

    // A hold rule drops its flow: the datagram never reaches the node.
    let held = TranslationRule::hold(Protocol::Udp, at(PEER_IP6, 41002), at(NEW_IP6, 7003));
    xl.add(held).unwrap();
    let quiet = net.peer(move || {
        let s = UdpSocket::bind(at(PEER_IP6, 41002)).unwrap();
        s.send_to(b"held", at(NEW_IP6, 7003)).unwrap();
        s
    });
    server
        .set_read_timeout(Some(Duration::from_millis(400)))
        .unwrap();
    match server.recv_from(&mut buf) {
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
        other => panic!("a held datagram arrived: {other:?}"),
    }
    drop(quiet);
    assert!(xl.counters().unwrap().held >= 1);
    assert!(xl.remove(&held).unwrap());
    assert!(xl.remove(&tcp).unwrap() && xl.remove(&udp).unwrap());
    assert!(xl.rules().unwrap().is_empty());
}

#[test]
fn ipv6_flows_are_served_by_the_new_node_offloaded_checksums() {
    ipv6_flows_are_served_by_the_new_node(Checksums::Offloaded);
}

#[test]
fn ipv6_flows_are_served_by_the_new_node_software_checksums() {
    ipv6_flows_are_served_by_the_new_node(Checksums::Software);
}

#[test]
fn tcp_connection_is_served_by_the_new_node_offloaded_checksums() {
    require_root!();
    tcp_connection_is_served_by_the_new_node(Checksums::Offloaded);
}

#[test]
fn tcp_connection_is_served_by_the_new_node_software_checksums() {
    require_root!();
    tcp_connection_is_served_by_the_new_node(Checksums::Software);
}

/// IP_OPTIONS with `opts` (empty: none) on a socket.
fn set_ip_options(s: &UdpSocket, opts: &[u8]) {
    // SAFETY: the fd is the live socket `s`, and the option pointer and
    // length describe `opts`, which outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_OPTIONS,
            opts.as_ptr().cast(),
            opts.len() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "IP_OPTIONS: {}", std::io::Error::last_os_error());
}

/// SO_NO_CHECK: send UDP with checksum 0 ("none").
fn set_no_check(s: &UdpSocket) {
    let one: libc::c_int = 1;
    // SAFETY: the fd is the live socket `s`; the value is an int local.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NO_CHECK,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_NO_CHECK: {}", std::io::Error::last_os_error());
}

fn udp_datagrams_both_ways(checksums: Checksums) {
    let net = Net::new(checksums);
    let mut xl = net.attach();
    let server = net.new_node(|| UdpSocket::bind(v4(NEW_IP, 6000)).unwrap());
    let client = net.peer(|| UdpSocket::bind(v4(PEER_IP, 41000)).unwrap());
    // Connected: the peer's socket takes datagrams from the old address
    // only, so each reply it gets was translated.
    client.connect(v4(OLD_IP, 6000)).unwrap();
    for s in [&server, &client] {
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
    }
    let rule = udp_rule(41000, 6000);
    xl.add(rule).unwrap();
    // With forwarding on the device, bpf_fib_lookup() answers: once the
    // new node's MAC is known, the program writes it into the frame.
    net.peer(|| std::fs::write("/proc/sys/net/ipv4/conf/cl0/forwarding", "1").unwrap());

    let mut buf = vec![0u8; 65536];
    let mut exchange = |what: &str, len: usize| {
        let data = pattern(len as u32, len);
        client.send(&data).unwrap();
        let (n, from) = server.recv_from(&mut buf).expect(what);
        assert_eq!(from, rule.local, "{what}");
        assert!(buf[..n] == data[..], "{what}: datagram to the new node");
        let reply = pattern(!(len as u32), len);
        server.send_to(&reply, rule.local).unwrap();
        let (n, from) = client.recv_from(&mut buf).expect(what);
        assert_eq!(from, rule.remote, "{what}");
        assert!(buf[..n] == reply[..], "{what}: datagram from the new node");
    };
    exchange("small datagram", 100);
    let c = xl.counters().unwrap();
    // The first datagram found no neighbour for the new node and went
    // through bpf_redirect_neigh(), which resolved it; every later one
    // got its MACs from the FIB.
    assert_eq!(c.neigh_redirects, 1, "{c:?}");
    // 3000 bytes over a 1500-byte MTU: three fragments each way, the later
    // two without ports.
    exchange("fragmented datagram", 3000);
    // IP options (IHL 6): ports after them, the same checksum helpers at
    // another offset. NOPs are not copied into later fragments, so the
    // large datagram mixes IHL 6 and IHL 5 fragments.
    for s in [&server, &client] {
        set_ip_options(s, &[1, 1, 1, 1]);
    }
    exchange("datagram with IP options", 100);
    exchange("fragmented datagram with IP options", 3000);
    for s in [&server, &client] {
        set_ip_options(s, &[]);
        set_no_check(s);
    }
    // Checksum 0 means none and must stay 0: anything else is a wrong
    // checksum to the receiver.
    exchange("datagram without checksum", 100);

    let c = xl.counters().unwrap();
    // Per direction: 5 datagrams, two of them in 3 fragments.
    assert_eq!((c.translated_egress, c.translated_ingress), (9, 9), "{c:?}");
    assert_eq!(
        (c.malformed, c.dropped, c.neigh_redirects),
        (0, 0, 1),
        "{c:?}"
    );
    // The rule counts datagrams (fragments without ports are the
    // datagram's).
    let state = xl.state(&rule).unwrap().unwrap();
    assert_eq!((state.packets_egress, state.packets_ingress), (5, 5));
    assert_eq!(
        (
            state.fin_egress,
            state.fin_ingress,
            state.rst_egress,
            state.rst_ingress
        ),
        (0, 0, 0, 0)
    );
    assert!(!state.closed(), "UDP never closes: {state:?}");
    net.assert_no_checksum_errors();
}

#[test]
fn udp_datagrams_both_ways_with_fragments_options_and_no_checksum_offloaded_checksums() {
    require_root!();
    udp_datagrams_both_ways(Checksums::Offloaded);
}

#[test]
fn udp_datagrams_both_ways_with_fragments_options_and_no_checksum_software_checksums() {
    require_root!();
    udp_datagrams_both_ways(Checksums::Software);
}

#[test]
fn removing_the_rule_stops_translation() {
    require_root!();
    let net = Net::new(Checksums::Offloaded);
    let mut xl = net.attach();
    let listener = net.new_node(|| TcpListener::bind(v4(NEW_IP, 5000)).unwrap());
    let server_udp = net.new_node(|| UdpSocket::bind(v4(NEW_IP, 6000)).unwrap());
    let client_udp = net.peer(|| UdpSocket::bind(v4(PEER_IP, 41000)).unwrap());
    client_udp.connect(v4(OLD_IP, 6000)).unwrap();
    for s in [&server_udp, &client_udp] {
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
    }
    let tcp = tcp_rule(40000, 5000);
    let udp = udp_rule(41000, 6000);
    xl.add(tcp).unwrap();
    xl.add(udp).unwrap();
    // Adding again changes nothing.
    xl.add(tcp).unwrap();
    assert_eq!(
        xl.rules().unwrap().iter().map(|r| r.0).collect::<Vec<_>>(),
        [tcp, udp]
    );

    let (mut client, mut server) = connect_translated(&net, &listener, tcp);
    stream_check(&client, &mut server, 1, 1000);
    stream_check(&server, &mut client, 2, 1000);
    client_udp.send(b"before").unwrap();
    let mut buf = [0u8; 64];
    let n = server_udp.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"before");

    assert!(xl.remove(&tcp).unwrap());
    assert!(xl.remove(&udp).unwrap());
    assert!(!xl.remove(&tcp).unwrap(), "removed twice");
    assert!(xl.rules().unwrap().is_empty());

    // The peer's next segment goes to the old node, which knows no such
    // connection and resets it.
    send_expecting_reset(&mut client, b"after", "segment after the rule went");
    // The next datagram too: the old node has no socket and says so with
    // a port unreachable, which the connected socket reports.
    client_udp.send(b"after").unwrap();
    match client_udp.recv(&mut buf) {
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {}
        other => panic!("expected port unreachable from the old node, got {other:?}"),
    }
    // It went there, not to the new node.
    server_udp.set_nonblocking(true).unwrap();
    assert_eq!(
        server_udp.recv(&mut buf).unwrap_err().kind(),
        ErrorKind::WouldBlock
    );
    net.assert_no_checksum_errors();
}

#[test]
fn fin_and_rst_are_recorded_and_closed_rules_removed() {
    require_root!();
    let net = Net::new(Checksums::Offloaded);
    let mut xl = net.attach();
    let listener = net.new_node(|| TcpListener::bind(v4(NEW_IP, 5000)).unwrap());
    let rules: Vec<_> = (0..4).map(|i| tcp_rule(40010 + i, 5000)).collect();
    for r in &rules {
        xl.add(*r).unwrap();
    }
    let state = |xl: &Translator, r: &TranslationRule| xl.state(r).unwrap().unwrap();
    let linger0 = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    let mut buf = [0u8; 16];

    // Orderly close, the peer first. A FIN is counted before it is
    // delivered, so each end seeing EOF means the counter moved.
    let (mut c, mut s) = connect_translated(&net, &listener, rules[0]);
    c.shutdown(Shutdown::Write).unwrap();
    assert_eq!(s.read(&mut buf).unwrap(), 0);
    assert!(!state(&xl, &rules[0]).closed(), "half closed is open");
    s.shutdown(Shutdown::Write).unwrap();
    assert_eq!(c.read(&mut buf).unwrap(), 0);
    let st = state(&xl, &rules[0]);
    assert_eq!((st.fin_egress, st.fin_ingress), (1, 1), "{st:?}");
    assert!(st.closed(), "{st:?}");
    drop((c, s));

    // The process resets.
    let (mut c, s) = connect_translated(&net, &listener, rules[1]);
    nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::Linger, &linger0).unwrap();
    drop(s);
    assert_reset(&mut c, "reset by the process");
    let st = state(&xl, &rules[1]);
    assert!(
        st.rst_ingress >= 1 && st.rst_egress == 0 && st.closed(),
        "{st:?}"
    );

    // The peer resets.
    let (c, mut s) = connect_translated(&net, &listener, rules[2]);
    nix::sys::socket::setsockopt(&c, nix::sys::socket::sockopt::Linger, &linger0).unwrap();
    drop(c);
    assert_reset(&mut s, "reset by the peer");
    let st = state(&xl, &rules[2]);
    assert!(
        st.rst_egress >= 1 && st.rst_ingress == 0 && st.closed(),
        "{st:?}"
    );

    // Still open.
    let (open_c, mut open_s) = connect_translated(&net, &listener, rules[3]);
    stream_check(&open_c, &mut open_s, 5, 100);
    assert!(!state(&xl, &rules[3]).closed());

    // Just closed: within a minute's linger nothing goes.
    assert!(
        xl.remove_closed(Duration::from_secs(60))
            .unwrap()
            .is_empty()
    );
    assert_eq!(xl.rules().unwrap().len(), 4);
    let removed = xl.remove_closed(Duration::ZERO).unwrap();
    assert_eq!(removed, rules[..3]);
    let left: Vec<_> = xl.rules().unwrap().into_iter().map(|r| r.0).collect();
    assert_eq!(left, [rules[3]]);
    // The open connection is still translated.
    stream_check(&open_c, &mut open_s, 6, 100);
    stream_check(&open_s, &mut open_c.try_clone().unwrap(), 7, 100);
}

#[test]
fn conflicting_and_invalid_rules_are_refused() {
    require_root!();
    let net = Net::new(Checksums::Offloaded);
    let mut xl = net.attach();
    let rule = tcp_rule(40000, 5000);
    xl.add(rule).unwrap();
    // Another old address moved to the same new one, for the same local
    // socket and port: its answers would look the same.
    let other = TranslationRule {
        remote: v4(Ipv4Addr::new(198, 19, 7, 9), 5000).into(),
        ..rule
    };
    let err = xl.add(other).unwrap_err();
    assert!(matches!(err, DataPlaneError::RuleConflict { .. }), "{err}");
    let same = TranslationRule {
        action: RuleAction::Translate {
            remote_new: OLD_IP.into(),
        },
        ..rule
    };
    let err = xl.add(same).unwrap_err();
    assert!(matches!(err, DataPlaneError::InvalidRule { .. }), "{err}");

    // Moving the process again re-targets the rule: the old reverse entry
    // goes, the state stays.
    let moved = TranslationRule {
        action: RuleAction::Translate {
            remote_new: Ipv4Addr::new(198, 19, 7, 4).into(),
        },
        ..rule
    };
    xl.add(moved).unwrap();
    assert_eq!(xl.rules().unwrap().len(), 1);
    assert_eq!(xl.rules().unwrap()[0].0, moved);
    // Now the first conflict is gone (nothing answers from .2 any more).
    xl.add(other).unwrap();
    assert_eq!(xl.rules().unwrap().len(), 2);
}

#[test]
fn pinned_translator_survives_its_owner_and_unpin_removes_everything() {
    require_root!();
    let net = Net::new(Checksums::Offloaded);
    let fs = Bpffs::new();
    let pins = fs.pins("translate");
    let listener = net.new_node(|| TcpListener::bind(v4(NEW_IP, 5000)).unwrap());
    let rule = tcp_rule(40000, 5000);

    let mut xl = net.attach_pinned(&pins).expect("attach_pinned");
    assert_eq!(xl.pin_dir(), Some(pins.path()));
    xl.add(rule).unwrap();
    let (mut client, mut server) = connect_translated(&net, &listener, rule);
    stream_check(&client, &mut server, 1, 64 << 10);
    stream_check(&server, &mut client, 2, 64 << 10);
    let first = xl.state(&rule).unwrap().unwrap();
    drop(xl);

    // The agent is gone; the pins hold everything.
    for name in [
        "FERRY_XL_RULES",
        "FERRY_XL_REV",
        "FERRY_XL_FRAGS",
        "FERRY_XL_COUNT",
        "link-ferry_xlate_out",
        "link-ferry_xlate_in",
    ] {
        assert!(pins.path().join(name).exists(), "{name} pinned");
    }
    let (egress, ingress) = Net::tcx_programs(&net.peer);
    assert_eq!((egress.len(), ingress.len()), (1, 1), "still attached");
    stream_check(&client, &mut server, 3, 64 << 10);
    stream_check(&server, &mut client, 4, 64 << 10);

    // The agent restarts while the peer streams: the new programs go into
    // the links atomically. One segment to the old node would reset the
    // connection. The writer keeps going until the restart is done, in
    // numbered chunks, the last one flagged.
    let restarted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let w = std::thread::spawn({
        let mut writer = client.try_clone().unwrap();
        let restarted = restarted.clone();
        move || {
            let mut extra = 0;
            for i in 0u32.. {
                let last = extra == 32;
                let mut chunk = vec![u8::from(last)];
                chunk.extend_from_slice(&pattern(i, 16 << 10));
                writer.write_all(&chunk)?;
                if last {
                    return Ok::<_, std::io::Error>(i + 1);
                }
                if restarted.load(Ordering::Relaxed) {
                    extra += 1;
                }
                // Paced, so that the stream spans the restart without
                // taking both CPUs.
                std::thread::sleep(Duration::from_millis(1));
            }
            unreachable!()
        }
    });
    let reader = std::thread::spawn({
        let mut server = server.try_clone().unwrap();
        move || {
            let mut chunk = vec![0u8; 1 + (16 << 10)];
            for i in 0u32.. {
                server.read_exact(&mut chunk)?;
                assert!(
                    chunk[1..] == pattern(i, 16 << 10)[..],
                    "chunk {i} corrupted"
                );
                if chunk[0] == 1 {
                    return Ok::<_, std::io::Error>(i + 1);
                }
            }
            unreachable!()
        }
    });
    let xl = net.attach_pinned(&pins).expect("reopen");
    restarted.store(true, Ordering::Relaxed);
    let sent = w.join().unwrap().expect("streaming across the restart");
    let got = reader.join().unwrap().expect("reading across the restart");
    assert_eq!(sent, got);
    let (egress2, ingress2) = Net::tcx_programs(&net.peer);
    assert_eq!(
        (egress2.len(), ingress2.len()),
        (1, 1),
        "one program each way"
    );
    assert!(
        egress2 != egress && ingress2 != ingress,
        "this build's programs were swapped in"
    );
    // The rule and its state lived through it.
    let rules = xl.rules().unwrap();
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0].0, rule);
    assert!(
        rules[0].1.packets_egress > first.packets_egress,
        "{:?}",
        rules[0].1
    );
    assert!(xl.counters().unwrap().translated_egress >= first.packets_egress);
    stream_check(&server, &mut client, 6, 64 << 10);

    Translator::unpin(&pins).unwrap();
    assert!(!pins.path().exists());
    assert_eq!(Net::tcx_programs(&net.peer), (vec![], vec![]));
    // The open object's maps are still readable, but nothing translates:
    // the old node resets the connection.
    assert_eq!(xl.rules().unwrap().len(), 1);
    send_expecting_reset(&mut client, b"after unpin", "segment after unpin");
    // Unpinning twice is fine.
    Translator::unpin(&pins).unwrap();
}

#[test]
fn pins_of_another_layout_are_refused_and_stale_links_replaced() {
    require_root!();
    let net = Net::new(Checksums::Offloaded);
    let fs = Bpffs::new();
    let good = fs.pins("good");
    let xl = net.attach_pinned(&good).unwrap();

    // A map of another size where the rules should be, as an older build
    // with another layout would have left it.
    let bad = fs.pins("bad");
    bad.create().unwrap();
    aya::maps::MapData::from_pin(good.map_path("FERRY_XL_REV"))
        .unwrap()
        .pin(bad.map_path("FERRY_XL_RULES"))
        .unwrap();
    let err = net.attach_pinned(&bad).unwrap_err();
    assert!(
        matches!(err, DataPlaneError::Pin(PinError::Mismatch { .. })),
        "{err}"
    );
    // The refused attempt attached nothing.
    let (egress, ingress) = Net::tcx_programs(&net.peer);
    assert_eq!((egress.len(), ingress.len()), (1, 1));
    Translator::unpin(&bad).unwrap();

    // The counters of the build before hold rules, which had six: refused
    // (as its 4-byte fragment entries would be).
    let previous = fs.pins("previous");
    previous.create().unwrap();
    aya::maps::PerCpuArray::<aya::maps::MapData, u64>::create(6, 0)
        .unwrap()
        .pin(previous.map_path("FERRY_XL_COUNT"))
        .unwrap();
    let err = net.attach_pinned(&previous).unwrap_err();
    assert!(
        matches!(&err, DataPlaneError::Pin(PinError::Mismatch { found, .. }) if found.contains("max_entries 6")),
        "{err}"
    );
    assert_eq!(Net::tcx_programs(&net.peer), (egress, ingress));
    Translator::unpin(&previous).unwrap();
    drop(xl);

    // The same pins used for another interface (here the old node's cl0,
    // in another namespace): the links pinned for the peer's are not
    // attached there, so they are detached and replaced.
    let pins = good.clone();
    let moved = net
        .old(move || Translator::attach_pinned(IFACE, &pins))
        .unwrap();
    assert_eq!(Net::tcx_programs(&net.peer), (vec![], vec![]));
    let (egress, ingress) = Net::tcx_programs(&net.old);
    assert_eq!((egress.len(), ingress.len()), (1, 1));
    drop(moved);
    Translator::unpin(&good).unwrap();
    assert_eq!(Net::tcx_programs(&net.old), (vec![], vec![]));
}

// ---- Hold rules ------------------------------------------------------------
//
// On the new node of a migrating process (here `new`, A2), whose restored
// socket's peer is the `peer` node (A3): the translator runs on A2 and
// holds the exact flow A2:port <-> A3:port until the migration commits.

impl Net {
    /// The translator on the new node's cluster interface, where hold
    /// rules go.
    fn attach_new(&self) -> Translator {
        self.new_node(|| Translator::attach(IFACE).expect("attach on the new node"))
    }
}

/// `tcpi_state` of TCP_INFO (1: ESTABLISHED).
fn tcp_state(s: &TcpStream) -> u8 {
    // SAFETY: an all-zero tcp_info is valid for getsockopt to fill.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: TCP_INFO writes at most `len` bytes into `info`, a live
    // local, and the new length into `len`; the fd is the live socket `s`.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    assert_eq!(rc, 0, "TCP_INFO: {}", std::io::Error::last_os_error());
    info.tcpi_state
}

const TCP_ESTABLISHED: u8 = 1;

/// Nothing to read on a non-blocking socket.
#[track_caller]
fn assert_nothing<T: std::fmt::Debug>(r: std::io::Result<T>, what: &str) {
    match r {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("{what}: expected nothing, got {other:?}"),
    }
}

/// TCP segments with RST sent from namespace `ns` (/proc/net/snmp).
fn out_rsts(ns: &str) -> u64 {
    Net::snmp(ns, "Tcp", "OutRsts")
}

#[test]
fn hold_drops_a_tcp_flow_both_ways_without_rst_and_release_resumes_it() {
    require_root!();
    let net = Net::new(Checksums::Offloaded);
    let mut xl = net.attach_new();
    let listener = net.new_node(|| TcpListener::bind(v4(NEW_IP, 5000)).unwrap());
    let dial = |port: u16| {
        let client = net
            .peer(move || connect_from(v4(PEER_IP, port), v4(NEW_IP, 5000)))
            .expect("connect to the new node");
        let (server, from) = accept(&listener);
        assert_eq!(from, SocketAddr::V4(v4(PEER_IP, port)));
        (client, server)
    };
    let (mut client, mut server) = dial(40000);
    stream_check(&client, &mut server, 1, 64 << 10);
    stream_check(&server, &mut client, 2, 64 << 10);
    let rsts = (out_rsts(&net.peer), out_rsts(&net.new));

    let hold = TranslationRule::hold(Protocol::Tcp, v4(NEW_IP, 5000), v4(PEER_IP, 40000));
    xl.add(hold).unwrap();
    assert_eq!(
        hold.to_string(),
        "tcp 198.19.7.2:5000 <-> 198.19.7.3:40000 (held)"
    );
    let rules = xl.rules().unwrap();
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0], (hold, Default::default()));

    // Data both ways: the peer's is dropped at the new node's ingress (its
    // stack never sees it), the new node's at its egress (it never leaves).
    client.write_all(b"to-server").unwrap();
    server.write_all(b"to-client").unwrap();

    // Another flow between the same two addresses and the same listening
    // port, opened during the hold, passes both ways.
    let (mut c2, mut s2) = dial(40001);
    stream_check(&c2, &mut s2, 3, 256 << 10);
    stream_check(&s2, &mut c2, 4, 256 << 10);

    // Long enough for retransmissions both ways (the peer's RTO, the new
    // node's retries of a locally dropped segment every 500 ms): each is
    // dropped again.
    std::thread::sleep(Duration::from_millis(1200));
    let mut buf = [0u8; 16];
    for s in [&server, &client] {
        s.set_nonblocking(true).unwrap();
    }
    assert_nothing(
        server.read(&mut buf),
        "the peer's data reached the held socket",
    );
    assert_nothing(
        client.read(&mut buf),
        "the held socket's data reached the peer",
    );
    for s in [&server, &client] {
        s.set_nonblocking(false).unwrap();
        assert_eq!(tcp_state(s), TCP_ESTABLISHED);
    }
    assert_eq!(
        (out_rsts(&net.peer), out_rsts(&net.new)),
        rsts,
        "no RST on either side"
    );
    let before = xl.state(&hold).unwrap().expect("hold state");
    let c = xl.counters().unwrap();
    let after = xl.state(&hold).unwrap().unwrap();
    assert!(
        before.packets_egress >= 1 && before.packets_ingress >= 2,
        "the data and the peer's retransmissions: {before:?}"
    );
    assert_eq!(
        (
            before.fin_egress,
            before.fin_ingress,
            before.rst_egress,
            before.rst_ingress
        ),
        (0, 0, 0, 0)
    );
    assert!(before.idle().is_some() && !before.closed(), "{before:?}");
    let held = |s: &ferry_ebpf::RuleState| s.packets_egress + s.packets_ingress;
    assert!(
        held(&before) <= c.held && c.held <= held(&after),
        "the global count is the rule's: {c:?} {after:?}"
    );
    assert_eq!(
        (
            c.translated_egress,
            c.translated_ingress,
            c.dropped,
            c.malformed
        ),
        (0, 0, 0, 0),
        "{c:?}"
    );
    assert!(c.passed > 0, "the other flow: {c:?}");
    // Closed-connection cleanup never lifts a hold.
    assert!(xl.remove_closed(Duration::ZERO).unwrap().is_empty());

    // The migration commits: TCP's retransmissions deliver both ways.
    assert!(xl.remove(&hold).unwrap());
    assert!(xl.rules().unwrap().is_empty());
    assert_eq!(xl.state(&hold).unwrap(), None);
    let held_total = xl.counters().unwrap().held;
    let mut got = [0u8; 9];
    server
        .read_exact(&mut got)
        .expect("the peer's data, retransmitted after the hold");
    assert_eq!(&got, b"to-server");
    client
        .read_exact(&mut got)
        .expect("the held socket's data, retransmitted after the hold");
    assert_eq!(&got, b"to-client");
    stream_check(&client, &mut server, 5, 1 << 20);
    stream_check(&server, &mut client, 6, 1 << 20);
    stream_check(&c2, &mut s2, 7, 1000);
    assert_eq!((out_rsts(&net.peer), out_rsts(&net.new)), rsts);
    assert_eq!(
        xl.counters().unwrap().held,
        held_total,
        "nothing held after"
    );
    net.assert_no_checksum_errors();
}

#[test]
fn hold_rules_conflicting_with_other_rules_are_refused() {
    require_root!();
    let net = Net::new(Checksums::Offloaded);
    let mut xl = net.attach();
    let conflict = |xl: &mut Translator, r: TranslationRule| match xl.add(r) {
        Err(DataPlaneError::RuleConflict { rule, existing }) => {
            assert_eq!(rule, r.to_string());
            existing
        }
        other => panic!("{r}: expected a conflict, got {other:?}"),
    };
    let translate = tcp_rule(40000, 5000);
    xl.add(translate).unwrap();
    // A hold of the translated flow.
    let held_translated = TranslationRule::hold(Protocol::Tcp, translate.local, translate.remote);
    assert_eq!(conflict(&mut xl, held_translated), translate.to_string());
    // A hold of the flow as the translated answers arrive (from the new
    // address): both would claim them.
    let held_answers = TranslationRule::hold(Protocol::Tcp, translate.local, v4(NEW_IP, 5000));
    assert_eq!(conflict(&mut xl, held_answers), translate.to_string());

    let hold = TranslationRule::hold(Protocol::Tcp, v4(PEER_IP, 40001), v4(NEW_IP, 5001));
    xl.add(hold).unwrap();
    // Again: nothing changes.
    xl.add(hold).unwrap();
    // A translate rule for the held flow.
    let translate_held = TranslationRule::translate(Protocol::Tcp, hold.local, hold.remote, OLD_IP);
    assert_eq!(conflict(&mut xl, translate_held), hold.to_string());
    // One whose answers would come from the held remote.
    let into_held = TranslationRule::translate(Protocol::Tcp, hold.local, v4(OLD_IP, 5001), NEW_IP);
    assert_eq!(conflict(&mut xl, into_held), hold.to_string());
    // The same ports over UDP are another flow.
    let hold_udp = TranslationRule {
        protocol: Protocol::Udp,
        ..hold
    };
    xl.add(hold_udp).unwrap();
    for invalid in [
        TranslationRule::hold(Protocol::Tcp, v4(PEER_IP, 0), v4(NEW_IP, 5001)),
        TranslationRule::hold(Protocol::Tcp, v4(PEER_IP, 40001), v4(NEW_IP, 0)),
        TranslationRule::hold(
            Protocol::Udp,
            v4(PEER_IP, 40001),
            v4(Ipv4Addr::new(224, 0, 0, 9), 5001),
        ),
        TranslationRule::hold(
            Protocol::Udp,
            v4(Ipv4Addr::UNSPECIFIED, 40001),
            v4(NEW_IP, 5001),
        ),
    ] {
        let err = xl.add(invalid).unwrap_err();
        assert!(
            matches!(err, DataPlaneError::InvalidRule { .. }),
            "{invalid}: {err}"
        );
    }

    // The refusals changed nothing; both kinds are listed.
    let mut want = vec![translate, hold, hold_udp];
    want.sort();
    let rules = xl.rules().unwrap();
    assert_eq!(rules.iter().map(|r| r.0).collect::<Vec<_>>(), want);
    assert!(rules.iter().all(|(_, s)| *s == Default::default()));
    // A rule is found by its flow and its kind.
    assert_eq!(xl.state(&translate_held).unwrap(), None);
    assert!(!xl.remove(&translate_held).unwrap());
    assert!(!xl.remove(&held_translated).unwrap());
    assert!(xl.state(&hold).unwrap().is_some());

    // The migration is over: the flow may be translated now.
    assert!(xl.remove(&hold).unwrap());
    assert!(!xl.remove(&hold).unwrap(), "removed twice");
    xl.add(translate_held).unwrap();
    // And the translated one held, once its rule is gone.
    assert!(xl.remove(&translate).unwrap());
    xl.add(held_translated).unwrap();
    let mut want = vec![held_translated, translate_held, hold_udp];
    want.sort();
    assert_eq!(
        xl.rules().unwrap().iter().map(|r| r.0).collect::<Vec<_>>(),
        want
    );
}

#[test]
fn hold_drops_udp_datagrams_both_ways_with_their_fragments() {
    require_root!();
    let net = Net::new(Checksums::Software);
    let mut xl = net.attach_new();
    let server = net.new_node(|| UdpSocket::bind(v4(NEW_IP, 6000)).unwrap());
    let client = net.peer(|| UdpSocket::bind(v4(PEER_IP, 41000)).unwrap());
    // Another flow between the same addresses, to the same server port.
    let other = net.peer(|| UdpSocket::bind(v4(PEER_IP, 41001)).unwrap());
    client.connect(v4(NEW_IP, 6000)).unwrap();
    other.connect(v4(NEW_IP, 6000)).unwrap();
    for s in [&server, &client, &other] {
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
    }
    let mut buf = vec![0u8; 65536];
    let small = pattern(1, 100);
    let big = pattern(2, 3000); // three fragments on a 1500-byte MTU
    #[track_caller]
    fn recv_from(s: &UdpSocket, buf: &mut [u8], want: &[u8], from: SocketAddrV4, what: &str) {
        let (n, f) = s.recv_from(buf).expect(what);
        assert_eq!(f, SocketAddr::V4(from), "{what}");
        assert!(buf[..n] == *want, "{what}");
    }
    let exchange = |buf: &mut Vec<u8>, what: &str| {
        for data in [&small, &big] {
            client.send(data).unwrap();
            recv_from(&server, buf, data, v4(PEER_IP, 41000), what);
            server.send_to(data, v4(PEER_IP, 41000)).unwrap();
            recv_from(&client, buf, data, v4(NEW_IP, 6000), what);
        }
    };
    exchange(&mut buf, "before the hold");

    let hold = TranslationRule::hold(Protocol::Udp, v4(NEW_IP, 6000), v4(PEER_IP, 41000));
    xl.add(hold).unwrap();
    // In: a datagram and a fragmented one, every fragment dropped at
    // ingress (the later ones follow the first).
    client.send(&small).unwrap();
    client.send(&big).unwrap();
    // Out: the same; the kernel may not even try the later fragments once
    // the first one is dropped.
    server.send_to(&small, v4(PEER_IP, 41000)).unwrap();
    server.send_to(&big, v4(PEER_IP, 41000)).unwrap();
    // The other flow passes both ways, and is what the sockets get first:
    // nothing of the held flow came before it.
    other.send(b"other").unwrap();
    recv_from(
        &server,
        &mut buf,
        b"other",
        v4(PEER_IP, 41001),
        "other flow in",
    );
    server.send_to(b"other back", v4(PEER_IP, 41001)).unwrap();
    recv_from(
        &other,
        &mut buf,
        b"other back",
        v4(NEW_IP, 6000),
        "other flow out",
    );
    wait_for("the held datagrams", || {
        let s = xl.state(&hold).unwrap().unwrap();
        (s.packets_egress, s.packets_ingress) == (2, 2)
    });
    let c = xl.counters().unwrap();
    // Per rule datagrams; globally fragments too: 1 + 3 in, 1 + 1..=3 out.
    assert!((6..=8).contains(&c.held), "{c:?}");
    assert_eq!(
        (c.translated_egress, c.translated_ingress, c.dropped),
        (0, 0, 0),
        "{c:?}"
    );
    for s in [&server, &client] {
        s.set_nonblocking(true).unwrap();
    }
    assert_nothing(server.recv_from(&mut buf), "held datagram delivered in");
    assert_nothing(client.recv_from(&mut buf), "held datagram delivered out");

    // Out, a fragmented datagram sent fragment by fragment (the stack's
    // own stops at the first drop): the later fragments follow the first.
    let send_new = net.new_node(|| packet_socket(false));
    let whole = udp(v4(NEW_IP, 6000), v4(PEER_IP, 41000), &big);
    for (off, part) in [
        (0x2000u16, &whole[..1480]),
        (0x2000 | 185, &whole[1480..2960]),
        (370, &whole[2960..]),
    ] {
        let ip = ipv4(
            NEW_IP,
            PEER_IP,
            libc::IPPROTO_UDP as u8,
            &[],
            off,
            0x4242,
            part,
        );
        // The drop at tc egress is reported to the sender.
        let err = try_inject(&send_new, &frame(PEER_MAC, NEW_MAC, &ip)).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOBUFS), "{err}");
    }
    wait_for("the injected fragments held", || {
        xl.counters().unwrap().held == c.held + 3
    });
    assert_eq!(xl.state(&hold).unwrap().unwrap().packets_egress, 3);
    std::thread::sleep(Duration::from_millis(200));
    assert_nothing(
        client.recv_from(&mut buf),
        "injected datagram delivered out",
    );
    // No held fragment reached either stack: each got the three of the
    // fragmented datagram before the hold, no more.
    for ns in [&net.peer, &net.new] {
        assert_eq!(Net::snmp(ns, "Ip", "ReasmReqds"), 3, "fragments in {ns}");
    }
    assert_eq!(
        Net::snmp(&net.peer, "Udp", "InDatagrams"),
        3,
        "before the hold, and the other flow"
    );

    // Released: datagrams pass again (UDP retransmits nothing).
    assert!(xl.remove(&hold).unwrap());
    for s in [&server, &client] {
        s.set_nonblocking(false).unwrap();
    }
    exchange(&mut buf, "after the hold");
    assert_eq!(xl.counters().unwrap().held, c.held + 3);
    net.assert_no_checksum_errors();
}

// ---- Hand-made frames ----------------------------------------------------

fn sum16(data: &[u8]) -> u32 {
    data.chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)])))
        .sum()
}

fn fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv4 packet: header (with `options`) and `payload`.
fn ipv4(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    options: &[u8],
    frag_off: u16,
    id: u16,
    payload: &[u8],
) -> Vec<u8> {
    let hlen = 20 + options.len();
    assert_eq!(hlen % 4, 0);
    let mut p = vec![0x40 | (hlen / 4) as u8, 0];
    p.extend_from_slice(&((hlen + payload.len()) as u16).to_be_bytes());
    p.extend_from_slice(&id.to_be_bytes());
    p.extend_from_slice(&frag_off.to_be_bytes());
    p.extend_from_slice(&[64, proto, 0, 0]);
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.extend_from_slice(options);
    let csum = fold(sum16(&p));
    p[10..12].copy_from_slice(&csum.to_be_bytes());
    p.extend_from_slice(payload);
    p
}

/// A UDP datagram (header and data) with its checksum.
fn udp(src: SocketAddrV4, dst: SocketAddrV4, data: &[u8]) -> Vec<u8> {
    let len = (8 + data.len()) as u16;
    let mut d = Vec::new();
    d.extend_from_slice(&src.port().to_be_bytes());
    d.extend_from_slice(&dst.port().to_be_bytes());
    d.extend_from_slice(&len.to_be_bytes());
    d.extend_from_slice(&[0, 0]);
    d.extend_from_slice(data);
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&src.ip().octets());
    pseudo.extend_from_slice(&dst.ip().octets());
    pseudo.extend_from_slice(&[0, libc::IPPROTO_UDP as u8]);
    pseudo.extend_from_slice(&len.to_be_bytes());
    let csum = match fold(sum16(&pseudo) + sum16(&d)) {
        0 => 0xffff,
        c => c,
    };
    d[6..8].copy_from_slice(&csum.to_be_bytes());
    d
}

fn frame(dst: [u8; 6], src: [u8; 6], ip: &[u8]) -> Vec<u8> {
    let mut f = dst.to_vec();
    f.extend_from_slice(&src);
    f.extend_from_slice(&[0x08, 0x00]);
    f.extend_from_slice(ip);
    f
}

/// An AF_PACKET socket on `cl0` of the calling thread's namespace:
/// `capture` receives every frame, otherwise it only sends.
fn packet_socket(capture: bool) -> (OwnedFd, i32) {
    let proto = if capture {
        (libc::ETH_P_ALL as u16).to_be()
    } else {
        0
    };
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto)) };
    assert!(fd >= 0, "AF_PACKET: {}", std::io::Error::last_os_error());
    // SAFETY: fd is a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let name = std::ffi::CString::new(IFACE).unwrap();
    // SAFETY: `name` is a NUL-terminated string alive for the call.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) } as i32;
    assert!(ifindex > 0);
    if capture {
        // SAFETY: an all-zero sockaddr_ll is valid; the fields that
        // matter are set below.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = ifindex;
        // SAFETY: binds the live socket to a sockaddr_ll local whose size
        // is passed.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(rc, 0, "bind AF_PACKET: {}", std::io::Error::last_os_error());
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        // SAFETY: SO_RCVTIMEO reads a timeval, a live local.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        assert_eq!(rc, 0);
    }
    (fd, ifindex)
}

/// Sends `frame` out of the interface of the sending socket `(fd, ifindex)`
/// as an IPv4 frame (skb->protocol ETH_P_IP, as the stack's own): through
/// tc egress like any packet the node sends.
fn inject(sock: &(OwnedFd, i32), frame: &[u8]) {
    try_inject(sock, frame).expect("inject");
}

/// [`inject`], returning the error: a frame dropped at tc egress fails
/// with ENOBUFS (NET_XMIT_DROP).
fn try_inject(sock: &(OwnedFd, i32), frame: &[u8]) -> std::io::Result<()> {
    // SAFETY: an all-zero sockaddr_ll is valid; the fields that matter are
    // set below.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = (libc::ETH_P_IP as u16).to_be();
    sll.sll_ifindex = sock.1;
    sll.sll_halen = 6;
    sll.sll_addr[..6].copy_from_slice(&frame[..6]);
    // SAFETY: sends `frame` (pointer and length of a live slice) to the
    // address in `sll`, a live local whose size is passed.
    let rc = unsafe {
        libc::sendto(
            sock.0.as_raw_fd(),
            frame.as_ptr().cast(),
            frame.len(),
            0,
            (&sll as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    assert_eq!(rc, frame.len() as isize, "inject: sent in part");
    Ok(())
}

/// Receives frames on the capture socket until one equals `want`; fails
/// after `TIMEOUT`. Frames the node sent itself are skipped.
#[track_caller]
fn expect_frame(sock: &(OwnedFd, i32), want: &[u8], what: &str) {
    let deadline = Instant::now() + TIMEOUT;
    let mut buf = vec![0u8; 65536];
    let mut seen = 0;
    while Instant::now() < deadline {
        // SAFETY: an all-zero sockaddr_ll is valid for recvfrom to fill.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
        // SAFETY: receives into `buf` (pointer and length of a live
        // buffer) and the address into `sll`, whose size `len` holds.
        let n = unsafe {
            libc::recvfrom(
                sock.0.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
                (&mut sll as *mut libc::sockaddr_ll).cast(),
                &mut len,
            )
        };
        if n < 0 {
            continue; // the 100 ms receive timeout
        }
        if sll.sll_pkttype == libc::PACKET_OUTGOING {
            continue;
        }
        seen += 1;
        if &buf[..n as usize] == want {
            return;
        }
    }
    panic!("{what}: the expected frame did not arrive ({seen} others did)");
}

/// Malformed headers, one of each kind, for the flow `src` -> `dst`.
fn malformed(src: SocketAddrV4, dst: SocketAddrV4) -> Vec<(&'static str, Vec<u8>)> {
    let good = ipv4(
        *src.ip(),
        *dst.ip(),
        libc::IPPROTO_UDP as u8,
        &[],
        0,
        1,
        &udp(src, dst, b"malformed"),
    );
    let mut out = vec![("IPv4 header cut at 10 bytes", good[..10].to_vec())];
    let mut p = good.clone();
    p[0] = 0x44;
    out.push(("IHL below 5", p));
    let mut p = good.clone();
    p[0] = 0x4f;
    out.push(("IHL beyond the packet", p));
    let mut p = good.clone();
    let long = (good.len() + 100) as u16;
    p[2..4].copy_from_slice(&long.to_be_bytes());
    out.push(("total length beyond the packet", p));
    let mut p = good.clone();
    p[0] = 0x65;
    out.push(("version 6 in an IPv4 frame", p));
    // Only the ports of the transport header: its checksum field is not
    // in the packet.
    let mut ports = src.port().to_be_bytes().to_vec();
    ports.extend_from_slice(&dst.port().to_be_bytes());
    out.push((
        "UDP header cut short",
        ipv4(
            *src.ip(),
            *dst.ip(),
            libc::IPPROTO_UDP as u8,
            &[],
            0,
            2,
            &ports,
        ),
    ));
    let mut tcp8 = ports.clone();
    tcp8.extend_from_slice(&[0, 0, 0, 1]);
    out.push((
        "TCP header cut short",
        ipv4(
            *src.ip(),
            *dst.ip(),
            libc::IPPROTO_TCP as u8,
            &[],
            0,
            3,
            &tcp8,
        ),
    ));
    out
}

#[test]
fn hand_made_packets_malformed_pass_untouched_valid_ones_are_exact() {
    require_root!();
    let net = Net::new(Checksums::Software);
    let mut xl = net.attach();
    let local = v4(PEER_IP, 41000);
    let old = v4(OLD_IP, 6000);
    let new = v4(NEW_IP, 6000);
    xl.add(udp_rule(41000, 6000)).unwrap();
    xl.add(tcp_rule(41000, 6000)).unwrap();
    let server = net.new_node(|| UdpSocket::bind(v4(NEW_IP, 6000)).unwrap());
    server.set_read_timeout(Some(TIMEOUT)).unwrap();
    let send_peer = net.peer(|| packet_socket(false));
    let send_new = net.new_node(|| packet_socket(false));
    let cap_old = net.old(|| packet_socket(true));
    let cap_new = net.new_node(|| packet_socket(true));
    let mut buf = vec![0u8; 65536];

    // Egress, malformed: each reaches the old node exactly as sent.
    let bad = malformed(local, old);
    for (what, ip) in &bad {
        let f = frame(OLD_MAC, PEER_MAC, ip);
        inject(&send_peer, &f);
        expect_frame(&cap_old, &f, what);
    }
    let c = xl.counters().unwrap();
    assert_eq!(c.malformed, bad.len() as u64, "{c:?}");
    assert_eq!(c.translated_egress, 0, "{c:?}");
    // A later fragment whose first one was never seen: no ports, no
    // entry, untouched.
    let stray = ipv4(
        PEER_IP,
        OLD_IP,
        libc::IPPROTO_UDP as u8,
        &[],
        185,
        0x1234,
        &[7; 64],
    );
    let f = frame(OLD_MAC, PEER_MAC, &stray);
    inject(&send_peer, &f);
    expect_frame(&cap_old, &f, "stray later fragment");

    // Egress, valid, with IP options: the new node gets exactly the packet
    // built for it (addresses, both checksums, MACs), and accepts it.
    let opts = [1u8, 1, 1, 1];
    let sent = ipv4(
        PEER_IP,
        OLD_IP,
        libc::IPPROTO_UDP as u8,
        &opts,
        0,
        10,
        &udp(local, old, b"options"),
    );
    let want = ipv4(
        PEER_IP,
        NEW_IP,
        libc::IPPROTO_UDP as u8,
        &opts,
        0,
        10,
        &udp(local, new, b"options"),
    );
    inject(&send_peer, &frame(OLD_MAC, PEER_MAC, &sent));
    expect_frame(
        &cap_new,
        &frame(NEW_MAC, PEER_MAC, &want),
        "translated with options",
    );
    let n = server.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"options");

    // Checksum 0 stays 0.
    let mut nocheck = udp(local, old, b"nocheck");
    nocheck[6..8].copy_from_slice(&[0, 0]);
    let mut nocheck_new = udp(local, new, b"nocheck");
    nocheck_new[6..8].copy_from_slice(&[0, 0]);
    let udp_proto = libc::IPPROTO_UDP as u8;
    inject(
        &send_peer,
        &frame(
            OLD_MAC,
            PEER_MAC,
            &ipv4(PEER_IP, OLD_IP, udp_proto, &[], 0, 11, &nocheck),
        ),
    );
    expect_frame(
        &cap_new,
        &frame(
            NEW_MAC,
            PEER_MAC,
            &ipv4(PEER_IP, NEW_IP, udp_proto, &[], 0, 11, &nocheck_new),
        ),
        "no checksum",
    );
    let n = server.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"nocheck");

    // A wrong checksum stays wrong (an incremental update, not a
    // recomputation), and the new node's stack rejects it: the receivers
    // in these tests do check.
    let errors = Net::snmp(&net.new, "Udp", "InCsumErrors");
    let mut corrupt = udp(local, old, b"corrupt");
    corrupt[6] ^= 0x10;
    inject(
        &send_peer,
        &frame(
            OLD_MAC,
            PEER_MAC,
            &ipv4(PEER_IP, OLD_IP, udp_proto, &[], 0, 12, &corrupt),
        ),
    );
    wait_for("the corrupt datagram to be rejected", || {
        Net::snmp(&net.new, "Udp", "InCsumErrors") == errors + 1
    });

    // A fragmented datagram: the first fragment (with the UDP header and
    // the checksum over all of it) and the second, translated alike.
    let data = pattern(9, 2000);
    let whole = udp(local, old, &data);
    let whole_new = udp(local, new, &data);
    for (i, (part, part_new, off)) in [
        (&whole[..1480], &whole_new[..1480], 0x2000u16),
        (&whole[1480..], &whole_new[1480..], 185),
    ]
    .into_iter()
    .enumerate()
    {
        let sent = ipv4(PEER_IP, OLD_IP, udp_proto, &[], off, 13, part);
        let want = ipv4(PEER_IP, NEW_IP, udp_proto, &[], off, 13, part_new);
        inject(&send_peer, &frame(OLD_MAC, PEER_MAC, &sent));
        expect_frame(
            &cap_new,
            &frame(NEW_MAC, PEER_MAC, &want),
            &format!("fragment {i}"),
        );
    }
    let n = server.recv(&mut buf).unwrap();
    assert!(buf[..n] == data[..], "reassembled on the new node");
    let c = xl.counters().unwrap();
    // options, nocheck, corrupt, two fragments.
    assert_eq!(c.translated_egress, 5, "{c:?}");
    assert_eq!((c.malformed, c.dropped), (bad.len() as u64, 0), "{c:?}");

    // Ingress: malformed packets from the new node pass (and the peer's
    // stack drops them); valid ones reach the peer's socket as if from the
    // old node.
    let client = net.peer(|| UdpSocket::bind(v4(PEER_IP, 41000)).unwrap());
    client.connect(old).unwrap();
    client.set_read_timeout(Some(TIMEOUT)).unwrap();
    for (_, ip) in malformed(new, local) {
        inject(&send_new, &frame(PEER_MAC, NEW_MAC, &ip));
    }
    wait_for("the malformed packets at the peer's ingress", || {
        xl.counters().unwrap().malformed == 2 * bad.len() as u64
    });
    let reply = ipv4(
        NEW_IP,
        PEER_IP,
        udp_proto,
        &opts,
        0,
        20,
        &udp(new, local, b"reply with options"),
    );
    inject(&send_new, &frame(PEER_MAC, NEW_MAC, &reply));
    let (n, from) = client.recv_from(&mut buf).unwrap();
    assert_eq!(
        (&buf[..n], from),
        (&b"reply with options"[..], SocketAddr::V4(old))
    );
    let whole = udp(new, local, &data);
    inject(
        &send_new,
        &frame(
            PEER_MAC,
            NEW_MAC,
            &ipv4(NEW_IP, PEER_IP, udp_proto, &[], 0x2000, 21, &whole[..1480]),
        ),
    );
    inject(
        &send_new,
        &frame(
            PEER_MAC,
            NEW_MAC,
            &ipv4(NEW_IP, PEER_IP, udp_proto, &[], 185, 21, &whole[1480..]),
        ),
    );
    let n = client.recv(&mut buf).unwrap();
    assert!(buf[..n] == data[..], "reassembled on the peer");
    let c = xl.counters().unwrap();
    assert_eq!(c.translated_ingress, 3, "{c:?}");
    assert_eq!(c.dropped, 0, "{c:?}");
    assert_eq!(Net::snmp(&net.peer, "Udp", "InCsumErrors"), 0);
}

#[test]
fn pin_dir_outside_bpffs_is_refused() {
    require_root!();
    let dir = std::env::temp_dir().join(format!("ferry-xl-notbpf-{}", std::process::id()));
    let pins = PinDir::new(&dir);
    let err = pins.create().unwrap_err();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(matches!(err, PinError::NotBpffs { .. }), "{err}");
    assert_eq!(
        PinDir::ferry("translate").path(),
        Path::new("/sys/fs/bpf/ferry/translate")
    );
}
