//! The userfaultfd and pagemap ioctls ferryd uses (Linux 6.7+).
//!
//! Dirty tracking ([`crate::memtrack`]): with `UFFD_FEATURE_WP_ASYNC` a
//! write to a write-protected page does not wait for a handler: the kernel
//! lifts the protection and lets the write through, and the page then
//! reads as written in `PAGEMAP_SCAN` until it is protected again. The scan
//! can re-protect what it reports in the same call (`PM_SCAN_WP_MATCHING`),
//! so no write falls between report and re-arm. Both ioctls act on the
//! memory of the process the descriptors belong to (the userfaultfd's
//! creator, `/proc/<pid>/pagemap`'s process), whoever calls them.
//!
//! Filling a restored process ([`crate::fill`]): CRIU's restore registers
//! the process's private anonymous areas for missing-page faults on a
//! userfaultfd of the process and hands it over; the filler installs pages
//! with `UFFDIO_COPY` (or zeros with `UFFDIO_ZEROPAGE`) from its own
//! memory into the process's, and reads the process's faults and the
//! changes to its areas (fork, mremap, munmap, madvise) as messages.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

const UFFD_API: u64 = 0xaa;
/// Non-cooperative events the filler needs: without them a change to the
/// process's areas during the fill would go unseen.
pub const UFFD_FEATURE_EVENT_FORK: u64 = 1 << 1;
pub const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
pub const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
pub const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;
/// What CRIU's restore asks for when the kernel has it (`criu/uffd.c`,
/// `NEED_UFFD_API_FEATURES`).
pub const FILL_FEATURES: u64 = UFFD_FEATURE_EVENT_FORK
    | UFFD_FEATURE_EVENT_REMAP
    | UFFD_FEATURE_EVENT_REMOVE
    | UFFD_FEATURE_EVENT_UNMAP;
const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
pub const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1 << 0;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
/// `userfaultfd(2)` flag: only faults from user mode reach a handler. Lets
/// an unprivileged target create one (vm.unprivileged_userfaultfd = 0),
/// and asynchronous write protection never calls a handler anyway.
pub const UFFD_USER_MODE_ONLY: u64 = 1;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

/// `struct pm_scan_arg` (linux/fs.h).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// `struct page_region` (linux/fs.h).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PageRegion {
    pub start: u64,
    pub end: u64,
    pub categories: u64,
}

/// `struct uffdio_copy`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    /// Bytes copied, or a negative errno.
    copy: i64,
}

/// `struct uffdio_zeropage`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}

const _: () = assert!(std::mem::size_of::<UffdioApi>() == 24);
const _: () = assert!(std::mem::size_of::<UffdioCopy>() == 40);
const _: () = assert!(std::mem::size_of::<UffdioZeropage>() == 32);
const _: () = assert!(std::mem::size_of::<UffdioRegister>() == 32);
const _: () = assert!(std::mem::size_of::<UffdioWriteprotect>() == 24);
const _: () = assert!(std::mem::size_of::<PmScanArg>() == 96);
const _: () = assert!(std::mem::size_of::<PageRegion>() == 24);

/// `_IOC(dir, type, nr, size)` as the kernel's asm-generic/ioctl.h builds it.
const fn ioc(dir: u64, ty: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (ty << 8) | nr
}
const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;
const UFFDIO_API: u64 = ioc(IOC_READ | IOC_WRITE, 0xaa, 0x3f, 24);
const UFFDIO_REGISTER: u64 = ioc(IOC_READ | IOC_WRITE, 0xaa, 0x00, 32);
const UFFDIO_UNREGISTER: u64 = ioc(IOC_READ, 0xaa, 0x01, 16);
const UFFDIO_WRITEPROTECT: u64 = ioc(IOC_READ | IOC_WRITE, 0xaa, 0x06, 24);
const UFFDIO_WAKE: u64 = ioc(IOC_READ, 0xaa, 0x02, 16);
const UFFDIO_COPY: u64 = ioc(IOC_READ | IOC_WRITE, 0xaa, 0x03, 40);
const UFFDIO_ZEROPAGE: u64 = ioc(IOC_READ | IOC_WRITE, 0xaa, 0x04, 32);
const PAGEMAP_SCAN: u64 = ioc(IOC_READ | IOC_WRITE, b'f' as u64, 16, 96);

/// `PM_SCAN_*` flags.
pub const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
pub const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
/// `PAGE_IS_*` categories.
pub const PAGE_IS_WRITTEN: u64 = 1 << 1;
pub const PAGE_IS_FILE: u64 = 1 << 2;
pub const PAGE_IS_PRESENT: u64 = 1 << 3;
pub const PAGE_IS_SWAPPED: u64 = 1 << 4;
pub const PAGE_IS_PFNZERO: u64 = 1 << 5;

fn ioctl<T>(fd: BorrowedFd<'_>, request: u64, arg: &mut T) -> io::Result<libc::c_int> {
    // SAFETY: every request used here takes a pointer to the #[repr(C)]
    // struct of the size encoded in the request (checked by the asserts
    // above), which lives for the duration of the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg as *mut T) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Enables the userfaultfd with asynchronous write protection.
pub fn api_wp_async(uffd: BorrowedFd<'_>) -> io::Result<()> {
    let mut a = UffdioApi {
        api: UFFD_API,
        features: UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_HUGETLBFS_SHMEM,
        ioctls: 0,
    };
    ioctl(uffd, UFFDIO_API, &mut a).map(|_| ())
}

/// Enables a userfaultfd with `features` (as CRIU's restore does for a
/// lazy restore); fails if the kernel lacks one.
pub fn api(uffd: BorrowedFd<'_>, features: u64) -> io::Result<()> {
    let mut a = UffdioApi {
        api: UFFD_API,
        features,
        ioctls: 0,
    };
    ioctl(uffd, UFFDIO_API, &mut a)?;
    if a.features & features != features {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    Ok(())
}

/// Registers `[start, end)` for missing-page faults (as CRIU's restorer
/// does for the areas a lazy restore fills).
pub fn register_missing(uffd: BorrowedFd<'_>, start: u64, end: u64) -> io::Result<()> {
    let mut r = UffdioRegister {
        range: UffdioRange {
            start,
            len: end - start,
        },
        mode: UFFDIO_REGISTER_MODE_MISSING,
        ioctls: 0,
    };
    ioctl(uffd, UFFDIO_REGISTER, &mut r).map(|_| ())
}

/// Registers `[start, end)` for write protection (not yet protected).
pub fn register_wp(uffd: BorrowedFd<'_>, start: u64, end: u64) -> io::Result<()> {
    let mut r = UffdioRegister {
        range: UffdioRange {
            start,
            len: end - start,
        },
        mode: UFFDIO_REGISTER_MODE_WP,
        ioctls: 0,
    };
    ioctl(uffd, UFFDIO_REGISTER, &mut r).map(|_| ())
}

/// Unregisters `[start, end)`.
pub fn unregister(uffd: BorrowedFd<'_>, start: u64, end: u64) -> io::Result<()> {
    let mut r = UffdioRange {
        start,
        len: end - start,
    };
    ioctl(uffd, UFFDIO_UNREGISTER, &mut r).map(|_| ())
}

/// Write-protects (`protect`) or unprotects `[start, end)`.
pub fn write_protect(uffd: BorrowedFd<'_>, start: u64, end: u64, protect: bool) -> io::Result<()> {
    let mut w = UffdioWriteprotect {
        range: UffdioRange {
            start,
            len: end - start,
        },
        mode: if protect {
            UFFDIO_WRITEPROTECT_MODE_WP
        } else {
            0
        },
    };
    ioctl(uffd, UFFDIO_WRITEPROTECT, &mut w).map(|_| ())
}

/// One `PAGEMAP_SCAN` over `[start, end)` for pages in all of
/// `category_mask` (after flipping the `category_inverted` ones: those
/// must be absent), reporting `return_mask` categories, `flags` as above.
/// Appends regions to `out`; returns where the walk ended (`end` unless
/// `vec` filled up first: call again from there).
/// What a `PAGEMAP_SCAN` looks for and reports.
#[derive(Debug, Clone, Copy, Default)]
pub struct ScanQuery {
    pub flags: u64,
    pub category_mask: u64,
    pub category_inverted: u64,
    pub return_mask: u64,
}

pub fn pagemap_scan(
    pagemap: BorrowedFd<'_>,
    start: u64,
    end: u64,
    q: ScanQuery,
    out: &mut Vec<PageRegion>,
) -> io::Result<u64> {
    let mut vec = vec![PageRegion::default(); 512];
    let mut arg = PmScanArg {
        size: std::mem::size_of::<PmScanArg>() as u64,
        flags: q.flags,
        start,
        end,
        vec: vec.as_mut_ptr() as u64,
        vec_len: vec.len() as u64,
        category_mask: q.category_mask,
        category_inverted: q.category_inverted,
        return_mask: q.return_mask,
        ..Default::default()
    };
    let n = ioctl(pagemap, PAGEMAP_SCAN, &mut arg)? as usize;
    out.extend_from_slice(&vec[..n.min(vec.len())]);
    Ok(arg.walk_end)
}

/// Whether this kernel's userfaultfd has `features` (a handshake on a
/// userfaultfd of this process, closed again).
pub fn has_features(features: u64) -> io::Result<bool> {
    // SAFETY: userfaultfd takes flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
    let mut a = UffdioApi {
        api: UFFD_API,
        features,
        ioctls: 0,
    };
    match ioctl(std::os::fd::AsFd::as_fd(&fd), UFFDIO_API, &mut a) {
        Ok(_) => Ok(a.features & features == features),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

/// What an install did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Installed {
    /// All of it.
    All,
    /// The first `done` bytes; the page after them was already there
    /// (`EEXIST`): never overwritten.
    Exists { done: u64 },
    /// The first `done` bytes; the process's areas are changing (a fork,
    /// mremap, munmap or madvise whose message is not read yet: `EAGAIN`).
    /// Read the messages, then try the rest again.
    Changing { done: u64 },
    /// The first `done` bytes; the range is not (or no longer) in one
    /// registered area (`ENOENT`): unmapped, or split since.
    NoArea { done: u64 },
    /// The process's memory is gone: it exited (`ESRCH`, or `ENOSPC`
    /// while its mm is torn down).
    Gone,
}

fn installed(done: i64, e: io::Error) -> io::Result<Installed> {
    let done = done.max(0) as u64;
    match e.raw_os_error() {
        Some(libc::EEXIST) => Ok(Installed::Exists { done }),
        Some(libc::EAGAIN) => Ok(Installed::Changing { done }),
        Some(libc::ENOENT) => Ok(Installed::NoArea { done }),
        Some(libc::ESRCH) | Some(libc::ENOSPC) => Ok(Installed::Gone),
        _ => Err(e),
    }
}

/// Installs `len` bytes at `src` in this process into `dst` of the
/// userfaultfd's process, waking any thread that waits for them.
///
/// # Safety
///
/// `src..src + len` must be readable memory of this process for the whole
/// call.
pub unsafe fn copy(
    uffd: BorrowedFd<'_>,
    dst: u64,
    src: *const u8,
    len: u64,
) -> io::Result<Installed> {
    let mut c = UffdioCopy {
        dst,
        src: src as u64,
        len,
        mode: 0,
        copy: 0,
    };
    match ioctl(uffd, UFFDIO_COPY, &mut c) {
        Ok(_) => Ok(Installed::All),
        Err(e) => installed(c.copy, e),
    }
}

/// Maps zero pages at `[start, start + len)` of the userfaultfd's process
/// (pages it never had), waking any thread that waits for them.
pub fn zeropage(uffd: BorrowedFd<'_>, start: u64, len: u64) -> io::Result<Installed> {
    let mut z = UffdioZeropage {
        range: UffdioRange { start, len },
        mode: 0,
        zeropage: 0,
    };
    match ioctl(uffd, UFFDIO_ZEROPAGE, &mut z) {
        Ok(_) => Ok(Installed::All),
        Err(e) => installed(z.zeropage, e),
    }
}

/// Wakes the threads waiting for `[start, start + len)`.
pub fn wake(uffd: BorrowedFd<'_>, start: u64, len: u64) -> io::Result<()> {
    let mut r = UffdioRange { start, len };
    ioctl(uffd, UFFDIO_WAKE, &mut r).map(|_| ())
}

const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_EVENT_FORK: u8 = 0x13;
const UFFD_EVENT_REMAP: u8 = 0x14;
const UFFD_EVENT_REMOVE: u8 = 0x15;
const UFFD_EVENT_UNMAP: u8 = 0x16;
/// `sizeof(struct uffd_msg)`.
pub const MSG_BYTES: usize = 32;

/// One message of a userfaultfd (`struct uffd_msg`).
#[derive(Debug)]
pub enum Message {
    /// A thread waits for the page at `address`.
    PageFault { address: u64 },
    /// The process forked: `uffd` (now a descriptor of this process) is
    /// the child's, with the same registrations.
    Fork { uffd: std::os::fd::OwnedFd },
    /// `mremap` moved `[from, from + len)` to `to`.
    Remap { from: u64, to: u64, len: u64 },
    /// `madvise(MADV_DONTNEED/REMOVE/FREE)` dropped `[start, end)`: it reads
    /// as zeros (the area stays registered).
    Remove { start: u64, end: u64 },
    /// `munmap` (or a shrinking `mremap`) removed `[start, end)`.
    Unmap { start: u64, end: u64 },
    /// An event this code does not know.
    Other { event: u8 },
}

/// Parses a message read from a userfaultfd. A fork's descriptor becomes
/// owned here (the kernel installed it in this process by the read).
pub fn parse(msg: &[u8; MSG_BYTES]) -> Message {
    let u64_at = |i: usize| u64::from_ne_bytes(msg[i..i + 8].try_into().expect("8 bytes"));
    match msg[0] {
        UFFD_EVENT_PAGEFAULT => Message::PageFault {
            address: u64_at(16),
        },
        UFFD_EVENT_FORK => {
            let fd = i32::from_ne_bytes(msg[8..12].try_into().expect("4 bytes"));
            // SAFETY: for a fork message the kernel installed this
            // descriptor in our table as part of the read that returned
            // the message; nothing else owns it.
            let uffd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
            Message::Fork { uffd }
        }
        UFFD_EVENT_REMAP => Message::Remap {
            from: u64_at(8),
            to: u64_at(16),
            len: u64_at(24),
        },
        UFFD_EVENT_REMOVE => Message::Remove {
            start: u64_at(8),
            end: u64_at(16),
        },
        UFFD_EVENT_UNMAP => Message::Unmap {
            start: u64_at(8),
            end: u64_at(16),
        },
        event => Message::Other { event },
    }
}

/// Reads the messages waiting on a non-blocking userfaultfd into `out`;
/// returns how many.
pub fn read_messages(uffd: BorrowedFd<'_>, out: &mut Vec<Message>) -> io::Result<usize> {
    let mut buf = [0u8; MSG_BYTES * 16];
    let mut n_total = 0;
    loop {
        // SAFETY: reads at most `buf.len()` bytes into `buf`.
        let n = unsafe { libc::read(uffd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EAGAIN) {
                return Ok(n_total);
            }
            return Err(e);
        }
        if n == 0 {
            return Ok(n_total);
        }
        let n = n as usize;
        for chunk in buf[..n].chunks_exact(MSG_BYTES) {
            out.push(parse(chunk.try_into().expect("MSG_BYTES")));
            n_total += 1;
        }
        if n < buf.len() {
            return Ok(n_total);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(event: u8, words: [u64; 3]) -> [u8; MSG_BYTES] {
        let mut m = [0u8; MSG_BYTES];
        m[0] = event;
        for (i, w) in words.iter().enumerate() {
            m[8 + 8 * i..16 + 8 * i].copy_from_slice(&w.to_ne_bytes());
        }
        m
    }

    #[test]
    fn parses_the_messages_the_filler_handles() {
        assert!(matches!(
            parse(&msg(0x12, [0, 0x7f00_1234, 0])),
            Message::PageFault {
                address: 0x7f00_1234
            }
        ));
        assert!(matches!(
            parse(&msg(0x14, [0x1000, 0x9000, 0x2000])),
            Message::Remap {
                from: 0x1000,
                to: 0x9000,
                len: 0x2000
            }
        ));
        assert!(matches!(
            parse(&msg(0x15, [0x1000, 0x3000, 0])),
            Message::Remove {
                start: 0x1000,
                end: 0x3000
            }
        ));
        assert!(matches!(
            parse(&msg(0x16, [0x4000, 0x5000, 0])),
            Message::Unmap {
                start: 0x4000,
                end: 0x5000
            }
        ));
        assert!(matches!(
            parse(&msg(0x77, [0; 3])),
            Message::Other { event: 0x77 }
        ));
    }

    #[test]
    fn this_kernel_reports_the_events_the_filler_needs() {
        // The machines ferry runs on (Linux 5.15+) have all four.
        assert!(has_features(FILL_FEATURES).unwrap());
    }
}
