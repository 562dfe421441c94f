//! The setsockopt watch in the real kernel: attached to this test's own
//! cgroup, it must record exactly the connections a setsockopt call was
//! made on, told apart by network namespace, and be gone once dropped.
//! Each connection lives on the loopback of a network namespace the test
//! creates (and that goes with its last socket). Needs root; skipped with
//! a reason otherwise.

use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::process::Command;

use ferry_ebpf::{SockoptWatch, WatchedConnection, cgroup_v2_dir};

const SO_NETNS_COOKIE: libc::c_int = 71;

/// Both ends of one loopback connection in a new network namespace, with
/// fixed ports so that two namespaces hold the very same 4-tuple.
struct Pair {
    client: TcpStream,
    server: TcpStream,
    netns: u64,
}

fn pair_in_new_netns() -> Pair {
    std::thread::spawn(|| {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare the netns");
        // A child forked from this thread starts in its namespace.
        let up = Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .expect("running ip");
        assert!(up.success(), "ip link set lo up");
        let listener = TcpListener::bind("127.0.0.1:5000").expect("listen");
        let client = TcpStream::from(bound_and_connected("127.0.0.1:6000", "127.0.0.1:5000"));
        let (server, _) = listener.accept().expect("accept");
        let netns = cookie(&server);
        Pair {
            client,
            server,
            netns,
        }
    })
    .join()
    .expect("namespace thread")
}

/// A TCP socket bound to `local` and connected to `remote`.
fn bound_and_connected(local: &str, remote: &str) -> std::os::fd::OwnedFd {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, socket};
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("socket");
    let l: SockaddrIn = local.parse::<std::net::SocketAddrV4>().unwrap().into();
    let r: SockaddrIn = remote.parse::<std::net::SocketAddrV4>().unwrap().into();
    bind(fd.as_raw_fd(), &l).expect("bind");
    connect(fd.as_raw_fd(), &r).expect("connect");
    fd
}

fn cookie(s: &TcpStream) -> u64 {
    let mut v = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: v is a u64 the kernel writes at most `len` (8) bytes into;
    // the descriptor is the open socket `s`.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut v).cast(),
            &mut len,
        )
    };
    assert_eq!(
        rc,
        0,
        "SO_NETNS_COOKIE: {}",
        std::io::Error::last_os_error()
    );
    v
}

fn seen_from(s: &TcpStream, netns: u64) -> WatchedConnection {
    WatchedConnection::new(netns, s.local_addr().unwrap(), s.peer_addr().unwrap())
}

fn ids_named_like_ours() -> Vec<u32> {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter(|p| {
            p.name_as_str()
                .is_some_and(|n| n.starts_with("ferry_sockopt"))
        })
        .map(|p| p.id())
        .collect()
}

#[test]
fn setsockopt_calls_are_recorded_per_connection_and_namespace() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root (network namespaces, eBPF)");
        return;
    }
    let one = pair_in_new_netns();
    let two = pair_in_new_netns();
    assert_ne!(one.netns, two.netns);
    // The same 4-tuple in both namespaces.
    assert_eq!(
        one.server.local_addr().unwrap(),
        two.server.local_addr().unwrap()
    );
    assert_eq!(
        one.server.peer_addr().unwrap(),
        two.server.peer_addr().unwrap()
    );
    // Set before the watch: not its business.
    two.client.set_nodelay(true).unwrap();

    let dir = cgroup_v2_dir(std::process::id() as i32).expect("this test's cgroup v2");
    let watch = SockoptWatch::attach(&[dir.clone(), dir]).expect("attach the watch");
    assert_eq!(watch.cgroups().len(), 1, "one attach per distinct cgroup");
    let id = watch.program_id().expect("the program's id");
    let before = watch.touched().expect("read the watch");
    assert!(before.connections.is_empty(), "{:?}", before.connections);

    one.server.set_nodelay(true).unwrap();
    one.server.set_ttl(17).unwrap();
    // A listening socket and an unconnected one are no connections.
    let listener = TcpListener::bind("0.0.0.0:0").unwrap();
    listener.set_ttl(9).unwrap();

    let touched = watch.touched().expect("read the watch");
    assert_eq!(touched.lost, 0);
    let server_one = seen_from(&one.server, one.netns);
    assert_eq!(
        touched.connections,
        [server_one].into_iter().collect(),
        "exactly the connection set on, in its own namespace"
    );
    assert!(touched.may_have_changed(&server_one));
    assert!(!touched.may_have_changed(&seen_from(&two.server, two.netns)));
    assert!(!touched.may_have_changed(&seen_from(&one.client, one.netns)));

    // Later calls add to it; a second call on the same connection does not
    // count twice.
    two.server.set_nodelay(false).unwrap();
    one.server.set_nodelay(false).unwrap();
    let touched = watch.touched().expect("read the watch");
    assert_eq!(touched.connections.len(), 2);
    assert!(touched.may_have_changed(&seen_from(&two.server, two.netns)));

    // Narrowed to namespace one: calls in two are no longer recorded.
    let mut watch = watch;
    watch.only_netns(one.netns).expect("narrow the watch");
    two.client.set_nodelay(false).unwrap();
    one.client.set_nodelay(false).unwrap();
    let touched = watch.touched().expect("read the watch");
    assert!(!touched.may_have_changed(&seen_from(&two.client, two.netns)));
    assert!(touched.may_have_changed(&seen_from(&one.client, one.netns)));
    assert_eq!(touched.connections.len(), 3);
    // The calls themselves took effect (the program leaves them alone).
    assert!(!one.server.nodelay().unwrap());
    assert_eq!(one.server.ttl().unwrap(), 17);

    assert!(ids_named_like_ours().contains(&id));
    drop(watch);
    // Detached, the program stays loaded for the next watch, and the calls
    // go on.
    assert!(
        ids_named_like_ours().contains(&id),
        "kept for the next watch"
    );
    one.server.set_nodelay(true).unwrap();
    assert!(one.server.nodelay().unwrap());
    // The next watch takes it (no new load) as a new one: nothing touched,
    // nothing lost, every namespace recorded again.
    let watch = SockoptWatch::attach(&[dir_again()]).expect("attach again");
    assert_eq!(
        watch.program_id().expect("the program's id"),
        id,
        "the detached program is taken again"
    );
    let fresh = watch.touched().expect("read the new watch");
    assert_eq!(fresh.lost, 0);
    assert!(fresh.connections.is_empty(), "{:?}", fresh.connections);
    two.server.set_ttl(33).unwrap();
    assert_eq!(
        watch.touched().expect("read the new watch").connections,
        [seen_from(&two.server, two.netns)].into_iter().collect(),
        "no longer narrowed to namespace one"
    );
    drop(watch);
}

fn dir_again() -> std::path::PathBuf {
    cgroup_v2_dir(std::process::id() as i32).expect("this test's cgroup v2")
}
