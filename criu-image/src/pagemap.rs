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
        }
    }
}

/// Reads `images_dir/pagemap-<pid>.img`, `pid` as CRIU names the file: the
/// task's pid inside its own PID namespace. Runs are measured in this
/// host's page size.
pub fn read_pagemap(images_dir: &Path, pid: u32) -> Result<Pagemap, ImageError> {
    let path = images_dir.join(format!("pagemap-{pid}.img"));
    let bytes = fs::read(&path).map_err(|source| ImageError::Io {
        path: path.clone(),
        op: "read",
        source,
    })?;
    parse(&path, &bytes, host_page_size())
}

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
    let mut bytes = fs::read(&path).map_err(|source| ImageError::Io {
        path: path.clone(),
        op: "read",
        source,
    })?;
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
mod tests {
    use super::*;
    use crate::image::{FILES, IMG_COMMON_MAGIC};
    use crate::wire::{WireProblem, encode_len, encode_varint};

    const PS: u64 = 4096;

    /// A protobuf message under construction.
    #[derive(Default)]
    struct Msg(Vec<u8>);

    impl Msg {
        fn varint(mut self, field: u32, v: u64) -> Self {
            encode_varint(u64::from(field) << 3, &mut self.0);
            encode_varint(v, &mut self.0);
            self
        }
        fn bytes(mut self, field: u32, b: &[u8]) -> Self {
            encode_varint(u64::from(field) << 3 | 2, &mut self.0);
            encode_len(b, &mut self.0);
            self
        }
    }

    fn head(pages_id: u32) -> Vec<u8> {
        Msg::default().varint(1, u64::from(pages_id)).0
    }

    /// An entry as CRIU 4.2 writes it: field 2 left at 0, the count in 5.
    fn entry(vaddr: u64, nr_pages: u64, flags: u32) -> Vec<u8> {
        Msg::default()
            .varint(1, vaddr)
            .varint(2, 0)
            .varint(4, u64::from(flags))
            .varint(5, nr_pages)
            .0
    }

    /// An entry as CRIU before 3.5 wrote it: no flags, maybe in_parent.
    fn old_entry(vaddr: u64, nr_pages: u32, in_parent: Option<bool>) -> Vec<u8> {
        let m = Msg::default()
            .varint(1, vaddr)
            .varint(2, u64::from(nr_pages));
        match in_parent {
            Some(p) => m.varint(3, u64::from(p)).0,
            None => m.0,
        }
    }

    fn image(entries: &[Vec<u8>]) -> Vec<u8> {
        let mut b = IMG_COMMON_MAGIC.to_ne_bytes().to_vec();
        b.extend(PAGEMAP_MAGIC.to_ne_bytes());
        for e in entries {
            b.extend((e.len() as u32).to_ne_bytes());
            b.extend(e);
        }
        b
    }

    /// Where entry `i` (0 is the head) of `image(entries)` starts its
    /// payload.
    fn payload_offset(entries: &[Vec<u8>], i: usize) -> u64 {
        (8 + entries[..i].iter().map(|e| 4 + e.len()).sum::<usize>() + 4) as u64
    }

    fn parse_with(bytes: &[u8], page_size: u64) -> Result<Pagemap, ImageError> {
        parse(Path::new("pagemap-1.img"), bytes, page_size)
    }

    fn parse_ok(entries: &[Vec<u8>]) -> Pagemap {
        parse_with(&image(entries), PS).unwrap()
    }

    /// The problem and file offset of a pagemap error.
    fn problem(entries: &[Vec<u8>]) -> (PagemapProblem, u64) {
        match parse_with(&image(entries), PS) {
            Err(ImageError::BadPagemap {
                problem, offset, ..
            }) => (problem, offset),
            other => panic!("expected a pagemap error, got {other:?}"),
        }
    }

    fn run(vaddr: u64, nr_pages: u64, flags: u32, off: Option<u64>) -> PageRun {
        PageRun {
            vaddr,
            nr_pages,
            flags,
            pages_file_offset: off,
        }
    }

    /// Every kind of run CRIU 4.2 writes, with an adjacent pair and a field
    /// this module does not know.
    fn mixed() -> Vec<Vec<u8>> {
        let mut last = entry(0x7ffd_0000_0000, 1, PE_PRESENT);
        last.extend(Msg::default().varint(99, 7).bytes(100, b"future").0);
        vec![
            head(7),
            entry(0x40_0000, 3, PE_PRESENT),
            entry(0x40_3000, 2, PE_PARENT),
            entry(0x50_0000, 1, PE_LAZY),
            entry(0x60_0000, 2, PE_LAZY | PE_PRESENT),
            last,
        ]
    }

    #[test]
    fn present_runs_are_laid_out_back_to_back() {
        let pm = parse_ok(&mixed());
        assert_eq!(pm.pages_id, 7);
        assert_eq!(pm.pages_file, "pages-7.img");
        assert_eq!(pm.page_size, PS);
        assert_eq!(
            pm.runs,
            [
                run(0x40_0000, 3, PE_PRESENT, Some(0)),
                run(0x40_3000, 2, PE_PARENT, None),
                run(0x50_0000, 1, PE_LAZY, None),
                run(0x60_0000, 2, PE_LAZY | PE_PRESENT, Some(3 * PS)),
                run(0x7ffd_0000_0000, 1, PE_PRESENT, Some(5 * PS)),
            ]
        );
        assert_eq!(pm.present_bytes(), 6 * PS);
        assert!(pm.runs[3].is_present() && pm.runs[3].is_lazy());
        assert!(pm.runs[1].in_parent() && !pm.runs[1].is_present());
    }

    #[test]
    fn finds_the_run_and_offset_of_an_address() {
        let pm = parse_ok(&mixed());
        assert_eq!(pm.run_containing(0x3f_ffff), None);
        assert_eq!(pm.run_containing(0x40_0000).unwrap().vaddr, 0x40_0000);
        assert_eq!(pm.run_containing(0x40_2fff).unwrap().vaddr, 0x40_0000);
        assert_eq!(pm.run_containing(0x40_3000).unwrap().vaddr, 0x40_3000);
        assert_eq!(pm.run_containing(0x40_5000), None);
        assert_eq!(pm.run_containing(u64::MAX), None);
        assert_eq!(pm.pages_file_offset_of(0x40_2fff), Some(3 * PS - 1));
        assert_eq!(pm.pages_file_offset_of(0x40_3000), None);
        assert_eq!(pm.pages_file_offset_of(0x50_0000), None);
        assert_eq!(pm.pages_file_offset_of(0x60_1005), Some(4 * PS + 5));
        assert_eq!(pm.pages_file_offset_of(0x7ffd_0000_0fff), Some(6 * PS - 1));
        assert_eq!(pm.pages_file_offset_of(0x7ffd_0000_1000), None);
    }

    #[test]
    fn offsets_scale_with_the_page_size() {
        let entries = [
            head(1),
            entry(0x40_0000, 3, PE_PRESENT),
            entry(0x40_c000, 2, PE_PARENT),
            entry(0x60_0000, 2, PE_LAZY | PE_PRESENT),
        ];
        let pm = parse_with(&image(&entries), 16384).unwrap();
        let offsets: Vec<_> = pm.runs.iter().map(|r| r.pages_file_offset).collect();
        assert_eq!(offsets, [Some(0), None, Some(3 * 16384)]);
        assert_eq!(pm.present_bytes(), 5 * 16384);
        assert_eq!(pm.pages_file_offset_of(0x60_4001), Some(4 * 16384 + 1));
        // 0x40_3000 is not a 16 KiB boundary.
        let entries = [head(1), entry(0x40_3000, 1, PE_PRESENT)];
        assert!(matches!(
            parse_with(&image(&entries), 16384),
            Err(ImageError::BadPagemap {
                problem: PagemapProblem::Unaligned {
                    page_size: 16384,
                    ..
                },
                ..
            })
        ));
    }

    #[test]
    fn field_5_counts_when_present_field_2_otherwise() {
        let both = Msg::default()
            .varint(1, 0x1000)
            .varint(2, 9)
            .varint(4, u64::from(PE_PRESENT))
            .varint(5, 2)
            .0;
        let only_2 = Msg::default()
            .varint(1, 0x3000)
            .varint(2, 4)
            .varint(4, u64::from(PE_PRESENT))
            .0;
        let pm = parse_ok(&[head(1), both, only_2]);
        assert_eq!(
            pm.runs,
            [
                run(0x1000, 2, PE_PRESENT, Some(0)),
                run(0x3000, 4, PE_PRESENT, Some(2 * PS)),
            ]
        );
    }

    #[test]
    fn old_images_take_their_flags_from_in_parent() {
        let lazy_in_parent = Msg::default()
            .varint(1, 0x9000)
            .varint(2, 1)
            .varint(3, 1)
            .varint(4, u64::from(PE_LAZY))
            .0;
        let pm = parse_ok(&[
            head(3),
            old_entry(0x1000, 2, None),
            old_entry(0x3000, 1, Some(true)),
            old_entry(0x4000, 3, Some(false)),
            lazy_in_parent,
            old_entry(0xa000, 1, None),
        ]);
        assert_eq!(
            pm.runs,
            [
                run(0x1000, 2, PE_PRESENT, Some(0)),
                run(0x3000, 1, PE_PARENT, None),
                run(0x4000, 3, PE_PRESENT, Some(2 * PS)),
                run(0x9000, 1, PE_PARENT | PE_LAZY, None),
                run(0xa000, 1, PE_PRESENT, Some(5 * PS)),
            ]
        );
        assert_eq!(pm.present_bytes(), 6 * PS);
    }

    #[test]
    fn a_head_alone_is_an_empty_pagemap() {
        let pm = parse_ok(&[head(2)]);
        assert!(pm.runs.is_empty());
        assert_eq!(pm.present_bytes(), 0);
    }

    #[test]
    fn reads_the_file_of_a_pid_in_host_pages() {
        let dir = tempfile::tempdir().unwrap();
        let entries = [
            head(5),
            old_entry(0, 2, None),
            old_entry(0x10_0000, 1, None),
        ];
        fs::write(dir.path().join("pagemap-42.img"), image(&entries)).unwrap();
        let pm = read_pagemap(dir.path(), 42).unwrap();
        let ps = pm.page_size;
        assert!(ps.is_power_of_two() && ps >= 4096);
        assert_eq!(pm.runs[1].pages_file_offset, Some(2 * ps));
        assert!(matches!(
            read_pagemap(dir.path(), 43),
            Err(ImageError::Io { op: "read", source, .. }) if source.kind() == io::ErrorKind::NotFound
        ));
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

    #[test]
    fn checks_the_pages_file_size() {
        let dir = tempfile::tempdir().unwrap();
        let pm = parse_ok(&mixed());
        let pages = dir.path().join("pages-7.img");
        assert!(matches!(
            pm.check_pages_file(dir.path()),
            Err(ImageError::Io { op: "stat", source, .. }) if source.kind() == io::ErrorKind::NotFound
        ));
        fs::write(&pages, vec![0u8; 6 * PS as usize]).unwrap();
        assert_eq!(pm.check_pages_file(dir.path()).unwrap(), 6 * PS);
        for len in [6 * PS - 1, 6 * PS + 1, 5 * PS, 7 * PS, 0] {
            fs::write(&pages, vec![0u8; len as usize]).unwrap();
            match pm.check_pages_file(dir.path()) {
                Err(ImageError::PagesFileSize {
                    path,
                    expected,
                    found,
                }) => {
                    assert_eq!((path, expected, found), (pages.clone(), 6 * PS, len));
                }
                other => panic!("{len} bytes: {other:?}"),
            }
        }
    }

    #[test]
    fn rejects_another_magic_and_truncation() {
        let mut b = image(&mixed());
        b[4..8].copy_from_slice(&FILES.magic.to_ne_bytes());
        assert!(matches!(
            parse_with(&b, PS),
            Err(ImageError::BadMagic { offset: 4, .. })
        ));

        let entries = mixed();
        let full = image(&entries);
        assert!(matches!(
            parse_with(&full[..6], PS),
            Err(ImageError::Truncated { offset: 4, .. })
        ));
        // Cut inside the last entry: its size word promises more.
        let last = payload_offset(&entries, entries.len() - 1);
        assert!(matches!(
            parse_with(&full[..full.len() - 1], PS),
            Err(ImageError::Truncated { offset, .. }) if offset == last
        ));
        // Cut inside a size word.
        assert!(matches!(
            parse_with(&full[..last as usize - 2], PS),
            Err(ImageError::Truncated { offset, .. }) if offset == last - 4
        ));
        // Cut between entries: the framing cannot tell, the pages file can.
        let short = parse_with(&full[..last as usize - 4], PS).unwrap();
        assert_eq!(short.runs.len(), 4);
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("pages-7.img"), vec![0u8; 6 * PS as usize]).unwrap();
        assert!(matches!(
            short.check_pages_file(dir.path()),
            Err(ImageError::PagesFileSize { expected, found, .. })
                if expected == 5 * PS && found == 6 * PS
        ));
    }

    #[test]
    fn rejects_a_missing_head() {
        assert_eq!(
            problem(&[]),
            (PagemapProblem::MissingHead("the image has no entries"), 8)
        );
        let entries = [entry(0x1000, 1, PE_PRESENT), entry(0x2000, 1, PE_PRESENT)];
        let (p, offset) = problem(&entries);
        assert!(matches!(p, PagemapProblem::MissingHead(_)), "{p}");
        // The tag of field 2, after the three-byte vaddr field.
        assert_eq!(offset, payload_offset(&entries, 0) + 3);
        let (p, offset) = problem(&[Msg::default().varint(9, 1).0]);
        assert!(matches!(p, PagemapProblem::MissingHead(_)), "{p}");
        assert_eq!(offset, 12);
        // A vaddr above 4 GiB does not pass for a pages_id either way.
        let entries = [Msg::default().varint(1, 0x7f00_0000_0000).0];
        assert!(matches!(
            parse_with(&image(&entries), PS),
            Err(ImageError::Protobuf {
                problem: WireProblem::Uint32OutOfRange { field: 1, .. },
                ..
            })
        ));
    }

    #[test]
    fn rejects_runs_out_of_order() {
        // Overlapping by one page.
        let entries = [
            head(1),
            entry(0x1000, 2, PE_PRESENT),
            entry(0x2000, 1, PE_PRESENT),
        ];
        assert_eq!(
            problem(&entries),
            (
                PagemapProblem::OutOfOrder {
                    vaddr: 0x2000,
                    previous_end: 0x3000
                },
                payload_offset(&entries, 2)
            )
        );
        // Descending.
        let entries = [
            head(1),
            entry(0x5000, 1, PE_PARENT),
            entry(0x1000, 1, PE_PRESENT),
        ];
        assert!(matches!(
            problem(&entries).0,
            PagemapProblem::OutOfOrder {
                vaddr: 0x1000,
                previous_end: 0x6000
            }
        ));
        // The same run twice.
        let entries = [
            head(1),
            entry(0x5000, 1, PE_PRESENT),
            entry(0x5000, 1, PE_PRESENT),
        ];
        assert!(matches!(
            problem(&entries).0,
            PagemapProblem::OutOfOrder { .. }
        ));
    }

    #[test]
    fn rejects_runs_of_zero_pages() {
        let entries = [head(1), entry(0x1000, 0, PE_PRESENT)];
        // The tag of field 5: vaddr (3 bytes), field 2 (2), flags (2).
        assert_eq!(
            problem(&entries),
            (
                PagemapProblem::ZeroPages { vaddr: 0x1000 },
                payload_offset(&entries, 1) + 7
            )
        );
        let entries = [head(1), old_entry(0x1000, 0, None)];
        assert_eq!(
            problem(&entries),
            (
                PagemapProblem::ZeroPages { vaddr: 0x1000 },
                payload_offset(&entries, 1) + 3
            )
        );
    }

    #[test]
    fn rejects_unaligned_and_overflowing_runs() {
        let entries = [head(1), entry(0x1001, 1, PE_PRESENT)];
        assert_eq!(
            problem(&entries),
            (
                PagemapProblem::Unaligned {
                    vaddr: 0x1001,
                    page_size: PS
                },
                payload_offset(&entries, 1)
            )
        );
        let top = u64::MAX - (PS - 1);
        for (vaddr, nr_pages) in [(0x1000, u64::MAX), (0x1000, u64::MAX / PS), (top, 1)] {
            let (p, _) = problem(&[head(1), entry(vaddr, nr_pages, PE_PRESENT)]);
            assert!(matches!(p, PagemapProblem::RunOverflows { .. }), "{p}");
        }
        // The last page below 2^64 but one is fine.
        let pm = parse_ok(&[head(1), entry(top - PS, 1, PE_PRESENT)]);
        assert_eq!(pm.runs[0].pages_file_offset, Some(0));
    }

    #[test]
    fn rejects_missing_required_fields() {
        let no_vaddr = Msg::default().varint(2, 1).0;
        assert_eq!(
            problem(&[head(1), no_vaddr]).0,
            PagemapProblem::MissingField {
                field: 1,
                name: "vaddr"
            }
        );
        // CRIU 4.2's reader still requires field 2 next to field 5.
        let no_compat = Msg::default().varint(1, 0x1000).varint(5, 1).0;
        assert_eq!(
            problem(&[head(1), no_compat]).0,
            PagemapProblem::MissingField {
                field: 2,
                name: "compat_nr_pages"
            }
        );
    }

    #[test]
    fn rejects_flags_without_one_meaning() {
        for (flags, ok) in [
            (PE_PRESENT, true),
            (PE_PARENT, true),
            (PE_LAZY, true),
            (PE_LAZY | PE_PRESENT, true),
            (PE_LAZY | PE_PARENT, true),
            (0, false),
            (PE_PARENT | PE_PRESENT, false),
            (PE_PARENT | PE_PRESENT | PE_LAZY, false),
        ] {
            let r = parse_with(&image(&[head(1), entry(0x1000, 1, flags)]), PS);
            assert_eq!(r.is_ok(), ok, "flags {flags:#x}: {r:?}");
            if !ok {
                assert!(matches!(
                    r,
                    Err(ImageError::BadPagemap {
                        problem: PagemapProblem::ContradictoryFlags { .. },
                        ..
                    })
                ));
            }
        }
        let (p, _) = problem(&[head(1), entry(0x1000, 1, PE_PRESENT | 8)]);
        assert_eq!(p, PagemapProblem::UnknownFlags { flags: 12 });
        // in_parent and PE_PRESENT together.
        let both = Msg::default()
            .varint(1, 0x1000)
            .varint(2, 1)
            .varint(3, 1)
            .varint(4, u64::from(PE_PRESENT))
            .0;
        let (p, _) = problem(&[head(1), both]);
        assert_eq!(
            p,
            PagemapProblem::ContradictoryFlags {
                vaddr: 0x1000,
                flags: PE_PARENT | PE_PRESENT
            }
        );
    }

    #[test]
    fn rejects_fields_of_the_wrong_type_or_range() {
        let bytes_vaddr = Msg::default().bytes(1, b"x").varint(2, 1).0;
        assert!(matches!(
            parse_with(&image(&[head(1), bytes_vaddr]), PS),
            Err(ImageError::Protobuf {
                problem: WireProblem::WrongWireType { field: 1, .. },
                ..
            })
        ));
        let big_compat = Msg::default().varint(1, 0).varint(2, 1 << 32).0;
        let entries = [head(1), big_compat];
        assert!(matches!(
            parse_with(&image(&entries), PS),
            Err(ImageError::Protobuf {
                problem: WireProblem::Uint32OutOfRange { field: 2, .. },
                offset,
                ..
            }) if offset == payload_offset(&entries, 1) + 3
        ));
    }

    #[test]
    fn garbage_never_panics() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for len in 0..300 {
            let entries: Vec<Vec<u8>> = (0..len % 7)
                .map(|_| (0..next() % 24).map(|_| next() as u8).collect())
                .collect();
            let _ = parse_with(&image(&entries), PS);
            let mut raw = image(&[]);
            raw.extend((0..len).map(|_| next() as u8));
            let _ = parse_with(&raw, PS);
        }
    }
}
