//! The userfaultfd and pagemap ioctls dirty tracking uses (Linux 6.7+).
//!
//! With `UFFD_FEATURE_WP_ASYNC` a write to a write-protected page does not
//! wait for a handler: the kernel lifts the protection and lets the write
//! through, and the page then reads as written in `PAGEMAP_SCAN` until it
//! is protected again. The scan can re-protect what it reports in the same
//! call (`PM_SCAN_WP_MATCHING`), so no write falls between report and
//! re-arm. Both ioctls act on the memory of the process the descriptors
//! belong to (the userfaultfd's creator, `/proc/<pid>/pagemap`'s process),
//! whoever calls them.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

const UFFD_API: u64 = 0xaa;
const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
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

const _: () = assert!(std::mem::size_of::<UffdioApi>() == 24);
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
pub fn api(uffd: BorrowedFd<'_>) -> io::Result<()> {
    let mut a = UffdioApi {
        api: UFFD_API,
        features: UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_HUGETLBFS_SHMEM,
        ioctls: 0,
    };
    ioctl(uffd, UFFDIO_API, &mut a).map(|_| ())
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
