//! Pages a dump left out, restored lazily: the pagemap edit that a
//! destination filling held pages makes before the restore.

use std::fs;
use std::path::Path;

use super::{FLAGS, PAGEMAP_MAGIC, PAGEMAP_MAGIC_NAME, PE_LAZY, PE_PARENT, PE_PRESENT, PageRun};
use super::{PagemapProblem, host_page_size, parse};
use crate::ImageError;
use crate::image;
use crate::wire::Fields;

/// Makes `images_dir/pagemap-<pid>.img` ready for a restore in which only
/// the pages a dump left out come lazily, in place, and returns those runs
/// (flags as they now are):
///
/// - runs left "in the parent" ([`PE_PARENT`] alone) become lazy runs
///   ([`PE_LAZY`] alone). ferry's patched CRIU leaves the pages a
///   migration's destination already holds out of the dump as parent runs;
///   the destination has no parent dump but its page store, and installs
///   them by userfaultfd after the resume.
/// - runs in the pages file and flagged lazy ([`PE_PRESENT`] | [`PE_LAZY`]:
///   CRIU flags every page of an area a lazy restore could fill) lose
///   [`PE_LAZY`]: a lazy restore skips every lazy run, and these, the pages
///   written since the last pre-copy round, are restored from the file as
///   usual.
///
/// No run changes whether it takes room in the pages file, so its offsets
/// do not move. The flags are one-byte varints: the file keeps its size,
/// and only those bytes change. An image with neither kind is left
/// untouched.
pub fn left_out_to_lazy(images_dir: &Path, pid: u32) -> Result<Vec<PageRun>, ImageError> {
    let path = images_dir.join(format!("pagemap-{pid}.img"));
    let mut bytes = image::read(&path)?;
    let page_size = host_page_size();
    // Checks the whole image first, as a restore would read it.
    let map = parse(&path, &bytes, page_size)?;
    let mut edits = Vec::new();
    {
        let framed = image::frame_magic(&path, &bytes, PAGEMAP_MAGIC, PAGEMAP_MAGIC_NAME)?;
        for (entry, run) in framed.entries.iter().skip(1).zip(&map.runs) {
            let new_flags = match run.flags {
                PE_PARENT => PE_LAZY,
                f if f == PE_PRESENT | PE_LAZY => PE_PRESENT,
                _ => continue,
            };
            // The flags field as written: the last occurrence wins, and a
            // run flagged by the pre-3.5 `in_parent` has none to edit.
            let field = Fields::new(entry.payload)
                .filter_map(Result::ok)
                .filter(|f| f.number == FLAGS)
                .last();
            match field {
                Some(f) if f.raw.len() == f.value_offset - f.offset + 1 => {
                    edits.push((entry.payload_offset + f.value_offset, new_flags as u8));
                }
                _ => {
                    return Err(ImageError::BadPagemap {
                        path: path.clone(),
                        offset: entry.payload_offset as u64,
                        problem: PagemapProblem::ContradictoryFlags {
                            vaddr: run.vaddr,
                            flags: run.flags,
                        },
                    });
                }
            }
        }
    }
    if edits.is_empty() {
        return Ok(Vec::new());
    }
    for (at, flags) in &edits {
        bytes[*at] = *flags;
    }
    // Written beside and renamed over: a restore never reads a half-edited
    // pagemap.
    let tmp = images_dir.join(format!(".pagemap-{pid}.img.lazy"));
    fs::write(&tmp, &bytes).map_err(|source| ImageError::Io {
        path: tmp.clone(),
        op: "write",
        source,
    })?;
    fs::rename(&tmp, &path).map_err(|source| ImageError::Io {
        path: path.clone(),
        op: "rename",
        source,
    })?;
    Ok(map
        .runs
        .into_iter()
        .filter(|r| r.flags == PE_PARENT)
        .map(|r| PageRun {
            flags: PE_LAZY,
            ..r
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::super::tests::{entry, head, image, old_entry};
    use super::super::{Pagemap, read_pagemap};
    use super::*;

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
        let path = dir.path().join("pagemap-7.img");
        let before = image(&entries);
        fs::write(&path, &before).unwrap();
        let ps = host_page_size();
        let old = read_pagemap(dir.path(), 7).unwrap();

        let lazy = left_out_to_lazy(dir.path(), 7).unwrap();
        let got: Vec<(u64, u64, u32)> = lazy
            .iter()
            .map(|r| (r.vaddr, r.nr_pages, r.flags))
            .collect();
        assert_eq!(got, [(0x20_0000, 3, PE_LAZY), (0x50_0000, 5, PE_LAZY)]);

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
        assert!(left_out_to_lazy(dir.path(), 7).unwrap().is_empty());
        assert_eq!(fs::read(&path).unwrap(), after);
        assert!(!dir.path().join(".pagemap-7.img.lazy").exists());
    }

    #[test]
    fn a_parent_run_without_a_flags_field_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let entries = [head(3), old_entry(0x10_0000, 2, Some(true))];
        fs::write(dir.path().join("pagemap-8.img"), image(&entries)).unwrap();
        assert!(matches!(
            left_out_to_lazy(dir.path(), 8),
            Err(ImageError::BadPagemap { .. })
        ));
    }
}
