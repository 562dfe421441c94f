//! Pre-copy's throttle ("auto-converge", as QEMU calls its vCPU
//! throttling): a process that writes its memory faster than the link
//! carries its pages never converges, so it is slowed down for the rest of
//! the rounds by letting it run only a share of each period (SIGCONT, then
//! SIGSTOP for the rest of the period). Each tightening halves the share.
//!
//! A process must never reach the dump stopped by the throttle: CRIU would
//! record it as stopped and the destination would restore it stopped.
//! [`Throttle::release`] lets it run (SIGCONT) and waits for the ticker to
//! end; the pre-copy rounds call it on every way out, and dropping a
//! throttle does the same without waiting.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::sync::lock;

/// The throttle's period: long enough that the signals cost nothing,
/// short enough that a client of the process sees stalls of tens of
/// milliseconds, not seconds.
const PERIOD: Duration = Duration::from_millis(20);

/// The smallest share of each period the process runs, in percent: 200 µs
/// of every 20 ms. A process that rewrites its memory as fast as it can
/// (Noack (2003)'s random-memory-access process) dirties most of 4 MiB in one millisecond of running, so
/// the floor must be well under that; the ticker is a thread of its own
/// for timing that fine (the runtime's timers tick in milliseconds).
pub const FLOOR_PERCENT: u32 = 1;

/// A throttle on a set of processes (each whole, with its threads).
#[derive(Debug)]
pub struct Throttle {
    pids: Vec<i32>,
    /// Share of each period the processes run, in percent (100: free).
    percent: Arc<AtomicU32>,
    /// Set (under its lock) once the processes must run for good; the
    /// ticker sends SIGSTOP only under the same lock, so no SIGSTOP can
    /// follow the last SIGCONT.
    released: Arc<std::sync::Mutex<bool>>,
    ticker: Option<std::thread::JoinHandle<()>>,
}

impl Throttle {
    pub fn new(pids: Vec<i32>) -> Self {
        Throttle {
            pids,
            percent: Arc::new(AtomicU32::new(100)),
            released: Arc::new(std::sync::Mutex::new(false)),
            ticker: None,
        }
    }

    /// The share the processes run now, in percent.
    pub fn percent(&self) -> u32 {
        self.percent.load(Ordering::Relaxed)
    }

    /// Halves the share (starting the ticker the first time); `None` at
    /// the floor already.
    pub fn tighten(&mut self) -> Option<u32> {
        let now = self.percent();
        if now <= FLOOR_PERCENT {
            return None;
        }
        let next = (now / 2).max(FLOOR_PERCENT);
        self.percent.store(next, Ordering::Relaxed);
        if self.ticker.is_none() {
            *lock(&self.released) = false;
            let (pids, percent, released) = (
                self.pids.clone(),
                self.percent.clone(),
                self.released.clone(),
            );
            self.ticker = Some(std::thread::spawn(move || {
                loop {
                    signal(&pids, Signal::SIGCONT);
                    let run = PERIOD * percent.load(Ordering::Relaxed) / 100;
                    std::thread::sleep(run);
                    {
                        let done = lock(&released);
                        if *done {
                            return;
                        }
                        signal(&pids, Signal::SIGSTOP);
                    }
                    std::thread::sleep(PERIOD - run);
                    if *lock(&released) {
                        return;
                    }
                }
            }));
        }
        Some(next)
    }

    /// Lets the processes run freely again and waits until the ticker has
    /// ended.
    pub async fn release(&mut self) {
        if let Some(t) = self.ticker.take() {
            self.let_run();
            // It ends within a period.
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
        self.percent.store(100, Ordering::Relaxed);
    }

    /// No SIGSTOP after this: the flag first, then SIGCONT.
    fn let_run(&self) {
        *lock(&self.released) = true;
        signal(&self.pids, Signal::SIGCONT);
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        if self.ticker.take().is_some() {
            // The thread sees the flag and ends by itself within a period.
            self.let_run();
        }
    }
}

fn signal(pids: &[i32], sig: Signal) {
    for &p in pids {
        if let Err(e) = kill(Pid::from_raw(p), sig)
            && e != nix::errno::Errno::ESRCH
        {
            tracing::warn!(pid = p, signal = ?sig, error = %e, "throttle");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The state letter of /proc/<pid>/stat.
    fn state(pid: i32) -> char {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
        let after = &stat[stat.rfind(')').expect("comm") + 2..];
        after.chars().next().expect("state")
    }

    /// A real child: throttled, it spends most of its time stopped; after
    /// the release it runs and stays running.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_throttled_process_is_stopped_most_of_the_time_and_runs_after_release() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("spawn");
        let pid = child.id() as i32;
        let mut t = Throttle::new(vec![pid]);
        assert_eq!(t.tighten(), Some(50));
        assert_eq!(t.tighten(), Some(25));
        assert_eq!(t.tighten(), Some(12));
        assert_eq!(t.tighten(), Some(6));
        let mut stopped = 0;
        for _ in 0..100 {
            if state(pid) == 'T' {
                stopped += 1;
            }
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        assert!(stopped > 50, "stopped in only {stopped} of 100 samples");
        t.release().await;
        for _ in 0..20 {
            assert_ne!(state(pid), 'T', "stopped after the release");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        while t.tighten().is_some() {}
        assert_eq!(t.percent(), FLOOR_PERCENT);
        drop(t);
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert_ne!(state(pid), 'T', "stopped after the drop");
        child.kill().expect("kill");
        child.wait().expect("wait");
    }
}
