//! Dirty tracking against a real process: a Python child that writes pages
//! of an anonymous mapping on command, in user mode, from the kernel
//! (`readv` into the mapping) and after `madvise(MADV_DONTNEED)`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use super::*;

const PAGES: u64 = 64;

const CHILD: &str = r#"
import mmap, ctypes, os, sys
P = mmap.PAGESIZE
mm = mmap.mmap(-1, 64 * P, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(64):
    mm[i * P:(i + 1) * P] = bytes([i]) * P
extra = None
print("%x" % ctypes.addressof(ctypes.c_char.from_buffer(mm)), flush=True)
for line in sys.stdin:
    w = line.split()
    if w[0] == "w":
        page, val = int(w[1]), int(w[2])
        mm[page * P + 17] = val
    elif w[0] == "k":
        # The kernel writes this page (copy_to_user), not the process.
        page = int(w[1])
        r, wr = os.pipe()
        os.write(wr, bytes([int(w[2])]) * 100)
        os.readv(r, [memoryview(mm)[page * P + 100:page * P + 200]])
        os.close(r); os.close(wr)
    elif w[0] == "d":
        page = int(w[1])
        mm.madvise(mmap.MADV_DONTNEED, page * P, P)
    elif w[0] == "c":
        # Another mapping, next to this one, replaced again and again by a
        # thread (as a process's scratch buffers are): unmapped and mapped
        # anew at the same place, so that it is new (not registered) at
        # any moment, and merged with this one whenever it is registered.
        import threading
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        FIXED_NOREPLACE, FIXED = 0x100000, 0x10
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        at = None
        for cand in (base + 64 * P, base - 4 * P):
            if libc.mmap(cand, 4 * P, 3, flags | FIXED_NOREPLACE, -1, 0) == cand:
                at = cand
                break
        assert at is not None
        def churn():
            while True:
                libc.munmap(at, 4 * P)
                libc.mmap(at, 4 * P, 3, flags | FIXED, -1, 0)
                ctypes.memset(at, 0x33, 4 * P)
        threading.Thread(target=churn, daemon=True).start()
    elif w[0] == "r":
        # The extra mapping replaced at its place by a new one (MAP_FIXED),
        # written with another byte: /proc/<pid>/maps may read the same.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        at = ctypes.addressof(ctypes.c_char.from_buffer(extra))
        assert libc.mmap(at, 4 * P, 3, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10, -1, 0) == at
        ctypes.memset(at, int(w[1]), 4 * P)
    elif w[0] == "m":
        extra = mmap.mmap(-1, 4 * P, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        extra[0:4 * P] = b"\x55" * (4 * P)
        print("%x" % ctypes.addressof(ctypes.c_char.from_buffer(extra)), flush=True)
        continue
    print("ok", flush=True)
"#;

struct Workload {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    base: u64,
}

impl Workload {
    fn spawn() -> Option<Self> {
        let mut child = match Command::new("python3")
            .args(["-c", CHILD])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
        {
            Ok(c) => c,
            Err(e) => {
                ferry_testkit::skip("memtrack", Some(format!("python3 not runnable: {e}")));
                return None;
            }
        };
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let base = u64::from_str_radix(line.trim(), 16).unwrap();
        Some(Workload {
            child,
            stdin,
            stdout,
            base,
        })
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().to_owned()
    }

    fn page(&self, i: u64) -> (u64, u64) {
        let p = page_size();
        (self.base + i * p, self.base + (i + 1) * p)
    }

    fn region(&self) -> (u64, u64) {
        (self.base, self.base + PAGES * page_size())
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn root() -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    !ferry_testkit::skip(
        "memtrack",
        (!root).then(|| "ptrace of a child and PAGEMAP_SCAN need root here".into()),
    )
}

/// Stops (`stop`) or resumes the workload, as the freeze does.
fn signal(pid: i32, stop: bool) {
    use nix::sys::signal::Signal::{SIGCONT, SIGSTOP};
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        if stop { SIGSTOP } else { SIGCONT },
    )
    .unwrap();
}

fn written_in(scan: &Scan, (start, end): (u64, u64)) -> Vec<(u64, u64)> {
    scan.written.within(start, end).iter().collect()
}

#[test]
fn reports_exactly_the_pages_written_between_scans() {
    if !root() {
        return;
    }
    let Some(mut w) = Workload::spawn() else {
        return;
    };
    let mut t = Tracker::start(w.pid()).unwrap();
    // Nothing of the injection is left in the process.
    for e in std::fs::read_dir(format!("/proc/{}/fd", w.pid())).unwrap() {
        let link = std::fs::read_link(e.unwrap().path()).unwrap();
        assert!(
            !link.to_string_lossy().contains("userfaultfd"),
            "{}",
            link.display()
        );
    }
    // The thread interrupted in read(2) goes on reading its commands.
    assert_eq!(w.ask("w 1 1"), "ok");

    // First scan: never protected, so all of it counts as written.
    let first = t.scan(true).unwrap();
    assert_eq!(written_in(&first, w.region()), [w.region()]);
    let quiet = t.scan(true).unwrap();
    assert_eq!(written_in(&quiet, w.region()), []);

    assert_eq!(w.ask("w 5 7"), "ok");
    let s = t.scan(true).unwrap();
    assert_eq!(written_in(&s, w.region()), [w.page(5)]);

    assert_eq!(w.ask("k 9 3"), "ok");
    assert_eq!(w.ask("w 40 3"), "ok");
    let s = t.scan(true).unwrap();
    assert_eq!(written_in(&s, w.region()), [w.page(9), w.page(40)]);

    // Dropped, then written again: reported again.
    assert_eq!(w.ask("d 12"), "ok");
    assert_eq!(w.ask("w 12 9"), "ok");
    let s = t.scan(true).unwrap();
    assert_eq!(written_in(&s, w.region()), [w.page(12)]);

    // A new mapping is all new.
    let extra = u64::from_str_radix(&w.ask("m"), 16).unwrap();
    let s = t.scan(true).unwrap();
    let p = page_size();
    assert!(s.stale.contains(extra, extra + 4 * p));
    assert!(s.written.contains(extra, extra + 4 * p));
    let s = t.scan(true).unwrap();
    assert_eq!(written_in(&s, (extra, extra + 4 * p)), []);

    t.stop();
    let maps = mappings(w.pid()).unwrap();
    assert!(maps.iter().all(|m| !m.uffd_wp), "{maps:?}");
    // Writes after the end go through as usual.
    assert_eq!(w.ask("w 5 8"), "ok");
    assert_eq!(w.ask("k 6 8"), "ok");
}

/// A pre-copy in miniature: rounds copy the written pages into a "remote"
/// copy; after the last, stopped, scan the copy equals the memory.
#[test]
fn a_copy_kept_from_the_scans_equals_the_memory() {
    if !root() {
        return;
    }
    let Some(mut w) = Workload::spawn() else {
        return;
    };
    let pid = w.pid();
    let p = page_size();
    let mut t = Tracker::start(pid).unwrap();
    let mut copy: HashMap<u64, Vec<u8>> = HashMap::new();
    let apply = |scan: &Scan, copy: &mut HashMap<u64, Vec<u8>>| {
        for (s, e) in scan.stale.iter() {
            let mut a = s;
            while a < e {
                copy.remove(&a);
                a += p;
            }
        }
        for (s, e) in scan.written.iter() {
            let mut a = s;
            while a < e {
                let mut buf = vec![0u8; p as usize];
                if read_remote(pid, a, &mut buf).unwrap_or(0) == buf.len() {
                    copy.insert(a, buf);
                }
                a += p;
            }
        }
    };
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for round in 0..12 {
        let s = t.scan(true).unwrap();
        apply(&s, &mut copy);
        for _ in 0..6 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let page = rng % PAGES;
            let cmd = match rng % 3 {
                0 => format!("w {page} {}", round + 1),
                1 => format!("k {page} {}", round + 1),
                _ => format!("d {page}"),
            };
            assert_eq!(w.ask(&cmd), "ok");
        }
    }
    signal(pid, true);
    let last = t.scan(false).unwrap();
    apply(&last, &mut copy);
    // What the engine keeps: pages still the process's own.
    let (start, end) = w.region();
    let mut region = RangeSet::new();
    region.insert(start, end);
    let own = t.own_pages(&region).unwrap();
    let mut a = start;
    let mut checked = 0;
    while a < end {
        if let Some(c) = copy.get(&a)
            && own.contains(a, a + p)
        {
            let mut now = vec![0u8; p as usize];
            assert_eq!(read_remote(pid, a, &mut now).unwrap(), now.len());
            assert!(c == &now, "page {} differs", (a - start) / p);
            checked += 1;
        }
        a += p;
    }
    assert!(checked > PAGES / 2, "only {checked} pages were in the copy");
    t.stop();
    signal(pid, false);
    assert_eq!(w.ask("w 3 3"), "ok");
}

#[test]
fn parses_smaps() {
    let text = "\
55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
VmFlags: rd wr mr mw me ac uw
7f0000000000-7f0000001000 r--s 00000000 00:1a 12 /dev/shm/x
VmFlags: rd sh mr mw me
7fff00000000-7fff00002000 r-xp 00000000 00:00 0                          [vdso]
VmFlags: rd ex mr mw me de sd
";
    let m = parse_smaps(text);
    assert_eq!(m.len(), 3);
    assert!(m[0].trackable() && !m[1].trackable());
    assert!(m[2].special && !m[2].trackable());
    assert_eq!(
        m[0],
        Mapping {
            start: 0x55d0_c000_0000,
            end: 0x55d0_c002_1000,
            writable: true,
            private: true,
            may_write: true,
            special: false,
            uffd_wp: true,
            vm_flags: ["rd", "wr", "mr", "mw", "me", "ac", "uw"]
                .map(str::to_owned)
                .into()
        }
    );
    assert!(!m[1].writable && !m[1].private && !m[1].uffd_wp);
}

/// A mapping replaced again and again next to a tracked one (merged with
/// it whenever the tracker registers it, new and unregistered the moment
/// after) leaves the tracked one's pages held: only what was written
/// counts as stale. (A scan that stopped at the new mapping once marked
/// the whole merged range stale, and a pre-copy then resent it all in the
/// freeze.)
#[test]
fn a_mapping_replaced_beside_a_tracked_one_does_not_make_it_stale() {
    if !root() {
        return;
    }
    let Some(mut w) = Workload::spawn() else {
        return;
    };
    let mut t = Tracker::start(w.pid()).unwrap();
    let first = t.scan(true).unwrap();
    assert_eq!(written_in(&first, w.region()), [w.region()]);
    assert_eq!(w.ask("c"), "ok");
    let (start, end) = w.region();
    for round in 0..300 {
        let s = t.scan(true).unwrap();
        let stale: Vec<_> = s.stale.within(start, end).iter().collect();
        assert!(
            stale.is_empty(),
            "scan {round}: {stale:x?} stale, nothing written"
        );
        if round % 50 == 49 {
            // A write still shows.
            assert_eq!(w.ask("w 7 1"), "ok");
            let s = t.scan(true).unwrap();
            assert_eq!(written_in(&s, w.region()), [w.page(7)]);
        }
    }
    t.stop();
}

/// A mapping replaced at its place between rounds: the rounds read smaps
/// (where a mapping's registration shows) only when /proc/<pid>/maps
/// changed, so one may pass over it; the last scan, the process stopped,
/// always reads smaps and finds all of it stale, so nothing the
/// destination held of the old mapping is kept.
#[test]
fn a_mapping_replaced_in_place_between_rounds_is_stale_by_the_last_scan() {
    if !root() {
        return;
    }
    let Some(mut w) = Workload::spawn() else {
        return;
    };
    let pid = w.pid();
    let p = page_size();
    let mut t = Tracker::start(pid).unwrap();
    let extra = u64::from_str_radix(&w.ask("m"), 16).unwrap();
    let s = t.scan(true).unwrap();
    assert!(s.written.contains(extra, extra + 4 * p));
    let s = t.scan(true).unwrap();
    assert_eq!(written_in(&s, (extra, extra + 4 * p)), []);
    assert_eq!(w.ask("r 119"), "ok");
    let round = t.scan(true).unwrap();
    signal(pid, true);
    let last = t.scan(false).unwrap();
    signal(pid, false);
    assert!(
        last.stale.contains(extra, extra + 4 * p)
            || round.stale.contains(extra, extra + 4 * p)
                && round.written.contains(extra, extra + 4 * p),
        "the replaced mapping was neither sent again by the round nor stale at the last scan"
    );
    t.stop();
}
