//! The destination's store of pre-copied pages: one sparse file per
//! process in the work directory, each page at the offset of its address,
//! and the set of pages that arrived. A later round's copy of a page lands
//! on the earlier one, so the store never holds two copies of a page.
//!
//! Addresses reach 2^47 (2^56 with 5-level tables), beyond the largest file
//! of some file systems (ext4: 16 TiB) but not of tmpfs, where ferry's work
//! directory lives; a work directory that cannot hold such a file gets an
//! anonymous in-memory file (memfd) instead, with the same layout.
//!
//! With the address as the offset, the pages of a memory area lie together
//! in the file as in the process: the destination's page filler
//! ([`crate::fill`]) maps a window of the file per area and installs the
//! pages from it by userfaultfd after the resume, with no copy in the
//! freeze; and the pages image of an older peer's restore (`StoredPages`
//! pieces) is cut out of the file in large in-kernel copies.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use ferry_proto::v1::{PageBatch, StoredPages};

use super::EngineError;
use crate::memtrack::{self, RangeSet};

/// Addresses above this are no user-space address on any x86_64 or
/// aarch64 paging mode (57-bit with 5-level tables). The size of every
/// store file.
pub const USER_ADDRESS_LIMIT: u64 = 1 << 57;

/// One process's pages.
#[derive(Debug)]
struct Stored {
    /// Sparse, [`USER_ADDRESS_LIMIT`] bytes: a page at its address.
    file: File,
    /// The pages that arrived.
    held: RangeSet,
}

#[derive(Debug)]
pub struct PageStore {
    dir: PathBuf,
    processes: HashMap<u32, Stored>,
    /// Pages and bytes received, counting a page each time it came.
    pub pages: u64,
    pub bytes: u64,
}

/// A store file for process `pid`: in `dir` if its file system takes a
/// file of [`USER_ADDRESS_LIMIT`] bytes, an anonymous in-memory one if not.
fn create_file(dir: &Path, pid: u32) -> Result<File, EngineError> {
    std::fs::create_dir_all(dir).map_err(EngineError::io(format!("creating {}", dir.display())))?;
    let path = dir.join(format!("memory-{pid}"));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .map_err(EngineError::io(format!("creating {}", path.display())))?;
    match file.set_len(USER_ADDRESS_LIMIT) {
        Ok(()) => Ok(file),
        Err(e)
            if e.raw_os_error() == Some(libc::EFBIG) || e.raw_os_error() == Some(libc::EINVAL) =>
        {
            let _ = std::fs::remove_file(&path);
            tracing::warn!(dir = %dir.display(), "the work directory cannot hold sparse files of 2^57 bytes (not tmpfs?): pre-copied pages go to an in-memory file");
            // SAFETY: memfd_create reads a NUL-terminated name and returns
            // a new descriptor or -1; nothing else is touched.
            let raw = unsafe { libc::memfd_create(c"ferry-pages".as_ptr(), libc::MFD_CLOEXEC) };
            if raw < 0 {
                return Err(EngineError::io("creating an in-memory page store")(
                    std::io::Error::last_os_error(),
                ));
            }
            // SAFETY: `raw` is a descriptor just returned to us, owned by
            // nothing else.
            let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(raw) };
            file.set_len(USER_ADDRESS_LIMIT)
                .map_err(EngineError::io("sizing the in-memory page store"))?;
            Ok(file)
        }
        Err(e) => Err(EngineError::io(format!("sizing {}", path.display()))(e)),
    }
}

impl PageStore {
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
            processes: HashMap::new(),
            pages: 0,
            bytes: 0,
        }
    }

    fn process(&mut self, pid: u32) -> Result<&mut Stored, EngineError> {
        if !self.processes.contains_key(&pid) {
            let file = create_file(&self.dir, pid)?;
            self.processes.insert(
                pid,
                Stored {
                    file,
                    held: RangeSet::new(),
                },
            );
        }
        Ok(self.processes.get_mut(&pid).expect("inserted above"))
    }

    /// Bytes of the distinct pages that arrived (a page sent again in a
    /// later round counts once: the store holds one copy of each).
    pub fn held_bytes(&self) -> u64 {
        self.processes.values().map(|s| s.held.len()).sum()
    }

    /// Stores a batch of pages, each field checked.
    pub fn write(&mut self, batch: &PageBatch) -> Result<(), EngineError> {
        let page = memtrack::page_size();
        for (i, run) in batch.runs.iter().enumerate() {
            let bad = |field: &'static str, reason: String| EngineError::InvalidField {
                field,
                reason: format!("runs[{i}]: {reason}"),
            };
            if run.pid == 0 {
                return Err(bad("runs.pid", "0 is no process".into()));
            }
            let unpacked;
            let data: &[u8] = if run.lz4.is_empty() {
                &run.data
            } else if !run.data.is_empty() {
                return Err(bad("runs.lz4", "set beside runs.data".into()));
            } else {
                unpacked = super::compression::unpack(&run.lz4, run.lz4_length)
                    .map_err(|why| bad("runs.lz4", why))?;
                &unpacked
            };
            let len = data.len() as u64;
            if len == 0 || !len.is_multiple_of(page) {
                return Err(bad(
                    "runs.data",
                    format!("{len} bytes is not a whole number of {page}-byte pages"),
                ));
            }
            if run.vaddr % page != 0 {
                return Err(bad(
                    "runs.vaddr",
                    format!("{:#x} is not page-aligned", run.vaddr),
                ));
            }
            let end = run
                .vaddr
                .checked_add(len)
                .filter(|e| *e <= USER_ADDRESS_LIMIT)
                .ok_or_else(|| {
                    bad(
                        "runs.vaddr",
                        format!("{:#x} + {len} bytes is beyond user space", run.vaddr),
                    )
                })?;
            let stored = self.process(run.pid)?;
            stored
                .file
                .write_all_at(data, run.vaddr)
                .map_err(|e| match e.raw_os_error() {
                    Some(libc::ENOSPC) => EngineError::Io {
                        what: "storing pre-copied pages (the work directory is full)".into(),
                        source: e,
                    },
                    _ => EngineError::io("storing pre-copied pages")(e),
                })?;
            stored.held.insert(run.vaddr, end);
            self.pages += len / page;
            self.bytes += len;
        }
        Ok(())
    }

    /// The first page of `stored` that never arrived, if any (a range
    /// beyond the address space or not in whole pages is all missing).
    pub fn first_missing(&self, stored: &StoredPages) -> Option<u64> {
        let page = memtrack::page_size();
        let Some(st) = self.processes.get(&stored.pid) else {
            return Some(stored.vaddr);
        };
        if !stored.vaddr.is_multiple_of(page) || !stored.length.is_multiple_of(page) {
            return Some(stored.vaddr);
        }
        // A range past 2^64 was never stored (`?` here once answered "none
        // missing" for it, and Restore then overflowed adding it up).
        let Some(end) = stored.vaddr.checked_add(stored.length) else {
            return Some(stored.vaddr);
        };
        st.held
            .split(stored.vaddr, end)
            .into_iter()
            .find(|(_, _, held)| !held)
            .map(|(s, _, _)| s)
    }

    /// The store file of process `pid`, made empty if none is yet (pages
    /// that follow the resume arrive into it).
    pub fn open(&mut self, pid: u32) -> Result<&File, EngineError> {
        Ok(&self.process(pid)?.file)
    }

    /// The store file of process `pid`, if any page of it arrived: a page
    /// at the offset of its address.
    pub fn file(&self, pid: u32) -> Option<&File> {
        self.processes.get(&pid).map(|st| &st.file)
    }

    /// `len` bytes of process `pid`'s pages from `vaddr`, from the store;
    /// refuses a range of which any page never arrived. Blocking.
    pub fn read(&self, pid: u32, vaddr: u64, len: u64) -> Result<Vec<u8>, EngineError> {
        let wanted = StoredPages {
            pid,
            vaddr,
            length: len,
        };
        if let Some(addr) = self.first_missing(&wanted) {
            return Err(EngineError::PageStore(format!(
                "pages of pid {pid} at {vaddr:#x}+{len}: page {addr:#x} is not in the store"
            )));
        }
        let st = &self.processes[&pid];
        let mut out = vec![0u8; len as usize];
        st.file
            .read_exact_at(&mut out, vaddr)
            .map_err(EngineError::io("reading pre-copied pages"))?;
        Ok(out)
    }

    /// Appends `stored` to `out`, from the store; refuses a range of which
    /// any page never arrived.
    pub fn copy_out(&self, stored: &StoredPages, out: &mut File) -> Result<(), EngineError> {
        let missing = |what: String| {
            EngineError::BadImage(format!(
                "stored pages of pid {} at {:#x}+{}: {what}",
                stored.pid, stored.vaddr, stored.length
            ))
        };
        let Some(st) = self.processes.get(&stored.pid) else {
            return Err(missing("none of this process were pre-copied".into()));
        };
        // Every page first: nothing is written for a range that fails.
        if let Some(addr) = self.first_missing(stored) {
            return Err(missing(format!("page {addr:#x} was never pre-copied")));
        }
        // One in-kernel copy (copy_file_range), not through a buffer here:
        // with an older peer this copies most of the process's memory in
        // the freeze.
        copy_range(&st.file, stored.vaddr, out, stored.length)
    }
}

/// Appends `len` bytes of `from` at `offset` to `to` (at its position):
/// in the kernel (copy_file_range) where both files allow it, through a
/// buffer otherwise (an in-memory store and a file elsewhere: `EXDEV`).
fn copy_range(from: &File, mut offset: u64, to: &mut File, len: u64) -> Result<(), EngineError> {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let mut left = len;
    while left > 0 {
        let mut off_in = offset as libc::loff_t;
        // SAFETY: two open descriptors; `off_in` is a valid loff_t the
        // kernel updates; a null out-offset means `to`'s own position.
        let n = unsafe {
            libc::copy_file_range(
                from.as_raw_fd(),
                &mut off_in,
                to.as_raw_fd(),
                std::ptr::null_mut(),
                left as usize,
                0,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if matches!(
                e.raw_os_error(),
                Some(libc::EXDEV | libc::EINVAL | libc::EOPNOTSUPP)
            ) {
                break;
            }
            return Err(EngineError::io("copying pre-copied pages")(e));
        }
        if n == 0 {
            return Err(EngineError::PageStore(format!(
                "pre-copied pages end early at {offset}"
            )));
        }
        offset += n as u64;
        left -= n as u64;
    }
    let mut buf = vec![0u8; (left as usize).min(1 << 20)];
    while left > 0 {
        let n = (left as usize).min(buf.len());
        from.read_exact_at(&mut buf[..n], offset)
            .map_err(EngineError::io("reading pre-copied pages"))?;
        to.write_all(&buf[..n])
            .map_err(EngineError::io("copying pre-copied pages"))?;
        offset += n as u64;
        left -= n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_proto::v1::PageRun;

    fn batch(runs: Vec<PageRun>) -> PageBatch {
        PageBatch {
            migration_id: "m".into(),
            round: 1,
            runs,
        }
    }

    #[test]
    fn later_rounds_overwrite_and_copy_out_checks_every_page() {
        let p = memtrack::page_size();
        let dir = tempfile::tempdir().unwrap();
        let mut s = PageStore::new(&dir.path().join("pre"));
        let base = 0x7f00_0000_0000u64;
        s.write(&batch(vec![PageRun {
            pid: 1,
            vaddr: base,
            data: vec![1u8; 3 * p as usize].into(),
            ..Default::default()
        }]))
        .unwrap();
        s.write(&batch(vec![PageRun {
            pid: 1,
            vaddr: base + p,
            data: vec![2u8; p as usize].into(),
            ..Default::default()
        }]))
        .unwrap();
        let out_path = dir.path().join("pages-1.img");
        let mut out = File::create(&out_path).unwrap();
        s.copy_out(
            &StoredPages {
                pid: 1,
                vaddr: base,
                length: 3 * p,
            },
            &mut out,
        )
        .unwrap();
        let got = std::fs::read(&out_path).unwrap();
        let mut want = vec![1u8; 3 * p as usize];
        want[p as usize..2 * p as usize].fill(2);
        assert_eq!(got, want);
        // One page too far, another process, nothing at all.
        for bad in [
            StoredPages {
                pid: 1,
                vaddr: base,
                length: 4 * p,
            },
            StoredPages {
                pid: 2,
                vaddr: base,
                length: p,
            },
            StoredPages {
                pid: 1,
                vaddr: u64::MAX - 10,
                length: p,
            },
        ] {
            assert!(
                matches!(s.copy_out(&bad, &mut out), Err(EngineError::BadImage(_))),
                "{bad:?}"
            );
        }
    }

    /// Found writing the `peer_protocol` fuzz target: a Restore naming pages
    /// from a stored one to past 2^64 as held here passed the check, then
    /// overflowed.
    #[test]
    fn a_range_past_the_address_space_is_missing() {
        let p = memtrack::page_size();
        let dir = tempfile::tempdir().unwrap();
        let mut s = PageStore::new(dir.path());
        let base = 0x40_0000;
        s.write(&batch(vec![PageRun {
            pid: 1,
            vaddr: base,
            data: vec![7; p as usize].into(),
            ..Default::default()
        }]))
        .unwrap();
        let past = StoredPages {
            pid: 1,
            vaddr: base,
            length: u64::MAX - (p - 1),
        };
        assert_eq!(s.first_missing(&past), Some(base));
        let mut out = tempfile::tempfile().unwrap();
        assert!(s.copy_out(&past, &mut out).is_err());
    }

    #[test]
    fn compressed_runs_are_stored_as_they_were_before_compression() {
        let p = memtrack::page_size();
        let dir = tempfile::tempdir().unwrap();
        let mut s = PageStore::new(dir.path());
        let base = 0x7f00_0000_0000u64;
        let mut pages = vec![0u8; 4 * p as usize];
        pages[..12].copy_from_slice(b"value:123456");
        pages[3 * p as usize] = 9;
        s.write(&batch(vec![PageRun {
            pid: 1,
            vaddr: base,
            lz4: crate::engine::compression::pack(&pages).unwrap(),
            lz4_length: 4 * p,
            ..Default::default()
        }]))
        .unwrap();
        assert_eq!(s.pages, 4);
        assert_eq!(s.read(1, base, 4 * p).unwrap(), pages);
    }

    #[test]
    fn refuses_malformed_runs_naming_the_field() {
        let p = memtrack::page_size();
        let dir = tempfile::tempdir().unwrap();
        let mut s = PageStore::new(dir.path());
        for (run, field) in [
            (
                PageRun {
                    pid: 0,
                    vaddr: 0,
                    data: vec![0; p as usize].into(),
                    ..Default::default()
                },
                "runs.pid",
            ),
            (
                PageRun {
                    pid: 1,
                    vaddr: 1,
                    data: vec![0; p as usize].into(),
                    ..Default::default()
                },
                "runs.vaddr",
            ),
            (
                PageRun {
                    pid: 1,
                    vaddr: 0,
                    data: vec![0; 10].into(),
                    ..Default::default()
                },
                "runs.data",
            ),
            (
                PageRun {
                    pid: 1,
                    vaddr: 0,
                    data: vec![].into(),
                    ..Default::default()
                },
                "runs.data",
            ),
            (
                PageRun {
                    pid: 1,
                    vaddr: USER_ADDRESS_LIMIT,
                    data: vec![0; p as usize].into(),
                    ..Default::default()
                },
                "runs.vaddr",
            ),
            (
                PageRun {
                    pid: 1,
                    data: vec![0; p as usize].into(),
                    lz4: crate::engine::compression::pack(&vec![0; p as usize]).unwrap(),
                    lz4_length: p,
                    ..Default::default()
                },
                "runs.lz4",
            ),
            (
                PageRun {
                    pid: 1,
                    lz4: vec![0xf0, 1, 2],
                    lz4_length: p,
                    ..Default::default()
                },
                "runs.lz4",
            ),
            (
                PageRun {
                    pid: 1,
                    lz4: crate::engine::compression::pack(&vec![0; 10 * p as usize]).unwrap(),
                    lz4_length: 10 * p + 1,
                    ..Default::default()
                },
                "runs.lz4",
            ),
        ] {
            match s.write(&batch(vec![run])) {
                Err(EngineError::InvalidField { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(s.pages, 0);
    }
}
