//! The ownership filter in the real kernel. Each test builds a client
//! namespace (198.18.1.1) and a node namespace (198.18.1.100) joined by a
//! veth; the client sends every frame for the node to the broadcast MAC, as
//! the cluster's router does. Needs root; skipped with a reason otherwise.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use aya::programs::{SchedClassifier, TcAttachType};
use ferry_ebpf::{CaptureKind, OwnershipFilter, PortState, Protocol, Replayer};

const NODE_IP: &str = "198.18.1.100";
const NODE_IFACE: &str = "pub0";

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Skips the test (aya-style: a printed reason, not a failure) unless root.
macro_rules! require_root {
    () => {
        if !is_root() {
            eprintln!("skipped: needs root (network namespaces, eBPF)");
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

/// A client and a node namespace, deleted on drop, also when the test
/// panics.
struct Net {
    client: String,
    node: String,
}

impl Net {
    fn new() -> Self {
        // Unique per process and test: the tests run in parallel.
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let id = format!(
            "fe-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let net = Net {
            client: format!("{id}c"),
            node: format!("{id}n"),
        };
        // The guard exists before the first namespace, so a failure below
        // still removes whatever was created.
        ip(&["netns", "add", &net.client]);
        ip(&["netns", "add", &net.node]);
        ip(&[
            "-n",
            &net.client,
            "link",
            "add",
            "eth0",
            "type",
            "veth",
            "peer",
            "name",
            NODE_IFACE,
            "netns",
            &net.node,
        ]);
        for (ns, dev, addr) in [
            (&net.client, "eth0", "198.18.1.1/24"),
            (&net.node, NODE_IFACE, "198.18.1.100/24"),
        ] {
            ip(&["-n", ns, "addr", "add", addr, "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        // As in the cluster: every frame for the node's address is a
        // broadcast frame, so it arrives as PACKET_BROADCAST.
        ip(&[
            "-n",
            &net.client,
            "neigh",
            "replace",
            NODE_IP,
            "lladdr",
            "ff:ff:ff:ff:ff:ff",
            "dev",
            "eth0",
            "nud",
            "permanent",
        ]);
        net
    }

    /// Runs `f` on a thread that joined namespace `ns` (network only).
    /// Sockets and netlink handles it creates stay bound to that namespace
    /// wherever they are used later.
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

    fn client<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        Self::within(&self.client, f)
    }

    fn node<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        Self::within(&self.node, f)
    }

    /// The filter on the node's public interface.
    fn attach(&self) -> OwnershipFilter {
        self.node(|| OwnershipFilter::attach(NODE_IFACE).expect("attach"))
    }

    /// Names of the tcx programs on the node's interface in one direction.
    fn tcx_programs(&self, direction: TcAttachType) -> Vec<String> {
        self.node(move || {
            let (_, progs) = SchedClassifier::query_tcx(NODE_IFACE, direction).expect("query_tcx");
            progs
                .iter()
                .map(|p| p.name_as_str().unwrap_or("?").to_owned())
                .collect()
        })
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in [&self.client, &self.node] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn addr(port: u16) -> SocketAddr {
    format!("{NODE_IP}:{port}").parse().unwrap()
}

/// Asserts that a read saw nothing: a timeout, not data and not a reset.
#[track_caller]
fn assert_silent(r: std::io::Result<usize>, what: &str) {
    match r {
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
        other => panic!("{what}: expected silence, got {other:?}"),
    }
}

#[test]
fn tcp_owned_port_connects_and_other_port_stays_silent() {
    require_root!();
    let net = Net::new();
    let mut filter = net.attach();
    let (_owned, _other) = net.node(|| {
        (
            TcpListener::bind("0.0.0.0:7001").unwrap(),
            TcpListener::bind("0.0.0.0:7002").unwrap(),
        )
    });
    filter.set(Protocol::Tcp, 7001, PortState::Owned).unwrap();
    assert_eq!(
        filter.ports().unwrap(),
        vec![(Protocol::Tcp, 7001, PortState::Owned)]
    );

    let (owned, other) = net.client(|| {
        (
            TcpStream::connect_timeout(&addr(7001), Duration::from_secs(3)),
            // Long enough for a retransmitted SYN (1 s) to be dropped too.
            TcpStream::connect_timeout(&addr(7002), Duration::from_millis(1500)),
        )
    });
    owned.expect("connect to the owned port");
    // Another node owns 7002: even with a listener here, silence, never
    // "connection refused" (an RST from a non-owner).
    let err = other.expect_err("a non-owned port must not answer");
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
    let c = filter.counters().unwrap();
    assert!(c.passed >= 3, "handshake passed: {c:?}");
    assert!(c.dropped_not_owned >= 2, "both SYNs dropped: {c:?}");
}

#[test]
fn udp_owned_port_receives_with_options_and_fragments_other_port_does_not() {
    require_root!();
    let net = Net::new();
    let mut filter = net.attach();
    let (owned, other) = net.node(|| {
        let owned = UdpSocket::bind("0.0.0.0:7003").unwrap();
        let other = UdpSocket::bind("0.0.0.0:7004").unwrap();
        owned
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        other
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        (owned, other)
    });
    filter.set(Protocol::Udp, 7003, PortState::Owned).unwrap();
    let client = net.client(|| UdpSocket::bind("0.0.0.0:0").unwrap());
    let mut buf = [0u8; 4096];

    client.send_to(b"owned", addr(7003)).unwrap();
    let n = owned.recv(&mut buf).expect("datagram to the owned port");
    assert_eq!(&buf[..n], b"owned");
    // UDP ignores pkt_type: only the filter keeps this one out.
    client.send_to(b"other", addr(7004)).unwrap();
    assert_silent(other.recv(&mut buf), "datagram to a non-owned port");
    let c = filter.counters().unwrap();
    assert!(c.passed >= 1 && c.dropped_not_owned >= 1, "{c:?}");

    // 3000 bytes over a 1500-byte MTU: the client fragments. Fragment zero
    // decides, the later one passes and is reassembled only by the owner.
    let big = vec![7u8; 3000];
    client.send_to(&big, addr(7003)).unwrap();
    let n = owned.recv(&mut buf).expect("fragmented datagram");
    assert_eq!(&buf[..n], &big[..]);
    client.send_to(&big, addr(7004)).unwrap();
    assert_silent(
        other.recv(&mut buf),
        "fragmented datagram to a non-owned port",
    );
    assert!(filter.counters().unwrap().passed_other >= 2);

    // IP options (IHL 6): the ports are found after them, not at byte 20.
    // Four NOPs are a valid option block.
    let nops = [1u8; 4];
    // SAFETY: the fd is the live socket `client`, and the option pointer
    // and length describe `nops`, which outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            client.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_OPTIONS,
            nops.as_ptr().cast(),
            nops.len() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "IP_OPTIONS: {}", std::io::Error::last_os_error());
    client.send_to(b"options", addr(7003)).unwrap();
    let n = owned.recv(&mut buf).expect("datagram with IP options");
    assert_eq!(&buf[..n], b"options");
    client.send_to(b"options", addr(7004)).unwrap();
    assert_silent(
        other.recv(&mut buf),
        "datagram with options to a non-owned port",
    );

    filter.remove(Protocol::Udp, 7003).unwrap();
    assert!(filter.ports().unwrap().is_empty());
    client.send_to(b"late", addr(7003)).unwrap();
    owned
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    assert_silent(owned.recv(&mut buf), "datagram to a disowned port");
}

#[test]
fn icmp_passes_untouched() {
    require_root!();
    let net = Net::new();
    let filter = net.attach();
    // An echo request over a raw socket: the node's stack answers; the
    // filter neither drops it nor makes it PACKET_HOST.
    let reply = net.client(|| {
        use nix::sys::socket::{AddressFamily, SockFlag, SockProtocol, SockType, socket};
        let fd = socket(
            AddressFamily::Inet,
            SockType::Raw,
            SockFlag::empty(),
            SockProtocol::Icmp,
        )
        .expect("raw ICMP socket");
        // A raw socket speaks sendto/recv like a datagram socket; std's
        // UdpSocket is only the wrapper here (the port is ignored).
        let sock = UdpSocket::from(fd);
        sock.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        // Echo request, id 0x4645, seq 1, checksum over the 8 bytes.
        let mut echo = [8u8, 0, 0, 0, 0x46, 0x45, 0, 1];
        let sum: u32 = echo
            .chunks(2)
            .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
            .sum();
        let sum = !(((sum & 0xffff) + (sum >> 16)) as u16);
        echo[2..4].copy_from_slice(&sum.to_be_bytes());
        sock.send_to(&echo, addr(0)).unwrap();
        let mut buf = [0u8; 128];
        loop {
            let n = sock.recv(&mut buf)?;
            let ihl = usize::from(buf[0] & 0xf) * 4;
            // The raw socket gets every ICMP packet: wait for an echo
            // reply (type 0) with our id.
            if n >= ihl + 8 && buf[ihl] == 0 && buf[ihl + 4..ihl + 6] == [0x46, 0x45] {
                return Ok::<_, std::io::Error>(());
            }
        }
    });
    reply.expect("echo reply from the node");
    let c = filter.counters().unwrap();
    assert!(c.passed_other >= 1 && c.dropped_not_owned == 0, "{c:?}");
}

#[test]
fn freeze_holds_both_directions_without_rst_and_thaw_resumes() {
    require_root!();
    let net = Net::new();
    let mut filter = net.attach();
    let listener = net.node(|| TcpListener::bind("0.0.0.0:7001").unwrap());
    let udp_server = net.node(|| UdpSocket::bind("0.0.0.0:7003").unwrap());
    filter.set(Protocol::Tcp, 7001, PortState::Owned).unwrap();
    filter.set(Protocol::Udp, 7003, PortState::Owned).unwrap();
    let (mut a, b, udp) = net.client(|| {
        let connect = || TcpStream::connect_timeout(&addr(7001), Duration::from_secs(3)).unwrap();
        (connect(), connect(), UdpSocket::bind("0.0.0.0:0").unwrap())
    });
    let (mut a_srv, _) = listener.accept().unwrap();
    let (b_srv, _) = listener.accept().unwrap();
    let ms = |n| Some(Duration::from_millis(n));
    let mut buf = [0u8; 16];

    let frozen = [(Protocol::Tcp, 7001), (Protocol::Udp, 7003)];
    for (proto, port) in frozen {
        filter.set(proto, port, PortState::Frozen).unwrap();
    }
    assert_eq!(
        filter.ports().unwrap(),
        vec![
            (Protocol::Tcp, 7001, PortState::Frozen),
            (Protocol::Udp, 7003, PortState::Frozen)
        ]
    );

    // Data in neither direction.
    a.write_all(b"to-server").unwrap();
    a_srv.write_all(b"to-client").unwrap();
    a_srv.set_read_timeout(ms(700)).unwrap();
    a.set_read_timeout(ms(700)).unwrap();
    assert_silent(a_srv.read(&mut buf), "data reached a frozen port");
    assert_silent(a.read(&mut buf), "data left a frozen port");

    // An abortive close sends an RST, as a dumped-and-killed process's
    // sockets would: it must not leave the node.
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    nix::sys::socket::setsockopt(&b_srv, nix::sys::socket::sockopt::Linger, &linger).unwrap();
    drop(b_srv);
    let mut b = b;
    b.set_read_timeout(ms(700)).unwrap();
    assert_silent(b.read(&mut buf), "a frozen port's RST reached the peer");

    // UDP both ways.
    udp.set_read_timeout(ms(500)).unwrap();
    udp_server.set_read_timeout(ms(500)).unwrap();
    udp.send_to(b"in", addr(7003)).unwrap();
    assert_silent(udp_server.recv(&mut buf), "datagram reached a frozen port");
    let client_addr = SocketAddr::new([198, 18, 1, 1].into(), udp.local_addr().unwrap().port());
    udp_server.send_to(b"out", client_addr).unwrap();
    assert_silent(udp.recv(&mut buf), "datagram left a frozen port");

    let c = filter.counters().unwrap();
    assert!(c.dropped_frozen >= 2, "{c:?}");
    assert!(c.egress_blocked >= 3, "data, RST and datagram: {c:?}");

    // Thaw: the ports stay owned and TCP's retransmissions deliver both
    // directions of the connection that lived through the freeze.
    for (proto, port) in frozen {
        filter.set(proto, port, PortState::Owned).unwrap();
    }
    assert_eq!(
        filter.ports().unwrap(),
        vec![
            (Protocol::Tcp, 7001, PortState::Owned),
            (Protocol::Udp, 7003, PortState::Owned)
        ]
    );
    a_srv.set_read_timeout(ms(5000)).unwrap();
    a.set_read_timeout(ms(5000)).unwrap();
    let mut got = [0u8; 9];
    a_srv
        .read_exact(&mut got)
        .expect("retransmission after the thaw");
    assert_eq!(&got, b"to-server");
    a.read_exact(&mut got)
        .expect("reply retransmitted after the thaw");
    assert_eq!(&got, b"to-client");
}

#[test]
fn drop_detaches_both_programs() {
    require_root!();
    let net = Net::new();
    let filter = net.attach();
    let other = net.node(|| UdpSocket::bind("0.0.0.0:7004").unwrap());
    assert_eq!(net.tcx_programs(TcAttachType::Ingress), ["ferry_ingress"]);
    assert_eq!(net.tcx_programs(TcAttachType::Egress), ["ferry_egress"]);

    drop(filter);
    assert!(net.tcx_programs(TcAttachType::Ingress).is_empty());
    assert!(net.tcx_programs(TcAttachType::Egress).is_empty());
    for direction in ["ingress", "egress"] {
        let out = Command::new("ip")
            .args([
                "netns", "exec", &net.node, "tc", "filter", "show", "dev", NODE_IFACE, direction,
            ])
            .output()
            .expect("tc filter show");
        assert!(out.status.success());
        assert!(
            out.stdout.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }

    // Without the filter UDP (which ignores pkt_type) reaches any bound
    // port again.
    let client = net.client(|| UdpSocket::bind("0.0.0.0:0").unwrap());
    client.send_to(b"free", addr(7004)).unwrap();
    other
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut buf = [0u8; 16];
    let n = other.recv(&mut buf).expect("no filter after drop");
    assert_eq!(&buf[..n], b"free");
}

/// What a migration's destination does: capture a port's packets while no
/// socket may see them, then replay them in order into the stack, where
/// they arrive as if just received: every byte, every datagram, once.
#[test]
fn captured_packets_replay_in_order_without_loss() {
    require_root!();
    let net = Net::new();
    let mut filter = net.attach();
    let listener = net.node(|| TcpListener::bind("0.0.0.0:7001").unwrap());
    let udp_server = net.node(|| UdpSocket::bind("0.0.0.0:7003").unwrap());
    let mut replayer = net.node(|| Replayer::new().expect("raw socket"));
    for (proto, port) in [(Protocol::Tcp, 7001), (Protocol::Udp, 7003)] {
        filter.set(proto, port, PortState::Owned).unwrap();
    }
    let (mut tcp, udp) = net.client(|| {
        let t = TcpStream::connect_timeout(&addr(7001), Duration::from_secs(3)).unwrap();
        (t, UdpSocket::bind("0.0.0.0:0").unwrap())
    });
    let (mut srv, _) = listener.accept().unwrap();
    let ms = |n| Some(Duration::from_millis(n));

    for (proto, port) in [(Protocol::Tcp, 7001), (Protocol::Udp, 7003)] {
        filter.set(proto, port, PortState::Capturing).unwrap();
    }
    // 40 small writes (several segments, as TCP coalesces some) and 40
    // datagrams, the first one large enough to be fragmented.
    let mut sent = Vec::new();
    for i in 0..40u32 {
        let msg = format!("message {i:04};");
        tcp.write_all(msg.as_bytes()).unwrap();
        sent.extend_from_slice(msg.as_bytes());
        let mut d = i.to_be_bytes().to_vec();
        if i == 0 {
            d.resize(3000, 0xab);
        }
        udp.send_to(&d, addr(7003)).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    let mut buf = vec![0u8; 4096];
    srv.set_read_timeout(ms(300)).unwrap();
    udp_server.set_read_timeout(ms(300)).unwrap();
    assert_silent(srv.read(&mut buf), "a captured TCP segment was delivered");
    assert_silent(
        udp_server.recv(&mut buf),
        "a captured datagram was delivered",
    );

    let mut captured = Vec::new();
    let (_, bad) = filter.drain_captured(|p| captured.push(p));
    assert_eq!(bad, 0);
    assert!(captured.iter().all(|p| p.kind == CaptureKind::Captured));
    let udp_pkts = captured
        .iter()
        .filter(|p| p.protocol == Protocol::Udp)
        .count();
    assert_eq!(
        udp_pkts,
        39 + 3,
        "39 datagrams plus 3 fragments of the first"
    );
    assert!(captured.windows(2).all(|w| w[0].ktime_ns <= w[1].ktime_ns));
    let c = filter.counters().unwrap();
    assert_eq!(c.captured as usize, captured.len(), "{c:?}");
    assert_eq!(c.capture_lost, 0);

    // Egress opens, ingress still captures: the client's retransmissions
    // during the replay land in the ring, not in the socket.
    for (proto, port) in [(Protocol::Tcp, 7001), (Protocol::Udp, 7003)] {
        filter.set(proto, port, PortState::Releasing).unwrap();
    }
    for p in &captured {
        replayer.replay(&p.data).expect("replay");
    }
    for (proto, port) in [(Protocol::Tcp, 7001), (Protocol::Udp, 7003)] {
        filter.set(proto, port, PortState::Owned).unwrap();
    }
    let mut late = Vec::new();
    filter.drain_captured(|p| late.push(p));
    for p in &late {
        replayer.replay(&p.data).expect("replay");
    }

    udp_server.set_read_timeout(ms(2000)).unwrap();
    let first = udp_server.recv(&mut buf).expect("replayed datagram 0");
    assert_eq!(first, 3000, "the fragmented datagram was reassembled");
    assert_eq!(&buf[..4], &0u32.to_be_bytes());
    for i in 1..40u32 {
        let n = udp_server.recv(&mut buf).expect("replayed datagram");
        assert_eq!(&buf[..n], &i.to_be_bytes(), "datagrams out of order");
    }
    udp_server.set_read_timeout(ms(300)).unwrap();
    assert_silent(udp_server.recv(&mut buf), "a datagram was replayed twice");

    srv.set_read_timeout(ms(5000)).unwrap();
    let mut got = vec![0u8; sent.len()];
    srv.read_exact(&mut got).expect("replayed stream");
    assert_eq!(got, sent);
    // The connection goes on both ways. (The client did retransmit: this
    // test holds the packets for longer than its 200 ms RTO to show that
    // nothing was delivered; the retransmissions were captured and
    // replayed too, and TCP dropped the duplicates.)
    srv.write_all(b"pong").unwrap();
    let mut pong = [0u8; 4];
    tcp.set_read_timeout(ms(5000)).unwrap();
    tcp.read_exact(&mut pong).unwrap();
    assert_eq!(&pong, b"pong");
}

/// On the source, before the freeze: what it delivers is also logged, so
/// that the destination can tell which of its captured packets were
/// handled here already.
#[test]
fn recording_port_delivers_and_logs() {
    require_root!();
    let net = Net::new();
    let mut filter = net.attach();
    let udp_server = net.node(|| UdpSocket::bind("0.0.0.0:7003").unwrap());
    filter
        .set(Protocol::Udp, 7003, PortState::Recording)
        .unwrap();
    let udp = net.client(|| UdpSocket::bind("0.0.0.0:0").unwrap());
    udp.send_to(b"seen", addr(7003)).unwrap();
    udp_server
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut buf = [0u8; 16];
    let n = udp_server.recv(&mut buf).expect("delivered");
    assert_eq!(&buf[..n], b"seen");
    let mut logged = Vec::new();
    filter.drain_captured(|p| logged.push(p));
    assert_eq!(logged.len(), 1);
    assert_eq!(logged[0].kind, CaptureKind::Delivered);
    assert_eq!(logged[0].port, 7003);
    assert!(logged[0].data.ends_with(b"seen"));
    assert_eq!(filter.counters().unwrap().recorded, 1);
}
