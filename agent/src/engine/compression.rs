//! LZ4 for the pages that cross a slow link.
//!
//! Pre-copy's rounds and the freeze's pages images cross the cluster link
//! at its rate. A server that writes its memory as fast as the link
//! carries it never gets a smaller dirty set: Redis serving 1,000 clients
//! from a 1 GiB data set at 1 Gb/s wrote ~4,000 pages in each ~150 ms
//! round until the rounds stopped shrinking, and its freeze carried them
//! all over the link (180-200 ms of a ~280 ms freeze). Pages often
//! compress (zeros, pointers, text), and a compressed page crosses in
//! less time. LZ4 because the source compresses while the process runs
//! and inside the freeze, where a slow codec would cost more than it
//! saves; decompressing is several times faster still.
//!
//! When (`[migration] compression`, where the destination takes it):
//! "lz4", or "off" (the default). Compression pays where the link is
//! slower than the compressor and the pages compress; it costs the source
//! CPU while the process runs and in the freeze, and on this machine's
//! unshaped links (a TLS stream carries ~650 MB/s, LZ4 compresses ~250
//! MB/s of a busy node's pages) it would slow the pages down: the
//! operator who knows the link chooses. (A choice by measurement was tried:
//! the reader's per-batch timing cannot see the link behind the stream's,
//! the connection's and a shaped link's buffers, tens of megabytes at 1
//! Gb/s.) A run that does not shrink by an eighth goes as it is, and pages
//! that do not compress are tried only now and then.

use crate::config::Compression;

/// The most a compressed run or piece may stand for: the senders' largest
/// batch of pages (1 MiB image chunks, pre-copy runs of up to 1 MiB)
/// with room to spare; a larger claim is refused before anything is
/// allocated for it.
pub const MAX_DECOMPRESSED: u64 = 4 << 20;

/// `raw` compressed, when that saves at least an eighth of it.
pub fn pack(raw: &[u8]) -> Option<Vec<u8>> {
    if raw.len() < 512 {
        return None;
    }
    let packed = lz4_flex::block::compress(raw);
    (packed.len() <= raw.len() - raw.len() / 8).then_some(packed)
}

/// What `packed` stands for, `length` bytes; a wrong claim or a damaged
/// block is an error saying which.
pub fn unpack(packed: &[u8], length: u64) -> Result<Vec<u8>, String> {
    if length == 0 || length > MAX_DECOMPRESSED {
        return Err(format!(
            "lz4_length {length} is outside 1..={MAX_DECOMPRESSED}"
        ));
    }
    let mut out = vec![0u8; length as usize];
    let n = lz4_flex::block::decompress_into(packed, &mut out)
        .map_err(|e| format!("the LZ4 block does not decompress: {e}"))?;
    if n as u64 != length {
        return Err(format!(
            "the LZ4 block holds {n} bytes, not lz4_length {length}"
        ));
    }
    Ok(out)
}

/// Compresses the pages of one migration: the choice, whether the
/// destination takes compressed pages, and whether the last tries
/// compressed.
#[derive(Debug, Clone)]
pub struct Compressor {
    choice: Compression,
    /// The destination takes compressed pages.
    allowed: bool,
    /// Of the last tries, the share that compressed (smoothed): pages that
    /// do not compress are tried only now and then.
    compressing: f64,
    /// Batches since the last try while they do not compress.
    skipped: u32,
}

/// Weight of the newest try in the smoothed share.
const NEWEST: f64 = 0.25;
/// Below this share of tries that compressed, pages are tried once in
/// [`RETRY_EVERY`] batches: incompressible memory (a process's random
/// data, already compressed files) costs a try per 16 MiB or so.
const POOR: f64 = 0.2;
const RETRY_EVERY: u32 = 16;

impl Compressor {
    pub fn new(choice: Compression, allowed: bool) -> Self {
        Compressor {
            choice,
            allowed,
            compressing: 1.0,
            skipped: 0,
        }
    }

    /// Whether to compress the next batch.
    fn compress(&self) -> bool {
        self.allowed && self.choice == Compression::Lz4
    }

    /// `raw` compressed, when compression is on and that saves (see
    /// [`pack`]); while the last tries did not compress, only every
    /// [`RETRY_EVERY`]th batch tries.
    pub fn pack(&mut self, raw: &[u8]) -> Option<Vec<u8>> {
        if !self.compress() {
            return None;
        }
        if self.compressing < POOR {
            self.skipped += 1;
            if self.skipped < RETRY_EVERY {
                return None;
            }
        }
        self.skipped = 0;
        let packed = pack(raw);
        self.compressing =
            self.compressing * (1.0 - NEWEST) + if packed.is_some() { NEWEST } else { 0.0 };
        packed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_that_compress_go_compressed_and_come_back_the_same() {
        let mut page = vec![0u8; 4096 * 4];
        page[..10].copy_from_slice(b"value:1234");
        let packed = pack(&page).expect("zeros compress");
        assert!(packed.len() < page.len() / 8);
        assert_eq!(unpack(&packed, page.len() as u64).unwrap(), page);
    }

    #[test]
    fn pages_that_do_not_compress_go_as_they_are() {
        let mut x: u64 = 1;
        let page: Vec<u8> = (0..16384)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        assert!(pack(&page).is_none());
    }

    #[test]
    fn a_wrong_length_or_a_damaged_block_is_refused() {
        let page = vec![7u8; 8192];
        let packed = pack(&page).unwrap();
        assert!(
            unpack(&packed, 4096)
                .unwrap_err()
                .contains("does not decompress")
        );
        assert!(
            unpack(&packed, 12288)
                .unwrap_err()
                .contains("not lz4_length 12288")
        );
        assert!(unpack(&packed, 0).unwrap_err().contains("outside"));
        assert!(
            unpack(&packed, MAX_DECOMPRESSED + 1)
                .unwrap_err()
                .contains("outside")
        );
        let mut damaged = packed.clone();
        damaged.truncate(packed.len() / 2);
        assert!(unpack(&damaged, 8192).is_err());
    }

    #[test]
    fn compressed_only_when_asked_and_taken() {
        assert!(Compressor::new(Compression::Lz4, true).compress());
        assert!(
            !Compressor::new(Compression::Lz4, false).compress(),
            "not taken there"
        );
        assert!(!Compressor::new(Compression::Off, true).compress());
    }

    #[test]
    fn pages_that_do_not_compress_are_tried_now_and_then() {
        let mut x: u64 = 7;
        let noise: Vec<u8> = (0..8192)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                (x >> 33) as u8
            })
            .collect();
        let mut lz = Compressor::new(Compression::Lz4, true);
        // Six failed tries in a row make it poor (0.75^6 < 0.2).
        for _ in 0..6 {
            assert!(lz.pack(&noise).is_none());
        }
        assert!(lz.compressing < POOR);
        let zeros = vec![0u8; 8192];
        let waited = (0..RETRY_EVERY)
            .take_while(|_| lz.pack(&zeros).is_none())
            .count();
        assert_eq!(
            waited as u32,
            RETRY_EVERY - 1,
            "tried again at the 16th batch"
        );
        assert!(
            lz.pack(&zeros).is_some(),
            "compressing again: tried each time"
        );
    }
}
