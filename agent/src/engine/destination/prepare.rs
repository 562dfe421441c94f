//! `Peer.Prepare`: reserves this node for one incoming migration.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_proto::v1::{PrepareRequest, PrepareResponse};

use super::capacity::{Announced, Room};
use super::peak::PeakMeter;
use super::{Incoming, IncomingState, RestoreWorker, discard};
use crate::criu;
use crate::dataplane::PortState;
use crate::engine::fault_point::{self, Side};
use crate::engine::journal::{IncomingStage, Record};
use crate::engine::needs::{self, Role};
use crate::engine::pagestore::PageStore;
use crate::engine::precopy::MemoryStrategy;
use crate::engine::{Engine, EngineError, set_private};
use crate::process::PortKey;

/// A reservation left without news this long is taken to be abandoned by a
/// source that died, and a new Prepare may replace it.
pub(super) const STALE_RESERVATION: Duration = Duration::from_secs(120);

/// Reserves this node for the migration. Answers what this node's CRIU
/// restores: images whose connections were dumped without their socket
/// options (`PrepareResponse.takes_tcp_options`), or kept out of them
/// altogether (`takes_connections_out`).
pub async fn prepare(
    engine: &Arc<Engine>,
    req: PrepareRequest,
) -> Result<PrepareResponse, EngineError> {
    if !ferry_proto::PEER_PROTOCOL_VERSIONS.contains(&req.protocol_version) {
        return Err(EngineError::NoCommonVersion {
            node: req.source_node.clone(),
            theirs: vec![req.protocol_version],
            ours: ferry_proto::PEER_PROTOCOL_VERSIONS.to_vec(),
        });
    }
    if req.migration_id.is_empty() || !crate::engine::valid_image_name(&req.migration_id) {
        return Err(EngineError::InvalidField {
            field: "migration_id",
            reason: format!("{:?} is not a valid id", req.migration_id),
        });
    }
    let ports = req
        .ports
        .iter()
        .map(PortKey::from_pb)
        .collect::<Result<Vec<_>, _>>()?;
    engine.cordon.refuse_if_on()?;
    require_features(engine, req.strategy).await?;
    let room = {
        let (dir, limit) = (
            engine.config.work_dir.clone(),
            engine.config.migration.incoming_memory_limit_mib,
        );
        crate::engine::blocking("reading this node's free memory", move || {
            Room::read(&dir, limit)
        })
        .await??
    };
    room.check(engine.node(), &req)?;
    tracing::debug!(
        resident_mib = req.resident_bytes >> 20,
        dumped_mib = req.dumped_bytes >> 20,
        ?room,
        "room for the process"
    );
    let takes = what_criu_restores(engine).await?;

    let mut slot = engine.incoming.lock().await;
    // Under the slot's lock, as the Abort that gives a migration up.
    if engine.incoming.was_given_up(&req.migration_id) {
        return Err(EngineError::GivenUp {
            node: engine.node().to_owned(),
            migration_id: req.migration_id,
        });
    }
    if let Some(cur) = slot.as_ref() {
        let stale = cur.last_activity.elapsed() > STALE_RESERVATION
            && !matches!(cur.state, IncomingState::Restored { .. });
        if !stale {
            return Err(EngineError::DestinationBusy {
                node: engine.node().to_owned(),
                migration_id: cur.migration_id.clone(),
                from: cur.from.clone(),
            });
        }
        tracing::warn!(migration = %cur.migration_id, "dropping an abandoned reservation");
        discard(engine, cur).await;
        *slot = None;
    }
    engine.ports.refuse_owned(&ports, &[])?;
    let dir = engine
        .config
        .work_dir
        .join("incoming")
        .join(&req.migration_id);
    std::fs::create_dir_all(dir.join("images"))
        .map_err(EngineError::io(format!("creating {}", dir.display())))?;
    set_private(&dir);
    // perf's scheduler hooks on for the restore's breakpoints
    // (`criu::SchedHooks`), beside CRIU's start.
    let sched_hooks = tokio::task::spawn_blocking(criu::SchedHooks::hold);
    // The CRIU that will restore, started now, well before the freeze:
    // its fork and exec then neither lengthen the freeze nor crowd the
    // cores just before it.
    let restore_worker = {
        let (criu, images, log_dir) = (
            engine.config.criu_path.clone(),
            dir.join("images"),
            dir.clone(),
        );
        let started =
            tokio::task::spawn_blocking(move || RestoreWorker::start(&criu, &images, &log_dir))
                .await
                .map_err(|source| EngineError::Task {
                    what: "starting CRIU ahead of the restore",
                    source,
                })?;
        // Without it the restore starts its own CRIU, as before.
        started
            .inspect_err(|e| tracing::warn!(error = %e, "starting CRIU ahead of the restore"))
            .ok()
    };
    let sched_hooks = crate::engine::held_sched_hooks(sched_hooks).await;
    let peak = PeakMeter::start(dir.clone());
    if let Some(w) = &restore_worker {
        // The restored tree is CRIU's child until the restore ends.
        peak.watch(w.worker.pid());
    }
    engine.ports.reserve(&ports, PortState::Frozen);
    if let Err(e) = engine.ports.refresh().await {
        engine.ports.release(&ports);
        return Err(e.into());
    }
    tracing::info!(migration = %req.migration_id, from = %req.source_node, pid = req.source_pid, "incoming migration reserved");
    engine
        .incoming
        .prepared(&req.migration_id, &req.source_node);
    let announced = Announced::of(&req);
    // Before any restore: an agent killed inside CRIU's restore leaves a
    // copy no later record names, which its successor finds by this one.
    let prepared_ticks = crate::process::ticks_now();
    let recorded = engine.journal.write(&Record::Incoming {
        migration_id: req.migration_id.clone(),
        pid: 0,
        start_ticks: prepared_ticks,
        argv: req.argv.clone(),
        from: req.source_node.clone(),
        stage: IncomingStage::Prepared,
    });
    if let Err(e) = recorded {
        engine.ports.release(&ports);
        let _ = std::fs::remove_dir_all(&dir);
        return Err(e.into());
    }
    *slot = Some(Incoming {
        migration_id: req.migration_id,
        from: req.source_node,
        protocol_version: req.protocol_version,
        argv: req.argv,
        ports,
        prepared_ticks,
        armed: false,
        in_cluster: Vec::new(),
        discarded: Arc::new(std::sync::Mutex::new(false)),
        leaving: None,
        restore_worker,
        _sched_hooks: sched_hooks,
        staged: Arc::default(),
        udp_buffers: None,
        pages: Arc::new(std::sync::Mutex::new(PageStore::new(&dir.join("precopy")))),
        lazy: None,
        filler: None,
        following: None,
        filler_ahead: None,
        tunnel: None,
        peak,
        announced,
        dir,
        state: IncomingState::Reserved,
        last_activity: Instant::now(),
    });
    drop(slot);
    fault_point::reached(Side::Destination, "Prepared").await;
    Ok(takes)
}

/// What the migration's strategy needs of this node's kernel and
/// privileges that it lacks (`needs`), refused before the source stops
/// anything. An unspecified strategy (an older source) is not checked.
async fn require_features(engine: &Engine, strategy: i32) -> Result<(), EngineError> {
    let strategy = match ferry_proto::v1::Strategy::try_from(strategy) {
        Ok(s) => match MemoryStrategy::from_pb(s) {
            Some(s) => s,
            None => return Ok(()),
        },
        Err(_) => {
            return Err(EngineError::InvalidField {
                field: "strategy",
                reason: format!("{strategy} is no strategy this node knows"),
            });
        }
    };
    let host = needs::this_host(engine).await?;
    needs::check_here(Role::Destination, strategy, &host, engine.node())
}

/// What this node's CRIU restores (its version checked): the answer to
/// Prepare.
async fn what_criu_restores(engine: &Engine) -> Result<PrepareResponse, EngineError> {
    let criu_path = engine.config.criu_path.clone();
    let features_off = engine.config.features_off.clone();
    Ok(tokio::task::spawn_blocking(move || {
        criu::probe_version(&criu_path).map(|_| {
            let takes_tcp_options = criu::has_patch(&criu_path, criu::OPTS_BY_CALLER_MARK);
            PrepareResponse {
                takes_tcp_options,
                // It builds on the options patch and on the table (the
                // connections it installs come from ferryd's table).
                takes_connections_out: takes_tcp_options
                    && criu::has_patch(&criu_path, criu::TCP_BY_PIDFD_MARK)
                    && criu::has_patch(&criu_path, criu::TCP_TABLE_MARK)
                    && criu::has_patch(&criu_path, criu::CONNS_OUT_MARK),
                // Any CRIU restores lazy runs; the filler needs a kernel
                // whose userfaultfd reports forks, remaps and unmaps.
                fills_held_pages: crate::fill::available(&features_off),
                // A parent image written from the store before the
                // restore (`restore.rs`'s `plan_fill`): any CRIU reads it.
                fills_held_pages_everywhere: crate::fill::available(&features_off),
                // The page store and the image writer decompress.
                takes_lz4: true,
            }
        })
    })
    .await
    .map_err(|source| EngineError::Task {
        what: "probing CRIU",
        source,
    })??)
}
