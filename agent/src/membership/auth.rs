//! Authenticated membership datagrams.
//!
//! With `[tls] membership_key`, every datagram a node sends (SWIM's and the
//! discovery beacon alike) ends with a timestamp and an HMAC-SHA256 over
//! the whole of it, keyed with the cluster's membership key; a datagram
//! whose MAC does not verify, or whose timestamp is too far from now, is
//! dropped before foca or the beacon decoder sees a byte of it, and
//! counted. Beacons alone would not do: an outsider could skip discovery
//! and send a SWIM announce straight to a node.
//!
//! Why a shared-key MAC rather than signatures with each node's key:
//! SWIM sends several small datagrams per probe period to every member,
//! and a receiver would need the sender's certificate (hundreds of bytes,
//! with foca's packet already near the MTU) before it could check a
//! signature: a node that does not yet know another could not verify its
//! first announce. A MAC costs a hash and 40 bytes, and needs nothing from
//! the sender. What it gives up: every member holds the key, so a member
//! could speak for another in membership. Members are trusted nodes
//! holding a node certificate anyway, and nothing that matters rests on
//! membership alone: a peer address learned from it is dialled with TLS
//! that checks the node's name against the CA, so a lie about an address
//! leads to a failed handshake, not to a migration sent to a stranger.
//!
//! Replays: the timestamp bounds them to [`MAX_SKEW`]. Within it, a
//! replayed datagram is one a member really sent; SWIM's incarnation
//! numbers make re-delivered probes, acks and updates harmless, and a
//! replayed "leave" is refuted by the node at its next probe.

use std::path::Path;
use std::time::Duration;

use ring::hmac;

/// How far a datagram's timestamp may be from the receiver's clock. The
/// cluster's clocks must agree that well (NTP does much better).
pub const MAX_SKEW: Duration = Duration::from_secs(30);

const TS_LEN: usize = 8;
const MAC_LEN: usize = 32;
/// What sealing adds to a datagram.
pub const OVERHEAD: usize = TS_LEN + MAC_LEN;
/// Binds the MAC to this use of the key.
const CONTEXT: &[u8] = b"ferry membership v1\0";

/// Why a datagram was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    #[error("no valid MAC (a node without the cluster's membership key, or a forgery)")]
    Unauthenticated,
    #[error("timestamp {skew_ms} ms away from this node's clock (a replay, or clocks apart)")]
    Stale { skew_ms: u64 },
}

/// Rejected datagrams since start, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RejectCounts {
    pub unauthenticated: u64,
    pub stale: u64,
}

impl RejectCounts {
    pub fn count(&mut self, r: Reject) {
        match r {
            Reject::Unauthenticated => self.unauthenticated += 1,
            Reject::Stale { .. } => self.stale += 1,
        }
    }
}

/// Seals and opens datagrams with the membership key.
pub struct Sealer {
    key: hmac::Key,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer")
    }
}

impl Sealer {
    pub fn new(key: &[u8]) -> Self {
        Sealer {
            key: hmac::Key::new(hmac::HMAC_SHA256, key),
        }
    }

    fn mac(&self, body: &[u8]) -> hmac::Tag {
        hmac::sign(&self.key, &[CONTEXT, body].concat())
    }

    /// Appends the timestamp `now_ms` and the MAC to `datagram`.
    pub fn seal(&self, datagram: &mut Vec<u8>, now_ms: u64) {
        datagram.extend_from_slice(&now_ms.to_be_bytes());
        let tag = self.mac(datagram);
        datagram.extend_from_slice(tag.as_ref());
    }

    /// The datagram without timestamp and MAC, if the MAC verifies and the
    /// timestamp is within [`MAX_SKEW`] of `now_ms`.
    pub fn open<'a>(&self, datagram: &'a [u8], now_ms: u64) -> Result<&'a [u8], Reject> {
        let Some(body_len) = datagram.len().checked_sub(MAC_LEN) else {
            return Err(Reject::Unauthenticated);
        };
        if body_len < TS_LEN {
            return Err(Reject::Unauthenticated);
        }
        let (body, tag) = datagram.split_at(body_len);
        // ring's verify compares in constant time.
        hmac::verify(&self.key, &[CONTEXT, body].concat(), tag)
            .map_err(|_| Reject::Unauthenticated)?;
        let (payload, ts) = body.split_at(body_len - TS_LEN);
        let ts = u64::from_be_bytes(ts.try_into().map_err(|_| Reject::Unauthenticated)?);
        let skew_ms = now_ms.abs_diff(ts);
        if skew_ms > MAX_SKEW.as_millis() as u64 {
            return Err(Reject::Stale { skew_ms });
        }
        Ok(payload)
    }
}

/// Reads a membership key file: hex (as `ferry cert ca` writes it), at
/// least 16 bytes, whitespace ignored.
pub fn read_key(path: &Path) -> Result<Vec<u8>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let hex: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    if !hex.len().is_multiple_of(2) || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err("not a hex key (the membership.key of `ferry cert ca`)".into());
    }
    let key: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap_or(0))
        .collect();
    if key.len() < 16 {
        return Err(format!("{} bytes: a key needs at least 16", key.len()));
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_datagrams_open_and_anything_else_is_rejected() {
        let s = Sealer::new(&[7; 32]);
        let mut d = vec![2, 1, 2, 3];
        s.seal(&mut d, 1_000_000);
        assert_eq!(d.len(), 4 + OVERHEAD);
        assert_eq!(s.open(&d, 1_000_000), Ok(&[2u8, 1, 2, 3][..]));
        assert_eq!(s.open(&d, 1_000_000 + 29_000), Ok(&[2u8, 1, 2, 3][..]));
        // Another key: an outsider's datagram.
        assert_eq!(
            Sealer::new(&[8; 32]).open(&d, 1_000_000),
            Err(Reject::Unauthenticated)
        );
        // Any flipped bit.
        for i in 0..d.len() {
            let mut bad = d.clone();
            bad[i] ^= 1;
            assert_eq!(s.open(&bad, 1_000_000), Err(Reject::Unauthenticated), "{i}");
        }
        // Unsealed or short.
        assert_eq!(s.open(&[2, 1, 2, 3], 0), Err(Reject::Unauthenticated));
        assert_eq!(s.open(&[], 0), Err(Reject::Unauthenticated));
        assert_eq!(s.open(&d[..MAC_LEN], 0), Err(Reject::Unauthenticated));
        // Replayed later than the window.
        assert_eq!(
            s.open(&d, 1_000_000 + 31_000),
            Err(Reject::Stale { skew_ms: 31_000 })
        );
        let mut counts = RejectCounts::default();
        counts.count(Reject::Unauthenticated);
        counts.count(Reject::Stale { skew_ms: 1 });
        assert_eq!((counts.unauthenticated, counts.stale), (1, 1));
    }

    #[test]
    fn key_files_are_hex() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("k");
        std::fs::write(&p, format!("{}\n", "ab".repeat(32))).unwrap();
        assert_eq!(read_key(&p).unwrap(), vec![0xab; 32]);
        std::fs::write(&p, "xyz").unwrap();
        assert!(read_key(&p).is_err());
        std::fs::write(&p, "abcd").unwrap();
        assert!(read_key(&p).unwrap_err().contains("at least 16"));
    }
}
