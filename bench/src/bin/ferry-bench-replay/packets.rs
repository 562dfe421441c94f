//! The captured packets a replay hands back: IPv4 UDP datagrams and TCP segments with correct checksums.

use super::*;

/// The 256-byte payload tagged `tag`: the tag, then bytes that depend on it.
pub(crate) fn payload(tag: u64) -> [u8; PAYLOAD] {
    let mut p = [0u8; PAYLOAD];
    p[..8].copy_from_slice(&tag.to_be_bytes());
    for (i, b) in p[8..].iter_mut().enumerate() {
        *b = (tag as u8).wrapping_mul(31).wrapping_add(i as u8);
    }
    p
}

/// Sums big-endian 16-bit words (odd last byte padded with zero).
pub(crate) fn sum_words(mut sum: u32, bytes: &[u8]) -> u32 {
    let mut chunks = bytes.chunks_exact(2);
    for w in &mut chunks {
        sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    sum
}

pub(crate) fn fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv4 packet CLIENT -> TARGET around `l4`, whose checksum (at
/// `csum_at` within it) is filled in, as is the header's.
pub(crate) fn ipv4(id: u16, proto: u8, mut l4: Vec<u8>, csum_at: usize) -> Vec<u8> {
    let total = 20 + l4.len();
    let mut p = Vec::with_capacity(total);
    p.extend_from_slice(&[0x45, 0]);
    p.extend_from_slice(&(total as u16).to_be_bytes());
    p.extend_from_slice(&id.to_be_bytes());
    p.extend_from_slice(&[0x40, 0, 64, proto, 0, 0]); // DF, TTL 64
    p.extend_from_slice(&CLIENT.octets());
    p.extend_from_slice(&TARGET.octets());
    let h = fold(sum_words(0, &p));
    p[10..12].copy_from_slice(&h.to_be_bytes());
    let mut sum = sum_words(0, &p[12..20]) + u32::from(proto) + l4.len() as u32;
    sum = sum_words(sum, &l4);
    let mut c = fold(sum);
    if c == 0 && proto == 17 {
        c = 0xffff;
    }
    l4[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
    p.extend_from_slice(&l4);
    p
}

/// Datagram `seq` of a UDP player at 198.18.243.7 (16 source ports).
pub(crate) fn udp_packet(seq: u64, k: usize) -> Vec<u8> {
    udp_packet_to(UDP_PORT, seq, k)
}

pub(crate) fn udp_packet_to(port: u16, seq: u64, k: usize) -> Vec<u8> {
    let mut l4 = Vec::with_capacity(8 + PAYLOAD);
    l4.extend_from_slice(&(40_000 + (k % 16) as u16).to_be_bytes());
    l4.extend_from_slice(&port.to_be_bytes());
    l4.extend_from_slice(&((8 + PAYLOAD) as u16).to_be_bytes());
    l4.extend_from_slice(&[0, 0]);
    l4.extend_from_slice(&payload(seq));
    ipv4(k as u16, 17, l4, 6)
}

/// Data segment `seg` (256 bytes) of connection `conn`: in window, in
/// order, acknowledging everything the server has sent (nothing).
pub(crate) fn tcp_packet(c: &RepairedConn, conn: usize, seg: usize, k: usize) -> Vec<u8> {
    let mut l4 = Vec::with_capacity(20 + PAYLOAD);
    l4.extend_from_slice(&c.peer_port.to_be_bytes());
    l4.extend_from_slice(&TCP_PORT.to_be_bytes());
    l4.extend_from_slice(&(c.rcv_nxt.wrapping_add((seg * PAYLOAD) as u32)).to_be_bytes());
    l4.extend_from_slice(&c.snd_nxt.to_be_bytes());
    l4.extend_from_slice(&[5 << 4, 0x18]); // no options; PSH | ACK
    l4.extend_from_slice(&0xffffu16.to_be_bytes());
    l4.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
    l4.extend_from_slice(&payload(tcp_tag(conn, seg)));
    ipv4(k as u16, 6, l4, 16)
}

pub(crate) fn tcp_tag(conn: usize, seg: usize) -> u64 {
    ((conn as u64) << 32) | seg as u64
}

pub(crate) fn dst_of(p: &[u8]) -> Ipv4Addr {
    Ipv4Addr::new(p[16], p[17], p[18], p[19])
}

/// `p` in an Ethernet frame from `brpeer` to `brpub`.
pub(crate) fn ether_frame(p: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + p.len());
    f.extend_from_slice(&PUB_MAC);
    f.extend_from_slice(&PEER_MAC);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    f.extend_from_slice(p);
    f
}
