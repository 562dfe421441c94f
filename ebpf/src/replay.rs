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
//!   `lo` into `ip_rcv()`: no device to create, no reverse-path filter to
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

use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Why a packet could not be replayed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("opening the raw socket for replay: {0}")]
    Socket(std::io::Error),
    #[error("not an IPv4 packet ({len} bytes)")]
    NotIpv4 { len: usize },
    #[error("replaying a {len}-byte packet to {dst}: {source}")]
    Send {
        len: usize,
        dst: Ipv4Addr,
        source: std::io::Error,
    },
}

/// Re-injects IPv4 packets into the calling thread's network namespace.
#[derive(Debug)]
pub struct Replayer {
    fd: OwnedFd,
    buf: Vec<u8>,
}

impl Replayer {
    /// Opens the raw socket (needs CAP_NET_RAW) in the network namespace of
    /// the calling thread.
    pub fn new() -> Result<Self, ReplayError> {
        // SAFETY: socket(2) takes plain integers and returns a new
        // descriptor or -1.
        let fd = unsafe {
            libc::socket(
                libc::AF_INET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::IPPROTO_RAW,
            )
        };
        if fd < 0 {
            return Err(ReplayError::Socket(std::io::Error::last_os_error()));
        }
        // SAFETY: the kernel just returned this descriptor to us.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self {
            fd,
            buf: Vec::with_capacity(65536),
        })
    }

    /// Another replayer on the same raw socket, for a second thread.
    pub fn try_clone(&self) -> Result<Self, ReplayError> {
        Ok(Self {
            fd: self.fd.try_clone().map_err(ReplayError::Socket)?,
            buf: Vec::with_capacity(65536),
        })
    }

    /// Hands one IPv4 packet (header included) to the stack as received.
    pub fn replay(&mut self, packet: &[u8]) -> Result<(), ReplayError> {
        self.buf.clear();
        self.buf.extend_from_slice(packet);
        let dst = prepare(&mut self.buf)?;
        let addr = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(dst.octets()),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: buf and addr are valid for the lengths given for the
        // duration of the call; the kernel only reads them.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                self.buf.as_ptr().cast(),
                self.buf.len(),
                0,
                (&addr as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if n < 0 {
            return Err(ReplayError::Send {
                len: self.buf.len(),
                dst,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}

/// Checks the IPv4 header, trims the packet to its total length and
/// recomputes the transport checksum of an unfragmented TCP or UDP packet.
/// Returns the destination address.
pub fn prepare(p: &mut Vec<u8>) -> Result<Ipv4Addr, ReplayError> {
    let bad = |p: &Vec<u8>| ReplayError::NotIpv4 { len: p.len() };
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

/// The largest UDP payload one IPv4 packet carries (65,535 minus the IP
/// and UDP headers).
pub const MAX_UDP_PAYLOAD: usize = 65_535 - 20 - 8;

/// Builds the IPv4 packet of a UDP datagram from `src` to `dst`, checksums
/// included, as it would have arrived: for datagrams a socket received
/// before the capture began, which the replay hands to the stack again
/// from their sender, addresses and payload. `None` if `payload` does not
/// fit one IPv4 packet.
pub fn udp_datagram(src: SocketAddrV4, dst: SocketAddrV4, payload: &[u8]) -> Option<Vec<u8>> {
    if payload.len() > MAX_UDP_PAYLOAD {
        return None;
    }
    let udp_len = (8 + payload.len()) as u16;
    let total = 20 + udp_len;
    let mut p = Vec::with_capacity(usize::from(total));
    p.extend_from_slice(&[0x45, 0]);
    p.extend_from_slice(&total.to_be_bytes());
    // Identification 0, don't fragment, TTL 64, UDP, header checksum below.
    p.extend_from_slice(&[0, 0, 0x40, 0, 64, 17, 0, 0]);
    p.extend_from_slice(&src.ip().octets());
    p.extend_from_slice(&dst.ip().octets());
    let ip_csum = fold(add_words(0, &p[..20]));
    p[10..12].copy_from_slice(&ip_csum.to_be_bytes());
    p.extend_from_slice(&src.port().to_be_bytes());
    p.extend_from_slice(&dst.port().to_be_bytes());
    p.extend_from_slice(&udp_len.to_be_bytes());
    // Any non-zero value: `prepare` computes the real one.
    p.extend_from_slice(&[0xff, 0xff]);
    p.extend_from_slice(payload);
    prepare(&mut p).ok()?;
    Some(p)
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
        assert_eq!(dst, Ipv4Addr::new(198, 18, 0, 100));
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
        let src = SocketAddrV4::new(Ipv4Addr::new(198, 18, 1, 1), 5000);
        let dst = SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 100), 7003);
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

    #[test]
    fn rejects_what_is_not_ipv4() {
        for bad in [
            vec![],
            vec![0x60; 40],                    // IPv6
            vec![0x45, 0, 0, 200, 0, 0, 0, 0], // short
            udp_packet([0, 0])[..25].to_vec(), // total length beyond the data
        ] {
            let mut b = bad.clone();
            assert!(prepare(&mut b).is_err(), "{bad:?}");
        }
    }
}
