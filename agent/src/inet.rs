//! Internet addresses as the data path compares them: a dual-stack IPv6
//! socket's IPv4 peer (`::ffff:a.b.c.d`) is the IPv4 address its packets
//! carry, so every address read from a socket, an image, a request or a
//! kernel table is made canonical once, here.

use std::net::{IpAddr, SocketAddr};

use nix::sys::socket::SockaddrStorage;

/// `a` with an IPv4-mapped IPv6 address as the IPv4 one (and no flow
/// label or scope).
pub fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// A socket address of the IPv4 or IPv6 family, canonical; None for
/// another family.
pub fn of_sockaddr(s: &SockaddrStorage) -> Option<SocketAddr> {
    if let Some(v4) = s.as_sockaddr_in() {
        return Some(SocketAddr::from(*v4));
    }
    let v6 = s.as_sockaddr_in6()?;
    Some(SocketAddr::new(v6.ip().to_canonical(), v6.port()))
}

/// An address as /proc/net/{tcp,tcp6,udp,udp6} print it, `HEXADDR:HEXPORT`:
/// the network-order address as host-order 32-bit hex words (one for
/// IPv4, four for IPv6), each word's bytes in memory order the address's;
/// canonical.
pub fn of_proc_net(text: &str) -> Option<SocketAddr> {
    let (hex, port) = text.split_once(':')?;
    if hex.len() != 8 && hex.len() != 32 {
        return None;
    }
    let mut bytes = Vec::with_capacity(16);
    for word in hex.as_bytes().chunks(8) {
        let word = u32::from_str_radix(std::str::from_utf8(word).ok()?, 16).ok()?;
        bytes.extend_from_slice(&word.to_ne_bytes());
    }
    let ip = match bytes.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?).to_canonical(),
        _ => return None,
    };
    Some(SocketAddr::new(ip, u16::from_str_radix(port, 16).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_read_canonical() {
        let mapped: SocketAddr = "[::ffff:198.18.0.11]:40236".parse().unwrap();
        assert_eq!(canonical(mapped), "198.18.0.11:40236".parse().unwrap());
        let v6: SocketAddr = "[2001:2::11]:40236".parse().unwrap();
        assert_eq!(canonical(v6), v6);
        assert_eq!(
            of_sockaddr(&SockaddrStorage::from(mapped)),
            Some(canonical(mapped))
        );
        // 198.18.0.11 and port 40236 as a little-endian host prints them.
        assert_eq!(
            of_proc_net("0B0012C6:9D2C"),
            Some("198.18.0.11:40236".parse().unwrap())
        );
        assert_eq!(
            of_proc_net("0000000000000000FFFF00000B0012C6:9D2C"),
            Some("198.18.0.11:40236".parse().unwrap())
        );
        assert_eq!(
            of_proc_net("02000120000000000000000011000000:9D2C"),
            Some("[2001:2::11]:40236".parse().unwrap())
        );
        assert_eq!(of_proc_net("0B0012:9D2C"), None);
        assert_eq!(of_proc_net("0B0012C6"), None);
    }
}
