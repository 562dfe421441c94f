//! Discard: the destination answered the Commit (post-copy: has every
//! page, or lost the process); the source kills its stopped copy (its
//! sockets close silently, in repair mode) and forgets it. The Commit does
//! not wait for that exit (a thousand descriptors closed, their /proc
//! entries dropped), whose CPU the destination needs inside the freeze on
//! a small machine; the migration's end waits for it. Pages left out of
//! the dump: the destination fills them from its store, and [`Phase::Fill`]
//! asks how that went.

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::run::Run;
use super::{Phase, Stop};

pub(super) async fn discard(run: &mut Run, stop: Stop) -> Phase {
    let pid = run.p.pid;
    // The root is the init of its PID namespace: killing it takes the whole
    // tree with it.
    if let Err(e) = kill(Pid::from_raw(pid), Signal::SIGKILL) {
        tracing::warn!(pid, error = %e, "killing the source copy");
    }
    run.engine.processes.depart(pid);
    // Pages left out of the dump: tracking went on past the dump; it ends
    // with the copy, nothing unprotected.
    if let Some(pre) = run.undo.precopy.take() {
        pre.abandon();
    }
    if let Err(e) = run.engine.ports.apply().await {
        tracing::error!(error = %e, "releasing the ports of the migrated process");
    }
    if run.held_left_out && matches!(stop, Stop::Committed(_)) {
        return Phase::Fill(stop);
    }
    Phase::Done(stop)
}
