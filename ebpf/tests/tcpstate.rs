//! The TCP state iterator in the real kernel: for each connection asked
//! for, and for none other, it must report what the getsockopt and ioctl
//! calls of TCP repair read, field by field. The connections live on the
//! loopback of a network namespace the test creates (the iterator reads
//! the calling thread's). Needs root.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::process::Command;
use std::time::{Duration, Instant};

use ferry_ebpf::{TaskSocket, TcpClock, TcpKernelState, TcpStateReader};

const SO_COOKIE: libc::c_int = 57;
const TCP_REPAIR: libc::c_int = 19;
const TCP_REPAIR_QUEUE: libc::c_int = 20;
const TCP_QUEUE_SEQ: libc::c_int = 21;
const TCP_REPAIR_WINDOW: libc::c_int = 29;
const TCP_TIMESTAMP: libc::c_int = 24;
const TCP_RECV_QUEUE: i32 = 1;
const TCP_SEND_QUEUE: i32 = 2;
const SIOCOUTQNSD: libc::c_ulong = 0x894B;

fn get<T: Default + Copy>(fd: RawFd, level: i32, opt: i32) -> T {
    let mut v = T::default();
    let mut len = std::mem::size_of::<T>() as libc::socklen_t;
    // SAFETY: `v` is a valid, writable T and `len` its size.
    let r = unsafe { libc::getsockopt(fd, level, opt, (&raw mut v).cast(), &mut len) };
    assert_eq!(
        r,
        0,
        "getsockopt {level}/{opt}: {}",
        std::io::Error::last_os_error()
    );
    v
}

fn set(fd: RawFd, level: i32, opt: i32, v: i32) {
    // SAFETY: `v` is a valid i32 and its size is passed.
    let r = unsafe { libc::setsockopt(fd, level, opt, (&raw const v).cast(), 4) };
    assert_eq!(
        r,
        0,
        "setsockopt {level}/{opt}: {}",
        std::io::Error::last_os_error()
    );
}

fn ioctl(fd: RawFd, req: libc::c_ulong) -> u32 {
    let mut v: libc::c_int = 0;
    // SAFETY: these socket ioctls write one int.
    let r = unsafe { libc::ioctl(fd, req, &mut v) };
    assert_eq!(r, 0, "ioctl {req:#x}: {}", std::io::Error::last_os_error());
    v as u32
}

/// What the calls read of `fd`, in repair mode, as the iterator's record.
fn by_calls(fd: RawFd) -> TcpKernelState {
    let info: [u8; 8] = get(fd, libc::SOL_TCP, libc::TCP_INFO);
    let window: [u32; 5] = get(fd, libc::SOL_TCP, TCP_REPAIR_WINDOW);
    set(fd, libc::SOL_TCP, TCP_REPAIR_QUEUE, TCP_RECV_QUEUE);
    let rcv_nxt: u32 = get(fd, libc::SOL_TCP, TCP_QUEUE_SEQ);
    set(fd, libc::SOL_TCP, TCP_REPAIR_QUEUE, TCP_SEND_QUEUE);
    let write_seq: u32 = get(fd, libc::SOL_TCP, TCP_QUEUE_SEQ);
    let outq = ioctl(fd, libc::TIOCOUTQ);
    let unsent = ioctl(fd, SIOCOUTQNSD);
    let inq = ioctl(fd, libc::FIONREAD);
    TcpKernelState {
        cookie: get(fd, libc::SOL_SOCKET, SO_COOKIE),
        state: u32::from(info[0]),
        write_seq,
        snd_una: write_seq.wrapping_sub(outq),
        snd_nxt: write_seq.wrapping_sub(unsent),
        rcv_nxt,
        copied_seq: rcv_nxt.wrapping_sub(inq),
        snd_wl1: window[0],
        snd_wnd: window[1],
        max_window: window[2],
        rcv_wnd: window[3],
        rcv_wup: window[4],
        sndbuf: get(fd, libc::SOL_SOCKET, libc::SO_SNDBUF),
        rcvbuf: get(fd, libc::SOL_SOCKET, libc::SO_RCVBUF),
        urg_data: 0,
        mss_clamp: get::<i32>(fd, libc::SOL_TCP, libc::TCP_MAXSEG) as u32,
        // No call reads the offset alone: `timestamps_agree` checks it.
        tsoffset: 0,
    }
}

/// The record's fields against the calls', the offset aside.
fn same_as_calls(record: &TcpKernelState, calls: &TcpKernelState) {
    let mut record = *record;
    record.tsoffset = 0;
    assert_eq!(record, *calls);
}

/// The timestamp the record gives at a clock read between two
/// TCP_TIMESTAMP calls falls between them (their ticks are milliseconds on
/// loopback, which negotiates no microsecond timestamps), with the low
/// bit clear as Linux 6.7+ keeps it for millisecond ticks.
fn timestamps_agree(record: &TcpKernelState, fd: RawFd) {
    let before: u32 = get(fd, libc::SOL_TCP, TCP_TIMESTAMP);
    let clock = TcpClock::now().expect("the clock");
    let after: u32 = get(fd, libc::SOL_TCP, TCP_TIMESTAMP);
    let ours = record.timestamp(clock, false);
    assert_eq!(ours & 1, 0, "{ours}");
    // The low bit cleared may put ours one tick below `before`.
    assert!(
        ours.wrapping_sub(before & !1) <= after.wrapping_sub(before & !1),
        "TCP_TIMESTAMP {before}..{after}, from the record {ours} (offset {})",
        record.tsoffset
    );
}

/// Runs `test` as root on a thread of its own, in a new network namespace
/// with its loopback up (the namespace's pass reads the calling thread's);
/// says it skipped otherwise.
fn in_a_new_netns(test: impl FnOnce() + Send + 'static) {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root (BPF, network namespaces)");
        return;
    }
    std::thread::spawn(|| {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare the netns");
        let up = Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .expect("ip");
        assert!(up.success());
        test();
    })
    .join()
    .expect("namespace thread");
}

/// A `sleep` holding no socket: spawned, and waited for (bounded) until
/// its exec closed the descriptors it copied from this process (the spawn
/// returns once the new program is mapped, before that).
fn settled_sleep() -> std::process::Child {
    let child = Command::new("sleep").arg("30").spawn().expect("sleep");
    let fds = format!("/proc/{}/fd", child.id());
    let deadline = Instant::now() + Duration::from_secs(5);
    let holds_a_socket = || {
        std::fs::read_dir(&fds)
            .expect("sleep's descriptors")
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .any(|l| l.to_string_lossy().starts_with("socket:"))
    };
    while holds_a_socket() {
        assert!(
            Instant::now() < deadline,
            "sleep kept this process's sockets"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    child
}

#[test]
fn the_iterator_reads_what_the_repair_calls_read() {
    in_a_new_netns(|| {
        let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
        let mut pairs = Vec::new();
        for _ in 0..4 {
            let client = TcpStream::connect(listener.local_addr().unwrap()).expect("connect");
            let (server, _) = listener.accept().expect("accept");
            pairs.push((client, server));
        }
        // Unread bytes at two servers; one server's bytes unread by its
        // client; one connection left out of the request.
        pairs[0].0.write_all(b"unread at the server").unwrap();
        pairs[1].0.write_all(&[7u8; 3000]).unwrap();
        pairs[2].1.write_all(b"unread at the client").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while ioctl(pairs[0].1.as_raw_fd(), libc::FIONREAD) < 20
            || ioctl(pairs[1].1.as_raw_fd(), libc::FIONREAD) < 3000
            || ioctl(pairs[2].1.as_raw_fd(), libc::TIOCOUTQ) != 0
        {
            assert!(Instant::now() < deadline, "bytes never arrived");
            std::thread::sleep(Duration::from_millis(1));
        }
        let asked: Vec<RawFd> = pairs[..3].iter().map(|(_, s)| s.as_raw_fd()).collect();
        let mut reader = TcpStateReader::load().expect("load the iterator");
        reader
            .want(
                asked
                    .iter()
                    .map(|&fd| get::<u64>(fd, libc::SOL_SOCKET, SO_COOKIE)),
            )
            .expect("ask");
        // Read without repair mode (nothing moves here: no packet is in
        // flight), which the calls below need.
        let read = reader.read().expect("read the iterator");
        assert_eq!(read.len(), 3, "{read:#?}");
        for &fd in &asked {
            set(fd, libc::SOL_TCP, TCP_REPAIR, 1);
        }
        for &fd in &asked {
            let calls = by_calls(fd);
            let it = read
                .iter()
                .find(|r| r.cookie == calls.cookie)
                .unwrap_or_else(|| panic!("cookie {} not reported", calls.cookie));
            same_as_calls(it, &calls);
            timestamps_agree(it, fd);
        }
        assert_eq!(read.iter().map(TcpKernelState::inq).max(), Some(3000));
        // The per-process pass reads the same, from this process's
        // descriptors, and nothing from a process that holds none of them.
        assert!(
            reader.reads_by_process(),
            "the per-process iterator loads here"
        );
        let mut by_process = reader
            .read_processes(&[std::process::id() as i32])
            .expect("read this process's iterator");
        let mut by_namespace = read.clone();
        by_process.sort_by_key(|r| r.cookie);
        by_namespace.sort_by_key(|r| r.cookie);
        assert_eq!(by_process, by_namespace);
        let mut other = settled_sleep();
        let none = reader.read_processes(&[other.id() as i32]);
        let _ = other.kill();
        let _ = other.wait();
        assert_eq!(none.expect("read another process's iterator"), vec![]);
        // Given back and taken again (the next migration's), the reader
        // asks for nothing until told: the same pass reports no record.
        let spare = TcpStateReader::spare();
        reader.give_back();
        assert_eq!(TcpStateReader::spare(), spare + 1, "kept for later");
        let mut again = TcpStateReader::take().expect("take a reader");
        assert_eq!(TcpStateReader::spare(), spare, "the kept one was taken");
        assert_eq!(
            again
                .read_processes(&[std::process::id() as i32])
                .expect("read with the reader taken again"),
            vec![]
        );
        again
            .want([get::<u64>(asked[1], libc::SOL_SOCKET, SO_COOKIE)])
            .expect("ask again");
        let one = again
            .read_processes(&[std::process::id() as i32])
            .expect("read one connection");
        assert_eq!(one.len(), 1, "{one:#?}");
        same_as_calls(&one[0], &by_calls(asked[1]));
        for &fd in &asked {
            set(fd, libc::SOL_TCP, TCP_REPAIR, 0);
        }
        // The connections are whole after the read.
        let mut got = [0u8; 20];
        pairs[0].1.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"unread at the server");
    });
}

/// What the calls say of socket descriptor `fd`, as the listing's record.
fn socket_by_calls(fd: RawFd) -> TaskSocket {
    // SAFETY: an all-zero stat is a valid value for fstat to overwrite.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable stat.
    assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0, "fstat {fd}");
    let family = get::<i32>(fd, libc::SOL_SOCKET, libc::SO_DOMAIN) as u16;
    let kind = get::<i32>(fd, libc::SOL_SOCKET, libc::SO_TYPE) as u16;
    let protocol = get::<i32>(fd, libc::SOL_SOCKET, libc::SO_PROTOCOL) as u16;
    let state = if protocol == libc::IPPROTO_TCP as u16 {
        get::<[u8; 8]>(fd, libc::SOL_TCP, libc::TCP_INFO)[0]
    } else {
        0
    };
    TaskSocket {
        inode: st.st_ino,
        fd: fd as u32,
        family,
        kind,
        protocol,
        state,
    }
}

#[test]
fn the_socket_listing_names_each_socket_descriptor_as_its_calls_do() {
    in_a_new_netns(|| {
        let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
        let client = TcpStream::connect(listener.local_addr().unwrap()).expect("connect");
        let (server, _) = listener.accept().expect("accept");
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
        let (unix_a, _unix_b) = std::os::unix::net::UnixStream::pair().expect("socketpair");
        let file = std::fs::File::open("/proc/self/stat").expect("a file");
        let mut reader = TcpStateReader::load().expect("load the iterators");
        assert!(
            reader.reads_by_process(),
            "the per-process iterators load here"
        );
        let listed = reader
            .list_sockets(std::process::id() as i32)
            .expect("list this process's sockets");
        // Other tests' threads may open and close descriptors meanwhile:
        // only this test's are compared.
        for fd in [
            listener.as_raw_fd(),
            client.as_raw_fd(),
            server.as_raw_fd(),
            udp.as_raw_fd(),
            unix_a.as_raw_fd(),
        ] {
            let record = listed
                .iter()
                .find(|s| s.fd == fd as u32)
                .unwrap_or_else(|| panic!("descriptor {fd} not listed: {listed:#?}"));
            // No call reads the state of a socket that is no TCP one.
            let mut record = *record;
            if record.protocol != libc::IPPROTO_TCP as u16 {
                record.state = 0;
            }
            assert_eq!(record, socket_by_calls(fd));
        }
        assert!(
            !listed.iter().any(|s| s.fd == file.as_raw_fd() as u32),
            "a file listed as a socket: {listed:#?}"
        );
        let state = |fd: RawFd| listed.iter().find(|s| s.fd == fd as u32).unwrap().state;
        assert_eq!(state(listener.as_raw_fd()), 10, "LISTEN");
        assert_eq!(state(server.as_raw_fd()), 1, "ESTABLISHED");
        // A process without sockets lists none.
        let mut other = settled_sleep();
        let none = reader.list_sockets(other.id() as i32);
        let _ = other.kill();
        let _ = other.wait();
        assert_eq!(none.expect("list another process's sockets"), vec![]);
    });
}
