//! CRIU workers that answered and are still exiting.
//!
//! A worker that answered has nothing left to do but exit, and ferry
//! leaves that exit to idle time (`SCHED_IDLE`, see `swrk`): it tears down
//! CRIU's memory and descriptors, CPU the freeze needs. Until it exits,
//! though, it holds what it took or was given: a dump's worker keeps a
//! descriptor of every connection it dumped (CRIU's duplicates, in repair
//! mode, closed only when it exits), a restore's worker the connections
//! ferryd handed over. On a busy node an idle-priority exit can wait for
//! seconds, and all that time the connections of a copy killed at the
//! commit stay in the node's TCP tables: a process sent back to that node
//! cannot rebuild them there (`connect` in repair mode fails with
//! EADDRNOTAVAIL, the address pair being taken). Found by the soak, about
//! once in a thousand migrations; reproduced at will with every core busy
//! (`integration/tests/revisits.rs`).
//!
//! So every worker is listed here from its last answer until it is
//! reaped, and [`settle`] hurries the exits of those listed (back to the
//! normal policy) and waits for them: the source calls it before it
//! reports a commit, when the freeze is long over.

use std::collections::BTreeSet;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use super::spawn::SpawnedChild;

/// The workers exiting, by PID: a PID stays listed until its zombie is
/// seen and only then is it reaped, so a listed PID always names the
/// worker (never a process that reused its number).
static EXITING: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());
/// Told each time a worker leaves [`EXITING`].
static LEFT: Condvar = Condvar::new();

/// Waits for `child`'s exit off the caller's path (on a thread of its
/// own, inline if none can be started), listed in [`EXITING`] until then,
/// and reaps it, so that it never stays a zombie.
pub(super) fn reap_in_background(child: SpawnedChild) {
    let pid = child.id();
    crate::sync::lock(&EXITING).insert(pid);
    let slot = std::sync::Arc::new(Mutex::new(Some(child)));
    let theirs = slot.clone();
    if std::thread::Builder::new()
        .name("criu-reaper".into())
        .spawn(move || reap(&theirs))
        .is_err()
    {
        reap(&slot);
    }
}

fn reap(slot: &Mutex<Option<SpawnedChild>>) {
    let Some(child) = crate::sync::lock(slot).take() else {
        return;
    };
    // Ended but not reaped yet: its PID cannot be reused while it is
    // still listed.
    if let Err(e) = child.wait_ended() {
        tracing::warn!(pid = child.id(), error = %e, "waiting for CRIU's end");
    }
    crate::sync::lock(&EXITING).remove(&child.id());
    LEFT.notify_all();
    if let Err(e) = child.wait() {
        tracing::warn!(error = %e, "reaping CRIU");
    }
}

/// Hurries every CRIU worker exiting now (the normal scheduling policy
/// again) and waits up to `within` until all of them have ended. Returns
/// how many had not by then. Blocking.
pub fn settle(within: Duration) -> usize {
    let deadline = Instant::now() + within;
    let mut exiting = crate::sync::lock(&EXITING);
    let waited: Vec<i32> = exiting.iter().copied().collect();
    for &pid in &waited {
        hurry(pid);
    }
    loop {
        let left = waited.iter().filter(|p| exiting.contains(p)).count();
        let now = Instant::now();
        if left == 0 || now >= deadline {
            return left;
        }
        exiting = LEFT
            .wait_timeout(exiting, deadline - now)
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0;
    }
}

/// Moves `pid` (a listed worker, so still ours) back to `SCHED_OTHER`,
/// keeping its nice value.
fn hurry(pid: i32) {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler reads `param`, which lives across the
    // call, and changes only the scheduling of `pid`, our unreaped child.
    if unsafe { libc::sched_setscheduler(pid, libc::SCHED_OTHER, &param) } != 0 {
        tracing::debug!(pid, error = %std::io::Error::last_os_error(), "CRIU's exit not hurried");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listed child's end is waited for; it is then unlisted and
    /// reaped.
    #[test]
    fn settle_waits_for_a_listed_exit_and_unlists_it() {
        let child = super::super::spawn::spawn(
            std::path::Path::new("/bin/sh"),
            &["-c", "sleep 0.2"],
            &[],
            &[],
        )
        .expect("sh");
        let pid = child.id();
        reap_in_background(child);
        assert!(crate::sync::lock(&EXITING).contains(&pid));
        assert_eq!(settle(Duration::from_secs(10)), 0);
        assert!(!crate::sync::lock(&EXITING).contains(&pid));
        // Reaped by the reaper (not by this test: a waitpid here would
        // reap it itself): its /proc entry, a zombie's too, goes.
        let deadline = Instant::now() + Duration::from_secs(5);
        let proc_entry = std::path::PathBuf::from(format!("/proc/{pid}"));
        while proc_entry.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!proc_entry.exists(), "PID {pid} was never reaped");
    }
}
