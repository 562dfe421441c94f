//! A single checked round trip on a fresh connection, kept open so that the
//! test can look up which node holds its server side.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use super::pattern::{self, Verifier};
use super::seq_client::SeqError;
use crate::netns;

/// The connection id probes put in their messages.
pub const PROBE_CONN_ID: u32 = u32::MAX;
const PROBE_MESSAGE_LEN: usize = 64;

/// An open, verified connection to an echo server.
#[derive(Debug)]
pub struct ProbeConnection {
    stream: TcpStream,
    local: SocketAddr,
    target: SocketAddr,
    seq: u64,
    verifier: Verifier,
}

impl ProbeConnection {
    /// Connects from the namespace at `netns` to `target` and does one
    /// checked round trip (5 s bounds on each step).
    pub fn open(netns: &Path, target: impl Into<SocketAddr>) -> Result<Self, SeqError> {
        let target = target.into();
        probe_once(netns, target, Duration::from_secs(5))
    }

    /// The client side of the connection: the peer address the server's
    /// socket shows (see `Cluster::nodes_holding`).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// Sends the next message and waits for its exact echo; returns the
    /// round-trip time.
    pub fn round_trip(&mut self) -> Result<Duration, SeqError> {
        let target = self.target;
        let io = |what| {
            move |source| SeqError::Probe {
                target,
                what,
                source,
            }
        };
        let mut msg = [0u8; PROBE_MESSAGE_LEN];
        pattern::fill(&mut msg, PROBE_CONN_ID, self.seq);
        let t0 = Instant::now();
        self.stream.write_all(&msg).map_err(io("sending"))?;
        let mut echo = [0u8; PROBE_MESSAGE_LEN];
        // read_exact retries EINTR and fails on EOF or the read timeout.
        self.stream
            .read_exact(&mut echo)
            .map_err(io("reading the echo"))?;
        let rtt = t0.elapsed();
        self.verifier
            .check(&echo)
            .map_err(|m| SeqError::ProbeMismatch {
                target,
                offset: m.offset,
            })?;
        self.seq += 1;
        Ok(rtt)
    }

    pub fn into_stream(self) -> TcpStream {
        self.stream
    }
}

/// Connects from the namespace at `netns` to `target` and does one checked
/// round trip, each step bounded by `timeout`.
pub fn probe_once(
    netns: &Path,
    target: SocketAddr,
    timeout: Duration,
) -> Result<ProbeConnection, SeqError> {
    let io = |what| {
        move |source| SeqError::Probe {
            target,
            what,
            source,
        }
    };
    // The socket is created inside the namespace and stays there; the
    // stream itself is then usable from any thread.
    let stream = netns::run_in(netns, || TcpStream::connect_timeout(&target, timeout))?
        .map_err(io("connecting"))?;
    stream
        .set_nodelay(true)
        .map_err(io("setting TCP_NODELAY"))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(io("setting the read timeout"))?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(io("setting the write timeout"))?;
    let local = stream.local_addr().map_err(io("local address"))?;
    let mut probe = ProbeConnection {
        stream,
        local,
        target,
        seq: 0,
        verifier: Verifier::new(PROBE_CONN_ID, PROBE_MESSAGE_LEN),
    };
    probe.round_trip()?;
    Ok(probe)
}
