//! The filler against a real userfaultfd: this test process plays the
//! restored task (its own anonymous memory, registered for missing
//! pages) and, on its main thread, faults, discards, unmaps and moves
//! memory while the filler runs on another.

use super::*;
use crate::fill::TaskPlan;
use std::os::fd::{FromRawFd, OwnedFd};

const PAGES: u64 = 1024;

/// What the store holds for the page at `addr`.
fn pattern(addr: u64) -> u8 {
    (addr >> 12) as u8 ^ 0x5a
}

fn map(len: u64) -> u64 {
    // SAFETY: a new private anonymous mapping; the kernel picks where.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    p as u64
}

fn byte(addr: u64) -> u8 {
    // SAFETY: reads one byte of a mapping this test made and keeps.
    unsafe { std::ptr::read_volatile(addr as *const u8) }
}

/// Set in the process of its own that runs a test needing one.
const ISOLATED: &str = "FERRY_TEST_ISOLATED";

/// Runs test `name` of this binary alone in a new process (the test
/// harness's own, filtered to it) and asserts it passed.
fn in_a_process_of_its_own(name: &str) {
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--test-threads", "1"])
        .env(ISOLATED, "1")
        .status()
        .unwrap();
    assert!(
        status.success(),
        "{name}, run in a process of its own: {status}"
    );
}

/// A store file (memfd) as large as any address.
fn empty_store() -> File {
    // SAFETY: a new memfd, or -1.
    let raw = unsafe { libc::memfd_create(c"test-store".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(raw >= 0, "{}", std::io::Error::last_os_error());
    // SAFETY: just returned to us.
    let store = unsafe { File::from_raw_fd(raw) };
    store.set_len(1 << 47).unwrap();
    store
}

/// A plan for task 1: one window `[base, base + len)` of store 0, pages
/// to install in `run`.
fn one_task(base: u64, len: u64, run: (u64, u64), follows: bool, workers: usize) -> Plan {
    Plan {
        migration_id: "t".into(),
        workers,
        follows,
        tasks: vec![TaskPlan {
            vpid: 1,
            store: 0,
            windows: vec![(base, base + len)],
            runs: vec![run],
        }],
    }
}

/// A new area of `len` bytes of this process, registered for missing
/// pages on a userfaultfd with the filler's features: (its address, the
/// userfaultfd a restore would hand over).
fn registered_area(len: u64) -> (u64, OwnedFd) {
    let base = map(len);
    let uffd = fill_uffd();
    uffd::register_missing(uffd.as_fd(), base, base + len).unwrap();
    (base, uffd)
}

/// A userfaultfd of this process with the filler's features.
fn fill_uffd() -> OwnedFd {
    // SAFETY: userfaultfd takes flags and returns a descriptor or -1.
    let raw = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    assert!(raw >= 0, "{}", std::io::Error::last_os_error());
    // SAFETY: just returned to us.
    let uffd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
    uffd::api(uffd.as_fd(), uffd::FILL_FEATURES).unwrap();
    uffd
}

#[test]
fn installs_pages_as_they_arrive_and_asks_for_faulted_ones_first() {
    // Fork events, as below: alone in its process.
    if std::env::var_os(ISOLATED).is_none() {
        return in_a_process_of_its_own(
            "fill::filler::tests::installs_pages_as_they_arrive_and_asks_for_faulted_ones_first",
        );
    }
    use std::os::unix::fs::FileExt;
    let page = memtrack::page_size();
    let len = PAGES * page;
    let (base, uffd) = registered_area(len);
    let at = |i: u64| base + i * page;
    let store = empty_store();
    let feed = store.try_clone().unwrap();
    let plan = one_task(base, len, (base, base + len), true, 2);
    let filler = Filler::new(plan, vec![store]).unwrap();
    let (ours, theirs) = control::pair().unwrap();
    // Arrived before the task's userfaultfd: installable at once.
    feed.write_all_at(&vec![pattern(at(0)); page as usize], at(0))
        .unwrap();
    std::thread::scope(|s| {
        let running = s.spawn(|| filler.run(theirs.as_fd()));
        control::send_to_filler(
            ours.as_fd(),
            &ToFiller::Arrived {
                vpid: 1,
                ranges: vec![(at(0), at(1))],
            },
        )
        .unwrap();
        control::send_to_filler(
            ours.as_fd(),
            &ToFiller::Uffd {
                vpid: 1,
                uffd: uffd.try_clone().unwrap(),
            },
        )
        .unwrap();
        control::send_to_filler(ours.as_fd(), &ToFiller::RestoreFinished).unwrap();
        control::send_to_filler(ours.as_fd(), &ToFiller::Resumed).unwrap();
        // The source: sends from the last page down, slowly, and what
        // is asked for first.
        let source = s.spawn(|| {
            let mut sent = RangeSet::new();
            sent.insert(at(0), at(1));
            let mut wants = Vec::new();
            let mut next = PAGES;
            let send = |sent: &mut RangeSet, a: u64, b: u64| {
                let mut fresh = RangeSet::new();
                fresh.insert(a, b);
                fresh.remove_all(sent);
                for (x, y) in fresh.iter() {
                    let data: Vec<u8> = (x..y)
                        .step_by(page as usize)
                        .flat_map(|p| vec![pattern(p); page as usize])
                        .collect();
                    feed.write_all_at(&data, x).unwrap();
                }
                let ranges: Vec<(u64, u64)> = fresh.iter().collect();
                sent.insert_all(&fresh);
                if !ranges.is_empty() {
                    control::send_to_filler(ours.as_fd(), &ToFiller::Arrived { vpid: 1, ranges })
                        .unwrap();
                }
            };
            while !sent.contains(base, base + len) {
                let mut p = [libc::pollfd {
                    fd: ours.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                }];
                // SAFETY: one valid pollfd.
                if unsafe { libc::poll(p.as_mut_ptr(), 1, 2) } > 0 {
                    match control::recv_from_filler(ours.as_fd()).unwrap() {
                        Some(FromFiller::Want {
                            vpid: 1,
                            start,
                            end,
                        }) => {
                            wants.push((start, end));
                            send(&mut sent, start, end);
                        }
                        other => panic!("{other:?}"),
                    }
                    continue;
                }
                // The low pages only once the fault asked: page 10 must
                // be asked for, however slow the test's main thread is.
                if next > 64 || (next > 0 && !wants.is_empty()) {
                    let from = next.saturating_sub(8);
                    send(&mut sent, at(from), at(next));
                    next = from;
                }
            }
            wants
        });
        // The first page arrived before the task: no wait.
        assert_eq!(byte(at(0)), pattern(at(0)));
        // Page 10 is far from the source's order: the fault asks.
        assert_eq!(byte(at(10)), pattern(at(10)));
        // A write to a page still to come lands on its content.
        // SAFETY: writes one byte of this test's own mapping.
        unsafe { std::ptr::write_volatile(at(20) as *mut u8, 0xee) };
        let wants = source.join().unwrap();
        assert!(
            wants.iter().any(|&(a, b)| a <= at(10) && at(11) <= b),
            "page 10 was never asked for first: {wants:?}"
        );
        let stats = running.join().unwrap().unwrap();
        assert!(stats.faults_on_arrival >= 1, "{stats:?}");
        assert_eq!(stats.pages, PAGES, "{stats:?}");
        assert_eq!(stats.zero_pages, 0, "{stats:?}");
        for i in 0..PAGES {
            let want = if i == 20 { 0xee } else { pattern(at(i)) };
            assert_eq!(byte(at(i)), want, "page {i}");
            assert_eq!(byte(at(i) + page - 1), pattern(at(i)), "page {i} end");
        }
    });
    drop(uffd);
}

#[test]
fn a_fill_whose_pages_stop_coming_fails() {
    // The source gone with pages still to come: the fill fails, for
    // ferryd to kill the process, which would wait or read zeros.
    let (base, len) = (0x7f00_0000_0000, PAGES * memtrack::page_size());
    let plan = one_task(base, len, (base, base + len), true, 1);
    let filler = Filler::new(plan, vec![empty_store()]).unwrap();
    let (ours, theirs) = control::pair().unwrap();
    let unregistered = fill_uffd();
    control::send_to_filler(
        ours.as_fd(),
        &ToFiller::Uffd {
            vpid: 1,
            uffd: unregistered,
        },
    )
    .unwrap();
    control::send_to_filler(ours.as_fd(), &ToFiller::RestoreFinished).unwrap();
    control::send_to_filler(ours.as_fd(), &ToFiller::Resumed).unwrap();
    control::send_to_filler(
        ours.as_fd(),
        &ToFiller::Lost {
            why: "the link is cut".into(),
        },
    )
    .unwrap();
    let e = filler.run(theirs.as_fd()).unwrap_err();
    assert!(e.to_string().contains("the link is cut"), "{e}");
}

#[test]
fn a_fill_whose_ferryd_dies_with_pages_to_come_kills_the_process() {
    // ferryd killed during a post-copy fill: no page will arrive, and once
    // the filler exits no one holds the userfaultfd (the missing pages
    // would read as zeros): the filler fails and kills the tasks it was
    // handed. A `sleep` stands for the restored task.
    let (base, len) = (0x7f00_0000_0000, PAGES * memtrack::page_size());
    let plan = one_task(base, len, (base, base + len), true, 1);
    let filler = Filler::new(plan, vec![empty_store()]).unwrap();
    let (ours, theirs) = control::pair().unwrap();
    let mut task = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let pidfd = crate::process::pidfd::open(task.id() as i32).unwrap();
    for m in [
        ToFiller::Uffd {
            vpid: 1,
            uffd: fill_uffd(),
        },
        ToFiller::Guard {
            pid: task.id() as i32,
            pidfd,
        },
        ToFiller::RestoreFinished,
        ToFiller::Resumed,
    ] {
        control::send_to_filler(ours.as_fd(), &m).unwrap();
    }
    drop(ours);
    let e = filler.run(theirs.as_fd()).unwrap_err();
    assert!(e.to_string().contains("pages still to come"), "{e}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(task.wait().unwrap().signal(), Some(libc::SIGKILL));
}

#[test]
fn a_fill_from_the_store_goes_on_without_ferryd() {
    // Pre-copy's pages are all in the store: ferryd gone changes nothing,
    // and the task handed over is not killed.
    if std::env::var_os(ISOLATED).is_none() {
        return in_a_process_of_its_own(
            "fill::filler::tests::a_fill_from_the_store_goes_on_without_ferryd",
        );
    }
    use std::os::unix::fs::FileExt;
    let page = memtrack::page_size();
    let len = 16 * page;
    let (base, uffd) = registered_area(len);
    let store = empty_store();
    for i in 0..16 {
        let a = base + i * page;
        store
            .write_all_at(&vec![pattern(a); page as usize], a)
            .unwrap();
    }
    let filler = Filler::new(
        one_task(base, len, (base, base + len), false, 1),
        vec![store],
    )
    .unwrap();
    let (ours, theirs) = control::pair().unwrap();
    let mut task = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let pidfd = crate::process::pidfd::open(task.id() as i32).unwrap();
    for m in [
        ToFiller::Uffd { vpid: 1, uffd },
        ToFiller::Guard {
            pid: task.id() as i32,
            pidfd,
        },
        ToFiller::RestoreFinished,
        ToFiller::Resumed,
    ] {
        control::send_to_filler(ours.as_fd(), &m).unwrap();
    }
    drop(ours);
    let stats = filler.run(theirs.as_fd()).unwrap();
    assert_eq!(stats.pages, 16);
    assert_eq!(stats.inline_pages, 0, "no fault, so the workers did it all");
    for i in 0..16 {
        let a = base + i * page;
        assert_eq!(byte(a), pattern(a));
    }
    assert!(task.try_wait().unwrap().is_none(), "the task was killed");
    task.kill().unwrap();
    task.wait().unwrap();
}

#[test]
fn fills_faulted_and_pending_pages_and_follows_the_areas() {
    // Its userfaultfd asks for fork events, which the kernel reports
    // for every fork of the whole process: another test's thread
    // forking meanwhile would wait on this one's reader, and hung
    // there once when the reader was gone. So the test runs alone.
    if std::env::var_os(ISOLATED).is_none() {
        return in_a_process_of_its_own(
            "fill::filler::tests::fills_faulted_and_pending_pages_and_follows_the_areas",
        );
    }
    let page = memtrack::page_size();
    let len = PAGES * page;
    let (base, uffd) = registered_area(len);
    let at = |i: u64| base + i * page;

    // The store: a page at the offset of its address; the first three
    // quarters are held, the rest the process never had.
    let store = empty_store();
    let held = PAGES * 3 / 4;
    for i in 0..held {
        use std::os::unix::fs::FileExt;
        store
            .write_all_at(&vec![pattern(at(i)); page as usize], at(i))
            .unwrap();
    }
    let plan = one_task(base, len, (base, at(held)), false, 2);
    let filler = Filler::new(plan, vec![store]).unwrap();
    let (ours, theirs) = control::pair().unwrap();
    std::thread::scope(|s| {
        let running = s.spawn(|| filler.run(theirs.as_fd()));
        control::send_to_filler(
            ours.as_fd(),
            &ToFiller::Uffd {
                vpid: 1,
                uffd: uffd.try_clone().unwrap(),
            },
        )
        .unwrap();
        // Before the restore finishes only faults are answered.
        assert_eq!(byte(at(5)), pattern(at(5)));
        assert_eq!(byte(at(held + 3)), 0, "never had: zeros");
        // A write to a missing page lands on its content, and stays.
        // SAFETY: writes one byte of this test's own mapping.
        unsafe { std::ptr::write_volatile(at(50) as *mut u8, 0xee) };
        // Discarded: reads as zeros, never filled.
        let (discard_at, discard_len) = (at(100) as *mut libc::c_void, (100 * page) as usize);
        // SAFETY: madvise on this test's own mapping.
        let discarded = unsafe { libc::madvise(discard_at, discard_len, libc::MADV_DONTNEED) };
        assert_eq!(discarded, 0);
        // Unmapped: left alone.
        // SAFETY: unmaps part of this test's own mapping.
        let unmapped = unsafe { libc::munmap(at(300) as *mut libc::c_void, discard_len) };
        assert_eq!(unmapped, 0);
        // Moved: the content follows to the new address.
        let elsewhere = map(100 * page);
        // SAFETY: moves part of this test's mapping over another of its
        // mappings.
        let moved = unsafe {
            libc::mremap(
                at(500) as *mut _,
                (100 * page) as usize,
                (100 * page) as usize,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                elsewhere as *mut libc::c_void,
            )
        };
        assert_eq!(moved as u64, elsewhere);
        // A fork: the child lacks the parent's missing pages too and
        // gets them from the same store, through the userfaultfd the
        // fork event brings (UFFD_FEATURE_EVENT_FORK).
        // SAFETY: the child only reads memory and calls _exit, both
        // async-signal-safe, so forking this multi-threaded process is
        // sound.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "{}", std::io::Error::last_os_error());
        if child == 0 {
            let skipped = |i: &u64| {
                *i == 50
                    || (100..200).contains(i)
                    || (300..400).contains(i)
                    || (500..600).contains(i)
            };
            let right = (0..held)
                .filter(|i| !skipped(i))
                .all(|i| byte(at(i)) == pattern(at(i)));
            // SAFETY: ends the child at once, nothing of the test run.
            unsafe { libc::_exit(if right { 0 } else { 1 }) };
        }
        let mut status = 0;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        // SAFETY: polls the child forked above.
        while unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) } == 0 {
            if std::time::Instant::now() > deadline {
                // SAFETY: kills and reaps the child forked above.
                unsafe {
                    libc::kill(child, libc::SIGKILL);
                    libc::waitpid(child, &mut status, 0);
                }
                panic!("the forked child never got its pages");
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the forked child read wrong pages (status {status:#x})"
        );
        control::send_to_filler(ours.as_fd(), &ToFiller::RestoreFinished).unwrap();
        control::send_to_filler(ours.as_fd(), &ToFiller::Resumed).unwrap();
        let stats = running.join().unwrap().unwrap();
        assert_eq!(stats.tasks, 2, "{stats:?}");
        assert!(stats.faults >= 3, "{stats:?}");
        assert_eq!(stats.zero_pages, 1, "{stats:?}");
        // The parent's discarded and unmapped pages, and whatever the
        // child had left when it ended.
        assert!(stats.dropped_pages >= 200, "{stats:?}");
        assert!(stats.pages + stats.dropped_pages >= held, "{stats:?}");
        // As ferryd does once the filler is done: the last copy of the
        // userfaultfd closes, and pages never had fault in as zeros.
        drop(uffd);

        for i in 0..PAGES {
            if (300..400).contains(&i) {
                continue;
            }
            let want = match i {
                50 => 0xee,
                100..200 => 0,
                500..600 => continue,
                i if i < held => pattern(at(i)),
                _ => 0,
            };
            assert_eq!(byte(at(i)), want, "page {i}");
            assert_eq!(
                byte(at(i) + page - 1),
                if i == 50 { pattern(at(50)) } else { want },
                "page {i} end"
            );
        }
        for k in 0..100 {
            assert_eq!(
                byte(elsewhere + k * page),
                pattern(at(500 + k)),
                "moved page {k}"
            );
        }
    });
}

#[test]
fn while_the_process_faults_the_event_loop_installs_between_its_answers() {
    // Fork events, as above: alone.
    if std::env::var_os(ISOLATED).is_none() {
        return in_a_process_of_its_own(
            "fill::filler::tests::while_the_process_faults_the_event_loop_installs_between_its_answers",
        );
    }
    use std::os::unix::fs::FileExt;
    let page = memtrack::page_size();
    let pages = 16 * 1024;
    let len = pages * page;
    let (base, uffd) = registered_area(len);
    let store = empty_store();
    let mut bytes = vec![0u8; len as usize];
    for i in 0..pages {
        let a = base + i * page;
        bytes[(i * page) as usize..((i + 1) * page) as usize].fill(pattern(a));
    }
    store.write_all_at(&bytes, base).unwrap();
    drop(bytes);
    let filler = Filler::new(
        one_task(base, len, (base, base + len), false, 2),
        vec![store],
    )
    .unwrap();
    let (ours, theirs) = control::pair().unwrap();
    std::thread::scope(|s| {
        let running = s.spawn(|| filler.run(theirs.as_fd()));
        for m in [
            ToFiller::Uffd { vpid: 1, uffd },
            ToFiller::RestoreFinished,
            ToFiller::Resumed,
        ] {
            control::send_to_filler(ours.as_fd(), &m).unwrap();
        }
        // The process reads its pages at random, as a key-value store
        // serving its clients does, until every page is in.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut reads = 0u64;
        while !running.is_finished() {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let a = base + (x >> 33) % pages * page;
            assert_eq!(byte(a + page / 2), pattern(a), "page at {a:#x}");
            reads += 1;
        }
        let stats = running.join().unwrap().unwrap();
        assert_eq!(stats.pages, pages, "{stats:?}");
        assert!(stats.faults > 0, "{stats:?}");
        assert!(
            stats.inline_pages > 0 && stats.inline_pages < pages,
            "the event loop installed between the faults, the workers the rest: {stats:?} ({reads} reads)"
        );
        for i in 0..pages {
            let a = base + i * page;
            assert_eq!(
                (byte(a), byte(a + page - 1)),
                (pattern(a), pattern(a)),
                "page {i}"
            );
        }
    });
}

/// Blocks the file holds, in bytes.
fn file_bytes(f: &File) -> u64 {
    use std::os::unix::fs::MetadataExt;
    f.metadata().unwrap().blocks() * 512
}

#[test]
fn installed_pages_leave_the_store_in_batches_and_all_at_its_end() {
    const MIB: u64 = 1 << 20;
    // SAFETY: memfd_create reads a NUL-terminated name and returns a new
    // descriptor or -1.
    let raw = unsafe { libc::memfd_create(c"store-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(raw >= 0);
    // SAFETY: a descriptor just returned to us, owned by nothing else.
    let file = unsafe { File::from_raw_fd(raw) };
    std::os::unix::fs::FileExt::write_all_at(&file, &vec![7u8; (12 * MIB) as usize], 0).unwrap();
    let watch = file.try_clone().unwrap();
    let small = Store::map(file.try_clone().unwrap(), &[(0, 12 * MIB)]).unwrap();
    // Windows of 12 MiB: batches of 512 KiB (a 32nd, at least 512 KiB).
    small.release(11 * MIB, 256 << 10);
    assert_eq!(file_bytes(&watch), 12 * MIB);
    small.release(11 * MIB + (256 << 10), 256 << 10);
    assert_eq!(file_bytes(&watch), 23 * MIB / 2);
    drop(small);
    std::os::unix::fs::FileExt::write_all_at(&file, &vec![7u8; (12 * MIB) as usize], 0).unwrap();
    // Windows of 256 MiB (the file behind them is 12): batches of 8 MiB.
    let store = Store::map(file, &[(0, 256 * MIB)]).unwrap();
    // Under a batch: nothing is freed yet.
    store.release(0, 4 * MIB);
    store.release(6 * MIB, 2 * MIB);
    assert_eq!(file_bytes(&watch), 12 * MIB);
    // A batch gathered: all of it goes, the rest stays.
    store.release(4 * MIB, 2 * MIB);
    assert_eq!(file_bytes(&watch), 4 * MIB);
    store.release(8 * MIB, MIB);
    assert_eq!(file_bytes(&watch), 4 * MIB);
    // The store's end frees what it still kept.
    drop(store);
    assert_eq!(file_bytes(&watch), 3 * MIB);
}
