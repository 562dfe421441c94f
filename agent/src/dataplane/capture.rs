//! Packets kept while processes move: what the data plane's capture ring
//! yields, sorted into the migration whose ports each packet is for, and
//! replayed into this node's stack when the process resumes here.
//!
//! A node may send one process away and receive another at the same time;
//! their ports differ (a port has one owner), so one ring serves both.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use ferry_ebpf::{CaptureKind, CapturedPacket, Flow, Protocol};

use crate::process::{PortKey, Transport};

/// The packets of one migration's ports, in arrival order.
#[derive(Debug, Default)]
struct Session {
    ports: BTreeSet<PortKey>,
    /// When not empty, only these connections of `ports` (a handoff's
    /// session: the other connections of a shared port are not its).
    flows: BTreeSet<Flow>,
    captured: Vec<CapturedPacket>,
    /// Digests of packets delivered here while recording.
    delivered: Vec<u64>,
    /// When the session opened (CLOCK_MONOTONIC, the clock of
    /// `bpf_ktime_get_ns`): older packets are another migration's.
    since_ns: u64,
}

/// Now on CLOCK_MONOTONIC, the clock the capture records' times are on.
fn monotonic_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid, writable timespec for the duration of the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) } != 0 {
        // Cannot fail for CLOCK_MONOTONIC; keeping everything is the safe
        // side (a stale packet replayed, never a fresh one dropped).
        return 0;
    }
    (t.tv_sec as u64) * 1_000_000_000 + t.tv_nsec as u64
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

/// The connection a captured TCP packet belongs to, from its IP and TCP
/// headers: the sender's end and the port it is for. IPv6 extension
/// headers are not followed (TCP senders do not add them): a segment with
/// them belongs to no flow, so a session of single connections drops it as
/// stray, and TCP sends it again.
fn flow_of(p: &CapturedPacket) -> Option<Flow> {
    let d = &p.data;
    let (src, l4): (std::net::IpAddr, usize) = match *d.first()? >> 4 {
        4 => {
            let src: [u8; 4] = d.get(12..16)?.try_into().ok()?;
            (src.into(), usize::from(d[0] & 0x0f) * 4)
        }
        6 if d.get(6) == Some(&(libc::IPPROTO_TCP as u8)) => {
            let src: [u8; 16] = d.get(8..24)?.try_into().ok()?;
            (src.into(), 40)
        }
        _ => return None,
    };
    let sport = u16::from_be_bytes(d.get(l4..l4 + 2)?.try_into().ok()?);
    Some(Flow::new((src, sport).into(), p.port))
}

impl CaptureStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        crate::sync::lock(&self.sessions)
    }

    /// Starts (or widens) the session of `id`: from now on packets for
    /// `ports` are kept for it.
    ///
    /// Only packets taken into the ring from now on: the ring may still
    /// hold packets for the same ports from an earlier migration (what a
    /// source captured after it last collected the ring), and replaying those here
    /// would hand the stack segments of connections that are long gone,
    /// which it answers with RSTs.
    pub fn open(&self, id: &str, ports: impl IntoIterator<Item = PortKey>) {
        self.open_since(id, ports, monotonic_ns());
    }

    /// [`Self::open`] with an explicit start (CLOCK_MONOTONIC nanoseconds).
    pub fn open_since(&self, id: &str, ports: impl IntoIterator<Item = PortKey>, since_ns: u64) {
        let mut sessions = self.lock();
        let session = sessions.entry(id.to_owned()).or_insert_with(|| Session {
            since_ns,
            ..Session::default()
        });
        session.ports.extend(ports);
    }

    /// Starts the session of `id` for one connection of a shared port:
    /// packets of the port's other connections are not its.
    pub fn open_flow(&self, id: &str, flow: Flow) {
        let mut sessions = self.lock();
        let session = sessions.entry(id.to_owned()).or_insert_with(|| Session {
            since_ns: monotonic_ns(),
            ..Session::default()
        });
        session.ports.insert(PortKey {
            transport: Transport::Tcp,
            port: flow.local_port,
        });
        session.flows.insert(flow);
    }

    /// Whether the session of `id` is open.
    pub fn is_open(&self, id: &str) -> bool {
        self.lock().contains_key(id)
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
            let flow = flow_of(&p);
            match sessions.values_mut().find(|s| {
                s.ports.contains(&port)
                    && p.ktime_ns >= s.since_ns
                    && (s.flows.is_empty() || flow.is_some_and(|f| s.flows.contains(&f)))
            }) {
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

/// The XXH3 64-bit digest of a packet (seed 0): how source and destination
/// name the same packet (both copies are the same broadcast frame, byte for
/// byte). XXH3 has a published specification, so every agent computes the
/// same value, and it mixes every input bit into every output bit: packets
/// of one flow differ in a few scattered fields (IP ID and checksum, TCP
/// sequence and checksum), and a hash whose bits only carry upwards (FNV
/// over words) makes such pairs collide often, which would skip, and lose,
/// a packet. Part of peer protocol version 2: changing it changes the
/// protocol.
pub fn digest(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}

/// What the source delivered between Arm and the freeze, as a multiset of
/// digests: a captured packet found here was handled by the source already
/// and is not replayed.
///
/// Both nodes get every frame (the router floods it), but not in the same
/// order: frames reach each node's ingress on whichever CPU forwarded them,
/// so two flows interleave differently in the two rings, and a sequence
/// match between the source's log and the destination's capture breaks at
/// the first inversion. Membership does not care about order. It relies on
/// packets being unique byte for byte, which the IP ID (a per-socket
/// counter for TCP and connected UDP) and the TCP sequence numbers make
/// them; two equal frames each count once, so a duplicate the source saw
/// once is replayed once.
#[derive(Debug, Default)]
pub struct DeliveredLog {
    counts: HashMap<u64, u32>,
    left: usize,
}

impl DeliveredLog {
    pub fn new(digests: &[u64]) -> Self {
        let mut counts = HashMap::with_capacity(digests.len());
        for d in digests {
            *counts.entry(*d).or_insert(0) += 1;
        }
        Self {
            counts,
            left: digests.len(),
        }
    }

    /// Whether nothing of the log is left to match.
    pub fn is_empty(&self) -> bool {
        self.left == 0
    }

    /// Takes one occurrence of `digest` out of the log, if it is there.
    pub fn take(&mut self, digest: u64) -> bool {
        match self.counts.get_mut(&digest) {
            Some(n) if *n > 0 => {
                *n -= 1;
                self.left -= 1;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::dataplane::replay::lane_of;

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
    fn delivered_log_matches_in_any_order_and_each_packet_once() {
        let mut log = DeliveredLog::new(&[1, 2, 7, 7, 3]);
        // The destination's ring interleaves flows differently.
        assert!(log.take(3));
        assert!(log.take(1));
        // Missing from the log: replayed.
        assert!(!log.take(9));
        assert!(log.take(7));
        assert!(log.take(7));
        // A third 7 the source never saw is replayed.
        assert!(!log.take(7));
        assert!(!log.is_empty());
        assert!(log.take(2));
        assert!(log.is_empty());
        assert!(!log.take(2));
        assert!(DeliveredLog::new(&[]).is_empty());
    }

    #[test]
    fn packets_older_than_the_session_belong_to_an_earlier_migration() {
        let store = CaptureStore::default();
        let tcp = PortKey {
            transport: Transport::Tcp,
            port: 7000,
        };
        store.open_since("now", [tcp], 1_000);
        let mut old = pkt(CaptureKind::Captured, 7000, b"left from the last migration");
        old.protocol = Protocol::Tcp;
        old.ktime_ns = 999;
        let mut new = old.clone();
        new.ktime_ns = 1_000;
        new.data = b"this one".to_vec();
        assert_eq!(store.route(vec![old, new]), 1);
        let kept: Vec<_> = store
            .take_captured("now")
            .into_iter()
            .map(|p| p.data)
            .collect();
        assert_eq!(kept, vec![b"this one".to_vec()]);
    }

    /// A pure ACK from `src_port` to 198.18.0.100:7000 (coalescing passes
    /// it through unchanged).
    pub(crate) fn tcp_ack(src_port: u16, ack: u32) -> Vec<u8> {
        let mut p = vec![0u8; 40];
        p[..10].copy_from_slice(&[0x45, 0, 0, 40, 0, 0, 0x40, 0, 64, 6]);
        p[12..16].copy_from_slice(&[198, 18, 0, 2]);
        p[16..20].copy_from_slice(&[198, 18, 0, 100]);
        p[20..22].copy_from_slice(&src_port.to_be_bytes());
        p[22..24].copy_from_slice(&7000u16.to_be_bytes());
        p[28..32].copy_from_slice(&ack.to_be_bytes());
        p[32] = 0x50;
        p[33] = 0x10;
        p
    }

    /// [`tcp_ack`] over IPv6 (2001:2::2 to 2001:2::100), behind `ext`
    /// (extension headers; the next header field then says the first).
    pub(crate) fn tcp6_ack(src_port: u16, ack: u32, first: u8, ext: &[u8]) -> Vec<u8> {
        let v4 = tcp_ack(src_port, ack);
        let mut p = vec![0x60, 0, 0, 0, 0, 0, first, 64];
        p.extend_from_slice(&[0x20, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
        p.extend_from_slice(&[0x20, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]);
        p.extend_from_slice(ext);
        p.extend_from_slice(&v4[20..]);
        let len = (p.len() - 40) as u16;
        p[4..6].copy_from_slice(&len.to_be_bytes());
        p
    }

    #[test]
    fn a_connection_always_takes_the_same_lane_and_the_rest_lane_0() {
        for lanes in [2, 3, 4] {
            for packet in [
                |port, ack| tcp_ack(port, ack),
                |port, ack| tcp6_ack(port, ack, 6, &[]),
            ] {
                let mut per_lane = vec![0usize; lanes];
                for port in 10_000..11_000u16 {
                    let lane = lane_of(&packet(port, 1), lanes);
                    assert_eq!(lane, lane_of(&packet(port, 99), lanes), "port {port}");
                    per_lane[lane] += 1;
                }
                // A thousand connections spread over every lane.
                for n in &per_lane {
                    assert!(*n > 1000 / lanes / 2, "{per_lane:?}");
                }
            }
        }
        let mut udp = tcp_ack(10_000, 1);
        udp[9] = 17;
        let mut fragment = tcp_ack(10_001, 1);
        fragment[6] = 0x20; // more fragments
        let mut later_fragment = tcp_ack(10_001, 1);
        later_fragment[7] = 0x10; // offset 128
        let mut options = tcp_ack(10_002, 1);
        options[0] = 0x4f; // 60 bytes of IP header in a 40-byte packet
        for (what, p) in [
            ("udp", udp),
            ("fragment", fragment),
            ("later fragment", later_fragment),
            ("IP options past the end", options),
            ("ipv6, not TCP", vec![0x60; 60]),
            (
                "ipv6 behind hop-by-hop options",
                tcp6_ack(10_004, 1, 0, &[6, 0, 1, 4, 0, 0, 0, 0]),
            ),
            ("short", vec![0x45; 19]),
        ] {
            assert_eq!(lane_of(&p, 4), 0, "{what}");
        }
        assert_eq!(lane_of(&tcp_ack(10_003, 1), 1), 0);
    }

    #[test]
    fn a_captured_segment_belongs_to_its_senders_flow_in_either_family() {
        let tcp = |data: Vec<u8>| CapturedPacket {
            protocol: Protocol::Tcp,
            ..pkt(CaptureKind::Captured, 7000, &data)
        };
        assert_eq!(
            flow_of(&tcp(tcp_ack(40_000, 1))),
            Some(Flow::new("198.18.0.2:40000".parse().unwrap(), 7000))
        );
        assert_eq!(
            flow_of(&tcp(tcp6_ack(40_000, 1, 6, &[]))),
            Some(Flow::new("[2001:2::2]:40000".parse().unwrap(), 7000))
        );
        assert_eq!(
            flow_of(&tcp(tcp6_ack(40_000, 1, 0, &[6, 0, 1, 4, 0, 0, 0, 0]))),
            None
        );
        assert_eq!(flow_of(&tcp(vec![0x60; 30])), None);
    }

    #[test]
    fn routes_by_port_and_keeps_order() {
        let store = CaptureStore::default();
        let udp = |port| PortKey {
            transport: Transport::Udp,
            port,
        };
        store.open_since("a", [udp(7000)], 0);
        store.open_since("b", [udp(8000)], 0);
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
    fn digest_is_xxh3_and_tells_apart_packets_of_one_flow() {
        // Published XXH3-64 value of the empty input: agents of any build
        // agree.
        assert_eq!(digest(b""), 0x2d06_8005_38d3_94c2);
        // 100,000 segments of one TCP flow, as a busy migration captures
        // them: consecutive IP IDs, sequence numbers and checksums, and
        // payloads differing in a few bytes. No two may share a digest.
        let mut seen = std::collections::HashSet::new();
        let mut packet = vec![0u8; 296];
        packet[0] = 0x45;
        for i in 0u32..100_000 {
            packet[4..6].copy_from_slice(&(i as u16).to_be_bytes());
            packet[10..12].copy_from_slice(&((i * 7) as u16).to_be_bytes());
            packet[24..28].copy_from_slice(&(i * 256).to_be_bytes());
            packet[36..38].copy_from_slice(&((i * 13) as u16).to_be_bytes());
            packet[40..44].copy_from_slice(&i.to_le_bytes());
            assert!(seen.insert(digest(&packet)), "collision at {i}");
        }
        assert_ne!(digest(&[0; 8]), digest(&[0; 9]));
    }
}
