//! A task's page store as the filler reads it: the store file mapped
//! read-only in windows at the process's addresses, and its installed
//! pages given back to the file system in batches.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::Mutex;

use super::FillError;
use crate::memtrack::RangeSet;

/// A read-only window of a store: `[start, end)` of the process's
/// addresses, mapped from the store file at the same offsets.
pub(super) struct Window {
    start: u64,
    end: u64,
    ptr: *const u8,
}

/// Installed pages the store keeps until this many bytes of them can go
/// at once: a 32nd of the store's windows, within these bounds. Each
/// release punches a hole in the store file under its inode lock, which
/// ferryd's writes of the pages that follow hold too: released chunk by
/// chunk (up to 512 KiB), the filler spent half of its time spinning on
/// that lock in a 4 GiB post-copy fill (perf, release build, 2 cores).
/// The store then holds at most this much of pages already installed,
/// besides those still to install: a few per cent of the process.
const RELEASE_BATCH_MIN: u64 = 512 << 10;
const RELEASE_BATCH_MAX: u64 = 8 << 20;

/// One store, mapped.
pub(super) struct Store {
    file: File,
    windows: Vec<Window>,
    /// Installed, not released yet: `[offset, end)` of the store file.
    installed: Mutex<RangeSet>,
    /// How much of that goes at once.
    release_batch: u64,
}

// SAFETY: the windows are read-only shared mappings owned by the Store,
// unmapped only when it drops; reading them from any thread is sound.
unsafe impl Send for Store {}
// SAFETY: as above: nothing writes through the pointers.
unsafe impl Sync for Store {}

impl Store {
    pub(super) fn map(file: File, windows: &[(u64, u64)]) -> Result<Self, FillError> {
        let mut store = Store {
            file,
            windows: Vec::new(),
            installed: Mutex::new(RangeSet::new()),
            release_batch: (windows.iter().map(|(s, e)| e - s).sum::<u64>() / 32)
                .clamp(RELEASE_BATCH_MIN, RELEASE_BATCH_MAX),
        };
        for &(start, end) in windows {
            let len = (end - start) as usize;
            // SAFETY: a new read-only shared mapping of the store file at a
            // page-aligned offset (Plan::check); the kernel picks the
            // address, so nothing of ours is replaced.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ,
                    libc::MAP_SHARED | libc::MAP_NORESERVE,
                    store.file.as_raw_fd(),
                    start as libc::off_t,
                )
            };
            if ptr == libc::MAP_FAILED {
                return Err(FillError::io(format!(
                    "mapping the page store at {start:#x}+{len}"
                ))(std::io::Error::last_os_error()));
            }
            store.windows.push(Window {
                start,
                end,
                ptr: ptr.cast(),
            });
        }
        Ok(store)
    }

    /// Where the `len` bytes at store offset `off` are mapped, if inside one
    /// window.
    pub(super) fn src(&self, off: u64, len: u64) -> Option<*const u8> {
        let w = self
            .windows
            .iter()
            .find(|w| w.start <= off && off + len <= w.end)?;
        // SAFETY: inside the window, as just checked.
        Some(unsafe { w.ptr.add((off - w.start) as usize) })
    }

    /// Maps the store's pages at `src..src + len` into this process's page
    /// tables before they are installed. UFFDIO_COPY reads its source with
    /// page faults off first: a store page not mapped here yet (it was
    /// written after the mapping was made, as every page that follows is)
    /// fails that copy, which the kernel then zero-fills and repeats with
    /// faults on, one page at a time. Populating the chunk in one call
    /// spares that (measured: the filler's copy was 16 % of the two CPUs
    /// of a 4 GiB post-copy fill, its failed first tries' zeroing 2 %).
    /// Advice only: a kernel without `MADV_POPULATE_READ` (before 5.14)
    /// takes the slow way.
    pub(super) fn populate(src: *const u8, len: u64) {
        // SAFETY: `src..src + len` is inside a read-only shared window of
        // a Store (the caller got `src` from `Store::src`); populating it
        // reads nothing into our memory and changes no contents.
        let _ = unsafe {
            libc::madvise(
                src.cast_mut().cast(),
                len as usize,
                libc::MADV_POPULATE_READ,
            )
        };
    }

    /// Frees the store's pages of `[off, off + len)` (installed, or no
    /// longer wanted) once `release_batch` bytes of such pages gathered:
    /// the store shrinks as the process fills.
    pub(super) fn release(&self, off: u64, len: u64) {
        if len == 0 {
            return;
        }
        let ranges = {
            let mut installed = crate::sync::lock(&self.installed);
            installed.insert(off, off + len);
            if installed.len() < self.release_batch {
                return;
            }
            std::mem::take(&mut *installed)
        };
        self.punch(&ranges);
    }

    fn punch(&self, ranges: &RangeSet) {
        for (start, end) in ranges.iter() {
            // SAFETY: fallocate on our descriptor; no memory is passed.
            let _ = unsafe {
                libc::fallocate(
                    self.file.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    start as libc::off_t,
                    (end - start) as libc::off_t,
                )
            };
        }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        let rest = std::mem::take(&mut *crate::sync::lock(&self.installed));
        self.punch(&rest);
        for w in &self.windows {
            // SAFETY: unmaps exactly a mapping this Store made.
            unsafe { libc::munmap(w.ptr.cast_mut().cast(), (w.end - w.start) as usize) };
        }
    }
}
