//! Pages a dump left out, restored lazily or from a parent image: the
//! pagemap edits that a destination filling held pages makes before the
//! restore.

use std::fs;
use std::io::{self, Write};
use std::path::Path;

use super::{COMPAT_NR_PAGES, HEAD_PAGES_ID, NR_PAGES, VADDR};
use super::{FLAGS, PAGEMAP_MAGIC, PAGEMAP_MAGIC_NAME, PE_LAZY, PE_PARENT, PE_PRESENT, PageRun};
use super::{PagemapProblem, host_page_size, parse};
use crate::ImageError;
use crate::image::{self, IMG_COMMON_MAGIC};
use crate::mm::Vma;
use crate::wire::{Fields, encode_varint};

/// The runs a dump left out, as [`prepare_left_out`] made them.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct LeftOut {
    /// In areas a lazy restore fills: now lazy runs ([`PE_LAZY`]).
    pub lazy: Vec<PageRun>,
    /// In areas it does not fill (private file mappings the process
    /// wrote, locked areas): still parent runs ([`PE_PARENT`]), whose pages
    /// the restore reads from the parent image ([`write_parent`]).
    pub in_parent: Vec<PageRun>,
}

/// Makes `images_dir/pagemap-<pid>.img` ready for a restore in which the
/// pages a dump left out come lazily where they can, `areas` being the
/// process's memory areas (`crate::mm::read_vmas`), and returns those runs:
///
/// - runs left "in the parent" ([`PE_PARENT`] alone) in areas a lazy
///   restore fills ([`Vma::can_be_lazy`]) become lazy runs ([`PE_LAZY`]
///   alone). ferry's patched CRIU leaves the pages a migration's
///   destination already holds out of the dump as parent runs; the
///   destination has no parent dump but its page store, and installs them
///   by userfaultfd after the resume.
/// - parent runs in other areas stay parent runs, for a parent image the
///   caller writes from its store ([`write_parent`]). A run across areas
///   of both kinds (CRIU joins adjacent holes: a binary's written `.data`
///   and the anonymous `.bss` after it) is cut in two entries.
/// - runs in the pages file and flagged lazy ([`PE_PRESENT`] | [`PE_LAZY`]:
///   CRIU flags every page of an area a lazy restore could fill) lose
///   [`PE_LAZY`]: a lazy restore skips every lazy run, and these, the pages
///   written since the last pre-copy round, are restored from the file as
///   usual.
///
/// No run changes whether it takes room in the pages file, so its offsets
/// do not move, and the pages file is not touched. An image with nothing
/// to change is left as it is; a changed one is written beside and renamed
/// over, so a restore never reads a half-edited pagemap.
pub fn prepare_left_out(images_dir: &Path, pid: u32, areas: &[Vma]) -> Result<LeftOut, ImageError> {
    let path = images_dir.join(format!("pagemap-{pid}.img"));
    let bytes = image::read(&path)?;
    let page_size = host_page_size();
    // Checks the whole image first, as a restore would read it.
    let map = parse(&path, &bytes, page_size)?;
    let framed = image::frame_magic(&path, &bytes, PAGEMAP_MAGIC, PAGEMAP_MAGIC_NAME)?;
    let mut out = framed.header.to_vec();
    let mut left = LeftOut::default();
    let mut changed = false;
    let bad = |offset: usize, problem| ImageError::BadPagemap {
        path: path.clone(),
        offset: offset as u64,
        problem,
    };
    // The head, as it is.
    let head = &framed.entries[0];
    out.extend_from_slice(&bytes[head.offset..head.payload_offset + head.payload.len()]);
    for (entry, run) in framed.entries.iter().skip(1).zip(&map.runs) {
        let verbatim = &bytes[entry.offset..entry.payload_offset + entry.payload.len()];
        let pieces: Vec<PageRun> = match run.flags {
            PE_PARENT => {
                let end = run.vaddr + run.nr_pages * page_size;
                let mut pieces: Vec<PageRun> = Vec::new();
                let mut at = run.vaddr;
                while at < end {
                    let Some(area) = areas.iter().find(|a| a.start <= at && at < a.end) else {
                        return Err(bad(
                            entry.payload_offset,
                            PagemapProblem::LeftOutOutsideAreas { vaddr: at },
                        ));
                    };
                    let cut = end.min(area.end);
                    let flags = if area.can_be_lazy() {
                        PE_LAZY
                    } else {
                        PE_PARENT
                    };
                    match pieces.last_mut() {
                        Some(last) if last.flags == flags => {
                            last.nr_pages += (cut - at) / page_size;
                        }
                        _ => pieces.push(PageRun {
                            vaddr: at,
                            nr_pages: (cut - at) / page_size,
                            flags,
                            pages_file_offset: None,
                        }),
                    }
                    at = cut;
                }
                for p in &pieces {
                    if p.flags == PE_LAZY {
                        left.lazy.push(*p);
                    } else {
                        left.in_parent.push(*p);
                    }
                }
                pieces
            }
            f if f == PE_PRESENT | PE_LAZY => vec![PageRun {
                flags: PE_PRESENT,
                ..*run
            }],
            _ => vec![*run],
        };
        match pieces.as_slice() {
            [one] if one.flags == run.flags => out.extend_from_slice(verbatim),
            [one] => {
                // Only the flags change: the flags field as written, the
                // last occurrence winning. A run flagged by the pre-3.5
                // `in_parent` has none to edit.
                let field = Fields::new(entry.payload)
                    .filter_map(Result::ok)
                    .filter(|f| f.number == FLAGS)
                    .last();
                match field {
                    Some(f) if f.raw.len() == f.value_offset - f.offset + 1 => {
                        let at = out.len() + (entry.payload_offset - entry.offset) + f.value_offset;
                        out.extend_from_slice(verbatim);
                        out[at] = one.flags as u8;
                    }
                    _ => {
                        return Err(bad(
                            entry.payload_offset,
                            PagemapProblem::ContradictoryFlags {
                                vaddr: run.vaddr,
                                flags: run.flags,
                            },
                        ));
                    }
                }
                changed = true;
            }
            many => {
                for p in many {
                    push_entry(&mut out, p);
                }
                changed = true;
            }
        }
    }
    if changed {
        write_beside(images_dir, &path, &format!(".pagemap-{pid}.img.lazy"), &out)?;
    }
    Ok(left)
}

/// Appends a `pagemap_entry` as CRIU 4.2 writes one: the count in
/// `nr_pages`, `compat_nr_pages` left at 0.
fn push_entry(out: &mut Vec<u8>, run: &PageRun) {
    let mut msg = Vec::with_capacity(24);
    for (field, value) in [
        (VADDR, run.vaddr),
        (COMPAT_NR_PAGES, 0),
        (FLAGS, u64::from(run.flags)),
        (NR_PAGES, run.nr_pages),
    ] {
        encode_varint(u64::from(field) << 3, &mut msg);
        encode_varint(value, &mut msg);
    }
    out.extend_from_slice(&(msg.len() as u32).to_ne_bytes());
    out.extend_from_slice(&msg);
}

/// The directory a restore looks in for the parent images of the images
/// in its own directory (CRIU's `CR_PARENT_LINK`).
pub const PARENT_DIR: &str = "parent";

/// Writes the parent image of process `pid` that the parent runs `runs`
/// (from [`prepare_left_out`], sorted) are read from by the restore:
/// `images_dir/parent/pagemap-<pid>.img`, every run present, and its pages
/// file, each run's bytes read by `read(vaddr, buf)` (the destination's
/// page store). Nothing is written for no runs. Returns the bytes written
/// to the pages file.
pub fn write_parent(
    images_dir: &Path,
    pid: u32,
    runs: &[PageRun],
    mut read: impl FnMut(u64, &mut [u8]) -> io::Result<()>,
) -> Result<u64, ImageError> {
    if runs.is_empty() {
        return Ok(0);
    }
    let page_size = host_page_size();
    let dir = images_dir.join(PARENT_DIR);
    let io_err = |path: &Path, op: &'static str| {
        let path = path.to_owned();
        move |source| ImageError::Io { path, op, source }
    };
    fs::create_dir_all(&dir).map_err(io_err(&dir, "create"))?;
    // The pages file's id: the process's own, in a directory of its own.
    let pages_id = pid;
    let mut map = IMG_COMMON_MAGIC.to_ne_bytes().to_vec();
    map.extend(PAGEMAP_MAGIC.to_ne_bytes());
    let mut head = Vec::new();
    encode_varint(u64::from(HEAD_PAGES_ID) << 3, &mut head);
    encode_varint(u64::from(pages_id), &mut head);
    map.extend((head.len() as u32).to_ne_bytes());
    map.extend(head);
    let pages_path = dir.join(format!("pages-{pages_id}.img"));
    let mut pages = fs::File::create(&pages_path).map_err(io_err(&pages_path, "create"))?;
    let mut buf = Vec::new();
    let mut written = 0u64;
    let mut previous_end = 0;
    for run in runs {
        let len = run.nr_pages * page_size;
        let problem = if run.nr_pages == 0 {
            Some(PagemapProblem::ZeroPages { vaddr: run.vaddr })
        } else if run.vaddr < previous_end {
            Some(PagemapProblem::OutOfOrder {
                vaddr: run.vaddr,
                previous_end,
            })
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(ImageError::BadPagemap {
                path: dir.join(format!("pagemap-{pid}.img")),
                offset: 0,
                problem,
            });
        }
        previous_end = run.vaddr + len;
        buf.resize(len as usize, 0);
        read(run.vaddr, &mut buf).map_err(io_err(&pages_path, "read from the page store"))?;
        pages
            .write_all(&buf)
            .map_err(io_err(&pages_path, "write"))?;
        written += len;
        push_entry(
            &mut map,
            &PageRun {
                flags: PE_PRESENT,
                ..*run
            },
        );
    }
    let map_path = dir.join(format!("pagemap-{pid}.img"));
    fs::write(&map_path, &map).map_err(io_err(&map_path, "write"))?;
    Ok(written)
}

/// Writes `bytes` to `tmp_name` in `dir` and renames it over `path`.
fn write_beside(dir: &Path, path: &Path, tmp_name: &str, bytes: &[u8]) -> Result<(), ImageError> {
    let tmp = dir.join(tmp_name);
    fs::write(&tmp, bytes).map_err(|source| ImageError::Io {
        path: tmp.clone(),
        op: "write",
        source,
    })?;
    fs::rename(&tmp, path).map_err(|source| ImageError::Io {
        path: path.to_owned(),
        op: "rename",
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::{entry, head, image, old_entry};
    use super::super::{Pagemap, read_pagemap};
    use super::*;

    const ANON: u32 = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u32;
    const FILE: u32 = libc::MAP_PRIVATE as u32;

    fn area(start: u64, end: u64, flags: u32) -> Vma {
        Vma {
            start,
            end,
            prot: 3,
            flags,
            status: 1,
        }
    }

    fn runs(rs: &[PageRun]) -> Vec<(u64, u64, u32)> {
        rs.iter().map(|r| (r.vaddr, r.nr_pages, r.flags)).collect()
    }

    #[test]
    fn left_out_runs_become_lazy_and_present_ones_eager_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let entries = [
            head(3),
            entry(0x10_0000, 2, PE_PRESENT),
            entry(0x20_0000, 3, PE_PARENT),
            entry(0x30_0000, 1, PE_PRESENT | PE_LAZY),
            entry(0x40_0000, 4, PE_PRESENT),
            entry(0x50_0000, 5, PE_PARENT),
        ];
        let areas = [area(0x10_0000, 0x60_0000, ANON)];
        let path = dir.path().join("pagemap-7.img");
        let before = image(&entries);
        fs::write(&path, &before).unwrap();
        let ps = host_page_size();
        let old = read_pagemap(dir.path(), 7).unwrap();

        let left = prepare_left_out(dir.path(), 7, &areas).unwrap();
        assert_eq!(
            runs(&left.lazy),
            [(0x20_0000, 3, PE_LAZY), (0x50_0000, 5, PE_LAZY)]
        );
        assert!(left.in_parent.is_empty());

        let after = fs::read(&path).unwrap();
        assert_eq!(after.len(), before.len());
        assert_eq!(before.iter().zip(&after).filter(|(a, b)| a != b).count(), 3);
        let new = read_pagemap(dir.path(), 7).unwrap();
        let flags: Vec<u32> = new.runs.iter().map(|r| r.flags).collect();
        assert_eq!(
            flags,
            [PE_PRESENT, PE_LAZY, PE_PRESENT, PE_PRESENT, PE_LAZY]
        );
        // The pages file's layout is the same: only present runs take room.
        let offsets = |m: &Pagemap| {
            m.runs
                .iter()
                .map(|r| r.pages_file_offset)
                .collect::<Vec<_>>()
        };
        assert_eq!(offsets(&new), offsets(&old));
        assert_eq!(new.runs[3].pages_file_offset, Some(3 * ps));

        // Again: nothing left to turn, the file stays as it is.
        assert_eq!(
            prepare_left_out(dir.path(), 7, &areas).unwrap(),
            LeftOut::default()
        );
        assert_eq!(fs::read(&path).unwrap(), after);
        assert!(!dir.path().join(".pagemap-7.img.lazy").exists());
    }

    #[test]
    fn left_out_runs_of_areas_not_filled_lazily_stay_in_the_parent_cut_at_the_area() {
        let ps = host_page_size();
        let dir = tempfile::tempdir().unwrap();
        // A binary's written .data (a private file mapping), the anonymous
        // .bss right after it, one hole across both; then a locked area.
        let data = (0x10_0000, 0x10_0000 + 4 * ps);
        let bss = (data.1, data.1 + 8 * ps);
        let locked = (0x40_0000, 0x40_0000 + 2 * ps);
        let areas = [
            area(data.0, data.1, FILE),
            area(bss.0, bss.1, ANON),
            area(locked.0, locked.1, ANON | libc::MAP_LOCKED as u32),
        ];
        let entries = [
            head(3),
            entry(data.0, 1, PE_PRESENT),
            entry(data.0 + ps, 5, PE_PARENT),
            entry(data.0 + 6 * ps, 1, PE_PRESENT | PE_LAZY),
            entry(locked.0, 2, PE_PARENT),
        ];
        fs::write(dir.path().join("pagemap-9.img"), image(&entries)).unwrap();
        let old = read_pagemap(dir.path(), 9).unwrap();

        let left = prepare_left_out(dir.path(), 9, &areas).unwrap();
        assert_eq!(runs(&left.lazy), [(bss.0, 2, PE_LAZY)]);
        assert_eq!(
            runs(&left.in_parent),
            [(data.0 + ps, 3, PE_PARENT), (locked.0, 2, PE_PARENT)]
        );
        let new = read_pagemap(dir.path(), 9).unwrap();
        assert_eq!(
            runs(&new.runs),
            [
                (data.0, 1, PE_PRESENT),
                (data.0 + ps, 3, PE_PARENT),
                (bss.0, 2, PE_LAZY),
                (data.0 + 6 * ps, 1, PE_PRESENT),
                (locked.0, 2, PE_PARENT),
            ]
        );
        // Still the same pages file.
        assert_eq!(new.runs[3].pages_file_offset, old.runs[2].pages_file_offset);
        assert_eq!(new.present_bytes(), old.present_bytes());

        // The parent image the restore reads them from, filled by a store
        // that gives each page's address as its bytes.
        let store = |vaddr: u64, buf: &mut [u8]| {
            for (i, page) in buf.chunks_mut(ps as usize).enumerate() {
                page.fill(0);
                page[..8].copy_from_slice(&(vaddr + i as u64 * ps).to_ne_bytes());
            }
            Ok(())
        };
        let bytes = write_parent(dir.path(), 9, &left.in_parent, store).unwrap();
        assert_eq!(bytes, 5 * ps);
        let parent = dir.path().join(PARENT_DIR);
        let map = read_pagemap(&parent, 9).unwrap();
        assert_eq!(
            runs(&map.runs),
            [(data.0 + ps, 3, PE_PRESENT), (locked.0, 2, PE_PRESENT)]
        );
        assert_eq!(map.check_pages_file(&parent).unwrap(), 5 * ps);
        let pages = fs::read(parent.join(&map.pages_file)).unwrap();
        let first =
            |i: u64| u64::from_ne_bytes(pages[(i * ps) as usize..][..8].try_into().unwrap());
        assert_eq!(first(0), data.0 + ps);
        assert_eq!(first(2), data.0 + 3 * ps);
        assert_eq!(first(3), locked.0);
        assert_eq!(first(4), locked.0 + ps);
        // Nothing in the parent: nothing written.
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(write_parent(empty.path(), 9, &[], store).unwrap(), 0);
        assert!(!empty.path().join(PARENT_DIR).exists());
        // Runs it cannot lay out are refused, each for what it is.
        let run = |vaddr, nr_pages| PageRun {
            vaddr,
            nr_pages,
            flags: PE_PARENT,
            pages_file_offset: None,
        };
        let problem = |runs: &[PageRun]| match write_parent(empty.path(), 9, runs, store) {
            Err(ImageError::BadPagemap { problem, .. }) => problem,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            problem(&[run(data.0, 0)]),
            PagemapProblem::ZeroPages { vaddr: data.0 }
        );
        assert_eq!(
            problem(&[run(data.0, 2), run(data.0 + ps, 1)]),
            PagemapProblem::OutOfOrder {
                vaddr: data.0 + ps,
                previous_end: data.0 + 2 * ps
            }
        );
    }

    #[test]
    fn a_page_left_out_in_no_area_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let entries = [head(3), entry(0x10_0000, 2, PE_PARENT)];
        fs::write(dir.path().join("pagemap-6.img"), image(&entries)).unwrap();
        let ps = host_page_size();
        // The area ends one page into the run.
        let areas = [area(0x10_0000, 0x10_0000 + ps, ANON)];
        let err = prepare_left_out(dir.path(), 6, &areas).unwrap_err();
        assert!(
            matches!(
                err,
                ImageError::BadPagemap {
                    problem: PagemapProblem::LeftOutOutsideAreas { vaddr },
                    ..
                } if vaddr == 0x10_0000 + ps
            ),
            "{err}"
        );
    }

    #[test]
    fn a_parent_run_without_a_flags_field_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let entries = [head(3), old_entry(0x10_0000, 2, Some(true))];
        fs::write(dir.path().join("pagemap-8.img"), image(&entries)).unwrap();
        let areas = [area(0x10_0000, 0x20_0000, ANON)];
        assert!(matches!(
            prepare_left_out(dir.path(), 8, &areas),
            Err(ImageError::BadPagemap { .. })
        ));
    }
}
