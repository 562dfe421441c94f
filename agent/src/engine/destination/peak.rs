//! The most memory an incoming migration took on this node at once, for
//! the report: the blocks of its page store and pages images (a tmpfs
//! work dir holds them in memory) plus the resident sets of the
//! processes it started here (CRIU, the page filler, the lazy-pages
//! daemon, and the restored tree). Sampled every [`PERIOD`] on a thread of
//! its own, from Prepare to the end of the work after the resume.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often the meter samples: short enough to catch the restore's peak
/// (tens of milliseconds long for a large process).
const PERIOD: Duration = Duration::from_millis(10);

#[derive(Debug, Default)]
struct Shared {
    pids: Mutex<Vec<i32>>,
    peak: AtomicU64,
    stop: AtomicBool,
}

/// Samples until dropped (the last clone's drop ends its thread).
#[derive(Debug)]
pub(crate) struct PeakMeter {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl PeakMeter {
    /// Starts sampling `dir`. A meter that cannot start its thread reports
    /// 0 (and says so in the log): the migration does not depend on it.
    pub(super) fn start(dir: PathBuf) -> Arc<PeakMeter> {
        let shared = Arc::new(Shared::default());
        let thread = std::thread::Builder::new()
            .name("ferry-peak".into())
            .spawn({
                let shared = shared.clone();
                move || {
                    while !shared.stop.load(Ordering::Relaxed) {
                        let pids = crate::sync::lock(&shared.pids).clone();
                        let now = dir_bytes(&dir) + pids.iter().map(|&p| tree_rss(p)).sum::<u64>();
                        shared.peak.fetch_max(now, Ordering::Relaxed);
                        std::thread::park_timeout(PERIOD);
                    }
                }
            })
            .inspect_err(|e| tracing::warn!(error = %e, "starting the memory meter"))
            .ok();
        Arc::new(PeakMeter { shared, thread })
    }

    /// Counts `pid` and its descendants from now on.
    pub(super) fn watch(&self, pid: i32) {
        if pid > 0 {
            crate::sync::lock(&self.shared.pids).push(pid);
        }
    }

    /// The peak so far, in bytes.
    pub(super) fn peak(&self) -> u64 {
        self.shared.peak.load(Ordering::Relaxed)
    }
}

impl Drop for PeakMeter {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// Bytes allocated to what holds the process's pages under the
/// migration's directory `dir`: the page store (`precopy/`, sparse: what
/// it holds, not its length) and the pages images (`images/pages-*.img`).
/// The other images are small, and a stat of each of a thousand
/// connections' images every sample would take CPU from the freeze.
fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let allocated = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.blocks() * 512);
    let mut sum = 0;
    for (sub, wanted) in [
        ("precopy", (|_: &str| true) as fn(&str) -> bool),
        ("images", |n: &str| n.starts_with("pages-")),
    ] {
        let Ok(entries) = std::fs::read_dir(dir.join(sub)) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_name().to_str().is_some_and(wanted) {
                sum += allocated(&e.path());
            }
        }
    }
    sum
}

/// The resident bytes of `pid` and its descendants (`statm`; children
/// from each thread's `children` list).
fn tree_rss(pid: i32) -> u64 {
    let page = crate::memtrack::page_size();
    let mut sum = 0;
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let Ok(statm) = std::fs::read_to_string(format!("/proc/{p}/statm")) else {
            continue;
        };
        sum += statm
            .split_whitespace()
            .nth(1)
            .and_then(|r| r.parse::<u64>().ok())
            .unwrap_or(0)
            * page;
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for t in tasks.flatten() {
                let children =
                    std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
                todo.extend(
                    children
                        .split_whitespace()
                        .filter_map(|c| c.parse::<i32>().ok()),
                );
            }
        }
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_a_directory_and_a_process_tree() {
        let dir = tempfile::tempdir().unwrap();
        let meter = PeakMeter::start(dir.path().to_owned());
        // A shell and its child: the tree counts both.
        let mut shell = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & wait"])
            .spawn()
            .unwrap();
        let pid = shell.id() as i32;
        let alone = |p: i32| tree_rss_of(&[p]);
        while std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .trim()
            .is_empty()
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let tree = tree_rss(pid);
        assert!(tree > alone(pid), "tree {tree}, shell alone {}", alone(pid));
        meter.watch(pid);
        // 4 MiB written, then gone: the peak keeps it.
        let f = dir.path().join("precopy/1");
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(&f, vec![1u8; 4 << 20]).unwrap();
        std::thread::sleep(PERIOD * 5);
        std::fs::remove_file(&f).unwrap();
        std::thread::sleep(PERIOD * 3);
        let peak = meter.peak();
        assert!(
            peak >= (4 << 20) + tree / 2 && peak < (4 << 20) + 4 * tree,
            "peak {peak}, tree {tree}"
        );
        // The sleep first (it would outlive its shell), then the shell.
        for child in std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|c| c.parse::<i32>().ok())
        {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        shell.kill().unwrap();
        shell.wait().unwrap();
        drop(meter);
    }

    /// The resident bytes of these processes alone.
    fn tree_rss_of(pids: &[i32]) -> u64 {
        pids.iter()
            .map(|p| {
                std::fs::read_to_string(format!("/proc/{p}/statm"))
                    .ok()
                    .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
                    .unwrap_or(0)
                    * crate::memtrack::page_size()
            })
            .sum()
    }
}
