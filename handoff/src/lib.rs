//! Per-connection handoff for ferry's distributed servers (the XtreemOS
//! distributed servers, rebuilt on ferry's single-IP cluster): a group of
//! server processes on several nodes serves one port of the cluster's
//! address; a process hands one established TCP connection to the group's
//! process on another node, which goes on with it as if it had accepted it.
//! The client notices nothing: no reconnect, no lost or repeated byte.
//!
//! A process talks to its own node's ferryd over a Unix socket
//! ([`socket_path`]); ferryd freezes the connection (TCP repair), moves its
//! state over the Peer API, and the acceptor's ferryd rebuilds it and passes
//! it to the acceptor's process ([`Server::accept`]). Until the acceptor has
//! the connection, a failure leaves it with the donor, which goes on as
//! before.
//!
//! ```no_run
//! # fn main() -> Result<(), ferry_handoff::Error> {
//! // Every server of the group, on every node:
//! let server = ferry_handoff::Server::serve(8080)?;
//! // On the donor, with an accepted connection `conn`:
//! # let conn: std::net::TcpStream = unimplemented!();
//! ferry_handoff::handoff(conn, "node2", b"sent 500000", &Default::default())
//!     .map_err(|(_conn, e)| e)?;
//! // On the acceptor:
//! let handed = server.accept()?;
//! assert_eq!(handed.state, b"sent 500000");
//! # Ok(()) }
//! ```
//!
//! The C ABI (`include/ferry_handoff.h`) offers the same three calls.

pub mod ffi;
pub mod wire;

use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::time::Duration;

use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};

pub use wire::{ErrorKind, MAX_STATE, Phase, Reply, Request};

/// The environment variable naming the handoff socket; ferryd sets it for
/// the processes it starts.
pub const SOCKET_ENV: &str = "FERRY_HANDOFF_SOCKET";

/// Where ferryd listens when [`SOCKET_ENV`] is not set.
pub const DEFAULT_SOCKET: &str = "/run/ferry/handoff.sock";

/// The handoff socket of this node's ferryd.
pub fn socket_path() -> PathBuf {
    std::env::var_os(SOCKET_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET))
}

/// Why a call did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reaching ferryd at {path}: {source}")]
    Connect {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error(transparent)]
    Wire(#[from] wire::WireError),
    /// ferryd refused or failed the request.
    #[error("{message}")]
    Refused { kind: ErrorKind, message: String },
    #[error("ferryd answered {0:?}, which is not an answer to this request")]
    Unexpected(Box<Reply>),
}

impl Error {
    /// The errno the C ABI reports for it.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Connect { source, .. } => *source as i32,
            Error::Wire(wire::WireError::Io(e)) => *e as i32,
            Error::Wire(wire::WireError::TooLarge { .. }) => libc::EMSGSIZE,
            Error::Wire(_) | Error::Unexpected(_) => libc::EPROTO,
            Error::Refused { kind, .. } => kind.errno(),
        }
    }
}

fn connect_to_agent() -> Result<OwnedFd, Error> {
    connect_at(&socket_path())
}

fn connect_at(path: &std::path::Path) -> Result<OwnedFd, Error> {
    let path = path.to_owned();
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|source| Error::Connect {
        path: path.clone(),
        source,
    })?;
    let addr = UnixAddr::new(&path).map_err(|source| Error::Connect {
        path: path.clone(),
        source,
    })?;
    connect(fd.as_raw_fd(), &addr).map_err(|source| Error::Connect { path, source })?;
    Ok(fd)
}

pub(crate) fn refused(reply: Reply) -> Error {
    match reply {
        Reply::Refused { error, message } => Error::Refused {
            kind: error,
            message,
        },
        other => Error::Unexpected(Box::new(other)),
    }
}

/// This process as a server of a distributed server's group: the
/// connections other nodes hand to it arrive here.
#[derive(Debug)]
pub struct Server {
    pub(crate) channel: OwnedFd,
    port: u16,
    /// The handoff socket it registered through, to register again after
    /// its ferryd restarted.
    socket: PathBuf,
}

/// How long [`Server::accept`] tries to register again once its ferryd went
/// away: an agent restarting (an upgrade) is back within seconds.
const REREGISTER_FOR: Duration = Duration::from_secs(30);

/// A connection handed to this process.
#[derive(Debug)]
pub struct Handed {
    pub stream: TcpStream,
    /// What the donor passed along with it.
    pub state: Vec<u8>,
    /// The node that handed it over.
    pub donor: String,
    /// The client's address, as ferryd saw it.
    pub remote: String,
}

impl Server {
    /// Registers this process with its node's ferryd as a server of the
    /// group on `port` (the group must exist and take this node). The
    /// process must be one ferryd manages (`ferry run`, or adopted), or a
    /// descendant of one.
    pub fn serve(port: u16) -> Result<Self, Error> {
        Self::serve_via(&socket_path(), port)
    }

    /// [`Server::serve`] through the handoff socket at `socket` instead of
    /// [`socket_path`]'s.
    pub fn serve_via(socket: &std::path::Path, port: u16) -> Result<Self, Error> {
        Ok(Self {
            channel: register(socket, port)?,
            port,
            socket: socket.to_owned(),
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Waits for the next connection handed to this process. The channel
    /// is readable when one is there ([`AsRawFd`]), for an event loop.
    ///
    /// If ferryd goes away (it restarts: its groups and the connections
    /// they serve go on), this registers again with the new one, for up to
    /// 30 s, on a channel that takes the old one's descriptor number, so
    /// that an event loop watching it goes on.
    pub fn accept(&self) -> Result<Handed, Error> {
        let got = loop {
            match wire::recv::<Reply>(self.channel.as_fd()) {
                Err(wire::WireError::Closed) => self.register_again()?,
                got => break got?,
            }
        };
        match got.head {
            Reply::Accepted { remote, donor, .. } => {
                let fd = got.fd.ok_or_else(|| {
                    wire::WireError::Malformed(
                        "a handed-off connection without its descriptor".into(),
                    )
                })?;
                Ok(Handed {
                    stream: TcpStream::from(fd),
                    state: got.state,
                    donor,
                    remote,
                })
            }
            other => Err(refused(other)),
        }
    }
}

impl Server {
    /// A new channel with the restarted ferryd, in place of the old one.
    fn register_again(&self) -> Result<(), Error> {
        register_again_onto(self.channel.as_fd(), &self.socket, self.port)
    }
}

/// Registers again as a server of the group on `port` through `socket`
/// (its ferryd restarted), trying for [`REREGISTER_FOR`], on a channel
/// that takes `channel`'s descriptor number (dup3 closes the old one
/// atomically), so that whoever holds or watches it goes on.
pub(crate) fn register_again_onto(
    channel: BorrowedFd<'_>,
    socket: &std::path::Path,
    port: u16,
) -> Result<(), Error> {
    let until = std::time::Instant::now() + REREGISTER_FOR;
    let fresh = loop {
        match register(socket, port) {
            Ok(fd) => break fd,
            // Not listening yet (the socket is gone or refuses), or it
            // closed on us while starting: try again.
            Err(Error::Connect { .. } | Error::Wire(wire::WireError::Closed))
                if std::time::Instant::now() < until =>
            {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(e),
        }
    };
    // SAFETY: the caller owns `channel`'s descriptor number, which dup3
    // makes name the new channel; the caller goes on owning it, and
    // `fresh` is closed after.
    let replaced = unsafe { libc::dup3(fresh.as_raw_fd(), channel.as_raw_fd(), libc::O_CLOEXEC) };
    if replaced < 0 {
        return Err(wire::WireError::Io(nix::Error::last()).into());
    }
    Ok(())
}

/// Registers as a server of the group on `port` through `socket`.
fn register(socket: &std::path::Path, port: u16) -> Result<OwnedFd, Error> {
    let channel = connect_at(socket)?;
    wire::send(channel.as_fd(), &Request::Serve { port }, &[], None)?;
    match wire::recv::<Reply>(channel.as_fd())?.head {
        Reply::Served { .. } => Ok(channel),
        other => Err(refused(other)),
    }
}

impl AsRawFd for Server {
    fn as_raw_fd(&self) -> RawFd {
        self.channel.as_raw_fd()
    }
}

impl AsFd for Server {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.channel.as_fd()
    }
}

/// How a handoff is made.
#[derive(Debug, Clone, Default)]
pub struct HandoffOptions {
    /// Wait up to this long, before anything else, for the client to
    /// acknowledge every byte sent: the connection's state is then a few
    /// hundred bytes and the client's wait one trip between the nodes
    /// (XtreemOS distributed servers, Fig. 2). Zero: hand off at once,
    /// with whatever the send queue holds.
    pub drain: Duration,
}

/// What a successful handoff took.
#[derive(Debug, Clone)]
pub struct HandedOff {
    pub acceptor: String,
    pub phases: Vec<Phase>,
    /// The bytes of the connection's queues that crossed with it.
    pub queued_bytes: u64,
}

/// Hands `conn` (an established connection of a group's port) to the
/// group's server on `node`, with `state` for it. On success the
/// connection is the acceptor's and `conn` is closed here without a byte
/// sent; on failure `conn` comes back, still this process's and untouched.
pub fn handoff(
    conn: TcpStream,
    node: &str,
    state: &[u8],
    options: &HandoffOptions,
) -> Result<HandedOff, (TcpStream, Error)> {
    match handoff_fd(conn.as_fd(), node, state, options) {
        Ok(done) => Ok(done),
        Err(e) => Err((conn, e)),
    }
}

/// [`handoff`] of a borrowed descriptor; the caller closes it on success.
pub fn handoff_fd(
    conn: BorrowedFd<'_>,
    node: &str,
    state: &[u8],
    options: &HandoffOptions,
) -> Result<HandedOff, Error> {
    let agent = connect_to_agent()?;
    let req = Request::Handoff {
        node: node.to_owned(),
        drain_ms: u32::try_from(options.drain.as_millis()).unwrap_or(u32::MAX),
    };
    wire::send(agent.as_fd(), &req, state, Some(conn))?;
    match wire::recv::<Reply>(agent.as_fd())?.head {
        Reply::HandedOff {
            acceptor,
            phases,
            queued_bytes,
        } => Ok(HandedOff {
            acceptor,
            phases,
            queued_bytes,
        }),
        other => Err(refused(other)),
    }
}

/// Where a new connection of the group on `port` should be served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    pub node: String,
    /// The chosen node is this one: serve it here.
    pub here: bool,
}

/// Asks the node's ferryd which member should serve a new connection of
/// the group on `port`, by the group's placement policy (round robin or
/// least connections). The caller must serve the group.
pub fn place(port: u16) -> Result<Placed, Error> {
    let agent = connect_to_agent()?;
    wire::send(agent.as_fd(), &Request::Place { port }, &[], None)?;
    match wire::recv::<Reply>(agent.as_fd())?.head {
        Reply::Placed { node, here } => Ok(Placed { node, here }),
        other => Err(refused(other)),
    }
}
