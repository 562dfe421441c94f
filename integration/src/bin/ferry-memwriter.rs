//! A process that keeps writing its memory in a known pattern and can
//! check, on request, that all of it is what it wrote: the workload of the
//! pre-copy tests and the algorithms benchmark.
//!
//! Every page `i` of its main region holds `pattern(i, version[i])`; each
//! write bumps a page's version and rewrites the whole page, mostly in a
//! hot set (the first `--hot-percent` of the pages get `--hot-share` of
//! the writes), one write in ten through the kernel (`read(2)` from a pipe
//! into the page), the rest from user mode. A side region is unmapped and
//! mapped again every 200 ms, with fresh content. The versions live in the
//! process's memory too, so a migration that loses or mixes up any page of
//! either shows up as a mismatch at `check`.
//!
//! `--shapes` adds memory of other kinds, written and checked the same
//! way: transparent huge pages, shared anonymous memory, a memfd, and
//! small regions with advice (MADV_DONTDUMP, MADV_WIPEONFORK, MADV_RANDOM)
//! or mlock(2)ed, whose flags `check` also finds in smaps; with
//! `--private-file`, a file mapped private and written. `--child` forks a
//! child that shares a page of shared anonymous memory and one of a memfd
//! with the writer, which `check` finds still shared.
//!
//! `--mode getpid` makes it a process that only calls getpid(2) in a loop
//! (Noack (2003)'s light-weight process); `--busy` drops the 1 ms pause
//! between bursts of writes (Noack (2003)'s RMA process writes as fast as
//! it can).
//!
//! Protocol on `--port` (one command per connection, one line each way):
//! `check` answers `ok <writes> <pages>` or `bad <what>`; `stats` answers
//! `writes <n>`.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use clap::Parser;

#[derive(Debug, Parser)]
struct Args {
    #[arg(long)]
    port: u16,
    /// Size of the main region.
    #[arg(long, default_value_t = 64)]
    mib: usize,
    /// Size of the main region in KiB, instead of --mib.
    #[arg(long)]
    kib: Option<usize>,
    /// "write" (the default) or "getpid" (no writes, getpid(2) in a loop).
    #[arg(long, default_value = "write", value_parser = ["write", "getpid"])]
    mode: String,
    /// No pause between bursts of writes.
    #[arg(long)]
    busy: bool,
    /// Page writes per millisecond (0: none, a process that only computes).
    #[arg(long, default_value_t = 10)]
    writes_per_ms: u32,
    /// The hot set: this percentage of the pages...
    #[arg(long, default_value_t = 5)]
    hot_percent: u32,
    /// ...gets this percentage of the writes.
    #[arg(long, default_value_t = 90)]
    hot_share: u32,
    /// Also hold memory of other kinds, written and checked like the main
    /// region: 8 MiB of transparent huge pages (MADV_HUGEPAGE), 1 MiB
    /// shared anonymous, 1 MiB of a memfd mapped shared, and 64 KiB each
    /// with MADV_DONTDUMP, MADV_WIPEONFORK, MADV_RANDOM, and locked.
    #[arg(long)]
    shapes: bool,
    /// With `--shapes`, also 1 MiB of this file (made here, 1 MiB of
    /// zeros) mapped private and written (copy-on-write pages over a file):
    /// the file must be at the same path wherever the process moves.
    #[arg(long, requires = "shapes")]
    private_file: Option<std::path::PathBuf>,
    /// Fork a child that shares a page of anonymous shared memory and one
    /// of a memfd with the writer: `check` then also checks that both
    /// are still one page for the two processes.
    #[arg(long)]
    child: bool,
    /// Also map 16 pages in which the `guard` command installs guard
    /// pages (MADV_GUARD_INSTALL, Linux 6.13+) on pages 4 and 5: `check`
    /// then also checks that those still fault and the others hold their
    /// content.
    #[arg(long)]
    guard_region: bool,
}

const PAGE: usize = 4096;
/// `Shape::map`'s "advice" that mlock(2)s the region instead.
const LOCK: i32 = -1;
const SIDE_PAGES: usize = 16;
const SIDE_ID: u64 = 1 << 40;
/// MADV_GUARD_INSTALL (include/uapi/asm-generic/mman-common.h, 6.13).
const MADV_GUARD_INSTALL: i32 = 102;
/// The first page id of the guard region.
const GUARD_ID: u64 = 1 << 45;
const GUARD_PAGES: usize = 16;
/// The pages of the guard region the `guard` command guards.
const GUARDED: std::ops::Range<usize> = 4..6;

/// The process's view of whether it can read `len` bytes at `at`
/// (process_vm_readv(2) on itself: a guard page gives EFAULT, not a
/// signal).
fn readable(at: *const u8, len: usize) -> bool {
    let mut buf = vec![0u8; len];
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: at as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: reads from this process's own address space into `buf`,
    // both described by valid iovecs; the kernel checks `at`.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    n == len as isize
}

/// 16 pages, some of them guard pages once asked (`--guard-region`).
struct Guards {
    at: *mut u8,
    installed: bool,
}

/// A fresh private anonymous mapping of `pages` pages, readable and
/// writable, where the kernel places it; `what` names it if that fails.
fn private_pages(pages: usize, what: &str) -> *mut u8 {
    // SAFETY: a new mapping the kernel places; nothing else refers to it.
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            pages * PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(at, libc::MAP_FAILED, "mmap of the {what} region");
    at.cast()
}

impl Guards {
    fn map() -> Guards {
        let g = Guards {
            at: private_pages(GUARD_PAGES, "guard"),
            installed: false,
        };
        for k in 0..GUARD_PAGES {
            pattern(g.page(k), GUARD_ID + k as u64, 0);
        }
        g
    }

    #[allow(clippy::mut_from_ref)]
    fn page(&self, k: usize) -> &mut [u8] {
        // SAFETY: `at` is a live mapping of GUARD_PAGES pages, and callers
        // never touch a guarded page nor hold two slices at once.
        unsafe { std::slice::from_raw_parts_mut(self.at.add(k * PAGE), PAGE) }
    }

    fn install(&mut self) -> String {
        // SAFETY: advises pages of the mapping made in `map`, which
        // nothing reads or writes once they are guards.
        let r = unsafe {
            libc::madvise(
                self.at.add(GUARDED.start * PAGE).cast(),
                GUARDED.len() * PAGE,
                MADV_GUARD_INSTALL,
            )
        };
        if r != 0 {
            return format!("bad madvise: {}", std::io::Error::last_os_error());
        }
        self.installed = true;
        "guarded".into()
    }

    fn check(&self, scratch: &mut [u8]) -> Option<String> {
        for k in 0..GUARD_PAGES {
            let page = self.at.wrapping_add(k * PAGE);
            if self.installed && GUARDED.contains(&k) {
                if readable(page, PAGE) {
                    return Some(format!("bad guard page {k}: readable"));
                }
                continue;
            }
            pattern(scratch, GUARD_ID + k as u64, 0);
            if !readable(page, PAGE) || self.page(k) != scratch {
                return Some(format!("bad guard region page {k}"));
            }
        }
        None
    }
}

/// The first page id of the memory the `grow` command adds.
const GROWN_ID: u64 = 1 << 44;

/// The content of page `id` at `version`: both in the first 16 bytes, the
/// rest an LCG stream seeded by them.
fn pattern(buf: &mut [u8], id: u64, version: u64) {
    buf[..8].copy_from_slice(&id.to_le_bytes());
    buf[8..16].copy_from_slice(&version.to_le_bytes());
    let mut x = id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ version;
    for chunk in buf[16..].chunks_mut(8) {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

struct Side {
    at: *mut u8,
    generation: u64,
}

impl Side {
    fn map(generation: u64) -> Side {
        let side = Side {
            at: private_pages(SIDE_PAGES, "side"),
            generation,
        };
        for k in 0..SIDE_PAGES {
            pattern(side.page(k), SIDE_ID + k as u64, generation);
        }
        side
    }

    /// Unmaps the region and maps a fresh one (which may land in the
    /// same place), with the next generation's content.
    fn remap(&mut self) {
        // SAFETY: the live mapping made in `map`; `at` is replaced right
        // after, so it is never used again.
        unsafe { libc::munmap(self.at.cast(), SIDE_PAGES * PAGE) };
        let fresh = Side::map(self.generation + 1);
        self.at = fresh.at;
        self.generation = fresh.generation;
        // Its mapping now belongs to self.
        std::mem::forget(fresh);
    }

    #[allow(clippy::mut_from_ref)]
    fn page(&self, k: usize) -> &mut [u8] {
        // SAFETY: `at` is a live mapping of SIDE_PAGES pages owned by this
        // Side, and callers never hold two of these slices at once.
        unsafe { std::slice::from_raw_parts_mut(self.at.add(k * PAGE), PAGE) }
    }
}

impl Drop for Side {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.at.cast(), SIDE_PAGES * PAGE) };
    }
}

/// A region of another kind (`--shapes`): its pages, each with the
/// version it was last written at.
struct Shape {
    name: &'static str,
    id: u64,
    at: *mut u8,
    versions: Vec<u64>,
    /// The mnemonic smaps' "VmFlags:" shows for it (its advice or lock),
    /// which a migration must keep.
    flag: Option<&'static str>,
}

impl Shape {
    /// Maps `pages` pages with `flags` (and `fd`), `align`-aligned, with
    /// `advice` (0: none), and writes each once.
    fn map(
        name: &'static str,
        id: u64,
        pages: usize,
        flags: i32,
        fd: i32,
        align: usize,
        advice: i32,
    ) -> Shape {
        let len = pages * PAGE;
        // SAFETY: a fresh mapping the kernel places; nothing refers to it.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len + align,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                0,
            )
        };
        assert_ne!(raw, libc::MAP_FAILED, "mmap of the {name} region");
        let at = (raw as usize).next_multiple_of(align.max(PAGE)) as *mut u8;
        if advice == LOCK {
            // SAFETY: locks part of the mapping just made.
            let r = unsafe { libc::mlock(at.cast(), len) };
            assert_eq!(r, 0, "mlock of the {name} region");
        } else if advice != 0 {
            // SAFETY: advice on part of the mapping just made.
            let r = unsafe { libc::madvise(at.cast(), len, advice) };
            assert_eq!(r, 0, "madvise of the {name} region");
        }
        let shape = Shape {
            name,
            id,
            at,
            versions: vec![0; pages],
            flag: None,
        };
        for k in 0..pages {
            pattern(shape.page(k), id + k as u64, 0);
        }
        shape
    }

    #[allow(clippy::mut_from_ref)]
    fn page(&self, k: usize) -> &mut [u8] {
        // SAFETY: `at` is a live mapping of `versions.len()` pages owned by
        // this Shape (never unmapped), and callers never hold two of these
        // slices at once.
        unsafe { std::slice::from_raw_parts_mut(self.at.add(k * PAGE), PAGE) }
    }

    fn flagged(mut self, flag: &'static str) -> Shape {
        self.flag = Some(flag);
        self
    }

    /// Whether smaps shows its flag on the mapping holding it (`None`:
    /// yes, or it has none).
    fn flag_missing(&self, smaps: &str) -> Option<String> {
        let flag = self.flag?;
        let at = self.at as u64;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                if inside {
                    return (!flags.split_whitespace().any(|f| f == flag))
                        .then(|| format!("{} region lost {flag:?}: {}", self.name, flags.trim()));
                }
            } else if let Some((range, _)) = line.split_once(' ')
                && let Some((a, b)) = range.split_once('-')
                && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
            {
                inside = a <= at && at < b;
            }
        }
        Some(format!("{} region not in smaps", self.name))
    }

    /// The kinds of `--shapes`, and a private mapping of `private_file`.
    fn all(private_file: Option<&std::path::Path>) -> Vec<Shape> {
        let private = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        let shared = libc::MAP_SHARED | libc::MAP_ANONYMOUS;
        // SAFETY: creates a memfd, or returns -1.
        let memfd = unsafe { libc::memfd_create(c"ferry-memwriter".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(memfd >= 0, "memfd_create");
        // SAFETY: sizes the memfd just made.
        assert_eq!(unsafe { libc::ftruncate(memfd, 1 << 20) }, 0);
        let mut shapes = vec![
            Shape::map(
                "huge-page",
                2 << 40,
                2048,
                private,
                -1,
                2 << 20,
                libc::MADV_HUGEPAGE,
            )
            .flagged("hg"),
            Shape::map("shared", 3 << 40, 256, shared, -1, PAGE, 0),
            Shape::map("memfd", 4 << 40, 256, libc::MAP_SHARED, memfd, PAGE, 0),
            // Advice and a lock, which the dump reads among the mappings'
            // flags and the restore applies again.
            Shape::map(
                "dontdump",
                5 << 40,
                16,
                private,
                -1,
                PAGE,
                libc::MADV_DONTDUMP,
            )
            .flagged("dd"),
            Shape::map(
                "wipeonfork",
                6 << 40,
                16,
                private,
                -1,
                PAGE,
                libc::MADV_WIPEONFORK,
            )
            .flagged("wf"),
            Shape::map("random", 7 << 40, 16, private, -1, PAGE, libc::MADV_RANDOM).flagged("rr"),
            Shape::map("locked", 8 << 40, 16, private, -1, PAGE, LOCK).flagged("lo"),
        ];
        if let Some(path) = private_file {
            // Readable: a private writable mapping reads the file.
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(path)
                .expect("creating the private file");
            file.set_len(1 << 20).expect("sizing the private file");
            // The mapping keeps the file open; the descriptor may go.
            shapes.push(Shape::map(
                "private-file",
                9 << 40,
                256,
                libc::MAP_PRIVATE,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                PAGE,
                0,
            ));
        }
        shapes
    }
}

/// A child sharing memory with the writer (`--child`): a page of shared
/// anonymous memory and a page of a memfd, both mapped before the fork. At
/// each check the writer puts a fresh value in both and the child, asked
/// over a pipe, reads them back: a migration that gave either process a
/// copy of its own instead of the one shared page shows as a mismatch.
struct Child {
    anon: *mut u64,
    memfd: *mut u64,
    /// The writer's ends: asks to the child, answers from it.
    ask: std::fs::File,
    answer: std::fs::File,
    value: u64,
}

impl Child {
    fn fork() -> Child {
        use std::io::Read;
        use std::os::fd::{FromRawFd, OwnedFd};
        // SAFETY: creates a memfd, or returns -1.
        let memfd =
            unsafe { libc::memfd_create(c"ferry-memwriter-tree".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(memfd >= 0, "memfd_create");
        // SAFETY: `memfd` was just returned to us and is owned by nothing
        // else; the mapping below keeps the memfd alive once it drops.
        let memfd = unsafe { OwnedFd::from_raw_fd(memfd) };
        let fd = std::os::fd::AsRawFd::as_raw_fd(&memfd);
        // SAFETY: sizes the memfd just made.
        let sized = unsafe { libc::ftruncate(fd, PAGE as i64) };
        assert_eq!(sized, 0, "sizing the memfd");
        let map = |flags: i32, fd: i32| {
            // SAFETY: a fresh one-page mapping the kernel places.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    PAGE,
                    libc::PROT_READ | libc::PROT_WRITE,
                    flags,
                    fd,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED, "mmap of a page shared with the child");
            p.cast::<u64>()
        };
        let anon = map(libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1);
        let memfd = map(libc::MAP_SHARED, fd);
        let (ask_r, ask_w) = nix::unistd::pipe().expect("pipe");
        let (answer_r, answer_w) = nix::unistd::pipe().expect("pipe");
        // SAFETY: the writer has one thread (it forks before it listens),
        // so the child may go on with anything; it only reads its pipe
        // and the two pages, and leaves by _exit.
        match unsafe { libc::fork() } {
            -1 => panic!("fork: {}", std::io::Error::last_os_error()),
            0 => {
                drop((ask_w, answer_r));
                let mut ask = std::fs::File::from(ask_r);
                let mut answer = std::fs::File::from(answer_w);
                let mut buf = [0u8; 8];
                // Until the writer goes (end of file).
                while ask.read_exact(&mut buf).is_ok() {
                    // SAFETY: reads the two pages mapped before the fork,
                    // which the child keeps.
                    let seen = unsafe {
                        [
                            std::ptr::read_volatile(anon),
                            std::ptr::read_volatile(memfd),
                        ]
                    };
                    let mut out = [0u8; 16];
                    out[..8].copy_from_slice(&seen[0].to_le_bytes());
                    out[8..].copy_from_slice(&seen[1].to_le_bytes());
                    if answer.write_all(&out).is_err() {
                        break;
                    }
                }
                // SAFETY: leaves the child without running the writer's
                // exit handlers.
                unsafe { libc::_exit(0) }
            }
            _ => Child {
                anon,
                memfd,
                ask: std::fs::File::from(ask_w),
                answer: std::fs::File::from(answer_r),
                value: 0,
            },
        }
    }

    /// What is wrong with the shared pages, if anything.
    fn check(&mut self) -> Option<String> {
        use std::io::Read;
        self.value = self.value.wrapping_add(0x9e37_79b9_7f4a_7c15);
        // SAFETY: writes the two pages mapped in `fork`, which the writer
        // keeps.
        unsafe {
            std::ptr::write_volatile(self.anon, self.value);
            std::ptr::write_volatile(self.memfd, !self.value);
        }
        let mut seen = [0u8; 16];
        if let Err(e) = self
            .ask
            .write_all(&self.value.to_le_bytes())
            .and_then(|()| self.answer.read_exact(&mut seen))
        {
            return Some(format!("bad child: {e}"));
        }
        let anon = u64::from_le_bytes(seen[..8].try_into().unwrap());
        let memfd = u64::from_le_bytes(seen[8..].try_into().unwrap());
        if anon != self.value {
            return Some(format!(
                "bad shared page: the child sees {anon:#x}, not {:#x}",
                self.value
            ));
        }
        if memfd != !self.value {
            return Some(format!(
                "bad memfd page: the child sees {memfd:#x}, not {:#x}",
                !self.value
            ));
        }
        None
    }
}

struct Memory {
    pages: Vec<u8>,
    versions: Vec<u64>,
    side: Side,
    shapes: Vec<Shape>,
    child: Option<Child>,
    /// Memory added by the `grow` command (a process that grows while it
    /// migrates), each page written once and checked like the rest.
    grown: Vec<u8>,
    guards: Option<Guards>,
    writes: u64,
    rng: u64,
    pipe: (std::fs::File, std::fs::File),
}

impl Memory {
    fn page(&mut self, i: usize) -> &mut [u8] {
        &mut self.pages[i * PAGE..(i + 1) * PAGE]
    }

    fn next(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    fn write_one(&mut self, args: &Args, scratch: &mut [u8]) {
        let n = self.versions.len() as u64;
        let hot = (n * u64::from(args.hot_percent) / 100).max(1);
        let i = if self.next() % 100 < u64::from(args.hot_share) {
            self.next() % hot
        } else {
            self.next() % n
        } as usize;
        self.versions[i] += 1;
        let v = self.versions[i];
        if self.next().is_multiple_of(10) {
            // Through the kernel: the page is written by read(2).
            use std::io::Read;
            pattern(scratch, i as u64, v);
            self.pipe.1.write_all(scratch).expect("pipe write");
            let (r, page) = (&mut self.pipe.0, &mut self.pages[i * PAGE..(i + 1) * PAGE]);
            r.read_exact(page).expect("pipe read");
        } else {
            pattern(self.page(i), i as u64, v);
        }
        self.writes += 1;
    }

    /// Rewrites one page of one of the other kinds.
    fn write_shape(&mut self) {
        if self.shapes.is_empty() {
            return;
        }
        let which = (self.next() % self.shapes.len() as u64) as usize;
        let k = (self.next() % self.shapes[which].versions.len() as u64) as usize;
        let shape = &mut self.shapes[which];
        shape.versions[k] += 1;
        pattern(shape.page(k), shape.id + k as u64, shape.versions[k]);
    }

    /// Adds `mib` MiB, each page written with its pattern.
    fn grow(&mut self, mib: usize) -> String {
        let first = self.grown.len() / PAGE;
        let added = (mib << 20) / PAGE;
        self.grown.resize((first + added) * PAGE, 0);
        for k in first..first + added {
            pattern(
                &mut self.grown[k * PAGE..(k + 1) * PAGE],
                GROWN_ID + k as u64,
                0,
            );
        }
        format!("grown {}", self.grown.len() / PAGE)
    }

    fn check(&mut self, scratch: &mut [u8]) -> String {
        if let Some(bad) = self.guards.as_ref().and_then(|g| g.check(scratch)) {
            return bad;
        }
        for k in 0..self.grown.len() / PAGE {
            pattern(scratch, GROWN_ID + k as u64, 0);
            if self.grown[k * PAGE..(k + 1) * PAGE] != *scratch {
                return format!("bad grown page {k}");
            }
        }
        for i in 0..self.versions.len() {
            pattern(scratch, i as u64, self.versions[i]);
            if self.page(i) != scratch {
                return format!("bad page {i} version {}", self.versions[i]);
            }
        }
        for k in 0..SIDE_PAGES {
            pattern(scratch, SIDE_ID + k as u64, self.side.generation);
            if self.side.page(k) != scratch {
                return format!("bad side page {k} generation {}", self.side.generation);
            }
        }
        let mut pages = self.versions.len() + SIDE_PAGES + self.grown.len() / PAGE;
        if self.shapes.iter().any(|s| s.flag.is_some()) {
            let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
            if let Some(bad) = self.shapes.iter().find_map(|s| s.flag_missing(&smaps)) {
                return format!("bad {bad}");
            }
        }
        for shape in &self.shapes {
            for (k, v) in shape.versions.iter().enumerate() {
                pattern(scratch, shape.id + k as u64, *v);
                if shape.page(k) != scratch {
                    return format!("bad {} page {k} version {v}", shape.name);
                }
            }
            pages += shape.versions.len();
        }
        if let Some(bad) = self.child.as_mut().and_then(Child::check) {
            return bad;
        }
        format!("ok {} {}", self.writes, pages)
    }
}

fn serve(stream: TcpStream, mem: &mut Memory, scratch: &mut [u8]) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut line = String::new();
    let mut reader = BufReader::new(&stream);
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let answer = match line.trim() {
        "check" => mem.check(scratch),
        "stats" => format!("writes {}", mem.writes),
        "guard" => match mem.guards.as_mut() {
            Some(g) => g.install(),
            None => "no guard region (--guard-region)".into(),
        },
        grow if grow.starts_with("grow ") => match grow["grow ".len()..].parse() {
            Ok(mib) => mem.grow(mib),
            Err(e) => format!("bad size {grow:?}: {e}"),
        },
        other => format!("unknown command {other:?}"),
    };
    let _ = (&stream).write_all(format!("{answer}\n").as_bytes());
}

fn main() {
    let args = Args::parse();
    let bytes = args.kib.map(|k| k << 10).unwrap_or(args.mib << 20);
    let n = (bytes / PAGE).max(1);
    let (r, w) = nix::unistd::pipe().expect("pipe");
    let mut mem = Memory {
        pages: vec![0u8; n * PAGE],
        versions: vec![0; n],
        side: Side::map(0),
        shapes: if args.shapes {
            Shape::all(args.private_file.as_deref())
        } else {
            Vec::new()
        },
        child: args.child.then(Child::fork),
        grown: Vec::new(),
        guards: args.guard_region.then(Guards::map),
        writes: 0,
        rng: 0x2545_f491_4f6c_dd1d,
        pipe: (std::fs::File::from(r), std::fs::File::from(w)),
    };
    let mut scratch = vec![0u8; PAGE];
    for i in 0..n {
        pattern(mem.page(i), i as u64, 0);
    }
    // Listening means ready: all of the memory written once.
    let listener = TcpListener::bind(("0.0.0.0", args.port)).expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let mut side_remapped = Instant::now();
    let getpid = args.mode == "getpid";
    loop {
        if getpid {
            for _ in 0..1000 {
                // SAFETY: getpid takes nothing and cannot fail.
                std::hint::black_box(unsafe { libc::getpid() });
            }
        } else {
            for _ in 0..args.writes_per_ms {
                mem.write_one(&args, &mut scratch);
            }
        }
        if !getpid && args.writes_per_ms > 0 {
            mem.write_shape();
        }
        if !getpid && side_remapped.elapsed() >= Duration::from_millis(200) {
            mem.side.remap();
            side_remapped = Instant::now();
        }
        match listener.accept() {
            Ok((stream, _)) => serve(stream, &mut mem, &mut scratch),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => eprintln!("accept: {e}"),
        }
        if !args.busy {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
