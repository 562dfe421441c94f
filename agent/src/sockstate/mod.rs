//! Collective migration of TCP connections (Gerofi et al. (DVE) §III-C).
//!
//! CRIU moves a process's connections one by one: per socket it turns TCP
//! repair on, reads the queues, writes one image file, and on restore
//! reads that file and rebuilds the socket, all while the process is
//! frozen. With a thousand connections that was most of the freeze
//! (docs/results.md, "The freeze at 16 to 4096 connections", the
//! iterative rows). In collective mode ferryd does it instead, for all
//! connections in one batch:
//!
//! 1. the source dumps the process with CRIU's `--tcp-close`, which records
//!    each connection's file and socket options but not its TCP state;
//! 2. as soon as CRIU has frozen the process (its `query-ext-files`
//!    notification, a few milliseconds into the dump), the source takes
//!    every connection into ferryd (`pidfd_getfd`), turns repair on and
//!    reads the state of all of them into one buffer ([`Held::extract`]),
//!    beside the rest of CRIU's dump; the buffer crosses in one message
//!    (`Peer.TransferSockets`) as soon as it is read
//!    (`engine/sockettaker.rs`);
//! 3. the destination rebuilds all connections in repair mode at once
//!    ([`rebuild`]), while the source still dumps, and at Restore hands
//!    them to CRIU as inherited descriptors (ferry's patches to CRIU,
//!    `xtask/criu/`: `ferry-tcp:[<inode>]`, which CRIU keeps in its own
//!    process and the restored task takes by pidfd; `socket:[<inode>]`
//!    through CRIU's fdstore with an older build; one table naming
//!    ferryd's descriptors, [`CONNECTION_TABLE_KEY`], with a newer one),
//!    and CRIU restores the rest of the descriptor table. With ferry's
//!    connections-out-of-images patch on both ends
//!    (`PrepareResponse.takes_connections_out`) CRIU never handles the
//!    connections at all: its dump records each by descriptor number,
//!    inode and flags only (asked of the task, the connection never
//!    leaving it), and its restore installs ferryd's at those numbers
//!    before any other descriptor;
//! 4. the sockets' options: when both ends' CRIU has ferry's
//!    tcp-options-by-caller patch (`PrepareResponse.takes_tcp_options`),
//!    CRIU's dump records the connections without them and ferryd reads
//!    them with the state ([`options`]); the destination sets them beside
//!    CRIU's restore ([`Rebuilt::apply_options`]). Otherwise CRIU dumps
//!    and restores them itself, one getsockopt/setsockopt at a time inside
//!    its single-threaded dump and restore;
//! 5. at the commit, just before the captured packets are replayed, repair
//!    goes off and bytes the source had not yet sent are queued
//!    ([`Rebuilt::resume`]). Until then the rebuilt sockets are inert: no
//!    retransmission timer runs down while the process is frozen.
//!
//! Incremental collective migration ([`preread`], Gerofi et al. (DVE) §III-C's
//! tracking during pre-copy) moves most of step 2 out of the freeze: what
//! does not change while a connection lives (its addresses, SO_REUSEADDR,
//! the options of step 4) is read before it, with a setsockopt watch
//! (`ferry_ebpf::SockoptWatch`) attached first; the freeze reads it again
//! only for connections a setsockopt call was made on since, and for new
//! ones, and reads the rest (TCP state, queues, unlocked buffer sizes) of
//! every connection as before. With enough connections that rest comes
//! from one pass of the TCP state iterator, without repair mode (the
//! process is stopped and its packets held): only a connection with
//! queued bytes takes calls (repair on, a peek); the others go into repair
//! mode while the destination restores, before the commit point
//! ([`Held::repair_the_rest`]). What the pre-read found crosses at Arm,
//! so the freeze's message carries only what moved, as one buffer of
//! fixed-size records ([`packed`]).
//!
//! Only ESTABLISHED connections are handled this way; a process holding
//! others (half-closed, connecting) is migrated with CRIU's own per-socket
//! path, chosen before the freeze ([`choose`]).

mod descriptors;
mod extract;
mod flush;
pub mod options;
pub mod packed;
mod preread;
mod rebuild;
mod spread;
mod stage;
pub(crate) mod sys;
mod udp;

use std::net::SocketAddr;

pub use extract::{Held, ReadCounts, StoppedSockets, take_sockets, unsupported_sockets};
pub use flush::{Flushed, flush_send_queues};
pub use preread::{PER_PROCESS_PASS_FROM, Preread, PrereadConnection};
pub use rebuild::{CONNECTION_TABLE_KEY, Handover, Rebuilt, empty_connection_table, rebuild};
pub use stage::{Staged, ToStage, stage};
pub use sys::{RepairWindow, prepare_descriptor_table};
pub use udp::{
    QueuedDatagram, datagram_key, give_back_udp_buffers, key_of_packet, queued_datagrams,
};

use ferry_proto::v1 as pb;

/// Errors of collective socket migration. Every one names the connection.
#[derive(Debug, thiserror::Error)]
pub enum SockStateError {
    #[error("{op} on TCP connection {conn}: {source}")]
    Sys {
        op: &'static str,
        conn: String,
        source: std::io::Error,
    },
    #[error("{op} on UDP socket {socket}: {source}")]
    Udp {
        op: &'static str,
        /// Its inode, or its local address.
        socket: String,
        source: std::io::Error,
    },
    #[error("{op} on process {pid}: {source}")]
    Process {
        op: &'static str,
        pid: i32,
        source: std::io::Error,
    },
    #[error(
        "TCP connection {conn} is in state {state}, not ESTABLISHED: collective socket \
         migration handles established connections only (retry: the migration then uses \
         CRIU's per-socket path)"
    )]
    NotEstablished { conn: String, state: &'static str },
    #[error("tcp_connections[{index}].{field}: {reason}")]
    Invalid {
        index: usize,
        field: &'static str,
        reason: String,
    },
    /// A packed record (peer protocol 9, [`packed`]); `field` is the
    /// record's, or `packed` or `packed_queues` for the buffers.
    #[error("packed[{index}].{field}: {reason}")]
    InvalidPacked {
        index: usize,
        field: &'static str,
        reason: String,
    },
    #[error("rebuilt connections handed out before they were resumed")]
    NotResumed,
}

pub use crate::config::SocketMigration;

/// The socket path a migration takes: the one asked for, unless the
/// process holds connections collective mode cannot move, or the
/// destination does not speak it. Decided before the freeze; the reason
/// for a fallback is returned for the log and the report.
pub fn choose(
    wanted: SocketMigration,
    tcp_other: u32,
    peer_version: u32,
) -> (SocketMigration, Option<String>) {
    if wanted == SocketMigration::Iterative {
        return (wanted, None);
    }
    if peer_version < ferry_proto::PEER_PROTOCOL_COLLECTIVE_SOCKETS {
        return (
            SocketMigration::Iterative,
            Some(format!(
                "the destination speaks peer protocol {peer_version}; collective sockets need {}",
                ferry_proto::PEER_PROTOCOL_COLLECTIVE_SOCKETS
            )),
        );
    }
    if tcp_other > 0 {
        return (
            SocketMigration::Iterative,
            Some(format!(
                "{tcp_other} TCP socket(s) neither listening nor established (half-closed or \
                 connecting): left to CRIU's per-socket path"
            )),
        );
    }
    (wanted, None)
}

/// The state of one established TCP connection, as TCP repair reads and
/// writes it (the fields of CRIU's `libsoccr_sk_data` that an established
/// connection uses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpConnectionState {
    /// The socket's inode on the source: the key CRIU's images know it by.
    pub inode: u64,
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// Sequence number after the last byte queued for sending (write_seq).
    pub send_seq: u32,
    /// Next sequence number expected from the peer (rcv_nxt).
    pub recv_seq: u32,
    /// Sent but not yet acknowledged bytes, then the unsent ones.
    pub send_queue: Vec<u8>,
    /// How many bytes at the end of `send_queue` were never sent.
    pub unsent: u32,
    /// Received bytes the process has not read yet.
    pub recv_queue: Vec<u8>,
    pub mss_clamp: u32,
    /// `tcpi_options` (TCPI_OPT_*): timestamps, SACK, window scaling.
    pub options: u8,
    pub send_wscale: u8,
    pub recv_wscale: u8,
    /// TCP_TIMESTAMP: the connection's timestamp clock, kept so the peer's
    /// PAWS check accepts what the destination sends (TCPmig §4.3).
    pub timestamp: u32,
    pub window: RepairWindow,
    /// SO_REUSEADDR as the process set it (turning repair off clears it).
    pub reuseaddr: bool,
    /// SO_SNDBUF as getsockopt reports it (twice what setsockopt takes):
    /// the rebuilt socket gets it, so the bytes never sent fit again.
    pub sndbuf: u32,
    /// The socket's options, when ferryd carries them instead of CRIU
    /// ([`options`]); the rebuilt socket gets them.
    pub socket_options: Option<pb::TcpSocketOptions>,
}

impl TcpConnectionState {
    pub fn name(&self) -> String {
        conn_name(self.local, self.remote)
    }

    pub fn to_pb(&self) -> pb::TcpConnectionState {
        pb::TcpConnectionState {
            inode: self.inode,
            local: self.local.to_string(),
            remote: self.remote.to_string(),
            send_seq: self.send_seq,
            recv_seq: self.recv_seq,
            send_queue: self.send_queue.clone(),
            unsent: self.unsent,
            recv_queue: self.recv_queue.clone(),
            mss_clamp: self.mss_clamp,
            options: u32::from(self.options),
            send_wscale: u32::from(self.send_wscale),
            recv_wscale: u32::from(self.recv_wscale),
            timestamp: self.timestamp,
            window: Some(pb::TcpRepairWindow {
                snd_wl1: self.window.snd_wl1,
                snd_wnd: self.window.snd_wnd,
                max_window: self.window.max_window,
                rcv_wnd: self.window.rcv_wnd,
                rcv_wup: self.window.rcv_wup,
            }),
            reuseaddr: self.reuseaddr,
            sndbuf: self.sndbuf,
            socket_options: self.socket_options.clone(),
        }
    }

    /// Checks what a peer sent; errors name the entry and the field.
    pub fn from_pb(index: usize, p: pb::TcpConnectionState) -> Result<Self, SockStateError> {
        let bad = |field: &'static str, reason: String| SockStateError::Invalid {
            index,
            field,
            reason,
        };
        let (local, remote) =
            ends_from_pb(&p.local, &p.remote).map_err(|(field, reason)| bad(field, reason))?;
        if p.inode == 0 {
            return Err(bad("inode", "must not be 0".into()));
        }
        if p.unsent as usize > p.send_queue.len() {
            return Err(bad(
                "unsent",
                format!(
                    "{} unsent bytes in a send queue of {}",
                    p.unsent,
                    p.send_queue.len()
                ),
            ));
        }
        let scale = |field: &'static str, v: u32| window_scale(v).map_err(|r| bad(field, r));
        let options = handshake_options(p.options).map_err(|r| bad("options", r))?;
        check_mss(p.mss_clamp).map_err(|r| bad("mss_clamp", r))?;
        let w = p.window.ok_or_else(|| bad("window", "missing".into()))?;
        if let Some(o) = &p.socket_options {
            check_socket_options(o, "socket_options.bound_device", "socket_options.filter")
                .map_err(|(field, reason)| bad(field, reason))?;
        }
        Ok(Self {
            inode: p.inode,
            local,
            remote,
            send_seq: p.send_seq,
            recv_seq: p.recv_seq,
            send_queue: p.send_queue,
            unsent: p.unsent,
            recv_queue: p.recv_queue,
            mss_clamp: p.mss_clamp,
            options,
            send_wscale: scale("send_wscale", p.send_wscale)?,
            recv_wscale: scale("recv_wscale", p.recv_wscale)?,
            timestamp: p.timestamp,
            window: RepairWindow {
                snd_wl1: w.snd_wl1,
                snd_wnd: w.snd_wnd,
                max_window: w.max_window,
                rcv_wnd: w.rcv_wnd,
                rcv_wup: w.rcv_wup,
            },
            reuseaddr: p.reuseaddr,
            sndbuf: p.sndbuf,
            socket_options: p.socket_options,
        })
    }
}

/// A window scale a peer sent (0..=14).
fn window_scale(v: u32) -> Result<u8, String> {
    u8::try_from(v)
        .ok()
        .filter(|v| *v <= 14)
        .ok_or_else(|| format!("{v} is not a window scale (0..=14)"))
}

/// `tcpi_options` a peer sent: timestamps, SACK and window scaling only.
fn handshake_options(v: u32) -> Result<u8, String> {
    u8::try_from(v)
        .ok()
        .filter(|o| {
            *o & !(sys::TCPI_OPT_TIMESTAMPS | sys::TCPI_OPT_SACK | sys::TCPI_OPT_WSCALE) == 0
        })
        .ok_or_else(|| format!("{v:#x} has unknown bits"))
}

/// An MSS clamp a peer sent.
fn check_mss(v: u32) -> Result<(), String> {
    if v == 0 || v > 65535 {
        return Err(format!("{v} is not an MSS"));
    }
    Ok(())
}

/// Checks socket options a peer sent; the error names the field, as
/// `device` or `filter` (their names where the options are).
fn check_socket_options(
    o: &pb::TcpSocketOptions,
    device: &'static str,
    filter: &'static str,
) -> Result<(), (&'static str, String)> {
    if o.bound_device.len() >= libc::IFNAMSIZ {
        return Err((
            device,
            format!("{:?} is longer than an interface name", o.bound_device),
        ));
    }
    // BPF_MAXINSNS: the kernel takes no longer classic filter.
    if o.filter.len() > 4096 {
        return Err((
            filter,
            format!(
                "{} instructions, more than a socket filter has",
                o.filter.len()
            ),
        ));
    }
    Ok(())
}

/// How errors and logs name a connection: by its two ends.
fn conn_name(local: SocketAddr, remote: SocketAddr) -> String {
    format!("{local} -> {remote}")
}

/// A connection's two ends as a peer wrote them ("a.b.c.d:p" or
/// "[v6]:p"), of one family. The error names the field ("local" or
/// "remote") and says why.
pub fn ends_from_pb(
    local: &str,
    remote: &str,
) -> Result<(SocketAddr, SocketAddr), (&'static str, String)> {
    let addr = |field: &'static str, s: &str| {
        s.parse::<SocketAddr>()
            .map_err(|e| (field, format!("{s:?} is not an address:port ({e})")))
    };
    let (local, remote) = (addr("local", local)?, addr("remote", remote)?);
    if local.is_ipv4() != remote.is_ipv4() {
        return Err(("remote", "local and remote differ in family".into()));
    }
    Ok((local, remote))
}

/// Checks a whole batch from a peer: every entry, and no inode twice.
pub fn from_pb_batch(
    batch: Vec<pb::TcpConnectionState>,
) -> Result<Vec<TcpConnectionState>, SockStateError> {
    let mut seen = std::collections::HashSet::with_capacity(batch.len());
    batch
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let c = TcpConnectionState::from_pb(i, p)?;
            if !seen.insert(c.inode) {
                return Err(SockStateError::Invalid {
                    index: i,
                    field: "inode",
                    reason: format!("{} appears twice", c.inode),
                });
            }
            Ok(c)
        })
        .collect()
}

fn state_name(state: u8) -> &'static str {
    match state {
        1 => "ESTABLISHED",
        2 => "SYN_SENT",
        3 => "SYN_RECV",
        4 => "FIN_WAIT1",
        5 => "FIN_WAIT2",
        6 => "TIME_WAIT",
        7 => "CLOSE",
        8 => "CLOSE_WAIT",
        9 => "LAST_ACK",
        10 => "LISTEN",
        11 => "CLOSING",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests;
