//! The TCP connection under a Peer connection's TLS, read through a
//! buffer.
//!
//! rustls reads the socket a record at a time (at most ~16 KiB), so a
//! busy Peer connection cost a `recvfrom` and often a wake-up per record:
//! 1 GiB of post-copy pages took ~93,000 reads of ~11.5 KiB on the
//! destination. Below TLS, a buffer of [`BUFFER`] takes what the socket
//! holds at once (~85 KiB a read in the same transfer), and TLS reads its
//! records from memory. Measured with post-copy's page window
//! (`engine::pagewindow`), 1 GiB, release build, no link limit, 3
//! migrations each, interleaved: the fill 391-448 MB/s against 212-371
//! without the buffer (the buffer without that window: no change); at 1
//! Gb/s the fill is the link's either way. The freeze at 1024 connections
//! (their states cross in the freeze) did not change: 22 interleaved
//! rounds (`ferry-bench-ab`), medians 40.2-43.3 ms against 40.5-41.9.
//!
//! Writes pass straight through: HTTP/2 flushes after every data frame, so
//! a write buffer would gather nothing; and larger frames, which would
//! let it, lengthened the faults' wait at 1 Gb/s by 40 % (larger segments
//! queue ahead of the pages a fault asks for).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, BufReader, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Bytes read from the socket at once, at most.
pub const BUFFER: usize = 256 << 10;

/// A TCP stream read through a buffer of [`BUFFER`], for TLS to run
/// over.
#[derive(Debug)]
pub struct BufferedTcp {
    inner: BufReader<TcpStream>,
    info: TcpConnectInfo,
}

impl BufferedTcp {
    pub fn new(tcp: TcpStream) -> Self {
        let info = tcp.connect_info();
        BufferedTcp {
            inner: BufReader::with_capacity(BUFFER, tcp),
            info,
        }
    }
}

/// The server reads the caller's addresses (and, over TLS, its
/// certificates) from here, as from a bare `TcpStream`.
impl Connected for BufferedTcp {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

impl AsyncRead for BufferedTcp {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for BufferedTcp {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Bytes both ways arrive whole and in order, however the reads and
    /// writes are cut, and the addresses are the socket's.
    #[tokio::test]
    async fn bytes_cross_both_ways_whole() {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .unwrap();
        let at = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(at), listener.accept());
        let mut ours = BufferedTcp::new(client.unwrap());
        let (mut theirs, _) = accepted.unwrap();
        assert_eq!(ours.connect_info().remote_addr(), Some(at));

        // More than the buffer holds, read in small pieces.
        let big: Vec<u8> = (0..3 * BUFFER + 17).map(|i| (i % 251) as u8).collect();
        let sent = big.clone();
        let writer = tokio::spawn(async move {
            theirs.write_all(&sent).await.unwrap();
            theirs
        });
        let mut got = Vec::with_capacity(big.len());
        let mut piece = [0u8; 5000];
        while got.len() < big.len() {
            let n = ours.read(&mut piece).await.unwrap();
            assert!(n > 0);
            got.extend_from_slice(&piece[..n]);
        }
        assert_eq!(got, big);
        let mut theirs = writer.await.unwrap();

        // And the other way, with nothing held back: no flush needed.
        ours.write_all(b"pong").await.unwrap();
        let mut one = [0u8; 4];
        theirs.read_exact(&mut one).await.unwrap();
        assert_eq!(&one, b"pong");
    }
}
