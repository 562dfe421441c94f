//! Framing of a CRIU protobuf image file: header magic, then entries.
//!
//! ```text
//! [IMG_COMMON_MAGIC u32] [image magic u32]        (images v1.1; v1 has no first word)
//! [size u32] [size bytes of protobuf]              (repeated to the end of the file)
//! ```
//!
//! All words are in the dumping host's byte order (CRIU writes them with
//! `write(2)` of a `u32`): little-endian on x86_64 and aarch64. None of
//! `files.img`, `inetsk.img` and `pagemap-<pid>.img` has a payload after
//! its entries (CRIU reads them with `collect_image`/`pb_read_one_eof`
//! alone, and keeps a pagemap's pages in a file of their own; compare
//! `tcp-stream` or `pipes-data`, which carry raw data after each entry).

use std::path::Path;

use crate::error::ImageError;

/// First word of every image but the inventory, since images v1.1.
pub(crate) const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
/// First word of service files (stats, irmap cache).
pub(crate) const IMG_SERVICE_MAGIC: u32 = 0x5510_5940;

/// Which entries an image holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryKind {
    /// `file_entry` (fdinfo.proto): a union of all file kinds; sockets are
    /// `type = INETSK (4)` with `isk = 4`.
    FileEntry,
    /// `inet_sk_entry` (sk-inet.proto) directly.
    InetSkEntry,
}

/// An image file this crate edits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ImageKind {
    pub file_name: &'static str,
    pub magic: u32,
    pub magic_name: &'static str,
    pub entries: EntryKind,
}

/// `files.img`, where CRIU since 3.x keeps every file, sockets included.
pub(crate) const FILES: ImageKind = ImageKind {
    file_name: "files.img",
    magic: 0x5630_3138,
    magic_name: "files.img (FILES_MAGIC 0x56303138)",
    entries: EntryKind::FileEntry,
};

/// `inetsk.img` of older CRIU, one `inet_sk_entry` per socket. CRIU 4.x
/// still reads it when `files.img` is absent.
pub(crate) const INETSK: ImageKind = ImageKind {
    file_name: "inetsk.img",
    magic: 0x5644_3851,
    magic_name: "inetsk.img (INETSK_MAGIC 0x56443851)",
    entries: EntryKind::InetSkEntry,
};

/// One entry: where its size word starts, where its protobuf starts, and
/// the protobuf.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry<'a> {
    pub offset: usize,
    pub payload_offset: usize,
    pub payload: &'a [u8],
}

/// A parsed image: the header bytes (kept verbatim) and the entries.
#[derive(Debug)]
pub(crate) struct Framed<'a> {
    pub header: &'a [u8],
    pub entries: Vec<Entry<'a>>,
}

/// The whole image file at `path`.
pub(crate) fn read(path: &Path) -> Result<Vec<u8>, ImageError> {
    std::fs::read(path).map_err(|source| ImageError::Io {
        path: path.to_owned(),
        op: "read",
        source,
    })
}

/// Checks the header and splits the file into entries.
pub(crate) fn frame<'a>(
    path: &Path,
    bytes: &'a [u8],
    kind: &ImageKind,
) -> Result<Framed<'a>, ImageError> {
    frame_magic(path, bytes, kind.magic, kind.magic_name)
}

/// [`frame`] for an image this crate reads but does not edit, known by its
/// magic alone (`magic_name` says which image it is, for errors).
pub(crate) fn frame_magic<'a>(
    path: &Path,
    bytes: &'a [u8],
    expected_magic: u32,
    magic_name: &'static str,
) -> Result<Framed<'a>, ImageError> {
    let first = word(path, bytes, 0, "the image magic")?;
    let header_len = if first == IMG_COMMON_MAGIC || first == IMG_SERVICE_MAGIC {
        8
    } else {
        4
    };
    let magic = word(path, bytes, header_len - 4, "the image magic")?;
    if magic != expected_magic {
        return Err(ImageError::BadMagic {
            path: path.to_owned(),
            offset: (header_len - 4) as u64,
            expected: magic_name,
            found: magic,
        });
    }
    let mut entries = Vec::new();
    let mut pos = header_len;
    while pos < bytes.len() {
        let size = word(path, bytes, pos, "an entry size (u32)")? as usize;
        let payload_offset = pos + 4;
        let available = bytes.len() - payload_offset;
        if size > available {
            return Err(ImageError::Truncated {
                path: path.to_owned(),
                offset: payload_offset as u64,
                expected: format!("an entry of {size} bytes"),
                available: available as u64,
            });
        }
        entries.push(Entry {
            offset: pos,
            payload_offset,
            payload: &bytes[payload_offset..payload_offset + size],
        });
        pos = payload_offset + size;
    }
    Ok(Framed {
        header: &bytes[..header_len],
        entries,
    })
}

fn word(path: &Path, bytes: &[u8], at: usize, what: &str) -> Result<u32, ImageError> {
    bytes
        .get(at..at + 4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_ne_bytes)
        .ok_or_else(|| ImageError::Truncated {
            path: path.to_owned(),
            offset: at as u64,
            expected: what.to_owned(),
            available: bytes.len().saturating_sub(at) as u64,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path() -> &'static Path {
        Path::new("files.img")
    }

    fn header() -> Vec<u8> {
        let mut b = IMG_COMMON_MAGIC.to_ne_bytes().to_vec();
        b.extend(FILES.magic.to_ne_bytes());
        b
    }

    #[test]
    fn frames_entries() {
        let mut b = header();
        b.extend(2u32.to_ne_bytes());
        b.extend([0x08, 0x01]);
        b.extend(0u32.to_ne_bytes());
        let f = frame(path(), &b, &FILES).unwrap();
        assert_eq!(f.header.len(), 8);
        assert_eq!(f.entries.len(), 2);
        assert_eq!(f.entries[0].payload, [0x08, 0x01]);
        assert_eq!(f.entries[1].offset, 14);
        assert!(f.entries[1].payload.is_empty());
    }

    #[test]
    fn accepts_v1_images_without_common_magic() {
        let mut b = FILES.magic.to_ne_bytes().to_vec();
        b.extend(0u32.to_ne_bytes());
        let f = frame(path(), &b, &FILES).unwrap();
        assert_eq!(f.header.len(), 4);
        assert_eq!(f.entries.len(), 1);
    }

    #[test]
    fn rejects_wrong_magic_and_truncation() {
        let mut b = IMG_COMMON_MAGIC.to_ne_bytes().to_vec();
        b.extend(INETSK.magic.to_ne_bytes());
        assert!(matches!(
            frame(path(), &b, &FILES),
            Err(ImageError::BadMagic { offset: 4, .. })
        ));
        assert!(matches!(
            frame(path(), &b[..6], &FILES),
            Err(ImageError::Truncated { offset: 4, .. })
        ));
        let mut b = header();
        b.extend([5, 0]);
        assert!(matches!(
            frame(path(), &b, &FILES),
            Err(ImageError::Truncated { offset: 8, .. })
        ));
        let mut b = header();
        b.extend(10u32.to_ne_bytes());
        b.extend([1, 2, 3]);
        assert!(matches!(
            frame(path(), &b, &FILES),
            Err(ImageError::Truncated {
                offset: 12,
                available: 3,
                ..
            })
        ));
    }
}
