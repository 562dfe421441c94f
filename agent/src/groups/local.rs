//! The handoff socket: where the server processes of this node's groups
//! reach ferryd (`ferry-handoff`, its C ABI). A `SOCK_SEQPACKET` Unix
//! socket open to every local user: who may do what is decided by the
//! caller's PID (`SO_PEERCRED`), which must be a server of the group
//! ([`Groups::register_server`]). Each connection carries one request:
//! `serve` (the connection then stays open as the process's channel, on
//! which the connections handed to it arrive) or `handoff` (answered when
//! the handoff is done or refused).
//!
//! Blocking sockets on threads of their own: a request waits for a handoff
//! that crosses the network, which runs on the async runtime.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ferry_handoff::wire::{self, WireError};
use ferry_handoff::{Reply, Request};
use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, UnixAddr, accept4, bind, getsockopt, listen,
    setsockopt, socket, sockopt,
};

use super::{Groups, ServerChannel};

/// How long a process may take to send its request once connected.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// How long ferryd waits to hand a connection to a server whose channel is
/// full (the process does not take what it is given).
const DELIVER_TIMEOUT: Duration = Duration::from_secs(1);

/// Binds the handoff socket at `path` (a stale one is replaced), open to
/// every local user.
pub fn bind_socket(path: &Path) -> std::io::Result<OwnedFd> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => tracing::info!(path = %path.display(), "removed a stale handoff socket"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    bind(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    // Servers that dropped root (a web server's workers) must reach it.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    listen(&fd, Backlog::new(128)?)?;
    Ok(fd)
}

/// Serves the handoff socket on a thread of its own, for as long as the
/// process runs; each connection gets a thread of its own too.
pub fn serve(
    groups: Arc<Groups>,
    listener: OwnedFd,
    runtime: tokio::runtime::Handle,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("handoff-socket".into())
        .spawn(move || {
            loop {
                let conn = match accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
                    // SAFETY: accept4 just returned this descriptor, owned
                    // by nothing else.
                    Ok(raw) => unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) },
                    Err(nix::errno::Errno::EINTR | nix::errno::Errno::ECONNABORTED) => continue,
                    Err(e) => {
                        tracing::error!(error = %e, "the handoff socket stopped accepting");
                        return;
                    }
                };
                let (groups, runtime) = (groups.clone(), runtime.clone());
                let spawned = std::thread::Builder::new()
                    .name("handoff-request".into())
                    .spawn(move || handle(&groups, conn, &runtime));
                if let Err(e) = spawned {
                    tracing::error!(error = %e, "no thread for a handoff request");
                }
            }
        })?;
    Ok(())
}

fn timeval(d: Duration) -> nix::sys::time::TimeVal {
    nix::sys::time::TimeVal::new(d.as_secs() as i64, i64::from(d.subsec_micros()))
}

fn refused(e: &super::GroupsError) -> Reply {
    Reply::Refused {
        error: e.kind(),
        message: e.to_string(),
    }
}

fn answer(conn: BorrowedFd<'_>, reply: &Reply) {
    if let Err(e) = wire::send(conn, reply, &[], None) {
        tracing::warn!(error = %e, "answering on the handoff socket");
    }
}

/// One connection of a process: its request, and the answer.
fn handle(groups: &Arc<Groups>, conn: OwnedFd, runtime: &tokio::runtime::Handle) {
    let pid = match getsockopt(&conn, sockopt::PeerCredentials) {
        Ok(c) => c.pid(),
        Err(e) => {
            tracing::warn!(error = %e, "the handoff socket's caller");
            return;
        }
    };
    if let Err(e) = setsockopt(&conn, sockopt::ReceiveTimeout, &timeval(REQUEST_TIMEOUT)) {
        tracing::warn!(error = %e, "a handoff request's timeout");
    }
    let got = match wire::recv::<Request>(conn.as_fd()) {
        Ok(g) => g,
        Err(WireError::Closed) => return,
        Err(e) => {
            answer(
                conn.as_fd(),
                &Reply::Refused {
                    error: ferry_handoff::ErrorKind::BadRequest,
                    message: e.to_string(),
                },
            );
            return;
        }
    };
    match got.head {
        Request::Serve { port } => serve_request(groups, pid, port, conn),
        Request::Place { port } => {
            let reply = match runtime.block_on(groups.place(pid, port)) {
                Ok((node, here)) => Reply::Placed { node, here },
                Err(e) => refused(&e),
            };
            answer(conn.as_fd(), &reply);
        }
        Request::Handoff { node, drain_ms } => {
            let Some(fd) = got.fd else {
                answer(
                    conn.as_fd(),
                    &Reply::Refused {
                        error: ferry_handoff::ErrorKind::BadRequest,
                        message: "a handoff request without the connection's descriptor".into(),
                    },
                );
                return;
            };
            let reply = match runtime.block_on(groups.handoff(
                pid,
                fd,
                node,
                Duration::from_millis(u64::from(drain_ms)),
                got.state,
            )) {
                Ok(done) => Reply::HandedOff {
                    acceptor: done.acceptor,
                    phases: done.phases,
                    queued_bytes: done.queued_bytes,
                },
                Err(e) => refused(&e),
            };
            answer(conn.as_fd(), &reply);
        }
    }
}

fn serve_request(groups: &Arc<Groups>, pid: i32, port: u16, conn: OwnedFd) {
    // ferryd only writes to a channel: a process that stops taking what it
    // is given must not hold a handoff's commit for long.
    let r = setsockopt(&conn, sockopt::SendTimeout, &timeval(DELIVER_TIMEOUT))
        .map_err(|e| super::GroupsError::Internal(format!("the channel's timeout: {e}")))
        .and_then(|()| {
            conn.try_clone()
                .map_err(|e| super::GroupsError::Internal(format!("keeping the channel: {e}")))
        })
        .and_then(|kept| groups.register_server(pid, port, kept));
    match r {
        Ok(()) => answer(conn.as_fd(), &Reply::Served { port }),
        Err(e) => {
            tracing::info!(pid, port, error = %e, "a process asking to serve a group refused");
            answer(conn.as_fd(), &refused(&e));
        }
    }
}

/// Whether a server's channel is still open at the process's end.
pub fn is_open(channel: &OwnedFd) -> bool {
    let mut fds = [nix::poll::PollFd::new(
        channel.as_fd(),
        nix::poll::PollFlags::empty(),
    )];
    match nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO) {
        Ok(0) => true,
        Ok(_) => !fds[0].revents().is_some_and(|r| {
            r.intersects(nix::poll::PollFlags::POLLHUP | nix::poll::PollFlags::POLLERR)
        }),
        Err(_) => false,
    }
}

/// Hands a connection to a server process, with the donor's state.
pub fn deliver(
    server: &ServerChannel,
    port: u16,
    remote: &str,
    donor: &str,
    conn: BorrowedFd<'_>,
    state: &[u8],
) -> Result<(), WireError> {
    wire::send(
        server.channel.as_fd(),
        &Reply::Accepted {
            port,
            remote: remote.to_owned(),
            donor: donor.to_owned(),
        },
        state,
        Some(conn),
    )
}
