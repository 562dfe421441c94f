//! The one error type of this crate.

use std::io;
use std::path::PathBuf;

use crate::pagemap::PagemapProblem;
use crate::wire::WireProblem;

/// Why an image directory could not be read or rewritten. Offsets are in
/// bytes from the start of the named file. Nothing is written when a
/// rewrite fails: a file is either replaced whole or left as it was.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The directory holds neither `files.img` (CRIU 3.x and later) nor
    /// `inetsk.img` (older CRIU).
    #[error("{dir}: no CRIU image with sockets in it (files.img or inetsk.img)")]
    NoSocketImage { dir: PathBuf },

    /// Reading, writing or renaming a file failed.
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: io::Error,
    },

    /// The file's header is not the magic of the expected image.
    #[error("{path} at byte {offset}: expected the magic of {expected}, found {found:#010x}")]
    BadMagic {
        path: PathBuf,
        offset: u64,
        expected: &'static str,
        found: u32,
    },

    /// The file ends inside its header, an entry's size or an entry.
    #[error("{path} at byte {offset}: expected {expected}, only {available} bytes left")]
    Truncated {
        path: PathBuf,
        offset: u64,
        expected: String,
        available: u64,
    },

    /// An entry is not well-formed protobuf, or a field this crate reads
    /// has the wrong wire type or range.
    #[error("{path} at byte {offset}: malformed protobuf: {problem}")]
    Protobuf {
        path: PathBuf,
        offset: u64,
        problem: WireProblem,
    },

    /// An inet socket entry that CRIU itself would refuse: a required field
    /// is missing, the family is not AF_INET/AF_INET6, or an address has the
    /// wrong number of words for its family.
    #[error("{path} at byte {offset}: inet socket entry: {problem}")]
    BadSocket {
        path: PathBuf,
        offset: u64,
        problem: String,
    },

    /// A pagemap image that CRIU would refuse, or whose page layout would
    /// be ambiguous: pages spliced by the wrong layout corrupt the restored
    /// process's memory, so nothing is guessed.
    #[error("{path} at byte {offset}: pagemap: {problem}")]
    BadPagemap {
        path: PathBuf,
        offset: u64,
        problem: PagemapProblem,
    },

    /// An mm image whose memory areas CRIU would refuse or that cannot be
    /// told apart: a required field missing, an empty or unaligned area,
    /// areas out of order or overlapping.
    #[error("{path} at byte {offset}: mm: {problem}")]
    BadMm {
        path: PathBuf,
        offset: u64,
        problem: String,
    },

    /// A pages file whose size is not what its pagemap's present runs take:
    /// a short file lacks pages, a long one has bytes no run accounts for,
    /// and either way the offsets of the pagemap cannot be trusted for it.
    #[error("{path}: {found} bytes, but the present runs of its pagemap take {expected}")]
    PagesFileSize {
        path: PathBuf,
        expected: u64,
        found: u64,
    },

    /// A rewritten entry would no longer fit its u32 size prefix.
    #[error("{path} at byte {offset}: rewritten entry of {size} bytes exceeds a u32 size")]
    EntryTooLarge {
        path: PathBuf,
        offset: u64,
        size: usize,
    },
}
