//! The filler itself: the event loop over the restored tasks'
//! userfaultfds and the workers that install the pending pages (see the
//! module above for the design).

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use super::control::{self, FromFiller, ToFiller};
use super::pending::{Chunk, Pending};
use super::{FillError, FillStats, Plan};
use crate::memtrack::{self, RangeSet};
use crate::process::nice::{self, ThreadNice};
use crate::uffd::{self, Installed, Message};
use store::Store;

mod store;

/// Bytes a worker installs at once: large enough for memory speed, small
/// enough that a fault waits little for the gate (about a tenth of a
/// millisecond here).
const CHUNK: u64 = 512 << 10;
/// Pages installed at a fault: the faulting page and the pending ones after
/// it, for a process that reads on.
const FAULT_PAGES: u64 = 16;
/// While the process faults, the workers stand aside (until this long
/// after its last fault) and the event loop installs the pending pages
/// itself, this much between two looks at the userfaultfds. A fault then
/// waits for at most that copy (~40 µs here), not for the workers' chunks
/// to leave the gate and the event loop to get a core back: with two
/// workers on two cores, a Redis serving 1,000 clients from a 1 GiB data
/// set faulted ~1,100 times in a 550 ms fill and waited 160 µs a fault for
/// the gate alone, so its clients waited out the whole fill.
const INLINE_CHUNK: u64 = 64 << 10;
const STAND_ASIDE: Duration = Duration::from_millis(5);
/// How long the event loop sleeps at most between looks at the workers.
const POLL_MS: i32 = 50;
/// Pages asked for first at a fault on pages still to come: the faulting
/// page and those after it, for a process that reads on.
const WANT_PAGES: u64 = 64;

/// One task being filled.
struct Task {
    uffd: OwnedFd,
    /// Its store's task in the plan (a forked child's is its parent's).
    vpid: i32,
    store: Option<Arc<Store>>,
    /// In the store, to install.
    pending: Pending,
    /// Not in the store yet (a plan whose pages follow): moves to
    /// `pending` as it arrives.
    coming: Pending,
    /// Its memory is gone (it exited).
    gone: bool,
}

/// A page fault waiting for its page to arrive in the store.
#[derive(Debug, Clone, Copy)]
struct Fault {
    task: usize,
    address: u64,
    /// When the filler read it.
    since: Instant,
}

#[derive(Default)]
struct State {
    tasks: Vec<Task>,
    /// A plan whose pages follow: per store (by its task), the offsets
    /// that arrived, and those asked for first.
    arrived: HashMap<i32, RangeSet>,
    wanted: HashMap<i32, RangeSet>,
    /// Asks for ferryd, sent by the event loop.
    wants: Vec<(i32, u64, u64)>,
    /// Faults waiting for their pages to arrive.
    parked: Vec<Fault>,
    restore_finished: Option<Instant>,
    /// A task forked: several tasks may take the same store pages, which
    /// are no longer released once installed.
    forked: bool,
    /// Chunks a worker took and has not given back.
    in_flight: usize,
    /// Round robin over the tasks.
    next: usize,
    stats: FillStats,
    failed: Option<String>,
    /// The restored tree's tasks, by pidfd (host PID beside it, for the
    /// log), killed should the fill fail.
    guards: Vec<(i32, OwnedFd)>,
}

impl State {
    fn all_done(&self) -> bool {
        self.restore_finished.is_some()
            && self.in_flight == 0
            && self
                .tasks
                .iter()
                .all(|t| t.gone || (t.pending.is_empty() && t.coming.is_empty()))
    }

    /// Whether pages are still to arrive for a live task.
    fn awaiting(&self) -> bool {
        self.tasks.iter().any(|t| !t.gone && !t.coming.is_empty())
    }

    /// Store offsets `ranges` of task `vpid`'s store arrived: what its
    /// tasks still lack there becomes installable, and the faults waiting
    /// are tried again.
    fn arrive(&mut self, vpid: i32, ranges: &[(u64, u64)]) {
        let arrived = self.arrived.entry(vpid).or_default();
        for &(a, b) in ranges {
            arrived.insert(a, b);
        }
        for t in self.tasks.iter_mut().filter(|t| t.vpid == vpid && !t.gone) {
            for &(a, b) in ranges {
                for c in t.coming.extract_stored(a, b) {
                    t.pending.put_back(c);
                }
            }
        }
    }

    /// Whether a live task still has pages pending or to come.
    fn anything_left(&self) -> bool {
        self.tasks
            .iter()
            .any(|t| !t.gone && (!t.pending.is_empty() || !t.coming.is_empty()))
    }

    /// A chunk of at most `size` bytes to install, with what installing
    /// it needs: the task's index, its store and its userfaultfd.
    fn job(&mut self, size: u64) -> Option<(usize, Chunk, Arc<Store>, i32)> {
        let (i, c) = self.pick(size)?;
        let t = &self.tasks[i];
        let store = t.store.clone().expect("picked tasks have a store");
        Some((i, c, store, t.uffd.as_raw_fd()))
    }

    /// A chunk of at most `size` bytes: from the next task with pages
    /// pending.
    fn pick(&mut self, size: u64) -> Option<(usize, Chunk)> {
        let n = self.tasks.len();
        for k in 0..n {
            let i = (self.next + k) % n;
            let t = &mut self.tasks[i];
            if t.gone || t.store.is_none() {
                continue;
            }
            if let Some(c) = t.pending.take_first(size) {
                self.next = (i + 1) % n;
                self.in_flight += 1;
                return Some((i, c));
            }
        }
        None
    }
}

/// What installing a chunk did.
#[derive(Debug, Default)]
struct Outcome {
    installed: u64,
    /// Pages found already there (never overwritten).
    existing: u64,
    /// Pages whose area is gone.
    dropped: u64,
    /// What is left to do later (the areas are changing).
    rest: Option<Chunk>,
    /// The task's memory is gone.
    gone: bool,
}

/// Installs `c` from `store` into the process of `uffd`; a chunk that
/// spans areas split since the plan (an `mprotect` of part of an area sends
/// no message) goes page by page.
fn install(uffd: BorrowedFd<'_>, store: &Store, mut c: Chunk) -> Result<Outcome, FillError> {
    let page = memtrack::page_size();
    let mut out = Outcome::default();
    let mut pagewise = false;
    if let Some(src) = store.src(c.src, c.len) {
        Store::populate(src, c.len);
    }
    while c.len > 0 {
        let len = if pagewise { page } else { c.len };
        let src = store.src(c.src, len).ok_or_else(|| {
            FillError::Plan(format!(
                "store offset {:#x}+{len} is outside every window",
                c.src
            ))
        })?;
        // SAFETY: `src..src + len` is inside a mapped window of `store`,
        // which the caller keeps alive.
        let r = unsafe { uffd::copy(uffd, c.dst, src, len) }.map_err(FillError::io(format!(
            "installing {len} bytes at {:#x}",
            c.dst
        )))?;
        if r != Installed::All {
            tracing::debug!(dst = format_args!("{:#x}", c.dst), len, ?r, "install");
        }
        match r {
            Installed::All => {
                out.installed += len;
                c = c.after(len);
            }
            Installed::Exists { done } => {
                out.installed += done;
                out.existing += page;
                c = c.after((done + page).min(c.len));
            }
            Installed::Changing { done } => {
                out.installed += done;
                out.rest = Some(c.after(done));
                return Ok(out);
            }
            Installed::NoArea { done } => {
                out.installed += done;
                c = c.after(done);
                if pagewise || c.len <= page {
                    out.dropped += page.min(c.len);
                    c = c.after(page.min(c.len));
                } else {
                    pagewise = true;
                }
            }
            Installed::Gone => {
                out.gone = true;
                return Ok(out);
            }
        }
    }
    Ok(out)
}

/// Books an outcome; returns whether a fault's page is now in.
fn book(st: &mut State, i: usize, taken: Chunk, out: &Outcome, at_fault: bool) {
    let page = memtrack::page_size();
    st.stats.pages += out.installed / page;
    if at_fault {
        st.stats.fault_pages += out.installed / page;
    }
    st.stats.dropped_pages += out.dropped / page;
    let forked = st.forked;
    if out.gone {
        let t = &mut st.tasks[i];
        let lost =
            (taken.len - out.installed) / page + t.pending.bytes() / page + t.coming.bytes() / page;
        t.gone = true;
        t.pending = Pending::default();
        t.coming = Pending::default();
        st.stats.dropped_pages += lost;
        return;
    }
    let t = &mut st.tasks[i];
    let done = taken.len - out.rest.map_or(0, |r| r.len);
    if !forked && let Some(s) = &t.store {
        s.release(taken.src, done);
    }
    if let Some(rest) = out.rest {
        t.pending.put_back(rest);
    }
}

/// Drops `[start, end)` from `pending`; returns the bytes dropped.
fn drop_range(pending: &mut Pending, start: u64, end: u64) -> u64 {
    let before = pending.bytes();
    pending.remove(start, end);
    before - pending.bytes()
}

/// What became of a page fault.
enum Answer {
    Answered,
    /// The areas are changing: again after the next messages.
    Retry,
    /// Its page is still to come: again once it arrives.
    Parked,
}

/// The filler's shared state.
pub struct Filler {
    plan: Plan,
    stores: HashMap<u32, Arc<Store>>,
    state: Mutex<State>,
    /// Signalled when pages arrive (or the fill ends), for idle workers.
    arrivals: Condvar,
    /// Held shared by a worker for each chunk, exclusively while messages
    /// are read and handled.
    gate: RwLock<()>,
    /// When the process last faulted: microseconds since `started`, plus
    /// one (0: never).
    last_fault: AtomicU64,
    started: Instant,
    /// The nice value this process had, the workers' (the event loop runs
    /// ahead of them).
    base_nice: Option<i32>,
}

impl Filler {
    /// Maps the stores: `stores[i]` is the plan's store `i`.
    pub fn new(plan: Plan, stores: Vec<File>) -> Result<Self, FillError> {
        plan.check(memtrack::page_size())?;
        let mut files: Vec<Option<File>> = stores.into_iter().map(Some).collect();
        let mut mapped = HashMap::new();
        for t in &plan.tasks {
            let file = files
                .get_mut(t.store)
                .and_then(Option::take)
                .ok_or_else(|| {
                    FillError::Plan(format!("task {}: no store {} (or shared)", t.vpid, t.store))
                })?;
            mapped.insert(t.vpid, Arc::new(Store::map(file, &t.windows)?));
        }
        Ok(Filler {
            plan,
            stores: mapped,
            state: Mutex::new(State::default()),
            arrivals: Condvar::new(),
            gate: RwLock::new(()),
            last_fault: AtomicU64::new(0),
            started: Instant::now(),
            base_nice: nice::this_thread().map(|(_, n)| n),
        })
    }

    fn note_fault(&self) {
        let now = self.started.elapsed().as_micros() as u64 + 1;
        self.last_fault.store(now, Ordering::Relaxed);
    }

    /// While the process faults: how long the workers still stand aside.
    /// Not when its pages follow: its faults wait for pages from the
    /// source, not for the workers, and this node's cores are busy
    /// receiving them (standing aside slowed a 1 GiB post-copy fill by
    /// 7 %, with the same fault wait).
    fn standing_aside(&self) -> Option<Duration> {
        let last = self.last_fault.load(Ordering::Relaxed);
        if last == 0 || self.plan.follows {
            return None;
        }
        let since = self
            .started
            .elapsed()
            .saturating_sub(Duration::from_micros(last - 1));
        STAND_ASIDE.checked_sub(since).filter(|d| !d.is_zero())
    }

    fn add_task(&self, vpid: i32, uffd: OwnedFd) {
        let plan = u32::try_from(vpid)
            .ok()
            .and_then(|v| self.plan.tasks.iter().find(|t| t.vpid == v));
        let runs = plan.map_or_else(Pending::default, |t| Pending::new(t.runs.iter().copied()));
        let store = u32::try_from(vpid)
            .ok()
            .and_then(|v| self.stores.get(&v).cloned());
        let mut st = crate::sync::lock(&self.state);
        // Pages that follow: in the store only what arrived so far.
        let (pending, coming) = if self.plan.follows {
            let mut coming = runs;
            let mut pending = Pending::default();
            for (a, b) in st
                .arrived
                .get(&vpid)
                .map(|r| r.iter().collect::<Vec<_>>())
                .unwrap_or_default()
            {
                for c in coming.extract_stored(a, b) {
                    pending.put_back(c);
                }
            }
            (pending, coming)
        } else {
            (runs, Pending::default())
        };
        tracing::debug!(
            vpid,
            bytes = pending.bytes(),
            coming = coming.bytes(),
            "task arrived"
        );
        st.stats.tasks += 1;
        st.tasks.push(Task {
            uffd,
            vpid,
            store,
            pending,
            coming,
            gone: false,
        });
        drop(st);
        self.arrivals.notify_all();
    }

    /// Serves the tasks whose userfaultfds arrive on `ctl` until every
    /// pending page is in; returns how it went.
    pub fn run(&self, ctl: BorrowedFd<'_>) -> Result<FillStats, FillError> {
        let (wake_rx, wake_tx) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| FillError::io("creating the workers' pipe")(e.into()))?;
        std::thread::scope(|s| {
            let start_workers = || {
                for _ in 0..self.plan.workers.max(1) {
                    let tx = &wake_tx;
                    s.spawn(move || {
                        self.work();
                        let _ = nix::unistd::write(tx, b"w");
                    });
                }
            };
            let result = self.events(ctl, wake_rx.as_fd(), start_workers);
            if let Err(e) = &result {
                // The workers stop at their next chunk.
                crate::sync::lock(&self.state).failed = Some(e.to_string());
            }
            self.arrivals.notify_all();
            result
        })
        .inspect_err(|e| self.kill_guarded(e))?;
        let mut st = crate::sync::lock(&self.state);
        if let Some(started) = st.restore_finished {
            st.stats.fill_us = started.elapsed().as_micros() as u64;
        }
        // Closing the userfaultfds ends the registrations: a page the
        // process never had faults in as zeros from now on.
        let stats = st.stats;
        st.tasks.clear();
        Ok(stats)
    }

    /// The fill failed: kills the restored tree's tasks. ferryd kills the
    /// process too when it hears of the failure, and holds the
    /// userfaultfds meanwhile; but ferryd may be gone (killed during the
    /// fill), and once this process exits no one holds them: the pages
    /// not installed would read as zeros.
    fn kill_guarded(&self, why: &FillError) {
        let guards = std::mem::take(&mut crate::sync::lock(&self.state).guards);
        for (pid, pidfd) in &guards {
            match crate::process::pidfd::send_kill(pidfd.as_fd()) {
                Ok(()) => tracing::error!(pid, reason = %why, "fill failed: task killed"),
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => tracing::error!(pid, error = %e, "fill failed: killing a task"),
            }
        }
    }

    /// The event loop: control messages, the tasks' messages, until every
    /// pending page is in.
    fn events(
        &self,
        ctl: BorrowedFd<'_>,
        workers: BorrowedFd<'_>,
        start_workers: impl FnOnce(),
    ) -> Result<(), FillError> {
        // The process waits on this thread's answers: ahead of the node's
        // other work (the workers it starts set their own back). Not when
        // the pages follow: then ferryd's receiving of them is the work
        // the process waits on.
        let _ahead = (!self.plan.follows)
            .then(|| ThreadNice::raise(nice::AHEAD))
            .flatten();
        let mut ctl_open = true;
        let mut start_workers = Some(start_workers);
        let mut retry: Vec<Fault> = Vec::new();
        let mut inline_more = false;
        loop {
            {
                let st = crate::sync::lock(&self.state);
                if let Some(why) = &st.failed {
                    return Err(FillError::Failed(why.clone()));
                }
                if st.all_done() && retry.is_empty() {
                    return Ok(());
                }
            }
            let timeout = if inline_more {
                0
            } else if !retry.is_empty() {
                1
            } else {
                POLL_MS
            };
            let (ctl_ready, uffds_ready) = self.wait(ctl_open.then_some(ctl), workers, timeout)?;
            let woke = Instant::now();
            if ctl_ready {
                match control::recv_in_filler(ctl)? {
                    Some(ToFiller::Uffd { vpid, uffd }) => self.add_task(vpid, uffd),
                    Some(ToFiller::Guard { pid, pidfd }) => {
                        crate::sync::lock(&self.state).guards.push((pid, pidfd));
                    }
                    Some(ToFiller::RestoreFinished) => {
                        crate::sync::lock(&self.state).restore_finished = Some(Instant::now());
                    }
                    Some(ToFiller::Resumed) => {
                        if let Some(start) = start_workers.take() {
                            start();
                        }
                    }
                    Some(ToFiller::Arrived { vpid, ranges }) => {
                        let vpid = i32::try_from(vpid).map_err(|_| {
                            FillError::Protocol(format!("pages arrived for task {vpid}"))
                        })?;
                        let mut st = crate::sync::lock(&self.state);
                        st.arrive(vpid, &ranges);
                        let parked = std::mem::take(&mut st.parked);
                        drop(st);
                        retry.extend(parked);
                        self.arrivals.notify_all();
                    }
                    Some(ToFiller::Lost { why }) => {
                        if crate::sync::lock(&self.state).awaiting() {
                            return Err(FillError::Failed(format!(
                                "the pages still to come are lost: {why}"
                            )));
                        }
                    }
                    Some(m @ (ToFiller::Store { .. } | ToFiller::Plan { .. })) => {
                        return Err(FillError::Protocol(format!("{m:?} after the plan")));
                    }
                    None => {
                        ctl_open = false;
                        let st = crate::sync::lock(&self.state);
                        if st.restore_finished.is_none() {
                            return Err(FillError::Protocol(
                                "ferryd went away before the restore finished".into(),
                            ));
                        }
                        // No word of the resume will come: install on.
                        if let Some(start) = start_workers.take() {
                            start();
                        }
                        // Pages that follow come through ferryd: none
                        // will any more. (Pages in the stores go on.)
                        if st.awaiting() {
                            return Err(FillError::Failed(
                                "ferryd went away with pages still to come".into(),
                            ));
                        }
                    }
                }
            }
            if !uffds_ready.is_empty() || !retry.is_empty() {
                self.handle_messages(&uffds_ready, &mut retry, woke)?;
            }
            let resumed = start_workers.is_none();
            inline_more = resumed && self.standing_aside().is_some() && self.install_inline()?;
            let wants = std::mem::take(&mut crate::sync::lock(&self.state).wants);
            for (vpid, start, end) in wants {
                // A ferryd gone leaves the faults to the background order.
                if ctl_open {
                    let want = FromFiller::Want {
                        vpid: vpid as u32,
                        start,
                        end,
                    };
                    if let Err(e) = control::send_from_filler(ctl, &want) {
                        tracing::warn!(error = %e, "asking ferryd for pages first");
                    }
                }
            }
        }
    }

    /// Polls the control socket, the workers' pipe and the tasks'
    /// userfaultfds; returns whether the control socket is readable and
    /// which tasks are.
    fn wait(
        &self,
        ctl: Option<BorrowedFd<'_>>,
        workers: BorrowedFd<'_>,
        timeout: i32,
    ) -> Result<(bool, Vec<usize>), FillError> {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let pollfd = |fd: i32| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        fds.push(pollfd(ctl.map_or(-1, |c| c.as_raw_fd())));
        fds.push(pollfd(workers.as_raw_fd()));
        let live: Vec<usize> = {
            let st = crate::sync::lock(&self.state);
            st.tasks
                .iter()
                .enumerate()
                .filter(|(_, t)| !t.gone)
                .map(|(i, t)| {
                    fds.push(pollfd(t.uffd.as_raw_fd()));
                    i
                })
                .collect()
        };
        // SAFETY: `fds` is a valid array of pollfd for the call; a negative
        // fd is ignored by poll.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                return Ok((false, Vec::new()));
            }
            return Err(FillError::io("polling the userfaultfds")(e));
        }
        if fds[1].revents != 0 {
            let mut b = [0u8; 64];
            let _ = nix::unistd::read(workers, &mut b);
        }
        let ctl_ready = fds[0].revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0;
        let ready = live
            .into_iter()
            .zip(&fds[2..])
            .filter(|(_, p)| p.revents != 0)
            .map(|(i, _)| i)
            .collect();
        Ok((ctl_ready, ready))
    }

    /// Reads and handles the messages of the `ready` tasks, and the faults
    /// to try again, with no worker installing.
    fn handle_messages(
        &self,
        ready: &[usize],
        retry: &mut Vec<Fault>,
        woke: Instant,
    ) -> Result<(), FillError> {
        let asked = Instant::now();
        let _gate = self.gate.write().unwrap_or_else(|e| e.into_inner());
        let mut st = crate::sync::lock(&self.state);
        st.stats.gate_wait_us += asked.elapsed().as_micros() as u64;
        let mut faults = std::mem::take(retry);
        for &i in ready {
            let mut msgs = Vec::new();
            if let Err(e) = uffd::read_messages(st.tasks[i].uffd.as_fd(), &mut msgs) {
                // The task is gone (its userfaultfd ends with its memory).
                tracing::debug!(vpid = st.tasks[i].vpid, error = %e, "userfaultfd read failed");
                let t = &mut st.tasks[i];
                t.gone = true;
                continue;
            }
            for m in msgs {
                match m {
                    Message::PageFault { address } => {
                        self.note_fault();
                        st.stats.faults += 1;
                        faults.push(Fault {
                            task: i,
                            address,
                            since: woke,
                        });
                    }
                    other => self.area_changed(&mut st, i, other)?,
                }
            }
        }
        // A fault waiting for a page the process since dropped (another
        // thread's madvise or munmap) is answered now, not at the next
        // arrival.
        let (stale, parked): (Vec<Fault>, Vec<Fault>) =
            std::mem::take(&mut st.parked).into_iter().partition(|f| {
                let t = &st.tasks[f.task];
                t.gone || !t.coming.contains(f.address & !(memtrack::page_size() - 1))
            });
        st.parked = parked;
        faults.extend(stale);
        for f in faults {
            match self.fault(&mut st, f.task, f.address)? {
                Answer::Answered => st.stats.fault_wait_us += f.since.elapsed().as_micros() as u64,
                Answer::Retry => retry.push(f),
                Answer::Parked => st.parked.push(f),
            }
        }
        Ok(())
    }

    /// Answers a fault, or says when to try again.
    fn fault(&self, st: &mut State, i: usize, address: u64) -> Result<Answer, FillError> {
        let page = memtrack::page_size();
        let addr = address & !(page - 1);
        if st.tasks[i].gone {
            return Ok(Answer::Answered);
        }
        // Still to come: ask for it (and the pages after it) first, once.
        if let Some(c) = st.tasks[i].coming.take_at(addr, WANT_PAGES * page) {
            let t = &mut st.tasks[i];
            t.coming.put_back(c);
            let vpid = t.vpid;
            let wanted = st.wanted.entry(vpid).or_default();
            if !wanted.contains(c.src, c.src + page) {
                wanted.insert(c.src, c.src + c.len);
                st.wants.push((vpid, c.src, c.src + c.len));
                st.stats.faults_on_arrival += 1;
            }
            return Ok(Answer::Parked);
        }
        let taken = st.tasks[i].pending.take_at(addr, FAULT_PAGES * page);
        if let (Some(c), Some(store)) = (taken, st.tasks[i].store.clone()) {
            let out = install(st.tasks[i].uffd.as_fd(), &store, c)?;
            let waiting = out.rest.is_some_and(|r| r.dst == addr);
            if out.existing > 0 {
                let _ = uffd::wake(st.tasks[i].uffd.as_fd(), addr, page);
            }
            book(st, i, c, &out, true);
            return Ok(if waiting {
                Answer::Retry
            } else {
                Answer::Answered
            });
        }
        // Not pending: a page the process never had (or one already in).
        let t = &mut st.tasks[i];
        match uffd::zeropage(t.uffd.as_fd(), addr, page)
            .map_err(FillError::io(format!("mapping a zero page at {addr:#x}")))?
        {
            Installed::All => st.stats.zero_pages += 1,
            Installed::Exists { .. } => {
                let _ = uffd::wake(t.uffd.as_fd(), addr, page);
            }
            Installed::Changing { .. } => return Ok(Answer::Retry),
            Installed::NoArea { .. } => {}
            Installed::Gone => t.gone = true,
        }
        Ok(Answer::Answered)
    }

    /// Applies a change of a task's areas to its pending pages.
    fn area_changed(&self, st: &mut State, i: usize, m: Message) -> Result<(), FillError> {
        let page = memtrack::page_size();
        tracing::debug!(vpid = st.tasks[i].vpid, ?m, "area changed");
        match m {
            Message::Fork { uffd } => {
                // The child has the parent's areas and lacks the same
                // pages, from the same store.
                let parent = &st.tasks[i];
                let child = Task {
                    uffd,
                    vpid: parent.vpid,
                    store: parent.store.clone(),
                    pending: parent.pending.clone(),
                    coming: parent.coming.clone(),
                    gone: false,
                };
                st.forked = true;
                st.stats.tasks += 1;
                st.tasks.push(child);
            }
            Message::Remap { from, to, len } => {
                st.tasks[i].pending.remap(from, to, len);
                st.tasks[i].coming.remap(from, to, len);
            }
            Message::Remove { start, end } => {
                // Zeros from now on, and no fault reaches us there: the
                // range leaves the registration.
                let t = &mut st.tasks[i];
                if let Err(e) = uffd::unregister(t.uffd.as_fd(), start, end) {
                    if e.raw_os_error() == Some(libc::ENOMEM) {
                        t.gone = true;
                    } else {
                        return Err(FillError::io(format!("unregistering {start:#x}-{end:#x}"))(
                            e,
                        ));
                    }
                }
                let dropped =
                    drop_range(&mut t.pending, start, end) + drop_range(&mut t.coming, start, end);
                st.stats.dropped_pages += dropped / page;
            }
            Message::Unmap { start, end } => {
                let t = &mut st.tasks[i];
                let dropped =
                    drop_range(&mut t.pending, start, end) + drop_range(&mut t.coming, start, end);
                st.stats.dropped_pages += dropped / page;
            }
            Message::PageFault { .. } => unreachable!("faults are answered apart"),
            Message::Other { event } => {
                return Err(FillError::Protocol(format!(
                    "userfaultfd event {event:#x} of task {} is unknown here",
                    st.tasks[i].vpid
                )));
            }
        }
        Ok(())
    }

    /// While the process faults: one small chunk installed by the event
    /// loop itself, between two looks at the userfaultfds; returns whether
    /// it found one. No gate: this thread is the one that reads the
    /// messages, so no change of the areas is read while its copy runs.
    fn install_inline(&self) -> Result<bool, FillError> {
        let job = crate::sync::lock(&self.state).job(INLINE_CHUNK);
        let Some((i, c, store, raw)) = job else {
            return Ok(false);
        };
        // SAFETY: the task's userfaultfd stays open while the event loop
        // runs: it is closed only after the loop and the workers end.
        let fd = unsafe { BorrowedFd::borrow_raw(raw) };
        let result = install(fd, &store, c);
        let mut st = crate::sync::lock(&self.state);
        st.in_flight -= 1;
        let out = result?;
        st.stats.inline_pages += out.installed / memtrack::page_size();
        book(&mut st, i, c, &out, false);
        Ok(true)
    }

    /// A worker: installs chunks until none is left (none in the store and
    /// none to come), standing aside while the process faults.
    fn work(&self) {
        // Started by the event loop, which runs ahead: the background
        // does not.
        let _own = self.base_nice.and_then(ThreadNice::set_to);
        loop {
            if let Some(left) = self.standing_aside() {
                let st = crate::sync::lock(&self.state);
                if st.failed.is_some() || !st.anything_left() {
                    return;
                }
                let _ = self.arrivals.wait_timeout(st, left);
                continue;
            }
            let gate = self.gate.read().unwrap_or_else(|e| e.into_inner());
            let job = {
                let mut st = crate::sync::lock(&self.state);
                if st.failed.is_some() {
                    return;
                }
                st.job(CHUNK)
            };
            let Some((i, c, store, raw)) = job else {
                drop(gate);
                // Pages still to come: wait for them, not holding the gate.
                let st = crate::sync::lock(&self.state);
                if st.failed.is_some() || !st.awaiting() {
                    return;
                }
                let _ = self
                    .arrivals
                    .wait_timeout(st, Duration::from_millis(POLL_MS as u64));
                continue;
            };
            // SAFETY: the task's userfaultfd stays open while the gate is
            // held: tasks are only added or marked gone under the gate's
            // exclusive side, and closed after the workers end.
            let fd = unsafe { BorrowedFd::borrow_raw(raw) };
            let result = install(fd, &store, c);
            let mut st = crate::sync::lock(&self.state);
            st.in_flight -= 1;
            match result {
                Ok(out) => {
                    let changing = out.rest.is_some();
                    book(&mut st, i, c, &out, false);
                    drop(st);
                    drop(gate);
                    if changing {
                        // The reader takes the gate next and reads what is
                        // changing; then this chunk goes again.
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
                Err(e) => {
                    st.failed = Some(e.to_string());
                    return;
                }
            }
        }
    }
}

/// `ferryd fill`: the filler process. Its control socket is descriptor
/// [`super::CONTROL_FD`], as ferryd spawned it (ahead of the freeze when it
/// can); the stores and the plan come over it once the plan is known.
pub fn main() -> Result<(), FillError> {
    // SAFETY: ferryd hands the control socket at this number, and nothing
    // else in this process owns it.
    let ctl = unsafe { OwnedFd::from_raw_fd(super::CONTROL_FD) };
    let outcome = wait_for_plan(ctl.as_fd()).and_then(|(plan, stores)| {
        let filler = Filler::new(plan, stores)?;
        control::send_from_filler(ctl.as_fd(), &FromFiller::Ready)?;
        filler.run(ctl.as_fd())
    });
    let report = match &outcome {
        Ok(stats) => FromFiller::Done(*stats),
        Err(e) => FromFiller::Failed(e.to_string()),
    };
    // ferryd may be gone (killed during the fill): the fill stands anyway.
    let _ = control::send_from_filler(ctl.as_fd(), &report);
    outcome.map(|stats| {
        tracing::info!(?stats, "every page in");
    })
}

/// The stores (`S`), then the plan (`P`): the plan read, its stores in
/// order.
fn wait_for_plan(ctl: BorrowedFd<'_>) -> Result<(Plan, Vec<File>), FillError> {
    let mut stores: Vec<Option<File>> = Vec::new();
    let path = loop {
        match control::recv_in_filler(ctl)? {
            Some(ToFiller::Store { index, store }) => {
                let i = index as usize;
                if i >= 4096 {
                    return Err(FillError::Protocol(format!("store index {i}")));
                }
                if stores.len() <= i {
                    stores.resize_with(i + 1, || None);
                }
                stores[i] = Some(File::from(store));
            }
            Some(ToFiller::Plan { path }) => break path,
            Some(other) => {
                return Err(FillError::Protocol(format!("{other:?} before the plan")));
            }
            None => {
                return Err(FillError::Protocol(
                    "ferryd went away before the plan".into(),
                ));
            }
        }
    };
    let text = std::fs::read(&path).map_err(FillError::io(format!("reading the plan {path}")))?;
    let plan: Plan =
        serde_json::from_slice(&text).map_err(|e| FillError::Plan(format!("not JSON: {e}")))?;
    let stores = stores
        .into_iter()
        .enumerate()
        .map(|(i, s)| s.ok_or_else(|| FillError::Plan(format!("store {i} was never sent"))))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((plan, stores))
}

#[cfg(test)]
mod tests;
