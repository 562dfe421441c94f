//! The pages a pre-copy's destination holds, as ferry's held-pages patch to
//! CRIU reads them (`xtask/criu/held-pages-left-out.patch`): one file per
//! task in the image directory, `ferry-held-<pid in its namespace>.img`,
//! a header `{ u32 magic "FHP1", u32 count }` then `count` ranges
//! `{ u64 start, u64 end }`, page-aligned, sorted and disjoint, in the
//! host's byte order. A task without a file has none held.

use std::path::{Path, PathBuf};

use super::CriuError;
use crate::memtrack::RangeSet;

const MAGIC: u32 = 0x3150_4846; // "FHP1"
/// Every page with data in the ranges is held, written or not
/// (`xtask/criu/held-pages-written-or-not.patch`).
const MAGIC_ALL: u32 = 0x3250_4846; // "FHP2"
/// As "FHP1", in every private area, not only in those a lazy restore
/// fills: the destination gives the restore a parent image of the others
/// (`xtask/criu/held-pages-everywhere.patch`).
const MAGIC_EVERYWHERE: u32 = 0x3350_4846; // "FHP3"
/// The most ranges the patch reads.
pub const MAX_RANGES: usize = 1 << 24;

/// Where the file of task `vpid` goes.
pub fn path(images_dir: &Path, vpid: u32) -> PathBuf {
    images_dir.join(format!("ferry-held-{vpid}.img"))
}

/// Writes the held pages of task `vpid` (an empty set writes nothing).
/// Blocking.
pub fn write(images_dir: &Path, vpid: u32, held: &RangeSet) -> Result<(), CriuError> {
    write_as(images_dir, vpid, held, MAGIC)
}

/// As [`write`], for a destination that also writes the held pages of
/// areas a lazy restore cannot fill to the restore, as a parent image
/// ("FHP3").
/// Blocking.
pub fn write_everywhere(images_dir: &Path, vpid: u32, held: &RangeSet) -> Result<(), CriuError> {
    write_as(images_dir, vpid, held, MAGIC_EVERYWHERE)
}

/// Post-copy whose pages follow by ferryd: every page of task `vpid`
/// with data that a lazy restore can fill is held, written or not (the
/// "FHP2" file: one range, all of user space). Blocking.
pub fn write_all(images_dir: &Path, vpid: u32) -> Result<(), CriuError> {
    let mut everything = RangeSet::new();
    // Above every user-space address (57-bit with 5-level page tables).
    everything.insert(0, 1 << 57);
    write_as(images_dir, vpid, &everything, MAGIC_ALL)
}

fn write_as(images_dir: &Path, vpid: u32, held: &RangeSet, magic: u32) -> Result<(), CriuError> {
    if held.is_empty() {
        return Ok(());
    }
    let ranges: Vec<(u64, u64)> = held.iter().collect();
    let path = path(images_dir, vpid);
    if ranges.len() > MAX_RANGES {
        return Err(CriuError::Io {
            path,
            source: std::io::Error::other(format!(
                "{} held ranges, more than the {MAX_RANGES} CRIU reads",
                ranges.len()
            )),
        });
    }
    let mut bytes = Vec::with_capacity(8 + 16 * ranges.len());
    bytes.extend(magic.to_ne_bytes());
    bytes.extend((ranges.len() as u32).to_ne_bytes());
    for (start, end) in ranges {
        bytes.extend(start.to_ne_bytes());
        bytes.extend(end.to_ne_bytes());
    }
    std::fs::write(&path, bytes).map_err(|source| CriuError::Io { path, source })
}

/// Whether `name` is such a file: ferryd's note to its own CRIU, which the
/// destination does not need.
pub fn is_held_file(name: &str) -> bool {
    name.starts_with("ferry-held-") && name.ends_with(".img")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_the_layout_the_patch_reads() {
        let dir = tempfile::tempdir().unwrap();
        let mut held = RangeSet::new();
        held.insert(0x1000, 0x3000);
        held.insert(0x8000, 0x9000);
        write(dir.path(), 7, &held).unwrap();
        let b = std::fs::read(path(dir.path(), 7)).unwrap();
        let word = |i: usize| u32::from_ne_bytes(b[i..i + 4].try_into().unwrap());
        let long = |i: usize| u64::from_ne_bytes(b[i..i + 8].try_into().unwrap());
        assert_eq!(b.len(), 8 + 2 * 16);
        #[cfg(target_endian = "little")]
        assert_eq!(&b[0..4], b"FHP1");
        assert_eq!(word(0), MAGIC);
        assert_eq!(word(4), 2);
        assert_eq!(
            (long(8), long(16), long(24), long(32)),
            (0x1000, 0x3000, 0x8000, 0x9000)
        );
        assert!(is_held_file("ferry-held-7.img"));
        assert!(!is_held_file("pagemap-7.img"));
        // Nothing held: no file.
        write(dir.path(), 8, &RangeSet::new()).unwrap();
        assert!(!path(dir.path(), 8).exists());
        // Everything, written or not: its own magic, one range.
        write_all(dir.path(), 9).unwrap();
        let b = std::fs::read(path(dir.path(), 9)).unwrap();
        #[cfg(target_endian = "little")]
        assert_eq!(&b[0..4], b"FHP2");
        assert_eq!(b.len(), 8 + 16);
        assert_eq!(u64::from_ne_bytes(b[8..16].try_into().unwrap()), 0);
        // In every private area: the same ranges under their own magic.
        write_everywhere(dir.path(), 10, &held).unwrap();
        let b = std::fs::read(path(dir.path(), 10)).unwrap();
        #[cfg(target_endian = "little")]
        assert_eq!(&b[0..4], b"FHP3");
        assert_eq!(b.len(), 8 + 2 * 16);
    }
}
