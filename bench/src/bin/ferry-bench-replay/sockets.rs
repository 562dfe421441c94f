//! The ways of sending them (raw socket, sendmmsg, TUN, AF_PACKET) and the TCP connections restored by TCP_REPAIR that receive them.

use super::*;

pub(crate) fn raw_socket(family: libc::c_int, protocol: libc::c_int) -> std::io::Result<OwnedFd> {
    // SAFETY: socket(2) takes plain integers and returns a new descriptor
    // or -1.
    let fd = unsafe { libc::socket(family, libc::SOCK_RAW | libc::SOCK_CLOEXEC, protocol) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Creates the TUN device `name` in the calling thread's namespace; it
/// disappears with the descriptor.
pub(crate) fn open_tun(name: &str) -> Result<OwnedFd> {
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IFNAMSIZ],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .context("opening /dev/net/tun")?;
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes a struct ifreq, which IfReq lays
    // out (name, the flags union member, padding to 40 bytes); it lives
    // for the whole call.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) };
    if r < 0 {
        return Err(std::io::Error::last_os_error()).context("TUNSETIFF");
    }
    Ok(OwnedFd::from(file))
}

pub(crate) fn setsockopt_raw<T>(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: &T,
) -> Result<()> {
    // SAFETY: value points to a live T of the length given; the kernel
    // only reads it.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (value as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("setsockopt({level}, {name})"));
    }
    Ok(())
}

/// Bytes readable on a stream socket.
pub(crate) fn queued(fd: &OwnedFd) -> Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int, n, which outlives the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut n) };
    if r < 0 {
        return Err(std::io::Error::last_os_error()).context("FIONREAD");
    }
    Ok(n as usize)
}

/// Sends the Ethernet frame `f` on the interface `ifindex`.
pub(crate) fn send_frame(fd: &OwnedFd, ifindex: i32, f: &[u8]) -> Result<()> {
    let mut to = libc::sockaddr_ll {
        sll_family: libc::AF_PACKET as u16,
        sll_protocol: (libc::ETH_P_IP as u16).to_be(),
        sll_ifindex: ifindex,
        sll_hatype: 0,
        sll_pkttype: 0,
        sll_halen: 6,
        sll_addr: [0; 8],
    };
    to.sll_addr[..6].copy_from_slice(&PUB_MAC);
    // SAFETY: f and to are valid for the lengths given during the call;
    // the kernel only reads them.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            f.as_ptr().cast(),
            f.len(),
            0,
            (&to as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error()).context("sending on the veth peer");
    }
    ensure!(
        n as usize == f.len(),
        "short send on {PEER}: {n} of {}",
        f.len()
    );
    Ok(())
}

/// Raw-socket sends in batches of `batch` through sendmmsg(2).
pub(crate) fn send_mmsg(fd: &OwnedFd, packets: &[Vec<u8>], batch: usize) -> Result<()> {
    let mut addrs: Vec<libc::sockaddr_in> = Vec::with_capacity(batch);
    let mut iovs: Vec<libc::iovec> = Vec::with_capacity(batch);
    let mut msgs: Vec<libc::mmsghdr> = Vec::with_capacity(batch);
    for chunk in packets.chunks(batch) {
        addrs.clear();
        iovs.clear();
        msgs.clear();
        for p in chunk {
            addrs.push(libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: 0,
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(dst_of(p).octets()),
                },
                sin_zero: [0; 8],
            });
            iovs.push(libc::iovec {
                iov_base: p.as_ptr() as *mut libc::c_void,
                iov_len: p.len(),
            });
        }
        for i in 0..chunk.len() {
            // SAFETY: mmsghdr is plain data for which all-zero is valid.
            let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
            m.msg_hdr.msg_name = (&mut addrs[i] as *mut libc::sockaddr_in).cast();
            m.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            m.msg_hdr.msg_iov = &mut iovs[i];
            m.msg_hdr.msg_iovlen = 1;
            msgs.push(m);
        }
        let mut done = 0;
        while done < msgs.len() {
            // SAFETY: every header points into addrs, iovs and packets,
            // which are neither moved nor freed until the loop ends; the
            // kernel only reads them (and writes msg_len).
            let r = unsafe {
                libc::sendmmsg(
                    fd.as_raw_fd(),
                    msgs[done..].as_mut_ptr(),
                    (msgs.len() - done) as libc::c_uint,
                    0,
                )
            };
            if r < 0 {
                return Err(std::io::Error::last_os_error()).context("sendmmsg");
            }
            done += r as usize;
        }
    }
    Ok(())
}

/// A server-side connection 198.18.240.1:7004 <-> 198.18.243.7:port made
/// established with TCP_REPAIR, as CRIU restores one.
pub(crate) struct RepairedConn {
    pub(crate) fd: OwnedFd,
    pub(crate) peer_port: u16,
    /// The next sequence number the server expects.
    pub(crate) rcv_nxt: u32,
    /// The server's next sequence number (nothing sent yet).
    pub(crate) snd_nxt: u32,
}

#[repr(C)]
pub(crate) struct TcpRepairOpt {
    code: u32,
    val: u32,
}

#[repr(C)]
pub(crate) struct TcpRepairWindow {
    snd_wl1: u32,
    snd_wnd: u32,
    max_window: u32,
    rcv_wnd: u32,
    rcv_wup: u32,
}

pub(crate) fn repair_connection(
    peer_port: u16,
    snd_nxt: u32,
    rcv_nxt: u32,
) -> Result<RepairedConn> {
    const TCP_RECV_QUEUE: libc::c_int = 1;
    const TCP_SEND_QUEUE: libc::c_int = 2;
    const TCPOPT_MAXSEG: u32 = 2;
    const TCPOPT_WINDOW: u32 = 3;
    const TCP_REPAIR_OFF_NO_WP: libc::c_int = -1;
    let fd = socket::socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let raw = fd.as_raw_fd();
    // The whole run fits in the buffer: nobody reads until it is over.
    socket::setsockopt(&fd, sockopt::RcvBufForce, &(32 << 20))?;
    socket::setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_REPAIR, &1 as &libc::c_int)?;
    socket::bind(raw, &SockaddrIn::from(SocketAddrV4::new(TARGET, TCP_PORT)))?;
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_REPAIR_QUEUE, &TCP_SEND_QUEUE)?;
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_QUEUE_SEQ, &snd_nxt)?;
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_REPAIR_QUEUE, &TCP_RECV_QUEUE)?;
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_QUEUE_SEQ, &rcv_nxt)?;
    socket::connect(raw, &SockaddrIn::from(SocketAddrV4::new(CLIENT, peer_port)))
        .context("repair-mode connect")?;
    let opts = [
        TcpRepairOpt {
            code: TCPOPT_MAXSEG,
            val: 1460,
        },
        TcpRepairOpt {
            code: TCPOPT_WINDOW,
            val: 7 | (7 << 16),
        },
    ];
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_REPAIR_OPTIONS, &opts)?;
    let window = TcpRepairWindow {
        snd_wl1: rcv_nxt,
        snd_wnd: 0xffff << 7,
        max_window: 0xffff << 7,
        rcv_wnd: TCP_WINDOW,
        rcv_wup: rcv_nxt,
    };
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_REPAIR_WINDOW, &window)?;
    setsockopt_raw(raw, libc::SOL_TCP, libc::TCP_REPAIR, &TCP_REPAIR_OFF_NO_WP)?;
    Ok(RepairedConn {
        fd,
        peer_port,
        rcv_nxt,
        snd_nxt,
    })
}

impl RepairedConn {
    /// Closes with a RST (SO_LINGER 0): nothing lingers between runs.
    pub(crate) fn abort(self) {
        let _ = socket::setsockopt(
            &self.fd,
            sockopt::Linger,
            &libc::linger {
                l_onoff: 1,
                l_linger: 0,
            },
        );
    }
}

/// Reads every connection and counts the segments that arrived intact
/// and in order (`n` were sent, round-robin over the connections).
pub(crate) fn verify_tcp(conns: &[RepairedConn], n: usize) -> Result<usize> {
    let mut delivered = 0;
    for (i, c) in conns.iter().enumerate() {
        let segs = n / conns.len() + usize::from(i < n % conns.len());
        let mut data = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match socket::recv(c.fd.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT) {
                Ok(0) => break,
                Ok(r) => data.extend_from_slice(&buf[..r]),
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => return Err(e).with_context(|| format!("reading connection {i}")),
            }
        }
        ensure!(
            data.len() % PAYLOAD == 0 && data.len() / PAYLOAD <= segs,
            "connection {i}: {} bytes for {segs} segments",
            data.len()
        );
        for (seg, chunk) in data.chunks(PAYLOAD).enumerate() {
            ensure!(
                chunk == payload(tcp_tag(i, seg)),
                "connection {i}, segment {seg}: data corrupted"
            );
        }
        delivered += data.len() / PAYLOAD;
    }
    Ok(delivered)
}
