//! A connection's socket options, read on the source and set on the
//! rebuilt socket, when ferryd carries them instead of CRIU (ferry's
//! `tcp-options-by-caller` patch; `PrepareResponse.takes_tcp_options`).
//!
//! The set is CRIU's for a TCP socket (its SkOptsEntry, IpOptsEntry and
//! TcpOptsEntry), so a migration keeps exactly what it kept before. CRIU
//! read them one getsockopt at a time inside its single-threaded dump and
//! set them again inside its restore; ferryd reads them beside the dump,
//! spread over the cores with the connections' state, and sets them while
//! it rebuilds the connections, before the restore starts.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use ferry_proto::v1::TcpSocketOptions;

use super::sys;

// Not in the libc crate for every target it builds.
const SO_BUF_LOCK: libc::c_int = 72;
const IPV6_FREEBIND: libc::c_int = 78;

/// The receive buffer's bit in SO_BUF_LOCK (SOCK_RCVBUF_LOCK): its size
/// was set by the process, and the kernel no longer tunes it.
pub const RCVBUF_LOCKED: u32 = 2;

/// Reads them all (about thirty getsockopt calls).
pub fn read(fd: BorrowedFd<'_>, ipv6: bool) -> io::Result<TcpSocketOptions> {
    let int = |level, opt| sys::get_int(fd, level, opt);
    let flag = |level, opt| sys::get_int(fd, level, opt).map(|v| v != 0);
    let timeout = |opt| {
        let mut tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        };
        sys::get_into(fd, libc::SOL_SOCKET, opt, &mut tv)?;
        Ok::<u64, io::Error>(tv.tv_sec.max(0) as u64 * 1_000_000 + tv.tv_usec.max(0) as u64)
    };
    let mut linger = libc::linger {
        l_onoff: 0,
        l_linger: 0,
    };
    sys::get_into(fd, libc::SOL_SOCKET, libc::SO_LINGER, &mut linger)?;
    let (freebind, pktinfo, tos, ttl) = if ipv6 {
        (
            flag(libc::SOL_IPV6, IPV6_FREEBIND)?,
            flag(libc::SOL_IPV6, libc::IPV6_RECVPKTINFO)?,
            0,
            0,
        )
    } else {
        (
            flag(libc::SOL_IP, libc::IP_FREEBIND)?,
            flag(libc::SOL_IP, libc::IP_PKTINFO)?,
            int(libc::SOL_IP, libc::IP_TOS)? as u32,
            int(libc::SOL_IP, libc::IP_TTL)? as u32,
        )
    };
    Ok(TcpSocketOptions {
        rcvbuf: int(libc::SOL_SOCKET, libc::SO_RCVBUF)? as u32,
        buf_lock: int(libc::SOL_SOCKET, SO_BUF_LOCK)? as u32,
        priority: int(libc::SOL_SOCKET, libc::SO_PRIORITY)?,
        rcvlowat: int(libc::SOL_SOCKET, libc::SO_RCVLOWAT)?,
        mark: int(libc::SOL_SOCKET, libc::SO_MARK)? as u32,
        send_timeout_us: timeout(libc::SO_SNDTIMEO)?,
        recv_timeout_us: timeout(libc::SO_RCVTIMEO)?,
        reuseport: flag(libc::SOL_SOCKET, libc::SO_REUSEPORT)?,
        dontroute: flag(libc::SOL_SOCKET, libc::SO_DONTROUTE)?,
        no_check: flag(libc::SOL_SOCKET, libc::SO_NO_CHECK)?,
        broadcast: flag(libc::SOL_SOCKET, libc::SO_BROADCAST)?,
        keepalive: flag(libc::SOL_SOCKET, libc::SO_KEEPALIVE)?,
        oobinline: flag(libc::SOL_SOCKET, libc::SO_OOBINLINE)?,
        linger: linger.l_onoff != 0,
        linger_secs: linger.l_linger,
        bound_device: bound_device(fd)?,
        filter: filter(fd)?,
        freebind,
        pktinfo,
        tos,
        ttl,
        nodelay: flag(libc::SOL_TCP, libc::TCP_NODELAY)?,
        cork: flag(libc::SOL_TCP, libc::TCP_CORK)?,
        keepcnt: int(libc::SOL_TCP, libc::TCP_KEEPCNT)? as u32,
        keepidle: int(libc::SOL_TCP, libc::TCP_KEEPIDLE)? as u32,
        keepintvl: int(libc::SOL_TCP, libc::TCP_KEEPINTVL)? as u32,
    })
}

/// What a new TCP socket of a network namespace reports for the keepalive
/// timings, IP_TTL and the receive buffer's size: the namespace's sysctls,
/// until a process sets them (or the kernel tunes the buffer). CRIU's
/// restore set those whenever they were not zero, that is on every
/// connection; [`apply`] leaves one alone where the source's value is this
/// one, since the rebuilt socket has it already. At 1024 connections that
/// is up to five thousand calls fewer on the cores the restore runs on.
/// The default (all zero) is CRIU's rule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NewSocketDefaults {
    pub keepcnt: u32,
    pub keepidle: u32,
    pub keepintvl: u32,
    pub ttl: u32,
    /// SO_RCVBUF (twice what SO_RCVBUFFORCE takes). Connecting in repair
    /// mode leaves it as it is.
    pub rcvbuf: u32,
}

impl NewSocketDefaults {
    /// Those of a new IPv4 TCP socket in the calling thread's network
    /// namespace (the keepalive timings are the same for IPv6; TTL is
    /// IPv4's).
    pub fn here() -> io::Result<Self> {
        use nix::sys::socket::{AddressFamily, SockFlag, SockProtocol, SockType, socket};
        let sock = socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::Tcp,
        )?;
        let fd = std::os::fd::AsFd::as_fd(&sock);
        let int = |level, opt| sys::get_int(fd, level, opt).map(|v| v.max(0) as u32);
        Ok(Self {
            keepcnt: int(libc::SOL_TCP, libc::TCP_KEEPCNT)?,
            keepidle: int(libc::SOL_TCP, libc::TCP_KEEPIDLE)?,
            keepintvl: int(libc::SOL_TCP, libc::TCP_KEEPINTVL)?,
            ttl: int(libc::SOL_IP, libc::IP_TTL)?,
            rcvbuf: int(libc::SOL_SOCKET, libc::SO_RCVBUF)?,
        })
    }
}

/// Sets them on `fd`, as CRIU's restore did: the receive buffer's size
/// forced (and the buffers' lock bits given back), every other option only
/// where it differs from what a new socket has. The keepalive timings and
/// IP_TTL are compared with `defaults`, read from a new socket of this
/// namespace (CRIU set them whenever they were not zero), IP_TOS with
/// zero. The send buffer's size is not among them: the rebuild sets it,
/// before it refills the queues (`TcpConnectionState::sndbuf`).
pub fn apply(
    fd: BorrowedFd<'_>,
    o: &TcpSocketOptions,
    ipv6: bool,
    defaults: &NewSocketDefaults,
) -> Result<(), (&'static str, io::Error)> {
    let set = |what: &'static str, level, opt, v: i32| {
        sys::set_int(fd, level, opt, v).map_err(|e| (what, e))
    };
    // getsockopt reports twice what setsockopt takes.
    if o.rcvbuf > 0 && o.rcvbuf != defaults.rcvbuf {
        set(
            "SO_RCVBUFFORCE",
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            half(o.rcvbuf),
        )?;
    }
    // Forcing the sizes locked them; the source's lock bits come back
    // (none: the kernel autotunes them again, as it did there).
    set(
        "SO_BUF_LOCK",
        libc::SOL_SOCKET,
        SO_BUF_LOCK,
        o.buf_lock as i32,
    )?;
    if o.priority != 0 {
        set(
            "SO_PRIORITY",
            libc::SOL_SOCKET,
            libc::SO_PRIORITY,
            o.priority,
        )?;
    }
    if o.rcvlowat != 1 {
        set(
            "SO_RCVLOWAT",
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            o.rcvlowat,
        )?;
    }
    if o.mark != 0 {
        set("SO_MARK", libc::SOL_SOCKET, libc::SO_MARK, o.mark as i32)?;
    }
    for (what, opt, us) in [
        ("SO_SNDTIMEO", libc::SO_SNDTIMEO, o.send_timeout_us),
        ("SO_RCVTIMEO", libc::SO_RCVTIMEO, o.recv_timeout_us),
    ] {
        if us != 0 {
            let tv = libc::timeval {
                tv_sec: (us / 1_000_000) as libc::time_t,
                tv_usec: (us % 1_000_000) as libc::suseconds_t,
            };
            sys::set_struct(fd, libc::SOL_SOCKET, opt, &tv).map_err(|e| (what, e))?;
        }
    }
    for (what, opt, on) in [
        ("SO_REUSEPORT", libc::SO_REUSEPORT, o.reuseport),
        ("SO_DONTROUTE", libc::SO_DONTROUTE, o.dontroute),
        ("SO_NO_CHECK", libc::SO_NO_CHECK, o.no_check),
        ("SO_BROADCAST", libc::SO_BROADCAST, o.broadcast),
        ("SO_KEEPALIVE", libc::SO_KEEPALIVE, o.keepalive),
        ("SO_OOBINLINE", libc::SO_OOBINLINE, o.oobinline),
    ] {
        if on {
            set(what, libc::SOL_SOCKET, opt, 1)?;
        }
    }
    if o.linger {
        let l = libc::linger {
            l_onoff: 1,
            l_linger: o.linger_secs,
        };
        sys::set_struct(fd, libc::SOL_SOCKET, libc::SO_LINGER, &l).map_err(|e| ("SO_LINGER", e))?;
    }
    if !o.bound_device.is_empty() {
        sys::set_slice(
            fd,
            libc::SOL_SOCKET,
            libc::SO_BINDTODEVICE,
            o.bound_device.as_bytes(),
        )
        .map_err(|e| ("SO_BINDTODEVICE", e))?;
    }
    if !o.filter.is_empty() {
        attach_filter(fd, &o.filter).map_err(|e| ("SO_ATTACH_FILTER", e))?;
    }
    if ipv6 {
        if o.freebind {
            set("IPV6_FREEBIND", libc::SOL_IPV6, IPV6_FREEBIND, 1)?;
        }
        if o.pktinfo {
            set(
                "IPV6_RECVPKTINFO",
                libc::SOL_IPV6,
                libc::IPV6_RECVPKTINFO,
                1,
            )?;
        }
    } else {
        if o.freebind {
            set("IP_FREEBIND", libc::SOL_IP, libc::IP_FREEBIND, 1)?;
        }
        if o.pktinfo {
            set("IP_PKTINFO", libc::SOL_IP, libc::IP_PKTINFO, 1)?;
        }
        if o.tos != 0 {
            set("IP_TOS", libc::SOL_IP, libc::IP_TOS, o.tos as i32)?;
        }
        if o.ttl != 0 && o.ttl != defaults.ttl {
            set("IP_TTL", libc::SOL_IP, libc::IP_TTL, o.ttl as i32)?;
        }
    }
    for (what, opt, v, default) in [
        ("TCP_NODELAY", libc::TCP_NODELAY, u32::from(o.nodelay), 0),
        ("TCP_CORK", libc::TCP_CORK, u32::from(o.cork), 0),
        (
            "TCP_KEEPCNT",
            libc::TCP_KEEPCNT,
            o.keepcnt,
            defaults.keepcnt,
        ),
        (
            "TCP_KEEPIDLE",
            libc::TCP_KEEPIDLE,
            o.keepidle,
            defaults.keepidle,
        ),
        (
            "TCP_KEEPINTVL",
            libc::TCP_KEEPINTVL,
            o.keepintvl,
            defaults.keepintvl,
        ),
    ] {
        if v != 0 && v != default {
            set(what, libc::SOL_TCP, opt, v as i32)?;
        }
    }
    Ok(())
}

fn half(v: u32) -> i32 {
    (v / 2).min(i32::MAX as u32) as i32
}

fn bound_device(fd: BorrowedFd<'_>) -> io::Result<String> {
    let mut name = [0u8; libc::IFNAMSIZ];
    let len = sys::get_into(fd, libc::SOL_SOCKET, libc::SO_BINDTODEVICE, &mut name)?;
    let name = &name[..len.min(name.len())];
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Ok(String::from_utf8_lossy(&name[..end]).into_owned())
}

/// The classic BPF filter attached to the socket, CRIU's encoding (one
/// u64 per instruction); empty without one.
fn filter(fd: BorrowedFd<'_>) -> io::Result<Vec<u64>> {
    // SO_GET_FILTER's length is in instructions, not bytes.
    let mut len: libc::socklen_t = 0;
    // SAFETY: a null buffer with length 0 asks the kernel for the length
    // only; it writes `len`.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_GET_FILTER,
            std::ptr::null_mut(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    if len == 0 {
        return Ok(Vec::new());
    }
    let mut insns = vec![
        libc::sock_filter {
            code: 0,
            jt: 0,
            jf: 0,
            k: 0,
        };
        len as usize
    ];
    // SAFETY: `insns` holds `len` instructions, which is what the kernel
    // may write (it fails with EINVAL if the filter grew since).
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_GET_FILTER,
            insns.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    insns.truncate(len as usize);
    Ok(insns
        .iter()
        .map(|f| {
            (u64::from(f.code) << 48)
                | (u64::from(f.jt) << 40)
                | (u64::from(f.jf) << 32)
                | u64::from(f.k)
        })
        .collect())
}

fn attach_filter(fd: BorrowedFd<'_>, encoded: &[u64]) -> io::Result<()> {
    let mut insns: Vec<libc::sock_filter> = encoded
        .iter()
        .map(|&v| libc::sock_filter {
            code: (v >> 48) as u16,
            jt: (v >> 40) as u8,
            jf: (v >> 32) as u8,
            k: v as u32,
        })
        .collect();
    let prog = libc::sock_fprog {
        len: u16::try_from(insns.len()).map_err(|_| io::Error::other("filter too long"))?,
        filter: insns.as_mut_ptr(),
    };
    sys::set_struct(fd, libc::SOL_SOCKET, libc::SO_ATTACH_FILTER, &prog)
}
