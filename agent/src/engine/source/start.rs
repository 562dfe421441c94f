//! Start: the migration's directory, perf's scheduler hooks for CRIU's
//! breakpoints (held from the dump on), and connections to the nodes of
//! the process's in-cluster peers, opened before the freeze; for an
//! incremental socket migration, the setsockopt watch's program loaded.
//! First of all, the migration's record in the journal
//! ([`crate::engine::journal`]).

use super::Phase;
use super::run::Run;
use crate::engine::EngineError;
use crate::engine::journal::OutgoingStage;
use crate::sockstate::SocketMigration;

pub(super) async fn start(run: &mut Run) -> Result<Phase, EngineError> {
    // Before anything is touched: a restart of this agent from here on
    // finds the migration in its journal and settles it.
    run.record(OutgoingStage::Started)?;
    let images = run.images();
    std::fs::create_dir_all(&images)
        .map_err(EngineError::io(format!("creating {}", images.display())))?;
    crate::engine::set_private(&run.dir);
    // perf's scheduler hooks on for CRIU's breakpoints, so that their
    // grace-period wait is not in the freeze (`criu::SchedHooks`); opened
    // beside the steps before the dump, held until the migration ends.
    run.sched_hooks = Some(tokio::task::spawn_blocking(crate::criu::SchedHooks::hold));
    // Incremental: the setsockopt watch's program loaded now, beside the
    // rounds, not in the pre-read after their last scan (pages written
    // then join the freeze).
    if run.p.socket_migration == SocketMigration::Incremental {
        tokio::task::spawn_blocking(|| {
            if let Err(e) = ferry_ebpf::SockoptWatch::load_spare() {
                // The pre-read loads one itself, or says why it cannot.
                tracing::debug!(error = %e, "loading a spare setsockopt watch");
            }
        });
    }
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
