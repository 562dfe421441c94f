//! Packets kept while processes move: what the data plane's capture ring
//! yields, sorted into the migration whose ports each packet is for, and
//! replayed into this node's stack when the process resumes here.
//!
//! A node may send one process away and receive another at the same time;
//! their ports differ (a port has one owner), so one ring serves both.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use ferry_ebpf::{CaptureKind, CapturedPacket, Protocol};

use crate::process::{PortKey, Transport};

/// The packets of one migration's ports, in arrival order.
#[derive(Debug, Default)]
struct Session {
    ports: BTreeSet<PortKey>,
    captured: Vec<CapturedPacket>,
    /// Digests of packets delivered here while recording.
    delivered: Vec<u64>,
}

/// Capture sessions by migration id.
#[derive(Debug, Default)]
pub struct CaptureStore {
    sessions: Mutex<HashMap<String, Session>>,
}

fn port_of(p: &CapturedPacket) -> PortKey {
    PortKey {
        transport: match p.protocol {
            Protocol::Tcp => Transport::Tcp,
            Protocol::Udp => Transport::Udp,
        },
        port: p.port,
    }
}

impl CaptureStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts (or widens) the session of `id`: from now on packets for
    /// `ports` are kept for it.
    pub fn open(&self, id: &str, ports: impl IntoIterator<Item = PortKey>) {
        self.lock()
            .entry(id.to_owned())
            .or_default()
            .ports
            .extend(ports);
    }

    /// Ends the session of `id`, dropping whatever it still holds; returns
    /// how many captured packets that was.
    pub fn close(&self, id: &str) -> usize {
        self.lock().remove(id).map_or(0, |s| s.captured.len())
    }

    /// Files packets from the ring under their sessions; returns how many
    /// belonged to none (a session closed since, or a port state left
    /// behind), which are dropped.
    pub fn route(&self, packets: Vec<CapturedPacket>) -> usize {
        let mut sessions = self.lock();
        let mut stray = 0;
        for p in packets {
            let port = port_of(&p);
            match sessions.values_mut().find(|s| s.ports.contains(&port)) {
                Some(s) => match p.kind {
                    CaptureKind::Captured => s.captured.push(p),
                    CaptureKind::Delivered => s.delivered.push(digest(&p.data)),
                },
                None => stray += 1,
            }
        }
        stray
    }

    /// Takes the captured packets of `id` filed so far.
    pub fn take_captured(&self, id: &str) -> Vec<CapturedPacket> {
        self.lock()
            .get_mut(id)
            .map(|s| std::mem::take(&mut s.captured))
            .unwrap_or_default()
    }

    /// Takes the delivered log of `id` filed so far.
    pub fn take_delivered(&self, id: &str) -> Vec<u64> {
        self.lock()
            .get_mut(id)
            .map(|s| std::mem::take(&mut s.delivered))
            .unwrap_or_default()
    }
}

/// 64-bit FNV-1a of a packet: how source and destination name the same
/// packet (both copies are the same broadcast frame, byte for byte).
pub fn digest(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// How many of the first `captured` packets the source delivered already:
/// the length of the longest prefix of `captured` that equals a suffix of
/// `delivered`.
///
/// Both nodes get the same frames in the same order (the router floods
/// each frame to every node), so the packets the source delivered after the
/// destination started capturing are the end of its log and the start of
/// the destination's capture. The longest match is taken: a shorter one
/// would replay packets twice. A frame one node missed (a full queue)
/// breaks the match early, which errs towards a duplicate, never a loss.
pub fn overlap(delivered: &[u64], captured: &[u64]) -> usize {
    let Some(&first) = captured.first() else {
        return 0;
    };
    let max = delivered.len().min(captured.len());
    // Candidate lengths are where the capture's first packet appears in
    // the log; checking only those keeps this linear in practice.
    (1..=max)
        .rev()
        .filter(|&k| delivered[delivered.len() - k] == first)
        .find(|&k| delivered[delivered.len() - k..] == captured[..k])
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pkt(kind: CaptureKind, port: u16, data: &[u8]) -> CapturedPacket {
        CapturedPacket {
            kind,
            protocol: Protocol::Udp,
            port,
            ktime_ns: 0,
            data: data.to_vec(),
        }
    }

    #[test]
    fn overlap_is_the_longest_prefix_matching_a_suffix() {
        assert_eq!(overlap(&[1, 2, 3, 4], &[3, 4, 5, 6]), 2);
        assert_eq!(overlap(&[1, 2, 3, 4], &[5, 6]), 0);
        assert_eq!(overlap(&[], &[5, 6]), 0);
        assert_eq!(overlap(&[1, 2], &[]), 0);
        // Everything the destination captured had been delivered.
        assert_eq!(overlap(&[1, 2, 3], &[2, 3]), 2);
        // Identical packets (same digest): the longest match wins, so the
        // second 7 the source never saw is replayed once.
        assert_eq!(overlap(&[9, 7, 7], &[7, 7, 7, 8]), 2);
        assert_eq!(overlap(&[7], &[7, 7]), 1);
        // A frame the destination missed ends the match: no loss.
        assert_eq!(overlap(&[1, 2, 3, 4], &[2, 4, 5]), 0);
    }

    #[test]
    fn routes_by_port_and_keeps_order() {
        let store = CaptureStore::default();
        let udp = |port| PortKey {
            transport: Transport::Udp,
            port,
        };
        store.open("a", [udp(7000)]);
        store.open("b", [udp(8000)]);
        let stray = store.route(vec![
            pkt(CaptureKind::Captured, 7000, b"a1"),
            pkt(CaptureKind::Delivered, 8000, b"b0"),
            pkt(CaptureKind::Captured, 8000, b"b1"),
            pkt(CaptureKind::Captured, 9000, b"nobody"),
            pkt(CaptureKind::Captured, 7000, b"a2"),
        ]);
        assert_eq!(stray, 1);
        let a: Vec<_> = store
            .take_captured("a")
            .into_iter()
            .map(|p| p.data)
            .collect();
        assert_eq!(a, vec![b"a1".to_vec(), b"a2".to_vec()]);
        assert!(store.take_captured("a").is_empty(), "taken once");
        assert_eq!(store.take_delivered("b"), vec![digest(b"b0")]);
        assert_eq!(store.close("b"), 1);
        assert_eq!(
            store.route(vec![pkt(CaptureKind::Captured, 8000, b"late")]),
            1
        );
    }

    #[test]
    fn digest_is_fnv1a() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(digest(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(digest(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}

/// Hands packets to this node's stack as if just received. Faked in unit
/// tests.
pub trait PacketReplayer: Send {
    fn replay(&mut self, packet: &[u8]) -> Result<(), String>;
}

impl PacketReplayer for ferry_ebpf::Replayer {
    fn replay(&mut self, packet: &[u8]) -> Result<(), String> {
        ferry_ebpf::Replayer::replay(self, packet).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
pub mod fake {
    use std::sync::{Arc, Mutex};

    /// Keeps every replayed packet.
    #[derive(Default, Clone)]
    pub struct FakeReplayer(pub Arc<Mutex<Vec<Vec<u8>>>>);

    impl super::PacketReplayer for FakeReplayer {
        fn replay(&mut self, packet: &[u8]) -> Result<(), String> {
            self.0.lock().unwrap().push(packet.to_vec());
            Ok(())
        }
    }
}
