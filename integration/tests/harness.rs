//! Self-tests of the harness: the emulated network floods the shared
//! address to every node, teardown leaves nothing behind (also after a
//! panic or a failed start), and the workloads detect what they claim to.
//! None of them needs the agent. Root only; skipped with a reason otherwise.
//!
//! `cargo test -p ferry-integration --test harness`

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::os::fd::OwnedFd;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ferry_integration::cluster::{Cluster, ClusterError, ClusterSpec};
use ferry_integration::inspect;
use ferry_integration::netns;
use ferry_integration::tmpfs;
use ferry_integration::topology::{PUBLIC_ADDR, PUBLIC_ADDR6, PUBLIC_IFACE};
use ferry_integration::workload::{ProbeConnection, SeqClient, StreamErrorKind};
use nix::sys::socket::{
    AddressFamily, LinkAddr, SockFlag, SockProtocol, SockType, recvfrom, setsockopt, socket,
    sockopt,
};
use nix::sys::time::TimeVal;

const ECHO_BIN: &str = env!("CARGO_BIN_EXE_ferry-echo-server");

/// What a cluster made, to check after it is gone.
#[derive(Debug, Clone)]
struct Footprint {
    netns: Vec<String>,
    dir: PathBuf,
}

impl Footprint {
    fn of(c: &Cluster) -> Self {
        Self {
            netns: c.netns_names(),
            dir: c.dir().to_owned(),
        }
    }

    fn assert_present(&self) {
        let listed = netns::list().unwrap();
        for n in &self.netns {
            assert!(listed.contains(n), "namespace {n} missing from {listed:?}");
        }
        assert!(!tmpfs::mounts_under(&self.dir).unwrap().is_empty());
    }

    fn assert_gone(&self) {
        let listed = netns::list().unwrap();
        let left: Vec<_> = self.netns.iter().filter(|n| listed.contains(n)).collect();
        assert!(left.is_empty(), "namespaces left behind: {left:?}");
        let mounts = tmpfs::mounts_under(&self.dir).unwrap();
        assert!(mounts.is_empty(), "mounts left behind: {mounts:?}");
        assert!(!self.dir.exists(), "{} left behind", self.dir.display());
    }
}

/// An AF_PACKET socket in the node's namespace that sees every IPv4 frame
/// on its interfaces, whatever its pkt_type, plus the ifindex of `pub0`.
fn capture_on_public_iface(netns_path: &Path) -> (OwnedFd, usize) {
    netns::run_in(netns_path, || {
        let fd = socket(
            AddressFamily::Packet,
            SockType::Datagram,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::EthIp,
        )
        .expect("AF_PACKET socket");
        setsockopt(&fd, sockopt::ReceiveTimeout, &TimeVal::new(0, 200_000)).unwrap();
        let ifindex = nix::net::if_::if_nametoindex(PUBLIC_IFACE).expect("pub0") as usize;
        (fd, ifindex)
    })
    .unwrap()
}

/// Waits for the UDP datagram carrying `payload` to `PUBLIC_ADDR:port` on
/// `ifindex`; returns its pkt_type.
fn wait_for_datagram(fd: &OwnedFd, ifindex: usize, port: u16, payload: &[u8]) -> Option<u8> {
    use std::os::fd::AsRawFd;
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut buf = [0u8; 2048];
    while Instant::now() < deadline {
        let Ok((n, Some(from))) = recvfrom::<LinkAddr>(fd.as_raw_fd(), &mut buf) else {
            continue;
        };
        if from.ifindex() != ifindex || n < 28 {
            continue;
        }
        let ip = &buf[..n];
        let ihl = usize::from(ip[0] & 0x0f) * 4;
        let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
        if ip[0] >> 4 != 4 || ip[9] != 17 || dst != PUBLIC_ADDR || n < ihl + 8 {
            continue;
        }
        let udp = &ip[ihl..];
        if u16::from_be_bytes([udp[2], udp[3]]) == port && &udp[8..] == payload {
            return Some(from.pkttype());
        }
    }
    None
}

#[test]
fn network_floods_the_shared_address_to_every_node() {
    if !ferry_integration::can_run("network_floods_the_shared_address_to_every_node") {
        return;
    }
    let cluster = Cluster::start(ClusterSpec::new(2, 1).without_agents()).expect("cluster");
    let footprint = Footprint::of(&cluster);
    footprint.assert_present();
    // packaging/ferry-network's settings (docs/deploy.md): no node answers
    // ARP for the shared address, the gateway's entry floods.
    for n in cluster.node_names() {
        let arp_ignore = netns::run_in(&cluster.netns_path(&n), || {
            std::fs::read_to_string(format!("/proc/sys/net/ipv4/conf/{PUBLIC_IFACE}/arp_ignore"))
        })
        .unwrap()
        .expect("arp_ignore");
        assert_eq!(arp_ignore.trim(), "8", "{n}");
    }
    let neigh = netns::run_in(&cluster.netns_path("client1"), || {
        std::process::Command::new("ip")
            .args(["neigh", "show", &PUBLIC_ADDR.to_string()])
            .output()
    })
    .unwrap()
    .expect("ip neigh");
    let neigh = String::from_utf8_lossy(&neigh.stdout);
    assert!(
        neigh.contains("ff:ff:ff:ff:ff:ff") && neigh.contains("PERMANENT"),
        "{neigh}"
    );

    // IPv6 has no arp_ignore: the shared IPv6 address is on each node's
    // lo, where no node answers a neighbour solicitation for it. A host
    // without the gateway's permanent entry solicits it in vain (the
    // entry FAILs); the gateway's entry floods as IPv4's does.
    let ip_in = |ns: &str, args: &'static [&'static str]| {
        let out = netns::run_in(&cluster.netns_path(ns), move || {
            std::process::Command::new("ip").args(args).output()
        })
        .unwrap()
        .expect("ip");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for n in cluster.node_names() {
        let on_lo = ip_in(&n, &["-6", "addr", "show", "dev", "lo"]);
        assert!(
            on_lo.contains(&format!("{PUBLIC_ADDR6}/128")),
            "{n}: {on_lo}"
        );
    }
    let neigh6 = ip_in("client1", &["neigh", "show", "2001:2::100"]);
    assert!(
        neigh6.contains("ff:ff:ff:ff:ff:ff") && neigh6.contains("PERMANENT"),
        "{neigh6}"
    );
    ip_in("client1", &["neigh", "del", "2001:2::100", "dev", "eth0"]);
    netns::run_in(&cluster.netns_path("client1"), || {
        let sock = UdpSocket::bind("[::]:0").unwrap();
        sock.send_to(b"who has it?", (PUBLIC_ADDR6, 9997)).unwrap();
    })
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let state = ip_in("client1", &["neigh", "show", "2001:2::100"]);
        if state.contains("FAILED") {
            break;
        }
        assert!(
            !state.contains("lladdr"),
            "a node answered a neighbour solicitation for the shared address: {state}"
        );
        assert!(Instant::now() < deadline, "still soliciting: {state}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let gateway: Vec<String> = ferry_integration::topology::gateway_network_args();
    let script = ferry_integration::topology::network_script();
    let put_back = netns::run_in(&cluster.netns_path("client1"), move || {
        std::process::Command::new("sh")
            .arg(script)
            .args(gateway)
            .status()
    })
    .unwrap()
    .expect("ferry-network gateway");
    assert!(put_back.success());

    let captures: Vec<_> = cluster
        .node_names()
        .iter()
        .map(|n| (n.clone(), capture_on_public_iface(&cluster.netns_path(n))))
        .collect();
    let port = 9999;
    let payload = format!(
        "ferry flood check {} {:?}",
        std::process::id(),
        Instant::now()
    );
    let client_addr = cluster.client_addr("client1");
    netns::run_in(&cluster.netns_path("client1"), || {
        let sock = UdpSocket::bind(SocketAddrV4::new(client_addr, 0)).unwrap();
        // Three copies, in case the first one waits for anything; one
        // arriving at each node is the claim.
        for _ in 0..3 {
            sock.send_to(payload.as_bytes(), SocketAddrV4::new(PUBLIC_ADDR, port))
                .unwrap();
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .unwrap();
    for (node, (fd, ifindex)) in &captures {
        let pkt_type = wait_for_datagram(fd, *ifindex, port, payload.as_bytes());
        assert!(
            pkt_type.is_some(),
            "{node} never saw the client's datagram for {PUBLIC_ADDR} on {PUBLIC_IFACE}"
        );
        // Flooded as a broadcast frame: exactly what the agent's ingress
        // filter has to turn into PACKET_HOST for owned ports.
        assert_eq!(pkt_type, Some(libc::PACKET_BROADCAST), "{node}: pkt_type");
    }
    drop(captures);

    // Without the agent's filter the kernel already delivers the flooded
    // datagram to a UDP socket on EVERY node (UDP does not look at
    // pkt_type), so the filter must drop what a node does not own...
    let udp_port = 9998;
    let receivers: Vec<UdpSocket> = cluster
        .node_names()
        .iter()
        .map(|n| {
            netns::run_in(&cluster.netns_path(n), || {
                let s =
                    UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, udp_port)).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
                s
            })
            .unwrap()
        })
        .collect();
    netns::run_in(&cluster.netns_path("client1"), || {
        UdpSocket::bind(SocketAddrV4::new(client_addr, 0))
            .unwrap()
            .send_to(b"to all", SocketAddrV4::new(PUBLIC_ADDR, udp_port))
            .unwrap();
    })
    .unwrap();
    for (node, sock) in cluster.node_names().iter().zip(&receivers) {
        let mut buf = [0u8; 16];
        let (n, from) = sock
            .recv_from(&mut buf)
            .unwrap_or_else(|e| panic!("{node}: no datagram: {e}"));
        assert_eq!(&buf[..n], b"to all", "{node}");
        assert_eq!(from.ip(), std::net::IpAddr::V4(client_addr), "{node}");
    }
    drop(receivers);

    // ...while TCP drops the broadcast-typed SYNs: nothing connects until
    // the filter turns owned packets into PACKET_HOST.
    let tcp_port = 9997;
    let _listener = netns::run_in(&cluster.netns_path("node1"), || {
        TcpListener::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, tcp_port))
    })
    .unwrap()
    .unwrap();
    let attempt = netns::run_in(&cluster.netns_path("client1"), || {
        TcpStream::connect_timeout(
            &SocketAddrV4::new(PUBLIC_ADDR, tcp_port).into(),
            Duration::from_secs(1),
        )
    })
    .unwrap();
    assert!(
        attempt.is_err(),
        "TCP to the shared address connected without any ownership filter"
    );

    // The cluster network is ordinary unicast: node1 reaches node2's
    // address (where the agents' Peer services listen).
    let node2_addr = SocketAddrV4::new(cluster.node_cluster_addr("node2"), 7999);
    let listener = netns::run_in(&cluster.netns_path("node2"), || {
        TcpListener::bind(node2_addr)
    })
    .unwrap()
    .unwrap();
    let mut conn = netns::run_in(&cluster.netns_path("node1"), || {
        TcpStream::connect_timeout(&node2_addr.into(), Duration::from_secs(5))
    })
    .unwrap()
    .expect("node1 -> node2 over the cluster network");
    let (mut accepted, from) = listener.accept().unwrap();
    assert_eq!(
        from.ip(),
        std::net::IpAddr::V4(cluster.node_cluster_addr("node1"))
    );
    conn.write_all(b"ping").unwrap();
    let mut buf = [0u8; 4];
    accepted.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"ping");
    drop((conn, accepted, listener));

    drop(cluster);
    footprint.assert_gone();
}

#[test]
fn a_panicking_test_still_tears_everything_down() {
    if !ferry_integration::can_run("a_panicking_test_still_tears_everything_down") {
        return;
    }
    let mut seen: Option<(Footprint, u32)> = None;
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let cluster = Cluster::start(ClusterSpec::new(2, 1).without_agents()).expect("cluster");
        // A stray process the test forgot about, with its cwd in a node's
        // tmpfs (which would keep the mount busy).
        let mut sleeper = Command::new("sleep");
        sleeper.arg("1000").current_dir(cluster.work_dir("node1"));
        // Reaped with waitpid below, after the teardown killed it.
        #[allow(clippy::zombie_processes)]
        let stray = cluster.spawn_in("node1", sleeper).unwrap().into_inner();
        std::fs::write(cluster.work_dir("node1").join("image.img"), b"x").unwrap();
        seen = Some((Footprint::of(&cluster), stray.id()));
        panic!("deliberate panic with a live cluster");
    }));
    assert!(result.is_err(), "the closure was meant to panic");
    let (footprint, stray) = seen.expect("the cluster started");
    footprint.assert_gone();
    // The stray was SIGKILLed by the teardown; it is our child, so reap it.
    let status = nix::sys::wait::waitpid(
        nix::unistd::Pid::from_raw(stray as i32),
        Some(nix::sys::wait::WaitPidFlag::WNOHANG),
    )
    .expect("waitpid on the stray process");
    assert!(
        matches!(
            status,
            nix::sys::wait::WaitStatus::Signaled(_, nix::sys::signal::Signal::SIGKILL, _)
        ),
        "stray process not killed by the teardown: {status:?}"
    );
}

/// A stand-in for ferryd written to a file: `body` is a shell script.
fn fake_agent(dir: &Path, name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[test]
fn a_failed_agent_start_reports_the_log_and_tears_down() {
    if !ferry_integration::can_run("a_failed_agent_start_reports_the_log_and_tears_down") {
        return;
    }
    let bins = tempfile::tempdir().unwrap();
    // Other tests build clusters concurrently: look for this one's only.
    let assert_gone = |err: &ClusterError| {
        let ClusterError::Start { id, .. } = err else {
            panic!("not a start error: {err}");
        };
        let prefix = format!("{id}-");
        let left: Vec<_> = netns::list()
            .unwrap()
            .into_iter()
            .filter(|n| n.starts_with(&prefix))
            .collect();
        assert!(left.is_empty(), "namespaces left behind: {left:?}");
    };

    // An agent that dies at once: the error quotes its log.
    let mut spec = ClusterSpec::new(2, 0);
    spec.ferryd = Some(fake_agent(
        bins.path(),
        "ferryd-dies",
        "echo \"fake ferryd: refusing with config $2\" >&2; exit 3",
    ));
    let err = Cluster::start(spec).expect_err("a dying agent must fail the start");
    let msg = err.to_string();
    assert!(
        matches!(&err, ClusterError::Start { source, .. } if matches!(**source, ClusterError::Agent(_))),
        "{msg}"
    );
    assert!(
        msg.contains("exited") && msg.contains("fake ferryd: refusing with config"),
        "{msg}"
    );
    assert!(msg.contains("ferryd.toml"), "{msg}");
    assert_gone(&err);

    // An agent that never answers: a timeout, and it is killed.
    let mut spec = ClusterSpec::new(1, 0);
    spec.ferryd = Some(fake_agent(bins.path(), "ferryd-hangs", "exec sleep 1000"));
    spec.ready_timeout = Duration::from_secs(1);
    let t0 = Instant::now();
    let err = Cluster::start(spec).expect_err("a silent agent must fail the start");
    assert!(
        err.to_string().contains("did not answer ListNodes"),
        "{err}"
    );
    // 1 s of waiting plus the SIGTERM that `sleep` obeys at once.
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_gone(&err);
}

/// Echo server in the client's own namespace: the workload code is tested
/// without the agent (which is what makes the shared address reachable).
fn echo_server_in(cluster: &Cluster, ns: &str, port: u16) -> netns::ChildGuard {
    let mut cmd = Command::new(ECHO_BIN);
    cmd.args(["--port", &port.to_string()]);
    let child = cluster.spawn_in(ns, cmd).expect("echo server");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !inspect::tcp_sockets(&cluster.netns_path(ns))
        .unwrap()
        .iter()
        .any(|e| e.state == inspect::TCP_LISTEN && e.local.port() == port)
    {
        assert!(Instant::now() < deadline, "echo server not listening");
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}

#[test]
fn seq_client_checks_every_echoed_byte() {
    if !ferry_integration::can_run("seq_client_checks_every_echoed_byte") {
        return;
    }
    let cluster = Cluster::start(ClusterSpec::new(1, 1).without_agents()).expect("cluster");
    let _server = echo_server_in(&cluster, "client1", 7000);
    let target = SocketAddrV4::new(cluster.client_addr("client1"), 7000);
    let ns = cluster.netns_path("client1");

    let client = SeqClient::start(&ns, target, 8, Duration::from_millis(5), 300).unwrap();
    client.wait_until_flowing(Duration::from_secs(10)).unwrap();
    let mark = client.verified_per_connection();
    client
        .wait_until_each_passes(&mark, 20, Duration::from_secs(10))
        .unwrap();

    // The probe's connection is visible, by its local address, in the
    // server's namespace, and gone once dropped.
    let probe = ProbeConnection::open(&ns, target).unwrap();
    let peers = inspect::established_peers(&ns, 7000).unwrap();
    assert!(peers.contains(&probe.local_addr()), "{peers:?}");
    for local in client.local_addrs() {
        assert!(peers.contains(local), "{local} not among {peers:?}");
    }
    drop(probe);

    let report = client.stop();
    eprintln!("{report}");
    report.assert_clean();
    assert_eq!(report.connections.len(), 8);
    assert!(
        report
            .connections
            .iter()
            .all(|c| c.verified_messages() >= 21)
    );
    assert_eq!(report.sent_bytes(), report.verified_bytes());
    assert_eq!(report.sent_bytes() % 300, 0, "stop cuts no message");
    let gap = report.max_gap().expect("a gap between echoes");
    assert!(gap.duration >= Duration::from_millis(1), "{gap:?}");
}

#[test]
fn seq_client_reports_corruption_eof_and_reset_precisely() {
    if !ferry_integration::can_run("seq_client_reports_corruption_eof_and_reset_precisely") {
        return;
    }
    let cluster = Cluster::start(ClusterSpec::new(1, 1).without_agents()).expect("cluster");
    let ns = cluster.netns_path("client1");
    let target = SocketAddrV4::new(cluster.client_addr("client1"), 7001);
    let listener = netns::run_in(&ns, || TcpListener::bind(target))
        .unwrap()
        .unwrap();
    // Connections are made in order, so accept order is connection id:
    // 0 gets one flipped bit at byte 1000, 1 is closed after 500 bytes,
    // 2 is reset after 500 bytes, 3 is served faithfully.
    let server = std::thread::spawn(move || {
        let mut conns = Vec::new();
        for id in 0..4 {
            let (mut s, _) = listener.accept().unwrap();
            conns.push(std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let mut off = 0usize;
                loop {
                    let n = match s.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    let end = off + n;
                    if id == 0 && (off..end).contains(&1000) {
                        buf[1000 - off] ^= 0x01;
                    }
                    if (id == 1 || id == 2) && end >= 500 {
                        let _ = s.write_all(&buf[..500 - off]);
                        if id == 1 {
                            // FIN, then swallow the rest: closing with
                            // unread data would send an RST instead.
                            s.shutdown(std::net::Shutdown::Write).unwrap();
                            while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
                        } else {
                            // SO_LINGER 0: close() sends an RST.
                            nix::sys::socket::setsockopt(
                                &s,
                                nix::sys::socket::sockopt::Linger,
                                &libc::linger {
                                    l_onoff: 1,
                                    l_linger: 0,
                                },
                            )
                            .unwrap();
                        }
                        return;
                    }
                    if s.write_all(&buf[..n]).is_err() {
                        return;
                    }
                    off = end;
                }
            }));
        }
        for c in conns {
            c.join().unwrap();
        }
    });

    let client = SeqClient::start(&ns, target, 4, Duration::from_millis(2), 100).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.snapshot().failed_connections < 3 {
        assert!(Instant::now() < deadline, "{:?}", client.snapshot());
        std::thread::sleep(Duration::from_millis(10));
    }
    let mark = client.verified_per_connection();
    assert!(
        client
            .wait_until_each_passes(&mark, 1, Duration::from_secs(1))
            .is_err()
    );
    let report = client.stop_within(Duration::from_secs(2));
    eprintln!("{report}");
    let err = |i: usize| report.connections[i].error.clone().map(|e| e.kind);
    match err(0) {
        Some(StreamErrorKind::Mismatch(m)) => {
            assert_eq!(m.offset, 1000);
            assert_eq!(m.expected ^ m.actual, 0x01);
        }
        other => panic!("connection 0: {other:?}"),
    }
    assert_eq!(err(1), Some(StreamErrorKind::Eof));
    assert!(
        matches!(
            err(2),
            Some(StreamErrorKind::Reset | StreamErrorKind::BrokenPipe)
        ),
        "connection 2: {:?}",
        err(2)
    );
    assert_eq!(report.connections[1].verified_bytes, 500);
    assert!(
        report.connections[3].is_clean(),
        "{:?}",
        report.connections[3]
    );
    assert_eq!(report.failures().len(), 3);
    let failure = report.check_clean().unwrap_err();
    assert!(
        failure.contains("mismatch at byte offset 1000"),
        "{failure}"
    );
    assert!(std::panic::catch_unwind(|| report.assert_clean()).is_err());
    drop(cluster);
    server.join().unwrap();
}

#[test]
fn agent_plumbing_works_with_the_real_agent() {
    if !ferry_integration::can_run("agent_plumbing_works_with_the_real_agent") {
        return;
    }
    use ferry_proto::v1::ListNodesRequest;
    let mut cluster = Cluster::start(ClusterSpec::new(3, 0)).expect("cluster");
    let footprint = Footprint::of(&cluster);

    // Each agent runs in its node's network namespace (and nowhere else).
    for node in cluster.node_names() {
        let pid = cluster.agent_pid(&node);
        assert!(cluster.pids_in(&node).contains(&pid), "{node}");
        assert_eq!(cluster.node_of_pid(pid).unwrap().as_deref(), Some(&*node));
    }

    // Multi-threaded, so the client's idle connections stay serviced while
    // the test blocks: on SIGTERM the agent's graceful shutdown waits for
    // them to go away after its GOAWAY.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let lazy = rt.block_on(async {
        // The agent asks every peer's Hello over the cluster network.
        let mut node1 = cluster.control("node1").await.unwrap();
        let nodes = node1
            .list_nodes(ListNodesRequest {})
            .await
            .unwrap()
            .into_inner()
            .nodes;
        let names: Vec<_> = nodes.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["node1", "node2", "node3"]);
        assert!(nodes[0].is_self);
        assert!(nodes.iter().all(|n| n.reachable), "{nodes:?}");
        assert_eq!(nodes[2].peer_address, "198.19.0.3:7100");

        // Reserving a destination works from inside a runtime too.
        let held = cluster
            .reserve_destination("node1", "node2", "feedfacefeedface")
            .unwrap();
        let busy = cluster
            .reserve_destination("node3", "node2", "other")
            .unwrap_err();
        assert!(busy.to_string().contains("feedfacefeedface"), "{busy}");
        drop(held);
        cluster
            .reserve_destination("node3", "node2", "other")
            .expect("free again after the drop");

        let mut lazy = cluster.control_lazy("node2");
        lazy.list_nodes(ListNodesRequest {}).await.unwrap();
        lazy
    });

    // A clean stop is a SIGTERM the agent obeys; the lazy client finds the
    // restarted agent by itself.
    let status = cluster
        .stop_agent("node2")
        .unwrap()
        .expect("an exit status");
    assert!(status.success(), "{status:?}");
    let mut lazy2 = lazy.clone();
    assert!(rt.block_on(lazy2.list_nodes(ListNodesRequest {})).is_err());
    cluster.start_agent("node2").unwrap();
    rt.block_on(async {
        let mut lazy = lazy;
        lazy.list_nodes(ListNodesRequest {}).await.unwrap();
    });

    drop(cluster);
    footprint.assert_gone();
}
