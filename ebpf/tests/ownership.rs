//! The ownership filter in the real kernel. Each test builds a client
//! namespace (198.18.1.1) and a node namespace (198.18.1.100) joined by a
//! veth; the client sends every frame for the node to the broadcast MAC, as
//! the cluster's router does. The pinned filter's tests mount a bpffs of
//! their own. Needs root; skipped with a reason otherwise.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use aya::maps::{MapData, MapType};
use aya::programs::{SchedClassifier, TcAttachType};
use ferry_ebpf::pin::{self, PinDir, PinError};
use ferry_ebpf::{CaptureKind, DataPlaneError, OwnershipFilter, PortState, Protocol, Replayer};

#[macro_use]
mod common;
use common::*;

#[test]
fn tcp_owned_port_connects_and_other_port_stays_silent() {
    tcp_owned_port_connects_and_other_port_stays_silent_in(Family::V4);
}

#[test]
fn tcp_owned_port_connects_and_other_port_stays_silent_over_ipv6() {
    tcp_owned_port_connects_and_other_port_stays_silent_in(Family::V6);
}

fn tcp_owned_port_connects_and_other_port_stays_silent_in(family: Family) {
    require_root!();
    let net = Net::new();
    let mut filter = net.attach();
    let addr = move |port| family.addr(port);
    let (_owned, _other) = net.node(move || {
        (
            TcpListener::bind(family.any(7001)).unwrap(),
            TcpListener::bind(family.any(7002)).unwrap(),
        )
    });
    filter.set(Protocol::Tcp, 7001, PortState::Owned).unwrap();
    assert_eq!(
        filter.ports().unwrap(),
        vec![(Protocol::Tcp, 7001, PortState::Owned)]
    );

    let (owned, other) = net.client(move || {
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
    udp_owned_port_receives_with_options_and_fragments_other_port_does_not_in(Family::V4);
}

#[test]
fn udp_owned_port_receives_with_options_and_fragments_other_port_does_not_over_ipv6() {
    udp_owned_port_receives_with_options_and_fragments_other_port_does_not_in(Family::V6);
}

fn udp_owned_port_receives_with_options_and_fragments_other_port_does_not_in(family: Family) {
    require_root!();
    let net = Net::new();
    let mut filter = net.attach();
    let addr = move |port| family.addr(port);
    let (owned, other) = net.node(move || {
        let owned = UdpSocket::bind(family.any(7003)).unwrap();
        let other = UdpSocket::bind(family.any(7004)).unwrap();
        owned
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        other
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        (owned, other)
    });
    filter.set(Protocol::Udp, 7003, PortState::Owned).unwrap();
    let client = net.client(move || UdpSocket::bind(family.any(0)).unwrap());
    let mut buf = [0u8; 4096];

    client.send_to(b"owned", addr(7003)).unwrap();
    let n = owned.recv(&mut buf).expect("datagram to the owned port");
    assert_eq!(&buf[..n], b"owned");
    // UDP ignores pkt_type: only the filter keeps this one out.
    client.send_to(b"other", addr(7004)).unwrap();
    assert_silent(|| other.recv(&mut buf), "datagram to a non-owned port");
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
        || other.recv(&mut buf),
        "fragmented datagram to a non-owned port",
    );
    assert!(filter.counters().unwrap().passed_other >= 2);

    // IP options (IHL 6): the ports are found after them, not at byte 20.
    // Four NOPs are a valid option block. Over IPv6, a hop-by-hop and a
    // destination options header (PadN options), which the filter follows
    // to the UDP header.
    let nops = [1u8; 4];
    let pad_n = [0u8, 0, 1, 4, 0, 0, 0, 0];
    let options: &[(i32, i32, &[u8])] = match family {
        Family::V4 => &[(libc::IPPROTO_IP, libc::IP_OPTIONS, &nops)],
        Family::V6 => &[
            (libc::IPPROTO_IPV6, libc::IPV6_HOPOPTS, &pad_n),
            (libc::IPPROTO_IPV6, libc::IPV6_DSTOPTS, &pad_n),
        ],
    };
    for &(level, name, value) in options {
        // SAFETY: the fd is the live socket `client`, and the option
        // pointer and length describe `value`, which outlives the call.
        let rc = unsafe {
            libc::setsockopt(
                client.as_raw_fd(),
                level,
                name,
                value.as_ptr().cast(),
                value.len() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "option {name}: {}", std::io::Error::last_os_error());
    }
    client.send_to(b"options", addr(7003)).unwrap();
    let n = owned.recv(&mut buf).expect("datagram with IP options");
    assert_eq!(&buf[..n], b"options");
    client.send_to(b"options", addr(7004)).unwrap();
    assert_silent(
        || other.recv(&mut buf),
        "datagram with options to a non-owned port",
    );

    filter.remove(Protocol::Udp, 7003).unwrap();
    assert!(filter.ports().unwrap().is_empty());
    client.send_to(b"late", addr(7003)).unwrap();
    owned
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    assert_silent(|| owned.recv(&mut buf), "datagram to a disowned port");
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
    assert_silent(|| a_srv.read(&mut buf), "data reached a frozen port");
    assert_silent(|| a.read(&mut buf), "data left a frozen port");

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
    assert_silent(|| b.read(&mut buf), "a frozen port's RST reached the peer");

    // UDP both ways.
    udp.set_read_timeout(ms(500)).unwrap();
    udp_server.set_read_timeout(ms(500)).unwrap();
    udp.send_to(b"in", addr(7003)).unwrap();
    assert_silent(
        || udp_server.recv(&mut buf),
        "datagram reached a frozen port",
    );
    let client_addr = SocketAddr::new([198, 18, 1, 1].into(), udp.local_addr().unwrap().port());
    // A datagram the process sends leaves: it runs until CRIU stops it,
    // and nobody would send an answer dropped here again.
    udp_server.send_to(b"out", client_addr).unwrap();
    let n = udp
        .recv(&mut buf)
        .expect("a frozen UDP port's own datagram leaves");
    assert_eq!(&buf[..n], b"out");

    let c = filter.counters().unwrap();
    assert!(c.dropped_frozen >= 2, "{c:?}");
    assert!(c.egress_blocked >= 2, "data and RST: {c:?}");

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
    // Closing a link's last descriptor detaches it from a kernel work
    // queue (bpf_link_put defers the release): on a busy machine that can
    // come a little after the drop.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !(net.tcx_programs(TcAttachType::Ingress).is_empty()
        && net.tcx_programs(TcAttachType::Egress).is_empty())
    {
        assert!(
            std::time::Instant::now() < deadline,
            "still attached 5 s after the drop: {:?} {:?}",
            net.tcx_programs(TcAttachType::Ingress),
            net.tcx_programs(TcAttachType::Egress)
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
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
    captured_packets_replay_in_order_without_loss_in(Family::V4);
}

#[test]
fn captured_packets_replay_in_order_without_loss_over_ipv6() {
    captured_packets_replay_in_order_without_loss_in(Family::V6);
}

fn captured_packets_replay_in_order_without_loss_in(family: Family) {
    require_root!();
    let net = Net::new();
    let mut filter = net.attach();
    let addr = move |port| family.addr(port);
    let listener = net.node(move || TcpListener::bind(family.any(7001)).unwrap());
    let udp_server = net.node(move || UdpSocket::bind(family.any(7003)).unwrap());
    let mut replayer = net.node(|| Replayer::new().expect("raw socket"));
    for (proto, port) in [(Protocol::Tcp, 7001), (Protocol::Udp, 7003)] {
        filter.set(proto, port, PortState::Owned).unwrap();
    }
    let (mut tcp, udp) = net.client(move || {
        let t = TcpStream::connect_timeout(&addr(7001), Duration::from_secs(3)).unwrap();
        (t, UdpSocket::bind(family.any(0)).unwrap())
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
    assert_silent(
        || srv.read(&mut buf),
        "a captured TCP segment was delivered",
    );
    assert_silent(
        || udp_server.recv(&mut buf),
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
    assert_silent(
        || udp_server.recv(&mut buf),
        "a datagram was replayed twice",
    );

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

/// On the source, from Arm to the freeze, an armed TCP port goes on serving
/// (and logging) its connections but starts no new one: a SYN is not
/// delivered (the destination, capturing, replays it once the process
/// runs there), so no connection lands in the listener's accept queue for
/// the dump to find. A recording port (before Arm, when the destination
/// does not capture yet) still takes new connections.
#[test]
fn armed_tcp_port_serves_its_connections_and_takes_no_new_one() {
    require_root!();
    let net = Net::new();
    let mut filter = net.attach();
    let listener = net.node(|| TcpListener::bind("0.0.0.0:7004").unwrap());
    filter.set(Protocol::Tcp, 7004, PortState::Owned).unwrap();
    let mut old = net
        .client(|| TcpStream::connect_timeout(&addr(7004), Duration::from_secs(3)))
        .expect("connect while owned");
    let (mut served, _) = listener.accept().unwrap();
    filter
        .set(Protocol::Tcp, 7004, PortState::Recording)
        .unwrap();
    net.client(|| TcpStream::connect_timeout(&addr(7004), Duration::from_secs(3)))
        .expect("connect to a recording port");
    listener
        .accept()
        .expect("the recording port's new connection");
    filter.set(Protocol::Tcp, 7004, PortState::Armed).unwrap();
    assert_eq!(
        filter.ports().unwrap(),
        vec![(Protocol::Tcp, 7004, PortState::Armed)]
    );
    let mut logged = Vec::new();
    filter.drain_captured(|p| logged.push(p));
    let dropped_before = filter.counters().unwrap().dropped_frozen;

    // The established connection: both ways, each segment logged.
    old.write_all(b"ping").unwrap();
    let mut buf = [0u8; 4];
    served.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"ping");
    served.write_all(b"pong").unwrap();
    old.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    old.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"pong");

    // A new connection: its SYN (and the retransmission after 1 s) is
    // not answered, and nothing waits in the accept queue.
    let err = net
        .client(|| TcpStream::connect_timeout(&addr(7004), Duration::from_millis(1500)))
        .expect_err("an armed port started a handshake");
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
    listener.set_nonblocking(true).unwrap();
    assert_eq!(
        listener.accept().map(|_| ()).unwrap_err().kind(),
        ErrorKind::WouldBlock,
        "a connection was queued"
    );
    assert!(
        filter.counters().unwrap().dropped_frozen >= dropped_before + 2,
        "the SYN and its retransmission"
    );
    logged.clear();
    filter.drain_captured(|p| logged.push(p));
    assert!(
        logged.iter().all(|p| p.kind == CaptureKind::Delivered),
        "{logged:?}"
    );
    assert!(
        logged.iter().any(|p| p.data.ends_with(b"ping")),
        "the delivered data was logged"
    );

    // Owned again (an abort): new connections are taken.
    filter.set(Protocol::Tcp, 7004, PortState::Owned).unwrap();
    net.client(|| TcpStream::connect_timeout(&addr(7004), Duration::from_secs(3)))
        .expect("connect once owned again");
}

// ---- Pinned filter ---------------------------------------------------------
//
// ferryd restarting: the maps and links pinned on bpffs keep the filter
// attached and its state while no agent runs, and the next agent takes
// them over.

/// Every map and link pin of the filter.
const PINS: [&str; 9] = [
    "FERRY_PORTS",
    "FERRY_FLOWS",
    "FERRY_COUNTERS",
    "FERRY_CAPTURE",
    "FERRY_FRAGS",
    "FERRY_FLOWS6",
    "FERRY_FRAGS6",
    "link-ferry_ingress",
    "link-ferry_egress",
];

/// A bpffs instance of the test's own (this machine need not have one at
/// /sys/fs/bpf): the pins it holds are removed and the instance unmounted
/// on drop, also when the test fails.
struct Bpffs {
    path: PathBuf,
}

impl Bpffs {
    fn new() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        // No '.' anywhere below it: bpffs refuses such names.
        let fs = Bpffs {
            path: std::env::temp_dir().join(format!(
                "ferry-own-bpffs-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            )),
        };
        assert!(pin::mount_bpffs(&fs.path).expect("mount bpffs"));
        fs
    }

    fn pins(&self, name: &str) -> PinDir {
        PinDir::new(self.path.join("ferry").join(name))
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        // Detach what the test left pinned before the instance goes (its
        // pins would go with it anyway).
        if let Ok(dirs) = std::fs::read_dir(self.path.join("ferry")) {
            for dir in dirs.flatten() {
                let _ = OwnershipFilter::unpin(&PinDir::new(dir.path()));
            }
        }
        let _ = std::fs::remove_dir(self.path.join("ferry"));
        let _ = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&self.path);
    }
}

impl Net {
    /// The pinned filter on the node's public interface.
    fn attach_pinned(&self, pins: &PinDir) -> Result<OwnershipFilter, DataPlaneError> {
        let pins = pins.clone();
        self.node(move || OwnershipFilter::attach_pinned(NODE_IFACE, &pins))
    }

    /// IDs of the tcx programs on `pub0` of namespace `ns`, egress and
    /// ingress.
    fn tcx_ids(ns: &str) -> (Vec<u32>, Vec<u32>) {
        Self::within(ns, || {
            let ids = |direction| {
                let (_, progs) =
                    SchedClassifier::query_tcx(NODE_IFACE, direction).expect("query_tcx");
                progs.iter().map(|p| p.id()).collect::<Vec<_>>()
            };
            (ids(TcAttachType::Egress), ids(TcAttachType::Ingress))
        })
    }

    /// Neither tcx programs nor cls_bpf filters on the node's interface.
    #[track_caller]
    fn assert_unfiltered(&self) {
        assert_eq!(Self::tcx_ids(&self.node), (vec![], vec![]));
        for direction in ["ingress", "egress"] {
            let out = Command::new("ip")
                .args([
                    "netns", "exec", &self.node, "tc", "filter", "show", "dev", NODE_IFACE,
                    direction,
                ])
                .output()
                .expect("tc filter show");
            assert!(out.status.success());
            assert!(
                out.stdout.is_empty(),
                "{direction}: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
    }

    /// A counter of the node's /proc/net/snmp (e.g. "Tcp", "OutRsts").
    fn node_snmp(&self, proto: &'static str, field: &'static str) -> u64 {
        self.node(move || {
            // thread-self: /proc/self/net is the main thread's namespace.
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
}

/// The pinned counters, read straight from the pin as any other process
/// could (no filter object open), summed over CPUs, in the order of
/// `enum ferry_counter`.
fn pinned_counters(pins: &PinDir) -> [u64; 8] {
    let map = MapData::from_pin(pins.map_path("FERRY_COUNTERS")).expect("counters pin");
    let map = aya::maps::Map::from_map_data(map).unwrap();
    let counters = aya::maps::PerCpuArray::<_, u64>::try_from(map).unwrap();
    std::array::from_fn(|i| counters.get(&(i as u32), 0).unwrap().iter().sum())
}

const CNT_PASSED: usize = 0;
const CNT_DROPPED_NOT_OWNED: usize = 1;
const CNT_CAPTURED: usize = 5;

/// Polls `cond` until it holds, failing the test after five seconds.
#[track_caller]
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
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

/// `tcpi_total_retrans` of TCP_INFO: segments `s` retransmitted.
fn total_retrans(s: &TcpStream) -> u32 {
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
    info.tcpi_total_retrans
}

const CHUNK: usize = 16 << 10;

/// Streams numbered chunks from `from` to `to` until 32 chunks after
/// `done` is set, the last one flagged; the reader checks every byte.
/// Both threads return the number of chunks.
fn stream_until(
    from: &TcpStream,
    to: &TcpStream,
    seed: u32,
    done: &Arc<AtomicBool>,
) -> (
    JoinHandle<std::io::Result<u32>>,
    JoinHandle<std::io::Result<u32>>,
) {
    let writer = std::thread::spawn({
        let mut from = from.try_clone().unwrap();
        let done = done.clone();
        move || {
            let mut extra = 0;
            for i in 0u32.. {
                let last = extra == 32;
                let mut chunk = vec![u8::from(last)];
                chunk.extend_from_slice(&pattern(seed ^ i, CHUNK));
                from.write_all(&chunk)?;
                if last {
                    return Ok(i + 1);
                }
                if done.load(Ordering::Relaxed) {
                    extra += 1;
                }
                // Paced, so that the stream spans the restart without
                // taking every CPU.
                std::thread::sleep(Duration::from_millis(1));
            }
            unreachable!()
        }
    });
    let reader = std::thread::spawn({
        let mut to = to.try_clone().unwrap();
        move || {
            let mut chunk = vec![0u8; 1 + CHUNK];
            for i in 0u32.. {
                to.read_exact(&mut chunk)?;
                assert!(
                    chunk[1..] == pattern(seed ^ i, CHUNK)[..],
                    "chunk {i} corrupted"
                );
                if chunk[0] == 1 {
                    return Ok(i + 1);
                }
            }
            unreachable!()
        }
    });
    (writer, reader)
}

#[test]
fn pinned_filter_survives_its_owner_and_unpin_removes_everything() {
    require_root!();
    let net = Net::new();
    let fs = Bpffs::new();
    let pins = fs.pins("ownership");
    let (listener, _unowned_tcp, unowned_udp) = net.node(|| {
        (
            TcpListener::bind("0.0.0.0:7001").unwrap(),
            // Listeners on ports another node owns: the filter alone
            // keeps them from answering.
            TcpListener::bind("0.0.0.0:7002").unwrap(),
            UdpSocket::bind("0.0.0.0:7004").unwrap(),
        )
    });
    unowned_udp
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut buf = [0u8; 64];

    let mut filter = net.attach_pinned(&pins).expect("attach_pinned");
    assert_eq!(filter.pin_dir(), Some(pins.path()));
    filter.set(Protocol::Tcp, 7001, PortState::Owned).unwrap();
    let mut client = net
        .client(|| TcpStream::connect_timeout(&addr(7001), Duration::from_secs(3)))
        .expect("connect to the owned port");
    let (mut server, _) = listener.accept().unwrap();
    for s in [&client, &server] {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    }
    stream_check(&client, &mut server, 1, 64 << 10);
    stream_check(&server, &mut client, 2, 64 << 10);
    let first = filter.counters().unwrap();
    assert!(first.passed > 0, "{first:?}");

    // ferryd exits: the pins hold everything.
    drop(filter);
    for name in PINS {
        assert!(pins.path().join(name).exists(), "{name} pinned");
    }
    assert_eq!(net.tcx_programs(TcAttachType::Ingress), ["ferry_ingress"]);
    assert_eq!(net.tcx_programs(TcAttachType::Egress), ["ferry_egress"]);
    let ids = Net::tcx_ids(&net.node);
    stream_check(&client, &mut server, 3, 64 << 10);
    stream_check(&server, &mut client, 4, 64 << 10);
    // And it still filters: no answer from an unowned port, not even an
    // RST, and no datagram delivered to one.
    let rsts = net.node_snmp("Tcp", "OutRsts");
    let err = net
        .client(|| TcpStream::connect_timeout(&addr(7002), Duration::from_millis(1500)))
        .expect_err("a non-owned port must not answer");
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
    let spammer = net.client(|| UdpSocket::bind("0.0.0.0:0").unwrap());
    spammer.send_to(b"unowned", addr(7004)).unwrap();
    assert_silent(
        || unowned_udp.recv(&mut buf),
        "datagram to a non-owned port",
    );
    assert_eq!(
        net.node_snmp("Tcp", "OutRsts"),
        rsts,
        "an RST left the node"
    );
    let before = pinned_counters(&pins);
    assert!(before[CNT_PASSED] > first.passed, "{before:?} {first:?}");
    // The ferryd before IPv6 pinned no IPv6 maps: the next one takes over
    // the maps it finds and adds those.
    for name in ["FERRY_FLOWS6", "FERRY_FRAGS6"] {
        std::fs::remove_file(pins.path().join(name)).unwrap();
    }

    // ferryd restarts while both ends stream and a client keeps sending
    // datagrams to the unowned port: not one chunk may be lost (the
    // reader checks every byte), not one segment dropped (the filter's
    // drop counters) and not one datagram delivered (the filter never
    // left the interface).
    let retrans = (total_retrans(&client), total_retrans(&server));
    let done = Arc::new(AtomicBool::new(false));
    let up = stream_until(&client, &server, 0x1000, &done);
    let down = stream_until(&server, &client, 0x2000, &done);
    let spam_stop = Arc::new(AtomicBool::new(false));
    let spam = std::thread::spawn({
        let stop = spam_stop.clone();
        move || {
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if spammer.send_to(b"spam", addr(7004)).is_ok() {
                    sent += 1;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            sent
        }
    });
    std::thread::sleep(Duration::from_millis(50));
    let reattached = net.attach_pinned(&pins);
    done.store(true, Ordering::Relaxed);
    let filter = reattached.expect("attach_pinned again");
    for (w, r) in [up, down] {
        let sent = w.join().unwrap().expect("writing across the restart");
        let got = r.join().unwrap().expect("reading across the restart");
        assert_eq!(sent, got);
    }
    // A segment lost anywhere (by the filter, or by the stack in a
    // moment without it) would have been retransmitted.
    assert_eq!(
        (total_retrans(&client), total_retrans(&server)),
        retrans,
        "segments were retransmitted across the restart"
    );
    spam_stop.store(true, Ordering::Relaxed);
    let spammed = spam.join().unwrap();
    assert!(spammed > 0);
    std::thread::sleep(Duration::from_millis(100));
    assert_silent(
        || unowned_udp.recv(&mut buf),
        "spam reached a non-owned port",
    );

    // This build's programs were swapped into the same links, and the
    // maps missing were pinned.
    for name in PINS {
        assert!(pins.path().join(name).exists(), "{name} pinned");
    }
    assert_eq!(net.tcx_programs(TcAttachType::Ingress), ["ferry_ingress"]);
    assert_eq!(net.tcx_programs(TcAttachType::Egress), ["ferry_egress"]);
    let (egress, ingress) = Net::tcx_ids(&net.node);
    assert!(
        egress != ids.0 && ingress != ids.1,
        "new programs swapped in"
    );
    // The port, and the counters, lived through it: every drop is spam.
    assert_eq!(
        filter.ports().unwrap(),
        vec![(Protocol::Tcp, 7001, PortState::Owned)]
    );
    let c = filter.counters().unwrap();
    assert!(c.passed > before[CNT_PASSED], "{c:?} {before:?}");
    assert_eq!(
        c.dropped_not_owned - before[CNT_DROPPED_NOT_OWNED],
        spammed,
        "only the spam was dropped: {c:?} {before:?}"
    );
    assert_eq!((c.dropped_frozen, c.egress_blocked), (0, 0), "{c:?}");
    assert_eq!(
        net.node_snmp("Tcp", "OutRsts"),
        rsts,
        "an RST left the node"
    );
    stream_check(&server, &mut client, 5, 64 << 10);

    OwnershipFilter::unpin(&pins).unwrap();
    assert!(!pins.path().exists(), "pins left behind");
    net.assert_unfiltered();
    // The open object's maps are still readable, but nothing filters:
    // UDP (which ignores pkt_type) reaches any bound port again.
    assert_eq!(filter.ports().unwrap().len(), 1);
    let client_udp = net.client(|| UdpSocket::bind("0.0.0.0:0").unwrap());
    client_udp.send_to(b"free", addr(7004)).unwrap();
    unowned_udp
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let n = unowned_udp.recv(&mut buf).expect("no filter after unpin");
    assert_eq!(&buf[..n], b"free");
    drop(filter);
    // Unpinning twice is fine.
    OwnershipFilter::unpin(&pins).unwrap();
}

/// What the migration's source does when ferryd restarts during a freeze:
/// the packets captured meanwhile (also while no agent runs) wait in the
/// pinned ring, and the next agent drains exactly those not yet drained.
#[test]
fn captured_records_survive_a_restart_and_are_drained_after_it() {
    require_root!();
    let net = Net::new();
    let fs = Bpffs::new();
    let pins = fs.pins("capture");
    let server = net.node(|| UdpSocket::bind("0.0.0.0:7003").unwrap());
    let client = net.client(|| UdpSocket::bind("0.0.0.0:0").unwrap());
    let captured = |pins: &PinDir| pinned_counters(pins)[CNT_CAPTURED];

    let mut filter = net.attach_pinned(&pins).expect("attach_pinned");
    filter
        .set(Protocol::Udp, 7003, PortState::Capturing)
        .unwrap();
    client.send_to(b"record 0", addr(7003)).unwrap();
    wait_for("the first capture", || captured(&pins) == 1);
    let mut drained = Vec::new();
    assert_eq!(filter.drain_captured(|p| drained.push(p)), (1, 0));
    assert!(drained[0].data.ends_with(b"record 0"));
    for i in 1..3 {
        client
            .send_to(format!("record {i}").as_bytes(), addr(7003))
            .unwrap();
    }
    wait_for("two more captures", || captured(&pins) == 3);

    // ferryd exits undrained; the filter goes on capturing.
    drop(filter);
    client.send_to(b"record 3", addr(7003)).unwrap();
    wait_for("a capture without an agent", || captured(&pins) == 4);

    let mut filter = net.attach_pinned(&pins).expect("attach_pinned again");
    assert_eq!(
        filter.ports().unwrap(),
        vec![(Protocol::Udp, 7003, PortState::Capturing)]
    );
    let mut records = Vec::new();
    assert_eq!(filter.drain_captured(|p| records.push(p)), (3, 0));
    for (i, p) in records.iter().enumerate() {
        assert_eq!(
            (p.kind, p.protocol, p.port),
            (CaptureKind::Captured, Protocol::Udp, 7003)
        );
        let want = format!("record {}", i + 1);
        assert!(p.data.ends_with(want.as_bytes()), "{p:?} is not {want}");
    }
    assert!(records.windows(2).all(|w| w[0].ktime_ns <= w[1].ktime_ns));
    assert_eq!(filter.drain_captured(|_| {}), (0, 0), "drained twice");
    let c = filter.counters().unwrap();
    assert_eq!((c.captured, c.capture_lost), (4, 0), "{c:?}");
    // Captured, never delivered.
    server
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    assert_silent(|| server.recv(&mut [0u8; 64]), "a captured datagram");
    drop(filter);
    OwnershipFilter::unpin(&pins).unwrap();
    net.assert_unfiltered();
}

/// A ring buffer map of `bytes` bytes (aya creates none standalone).
fn ringbuf(bytes: u32) -> MapData {
    /// `union bpf_attr` as BPF_MAP_CREATE reads it (the rest zero).
    #[repr(C)]
    struct MapCreateAttr {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
    }
    const BPF_MAP_CREATE: libc::c_long = 0;
    let attr = MapCreateAttr {
        map_type: MapType::RingBuf as u32,
        key_size: 0,
        value_size: 0,
        max_entries: bytes,
        map_flags: 0,
    };
    // SAFETY: bpf(2) reads size_of::<MapCreateAttr>() bytes of `attr`, a
    // live repr(C) value laid out as the head of the kernel's bpf_attr for
    // BPF_MAP_CREATE (the fields it does not get read as zero).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_CREATE,
            &attr as *const MapCreateAttr,
            std::mem::size_of::<MapCreateAttr>(),
        )
    };
    assert!(
        rc >= 0,
        "BPF_MAP_CREATE: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: on success BPF_MAP_CREATE returns a new descriptor that
    // nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(rc as i32) };
    MapData::from_fd(fd).unwrap()
}

/// Names in a pin directory, sorted.
fn pinned(pins: &PinDir) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(pins.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn pins_of_another_layout_are_refused_and_stale_links_replaced() {
    require_root!();
    let net = Net::new();
    let fs = Bpffs::new();
    let good = fs.pins("good");
    let filter = net.attach_pinned(&good).unwrap();
    let ids = Net::tcx_ids(&net.node);

    // As an incompatible build would have left them: port flags of 8
    // bytes, a ring of 1 MiB, counters that are not per CPU.
    type Case = (&'static str, fn(PathBuf), &'static str, &'static str);
    let cases: [Case; 3] = [
        (
            "FERRY_PORTS",
            |at| {
                aya::maps::HashMap::<MapData, u32, u64>::create(65536, 0)
                    .unwrap()
                    .pin(at)
                    .unwrap()
            },
            "Hash key 4 value 8 max_entries 65536",
            "Hash key 4 value 4 max_entries 65536",
        ),
        (
            "FERRY_CAPTURE",
            |at| ringbuf(1 << 20).pin(at).unwrap(),
            "RingBuf key 0 value 0 max_entries 1048576",
            "RingBuf key 0 value 0 max_entries 33554432",
        ),
        (
            "FERRY_COUNTERS",
            |at| {
                aya::maps::Array::<MapData, u64>::create(8, 0)
                    .unwrap()
                    .pin(at)
                    .unwrap()
            },
            "Array key 4 value 8 max_entries 8",
            "PerCpuArray key 4 value 8 max_entries 8",
        ),
    ];
    for (name, make, found_want, expected_want) in cases {
        let bad = fs.pins(&format!("bad{name}"));
        bad.create().unwrap();
        make(bad.map_path(name));
        let err = net.attach_pinned(&bad).unwrap_err();
        match &err {
            DataPlaneError::Pin(PinError::Mismatch {
                path,
                found,
                expected,
            }) => {
                assert_eq!(path, &bad.map_path(name));
                assert_eq!(found, found_want);
                assert_eq!(expected, expected_want);
            }
            other => panic!("{name}: expected a mismatch, got {other}"),
        }
        let msg = err.to_string();
        assert!(msg.contains(name) && msg.contains(found_want), "{msg}");
        // Refused before anything was created or attached.
        assert_eq!(pinned(&bad), [name]);
        assert_eq!(Net::tcx_ids(&net.node), ids);
        OwnershipFilter::unpin(&bad).unwrap();
        assert!(!bad.path().exists());
    }
    drop(filter);

    // The same pins used for another interface (a pub0 in the client's
    // namespace): the links pinned for the node's are not attached there,
    // so they are detached and replaced.
    // (A veth pair: this kernel has no dummy devices.)
    ip(&[
        "-n",
        &net.client,
        "link",
        "add",
        NODE_IFACE,
        "type",
        "veth",
        "peer",
        "name",
        "pub0peer",
    ]);
    ip(&["-n", &net.client, "link", "set", NODE_IFACE, "up"]);
    let pins = good.clone();
    let moved = Net::within(&net.client, move || {
        OwnershipFilter::attach_pinned(NODE_IFACE, &pins)
    })
    .expect("attach_pinned elsewhere");
    net.assert_unfiltered();
    let (egress, ingress) = Net::tcx_ids(&net.client);
    assert_eq!((egress.len(), ingress.len()), (1, 1));
    drop(moved);
    assert_eq!(pinned(&good).len(), PINS.len());
    OwnershipFilter::unpin(&good).unwrap();
    assert_eq!(Net::tcx_ids(&net.client), (vec![], vec![]));
}
