//! The system calls of TCP repair (Linux `TCP_REPAIR`, 3.11+; the window
//! since 4.8) and of taking a descriptor out of another process
//! (`pidfd_getfd`, 5.6+). Everything unsafe in `sockstate` is here, each
//! call with its buffer sizes checked.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

// <linux/tcp.h>; the libc crate lacks some of them.
pub const TCP_REPAIR: libc::c_int = 19;
pub const TCP_REPAIR_QUEUE: libc::c_int = 20;
pub const TCP_QUEUE_SEQ: libc::c_int = 21;
pub const TCP_REPAIR_OPTIONS: libc::c_int = 22;
pub const TCP_TIMESTAMP: libc::c_int = 24;
pub const TCP_REPAIR_WINDOW: libc::c_int = 29;
pub const TCP_RECV_QUEUE: libc::c_int = 1;
pub const TCP_SEND_QUEUE: libc::c_int = 2;
// TCP_REPAIR values.
pub const REPAIR_ON: libc::c_int = 1;
pub const REPAIR_OFF: libc::c_int = 0;
/// Off without the window probe the kernel otherwise sends (Linux 4.14+).
pub const REPAIR_OFF_NO_WP: libc::c_int = -1;

// Option codes for TCP_REPAIR_OPTIONS (RFC 793/1323/2018 kinds).
pub const TCPOPT_MAXSEG: u32 = 2;
pub const TCPOPT_WINDOW: u32 = 3;
pub const TCPOPT_SACK_PERM: u32 = 4;
pub const TCPOPT_TIMESTAMP: u32 = 8;

// tcp_info.tcpi_options bits.
pub const TCPI_OPT_TIMESTAMPS: u8 = 1;
pub const TCPI_OPT_SACK: u8 = 2;
pub const TCPI_OPT_WSCALE: u8 = 4;
/// Timestamps in microseconds (Linux 6.7+).
pub const TCPI_OPT_USEC_TS: u8 = 64;

// Socket queue sizes (<linux/sockios.h>).
const SIOCINQ: libc::c_ulong = libc::FIONREAD;
const SIOCOUTQ: libc::c_ulong = libc::TIOCOUTQ;
const SIOCOUTQNSD: libc::c_ulong = 0x894B;

pub const TCP_ESTABLISHED: u8 = 1;
pub const TCP_CLOSE: u8 = 7;
pub const TCP_LISTEN: u8 = 10;

/// `struct tcp_repair_window`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RepairWindow {
    pub snd_wl1: u32,
    pub snd_wnd: u32,
    pub max_window: u32,
    pub rcv_wnd: u32,
    pub rcv_wup: u32,
}

/// `struct tcp_repair_opt`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RepairOpt {
    pub code: u32,
    pub value: u32,
}

fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// A duplicate, in this process, of descriptor `target` of the process
/// behind `pidfd` (same open file: same socket).
pub fn pidfd_getfd(pidfd: BorrowedFd<'_>, target: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd takes two descriptor numbers and flags and returns
    // a new descriptor (O_CLOEXEC) or -1; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor the kernel just gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

pub fn set_int(fd: BorrowedFd<'_>, level: libc::c_int, opt: libc::c_int, v: i32) -> io::Result<()> {
    set_struct(fd, level, opt, &v)
}

/// Selects `queue` (TCP_RECV_QUEUE or TCP_SEND_QUEUE) for the repair
/// calls that follow: TCP_QUEUE_SEQ, and reads and writes of the queue.
pub fn select_repair_queue(fd: BorrowedFd<'_>, queue: i32) -> io::Result<()> {
    set_int(fd, libc::SOL_TCP, TCP_REPAIR_QUEUE, queue)
}

/// Forces the send buffer to `reported`, a size as getsockopt reports it
/// (twice what setsockopt takes).
pub fn force_sndbuf(fd: BorrowedFd<'_>, reported: u32) -> io::Result<()> {
    set_int(
        fd,
        libc::SOL_SOCKET,
        libc::SO_SNDBUFFORCE,
        (reported / 2).min(i32::MAX as u32) as i32,
    )
}

pub fn get_int(fd: BorrowedFd<'_>, level: libc::c_int, opt: libc::c_int) -> io::Result<i32> {
    let mut v = 0i32;
    let got = get_into(fd, level, opt, &mut v)?;
    if got != size_of::<i32>() {
        return Err(io::Error::other(format!(
            "getsockopt {level}/{opt}: {got} bytes, wanted 4"
        )));
    }
    Ok(v)
}

/// `setsockopt` with a plain-data value (`T` is `repr(C)` without padding
/// that matters to the kernel: integers and the structs above).
pub fn set_struct<T: Copy>(
    fd: BorrowedFd<'_>,
    level: libc::c_int,
    opt: libc::c_int,
    v: &T,
) -> io::Result<()> {
    // SAFETY: `v` points to size_of::<T>() readable bytes for the call.
    check(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            (v as *const T).cast(),
            size_of::<T>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// `setsockopt` with an array of plain-data values.
pub fn set_slice<T: Copy>(
    fd: BorrowedFd<'_>,
    level: libc::c_int,
    opt: libc::c_int,
    v: &[T],
) -> io::Result<()> {
    // SAFETY: `v` points to size_of_val(v) readable bytes for the call.
    check(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            v.as_ptr().cast(),
            std::mem::size_of_val(v) as libc::socklen_t,
        )
    })
    .map(drop)
}

/// `getsockopt` into `out`; returns how many bytes the kernel wrote.
pub fn get_into<T: Copy>(
    fd: BorrowedFd<'_>,
    level: libc::c_int,
    opt: libc::c_int,
    out: &mut T,
) -> io::Result<usize> {
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: `out` points to size_of::<T>() writable bytes and `len` says
    // so; the kernel writes at most `len` bytes and updates `len`. Every `T`
    // used here is valid for any bit pattern (integers, byte arrays).
    check(unsafe {
        libc::getsockopt(fd.as_raw_fd(), level, opt, (out as *mut T).cast(), &mut len)
    })?;
    Ok(len as usize)
}

/// A queue-size ioctl (SIOCINQ, SIOCOUTQ, SIOCOUTQNSD).
fn queue_size(fd: BorrowedFd<'_>, req: libc::c_ulong) -> io::Result<u32> {
    let mut v: libc::c_int = 0;
    // SAFETY: these ioctls write one int to the pointer passed.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), req as _, &mut v) })?;
    Ok(v.max(0) as u32)
}

pub fn inq(fd: BorrowedFd<'_>) -> io::Result<u32> {
    queue_size(fd, SIOCINQ)
}

pub fn outq(fd: BorrowedFd<'_>) -> io::Result<u32> {
    queue_size(fd, SIOCOUTQ)
}

pub fn outq_unsent(fd: BorrowedFd<'_>) -> io::Result<u32> {
    queue_size(fd, SIOCOUTQNSD)
}

/// The first bytes of `struct tcp_info`: state, ca_state, retransmits,
/// probes, backoff, options, snd_wscale:4 | rcv_wscale:4, ...
pub fn tcp_info_head(fd: BorrowedFd<'_>) -> io::Result<[u8; 8]> {
    let mut head = [0u8; 8];
    let got = get_into(fd, libc::SOL_TCP, libc::TCP_INFO, &mut head)?;
    if got < 7 {
        return Err(io::Error::other(format!("TCP_INFO: only {got} bytes")));
    }
    Ok(head)
}

/// `recv(MSG_PEEK | MSG_DONTWAIT)` of the whole selected repair queue.
/// One byte more is asked for, as a check that the queue holds exactly
/// `len` bytes.
pub fn peek_queue(fd: BorrowedFd<'_>, len: u32) -> io::Result<Vec<u8>> {
    // An empty queue needs no call: the size was just read, and nothing
    // moves while the process is stopped and its packets are held (a
    // thousand connections, two queues each, mostly empty, in the freeze).
    if len == 0 {
        return Ok(Vec::new());
    }
    let mut buf = vec![0u8; len as usize + 1];
    // SAFETY: `buf` has buf.len() writable bytes.
    let n = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != len as usize {
        return Err(io::Error::other(format!(
            "the queue held {n} bytes, its size said {len}"
        )));
    }
    buf.truncate(len as usize);
    Ok(buf)
}

/// `send()` of all of `data`. In repair mode the kernel puts the bytes
/// straight into the selected queue as one linear buffer, which a large
/// queue may not get (ENOMEM): then smaller pieces are tried, as CRIU does.
pub fn send_all(fd: BorrowedFd<'_>, data: &[u8], flags: libc::c_int) -> io::Result<()> {
    send_counted(fd, data, flags).1
}

/// The largest send buffer [`queue_all`] grows a socket's to (what
/// `SO_SNDBUF` reports; the kernel's own limit is `INT_MAX`).
const MAX_SNDBUF: i32 = 1 << 30;

/// Puts all of `data` into a TCP socket's send queue without blocking,
/// whatever its send buffer's size: when the buffer is full (EAGAIN), it
/// is doubled (`SO_SNDBUFFORCE`) and the rest is tried again; at the end
/// the size it had before is put back (what is queued stays queued; the
/// process's own writes then wait until acknowledgments free the room).
/// Returns the largest size the buffer was grown to, if it had to be.
///
/// Why not trust the size: the source's queue held these bytes in a
/// buffer of this size, but not necessarily within it. The kernel checks
/// the buffer before it starts a segment, not while it fills it, so a
/// queue may end up to a segment past its buffer, and the queue rebuilt
/// here is cut into other segments (the part already sent is written
/// first, in repair mode, and the unsent part starts a segment of its
/// own), whose overheads add up differently. A queue at the edge of its
/// buffer on the source then does not fit here: a send that blocked would
/// wait for acknowledgments that only the replay after it brings, and one
/// that stopped at EAGAIN lost the rest of the stream's bytes (the client
/// then received the process's next bytes in their place).
pub fn queue_all(fd: BorrowedFd<'_>, data: &[u8], flags: libc::c_int) -> io::Result<Option<i32>> {
    let before = get_int(fd, libc::SOL_SOCKET, libc::SO_SNDBUF)?;
    let mut size = before;
    let mut off = 0;
    let result = loop {
        let (n, r) = send_counted(fd, &data[off..], flags | libc::MSG_DONTWAIT);
        off += n;
        match r {
            Ok(()) => break Ok(()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && size < MAX_SNDBUF => {
                size = size
                    .saturating_mul(2)
                    .clamp(libc::c_int::from(u16::MAX), MAX_SNDBUF);
                // SO_SNDBUFFORCE takes half of what SO_SNDBUF reports.
                if let Err(e) = set_int(fd, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, size / 2) {
                    break Err(e);
                }
            }
            Err(e) => break Err(e),
        }
    };
    if size != before {
        // The send's own error, if any, says more than this one.
        let back = set_int(fd, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, before / 2);
        return result.and(back).map(|()| Some(size));
    }
    result.map(|()| None)
}

/// [`send_all`], also saying how many bytes went in before an error.
fn send_counted(fd: BorrowedFd<'_>, data: &[u8], flags: libc::c_int) -> (usize, io::Result<()>) {
    let mut off = 0;
    let mut max_chunk = data.len().max(1);
    while off < data.len() {
        let chunk = (data.len() - off).min(max_chunk);
        // SAFETY: the slice data[off..off + chunk] is readable.
        let n = unsafe {
            libc::send(
                fd.as_raw_fd(),
                data[off..].as_ptr().cast(),
                chunk,
                flags | libc::MSG_NOSIGNAL,
            )
        };
        if n <= 0 {
            let e = io::Error::last_os_error();
            if max_chunk > 1024 && e.raw_os_error() == Some(libc::ENOMEM) {
                max_chunk /= 2;
                continue;
            }
            let e = if n == 0 {
                io::Error::other("send() took nothing")
            } else {
                e
            };
            return (off, Err(e));
        }
        off += n as usize;
    }
    (off, Ok(()))
}

/// Raises this process's soft RLIMIT_NOFILE to its hard limit and grows
/// its descriptor table to hold `want` descriptors (at most the limit);
/// returns the table's size. Call it while the process has one thread:
/// growing the table of a multi-threaded process waits for an RCU grace
/// period each time it doubles, which inside a freeze (a thousand
/// descriptors taken or rebuilt at once) cost ~15 ms here.
pub fn prepare_descriptor_table(want: u32) -> io::Result<u32> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit to the pointer passed.
    check(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) })?;
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: setrlimit reads one rlimit from the pointer passed.
        check(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) })?;
    }
    let size = (want as u64).min(lim.rlim_cur).max(1) as i32;
    let null = std::fs::File::open("/dev/null")?;
    // SAFETY: dup2 onto a number below the limit; the duplicate is closed
    // at once, only the table's size remains.
    let high = check(unsafe { libc::dup2(null.as_raw_fd(), size - 1) })?;
    // SAFETY: `high` is the descriptor dup2 just created, owned by us.
    drop(unsafe { OwnedFd::from_raw_fd(high) });
    Ok(size as u32)
}
