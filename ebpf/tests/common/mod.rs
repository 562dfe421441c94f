//! What the ownership filter's tests share: a client and a node namespace
//! joined by a veth, the client sending every frame for the node to the
//! broadcast MAC, as the cluster's router does.
#![allow(dead_code)]

use std::fs::File;
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use aya::programs::{SchedClassifier, TcAttachType};
use ferry_ebpf::OwnershipFilter;

pub const NODE_IP: &str = "198.18.1.100";
/// The node's IPv6 address, in the benchmarking prefix 2001:2::/48 (RFC
/// 5180), IPv6's counterpart of 198.18.0.0/15.
pub const NODE_IP6: &str = "2001:2:0:1::100";

/// The address family a test runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    /// The node's address and `port`.
    pub fn addr(self, port: u16) -> SocketAddr {
        match self {
            Family::V4 => format!("{NODE_IP}:{port}"),
            Family::V6 => format!("[{NODE_IP6}]:{port}"),
        }
        .parse()
        .unwrap()
    }

    /// The wildcard address of the family and `port`, to bind to.
    pub fn any(self, port: u16) -> SocketAddr {
        match self {
            Family::V4 => format!("0.0.0.0:{port}"),
            Family::V6 => format!("[::]:{port}"),
        }
        .parse()
        .unwrap()
    }
}
pub const NODE_IFACE: &str = "pub0";

pub fn is_root() -> bool {
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

pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A client and a node namespace, deleted on drop, also when the test
/// panics.
pub struct Net {
    pub client: String,
    pub node: String,
}

impl Net {
    pub fn new() -> Self {
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
        for (ns, dev, addr, addr6) in [
            (&net.client, "eth0", "198.18.1.1/24", "2001:2:0:1::1/64"),
            (
                &net.node,
                NODE_IFACE,
                "198.18.1.100/24",
                "2001:2:0:1::100/64",
            ),
        ] {
            ip(&["-n", ns, "addr", "add", addr, "dev", dev]);
            // nodad: usable at once (no second of duplicate detection).
            ip(&["-n", ns, "addr", "add", addr6, "dev", dev, "nodad"]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        // As in the cluster: every frame for the node's address is a
        // broadcast frame, so it arrives as PACKET_BROADCAST.
        for node_ip in [NODE_IP, NODE_IP6] {
            ip(&[
                "-n",
                &net.client,
                "neigh",
                "replace",
                node_ip,
                "lladdr",
                "ff:ff:ff:ff:ff:ff",
                "dev",
                "eth0",
                "nud",
                "permanent",
            ]);
        }
        net
    }

    /// Runs `f` on a thread that joined namespace `ns` (network only).
    /// Sockets and netlink handles it creates stay bound to that namespace
    /// wherever they are used later.
    pub fn within<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{ns}");
        std::thread::spawn(move || {
            let fd = File::open(&path).expect("netns file");
            nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .expect("thread in namespace")
    }

    pub fn client<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        Self::within(&self.client, f)
    }

    pub fn node<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        Self::within(&self.node, f)
    }

    /// The filter on the node's public interface.
    pub fn attach(&self) -> OwnershipFilter {
        self.node(|| OwnershipFilter::attach(NODE_IFACE).expect("attach"))
    }

    /// Names of the tcx programs on the node's interface in one direction.
    pub fn tcx_programs(&self, direction: TcAttachType) -> Vec<String> {
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

pub fn addr(port: u16) -> SocketAddr {
    format!("{NODE_IP}:{port}").parse().unwrap()
}

/// Asserts that a read saw nothing: a timeout, not data and not a reset.
/// A read interrupted by a signal (another test's child exiting: a
/// socket read with a timeout is never restarted, SA_RESTART or not) is
/// read again.
#[track_caller]
pub fn assert_silent(mut read: impl FnMut() -> std::io::Result<usize>, what: &str) {
    loop {
        match read() {
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return,
            other => panic!("{what}: expected silence, got {other:?}"),
        }
    }
}
