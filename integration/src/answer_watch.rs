//! Watches everything a client namespace receives for the TCP RSTs and ICMP
//! or ICMPv6 "destination unreachable" messages the cluster sends it: the
//! answers a node that does not own a port must never give.
//!
//! Node-wide counters (`nstat`'s `TcpOutRsts`) cannot tell the public side
//! from the cluster network, where agents open and close their own gRPC
//! connections; a packet socket on the client sees exactly what reaches
//! the client, whoever sent it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::netns::{NetNsError, NetNsGuard};

/// Every protocol: IPv4 and IPv6 alike (ARP and the rest are skipped by
/// their first byte).
const ETH_P_ALL: u16 = 0x0003;

/// One unwanted answer seen by the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// A TCP segment with RST set, from `from:port` to the client's
    /// `to_port`, with its sequence number.
    TcpRst {
        from: IpAddr,
        port: u16,
        to_port: u16,
        seq: u32,
    },
    /// ICMP type 3 or ICMPv6 type 1 (destination unreachable) with its
    /// code.
    IcmpUnreachable { from: IpAddr, code: u8 },
}

/// What a watch saw.
#[derive(Debug, Default)]
pub struct Watched {
    /// Every IP packet received: proof the watch was looking.
    pub packets: u64,
    /// The RSTs and ICMP unreachables among them.
    pub answers: Vec<Answer>,
}

/// Counts RSTs and ICMP unreachables arriving in a namespace until stopped.
pub struct AnswerWatch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<Watched, NetNsError>>>,
}

impl AnswerWatch {
    /// Starts watching every IP packet received in the namespace at
    /// `netns` (all interfaces).
    pub fn start(netns: PathBuf) -> Result<Self, NetNsError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("answer-watch".into())
            .spawn(move || {
                let socket = {
                    let _in_ns = NetNsGuard::enter(&netns)?;
                    let s = packet_socket().map_err(NetNsError::Thread);
                    let _ = ready_tx.send(());
                    s?
                };
                let mut seen = Watched::default();
                let mut buf = vec![0u8; 65536];
                while !flag.load(Ordering::Relaxed) {
                    // SAFETY: `buf` is valid for writes of its length; the
                    // socket is open for the whole loop.
                    let n = unsafe {
                        libc::recv(socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0)
                    };
                    if n <= 0 {
                        // Timeout (SO_RCVTIMEO) or EINTR: check the flag.
                        continue;
                    }
                    seen.packets += 1;
                    if let Some(a) = classify(&buf[..n as usize]) {
                        seen.answers.push(a);
                    }
                }
                Ok(seen)
            })
            .map_err(NetNsError::Thread)?;
        // The socket must exist before the caller sends anything.
        let _ = ready_rx.recv_timeout(Duration::from_secs(5));
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops and returns what was seen.
    pub fn stop(mut self) -> Result<Watched, NetNsError> {
        self.finish()
    }

    fn finish(&mut self) -> Result<Watched, NetNsError> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take() {
            Some(t) => t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
            None => Ok(Watched::default()),
        }
    }
}

impl Drop for AnswerWatch {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// An `AF_PACKET` datagram socket (packets without their link header)
/// that also sees what the host sends, with a short receive timeout.
fn packet_socket() -> std::io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            i32::from(ETH_P_ALL.to_be()),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = libc::timeval {
        tv_sec: 0,
        tv_usec: 100_000,
    };
    // SAFETY: `timeout` is a valid timeval for the duration of the call.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(socket)
}

/// An RST or ICMP unreachable in an IPv4 or IPv6 packet, if it is one.
/// An IPv6 packet's transport header is taken right after its fixed
/// header (what the nodes' stacks send carries no extension header).
pub fn classify(ip: &[u8]) -> Option<Answer> {
    let (from, proto, l4): (IpAddr, u8, &[u8]) = match *ip.first()? >> 4 {
        4 if ip.len() >= 20 => {
            // Later fragments carry no header of their own.
            if u16::from_be_bytes([ip[6], ip[7]]) & 0x1fff != 0 {
                return None;
            }
            let ihl = usize::from(ip[0] & 0x0f) * 4;
            let from = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]).into();
            // ICMP's protocol number as ICMPv6's, to match one way below.
            let proto = if ip[9] == 1 { 58 } else { ip[9] };
            (from, proto, ip.get(ihl..)?)
        }
        6 if ip.len() >= 40 => {
            let from = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).ok()?).into();
            (from, ip[6], &ip[40..])
        }
        _ => return None,
    };
    // ICMP's "destination unreachable" is type 3, ICMPv6's type 1.
    let unreachable = if from.is_ipv4() { 3 } else { 1 };
    match proto {
        6 if l4.len() >= 14 && l4[13] & 0x04 != 0 => Some(Answer::TcpRst {
            from,
            port: u16::from_be_bytes([l4[0], l4[1]]),
            to_port: u16::from_be_bytes([l4[2], l4[3]]),
            seq: u32::from_be_bytes([l4[4], l4[5], l4[6], l4[7]]),
        }),
        58 if l4.len() >= 2 && l4[0] == unreachable => {
            Some(Answer::IcmpUnreachable { from, code: l4[1] })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(proto: u8, l4: &[u8]) -> Vec<u8> {
        let mut p = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, proto, 0, 0];
        p.extend_from_slice(&[198, 18, 0, 100, 198, 18, 1, 1]);
        p.extend_from_slice(l4);
        p
    }

    #[test]
    fn finds_rsts_and_unreachables_only() {
        let mut tcp = vec![0u8; 20];
        tcp[0..2].copy_from_slice(&7000u16.to_be_bytes());
        tcp[2..4].copy_from_slice(&40000u16.to_be_bytes());
        tcp[4..8].copy_from_slice(&7u32.to_be_bytes());
        tcp[13] = 0x14; // RST + ACK
        assert_eq!(
            classify(&ip(6, &tcp)),
            Some(Answer::TcpRst {
                from: Ipv4Addr::new(198, 18, 0, 100).into(),
                port: 7000,
                to_port: 40000,
                seq: 7
            })
        );
        tcp[13] = 0x12; // SYN + ACK
        assert_eq!(classify(&ip(6, &tcp)), None);
        assert_eq!(
            classify(&ip(1, &[3, 3, 0, 0])),
            Some(Answer::IcmpUnreachable {
                from: Ipv4Addr::new(198, 18, 0, 100).into(),
                code: 3
            })
        );
        // IPv6: an RST, ICMPv6's unreachable (type 1), and neither an
        // ICMPv6 type 3 (time exceeded) nor a neighbour solicitation.
        let ip6 = |next: u8, l4: &[u8]| {
            let mut p = vec![0x60, 0, 0, 0, 0, l4.len() as u8, next, 64];
            p.extend_from_slice(&"2001:2::100".parse::<Ipv6Addr>().unwrap().octets());
            p.extend_from_slice(&"2001:2::1:b".parse::<Ipv6Addr>().unwrap().octets());
            p.extend_from_slice(l4);
            p
        };
        let from6: IpAddr = "2001:2::100".parse().unwrap();
        tcp[13] = 0x04;
        assert_eq!(
            classify(&ip6(6, &tcp)),
            Some(Answer::TcpRst {
                from: from6,
                port: 7000,
                to_port: 40000,
                seq: 7
            })
        );
        assert_eq!(
            classify(&ip6(58, &[1, 4, 0, 0])),
            Some(Answer::IcmpUnreachable {
                from: from6,
                code: 4
            })
        );
        assert_eq!(classify(&ip6(58, &[3, 0, 0, 0])), None);
        assert_eq!(classify(&ip6(58, &[135, 0, 0, 0])), None);
        // ARP (no IP version in its first byte's high nibble).
        assert_eq!(classify(&[0, 1, 8, 0, 6, 4, 0, 1]), None);
        assert_eq!(classify(&ip(1, &[0, 0, 0, 0])), None);
        assert_eq!(classify(&ip(17, &[0; 8])), None);
        assert_eq!(classify(&[0x45, 0, 0]), None);
        assert_eq!(classify(&ip(6, &[0; 4])), None);
    }
}
