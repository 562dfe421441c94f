//! `ferry-dve-server --port 7000`: the seed's zone server, as a test
//! workload. One thread serves every client: TCP connections on the port
//! and UDP datagrams on the same port number, each echoed back exactly
//! (TCP byte for byte, UDP datagram for datagram to its sender).
//!
//! One thread and `poll(2)`, not a thread per connection: a DVE zone
//! server holds a thousand connections, and what a migration freezes is
//! its threads and sockets, not a thousand stacks. Built to be dumped and
//! restored by CRIU at any point: plain sockets and poll (no epoll or
//! eventfd state to carry), EINTR retried, a failing connection only closes
//! itself, and nothing is written after start (stdio is /dev/null under
//! the agent).
//!
//! `ferry-dve-server --port 7000 -- ferry-pg-session --pg ...` also starts
//! the command after `--` as its child, before it serves: a zone server's
//! database session, which moves with it (a migration takes the whole
//! process tree). The child is never waited for; if it ends, it stays a
//! zombie the test can see.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::process::ExitCode;

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "ferry-dve-server",
    about = "Single-threaded TCP and UDP echo server for ferry's tests (a DVE zone server)"
)]
struct Args {
    /// TCP and UDP port to serve.
    #[arg(long, default_value_t = 7000)]
    port: u16,
    /// Address to bind (`::` takes IPv6 and IPv4 clients alike).
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::UNSPECIFIED))]
    bind: IpAddr,
    /// Keep every Nth accepted connection open across exec (FD_CLOEXEC
    /// cleared), as a server that hands connections to the programs it
    /// runs would; 0: none. A migration must give back each descriptor's
    /// flags as they were.
    #[arg(long, value_name = "N", default_value_t = 0)]
    keep_on_exec_every: u32,
    /// Leave the datagrams on the UDP port unread, queued in the socket,
    /// until the first TCP connection: a server busy elsewhere, whose
    /// receive queue a migration must carry. The socket's receive buffer
    /// is then 1 MiB (SO_RCVBUFFORCE: root), room for what waits.
    #[arg(long)]
    udp_after_first_connection: bool,
    /// A command to start as this server's child (after `--`).
    #[arg(last = true)]
    companion: Vec<String>,
}

/// Stop reading a connection whose echo is this far behind (its client
/// reads too slowly): TCP's flow control then slows the client down.
const MAX_PENDING: usize = 256 * 1024;
const READ_CHUNK: usize = 64 * 1024;

struct Conn {
    stream: TcpStream,
    /// Echo bytes not yet written.
    pending: Vec<u8>,
    /// The client closed its side: close ours once `pending` is out.
    eof: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let addr = SocketAddr::new(args.bind, args.port);
    let bound = TcpListener::bind(addr).and_then(|l| Ok((l, UdpSocket::bind(addr)?)));
    let (listener, udp) = match bound {
        Ok(b) => b,
        Err(e) => {
            // The only message this program ever prints: before serving.
            eprintln!("ferry-dve-server: binding {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = listener
        .set_nonblocking(true)
        .and_then(|_| udp.set_nonblocking(true))
    {
        eprintln!("ferry-dve-server: {e}");
        return ExitCode::FAILURE;
    }
    if args.udp_after_first_connection {
        let forced =
            nix::sys::socket::setsockopt(&udp, nix::sys::socket::sockopt::RcvBufForce, &(1 << 20));
        if let Err(e) = forced {
            eprintln!("ferry-dve-server: SO_RCVBUFFORCE: {e}");
            return ExitCode::FAILURE;
        }
    }
    if let Some((program, rest)) = args.companion.split_first() {
        let started = std::process::Command::new(program)
            .args(rest)
            .stdin(std::process::Stdio::null())
            .spawn();
        if let Err(e) = started {
            eprintln!("ferry-dve-server: starting {program}: {e}");
            return ExitCode::FAILURE;
        }
    }
    serve(
        &listener,
        &udp,
        args.keep_on_exec_every,
        !args.udp_after_first_connection,
    )
}

fn serve(
    listener: &TcpListener,
    udp: &UdpSocket,
    keep_on_exec_every: u32,
    mut udp_open: bool,
) -> ExitCode {
    let mut conns: HashMap<RawFd, Conn> = HashMap::new();
    let mut accepted = 0u64;
    let mut buf = vec![0u8; READ_CHUNK];
    let mut fds: Vec<libc::pollfd> = Vec::new();
    loop {
        fds.clear();
        for (fd, read) in [(listener.as_raw_fd(), true), (udp.as_raw_fd(), udp_open)] {
            fds.push(libc::pollfd {
                fd,
                events: if read { libc::POLLIN } else { 0 },
                revents: 0,
            });
        }
        for (fd, c) in &conns {
            let mut events = 0;
            if c.pending.len() < MAX_PENDING && !c.eof {
                events |= libc::POLLIN;
            }
            if !c.pending.is_empty() {
                events |= libc::POLLOUT;
            }
            fds.push(libc::pollfd {
                fd: *fd,
                events,
                revents: 0,
            });
        }
        // SAFETY: fds is a valid array of fds.len() pollfd structs that
        // the kernel may write revents into for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            // EINTR (a restore, a signal): poll again.
            continue;
        }
        if fds[0].revents != 0 {
            accept_all(listener, &mut conns, &mut accepted, keep_on_exec_every);
            udp_open |= accepted > 0;
        }
        if fds[1].revents != 0 && udp_open {
            echo_datagrams(udp, &mut buf);
        }
        for p in &fds[2..] {
            if p.revents == 0 {
                continue;
            }
            let close = match conns.get_mut(&p.fd) {
                Some(c) => !serve_conn(c, p.revents, &mut buf),
                None => false,
            };
            if close {
                conns.remove(&p.fd);
            }
        }
    }
}

fn accept_all(
    listener: &TcpListener,
    conns: &mut HashMap<RawFd, Conn>,
    accepted: &mut u64,
    keep_on_exec_every: u32,
) {
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                if stream.set_nonblocking(true).is_err() {
                    continue;
                }
                *accepted += 1;
                if keep_on_exec_every != 0
                    && (*accepted).is_multiple_of(u64::from(keep_on_exec_every))
                {
                    // SAFETY: F_SETFD on a descriptor this process owns.
                    if unsafe { libc::fcntl(stream.as_raw_fd(), libc::F_SETFD, 0) } != 0 {
                        continue;
                    }
                }
                let _ = stream.set_nodelay(true);
                conns.insert(
                    stream.as_raw_fd(),
                    Conn {
                        stream,
                        pending: Vec::new(),
                        eof: false,
                    },
                );
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            // WouldBlock: all taken. Anything else (out of fds, an aborted
            // handshake): try again at the next poll.
            Err(_) => return,
        }
    }
}

fn echo_datagrams(udp: &UdpSocket, buf: &mut [u8]) {
    loop {
        match udp.recv_from(buf) {
            Ok((n, from)) => {
                // A datagram that cannot be sent now is lost, as UDP may;
                // the tests would see it, so they keep the rate low.
                let _ = udp.send_to(&buf[..n], from);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Reads what is there, writes what is pending; false when the connection
/// is done (closed by the client and flushed, or failed).
fn serve_conn(c: &mut Conn, revents: libc::c_short, buf: &mut [u8]) -> bool {
    if revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 && !c.eof {
        loop {
            if c.pending.len() >= MAX_PENDING {
                break;
            }
            match c.stream.read(buf) {
                Ok(0) => {
                    c.eof = true;
                    break;
                }
                Ok(n) => c.pending.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => return false,
            }
        }
    }
    while !c.pending.is_empty() {
        match c.stream.write(&c.pending) {
            Ok(n) => {
                c.pending.drain(..n);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(_) => return false,
        }
    }
    if c.eof && c.pending.is_empty() {
        // The client sees EOF after the last echo.
        let _ = c.stream.shutdown(std::net::Shutdown::Write);
        return false;
    }
    true
}
