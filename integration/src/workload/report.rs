//! What a [`SeqClient`](super::SeqClient) observed.

use std::fmt;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::pattern::Mismatch;

/// Why a connection's echo stream is not clean.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamErrorKind {
    /// ECONNRESET: an RST reached the client.
    Reset,
    /// EPIPE on send: the connection was already reset or closed.
    BrokenPipe,
    /// The server closed the connection.
    Eof,
    /// The echo differs from what was sent.
    Mismatch(Mismatch),
    /// More bytes came back than were sent.
    Excess { sent: u64, received: u64 },
    /// Sent bytes that had not come back when the drain period ended.
    Missing { sent: u64, verified: u64 },
    Io {
        kind: std::io::ErrorKind,
        message: String,
    },
}

impl StreamErrorKind {
    pub fn from_io(e: &std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::ConnectionReset => Self::Reset,
            std::io::ErrorKind::BrokenPipe => Self::BrokenPipe,
            kind => Self::Io {
                kind,
                message: e.to_string(),
            },
        }
    }
}

impl fmt::Display for StreamErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Reset => write!(f, "connection reset"),
            Self::BrokenPipe => write!(f, "broken pipe"),
            Self::Eof => write!(f, "unexpected EOF"),
            Self::Mismatch(m) => {
                write!(
                    f,
                    "mismatch at byte offset {}: expected {:#04x}, got {:#04x}",
                    m.offset, m.expected, m.actual
                )?;
                match m.source {
                    Some(at) => write!(
                        f,
                        "; the received bytes are the stream's from offset {at} ({} {} bytes, \
                         {} bytes of the read match from there)",
                        if at < m.offset {
                            "repeating"
                        } else {
                            "skipping"
                        },
                        at.abs_diff(m.offset),
                        m.source_run
                    ),
                    None => write!(f, "; the received bytes are nowhere near in the stream"),
                }
            }
            Self::Excess { sent, received } => {
                write!(f, "received {received} bytes but only {sent} were sent")
            }
            Self::Missing { sent, verified } => write!(
                f,
                "{} of {sent} sent bytes never came back",
                sent - verified
            ),
            Self::Io { kind, message } => write!(f, "{kind:?}: {message}"),
        }
    }
}

/// The first error of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamError {
    pub kind: StreamErrorKind,
    /// When it happened, from the client's start.
    pub after: Duration,
    /// Bytes verified on the connection at that moment.
    pub verified: u64,
}

impl fmt::Display for StreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (at {:.3}s, {} bytes verified)",
            self.kind,
            self.after.as_secs_f64(),
            self.verified
        )
    }
}

/// The longest silence between two consecutive echoes on one connection:
/// the client-perceived gap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gap {
    pub connection: usize,
    pub duration: Duration,
    /// Arrival of the echo before the gap.
    pub from: Instant,
    /// Arrival of the echo that ended it.
    pub to: Instant,
}

/// One connection's outcome.
#[derive(Debug, Clone)]
pub struct ConnReport {
    pub id: usize,
    pub local: SocketAddr,
    pub sent_bytes: u64,
    pub verified_bytes: u64,
    pub message_len: usize,
    pub error: Option<StreamError>,
    pub max_gap: Option<Gap>,
}

impl ConnReport {
    /// Whole messages sent (a message cut by an abort is not counted).
    pub fn sent_messages(&self) -> u64 {
        self.sent_bytes / self.message_len as u64
    }

    pub fn verified_messages(&self) -> u64 {
        self.verified_bytes / self.message_len as u64
    }

    pub fn is_clean(&self) -> bool {
        self.error.is_none() && self.sent_bytes == self.verified_bytes
    }
}

/// Everything a [`SeqClient`](super::SeqClient) saw, returned by `stop`.
#[derive(Debug, Clone)]
pub struct SeqReport {
    pub target: SocketAddr,
    pub started: Instant,
    pub stopped: Instant,
    pub connections: Vec<ConnReport>,
}

impl SeqReport {
    pub fn sent_messages(&self) -> u64 {
        self.connections.iter().map(ConnReport::sent_messages).sum()
    }

    pub fn verified_messages(&self) -> u64 {
        self.connections
            .iter()
            .map(ConnReport::verified_messages)
            .sum()
    }

    pub fn sent_bytes(&self) -> u64 {
        self.connections.iter().map(|c| c.sent_bytes).sum()
    }

    pub fn verified_bytes(&self) -> u64 {
        self.connections.iter().map(|c| c.verified_bytes).sum()
    }

    /// The client-perceived gap: the longest silence between consecutive
    /// echoes, over all connections.
    pub fn max_gap(&self) -> Option<Gap> {
        self.connections
            .iter()
            .filter_map(|c| c.max_gap)
            .max_by_key(|g| g.duration)
    }

    /// The connections that saw an error or lost bytes.
    pub fn failures(&self) -> Vec<&ConnReport> {
        self.connections.iter().filter(|c| !c.is_clean()).collect()
    }

    pub fn is_clean(&self) -> bool {
        self.failures().is_empty()
    }

    /// Panics, listing every faulty connection, unless every connection
    /// got back exactly what it sent without any error.
    #[track_caller]
    pub fn assert_clean(&self) {
        if let Err(msg) = self.check_clean() {
            panic!("{msg}");
        }
    }

    /// [`SeqReport::assert_clean`] as a `Result`: the error lists every
    /// faulty connection.
    pub fn check_clean(&self) -> Result<(), String> {
        let failures = self.failures();
        if failures.is_empty() {
            return Ok(());
        }
        let mut msg = format!(
            "{} of {} connections to {} are not clean:\n",
            failures.len(),
            self.connections.len(),
            self.target
        );
        for c in failures.iter().take(20) {
            let what = match &c.error {
                Some(e) => e.to_string(),
                None => format!("{} of {} bytes verified", c.verified_bytes, c.sent_bytes),
            };
            msg.push_str(&format!(
                "  conn {} ({}): {what}; sent {} msgs, verified {}\n",
                c.id,
                c.local,
                c.sent_messages(),
                c.verified_messages()
            ));
        }
        if failures.len() > 20 {
            msg.push_str(&format!("  ... and {} more\n", failures.len() - 20));
        }
        msg.push_str(&self.to_string());
        Err(msg)
    }
}

impl fmt::Display for SeqReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} connections to {} over {:.3}s: {} msgs sent, {} verified ({} / {} bytes), {} failed",
            self.connections.len(),
            self.target,
            self.stopped.duration_since(self.started).as_secs_f64(),
            self.sent_messages(),
            self.verified_messages(),
            self.sent_bytes(),
            self.verified_bytes(),
            self.failures().len()
        )?;
        if let Some(g) = self.max_gap() {
            write!(
                f,
                "; max gap {:.3} ms on conn {} at {:.3}s",
                g.duration.as_secs_f64() * 1e3,
                g.connection,
                g.from.duration_since(self.started).as_secs_f64()
            )?;
        }
        Ok(())
    }
}
