//! Joining captured TCP segments before they are replayed.
//!
//! While a process is frozen its clients keep sending: at the seed's DVE
//! load (1024 connections, 20 messages of 256 B a second each) a freeze of
//! half a second leaves ~10 small segments per connection in the capture.
//! Replayed one by one, each costs a pass through the receive path and an
//! ACK back through the cluster's links (~20 µs each on a loaded 2-core
//! node, measured by the 1024-connection data-plane test), all inside the
//! freeze. Consecutive segments of one connection carry one contiguous
//! byte range, so they can enter the stack as one segment, which is what
//! the kernel's own GRO does with segments that arrive together: every
//! byte still arrives once and in order, and the socket sees one skb and
//! sends one ACK instead of ten.
//!
//! What is joined: data segments of one flow (same addresses and ports)
//! whose sequence numbers follow each other or overlap what the run
//! already holds (a retransmission: TCP resends the same bytes, often
//! several small segments collapsed into one, and only the bytes past the
//! run's end are new), with only ACK (and PSH) set,
//! and no IP options, IPv6 extension headers or fragmentation; IPv4 and
//! IPv6 alike. The joined segment takes the first
//! segment's sequence number and the last one's acknowledgment, window and
//! TCP options (its timestamp is the newest, as in a segment the client
//! could have sent itself), and PSH if any had it. Anything else (SYN, FIN,
//! RST, URG, a pure ACK, a retransmission, UDP, a fragment, garbage) ends
//! the flow's run and is passed through unchanged, so the order of each
//! flow's packets is kept; packets of different flows may be reordered
//! among themselves, which no socket can tell.
//!
//! Checksums are left to the replayer, which recomputes the transport
//! checksum of every packet and whose raw socket fills in the IP header's
//! length and checksum.

use std::collections::HashMap;

/// The largest TCP payload a joined segment carries: its IP packet must fit
/// the 16-bit total length with room for headers and options.
pub const MAX_JOINED_PAYLOAD: usize = 60_000;

const TCP_PSH: u8 = 0x08;
const TCP_ACK: u8 = 0x10;

/// A packet to replay and how many captured packets it stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Joined {
    pub packet: Vec<u8>,
    pub packets: usize,
}

/// A TCP flow: its addresses (IPv4's 8 bytes, or IPv6's 32) and ports.
type FlowKey = [u8; 36];

fn flow_key(addresses: &[u8], ports: &[u8]) -> FlowKey {
    let mut flow = [0u8; 36];
    flow[..addresses.len()].copy_from_slice(addresses);
    flow[32..].copy_from_slice(&ports[..4]);
    flow
}

/// A TCP data segment that may be joined with its neighbours.
struct Segment<'a> {
    flow: FlowKey,
    seq: u32,
    /// The IP header: IPv4's 20 bytes (no options) or IPv6's 40 (no
    /// extension headers).
    ip_header: &'a [u8],
    /// The TCP header with its options.
    tcp_header: &'a [u8],
    payload: &'a [u8],
    flags: u8,
}

/// The IP header's length and the packet's, for a plain TCP packet: IPv4
/// without options or fragmentation, IPv6 without extension headers.
fn plain_tcp(p: &[u8]) -> Option<(usize, usize)> {
    let (ip_len, total) = match p.first()? >> 4 {
        4 if p.len() >= 20 && p[0] == 0x45 && p[9] == 6 => {
            let frag = u16::from_be_bytes([p[6], p[7]]);
            if frag & 0x3fff != 0 {
                return None;
            }
            (20, usize::from(u16::from_be_bytes([p[2], p[3]])))
        }
        6 if p.len() >= 40 && p[6] == 6 => (40, 40 + usize::from(u16::from_be_bytes([p[4], p[5]]))),
        _ => return None,
    };
    (total <= p.len() && total >= ip_len + 20).then_some((ip_len, total))
}

fn segment(p: &[u8]) -> Option<Segment<'_>> {
    let (ip_len, total) = plain_tcp(p)?;
    let tcp = &p[ip_len..total];
    let doff = usize::from(tcp[12] >> 4) * 4;
    if doff < 20 || doff > tcp.len() {
        return None;
    }
    let flags = tcp[13];
    // ACK, optionally PSH, nothing else (CWR/ECE would need care too).
    if flags & TCP_ACK == 0 || flags & !(TCP_ACK | TCP_PSH) != 0 {
        return None;
    }
    let payload = &tcp[doff..];
    if payload.is_empty() {
        return None;
    }
    let addresses = if ip_len == 20 { &p[12..20] } else { &p[8..40] };
    Some(Segment {
        flow: flow_key(addresses, tcp),
        seq: u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]),
        ip_header: &p[..ip_len],
        tcp_header: &tcp[..doff],
        payload,
        flags,
    })
}

/// A run of joined segments being built.
struct Run {
    /// IP header of the first segment.
    ip_header: Vec<u8>,
    first_seq: u32,
    /// TCP header (with options) of the latest segment.
    tcp_header: Vec<u8>,
    flags: u8,
    payload: Vec<u8>,
    packets: usize,
}

impl Run {
    fn start(s: &Segment<'_>) -> Self {
        Run {
            ip_header: s.ip_header.to_vec(),
            first_seq: s.seq,
            tcp_header: s.tcp_header.to_vec(),
            flags: s.flags,
            payload: s.payload.to_vec(),
            packets: 1,
        }
    }

    /// Adds a segment whose first `known` bytes the run already holds (a
    /// retransmission: the same bytes again).
    fn extend(&mut self, s: &Segment<'_>, known: usize) {
        self.tcp_header.clear();
        self.tcp_header.extend_from_slice(s.tcp_header);
        self.flags |= s.flags;
        self.payload.extend_from_slice(&s.payload[known..]);
        self.packets += 1;
    }

    fn into_joined(self) -> Joined {
        let ip_len = self.ip_header.len();
        let l4_len = self.tcp_header.len() + self.payload.len();
        let mut packet = Vec::with_capacity(ip_len + l4_len);
        packet.extend_from_slice(&self.ip_header);
        if ip_len == 20 {
            packet[2..4].copy_from_slice(&((ip_len + l4_len) as u16).to_be_bytes());
        } else {
            // IPv6's payload length leaves the fixed header out.
            packet[4..6].copy_from_slice(&(l4_len as u16).to_be_bytes());
        }
        let tcp_at = packet.len();
        packet.extend_from_slice(&self.tcp_header);
        packet[tcp_at + 4..tcp_at + 8].copy_from_slice(&self.first_seq.to_be_bytes());
        packet[tcp_at + 13] = self.flags;
        packet.extend_from_slice(&self.payload);
        Joined {
            packet,
            packets: self.packets,
        }
    }
}

/// Entries of the output: a packet passed through, or a run (by index).
enum Slot<'a> {
    Packet(&'a [u8]),
    Run(usize),
}

/// Joins consecutive data segments of each TCP flow in `packets` (in
/// capture order); see the module docs. Every input packet is in exactly
/// one output packet, and each flow's bytes keep their order.
pub fn coalesce<'a>(packets: impl IntoIterator<Item = &'a [u8]>) -> Vec<Joined> {
    let mut slots: Vec<Slot<'a>> = Vec::new();
    let mut runs: Vec<Run> = Vec::new();
    // The run each flow may still extend.
    let mut open: HashMap<FlowKey, usize> = HashMap::new();
    for p in packets {
        match segment(p) {
            Some(s) => {
                if let Some(&r) = open.get(&s.flow) {
                    let run = &mut runs[r];
                    // Where the segment starts inside the run's bytes: at
                    // their end (the next segment), or before it (the
                    // client retransmitted, often several small segments
                    // collapsed into one, while nothing was ACKed).
                    let at = s.seq.wrapping_sub(run.first_seq) as usize;
                    let fresh = (at + s.payload.len()).saturating_sub(run.payload.len());
                    if at <= run.payload.len() && run.payload.len() + fresh <= MAX_JOINED_PAYLOAD {
                        run.extend(&s, s.payload.len() - fresh);
                        continue;
                    }
                }
                open.insert(s.flow, runs.len());
                slots.push(Slot::Run(runs.len()));
                runs.push(Run::start(&s));
            }
            None => {
                // Whatever it is, later data of its flow must not be joined
                // into a run that precedes it.
                if let Some(flow) = flow_of(p) {
                    open.remove(&flow);
                }
                slots.push(Slot::Packet(p));
            }
        }
    }
    let mut runs: Vec<Option<Run>> = runs.into_iter().map(Some).collect();
    slots
        .into_iter()
        .filter_map(|slot| match slot {
            Slot::Packet(p) => Some(Joined {
                packet: p.to_vec(),
                packets: 1,
            }),
            // A run of one rebuilds its segment byte for byte.
            Slot::Run(i) => runs[i].take().map(Run::into_joined),
        })
        .collect()
}

/// The flow key of any TCP packet with a readable header: IPv4 with its
/// options, IPv6 past its extension headers (hop-by-hop, routing,
/// destination options, and a first fragment's header).
fn flow_of(p: &[u8]) -> Option<FlowKey> {
    match p.first()? >> 4 {
        4 => {
            if p.len() < 24 || p[9] != 6 {
                return None;
            }
            let ihl = usize::from(p[0] & 0x0f) * 4;
            Some(flow_key(&p[12..20], p.get(ihl.max(20)..ihl.max(20) + 4)?))
        }
        6 => {
            let (mut next, mut at) = (*p.get(6)?, 40);
            for _ in 0..8 {
                match next {
                    6 => return Some(flow_key(p.get(8..40)?, p.get(at..at + 4)?)),
                    0 | 43 | 60 => {
                        next = *p.get(at)?;
                        at += (usize::from(*p.get(at + 1)?) + 1) * 8;
                    }
                    // A fragment header: fragment zero holds the ports.
                    44 if u16::from_be_bytes(p.get(at + 2..at + 4)?.try_into().ok()?) >> 3 == 0 => {
                        next = *p.get(at)?;
                        at += 8;
                    }
                    _ => return None,
                }
            }
            None
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TCP_FIN: u8 = 0x01;

    /// An IPv4/TCP segment with a timestamp option (12 bytes: NOP NOP TS).
    fn tcp(src_port: u16, seq: u32, ack: u32, flags: u8, tsval: u32, payload: &[u8]) -> Vec<u8> {
        let mut p = vec![
            0x45, 0, 0, 0, 0x12, 0x34, 0x40, 0, 64, 6, 0, 0, 198, 18, 1, 1, 198, 18, 0, 100,
        ];
        p.extend_from_slice(&src_port.to_be_bytes());
        p.extend_from_slice(&7000u16.to_be_bytes());
        p.extend_from_slice(&seq.to_be_bytes());
        p.extend_from_slice(&ack.to_be_bytes());
        p.push(8 << 4); // 32-byte header
        p.push(flags);
        p.extend_from_slice(&502u16.to_be_bytes());
        p.extend_from_slice(&[0xab, 0xcd, 0, 0]); // checksum (stale), urgent
        p.extend_from_slice(&[1, 1, 8, 10]);
        p.extend_from_slice(&tsval.to_be_bytes());
        p.extend_from_slice(&77u32.to_be_bytes());
        p.extend_from_slice(payload);
        let total = p.len() as u16;
        p[2..4].copy_from_slice(&total.to_be_bytes());
        p
    }

    fn seq_of(p: &[u8]) -> u32 {
        u32::from_be_bytes([p[24], p[25], p[26], p[27]])
    }

    fn payload_of(p: &[u8]) -> &[u8] {
        let doff = usize::from(p[32] >> 4) * 4;
        let total = usize::from(u16::from_be_bytes([p[2], p[3]]));
        &p[20 + doff..total]
    }

    fn run(packets: &[Vec<u8>]) -> Vec<Joined> {
        coalesce(packets.iter().map(Vec::as_slice))
    }

    #[test]
    fn joins_a_flows_consecutive_segments_with_the_latest_header() {
        let a = tcp(40000, 1000, 5, TCP_ACK, 1, b"hello ");
        let b = tcp(40000, 1006, 6, TCP_ACK | TCP_PSH, 2, b"world");
        let c = tcp(40000, 1011, 7, TCP_ACK, 3, b"!");
        let out = run(&[a, b, c.clone()]);
        assert_eq!(out.len(), 1);
        let j = &out[0];
        assert_eq!(j.packets, 3);
        assert_eq!(seq_of(&j.packet), 1000);
        assert_eq!(payload_of(&j.packet), b"hello world!");
        assert_eq!(
            usize::from(u16::from_be_bytes([j.packet[2], j.packet[3]])),
            j.packet.len()
        );
        // ack, window and options are the last segment's; PSH is kept.
        assert_eq!(&j.packet[28..32], &c[28..32]);
        assert_eq!(&j.packet[40..52], &c[40..52]);
        assert_eq!(j.packet[33], TCP_ACK | TCP_PSH);
    }

    #[test]
    fn keeps_each_flows_order_and_every_byte_once() {
        // Two flows interleaved, a gap (retransmission) in one, a FIN in
        // the other: per flow, the bytes come out in order and complete.
        let packets = vec![
            tcp(1, 100, 0, TCP_ACK, 1, b"ab"),
            tcp(2, 500, 0, TCP_ACK, 1, b"xy"),
            tcp(1, 102, 0, TCP_ACK, 2, b"cd"),
            tcp(2, 502, 0, TCP_ACK | TCP_FIN, 2, b"z"),
            tcp(2, 503, 0, TCP_ACK, 3, b"late"),
            tcp(1, 100, 0, TCP_ACK, 3, b"abcdef"), // retransmitted, collapsed
            tcp(1, 106, 0, TCP_ACK, 4, b"gh"),
            tcp(1, 200, 0, TCP_ACK, 5, b"gap"), // not contiguous: a new run
            tcp(1, 90, 0, TCP_ACK, 5, b"old"),  // before that run: passed on
        ];
        let out = run(&packets);
        assert_eq!(out.iter().map(|j| j.packets).sum::<usize>(), packets.len());
        let stream = |port: u16| -> Vec<(u32, Vec<u8>)> {
            out.iter()
                .filter(|j| u16::from_be_bytes([j.packet[20], j.packet[21]]) == port)
                .map(|j| (seq_of(&j.packet), payload_of(&j.packet).to_vec()))
                .collect()
        };
        assert_eq!(
            stream(1),
            vec![
                (100, b"abcdefgh".to_vec()),
                (200, b"gap".to_vec()),
                (90, b"old".to_vec())
            ]
        );
        // The FIN passes unchanged and nothing after it joins what came
        // before it.
        assert_eq!(
            stream(2),
            vec![
                (500, b"xy".to_vec()),
                (502, b"z".to_vec()),
                (503, b"late".to_vec())
            ]
        );
    }

    /// The same TCP segment over IPv6 (2001:2::1:1 -> 2001:2::100),
    /// behind `ext` (extension headers, the first byte of each its next
    /// header; the last one's must be 6).
    fn over_ipv6(p: &[u8], first: u8, ext: &[u8]) -> Vec<u8> {
        let mut v6 = vec![0x60, 0, 0, 0, 0, 0, first, 64];
        v6.extend_from_slice(&[0x20, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1]);
        v6.extend_from_slice(&[0x20, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]);
        v6.extend_from_slice(ext);
        v6.extend_from_slice(&p[20..]);
        let len = (v6.len() - 40) as u16;
        v6[4..6].copy_from_slice(&len.to_be_bytes());
        v6
    }

    #[test]
    fn joins_ipv6_segments_apart_from_ipv4_ones_and_stops_at_extension_headers() {
        let v4 = tcp(1, 100, 0, TCP_ACK, 1, b"ab");
        let packets = vec![
            over_ipv6(&tcp(1, 100, 0, TCP_ACK, 1, b"v6:"), 6, &[]),
            v4.clone(),
            over_ipv6(&tcp(1, 103, 0, TCP_ACK, 2, b"one"), 6, &[]),
            // Hop-by-hop options: passed on, and the run before it ends.
            over_ipv6(
                &tcp(1, 106, 0, TCP_ACK, 3, b"-"),
                0,
                &[6, 0, 1, 4, 0, 0, 0, 0],
            ),
            over_ipv6(&tcp(1, 107, 0, TCP_ACK, 4, b"two"), 6, &[]),
        ];
        let out = run(&packets);
        assert_eq!(out.len(), 4);
        assert_eq!(
            out.iter().map(|j| j.packets).collect::<Vec<_>>(),
            [2, 1, 1, 1]
        );
        let j = &out[0].packet;
        assert_eq!(j[0] >> 4, 6);
        assert_eq!(usize::from(u16::from_be_bytes([j[4], j[5]])) + 40, j.len());
        assert_eq!(u32::from_be_bytes([j[44], j[45], j[46], j[47]]), 100);
        assert!(j.ends_with(b"v6:one"));
        assert_eq!(
            out[1].packet, v4,
            "the IPv4 flow of the same ports is another flow"
        );
        assert_eq!(out[2].packet, packets[3]);
        assert!(out[3].packet.ends_with(b"two"));
    }

    #[test]
    fn passes_through_what_it_does_not_join() {
        let syn = tcp(3, 0, 0, 0x02, 1, b"");
        let pure_ack = tcp(3, 1, 1, TCP_ACK, 1, b"");
        let mut udp = tcp(4, 0, 0, TCP_ACK, 1, b"dgram");
        udp[9] = 17;
        let mut fragment = tcp(5, 0, 0, TCP_ACK, 1, b"frag");
        fragment[6] = 0x20; // more fragments
        let mut options = tcp(6, 0, 0, TCP_ACK, 1, b"opts");
        options[0] = 0x46;
        let garbage = vec![0x45, 0, 1];
        let alone = tcp(7, 9, 0, TCP_ACK, 1, b"single");
        let packets = vec![syn, pure_ack, udp, fragment, options, garbage, alone];
        let out = run(&packets);
        let back: Vec<Vec<u8>> = out.into_iter().map(|j| j.packet).collect();
        assert_eq!(back, packets);
    }

    #[test]
    fn stops_joining_at_the_size_limit() {
        let chunk = vec![7u8; 1400];
        let packets: Vec<Vec<u8>> = (0..100)
            .map(|i| tcp(8, i * 1400, 0, TCP_ACK, i, &chunk))
            .collect();
        let out = run(&packets);
        assert!(out.len() > 1);
        assert!(
            out.iter()
                .all(|j| payload_of(&j.packet).len() <= MAX_JOINED_PAYLOAD)
        );
        assert!(out.iter().all(|j| j.packet.len() <= usize::from(u16::MAX)));
        let total: usize = out.iter().map(|j| payload_of(&j.packet).len()).sum();
        assert_eq!(total, 100 * 1400);
        let seqs: Vec<u32> = out.iter().map(|j| seq_of(&j.packet)).collect();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn sequence_numbers_may_wrap() {
        let a = tcp(9, u32::MAX - 1, 0, TCP_ACK, 1, b"ab");
        let b = tcp(9, 0, 0, TCP_ACK, 2, b"cd");
        let out = run(&[a, b]);
        assert_eq!(out.len(), 1);
        assert_eq!(payload_of(&out[0].packet), b"abcd");
    }
}
