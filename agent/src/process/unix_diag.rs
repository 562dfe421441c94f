//! Which Unix socket is connected to which: the kernel's sock_diag dump of
//! AF_UNIX sockets with their peers (what `ss -x` shows), in ferryd's
//! network namespace. procfs lists Unix sockets but not their peers, and a
//! peer outside the process tree is what CRIU refuses to dump.

use std::collections::HashMap;
use std::io;

use super::sock_diag::{self, malformed, u16_at, u32_at};

/// include/uapi/linux/unix_diag.h
const UDIAG_SHOW_PEER: u32 = 0x0000_0004;
const UNIX_DIAG_PEER: u16 = 2;
/// struct unix_diag_msg: family, type, state, pad (u8 each), ino (u32),
/// cookie (2 × u32).
const UNIX_DIAG_MSG_LEN: usize = 16;

/// Every Unix socket of this network namespace that has a peer, as (inode,
/// peer's inode). Blocking (a netlink dump).
pub fn unix_peers() -> io::Result<HashMap<u64, u64>> {
    let mut peers = HashMap::new();
    sock_diag::dump(&dump_request(), |m| add_peer(m, &mut peers))?;
    Ok(peers)
}

/// A unix_diag_req asking for every socket, with peers.
fn dump_request() -> Vec<u8> {
    let mut req = Vec::with_capacity(24);
    req.push(libc::AF_UNIX as u8); // sdiag_family
    req.push(0); // sdiag_protocol
    req.extend_from_slice(&0u16.to_ne_bytes()); // pad
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // udiag_states: all
    req.extend_from_slice(&0u32.to_ne_bytes()); // udiag_ino
    req.extend_from_slice(&UDIAG_SHOW_PEER.to_ne_bytes());
    req.extend_from_slice(&[0xff; 8]); // udiag_cookie: none (INET_DIAG_NOCOOKIE)
    req
}

/// Reads one unix_diag_msg and its attributes into `peers`.
fn add_peer(body: &[u8], peers: &mut HashMap<u64, u64>) -> io::Result<()> {
    let ino = u32_at(body, 4).ok_or_else(|| malformed("short unix_diag_msg"))?;
    let mut attrs = body.get(UNIX_DIAG_MSG_LEN..).unwrap_or(&[]);
    while attrs.len() >= 4 {
        let alen = u16_at(attrs, 0).unwrap_or(0) as usize;
        let atype = u16_at(attrs, 2).unwrap_or(0);
        if alen < 4 || alen > attrs.len() {
            return Err(malformed("attribute length out of bounds"));
        }
        if atype == UNIX_DIAG_PEER
            && let Some(peer) = u32_at(attrs, 4)
            && peer != 0
        {
            peers.insert(u64::from(ino), u64::from(peer));
        }
        let step = (alen + 3) & !3;
        attrs = attrs.get(step..).unwrap_or(&[]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::net::UnixStream;

    fn inode(s: &UnixStream) -> u64 {
        std::fs::metadata(format!("/proc/self/fd/{}", s.as_raw_fd()))
            .unwrap()
            .ino()
    }

    #[test]
    fn a_socket_pair_names_each_other_as_peers() {
        let (a, b) = UnixStream::pair().unwrap();
        let peers = unix_peers().unwrap();
        assert_eq!(peers.get(&inode(&a)), Some(&inode(&b)));
        assert_eq!(peers.get(&inode(&b)), Some(&inode(&a)));
    }

    #[test]
    fn an_attribute_past_its_message_is_an_error_not_a_panic() {
        let mut peers = HashMap::new();
        let mut msg = vec![0u8; 20];
        msg[16..18].copy_from_slice(&40u16.to_ne_bytes());
        assert!(add_peer(&msg, &mut peers).is_err());
        assert!(add_peer(&msg[..3], &mut peers).is_err());
        assert!(peers.is_empty());
    }
}
