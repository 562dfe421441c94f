//! The destination's page filler: after a pre-copy migration resumes, it
//! installs the pages the destination already held, from its page store,
//! into the running process, by userfaultfd.
//!
//! # Why
//!
//! Pre-copy (Noack (2003) §2.3.5) sends the process's memory while it
//! runs, so that the freeze carries only what was written since the last
//! round. Yet CRIU's dump reads and writes every page inside the freeze,
//! and its restore reads every page back: a 1 GiB process froze for
//! seconds though only megabytes had changed. With ferry's held-pages patch
//! the dump leaves the pages the destination holds out of the images
//! (parent runs in the pagemap, `xtask/criu/held-pages-left-out.patch`);
//! the destination turns them into lazy runs
//! ([`ferry_criu_image::pagemap::left_out_to_lazy`]), CRIU restores the
//! process without them (`--lazy-pages`: their areas registered for
//! missing-page faults on a userfaultfd), and the filler puts them in place
//! after the resume, from the store on this node: faulted pages first,
//! the rest by several threads at memory speed. The source is out of it:
//! it may vanish at the commit.
//!
//! # The process
//!
//! The filler is a process of its own (`ferryd fill`), spawned by ferryd
//! after the first pre-copy round ([`handle::Spawned::spawn`], so that its
//! fork and exec are not in the freeze; at the Restore step if it was not)
//! and handed its stores and plan by the Restore step
//! ([`handle::Spawned::start`]): if ferryd is killed during the fill, the
//! filler goes on and the process keeps its memory. Pages that follow
//! come through ferryd, though: with ferryd gone and pages still to come,
//! the filler fails. A filler that fails kills the restored tasks, which
//! ferryd hands it by pidfd after the restore: ferryd would too, but may
//! be gone, and once no one holds their userfaultfds a page not installed
//! reads as zeros.
//! ferryd listens on `lazy-pages.socket` in the restore's working
//! directory, where CRIU's restore connects (`criu/uffd.c`: per task, its
//! PID in its namespace as an `int`, then its userfaultfd by `SCM_RIGHTS`,
//! a negative PID and no descriptor for a zombie; at the end of the
//! restore, before the tasks run, `LAZY_PAGES_RESTORE_FINISHED`), and
//! relays each userfaultfd to the filler over a `SOCK_SEQPACKET` pair,
//! keeping a copy: should the filler die, the process's threads wait on
//! the missing pages instead of reading zeros, and ferryd kills the
//! process and reports it lost.
//!
//! # Concurrency
//!
//! One thread reads the userfaultfds' messages: page faults, answered at
//! once (the pending pages around the address, or a zero page for a page
//! the process never had), and the changes to the process's areas (fork,
//! mremap, munmap, madvise), applied to the pending ranges. Worker threads
//! install the pending ranges in chunks, from the moment ferryd says the
//! process resumed (`G`): in the freeze they would take the CPUs from the
//! restore and the commit, and the restorer's own unmapping, which waits
//! until the filler read of it, would wait for their chunks too (5.5 ms of
//! a 4 GiB restore, CRIU's log at level 4). A message about an area change
//! is read only while no worker is installing (a gate: workers hold it
//! shared for each chunk, the reader exclusively): after the read the
//! kernel goes on with the change (a `madvise(MADV_DONTNEED)` zaps the
//! pages), so a chunk read from the store before the change must not land
//! after it. A chunk that meets an unread change gets `EAGAIN` and goes
//! back to the pending ranges.
//!
//! The process's faults come first: while it faults (until 5 ms after its
//! last fault), the workers stand aside and the event loop installs the
//! pending pages itself, a small chunk between two looks at the
//! userfaultfds. It needs no gate for that, being the thread that reads
//! the changes, so a fault waits for at most one small copy, not for the
//! workers' chunks and a core. The event loop runs at CRIU's nice value,
//! the workers at the process's own. Not where the pages follow: those
//! faults wait on the source, and the cores on receiving its pages.

pub mod control;
pub mod filler;
pub mod handle;
pub mod pending;

use serde::{Deserialize, Serialize};

/// The descriptor a filler gets its control socket on.
pub const CONTROL_FD: i32 = 3;

/// What the filler installs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub migration_id: String,
    /// Threads installing pages in the background.
    pub workers: usize,
    /// The stores fill while the filler runs (post-copy: the pages come
    /// from the source after the resume): a page is installed only once
    /// ferryd said it arrived (`A`), a fault on one still to come waits
    /// for it and asks for it first (`W`). Otherwise every run is in its
    /// store from the start.
    #[serde(default)]
    pub follows: bool,
    /// The tasks with pages to install. A task of the restored tree that
    /// is not listed has none: its faults get zero pages.
    pub tasks: Vec<TaskPlan>,
}

/// One task's pages.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskPlan {
    /// Its PID in its namespace, as CRIU's restore names it.
    pub vpid: u32,
    /// Its store: the one ferryd sent with this index (`S`, see
    /// [`control`]), a page at the offset of its address.
    pub store: usize,
    /// The memory areas that hold its runs, `[start, end)`: the windows of
    /// the store the filler maps.
    pub windows: Vec<(u64, u64)>,
    /// The runs to install, `[start, end)`, each inside one window.
    pub runs: Vec<(u64, u64)>,
}

impl Plan {
    /// Checks what a filler relies on: page-aligned, non-empty runs, each
    /// inside one window of its task; windows disjoint.
    pub fn check(&self, page: u64) -> Result<(), FillError> {
        let bad = |what: String| FillError::Plan(what);
        for t in &self.tasks {
            let mut last_end = 0;
            for &(s, e) in &t.windows {
                if s >= e || s % page != 0 || e % page != 0 || s < last_end {
                    return Err(bad(format!(
                        "task {}: window {s:#x}-{e:#x} is empty, unaligned or out of order",
                        t.vpid
                    )));
                }
                last_end = e;
            }
            for &(s, e) in &t.runs {
                if s >= e || s % page != 0 || e % page != 0 {
                    return Err(bad(format!(
                        "task {}: run {s:#x}-{e:#x} is empty or unaligned",
                        t.vpid
                    )));
                }
                if !t.windows.iter().any(|&(ws, we)| ws <= s && e <= we) {
                    return Err(bad(format!(
                        "task {}: run {s:#x}-{e:#x} is in no window",
                        t.vpid
                    )));
                }
            }
        }
        Ok(())
    }

    /// Bytes to install.
    pub fn bytes(&self) -> u64 {
        self.tasks
            .iter()
            .flat_map(|t| t.runs.iter())
            .map(|(s, e)| e - s)
            .sum()
    }
}

/// How a fill went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FillStats {
    /// Pages installed from the store, by the workers and at faults.
    pub pages: u64,
    /// Of `pages`, those installed at a fault.
    pub fault_pages: u64,
    /// Page faults of the process the filler answered, and the time from
    /// reading each to its answer, summed.
    pub faults: u64,
    pub fault_wait_us: u64,
    /// Zero pages mapped at faults (pages the process never had).
    pub zero_pages: u64,
    /// Pages dropped before they were installed: the process unmapped or
    /// discarded them, or exited.
    pub dropped_pages: u64,
    /// Of `faults`, those that waited for their page to arrive in the
    /// store (a plan whose pages follow).
    #[serde(default)]
    pub faults_on_arrival: u64,
    /// From the end of the restore to the last page.
    pub fill_us: u64,
    /// Tasks the filler served (forks during the fill included).
    pub tasks: u64,
    /// Of `pages`, those the event loop installed between the process's
    /// faults, while the workers stood aside.
    #[serde(default)]
    pub inline_pages: u64,
    /// The event loop's summed wait for the workers' chunks to leave the
    /// gate before it read the userfaultfds (part of `fault_wait_us`).
    #[serde(default)]
    pub gate_wait_us: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum FillError {
    #[error("fill plan: {0}")]
    Plan(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("page filler protocol: {0}")]
    Protocol(String),
    #[error("the page filler failed: {0}")]
    Failed(String),
}

impl FillError {
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> FillError {
        let what = what.into();
        move |source| FillError::Io { what, source }
    }
}

/// Whether this kernel lets a filler see every change a restored process
/// makes to its areas (userfaultfd fork, remap, remove and unmap events),
/// unless the configuration turns that off (`features_off`; blocking the
/// first time, `crate::host_features`).
pub fn available(features_off: &[String]) -> bool {
    crate::host_features::feature(features_off, "uffd_events").present
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_is_checked_before_use() {
        let ok = Plan {
            migration_id: "m".into(),
            workers: 2,
            follows: false,
            tasks: vec![TaskPlan {
                vpid: 1,
                store: 0,
                windows: vec![(0x10000, 0x20000), (0x30000, 0x40000)],
                runs: vec![(0x11000, 0x13000), (0x30000, 0x40000)],
            }],
        };
        ok.check(0x1000).unwrap();
        assert_eq!(ok.bytes(), 0x12000);
        let mut across = ok.clone();
        across.tasks[0].runs.push((0x1f000, 0x31000));
        assert!(matches!(across.check(0x1000), Err(FillError::Plan(e)) if e.contains("no window")));
        let mut unaligned = ok.clone();
        unaligned.tasks[0].runs.push((0x11800, 0x12000));
        assert!(unaligned.check(0x1000).is_err());
        let mut overlapping = ok;
        overlapping.tasks[0].windows.push((0x35000, 0x50000));
        assert!(overlapping.check(0x1000).is_err());
    }
}
