//! Start: the migration's directory, perf's scheduler hooks for CRIU's
//! breakpoints (held from the dump on), and connections to the nodes of
//! the process's in-cluster peers, opened before the freeze.

use super::Phase;
use super::run::Run;
use crate::engine::EngineError;

pub(super) async fn start(run: &mut Run) -> Result<Phase, EngineError> {
    let images = run.images();
    std::fs::create_dir_all(&images)
        .map_err(EngineError::io(format!("creating {}", images.display())))?;
    crate::engine::set_private(&run.dir);
    // perf's scheduler hooks on for CRIU's breakpoints, so that their
    // grace-period wait is not in the freeze (`criu::SchedHooks`); opened
    // beside the steps before the dump, held until the migration ends.
    run.sched_hooks = Some(tokio::task::spawn_blocking(crate::criu::SchedHooks::hold));
    run.peer_links = super::peers::open_peer_links(
        &run.engine,
        &run.p.sockets.tcp_peers,
        &run.p.destination.name,
    );
    Ok(if run.p.strategy.is_precopy() {
        Phase::PreCopy
    } else {
        run.after_pre_copy()
    })
}
