//! The ownership filter in the real kernel: a client namespace and a node
//! namespace joined by a veth, frames for the node's address sent to the
//! broadcast MAC as the cluster's router does. Root only.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::Command;
use std::time::Duration;

use ferry_ebpf::{OwnershipFilter, PortState, Protocol};

const NODE_IP: &str = "198.18.1.100";

fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two namespaces, deleted on drop (also when the test panics).
struct Net {
    client: String,
    node: String,
}

impl Net {
    fn new() -> Self {
        let id = std::process::id();
        let net = Net {
            client: format!("fe{id}c"),
            node: format!("fe{id}n"),
        };
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
            "pub0",
            "netns",
            &net.node,
        ]);
        for (ns, dev, addr) in [
            (&net.client, "eth0", "198.18.1.1/24"),
            (&net.node, "pub0", "198.18.1.100/24"),
        ] {
            ip(&["-n", ns, "addr", "add", addr, "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        // As in the cluster: every frame for the node's address is a
        // broadcast frame.
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

    /// Runs `f` on a thread inside namespace `ns`; sockets it creates stay
    /// in that namespace wherever they are used later.
    fn within<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{ns}");
        std::thread::spawn(move || {
            let f_ns = File::open(&path).expect("netns file");
            nix::sched::setns(f_ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .expect("thread in namespace")
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

#[test]
fn filter_passes_owned_ports_drops_the_rest_and_freezes() {
    if !is_root() {
        eprintln!("skipped: needs root (network namespaces, eBPF)");
        return;
    }
    let net = Net::new();
    let (filter, tcp_owned, tcp_other, udp_owned, udp_other) = Net::within(&net.node, || {
        let f = OwnershipFilter::attach("pub0").expect("attach");
        (
            f,
            TcpListener::bind("0.0.0.0:7001").unwrap(),
            TcpListener::bind("0.0.0.0:7002").unwrap(),
            UdpSocket::bind("0.0.0.0:7003").unwrap(),
            UdpSocket::bind("0.0.0.0:7004").unwrap(),
        )
    });
    let mut filter = filter;
    filter.own(Protocol::Tcp, 7001).unwrap();
    filter.own(Protocol::Udp, 7003).unwrap();
    assert_eq!(
        filter.ports().unwrap(),
        vec![
            (Protocol::Tcp, 7001, PortState::Owned),
            (Protocol::Udp, 7003, PortState::Owned)
        ]
    );

    // TCP: the owned port answers; the other one stays silent: a timeout,
    // never "connection refused" (that would be an RST from a non-owner).
    let (owned, other) = Net::within(&net.client, || {
        let owned = TcpStream::connect_timeout(&addr(7001), Duration::from_secs(3));
        let other = TcpStream::connect_timeout(&addr(7002), Duration::from_millis(700));
        (owned, other)
    });
    let mut client = owned.expect("connect to the owned port");
    let err = other.expect_err("a non-owned port must not answer");
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
    let c = filter.counters().unwrap();
    assert!(c.passed > 0 && c.dropped_not_owned > 0, "{c:?}");
    let _ = tcp_other;

    // UDP ignores pkt_type: only the filter keeps the non-owned datagram out.
    let udp = Net::within(&net.client, || UdpSocket::bind("0.0.0.0:0").unwrap());
    udp.send_to(b"owned", addr(7003)).unwrap();
    udp.send_to(b"other", addr(7004)).unwrap();
    udp_owned
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    udp_other
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut buf = [0u8; 16];
    let n = udp_owned
        .recv(&mut buf)
        .expect("datagram to the owned port");
    assert_eq!(&buf[..n], b"owned");
    assert!(
        udp_other.recv(&mut buf).is_err(),
        "datagram to a non-owned port was delivered"
    );

    // Freeze: nothing in, nothing out, and no RST; after the thaw, TCP's
    // retransmissions deliver both directions.
    let (mut server, _) = tcp_owned.accept().unwrap();
    filter.freeze(&[(Protocol::Tcp, 7001)]).unwrap();
    client.write_all(b"to-server").unwrap();
    server.write_all(b"to-client").unwrap();
    server
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    client
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    assert!(server.read(&mut buf).is_err(), "data reached a frozen port");
    assert!(client.read(&mut buf).is_err(), "data left a frozen port");
    let c = filter.counters().unwrap();
    assert!(c.dropped_frozen > 0 && c.egress_blocked > 0, "{c:?}");
    assert_eq!(
        filter.ports().unwrap()[0],
        (Protocol::Tcp, 7001, PortState::Frozen)
    );

    filter.thaw(&[(Protocol::Tcp, 7001)]).unwrap();
    server
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut got = [0u8; 9];
    server
        .read_exact(&mut got)
        .expect("retransmitted data after the thaw");
    assert_eq!(&got, b"to-server");
    client
        .read_exact(&mut got)
        .expect("retransmitted reply after the thaw");
    assert_eq!(&got, b"to-client");

    // Disowning stops delivery; dropping the filter detaches it, after
    // which UDP (which ignores pkt_type) reaches any bound port again.
    filter.disown(Protocol::Udp, 7003).unwrap();
    udp.send_to(b"late", addr(7003)).unwrap();
    udp_owned
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    assert!(
        udp_owned.recv(&mut buf).is_err(),
        "a disowned port still receives"
    );
    drop(filter);
    udp.send_to(b"free", addr(7004)).unwrap();
    udp_other
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let n = udp_other.recv(&mut buf).expect("no filter after drop");
    assert_eq!(&buf[..n], b"free");
}
