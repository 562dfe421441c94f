//! Replaying captured packets into this node's stack.
//!
//! # Why a raw IP socket
//!
//! The captured packets must reach the restored sockets as if they had just
//! arrived, in capture order, without passing the ownership filter again
//! (which still captures new packets while the old ones are replayed). The
//! candidates, measured with `cargo xtask bench replay` (2-core VM, 10,000
//! packets of 256 B into UDP and TCP sockets, median µs per packet, every
//! packet delivered in order unless said):
//!
//! | path | µs/packet |
//! |---|---|
//! | raw socket, this [`Replayer`] (with checksum fix-up) | 2.0 |
//! | raw socket, bare `sendto()` / `sendmmsg()` x64 | 1.7 / 1.6 |
//! | TUN device write | 1.0 |
//! | TUN device write, `rp_filter = 1` | none delivered |
//!
//! - a raw `IPPROTO_RAW` socket: `sendto()` of the IP packet to its own
//!   destination address, which is local, so the kernel loops it through
//!   `lo` into `ip_rcv()` (an IPv6 one, on a raw socket of its family, into
//!   `ipv6_rcv()`: `IPPROTO_RAW` implies the header included there too,
//!   since Linux 4.5): no device to create, no reverse-path filter to
//!   relax (a looped-back packet keeps its local route); each packet is in
//!   its socket when `sendto()` returns. It passes tc ingress of `lo`
//!   only, never the public interface's, so it is not captured again;
//! - a TUN device: half the cost, but one more device per node, with its
//!   route, and with the distribution's strict reverse-path filter
//!   (`rp_filter = 1`) every replayed packet is dropped as a martian (the
//!   client's address routes via the public interface), silently;
//! - `BPF_PROG_RUN` with `BPF_F_TEST_XDP_LIVE_FRAMES` on the public
//!   interface: the most faithful (the packet arrives on the public
//!   interface itself), but it passes tc ingress again, so the filter would
//!   need a mark to tell replayed frames from live ones, each frame needs
//!   an Ethernet header with the device's MAC, and aya 0.14 has no test-run
//!   call.
//!
//! The raw socket costs about 1 µs per packet more than TUN (~1 ms for the
//! ~1,200 packets a 1024-connection migration replays here, whose replay
//! takes ~8 ms in all after the resume with the cores busy: the receive
//! path, not the injection, is most of a replayed packet's cost), and works
//! whatever the node's `rp_filter`: the cost of robustness. A replayed packet
//! keeps its ingress interface for sockets (`IP_PKTINFO` reports the public
//! interface and `SO_BINDTODEVICE` sockets receive it); netfilter sees it
//! on `lo` (OUTPUT, POSTROUTING, PREROUTING, INPUT).
//!
//! Checksums: the copy was taken at tc ingress, before any checksum check,
//! and on veth (or with other checksum offloads) a packet's TCP or UDP
//! checksum field may hold only the pseudo-header sum
//! (`CHECKSUM_PARTIAL`), which the receiving stack trusts without looking.
//! Replayed through a raw socket the packet is `CHECKSUM_NONE` and gets
//! verified, so the transport checksum of every unfragmented packet is
//! recomputed before sending. (Fragments come from a sender that computed
//! the full checksum before fragmenting; they are left alone.)

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Why a packet could not be replayed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("opening the raw socket for replay: {0}")]
    Socket(std::io::Error),
    #[error("not an IPv4 or IPv6 packet ({len} bytes)")]
    NotIp { len: usize },
    #[error("replaying a {len}-byte packet to {dst}: {source}")]
    Send {
        len: usize,
        dst: IpAddr,
        source: std::io::Error,
    },
}

/// Re-injects IPv4 and IPv6 packets into the calling thread's network
/// namespace.
#[derive(Debug)]
pub struct Replayer {
    fd4: OwnedFd,
    /// None where the kernel has no IPv6 (`EAFNOSUPPORT`): such a node
    /// never captures an IPv6 packet.
    fd6: Option<OwnedFd>,
    buf: Vec<u8>,
}

/// A raw `IPPROTO_RAW` socket of `family`.
fn raw_socket(family: libc::c_int) -> std::io::Result<OwnedFd> {
    // SAFETY: socket(2) takes plain integers and returns a new descriptor
    // or -1.
    let fd = unsafe {
        libc::socket(
            family,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::IPPROTO_RAW,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Replayer {
    /// Opens the raw sockets (needs CAP_NET_RAW) in the network namespace
    /// of the calling thread.
    pub fn new() -> Result<Self, ReplayError> {
        let fd4 = raw_socket(libc::AF_INET).map_err(ReplayError::Socket)?;
        let fd6 = match raw_socket(libc::AF_INET6) {
            Ok(fd) => Some(fd),
            Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => None,
            Err(e) => return Err(ReplayError::Socket(e)),
        };
        Ok(Self {
            fd4,
            fd6,
            buf: Vec::with_capacity(65576),
        })
    }

    /// Another replayer on the same raw sockets, for a second thread.
    pub fn try_clone(&self) -> Result<Self, ReplayError> {
        Ok(Self {
            fd4: self.fd4.try_clone().map_err(ReplayError::Socket)?,
            fd6: match &self.fd6 {
                Some(fd) => Some(fd.try_clone().map_err(ReplayError::Socket)?),
                None => None,
            },
            buf: Vec::with_capacity(65576),
        })
    }

    /// Hands one IP packet (header included), IPv4 or IPv6, to the stack
    /// as received.
    pub fn replay(&mut self, packet: &[u8]) -> Result<(), ReplayError> {
        self.buf.clear();
        self.buf.extend_from_slice(packet);
        let dst = prepare(&mut self.buf)?;
        let sent = match dst {
            IpAddr::V4(ip) => {
                let addr = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: 0,
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(ip.octets()),
                    },
                    sin_zero: [0; 8],
                };
                send_to(&self.fd4, &self.buf, &addr)
            }
            IpAddr::V6(ip) => {
                // sin6_port 0: the raw socket's own protocol (IPPROTO_RAW,
                // the header included).
                let addr = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: 0,
                    sin6_flowinfo: 0,
                    sin6_addr: libc::in6_addr {
                        s6_addr: ip.octets(),
                    },
                    sin6_scope_id: 0,
                };
                match &self.fd6 {
                    Some(fd) => send_to(fd, &self.buf, &addr),
                    None => Err(std::io::Error::from_raw_os_error(libc::EAFNOSUPPORT)),
                }
            }
        };
        sent.map_err(|source| ReplayError::Send {
            len: self.buf.len(),
            dst,
            source,
        })
    }
}

/// sendto(2) of `buf` to `addr` (a `sockaddr_in` or `sockaddr_in6`).
fn send_to<A>(fd: &OwnedFd, buf: &[u8], addr: &A) -> std::io::Result<()> {
    // SAFETY: buf and addr are valid for the lengths given for the
    // duration of the call; the kernel only reads them, and A is one of the
    // socket address structs whose size tells the kernel its family's
    // layout.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            buf.as_ptr().cast(),
            buf.len(),
            0,
            (addr as *const A).cast(),
            std::mem::size_of::<A>() as libc::socklen_t,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Checks the IP header, trims the packet to its length and recomputes the
/// transport checksum of an unfragmented TCP or UDP packet, IPv4 or IPv6.
/// Returns the destination address.
pub fn prepare(p: &mut Vec<u8>) -> Result<IpAddr, ReplayError> {
    match p.first().map(|b| b >> 4) {
        Some(4) => prepare4(p).map(IpAddr::V4),
        Some(6) => prepare6(p).map(IpAddr::V6),
        _ => Err(ReplayError::NotIp { len: p.len() }),
    }
}

/// [`prepare`] of an IPv4 packet.
fn prepare4(p: &mut Vec<u8>) -> Result<Ipv4Addr, ReplayError> {
    let bad = |p: &Vec<u8>| ReplayError::NotIp { len: p.len() };
    if p.len() < 20 || p[0] >> 4 != 4 {
        return Err(bad(p));
    }
    let ihl = usize::from(p[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([p[2], p[3]]));
    if ihl < 20 || total < ihl || total > p.len() {
        return Err(bad(p));
    }
    p.truncate(total);
    let dst = Ipv4Addr::new(p[16], p[17], p[18], p[19]);
    let frag = u16::from_be_bytes([p[6], p[7]]);
    if frag & 0x3fff != 0 {
        // A fragment (more to come, or a later piece): see the module docs.
        return Ok(dst);
    }
    let proto = p[9];
    let l4_len = total - ihl;
    let csum_at = match proto {
        6 if l4_len >= 20 => ihl + 16,
        17 if l4_len >= 8 => {
            // Zero means "no checksum" in UDP over IPv4: keep it so.
            if p[ihl + 6] == 0 && p[ihl + 7] == 0 {
                return Ok(dst);
            }
            ihl + 6
        }
        _ => return Ok(dst),
    };
    p[csum_at] = 0;
    p[csum_at + 1] = 0;
    let mut sum: u32 = 0;
    sum = add_words(sum, &p[12..20]); // source and destination address
    sum += u32::from(proto);
    sum += l4_len as u32;
    sum = add_words(sum, &p[ihl..total]);
    let mut c = fold(sum);
    if c == 0 && proto == 17 {
        c = 0xffff;
    }
    p[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
    Ok(dst)
}

/// IPv6 extension headers a packet's transport header may follow
/// (hop-by-hop, routing, destination options); a fragment header (44) makes
/// it a fragment, left alone.
const IPV6_EXTENSIONS: [u8; 3] = [0, 43, 60];

/// [`prepare`] of an IPv6 packet: trimmed to its payload length, and the
/// transport checksum, which IPv6 makes mandatory for UDP too, recomputed
/// over its pseudo-header (RFC 8200 8.1).
fn prepare6(p: &mut Vec<u8>) -> Result<Ipv6Addr, ReplayError> {
    let bad = |p: &Vec<u8>| ReplayError::NotIp { len: p.len() };
    if p.len() < 40 || p[0] >> 4 != 6 {
        return Err(bad(p));
    }
    let total = 40 + usize::from(u16::from_be_bytes([p[4], p[5]]));
    if total > p.len() {
        return Err(bad(p));
    }
    p.truncate(total);
    let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&p[24..40]).expect("16 bytes"));
    let (mut next, mut at) = (p[6], 40);
    while IPV6_EXTENSIONS.contains(&next) {
        let Some(&[n, len]) = p.get(at..at + 2) else {
            return Ok(dst);
        };
        next = n;
        at += (usize::from(len) + 1) * 8;
    }
    let l4_len = total.saturating_sub(at);
    let csum_at = match next {
        6 if l4_len >= 20 => at + 16,
        17 if l4_len >= 8 => at + 6,
        // A fragment, ICMPv6, or a header cut short: as it came.
        _ => return Ok(dst),
    };
    p[csum_at] = 0;
    p[csum_at + 1] = 0;
    let mut sum: u32 = 0;
    sum = add_words(sum, &p[8..40]); // source and destination address
    sum += l4_len as u32; // upper-layer length: under 2^16 here
    sum += u32::from(next);
    sum = add_words(sum, &p[at..total]);
    let mut c = fold(sum);
    if c == 0 && next == 17 {
        c = 0xffff;
    }
    p[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
    Ok(dst)
}

/// The largest UDP payload one IPv4 packet carries (65,535 minus the IP
/// and UDP headers); one IPv6 packet carries 20 bytes more (its payload
/// length leaves the fixed header out), which this bound keeps to for
/// both.
pub const MAX_UDP_PAYLOAD: usize = 65_535 - 20 - 8;

/// Builds the IP packet of a UDP datagram from `src` to `dst`, checksums
/// included, as it would have arrived: for datagrams a socket received
/// before the capture began, which the replay hands to the stack again
/// from their sender, addresses and payload. An IPv4 packet when both ends
/// are IPv4 (an IPv4-mapped IPv6 address counts as its IPv4 one: a
/// dual-stack socket's IPv4 peer), else an IPv6 one. `None` if `payload`
/// does not fit one packet or one end is IPv4 and the other IPv6.
pub fn udp_datagram(src: SocketAddr, dst: SocketAddr, payload: &[u8]) -> Option<Vec<u8>> {
    if payload.len() > MAX_UDP_PAYLOAD {
        return None;
    }
    match (src.ip().to_canonical(), dst.ip().to_canonical()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            Some(udp_datagram4((s, src.port()), (d, dst.port()), payload))
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            Some(udp_datagram6((s, src.port()), (d, dst.port()), payload))
        }
        _ => None,
    }
}

fn udp_datagram6(src: (Ipv6Addr, u16), dst: (Ipv6Addr, u16), payload: &[u8]) -> Vec<u8> {
    let udp_len = (8 + payload.len()) as u16;
    let mut p = Vec::with_capacity(40 + usize::from(udp_len));
    // Version 6, traffic class and flow label 0.
    p.extend_from_slice(&[0x60, 0, 0, 0]);
    p.extend_from_slice(&udp_len.to_be_bytes());
    p.extend_from_slice(&[17, 64]); // next header UDP, hop limit 64
    p.extend_from_slice(&src.0.octets());
    p.extend_from_slice(&dst.0.octets());
    p.extend_from_slice(&src.1.to_be_bytes());
    p.extend_from_slice(&dst.1.to_be_bytes());
    p.extend_from_slice(&udp_len.to_be_bytes());
    p.extend_from_slice(&[0, 0]); // `prepare` computes the checksum
    p.extend_from_slice(payload);
    prepare6(&mut p).expect("a well-formed IPv6 packet");
    p
}

fn udp_datagram4(src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), payload: &[u8]) -> Vec<u8> {
    let udp_len = (8 + payload.len()) as u16;
    let total = 20 + udp_len;
    let mut p = Vec::with_capacity(usize::from(total));
    p.extend_from_slice(&[0x45, 0]);
    p.extend_from_slice(&total.to_be_bytes());
    // Identification 0, don't fragment, TTL 64, UDP, header checksum below.
    p.extend_from_slice(&[0, 0, 0x40, 0, 64, 17, 0, 0]);
    p.extend_from_slice(&src.0.octets());
    p.extend_from_slice(&dst.0.octets());
    let ip_csum = fold(add_words(0, &p[..20]));
    p[10..12].copy_from_slice(&ip_csum.to_be_bytes());
    p.extend_from_slice(&src.1.to_be_bytes());
    p.extend_from_slice(&dst.1.to_be_bytes());
    p.extend_from_slice(&udp_len.to_be_bytes());
    // Any non-zero value: `prepare` computes the real one.
    p.extend_from_slice(&[0xff, 0xff]);
    p.extend_from_slice(payload);
    prepare4(&mut p).expect("a well-formed IPv4 packet");
    p
}

/// Adds big-endian 16-bit words (an odd last byte padded with zero).
fn add_words(mut sum: u32, bytes: &[u8]) -> u32 {
    let mut chunks = bytes.chunks_exact(2);
    for w in &mut chunks {
        sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
        // Fold early so a 64 KiB packet cannot overflow the u32.
        if sum > 0xffff_0000 {
            sum = (sum & 0xffff) + (sum >> 16);
        }
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    sum
}

/// Folds the carries and complements: the Internet checksum.
fn fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A UDP packet 198.18.1.1:5000 -> 198.18.0.100:7003 with payload "hi",
    /// its checksum computed by hand (RFC 768 over the pseudo-header).
    fn udp_packet(csum: [u8; 2]) -> Vec<u8> {
        let mut p = vec![
            0x45, 0, 0, 30, 0, 1, 0x40, 0, 64, 17, 0, 0, // ver/ihl .. protocol, hdr csum
            198, 18, 1, 1, 198, 18, 0, 100, // addresses
            0x13, 0x88, 0x1b, 0x5b, 0, 10, // ports, length
        ];
        p.extend_from_slice(&csum);
        p.extend_from_slice(b"hi");
        p
    }

    fn expected_udp_csum() -> u16 {
        // Pseudo-header: addresses, protocol 17, UDP length 10; header
        // with checksum 0; payload "hi".
        let words: [u32; 12] = [
            0xc612, 0x0101, 0xc612, 0x0064, 17, 10, 0x1388, 0x1b5b, 10, 0, 0x6869, 0,
        ];
        fold(words.iter().sum())
    }

    #[test]
    fn recomputes_a_partial_udp_checksum() {
        let mut p = udp_packet([0x12, 0x34]);
        p.extend_from_slice(b"trailing ethernet padding");
        let dst = prepare(&mut p).unwrap();
        assert_eq!(dst, IpAddr::V4(Ipv4Addr::new(198, 18, 0, 100)));
        assert_eq!(p.len(), 30, "trimmed to the IP total length");
        assert_eq!(u16::from_be_bytes([p[26], p[27]]), expected_udp_csum());
        // A correct checksum sums to all ones over pseudo-header + segment.
        let mut sum = add_words(0, &p[12..20]) + 17 + 10;
        sum = add_words(sum, &p[20..]);
        assert_eq!(fold(sum), 0);
    }

    #[test]
    fn keeps_udp_without_checksum_and_fragments_untouched() {
        let mut p = udp_packet([0, 0]);
        prepare(&mut p).unwrap();
        assert_eq!(&p[26..28], &[0, 0]);
        let mut f = udp_packet([0xab, 0xcd]);
        f[6] = 0x20; // more fragments
        prepare(&mut f).unwrap();
        assert_eq!(&f[26..28], &[0xab, 0xcd]);
    }

    #[test]
    fn recomputes_tcp_checksums_with_odd_lengths() {
        let mut p = vec![0x45, 0, 0, 43, 0, 1, 0x40, 0, 64, 6, 0, 0];
        p.extend_from_slice(&[198, 18, 1, 1, 198, 18, 0, 100]);
        let mut tcp = vec![0u8; 20];
        tcp[12] = 5 << 4;
        p.extend_from_slice(&tcp);
        p.extend_from_slice(b"odd"); // 23-byte segment
        prepare(&mut p).unwrap();
        let mut sum = add_words(0, &p[12..20]) + 6 + 23;
        sum = add_words(sum, &p[20..]);
        assert_eq!(fold(sum), 0);
    }

    #[test]
    fn builds_a_datagram_as_it_arrives() {
        let src: SocketAddr = "198.18.1.1:5000".parse().unwrap();
        let dst: SocketAddr = "198.18.0.100:7003".parse().unwrap();
        let p = udp_datagram(src, dst, b"hi").unwrap();
        let mut want = udp_packet([0, 0]);
        want[4..6].copy_from_slice(&[0, 0]); // identification
        want[26..28].copy_from_slice(&expected_udp_csum().to_be_bytes());
        let ip_csum = fold(add_words(0, &want[..20]));
        want[10..12].copy_from_slice(&ip_csum.to_be_bytes());
        assert_eq!(p, want);
        // A valid IP header sums to all ones.
        assert_eq!(fold(add_words(0, &p[..20])), 0);
        // An odd, empty and largest payload.
        for len in [0, 1, 999, MAX_UDP_PAYLOAD] {
            let p = udp_datagram(src, dst, &vec![7u8; len]).unwrap();
            assert_eq!(p.len(), 28 + len);
            let mut sum = add_words(0, &p[12..20]) + 17 + (8 + len) as u32;
            sum = add_words(sum, &p[20..]);
            assert_eq!(fold(sum), 0, "{len}-byte payload");
        }
        assert_eq!(
            udp_datagram(src, dst, &vec![0u8; MAX_UDP_PAYLOAD + 1]),
            None
        );
    }

    /// Sums an IPv6 packet's transport header and payload with its
    /// pseudo-header: a correct checksum makes it all ones.
    fn v6_sum_is_valid(p: &[u8], at: usize, proto: u8) -> bool {
        let len = (p.len() - at) as u32;
        let sum = add_words(0, &p[8..40]) + len + u32::from(proto);
        fold(add_words(sum, &p[at..])) == 0
    }

    #[test]
    fn builds_an_ipv6_datagram_as_it_arrives() {
        let src: SocketAddr = "[2001:2::1:1]:5000".parse().unwrap();
        let dst: SocketAddr = "[2001:2::100]:7003".parse().unwrap();
        for len in [0, 1, 2, 999, MAX_UDP_PAYLOAD] {
            let p = udp_datagram(src, dst, &vec![7u8; len]).unwrap();
            assert_eq!(p.len(), 48 + len);
            assert_eq!(p[0] >> 4, 6);
            assert_eq!(usize::from(u16::from_be_bytes([p[4], p[5]])), 8 + len);
            assert_eq!(p[6], 17);
            assert_eq!(
                &p[8..24],
                &src.ip().to_string().parse::<Ipv6Addr>().unwrap().octets()
            );
            assert_eq!(&p[40..44], &[0x13, 0x88, 0x1b, 0x5b]);
            assert_ne!(&p[46..48], &[0, 0], "IPv6 has no UDP without a checksum");
            assert!(v6_sum_is_valid(&p, 40, 17), "{len}-byte payload");
        }
        // Mixed families are no datagram; an IPv4-mapped end is IPv4.
        let v4: SocketAddr = "198.18.0.100:7003".parse().unwrap();
        assert_eq!(udp_datagram(src, v4, b"x"), None);
        let mapped: SocketAddr = "[::ffff:198.18.1.1]:5000".parse().unwrap();
        assert_eq!(udp_datagram(mapped, v4, b"hi").unwrap()[0], 0x45);
    }

    #[test]
    fn recomputes_ipv6_checksums_past_extension_headers_and_leaves_fragments() {
        let mut base = vec![0x60, 0, 0, 0, 0, 0, 0, 64];
        base.extend_from_slice(&"2001:2::1:1".parse::<Ipv6Addr>().unwrap().octets());
        base.extend_from_slice(&"2001:2::100".parse::<Ipv6Addr>().unwrap().octets());
        // A TCP segment of 23 bytes behind a hop-by-hop and a destination
        // options header (8 and 16 bytes), its checksum a partial one.
        let mut p = base.clone();
        p[6] = 0;
        p.extend_from_slice(&[60, 0, 1, 4, 0, 0, 0, 0]); // hop-by-hop -> dest opts
        p.extend_from_slice(&[6, 1, 1, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]); // -> TCP
        let mut tcp = vec![0u8; 20];
        tcp[12] = 5 << 4;
        tcp[16] = 0x12;
        p.extend_from_slice(&tcp);
        p.extend_from_slice(b"odd");
        let payload_len = (p.len() - 40) as u16;
        p[4..6].copy_from_slice(&payload_len.to_be_bytes());
        p.extend_from_slice(b"ethernet padding");
        let dst = prepare(&mut p).unwrap();
        assert_eq!(dst, "2001:2::100".parse::<IpAddr>().unwrap());
        assert_eq!(
            p.len(),
            40 + usize::from(payload_len),
            "trimmed to the payload length"
        );
        assert!(v6_sum_is_valid(&p, 64, 6));
        // A fragment (header 44) stays as it came.
        let mut f = base.clone();
        f[6] = 44;
        f.extend_from_slice(&[17, 0, 0, 1, 0, 0, 0, 9]);
        f.extend_from_slice(&[0x13, 0x88, 0x1b, 0x5b, 0, 10, 0xab, 0xcd, b'h', b'i']);
        let f_len = (f.len() - 40) as u16;
        f[4..6].copy_from_slice(&f_len.to_be_bytes());
        let before = f.clone();
        prepare(&mut f).unwrap();
        assert_eq!(f, before);
    }

    #[test]
    fn rejects_what_is_not_ip() {
        let mut v6_long = vec![0x60, 0, 0, 100, 0, 17, 0, 64];
        v6_long.extend_from_slice(&[0; 32]);
        for bad in [
            vec![],
            vec![0x50; 40],                    // version 5
            vec![0x60; 39],                    // IPv6, short
            v6_long,                           // payload length beyond the data
            vec![0x45, 0, 0, 200, 0, 0, 0, 0], // short
            udp_packet([0, 0])[..25].to_vec(), // total length beyond the data
        ] {
            let mut b = bad.clone();
            assert!(prepare(&mut b).is_err(), "{bad:?}");
        }
    }
}
