//! The byte stream a sequence-checking connection sends: message `seq` of
//! connection `conn` is a 16-byte header (magic, conn, seq) and padding
//! derived from (conn, seq). Since every byte depends on its message's
//! position, any loss, duplication, reordering or corruption of the echo
//! shows up as a mismatch at an exact stream offset.

/// "FYSQ".
pub const MAGIC: [u8; 4] = *b"FYSQ";
/// magic (4) + connection id (4) + sequence number (8), big-endian.
pub const HEADER_LEN: usize = 16;

/// Writes message `seq` of connection `conn` into `buf` (its whole length).
pub fn fill(buf: &mut [u8], conn: u32, seq: u64) {
    assert!(buf.len() >= HEADER_LEN, "message shorter than its header");
    buf[..4].copy_from_slice(&MAGIC);
    buf[4..8].copy_from_slice(&conn.to_be_bytes());
    buf[8..16].copy_from_slice(&seq.to_be_bytes());
    // An LCG seeded by (conn, seq), one 8-byte word per step: cheap enough
    // for debug builds at tens of MB/s, and different for every message.
    let mut x = (u64::from(conn) << 40) ^ seq ^ 0x9e37_79b9_7f4a_7c15;
    for chunk in buf[HEADER_LEN..].chunks_mut(8) {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

/// Where the echoed stream first differed from what was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mismatch {
    /// Offset in the connection's byte stream.
    pub offset: u64,
    pub expected: u8,
    pub actual: u8,
    /// Where in the sent stream the bytes received from `offset` on come
    /// from, when they are found near it (within [`LOCATE_MESSAGES`]
    /// messages): a copy shifted back (duplicated bytes) or forward
    /// (skipped bytes). `None`: nothing nearby matches (garbage, another
    /// connection's bytes, or too few bytes left in the read to tell).
    pub source: Option<u64>,
    /// How many received bytes, from `offset` on, match the stream at
    /// `source` (up to the end of the read that held the mismatch).
    pub source_run: u64,
}

/// How many messages either side of a mismatch [`Verifier::check`]
/// searches for where the received bytes come from.
pub const LOCATE_MESSAGES: u64 = 512;

/// The shortest run of received bytes that names a stream position: 16
/// bytes of padding (two LCG words) or a header.
const LOCATE_MIN: usize = 16;

/// Finds the stream offset of `data` (its first [`LOCATE_MIN`]..64 bytes)
/// in connection `conn`'s stream of `message_len`-byte messages, searching
/// the messages within `radius` of message `near`, nearest first.
pub fn locate(conn: u32, message_len: usize, near: u64, radius: u64, data: &[u8]) -> Option<u64> {
    if data.len() < LOCATE_MIN {
        return None;
    }
    let probe = &data[..data.len().min(64)];
    let mut window = vec![0u8; 2 * message_len];
    let mut try_seq = |seq: u64| -> Option<u64> {
        let (a, b) = window.split_at_mut(message_len);
        fill(a, conn, seq);
        fill(b, conn, seq + 1);
        // Starting positions within message `seq` only: the next one is
        // searched on its own turn.
        (0..message_len)
            .find(|&i| window[i..].starts_with(probe))
            .map(|i| seq * message_len as u64 + i as u64)
    };
    for d in 0..=radius {
        if let Some(at) = try_seq(near + d) {
            return Some(at);
        }
        if d > 0
            && let Some(s) = near.checked_sub(d)
            && let Some(at) = try_seq(s)
        {
            return Some(at);
        }
    }
    None
}

/// How many bytes of `data` equal connection `conn`'s stream from `at` on.
fn run_from(conn: u32, message_len: usize, at: u64, data: &[u8]) -> u64 {
    let mut msg = vec![0u8; message_len];
    let mut seq = at / message_len as u64;
    let mut pos = (at % message_len as u64) as usize;
    fill(&mut msg, conn, seq);
    let mut n = 0u64;
    for &b in data {
        if msg[pos] != b {
            break;
        }
        n += 1;
        pos += 1;
        if pos == message_len {
            seq += 1;
            pos = 0;
            fill(&mut msg, conn, seq);
        }
    }
    n
}

/// Checks an incoming stream against the stream connection `conn` sends.
#[derive(Debug)]
pub struct Verifier {
    conn: u32,
    seq: u64,
    pos: usize,
    expected: Vec<u8>,
    verified: u64,
}

impl Verifier {
    pub fn new(conn: u32, message_len: usize) -> Self {
        let mut expected = vec![0; message_len];
        fill(&mut expected, conn, 0);
        Self {
            conn,
            seq: 0,
            pos: 0,
            expected,
            verified: 0,
        }
    }

    /// Bytes verified so far.
    pub fn verified(&self) -> u64 {
        self.verified
    }

    /// Whole messages verified so far.
    pub fn verified_messages(&self) -> u64 {
        self.seq
    }

    /// Checks the next bytes of the stream; after a mismatch the verifier
    /// stays at the mismatching offset.
    pub fn check(&mut self, mut data: &[u8]) -> Result<(), Mismatch> {
        while !data.is_empty() {
            let take = (self.expected.len() - self.pos).min(data.len());
            let want = &self.expected[self.pos..self.pos + take];
            if want != &data[..take] {
                let i = want
                    .iter()
                    .zip(data)
                    .position(|(a, b)| a != b)
                    .expect("slices differ");
                let rest = &data[i..];
                let len = self.expected.len();
                let source = locate(self.conn, len, self.seq, LOCATE_MESSAGES, rest);
                return Err(Mismatch {
                    offset: self.verified + i as u64,
                    expected: want[i],
                    actual: data[i],
                    source,
                    source_run: source.map_or(0, |at| run_from(self.conn, len, at, rest)),
                });
            }
            self.verified += take as u64;
            self.pos += take;
            data = &data[take..];
            if self.pos == self.expected.len() {
                self.seq += 1;
                self.pos = 0;
                fill(&mut self.expected, self.conn, self.seq);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(conn: u32, len: usize, messages: u64) -> Vec<u8> {
        let mut out = Vec::new();
        let mut buf = vec![0; len];
        for seq in 0..messages {
            fill(&mut buf, conn, seq);
            out.extend_from_slice(&buf);
        }
        out
    }

    #[test]
    fn accepts_the_stream_in_any_split() {
        let s = stream(3, 37, 20);
        for split in [1, 5, 37, 100, s.len()] {
            let mut v = Verifier::new(3, 37);
            for chunk in s.chunks(split) {
                v.check(chunk).unwrap();
            }
            assert_eq!(v.verified(), s.len() as u64);
            assert_eq!(v.verified_messages(), 20);
        }
    }

    #[test]
    fn reports_the_offset_of_corruption_loss_and_reordering() {
        let s = stream(1, 64, 10);
        let mut bad = s.clone();
        bad[200] ^= 1;
        let e = Verifier::new(1, 64).check(&bad).unwrap_err();
        assert_eq!(e.offset, 200);

        // A lost message: the next one's header differs at its seq bytes.
        let mut lost = s[..128].to_vec();
        lost.extend_from_slice(&s[192..]);
        let e = Verifier::new(1, 64).check(&lost).unwrap_err();
        assert_eq!(e.offset, 128 + 15);

        // Where the wrong bytes come from: the lost message's successor.
        assert_eq!(e.source, Some(192 + 15));
        assert_eq!(e.source_run, (s.len() - 192 - 15) as u64);
        // Bytes sent twice: the stream goes back.
        let mut doubled = s[..300].to_vec();
        doubled.extend_from_slice(&s[250..]);
        let e = Verifier::new(1, 64).check(&doubled).unwrap_err();
        assert_eq!(e.offset, 300);
        assert_eq!(e.source, Some(250));
        // Garbage is found nowhere.
        let mut garbage = s[..100].to_vec();
        garbage.extend_from_slice(&[0x5a; 40]);
        let e = Verifier::new(1, 64).check(&garbage).unwrap_err();
        assert_eq!((e.offset, e.source), (100, None));

        // Another connection's stream never passes.
        assert!(Verifier::new(2, 64).check(&s).is_err());
    }
}
