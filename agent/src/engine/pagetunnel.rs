//! Post-copy's page traffic, carried inside the peer connection.
//!
//! CRIU's page server (on the source) and its lazy-pages daemon (on the
//! destination) speak a plain, unauthenticated protocol over TCP. Left to
//! themselves, the page server would listen on the cluster network and
//! anyone reaching its port could read the migrating process's memory, in
//! clear text on the wire. Instead each agent connects to itself over
//! loopback, hands one end to its CRIU (CRIU's `ps-socket`: an already
//! connected page-server socket), and carries the other end's bytes in the
//! `Peer.PageTunnel` stream, inside the agents' mutual TLS. Nothing listens
//! for CRIU at any time.
//!
//! TCP rather than a Unix socketpair: CRIU corks and sets NODELAY on its
//! page-server socket and logs an error for every such call on another
//! kind of socket.

use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;

use ferry_proto::v1::TunnelBytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt};

use super::EngineError;

/// Bytes read from a CRIU end per tunnel message.
const CHUNK: usize = 64 << 10;

/// Tunnel messages in flight per direction before the reader waits (HTTP/2
/// flow control then pushes back on the other agent).
pub const DEPTH: usize = 32;

/// A connected loopback pair: `ours` stays in the agent (async), `criu`
/// goes to a CRIU process (blocking, as CRIU expects).
#[derive(Debug)]
pub struct LoopbackPair {
    pub ours: TcpStream,
    pub criu: OwnedFd,
}

/// Connects the agent to itself over loopback. The listener lives only
/// until the connection it made arrives; any other connection that reaches
/// it first (a local process that found the port) is dropped.
pub async fn loopback_pair() -> Result<LoopbackPair, EngineError> {
    let io = |what: &'static str| EngineError::io(format!("page tunnel: {what}"));
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await
        .map_err(io("binding a loopback port"))?;
    let at = listener
        .local_addr()
        .map_err(io("reading the bound port"))?;
    let criu_end = TcpStream::connect(at)
        .await
        .map_err(io("connecting over loopback"))?;
    let want = criu_end.local_addr().map_err(io("reading the local end"))?;
    let ours = loop {
        let (sock, from) = listener
            .accept()
            .await
            .map_err(io("accepting over loopback"))?;
        if from == want {
            break sock;
        }
        tracing::warn!(%from, "a stranger reached a page tunnel's loopback port; dropped");
    };
    drop(listener);
    ours.set_nodelay(true).map_err(io("setting TCP_NODELAY"))?;
    let criu = criu_end
        .into_std()
        .map_err(io("taking the CRIU end out of the runtime"))?;
    criu.set_nonblocking(false)
        .map_err(io("making the CRIU end blocking"))?;
    Ok(LoopbackPair {
        ours,
        criu: OwnedFd::from(criu),
    })
}

/// Bytes moved by a pump, each way.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Moved {
    /// From the local CRIU into the tunnel.
    pub out: u64,
    /// From the tunnel to the local CRIU.
    pub into: u64,
}

/// Copies between the local CRIU's connection and the tunnel until both
/// directions have ended. What CRIU writes goes out through `outbound`;
/// what arrives on `inbound` is written to CRIU. A direction's orderly end is passed on (the tunnel stream ends,
/// or CRIU's socket is shut down for writing); a broken direction ends
/// both at once, and CRIU sees its connection close.
pub async fn pump<S>(
    socket: TcpStream,
    mut inbound: S,
    outbound: mpsc::Sender<TunnelBytes>,
) -> Result<Moved, EngineError>
where
    S: Stream<Item = Result<TunnelBytes, tonic::Status>> + Unpin,
{
    let (mut from_criu, mut to_criu) = socket.into_split();
    let out = async move {
        let mut total = 0u64;
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = from_criu
                .read(&mut buf)
                .await
                .map_err(EngineError::io("page tunnel: reading from CRIU"))?;
            if n == 0 {
                // Dropping the sender ends the tunnel stream this way.
                return Ok::<u64, EngineError>(total);
            }
            total += n as u64;
            let msg = TunnelBytes {
                migration_id: String::new(),
                data: buf[..n].to_vec(),
            };
            if outbound.send(msg).await.is_err() {
                return Err(EngineError::PageTunnel(
                    "page tunnel: the other agent stopped reading".into(),
                ));
            }
        }
    };
    let into = async move {
        let mut total = 0u64;
        while let Some(msg) = inbound.next().await {
            let msg = msg.map_err(|s| {
                EngineError::PageTunnel(format!("page tunnel broke: {}", s.message()))
            })?;
            total += msg.data.len() as u64;
            to_criu
                .write_all(&msg.data)
                .await
                .map_err(EngineError::io("page tunnel: writing to CRIU"))?;
        }
        to_criu
            .shutdown()
            .await
            .map_err(EngineError::io("page tunnel: shutting down CRIU's input"))?;
        Ok::<u64, EngineError>(total)
    };
    let (out, into) = tokio::try_join!(out, into)?;
    Ok(Moved { out, into })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// Both directions through a real loopback pair: the CRIU end (a
    /// blocking std socket, as CRIU gets it) talks with the tunnel's
    /// channels, and each side's end is passed on.
    #[tokio::test]
    async fn bytes_cross_both_ways_and_ends_are_passed_on() {
        let pair = loopback_pair().await.expect("pair");
        let (to_tunnel, mut from_pump) = mpsc::channel::<TunnelBytes>(DEPTH);
        let (into_pump, inbound) = mpsc::channel::<Result<TunnelBytes, tonic::Status>>(DEPTH);
        let pump = tokio::spawn(pump(
            pair.ours,
            tokio_stream::wrappers::ReceiverStream::new(inbound),
            to_tunnel,
        ));
        let mut criu = std::net::TcpStream::from(pair.criu);
        let request: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let reply: Vec<u8> = (0..300_000u32).map(|i| (i % 241) as u8).collect();
        // CRIU's side, blocking, on its own thread: write, read to the end.
        let criu_side = {
            let request = request.clone();
            std::thread::spawn(move || {
                criu.write_all(&request).expect("write");
                criu.shutdown(std::net::Shutdown::Write).expect("shutdown");
                let mut got = Vec::new();
                criu.read_to_end(&mut got).expect("read");
                got
            })
        };
        let mut sent = Vec::new();
        while let Some(m) = from_pump.recv().await {
            sent.extend_from_slice(&m.data);
        }
        assert_eq!(sent, request, "CRIU's bytes, in order, then the end");
        for piece in reply.chunks(7000) {
            into_pump
                .send(Ok(TunnelBytes {
                    migration_id: String::new(),
                    data: piece.to_vec(),
                }))
                .await
                .expect("send");
        }
        drop(into_pump);
        let moved = pump.await.expect("join").expect("pump");
        assert_eq!(criu_side.join().expect("thread"), reply);
        assert_eq!(
            moved,
            Moved {
                out: request.len() as u64,
                into: reply.len() as u64
            }
        );
    }

    /// A broken tunnel closes CRIU's connection instead of leaving it
    /// waiting for an answer that cannot come.
    #[tokio::test]
    async fn a_broken_tunnel_closes_the_criu_end() {
        let pair = loopback_pair().await.expect("pair");
        let (to_tunnel, _keep) = mpsc::channel::<TunnelBytes>(DEPTH);
        let (into_pump, inbound) = mpsc::channel::<Result<TunnelBytes, tonic::Status>>(DEPTH);
        let pump = tokio::spawn(pump(
            pair.ours,
            tokio_stream::wrappers::ReceiverStream::new(inbound),
            to_tunnel,
        ));
        into_pump
            .send(Err(tonic::Status::unavailable("peer gone")))
            .await
            .expect("send");
        let err = pump.await.expect("join").expect_err("a broken tunnel");
        assert!(err.to_string().contains("peer gone"), "{err}");
        let mut criu = std::net::TcpStream::from(pair.criu);
        let mut buf = [0u8; 16];
        let n = criu.read(&mut buf).expect("read after the break");
        assert_eq!(n, 0, "CRIU's connection is closed");
    }
}
