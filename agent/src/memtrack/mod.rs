//! Dirty-page tracking of a running process that does not cooperate, for
//! pre-copy migration.
//!
//! This kernel has no soft-dirty bits (so CRIU's `pre-dump --track-mem`
//! cannot work here); it has asynchronous userfaultfd write protection and
//! the `PAGEMAP_SCAN` ioctl (Linux 6.7+), which together give the exact set
//! of pages written between two scans:
//!
//! 1. **Start** ([`Tracker::start`]): the target is made to create a
//!    userfaultfd itself (a userfaultfd belongs to its creator's memory):
//!    one of its threads is interrupted under ptrace and runs the system
//!    call ([`inject`]); ferryd takes the descriptor with `pidfd_getfd` and
//!    has the target close its own, so nothing is left in its descriptor
//!    table for CRIU to trip over. The thread runs on at once.
//! 2. **Rounds** ([`Tracker::scan`]): each round reads the target's
//!    mappings, registers new writable private ones for write protection,
//!    and scans: pages written since the last scan (and pages of newly
//!    registered mappings, never protected yet) are reported and, in the
//!    same call, protected again. A mapping that went away or was replaced
//!    (munmap, mremap, a new mmap at the same place: the kernel drops the
//!    registration) shows up unregistered and is treated as all new.
//! 3. **Stop** ([`Tracker::stop`], and on drop): protection is lifted from
//!    every registered range, the ranges are unregistered and the
//!    descriptor closed, so the process never keeps a write-protected page
//!    after a migration, committed or aborted. (Even if ferryd died first,
//!    closing the descriptor unregisters everything, and a leftover
//!    protection bit on a page of an unregistered mapping is ignored by
//!    the kernel.)
//!
//! Only private mappings are tracked (read-only ones too: write protection
//! survives `mprotect`, so a write after a round trip through PROT_WRITE is
//! still seen), and only their own pages, not the file's: they are what
//! CRIU writes to a process's `pagemap-<pid>.img`. Shared memory goes to
//! other images, and its pages are never counted as already on the
//! destination.

mod inject;
pub mod ranges;
use crate::uffd;

use std::io;
use std::os::fd::{AsFd, OwnedFd};

pub use ranges::RangeSet;

/// Why tracking could not start or a scan failed. The process is never
/// left interrupted or write-protected by any of them.
#[derive(Debug, thiserror::Error)]
pub enum TrackError {
    #[error("process {pid}: {what}: {source}")]
    Io {
        pid: i32,
        what: &'static str,
        source: io::Error,
    },
    #[error("process {pid} cannot be tracked: {reason}")]
    Unsupported { pid: i32, reason: String },
}

/// The host's page size.
pub fn page_size() -> u64 {
    // SAFETY: sysconf takes an integer and returns one.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 { n as u64 } else { 4096 }
}

/// `process_vm_readv` of `len` bytes at `addr` of process `pid` into
/// `dst`; how many it read (short at the first unmapped page).
///
/// # Safety
/// `dst` must be valid for writes of `len` bytes for the whole call.
unsafe fn read_remote_into(pid: i32, addr: u64, dst: *mut u8, len: usize) -> io::Result<usize> {
    let local = libc::iovec {
        iov_base: dst.cast(),
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: `local` is writable for `len` bytes (the caller's promise);
    // `remote` is only read by the kernel, in the other process, with its
    // own checks.
    let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Reads `buf.len()` bytes at `addr` of process `pid`; returns how many
/// could be read (short at the first unmapped page).
pub fn read_remote(pid: i32, addr: u64, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is writable for its length for the whole call.
    unsafe { read_remote_into(pid, addr, buf.as_mut_ptr(), buf.len()) }
}

/// Reads up to `len` bytes at `addr` of process `pid` into a new buffer,
/// as long as what could be read (short at the first unmapped page). The
/// buffer is not zeroed first: a page stream reads gigabytes, and zeroing
/// each buffer before the kernel overwrites it cost the source a few per
/// cent of its CPU.
pub fn read_remote_vec(pid: i32, addr: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf: Vec<u8> = Vec::with_capacity(len);
    // SAFETY: the allocation holds `len` bytes, writable for the call.
    let n = unsafe { read_remote_into(pid, addr, buf.as_mut_ptr(), len) }?;
    // SAFETY: the kernel wrote the first `n` bytes (`n <= len`, the
    // capacity); the rest stays outside the vector's length.
    unsafe { buf.set_len(n) };
    Ok(buf)
}

/// The PID of `pid` inside its own PID namespace (the innermost of the
/// `NSpid` line): the number CRIU names its images by.
pub fn ns_pid(pid: i32) -> io::Result<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|v| v.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| io::Error::other(format!("no NSpid in /proc/{pid}/status")))
}

/// A mapping of the target, as `/proc/<pid>/smaps` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub writable: bool,
    pub private: bool,
    /// May be made writable ("mw" in VmFlags): every private mapping, and
    /// what userfaultfd registration requires.
    pub may_write: bool,
    /// A kernel-provided mapping ([vdso], [vvar], [vsyscall], [uprobes]):
    /// not the process's memory, never dumped.
    pub special: bool,
    /// Registered for userfaultfd write protection ("uw" in VmFlags).
    pub uffd_wp: bool,
    /// Every mnemonic of its "VmFlags:" line.
    pub vm_flags: std::collections::BTreeSet<String>,
}

impl Mapping {
    /// Whether its pages are tracked: private (what CRIU puts in the
    /// process's pages image), read-only ones included, since `mprotect`
    /// keeps the protection bits and a write after a round trip through
    /// PROT_WRITE is still seen.
    pub fn trackable(&self) -> bool {
        self.private && self.may_write && !self.special
    }
}

/// The mappings of `pid`.
pub fn mappings(pid: i32) -> io::Result<Vec<Mapping>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    Ok(parse_smaps(&text))
}

fn parse_smaps(text: &str) -> Vec<Mapping> {
    let mut out: Vec<Mapping> = Vec::new();
    for line in text.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some(m) = out.last_mut() {
                m.vm_flags = flags.split_whitespace().map(str::to_owned).collect();
                m.uffd_wp = m.vm_flags.contains("uw");
                m.may_write = m.vm_flags.contains("mw");
            }
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(range), Some(perms)) = (words.next(), words.next()) else {
            continue;
        };
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        if perms.len() != 4 {
            continue;
        }
        // offset, device, inode, then the name, if any.
        let name = words.nth(3).unwrap_or("");
        out.push(Mapping {
            start,
            end,
            writable: perms.as_bytes()[1] == b'w',
            private: perms.as_bytes()[3] == b'p',
            may_write: false,
            special: matches!(
                name,
                "[vdso]" | "[vvar]" | "[vvar_vclock]" | "[vsyscall]" | "[uprobes]"
            ),
            uffd_wp: false,
            vm_flags: Default::default(),
        });
    }
    out
}

/// What one scan found.
#[derive(Debug, Default, Clone)]
pub struct Scan {
    /// Pages written since the last scan (or never protected), with data:
    /// the ones to send.
    pub written: RangeSet,
    /// Every page whose content may differ from what an earlier read saw:
    /// `written`, plus written pages without data (unmapped since, or the
    /// shared zero page), plus all of every mapping that is new, replaced
    /// or not trackable. Whatever the destination holds there is stale.
    pub stale: RangeSet,
    /// The tracked (registered, write-protected) ranges at this scan.
    pub tracked: RangeSet,
}

/// Dirty-page tracking of one process (one address space).
pub struct Tracker {
    pid: i32,
    uffd: Option<OwnedFd>,
    pagemap: std::fs::File,
    /// What the last scan that read smaps found, for the next rounds.
    known: Option<Known>,
}

/// The mappings as the last scan that read `/proc/<pid>/smaps` saw them.
/// smaps is where a mapping's userfaultfd registration shows ("uw"), but
/// the kernel also counts every resident page for it: ~40 ms for a 4 GiB
/// process on this machine, a round's floor. `/proc/<pid>/maps` costs no
/// page walk: while it reads the same, a round takes these ranges as they
/// were.
///
/// A mapping replaced by an identical-looking one (unmapped and mapped
/// again at the same place) is not registered then, and the round's scan
/// passes over it (no PM_SCAN_CHECK_WPASYNC); the destination's copy of it
/// stays marked held. That costs nothing in correctness: its pages carry
/// no write protection, so the scan inside the freeze (CRIU's, with the
/// held-pages patch, or [`Tracker::scan`] without `rearm`, which always
/// reads smaps) finds every one of them written and dumps it.
#[derive(Debug)]
struct Known {
    maps: String,
    tracked: RangeSet,
    untracked: RangeSet,
}

impl std::fmt::Debug for Tracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracker").field("pid", &self.pid).finish()
    }
}

impl Tracker {
    /// Creates the target's userfaultfd (see the module docs). Blocking
    /// (ptrace): run it off the async runtime.
    pub fn start(pid: i32) -> Result<Self, TrackError> {
        let io = |what| move |source| TrackError::Io { pid, what, source };
        if mappings(pid)
            .map_err(io("reading its mappings"))?
            .iter()
            .any(|m| m.uffd_wp)
        {
            return Err(TrackError::Unsupported {
                pid,
                reason: "it uses userfaultfd write protection itself".into(),
            });
        }
        let pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap"))
            .map_err(io("opening its pagemap"))?;
        let pidfd = crate::process::pidfd::open(pid).map_err(io("pidfd_open"))?;
        let mut thread = inject::Seized::new(pid).map_err(io("seizing its main thread"))?;
        let flags = (libc::O_CLOEXEC | libc::O_NONBLOCK) as u64 | uffd::UFFD_USER_MODE_ONLY;
        let fd = thread
            .syscall(libc::SYS_userfaultfd, &[flags])
            .map_err(io("injecting userfaultfd(2)"))?;
        if fd < 0 {
            return Err(TrackError::Unsupported {
                pid,
                reason: format!(
                    "userfaultfd(2) failed in it: {}",
                    io::Error::from_raw_os_error(-fd as i32)
                ),
            });
        }
        let taken = crate::sockstate::sys::pidfd_getfd(pidfd.as_fd(), fd as i32);
        // Its own copy goes whatever happened: CRIU cannot dump one.
        let closed = thread.syscall(libc::SYS_close, &[fd as u64]);
        thread.release().map_err(io("releasing its main thread"))?;
        let uffd = taken.map_err(io("pidfd_getfd of its userfaultfd"))?;
        match closed {
            Ok(0) => {}
            Ok(e) => {
                return Err(TrackError::Io {
                    pid,
                    what: "closing its userfaultfd",
                    source: io::Error::from_raw_os_error(-e as i32),
                });
            }
            Err(e) => return Err(io("closing its userfaultfd")(e)),
        }
        uffd::api_wp_async(uffd.as_fd()).map_err(|e| TrackError::Unsupported {
            pid,
            reason: format!("asynchronous userfaultfd write protection (Linux 6.7+): {e}"),
        })?;
        Ok(Tracker {
            pid,
            uffd: Some(uffd),
            pagemap,
            known: None,
        })
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Registers new private mappings ([`Mapping::trackable`]), then reports the pages
    /// written since the last scan. With `rearm`, they are protected again
    /// in the same step; without, nothing changes (the final scan, with the
    /// process stopped).
    pub fn scan(&mut self, rearm: bool) -> Result<Scan, TrackError> {
        let pid = self.pid;
        let io = |what| move |source| TrackError::Io { pid, what, source };
        let Some(uffd) = self.uffd.as_ref() else {
            return Err(TrackError::Unsupported {
                pid,
                reason: "tracking was stopped".into(),
            });
        };
        let maps_text = std::fs::read_to_string(format!("/proc/{pid}/maps"))
            .map_err(io("reading its mappings"))?;
        let mut scan = Scan::default();
        match self.known.take() {
            Some(known) if rearm && known.maps == maps_text => {
                scan.tracked = known.tracked.clone();
                scan.stale = known.untracked.clone();
                self.known = Some(known);
            }
            _ => {
                let maps = mappings(pid).map_err(io("reading its mappings"))?;
                let mut untracked = RangeSet::new();
                for m in &maps {
                    if !m.trackable() {
                        untracked.insert(m.start, m.end);
                        continue;
                    }
                    if !m.uffd_wp {
                        // New, or replaced since it was registered: all of
                        // it counts as written (its pages carry no
                        // protection yet).
                        scan.stale.insert(m.start, m.end);
                        if !rearm {
                            continue;
                        }
                        if let Err(e) = uffd::register_wp(uffd.as_fd(), m.start, m.end) {
                            tracing::debug!(pid, start = m.start, end = m.end, error = %e, "mapping not trackable");
                            untracked.insert(m.start, m.end);
                            continue;
                        }
                    }
                    scan.tracked.insert(m.start, m.end);
                }
                scan.stale.insert_all(&untracked);
                // maps read before smaps: a change between the two reads
                // shows at the next round, which then reads smaps again.
                if rearm {
                    self.known = Some(Known {
                        maps: maps_text,
                        tracked: scan.tracked.clone(),
                        untracked,
                    });
                }
            }
        }
        // While the process runs, a mapping in the range may be replaced
        // between the read of its mappings and this scan: a new one, not
        // registered yet. The scan passes over it (PM_SCAN_WP_MATCHING
        // without PM_SCAN_CHECK_WPASYNC skips mappings that cannot be
        // write-protected) and goes on; the next scan finds it new and
        // counts it all stale. Failing there instead (EPERM) would leave
        // the rest of the range unscanned and, to be safe, all of it
        // stale: a tracked range merges with a registered neighbour, so a
        // process that remaps a small buffer beside a large region would
        // lose the region's held pages at every such scan. The last scan
        // (the process stopped) still fails on such a mapping: nothing
        // changes under it then.
        let flags = if rearm {
            uffd::PM_SCAN_WP_MATCHING
        } else {
            uffd::PM_SCAN_CHECK_WPASYNC
        };
        // Present pages only: a scan that re-protects a hole of a file
        // mapping leaves a marker there, which /proc/<pid>/pagemap shows as
        // a swapped page, and CRIU would then dump the file's page as the
        // process's own. A hole written later becomes a present page
        // without protection, found by the next scan.
        //
        // Nothing here asks whether a page is the file's (PAGE_IS_FILE):
        // for that the kernel reads every present page's struct page, ~17
        // ms a GiB on this machine, and a round of a 4 GiB process then
        // took ~70 ms whatever it found, so its last round left ~70 ms of
        // writes for the freeze. Only the written runs are asked, below.
        let want = uffd::PAGE_IS_WRITTEN | uffd::PAGE_IS_PRESENT;
        let tracked: Vec<(u64, u64)> = scan.tracked.iter().collect();
        let mut written = RangeSet::new();
        for (start, end) in tracked {
            let mut regions = Vec::new();
            let mut at = start;
            while at < end {
                match uffd::pagemap_scan(
                    self.pagemap.as_fd(),
                    at,
                    end,
                    uffd::ScanQuery {
                        flags,
                        category_mask: want,
                        category_inverted: 0,
                        return_mask: want,
                    },
                    &mut regions,
                ) {
                    Ok(walk_end) if walk_end > at => at = walk_end,
                    Ok(_) => break,
                    // The mapping changed under the scan (unmapped, or not
                    // registered any more): all of it is stale.
                    Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                        scan.stale.insert(start, end);
                        scan.tracked.remove(start, end);
                        break;
                    }
                    Err(e) => return Err(io("PAGEMAP_SCAN")(e)),
                }
            }
            for r in regions {
                scan.stale.insert(r.start, r.end);
                written.insert(r.start, r.end);
            }
        }
        // Data of its own: not the zero page, not a page of the file behind
        // the mapping (CRIU dumps neither). A written page unmapped or
        // replaced since the scan above is stale all the same, and what
        // replaced it is written again or not the process's own.
        scan.written = self.own_pages(&written)?;
        Ok(scan)
    }

    /// The pages in `ranges` that are the process's own right now: present,
    /// not the file's page, not the zero page. A page that was zapped
    /// (`MADV_DONTNEED`) and faulted in again from the file or as zeros
    /// carries no write, but is not what an earlier read saw; this tells.
    pub fn own_pages(&self, ranges: &RangeSet) -> Result<RangeSet, TrackError> {
        let pid = self.pid;
        let mut own = RangeSet::new();
        let mask = uffd::PAGE_IS_PRESENT | uffd::PAGE_IS_FILE | uffd::PAGE_IS_PFNZERO;
        let inverted = uffd::PAGE_IS_FILE | uffd::PAGE_IS_PFNZERO;
        for (start, end) in ranges.iter() {
            let mut at = start;
            while at < end {
                let mut regions = Vec::new();
                match uffd::pagemap_scan(
                    self.pagemap.as_fd(),
                    at,
                    end,
                    uffd::ScanQuery {
                        flags: 0,
                        category_mask: mask,
                        category_inverted: inverted,
                        return_mask: uffd::PAGE_IS_PRESENT,
                    },
                    &mut regions,
                ) {
                    Ok(walk_end) => {
                        for r in regions {
                            own.insert(r.start, r.end);
                        }
                        if walk_end <= at {
                            break;
                        }
                        at = walk_end;
                    }
                    Err(source) => {
                        return Err(TrackError::Io {
                            pid,
                            what: "PAGEMAP_SCAN",
                            source,
                        });
                    }
                }
            }
        }
        Ok(own)
    }

    /// Lifts every protection, unregisters and closes (see the module
    /// docs). Errors are logged: the descriptor's close unregisters all
    /// that is left anyway.
    pub fn stop(&mut self) {
        let Some(uffd) = self.uffd.take() else {
            return;
        };
        // Mapping by mapping, as they are now: ranges registered earlier
        // may have been unmapped, split or merged since.
        let maps = match mappings(self.pid) {
            Ok(m) => m,
            // Gone: nothing of it to undo.
            Err(_) => return,
        };
        for m in maps.iter().filter(|m| m.uffd_wp) {
            for (what, r) in [
                (
                    "unprotecting",
                    uffd::write_protect(uffd.as_fd(), m.start, m.end, false),
                ),
                (
                    "unregistering",
                    uffd::unregister(uffd.as_fd(), m.start, m.end),
                ),
            ] {
                if let Err(e) = r {
                    tracing::warn!(pid = self.pid, start = m.start, end = m.end, error = %e, "{what} a tracked mapping");
                }
            }
        }
        drop(uffd);
    }
}

impl Tracker {
    /// Ends tracking of a process that is being killed: its userfaultfd
    /// closes, with nothing unprotected first (no page of it will run).
    pub fn abandon(&mut self) {
        self.uffd.take();
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests;
