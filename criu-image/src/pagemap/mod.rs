//! Reads `pagemap-<pid>.img`: which pages of a process's private memory a
//! dump holds, and where each page's bytes are in `pages-<id>.img`.
//!
//! A migration's destination splices pages into the pages file by the
//! offsets computed here, so the layout must be exactly the one CRIU's
//! restore reads; whatever could be read two ways is refused instead.
//!
//! # The format (CRIU 4.2.1, read in its source)
//!
//! `images/pagemap.proto`, `criu/pagemap.c` (the reader),
//! `criu/page-xfer.c` (the writer). The image is framed like the others
//! (see `image.rs`), with `PAGEMAP_MAGIC` 0x56084025. Its first entry is a
//! `pagemap_head`, whose field 1 (`pages_id`, uint32) names the pages file,
//! `pages-<pages_id>.img`. Each later entry is a `pagemap_entry`, one run
//! of pages at consecutive addresses:
//!
//! | field | name | type | |
//! |---|---|---|---|
//! | 1 | `vaddr` | uint64, required | the run's first address |
//! | 2 | `compat_nr_pages` | uint32, required | its pages, before 4.2 |
//! | 3 | `in_parent` | bool | before 3.5: the pages are in the parent dump |
//! | 4 | `flags` | uint32 | since 3.5: [`PE_PARENT`], [`PE_LAZY`], [`PE_PRESENT`] |
//! | 5 | `nr_pages` | uint64 | its pages, since 4.2 |
//!
//! **The page count moved in 4.2.** CRIU 4.2 writes the count to field 5
//! and leaves the required field 2 at 0; older CRIU writes field 2 only.
//! Like CRIU's reader (`init_compat_pagemap_entry`), field 5 is used when
//! present, field 2 otherwise. A reader that knows only field 2 finds
//! every run of a 4.2 image empty.
//!
//! **Flags of older images.** The same function turns `in_parent = true`
//! into [`PE_PARENT`] added to the flags, and gives an entry with neither
//! `flags` nor `in_parent = true` the flag [`PE_PRESENT`].
//! [`PageRun::flags`] holds the flags after that step.
//!
//! **Where a run's bytes are.** The pages file is nothing but pages: the
//! writer appends the pages of each run flagged [`PE_PRESENT`], in entry
//! order, and nothing for the other runs, whose pages are in the parent
//! dump (a pre-dump) or left with the source for a lazy restore. So a
//! present run's bytes start where the previous present runs' bytes end;
//! the reader advances its file offset over present runs only
//! (`skip_pagemap_pages`, `maybe_read_page_local`). A run both lazy and
//! present (lazy pages written to the image anyway) is in the file.
//!
//! **Page size.** The image counts pages; CRIU multiplies by its
//! `PAGE_SIZE`, the dumping host's page size (4 KiB on x86_64; 4, 16 or
//! 64 KiB on aarch64 kernels). [`read_pagemap`] uses this host's page
//! size, which is right for images dumped on a host of the same kind.
//!
//! **What is refused**, besides malformed framing or protobuf:
//! - a missing head, or an entry without `vaddr` or `compat_nr_pages`
//!   (CRIU's protobuf reader refuses a missing required field);
//! - a run of zero pages, a `vaddr` not aligned to the page size, a run
//!   whose end does not fit in 64 bits;
//! - runs that are not in ascending address order or that overlap: the
//!   writer walks the address space upwards, and the restore only seeks
//!   forwards, so such an image is damaged;
//! - flag bits CRIU 4.2 does not define (a later flag might change where
//!   pages are), and flags that say both "in the parent" and "present", or
//!   none of present, parent and lazy: CRIU never writes them, and its
//!   reader would take file room for such a run on one path and not on
//!   another.

use std::fmt;
use std::fs;
use std::io;
use std::path::Path;

use crate::error::ImageError;
use crate::image;
use crate::wire::{Field, Fields, WireError};

mod lazy;

pub use lazy::{LeftOut, PARENT_DIR, prepare_left_out, write_parent};

/// The run's pages are in the parent dump's images (an earlier pre-dump),
/// not in this dump's pages file.
pub const PE_PARENT: u32 = 1 << 0;
/// The run's pages may be restored on demand (`--lazy-pages`). Alone, they
/// stayed with the source; with [`PE_PRESENT`], they are in the file too.
pub const PE_LAZY: u32 = 1 << 1;
/// The run's pages are in this dump's pages file.
pub const PE_PRESENT: u32 = 1 << 2;
const KNOWN_FLAGS: u32 = PE_PARENT | PE_LAZY | PE_PRESENT;

const PAGEMAP_MAGIC: u32 = 0x5608_4025;
const PAGEMAP_MAGIC_NAME: &str = "a pagemap (PAGEMAP_MAGIC 0x56084025)";

// Field numbers of pagemap_head and pagemap_entry.
const HEAD_PAGES_ID: u32 = 1;
const VADDR: u32 = 1;
const COMPAT_NR_PAGES: u32 = 2;
const IN_PARENT: u32 = 3;
const FLAGS: u32 = 4;
const NR_PAGES: u32 = 5;

/// One run of pages of a process's private memory, as CRIU 4.x dumps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRun {
    /// The first address, a multiple of the page size.
    pub vaddr: u64,
    /// At least one.
    pub nr_pages: u64,
    /// [`PE_PARENT`], [`PE_LAZY`], [`PE_PRESENT`], with the flags of
    /// images older than CRIU 3.5 made explicit (see the module docs).
    pub flags: u32,
    /// Where the run's bytes start in the pages file, if they are in it
    /// (the run is [`PE_PRESENT`]); its `nr_pages` pages follow there
    /// without gaps.
    pub pages_file_offset: Option<u64>,
}

impl PageRun {
    /// Whether the run's pages are in this dump's pages file.
    pub fn is_present(&self) -> bool {
        self.flags & PE_PRESENT != 0
    }

    /// Whether the run's pages are in the parent dump.
    pub fn in_parent(&self) -> bool {
        self.flags & PE_PARENT != 0
    }

    /// Whether the run's pages may be restored on demand.
    pub fn is_lazy(&self) -> bool {
        self.flags & PE_LAZY != 0
    }
}

/// The pagemap of one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pagemap {
    /// From the image's head; names the pages file.
    pub pages_id: u32,
    /// `pages-<pages_id>.img`, in the same directory as the pagemap.
    pub pages_file: String,
    /// The page size the runs were measured with (this host's, for
    /// [`read_pagemap`]).
    pub page_size: u64,
    /// In ascending, non-overlapping address order.
    pub runs: Vec<PageRun>,
}

impl Pagemap {
    /// The bytes the present runs take in the pages file: the size CRIU's
    /// writer gave it.
    pub fn present_bytes(&self) -> u64 {
        self.runs
            .iter()
            .filter(|r| r.pages_file_offset.is_some())
            .fold(0u64, |sum, r| {
                sum.saturating_add(r.nr_pages.saturating_mul(self.page_size))
            })
    }

    /// The run holding the page of `vaddr`, if any.
    pub fn run_containing(&self, vaddr: u64) -> Option<&PageRun> {
        let after = self.runs.partition_point(|r| r.vaddr <= vaddr);
        let run = self.runs[..after].last()?;
        (vaddr - run.vaddr < run.nr_pages.saturating_mul(self.page_size)).then_some(run)
    }

    /// Where the byte at `vaddr` is in the pages file, if its page is in it.
    pub fn pages_file_offset_of(&self, vaddr: u64) -> Option<u64> {
        let run = self.run_containing(vaddr)?;
        Some(run.pages_file_offset? + (vaddr - run.vaddr))
    }

    /// Checks that the pages file in `images_dir` has exactly the size the
    /// present runs take, and returns that size in bytes. A file of another
    /// size was not written for this pagemap (or was cut short), so its
    /// offsets cannot be trusted for it.
    pub fn check_pages_file(&self, images_dir: &Path) -> Result<u64, ImageError> {
        let path = images_dir.join(&self.pages_file);
        let meta = fs::metadata(&path).map_err(|source| ImageError::Io {
            path: path.clone(),
            op: "stat",
            source,
        })?;
        if !meta.is_file() {
            return Err(ImageError::Io {
                path,
                op: "stat",
                source: io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"),
            });
        }
        let expected = self.present_bytes();
        if meta.len() != expected {
            return Err(ImageError::PagesFileSize {
                path,
                expected,
                found: meta.len(),
            });
        }
        Ok(expected)
    }
}

/// What is wrong with a pagemap image, at an offset kept by the error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PagemapProblem {
    /// The first entry is not a `pagemap_head`; says why.
    MissingHead(&'static str),
    /// A `pagemap_entry` lacks a required field.
    MissingField { field: u32, name: &'static str },
    /// A run of no pages.
    ZeroPages { vaddr: u64 },
    /// A run starting inside a page.
    Unaligned { vaddr: u64, page_size: u64 },
    /// A run whose end is past the 64-bit address space.
    RunOverflows {
        vaddr: u64,
        nr_pages: u64,
        page_size: u64,
    },
    /// A run starting before the end of the previous one.
    OutOfOrder { vaddr: u64, previous_end: u64 },
    /// Flag bits CRIU 4.2 does not define.
    UnknownFlags { flags: u32 },
    /// Flags that do not say where the pages are, or say two places.
    ContradictoryFlags { vaddr: u64, flags: u32 },
    /// A page left out of the dump in no memory area of the process.
    LeftOutOutsideAreas { vaddr: u64 },
}

impl fmt::Display for PagemapProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MissingHead(why) => write!(f, "expected a pagemap_head first: {why}"),
            Self::MissingField { field, name } => {
                write!(f, "pagemap_entry without field {field} ({name})")
            }
            Self::ZeroPages { vaddr } => write!(f, "run at {vaddr:#x} has no pages"),
            Self::Unaligned { vaddr, page_size } => {
                write!(f, "run at {vaddr:#x} is not aligned to {page_size} bytes")
            }
            Self::RunOverflows {
                vaddr,
                nr_pages,
                page_size,
            } => write!(
                f,
                "run at {vaddr:#x} of {nr_pages} pages of {page_size} bytes ends past 2^64"
            ),
            Self::OutOfOrder {
                vaddr,
                previous_end,
            } => write!(
                f,
                "run at {vaddr:#x} starts before the previous run's end {previous_end:#x}"
            ),
            Self::UnknownFlags { flags } => write!(
                f,
                "flags {flags:#x} have bits other than PE_PARENT, PE_LAZY, PE_PRESENT"
            ),
            Self::ContradictoryFlags { vaddr, flags } => write!(
                f,
                "run at {vaddr:#x}: flags {flags:#x} do not say where its pages are \
                 (expected PE_PRESENT or PE_PARENT, not both, or PE_LAZY)"
            ),
            Self::LeftOutOutsideAreas { vaddr } => write!(
                f,
                "page {vaddr:#x} was left out of the dump but is in no memory area of the mm image"
            ),
        }
    }
}

/// Reads `images_dir/pagemap-<pid>.img`, `pid` as CRIU names the file: the
/// task's pid inside its own PID namespace. Runs are measured in this
/// host's page size.
pub fn read_pagemap(images_dir: &Path, pid: u32) -> Result<Pagemap, ImageError> {
    let path = images_dir.join(format!("pagemap-{pid}.img"));
    let bytes = image::read(&path)?;
    parse(&path, &bytes, host_page_size())
}

/// This host's page size, as CRIU's `PAGE_SIZE` has it.
pub(crate) fn host_page_size() -> u64 {
    // SAFETY: sysconf reads a system constant; it has no memory effects.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size)
        .ok()
        .filter(|s| s.is_power_of_two())
        .unwrap_or_else(|| panic!("sysconf(_SC_PAGESIZE) returned {size}"))
}

/// Why an entry cannot be used, at an offset into its message.
#[derive(Debug)]
enum Fault {
    Wire(WireError),
    Pagemap {
        offset: usize,
        problem: PagemapProblem,
    },
}

impl From<WireError> for Fault {
    fn from(e: WireError) -> Self {
        Self::Wire(e)
    }
}

impl Fault {
    fn at(offset: usize, problem: PagemapProblem) -> Self {
        Self::Pagemap { offset, problem }
    }

    /// The error for a fault in the message that starts `base` bytes into
    /// the file at `path`.
    fn into_error(self, path: &Path, base: usize) -> ImageError {
        match self {
            Self::Wire(e) => ImageError::Protobuf {
                path: path.to_owned(),
                offset: (base + e.offset) as u64,
                problem: e.problem,
            },
            Self::Pagemap { offset, problem } => ImageError::BadPagemap {
                path: path.to_owned(),
                offset: (base + offset) as u64,
                problem,
            },
        }
    }
}

/// Parses a whole pagemap image measured in pages of `page_size` bytes (a
/// power of two).
pub(crate) fn parse(path: &Path, bytes: &[u8], page_size: u64) -> Result<Pagemap, ImageError> {
    let framed = image::frame_magic(path, bytes, PAGEMAP_MAGIC, PAGEMAP_MAGIC_NAME)?;
    let Some((head, entries)) = framed.entries.split_first() else {
        return Err(
            Fault::at(0, PagemapProblem::MissingHead("the image has no entries"))
                .into_error(path, framed.header.len()),
        );
    };
    let pages_id = parse_head(head.payload).map_err(|f| f.into_error(path, head.payload_offset))?;
    let mut runs = Vec::with_capacity(entries.len());
    let mut previous_end = 0u64;
    let mut file_offset = 0u64;
    for entry in entries {
        let fault = |f: Fault| f.into_error(path, entry.payload_offset);
        let run = parse_entry(entry.payload, page_size).map_err(fault)?;
        if run.vaddr < previous_end {
            return Err(fault(Fault::at(
                run.vaddr_offset,
                PagemapProblem::OutOfOrder {
                    vaddr: run.vaddr,
                    previous_end,
                },
            )));
        }
        previous_end = run.end;
        let pages_file_offset = if run.flags & PE_PRESENT != 0 {
            let at = file_offset;
            // Cannot overflow: the present runs are disjoint ranges of the
            // 64-bit address space, so their lengths sum to less than 2^64.
            file_offset += run.end - run.vaddr;
            Some(at)
        } else {
            None
        };
        runs.push(PageRun {
            vaddr: run.vaddr,
            nr_pages: run.nr_pages,
            flags: run.flags,
            pages_file_offset,
        });
    }
    Ok(Pagemap {
        pages_id,
        pages_file: format!("pages-{pages_id}.img"),
        page_size,
        runs,
    })
}

/// The `pages_id` of a `pagemap_head`.
fn parse_head(msg: &[u8]) -> Result<u32, Fault> {
    let fields: Vec<Field<'_>> = Fields::new(msg).collect::<Result<_, _>>()?;
    // A head has no field 2; every pagemap_entry has (compat_nr_pages is
    // required), and its vaddr would pass for a pages_id.
    if let Some(f) = fields.iter().find(|f| f.number == COMPAT_NR_PAGES) {
        return Err(Fault::at(
            f.offset,
            PagemapProblem::MissingHead("the first entry has field 2, so it is a pagemap_entry"),
        ));
    }
    // The last occurrence of a scalar wins, as protobuf says.
    match fields.iter().rfind(|f| f.number == HEAD_PAGES_ID) {
        Some(f) => Ok(f.uint32()?),
        None => Err(Fault::at(
            0,
            PagemapProblem::MissingHead("the first entry has no pages_id (field 1)"),
        )),
    }
}

/// One `pagemap_entry`, checked on its own.
#[derive(Debug)]
struct Run {
    vaddr: u64,
    /// Where the vaddr field is in the message.
    vaddr_offset: usize,
    nr_pages: u64,
    /// `vaddr` + the run's bytes.
    end: u64,
    flags: u32,
}

fn parse_entry(msg: &[u8], page_size: u64) -> Result<Run, Fault> {
    let mut vaddr = None;
    let mut compat_nr_pages = None;
    let mut nr_pages = None;
    let mut in_parent = false;
    let mut flags = None;
    // The last occurrence of a scalar wins, as protobuf says. Each value is
    // kept with the offset of its field, for errors.
    for field in Fields::new(msg) {
        let field = field?;
        let at = field.offset;
        match field.number {
            VADDR => vaddr = Some((field.uint64()?, at)),
            COMPAT_NR_PAGES => compat_nr_pages = Some((u64::from(field.uint32()?), at)),
            IN_PARENT => in_parent = field.boolean()?,
            FLAGS => flags = Some((field.uint32()?, at)),
            NR_PAGES => nr_pages = Some((field.uint64()?, at)),
            _ => {}
        }
    }
    let missing = |field, name| Fault::at(0, PagemapProblem::MissingField { field, name });
    let (vaddr, vaddr_offset) = vaddr.ok_or_else(|| missing(VADDR, "vaddr"))?;
    let compat_nr_pages =
        compat_nr_pages.ok_or_else(|| missing(COMPAT_NR_PAGES, "compat_nr_pages"))?;
    let (nr_pages, nr_offset) = nr_pages.unwrap_or(compat_nr_pages);

    let flags_offset = flags.map_or(0, |(_, at)| at);
    let flags = match (flags, in_parent) {
        (Some((f, _)), true) => f | PE_PARENT,
        (Some((f, _)), false) => f,
        (None, true) => PE_PARENT,
        (None, false) => PE_PRESENT,
    };
    if flags & !KNOWN_FLAGS != 0 {
        return Err(Fault::at(
            flags_offset,
            PagemapProblem::UnknownFlags { flags },
        ));
    }
    let present = flags & PE_PRESENT != 0;
    let parent = flags & PE_PARENT != 0;
    if (present && parent) || flags == 0 {
        return Err(Fault::at(
            flags_offset,
            PagemapProblem::ContradictoryFlags { vaddr, flags },
        ));
    }

    if nr_pages == 0 {
        return Err(Fault::at(nr_offset, PagemapProblem::ZeroPages { vaddr }));
    }
    if vaddr % page_size != 0 {
        return Err(Fault::at(
            vaddr_offset,
            PagemapProblem::Unaligned { vaddr, page_size },
        ));
    }
    let end = nr_pages
        .checked_mul(page_size)
        .and_then(|len| vaddr.checked_add(len))
        .ok_or(Fault::at(
            nr_offset,
            PagemapProblem::RunOverflows {
                vaddr,
                nr_pages,
                page_size,
            },
        ))?;
    Ok(Run {
        vaddr,
        vaddr_offset,
        nr_pages,
        end,
        flags,
    })
}

#[cfg(test)]
mod tests;
