//! Reads the memory areas (VMAs) of `mm-<pid>.img`.
//!
//! A lazy restore fills a process's memory by userfaultfd after it
//! resumes, and one copy must stay within one area: the areas say where
//! the runs of a pagemap are cut.
//!
//! # The format (CRIU 4.2.1, `images/mm.proto`, `images/vma.proto`)
//!
//! Framed like the other images (see `image.rs`) with `MM_MAGIC`
//! 0x57492820; one `mm_entry`, whose field 14 (`vmas`) repeats a
//! `vma_entry` per area, in ascending address order:
//!
//! | field | name | type |
//! |---|---|---|
//! | 1 | `start` | uint64, required |
//! | 2 | `end` | uint64, required |
//! | 5 | `prot` | uint32, required (`PROT_*`) |
//! | 6 | `flags` | uint32, required (`MAP_*`) |
//! | 7 | `status` | uint32, required (CRIU's `VMA_*`) |
//!
//! The other fields (offsets, files, madvise bits) are not read.
//!
//! CRIU 4.2 also lists guard areas there (`MADV_GUARD_INSTALL` markers,
//! status `VMA_AREA_GUARD`): not memory areas but ranges inside them,
//! after all the real ones, which the restore marks again. They are left
//! out of what [`read_vmas`] returns.

use std::path::Path;

use crate::error::ImageError;
use crate::image;
use crate::wire::{Field, Fields, Value};

const MM_MAGIC: u32 = 0x5749_2820;
const MM_MAGIC_NAME: &str = "an mm image (MM_MAGIC 0x57492820)";
const MM_VMAS: u32 = 14;
const VMA_START: u32 = 1;
const VMA_END: u32 = 2;
const VMA_PROT: u32 = 5;
const VMA_FLAGS: u32 = 6;
const VMA_STATUS: u32 = 7;
/// CRIU's `VMA_AREA_GUARD` status bit (criu/include/image.h).
const VMA_AREA_GUARD: u32 = 1 << 16;
/// CRIU's status bits of the kernel's own areas (criu/include/image.h).
const VMA_AREA_VSYSCALL: u32 = 1 << 2;
const VMA_AREA_VDSO: u32 = 1 << 3;
const VMA_AREA_VVAR: u32 = 1 << 12;

/// One memory area of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vma {
    pub start: u64,
    pub end: u64,
    /// `PROT_*`.
    pub prot: u32,
    /// `MAP_*` (`MAP_PRIVATE`, `MAP_ANONYMOUS`, ...).
    pub flags: u32,
    /// CRIU's `VMA_*` status bits (area kind).
    pub status: u32,
}

impl Vma {
    /// Whether a lazy restore fills this area by userfaultfd: CRIU's
    /// `vma_entry_can_be_lazy` (criu/include/vma.h): private anonymous,
    /// not locked, not hugetlb, not the kernel's vDSO, vvar or vsyscall.
    pub fn can_be_lazy(&self) -> bool {
        let flag = |f: libc::c_int| self.flags & f as u32 != 0;
        flag(libc::MAP_ANONYMOUS)
            && flag(libc::MAP_PRIVATE)
            && !flag(libc::MAP_LOCKED)
            && !flag(libc::MAP_HUGETLB)
            && self.status & (VMA_AREA_VDSO | VMA_AREA_VVAR | VMA_AREA_VSYSCALL) == 0
    }
}

/// Reads `images_dir/mm-<pid>.img`, `pid` as CRIU names the file (the
/// task's pid inside its own PID namespace): its memory areas, in
/// ascending address order, none empty, none overlapping; no guard areas.
pub fn read_vmas(images_dir: &Path, pid: u32) -> Result<Vec<Vma>, ImageError> {
    let path = images_dir.join(format!("mm-{pid}.img"));
    let bytes = image::read(&path)?;
    parse(&path, &bytes)
}

pub(crate) fn parse(path: &Path, bytes: &[u8]) -> Result<Vec<Vma>, ImageError> {
    let framed = image::frame_magic(path, bytes, MM_MAGIC, MM_MAGIC_NAME)?;
    let bad = |offset: usize, problem: String| ImageError::BadMm {
        path: path.to_owned(),
        offset: offset as u64,
        problem,
    };
    let Some(entry) = framed.entries.first() else {
        return Err(bad(framed.header.len(), "the image has no mm_entry".into()));
    };
    let wire = |base: usize| {
        move |e: crate::wire::WireError| ImageError::Protobuf {
            path: path.to_owned(),
            offset: (base + e.offset) as u64,
            problem: e.problem,
        }
    };
    let mut vmas: Vec<Vma> = Vec::new();
    for field in Fields::new(entry.payload) {
        let field = field.map_err(wire(entry.payload_offset))?;
        if field.number != MM_VMAS {
            continue;
        }
        let Value::Len(msg) = field.value else {
            return Err(wire(entry.payload_offset)(
                field.wrong_type("a vma_entry message"),
            ));
        };
        let base = entry.payload_offset + field.value_offset;
        let vma = parse_vma(msg).map_err(|e| match e {
            VmaFault::Wire(e) => wire(base)(e),
            VmaFault::Missing(name) => bad(base, format!("vma_entry without {name}")),
        })?;
        let page = crate::pagemap::host_page_size();
        if vma.start >= vma.end || vma.start % page != 0 || vma.end % page != 0 {
            return Err(bad(
                base,
                format!(
                    "area {:#x}-{:#x} is empty or not page-aligned",
                    vma.start, vma.end
                ),
            ));
        }
        if vma.status & VMA_AREA_GUARD != 0 {
            continue;
        }
        if let Some(prev) = vmas.last()
            && vma.start < prev.end
        {
            return Err(bad(
                base,
                format!(
                    "area {:#x}-{:#x} starts before the previous one's end {:#x}",
                    vma.start, vma.end, prev.end
                ),
            ));
        }
        vmas.push(vma);
    }
    Ok(vmas)
}

enum VmaFault {
    Wire(crate::wire::WireError),
    Missing(&'static str),
}

fn parse_vma(msg: &[u8]) -> Result<Vma, VmaFault> {
    let (mut start, mut end, mut prot, mut flags, mut status) = (None, None, None, None, None);
    for field in Fields::new(msg) {
        let field: Field<'_> = field.map_err(VmaFault::Wire)?;
        // The last occurrence of a scalar wins, as protobuf says.
        match field.number {
            VMA_START => start = Some(field.uint64().map_err(VmaFault::Wire)?),
            VMA_END => end = Some(field.uint64().map_err(VmaFault::Wire)?),
            VMA_PROT => prot = Some(field.uint32().map_err(VmaFault::Wire)?),
            VMA_FLAGS => flags = Some(field.uint32().map_err(VmaFault::Wire)?),
            VMA_STATUS => status = Some(field.uint32().map_err(VmaFault::Wire)?),
            _ => {}
        }
    }
    Ok(Vma {
        start: start.ok_or(VmaFault::Missing("start"))?,
        end: end.ok_or(VmaFault::Missing("end"))?,
        prot: prot.ok_or(VmaFault::Missing("prot"))?,
        flags: flags.ok_or(VmaFault::Missing("flags"))?,
        status: status.ok_or(VmaFault::Missing("status"))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::IMG_COMMON_MAGIC;
    use crate::wire::{encode_len, encode_varint};

    fn varint(out: &mut Vec<u8>, field: u32, v: u64) {
        encode_varint(u64::from(field) << 3, out);
        encode_varint(v, out);
    }

    fn vma(start: u64, end: u64, flags: u32) -> Vec<u8> {
        vma_with_status(start, end, flags, 0x201)
    }

    fn vma_with_status(start: u64, end: u64, flags: u32, status: u64) -> Vec<u8> {
        let mut m = Vec::new();
        varint(&mut m, 1, start);
        varint(&mut m, 2, end);
        varint(&mut m, 3, 0);
        varint(&mut m, 4, 0);
        varint(&mut m, 5, 3);
        varint(&mut m, 6, u64::from(flags));
        varint(&mut m, 7, status);
        varint(&mut m, 8, u64::MAX);
        m
    }

    fn image(vmas: &[Vec<u8>]) -> Vec<u8> {
        let mut entry = Vec::new();
        varint(&mut entry, 1, 0x40_0000);
        for v in vmas {
            encode_varint(u64::from(MM_VMAS) << 3 | 2, &mut entry);
            encode_len(v, &mut entry);
        }
        varint(&mut entry, 15, 1);
        let mut b = IMG_COMMON_MAGIC.to_ne_bytes().to_vec();
        b.extend(MM_MAGIC.to_ne_bytes());
        b.extend((entry.len() as u32).to_ne_bytes());
        b.extend(entry);
        b
    }

    #[test]
    fn reads_the_areas_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = image(&[
            vma(0x10_0000, 0x30_0000, 0x22),
            vma(0x50_0000, 0x60_0000, 0x2),
        ]);
        std::fs::write(dir.path().join("mm-9.img"), bytes).unwrap();
        let vmas = read_vmas(dir.path(), 9).unwrap();
        assert_eq!(
            vmas,
            [
                Vma {
                    start: 0x10_0000,
                    end: 0x30_0000,
                    prot: 3,
                    flags: 0x22,
                    status: 0x201
                },
                Vma {
                    start: 0x50_0000,
                    end: 0x60_0000,
                    prot: 3,
                    flags: 0x2,
                    status: 0x201
                }
            ]
        );
    }

    #[test]
    fn leaves_out_the_guard_areas_after_the_real_ones() {
        let p = Path::new("mm-1.img");
        let bytes = image(&[
            vma(0x10_0000, 0x30_0000, 0x22),
            vma(0x50_0000, 0x60_0000, 0x22),
            // Guards inside both, listed after them (CRIU's order).
            vma_with_status(0x20_0000, 0x20_2000, 0, u64::from(VMA_AREA_GUARD)),
            vma_with_status(0x50_0000, 0x50_1000, 0, u64::from(VMA_AREA_GUARD)),
        ]);
        let vmas = parse(p, &bytes).unwrap();
        assert_eq!(
            vmas.iter().map(|v| (v.start, v.end)).collect::<Vec<_>>(),
            [(0x10_0000, 0x30_0000), (0x50_0000, 0x60_0000)]
        );
        // Still page-aligned and not empty.
        let bad = image(&[
            vma(0x10_0000, 0x30_0000, 0x22),
            vma_with_status(0x20_0001, 0x20_2000, 0, u64::from(VMA_AREA_GUARD)),
        ]);
        assert!(matches!(parse(p, &bad), Err(ImageError::BadMm { .. })));
    }

    #[test]
    fn refuses_overlap_emptiness_and_missing_fields() {
        let p = Path::new("mm-1.img");
        for bad in [
            image(&[
                vma(0x10_0000, 0x30_0000, 0x22),
                vma(0x20_0000, 0x40_0000, 0x22),
            ]),
            image(&[vma(0x30_0000, 0x30_0000, 0x22)]),
            image(&[vma(0x10_0001, 0x30_0000, 0x22)]),
        ] {
            assert!(
                matches!(parse(p, &bad), Err(ImageError::BadMm { .. })),
                "{bad:?}"
            );
        }
        let mut short = Vec::new();
        varint(&mut short, 1, 0x10_0000);
        assert!(matches!(
            parse(p, &image(&[short])),
            Err(ImageError::BadMm { problem, .. }) if problem.contains("end")
        ));
        // Garbage never panics.
        let good = image(&[vma(0x10_0000, 0x30_0000, 0x22)]);
        for cut in 0..good.len() {
            let _ = parse(p, &good[..cut]);
        }
    }
}
