//! The connections' states as one buffer of fixed-size records (peer
//! protocol 9), for those whose fixed part crossed at Arm.
//!
//! Inside the freeze the source sent every connection as a
//! `TcpConnectionState` message: its addresses as text, its options, its
//! socket options field by field. For 1025 connections, building and
//! encoding those messages took the source 1.9 ms of CPU, decoding and
//! checking them the destination 1.3 ms (this crate's test build, one
//! idle core), on cores the dump, the image transfer and the rebuild were
//! all waiting for. What a connection keeps while it lives
//! (its ends, what the handshake settled, SO_REUSEADDR, its socket options)
//! is known before the freeze: the pre-read has it, and Arm carries it
//! ([`Fixed`], `StagedConnection.fixed`). The freeze then carries only what
//! moves, 68 bytes a connection plus its queued bytes, written and read
//! without a message per connection ([`pack`], [`unpack`]). The layout is
//! `TransferSocketsRequest.packed`'s, in `proto/ferry/v1/peer.proto`.

use std::collections::HashMap;
use std::net::SocketAddr;

use ferry_proto::v1 as pb;

use super::{RepairWindow, SockStateError, TcpConnectionState};

/// One record's length in `TransferSocketsRequest.packed`.
pub const RECORD_LEN: usize = 68;

/// What stays the same while a connection lives, as Arm carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fixed {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    pub options: u8,
    pub send_wscale: u8,
    pub recv_wscale: u8,
    pub reuseaddr: bool,
    /// The socket options, when ferryd carries them; their `rcvbuf` is the
    /// one read before the freeze (a record carries the freeze's).
    pub socket_options: Option<pb::TcpSocketOptions>,
}

/// The fixed parts Arm carried, by the connection's inode on the source.
pub type FixedParts = HashMap<u64, Fixed>;

impl Fixed {
    /// `c`'s fixed part, as a pre-read would have found it (tests build
    /// Arm's from the states they pack).
    #[cfg(test)]
    pub(crate) fn of(c: &TcpConnectionState) -> Self {
        Self {
            local: c.local,
            remote: c.remote,
            options: c.options,
            send_wscale: c.send_wscale,
            recv_wscale: c.recv_wscale,
            reuseaddr: c.reuseaddr,
            socket_options: c.socket_options.clone(),
        }
    }

    pub fn to_pb(&self) -> pb::TcpConnectionFixed {
        pb::TcpConnectionFixed {
            options: u32::from(self.options),
            send_wscale: u32::from(self.send_wscale),
            recv_wscale: u32::from(self.recv_wscale),
            reuseaddr: self.reuseaddr,
            socket_options: self.socket_options.clone(),
        }
    }

    /// Checks what a peer sent for the connection between `local` and
    /// `remote`. The error names the field (under `fixed.`) and says why.
    pub fn from_pb(
        local: SocketAddr,
        remote: SocketAddr,
        p: &pb::TcpConnectionFixed,
    ) -> Result<Self, (&'static str, String)> {
        let scale = |field: &'static str, v: u32| super::window_scale(v).map_err(|r| (field, r));
        let options = super::handshake_options(p.options).map_err(|r| ("fixed.options", r))?;
        if let Some(o) = &p.socket_options {
            super::check_socket_options(
                o,
                "fixed.socket_options.bound_device",
                "fixed.socket_options.filter",
            )?;
        }
        Ok(Self {
            local,
            remote,
            options,
            send_wscale: scale("fixed.send_wscale", p.send_wscale)?,
            recv_wscale: scale("fixed.recv_wscale", p.recv_wscale)?,
            reuseaddr: p.reuseaddr,
            socket_options: p.socket_options.clone(),
        })
    }

    /// Whether `c` has this fixed part: then a record of its moving part
    /// and this rebuild it whole. The receive buffer's size is not
    /// compared: the record carries it.
    pub fn describes(&self, c: &TcpConnectionState) -> bool {
        let same_options = match (&self.socket_options, &c.socket_options) {
            (None, None) => true,
            (Some(ours), Some(theirs)) => same_but_rcvbuf(ours, theirs),
            _ => false,
        };
        self.local == c.local
            && self.remote == c.remote
            && self.options == c.options
            && self.send_wscale == c.send_wscale
            && self.recv_wscale == c.recv_wscale
            && self.reuseaddr == c.reuseaddr
            && same_options
    }
}

/// Whether `a` and `b` are the same options but maybe the receive
/// buffer's size (a copy only when the sizes differ).
fn same_but_rcvbuf(a: &pb::TcpSocketOptions, b: &pb::TcpSocketOptions) -> bool {
    if a.rcvbuf == b.rcvbuf {
        return a == b;
    }
    pb::TcpSocketOptions {
        rcvbuf: b.rcvbuf,
        ..a.clone()
    } == *b
}

/// Connections as `TransferSocketsRequest.packed` and `packed_queues`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Packed {
    pub records: Vec<u8>,
    pub queues: Vec<u8>,
}

/// Splits `states` into those `fixed` describes, packed, and the others,
/// which go whole.
pub fn pack<'a>(
    states: &'a [TcpConnectionState],
    fixed: &FixedParts,
) -> (Packed, Vec<&'a TcpConnectionState>) {
    let mut packed = Packed {
        records: Vec::with_capacity(states.len() * RECORD_LEN),
        queues: Vec::new(),
    };
    let mut whole = Vec::new();
    for c in states {
        if !fixed.get(&c.inode).is_some_and(|f| f.describes(c)) {
            whole.push(c);
            continue;
        }
        let r = &mut packed.records;
        r.extend_from_slice(&c.inode.to_le_bytes());
        for v in [
            c.send_seq,
            c.recv_seq,
            c.send_queue.len() as u32,
            c.unsent,
            c.recv_queue.len() as u32,
            c.mss_clamp,
            c.timestamp,
            c.window.snd_wl1,
            c.window.snd_wnd,
            c.window.max_window,
            c.window.rcv_wnd,
            c.window.rcv_wup,
            c.sndbuf,
            c.socket_options.as_ref().map_or(0, |o| o.rcvbuf),
            0,
        ] {
            r.extend_from_slice(&v.to_le_bytes());
        }
        packed.queues.extend_from_slice(&c.send_queue);
        packed.queues.extend_from_slice(&c.recv_queue);
    }
    (packed, whole)
}

/// The connections of `records` and `queues`, each joined with the fixed
/// part Arm carried for its inode. Checks what the peer sent: the errors
/// name the record and the field (`packed[3].mss_clamp`).
pub fn unpack(
    records: &[u8],
    queues: &[u8],
    fixed: Option<&FixedParts>,
) -> Result<Vec<TcpConnectionState>, SockStateError> {
    let bad = |index: usize, field: &'static str, reason: String| SockStateError::InvalidPacked {
        index,
        field,
        reason,
    };
    if !records.len().is_multiple_of(RECORD_LEN) {
        return Err(bad(
            records.len() / RECORD_LEN,
            "packed",
            format!(
                "{} bytes, not a whole number of {RECORD_LEN}-byte records",
                records.len()
            ),
        ));
    }
    let none = FixedParts::new();
    let fixed = fixed.unwrap_or(&none);
    let mut at = 0usize;
    let mut states = Vec::with_capacity(records.len() / RECORD_LEN);
    for (index, r) in records.chunks_exact(RECORD_LEN).enumerate() {
        let inode = u64::from_le_bytes(r[..8].try_into().expect("8 bytes"));
        let word = |i: usize| {
            let o = 8 + 4 * i;
            u32::from_le_bytes(r[o..o + 4].try_into().expect("4 bytes"))
        };
        let Some(f) = fixed.get(&inode) else {
            return Err(bad(
                index,
                "inode",
                format!("{inode} was not named with its fixed part at Arm"),
            ));
        };
        let (send_len, unsent, recv_len) = (word(2) as usize, word(3), word(4) as usize);
        if unsent as usize > send_len {
            return Err(bad(
                index,
                "unsent",
                format!("{unsent} unsent bytes in a send queue of {send_len}"),
            ));
        }
        let mss_clamp = word(5);
        super::check_mss(mss_clamp).map_err(|r| bad(index, "mss_clamp", r))?;
        if word(14) != 0 {
            return Err(bad(index, "reserved", format!("{:#x}, not 0", word(14))));
        }
        let mut take = |len: usize, field: &'static str| {
            let end = at
                .checked_add(len)
                .filter(|end| *end <= queues.len())
                .ok_or_else(|| {
                    bad(
                        index,
                        field,
                        format!(
                            "{len} bytes, but packed_queues has {} left",
                            queues.len() - at
                        ),
                    )
                })?;
            let bytes = queues[at..end].to_vec();
            at = end;
            Ok::<_, SockStateError>(bytes)
        };
        let send_queue = take(send_len, "send_queue")?;
        let recv_queue = take(recv_len, "recv_queue")?;
        let socket_options = f.socket_options.as_ref().map(|o| pb::TcpSocketOptions {
            rcvbuf: word(13),
            ..o.clone()
        });
        states.push(TcpConnectionState {
            inode,
            local: f.local,
            remote: f.remote,
            send_seq: word(0),
            recv_seq: word(1),
            send_queue,
            unsent,
            recv_queue,
            mss_clamp,
            options: f.options,
            send_wscale: f.send_wscale,
            recv_wscale: f.recv_wscale,
            timestamp: word(6),
            window: RepairWindow {
                snd_wl1: word(7),
                snd_wnd: word(8),
                max_window: word(9),
                rcv_wnd: word(10),
                rcv_wup: word(11),
            },
            reuseaddr: f.reuseaddr,
            sndbuf: word(12),
            socket_options,
        });
    }
    if at != queues.len() {
        return Err(bad(
            states.len(),
            "packed_queues",
            format!(
                "{} bytes left over after the records' queues",
                queues.len() - at
            ),
        ));
    }
    Ok(states)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sockstate::sys;

    fn state(inode: u64, local: &str, remote: &str) -> TcpConnectionState {
        TcpConnectionState {
            inode,
            local: local.parse().unwrap(),
            remote: remote.parse().unwrap(),
            send_seq: 0xfedc_ba98,
            recv_seq: 0x0123_4567u32.wrapping_add(inode as u32),
            send_queue: Vec::new(),
            unsent: 0,
            recv_queue: Vec::new(),
            mss_clamp: 1448,
            options: sys::TCPI_OPT_TIMESTAMPS | sys::TCPI_OPT_SACK | sys::TCPI_OPT_WSCALE,
            send_wscale: 7,
            recv_wscale: 9,
            timestamp: 0xdead_beef,
            window: RepairWindow {
                snd_wl1: 11,
                snd_wnd: 12,
                max_window: 13,
                rcv_wnd: 14,
                rcv_wup: 15,
            },
            reuseaddr: false,
            sndbuf: 87_040,
            socket_options: Some(pb::TcpSocketOptions {
                rcvbuf: 131_072,
                nodelay: true,
                keepalive: true,
                keepidle: 30,
                bound_device: "eth0".into(),
                filter: vec![0x0006_0000_0000_ffff],
                ..Default::default()
            }),
        }
    }

    fn fixed_of(c: &TcpConnectionState) -> Fixed {
        Fixed::of(c)
    }

    /// Connections of every shape: queues in both directions, some bytes
    /// never sent, IPv6, no socket options, an autotuned receive buffer.
    fn varied() -> Vec<TcpConnectionState> {
        let mut a = state(101, "198.18.0.100:7000", "198.18.1.2:40000");
        a.send_queue = b"sent but not acked, then never sent".to_vec();
        a.unsent = 10;
        a.recv_queue = b"unread".to_vec();
        let mut b = state(102, "[fd00::1]:7000", "[fd00::2]:40001");
        b.options = 0;
        b.send_wscale = 0;
        b.recv_wscale = 0;
        b.reuseaddr = true;
        b.socket_options = None;
        let mut c = state(103, "198.18.0.100:7000", "198.18.1.3:40002");
        c.recv_queue = vec![0xaa; 3000];
        vec![a, b, c]
    }

    #[test]
    fn packed_connections_come_back_as_they_were_read() {
        let states = varied();
        let mut fixed: FixedParts = states.iter().map(|c| (c.inode, fixed_of(c))).collect();
        // Arm saw a smaller receive buffer: the kernel has grown it since.
        fixed
            .get_mut(&103)
            .unwrap()
            .socket_options
            .as_mut()
            .unwrap()
            .rcvbuf = 65_536;
        let (packed, whole) = pack(&states, &fixed);
        assert!(whole.is_empty(), "{whole:?}");
        assert_eq!(packed.records.len(), 3 * RECORD_LEN);
        assert_eq!(packed.queues.len(), 35 + 6 + 3000);
        let back = unpack(&packed.records, &packed.queues, Some(&fixed)).unwrap();
        assert_eq!(back, states, "the receive buffer is the freeze's, 131072");
    }

    #[test]
    fn a_connection_whose_fixed_part_changed_since_arm_goes_whole() {
        let states = varied();
        let arm: FixedParts = states.iter().map(|c| (c.inode, fixed_of(c))).collect();
        for (what, change) in [
            (
                "SO_REUSEADDR",
                (|c: &mut Fixed| c.reuseaddr = !c.reuseaddr) as fn(&mut Fixed),
            ),
            ("an option", |c| {
                c.socket_options.as_mut().unwrap().nodelay = false
            }),
            ("the remote end", |c| {
                c.remote = "198.18.1.9:1".parse().unwrap()
            }),
            ("the window scale", |c| c.recv_wscale = 3),
            ("options carried or not", |c| c.socket_options = None),
        ] {
            let mut fixed = arm.clone();
            change(fixed.get_mut(&101).unwrap());
            let (packed, whole) = pack(&states, &fixed);
            assert_eq!(
                whole.iter().map(|c| c.inode).collect::<Vec<_>>(),
                vec![101],
                "{what}"
            );
            let back = unpack(&packed.records, &packed.queues, Some(&fixed)).unwrap();
            assert_eq!(back, states[1..], "{what}");
        }
        let mut fixed = arm.clone();
        fixed.remove(&102);
        let (_, whole) = pack(&states, &fixed);
        assert_eq!(whole.len(), 1, "one Arm did not name");
        assert_eq!(whole[0].inode, 102);
    }

    #[test]
    fn bad_records_are_refused_naming_the_record_and_the_field() {
        let states = varied();
        let fixed: FixedParts = states.iter().map(|c| (c.inode, fixed_of(c))).collect();
        let (good, _) = pack(&states, &fixed);
        let word_at = |record: usize, word: usize| record * RECORD_LEN + 8 + 4 * word;
        let set = |p: &mut Packed, record: usize, word: usize, v: u32| {
            let o = word_at(record, word);
            p.records[o..o + 4].copy_from_slice(&v.to_le_bytes());
        };
        let cases: Vec<(&str, Packed, Option<&FixedParts>)> = vec![
            (
                "packed[2].packed: ",
                Packed {
                    records: good.records[..2 * RECORD_LEN + 5].to_vec(),
                    ..good.clone()
                },
                Some(&fixed),
            ),
            ("packed[0].inode: 101 was not named", good.clone(), None),
            (
                "packed[0].unsent: ",
                {
                    let mut p = good.clone();
                    set(&mut p, 0, 3, 36);
                    p
                },
                Some(&fixed),
            ),
            (
                "packed[1].mss_clamp: ",
                {
                    let mut p = good.clone();
                    set(&mut p, 1, 5, 0);
                    p
                },
                Some(&fixed),
            ),
            (
                "packed[1].mss_clamp: ",
                {
                    let mut p = good.clone();
                    set(&mut p, 1, 5, 70_000);
                    p
                },
                Some(&fixed),
            ),
            (
                "packed[2].reserved: ",
                {
                    let mut p = good.clone();
                    set(&mut p, 2, 14, 1);
                    p
                },
                Some(&fixed),
            ),
            (
                "packed[2].recv_queue: 3000 bytes, but packed_queues has 2999 left",
                Packed {
                    queues: good.queues[..good.queues.len() - 1].to_vec(),
                    ..good.clone()
                },
                Some(&fixed),
            ),
            (
                "packed[0].send_queue: ",
                {
                    let mut p = good.clone();
                    set(&mut p, 0, 2, u32::MAX);
                    p
                },
                Some(&fixed),
            ),
            (
                "packed[3].packed_queues: 1 bytes left over",
                Packed {
                    queues: [&good.queues[..], b"!"].concat(),
                    ..good.clone()
                },
                Some(&fixed),
            ),
        ];
        for (want, p, fixed) in cases {
            let err = unpack(&p.records, &p.queues, fixed).unwrap_err();
            assert!(matches!(err, SockStateError::InvalidPacked { .. }), "{err}");
            assert!(err.to_string().starts_with(want), "{want}: {err}");
        }
    }

    #[test]
    fn a_fixed_part_from_a_peer_is_checked() {
        let read = fixed_of(&varied()[0]);
        let (local, remote) = (read.local, read.remote);
        assert_eq!(Fixed::from_pb(local, remote, &read.to_pb()).unwrap(), read);
        for (field, p) in [
            (
                "fixed.send_wscale",
                pb::TcpConnectionFixed {
                    send_wscale: 15,
                    ..Default::default()
                },
            ),
            (
                "fixed.recv_wscale",
                pb::TcpConnectionFixed {
                    recv_wscale: 256,
                    ..Default::default()
                },
            ),
            (
                "fixed.options",
                pb::TcpConnectionFixed {
                    options: 0x10,
                    ..Default::default()
                },
            ),
            (
                "fixed.socket_options.bound_device",
                pb::TcpConnectionFixed {
                    socket_options: Some(pb::TcpSocketOptions {
                        bound_device: "x".repeat(16),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            ),
            (
                "fixed.socket_options.filter",
                pb::TcpConnectionFixed {
                    socket_options: Some(pb::TcpSocketOptions {
                        filter: vec![0; 4097],
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            ),
        ] {
            let (named, _) = Fixed::from_pb(local, remote, &p).unwrap_err();
            assert_eq!(named, field);
        }
    }
}
