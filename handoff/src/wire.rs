//! What a serving process and its node's ferryd say to each other over the
//! handoff socket: one message per `SOCK_SEQPACKET` datagram, a JSON head,
//! a NUL byte, then the application's state as raw bytes; a connection
//! travels beside it as `SCM_RIGHTS`. Datagrams keep each message and its
//! descriptor together, which a byte stream would not.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use serde::{Deserialize, Serialize};

/// The most application state one handoff carries: what the acceptor needs
/// to go on with the connection (where a download stands, a session's
/// keys), not the process's memory. ferryd's Peer API carries it in one
/// message.
pub const MAX_STATE: usize = 64 * 1024;

/// The largest datagram: the state and a head of a few hundred bytes.
const MAX_DATAGRAM: usize = MAX_STATE + 4096;

/// A process's request to its ferryd.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Request {
    /// Registers the sending process as a server of the group on `port`.
    /// The socket it came on stays open as the process's channel: the
    /// connections handed off to it arrive there ([`Reply::Accepted`]).
    Serve { port: u16 },
    /// Hands the attached connection to the server of its group on
    /// `node`. `drain_ms` > 0: first wait up to that long for the client
    /// to acknowledge everything sent, so that only the connection's
    /// bare state crosses (XtreemOS distributed servers, Fig. 2).
    Handoff { node: String, drain_ms: u32 },
    /// Which member should serve a new connection of the group on `port`,
    /// by the group's placement policy.
    Place { port: u16 },
}

/// ferryd's answer, or a connection handed to a server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Reply {
    /// The process serves the group on `port` from now on.
    Served { port: u16 },
    /// The connection is `acceptor`'s now; the process's descriptor of it
    /// is inert (closing it sends nothing). The phases' durations, in the
    /// order they ran.
    HandedOff {
        acceptor: String,
        phases: Vec<Phase>,
        /// The bytes of the connection's queues that crossed with it (what
        /// was sent and not acknowledged, and what was received and not
        /// read).
        #[serde(default)]
        queued_bytes: u64,
    },
    /// The member chosen for a new connection; `here`: it is this node
    /// (serve it, no handoff).
    Placed { node: String, here: bool },
    /// Not done, and why; a connection stays the process's.
    Refused { error: ErrorKind, message: String },
    /// A connection handed to this process, attached, with the donor's
    /// state after the head.
    Accepted {
        port: u16,
        remote: String,
        donor: String,
    },
}

/// One step of a handoff and how long it took.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Phase {
    pub name: String,
    pub micros: u64,
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The process is not a server of the group (it never called serve,
    /// or is not one of the node's managed processes).
    NotMember,
    /// The descriptor is not an established TCP connection of a group's
    /// port.
    NotAConnection,
    /// The node is not in the connection's group, or no group has the port.
    NotInGroup,
    /// A handoff of the same connection is under way.
    Busy,
    /// The acceptor said no (no server of the group there, ...).
    Refused,
    /// The acceptor could not be reached or failed before the commit: the
    /// connection stayed with the donor.
    Unavailable,
    /// A malformed request.
    BadRequest,
    /// Anything else on ferryd's side.
    Internal,
}

impl ErrorKind {
    /// The errno the C ABI sets for it.
    pub fn errno(self) -> i32 {
        match self {
            ErrorKind::NotMember => libc::EPERM,
            ErrorKind::NotAConnection => libc::ENOTCONN,
            ErrorKind::NotInGroup => libc::ENOENT,
            ErrorKind::Busy => libc::EBUSY,
            ErrorKind::Refused => libc::ECONNREFUSED,
            ErrorKind::Unavailable => libc::EHOSTUNREACH,
            ErrorKind::BadRequest => libc::EINVAL,
            ErrorKind::Internal => libc::EIO,
        }
    }
}

/// What went wrong on the socket itself.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("handoff socket: {0}")]
    Io(#[from] nix::Error),
    #[error("handoff socket: the other end closed it")]
    Closed,
    #[error("handoff socket: a malformed message: {0}")]
    Malformed(String),
    #[error(
        "handoff socket: the state is {len} bytes, more than the {MAX_STATE} a handoff carries"
    )]
    TooLarge { len: usize },
}

/// One message as it came off the socket.
#[derive(Debug)]
pub struct Received<T> {
    pub head: T,
    pub state: Vec<u8>,
    pub fd: Option<OwnedFd>,
}

/// Sends `head`, `state` and, if given, the descriptor `fd` as one
/// datagram.
pub fn send<T: Serialize>(
    socket: BorrowedFd<'_>,
    head: &T,
    state: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> Result<(), WireError> {
    if state.len() > MAX_STATE {
        return Err(WireError::TooLarge { len: state.len() });
    }
    let mut head = serde_json::to_vec(head).map_err(|e| WireError::Malformed(e.to_string()))?;
    head.push(0);
    let iov = [IoSlice::new(&head), IoSlice::new(state)];
    let fds: Vec<RawFd> = fd.iter().map(AsRawFd::as_raw_fd).collect();
    let cmsgs: Vec<ControlMessage<'_>> = if fds.is_empty() {
        Vec::new()
    } else {
        vec![ControlMessage::ScmRights(&fds)]
    };
    loop {
        match sendmsg::<()>(
            socket.as_raw_fd(),
            &iov,
            &cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
            Ok(_) => return Ok(()),
        }
    }
}

/// Receives one datagram (blocking as the socket does).
pub fn recv<T: for<'de> Deserialize<'de>>(
    socket: BorrowedFd<'_>,
) -> Result<Received<T>, WireError> {
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let (len, fd, truncated) = loop {
        let mut iov = [std::io::IoSliceMut::new(&mut buf)];
        match recvmsg::<()>(
            socket.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
            Ok(msg) => {
                let mut fd = None;
                for c in msg.cmsgs()? {
                    if let ControlMessageOwned::ScmRights(fds) = c {
                        for raw in fds {
                            // SAFETY: the kernel just installed `raw` in
                            // this process for this message; nothing else
                            // owns it, and only the first is kept (any
                            // other is closed right here).
                            let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                            if fd.is_none() {
                                fd = Some(owned);
                            }
                        }
                    }
                }
                let truncated = msg.flags.contains(MsgFlags::MSG_TRUNC);
                break (msg.bytes, fd, truncated);
            }
        }
    };
    if len == 0 {
        return Err(WireError::Closed);
    }
    if truncated {
        return Err(WireError::Malformed(format!(
            "a datagram over {MAX_DATAGRAM} bytes"
        )));
    }
    let buf = &buf[..len];
    let nul = buf
        .iter()
        .position(|&b| b == 0)
        .ok_or_else(|| WireError::Malformed("no end to the head".into()))?;
    let head =
        serde_json::from_slice(&buf[..nul]).map_err(|e| WireError::Malformed(e.to_string()))?;
    Ok(Received {
        head,
        state: buf[nul + 1..].to_vec(),
        fd,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
    use std::os::fd::AsFd;

    fn pair() -> (OwnedFd, OwnedFd) {
        socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap()
    }

    #[test]
    fn a_message_its_state_and_its_descriptor_arrive_together() {
        let (a, b) = pair();
        let (passed, _keep) = pair();
        let req = Request::Handoff {
            node: "node2".into(),
            drain_ms: 25,
        };
        let state: Vec<u8> = (0..MAX_STATE).map(|i| (i % 251) as u8).collect();
        send(a.as_fd(), &req, &state, Some(passed.as_fd())).unwrap();
        send(a.as_fd(), &Request::Serve { port: 80 }, &[], None).unwrap();
        let got: Received<Request> = recv(b.as_fd()).unwrap();
        assert_eq!(got.head, req);
        assert_eq!(got.state, state);
        assert!(got.fd.is_some());
        let got: Received<Request> = recv(b.as_fd()).unwrap();
        assert_eq!(got.head, Request::Serve { port: 80 });
        assert!(got.state.is_empty() && got.fd.is_none());
        drop(a);
        assert!(matches!(recv::<Request>(b.as_fd()), Err(WireError::Closed)));
    }

    #[test]
    fn too_much_state_is_refused_before_anything_is_sent() {
        let (a, _b) = pair();
        let err = send(
            a.as_fd(),
            &Request::Serve { port: 1 },
            &vec![0; MAX_STATE + 1],
            None,
        )
        .unwrap_err();
        assert!(matches!(err, WireError::TooLarge { len } if len == MAX_STATE + 1));
    }

    #[test]
    fn a_head_that_is_not_a_request_is_malformed() {
        let (a, b) = pair();
        send(a.as_fd(), &Reply::Served { port: 1 }, &[], None).unwrap();
        assert!(matches!(
            recv::<Request>(b.as_fd()),
            Err(WireError::Malformed(_))
        ));
    }
}
