//! `Control.WaitProcess`: following a managed process until it ends,
//! across the migrations that move it.
//!
//! On the node that manages it, the process's fate comes from this
//! agent's event bus (its exit, or the report of the migration that took
//! it away), subscribed to before the registry is read, so that nothing
//! happening in between is missed. A watcher that falls behind the bus
//! reads the registry, the reports and the recent exits again.
//!
//! When a migration moves it (or when the call names another node), the
//! agent that was called goes on at that node: it calls its WaitProcess
//! (forwarded) and relays what comes. A forwarded call does not follow
//! further: the agent that forwarded it does, so a process is followed
//! through any number of moves with one hop at a time.

use std::sync::Arc;

use ferry_proto::v1::{
    self as pb, MigrationOutcome, MigrationReport, ProcessUpdate, WaitProcessRequest,
    cluster_event::Event, process_update::Update,
};
use tokio::sync::{broadcast, mpsc};
use tonic::Status;

use crate::engine::Engine;
use crate::managed::ProcessEnd;

/// What this node knows of a process.
#[derive(Debug, Clone)]
enum Fate {
    /// Managed here (or leaving, its migration not reported yet).
    Here {
        argv: Vec<String>,
    },
    /// A migration moved it (committed), or lost it (post-copy).
    Migrated(Box<MigrationReport>),
    Exited(pb::ProcessExit),
}

fn fate(engine: &Engine, pid: i32) -> Option<Fate> {
    if let Some(p) = engine.processes.registry().get(pid) {
        return Some(Fate::Here {
            argv: p.argv.clone(),
        });
    }
    if let Some(argv) = engine.processes.departing(pid) {
        return Some(Fate::Here { argv });
    }
    engine.processes.recent_end(pid).map(|end| match end {
        ProcessEnd::Exited(exit) => Fate::Exited(exit),
        ProcessEnd::Migrated(report) => Fate::Migrated(report),
    })
}

fn update(node: &str, pid: i32, u: Update) -> ProcessUpdate {
    ProcessUpdate {
        node: node.to_owned(),
        pid,
        update: Some(u),
    }
}

/// The update a migration's report makes: moved, or ended when post-copy
/// lost it.
fn migrated(report: &MigrationReport) -> ProcessUpdate {
    if report.outcome == MigrationOutcome::Lost as i32 {
        return update(
            &report.destination_node,
            report.destination_pid,
            Update::Exited(pb::ProcessExit {
                status_known: false,
                code: 0,
                signal: 0,
                description: format!(
                    "lost with migration {}: {}",
                    report.migration_id, report.error
                ),
            }),
        );
    }
    update(
        &report.destination_node,
        report.destination_pid,
        Update::Moved(pb::ProcessMoved {
            migration_id: report.migration_id.clone(),
            from_node: report.source_node.clone(),
            from_pid: report.source_pid,
        }),
    )
}

pub type Updates = mpsc::Receiver<Result<ProcessUpdate, Status>>;

/// Starts following `pid`, managed by this node. NOT_FOUND when this node
/// knows nothing of it. `follow_moves`: go on at the destination after a
/// migration (false for a forwarded call).
pub fn start(engine: Arc<Engine>, pid: i32, follow_moves: bool) -> Result<Updates, Status> {
    if pid <= 0 {
        return Err(Status::invalid_argument(format!(
            "pid: {pid} is not a process ID"
        )));
    }
    let events = engine.events.subscribe();
    let first = fate(&engine, pid).ok_or_else(|| {
        Status::not_found(format!(
            "pid: {pid} is not managed by {} (nor did it end or leave lately)",
            engine.node()
        ))
    })?;
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        let last = watch_here(&engine, pid, first, events, &tx, true).await;
        if let Some(moved) = last
            && follow_moves
        {
            follow_elsewhere(&engine, moved, &tx).await;
        }
    });
    Ok(rx)
}

/// Sends what happens to `pid` here until it ends or leaves (first that
/// it runs, if `announce`); returns the `moved` update when it left
/// (already sent).
async fn watch_here(
    engine: &Arc<Engine>,
    pid: i32,
    first: Fate,
    mut events: broadcast::Receiver<pb::ClusterEvent>,
    tx: &mpsc::Sender<Result<ProcessUpdate, Status>>,
    announce: bool,
) -> Option<ProcessUpdate> {
    let node = engine.node().to_owned();
    let mut fate_now = Some(first);
    loop {
        match fate_now.take() {
            Some(Fate::Here { argv }) if announce => {
                let running = update(&node, pid, Update::Running(pb::ProcessRunning { argv }));
                tx.send(Ok(running)).await.ok()?;
            }
            Some(Fate::Here { .. }) => {}
            Some(Fate::Migrated(report)) => {
                let u = migrated(&report);
                let moved = matches!(u.update, Some(Update::Moved(_)));
                tx.send(Ok(u.clone())).await.ok()?;
                return moved.then_some(u);
            }
            Some(Fate::Exited(exit)) => {
                let _ = tx.send(Ok(update(&node, pid, Update::Exited(exit)))).await;
                return None;
            }
            None => {}
        }
        // Wait for this process's next event.
        loop {
            let event = tokio::select! {
                e = events.recv() => e,
                () = engine.events.closed() => {
                    let _ = tx
                        .send(Err(Status::unavailable(format!(
                            "{node}'s agent is stopping; ask again once it is back"
                        ))))
                        .await;
                    return None;
                }
                () = tx.closed() => return None,
            };
            match event {
                Ok(e) => match e.event {
                    Some(Event::ProcessExited(x)) if x.pid == pid => {
                        fate_now = Some(Fate::Exited(x.exit.unwrap_or_default()));
                        break;
                    }
                    Some(Event::MigrationFinished(r))
                        if r.source_pid == pid
                            && (r.outcome == MigrationOutcome::Committed as i32
                                || r.outcome == MigrationOutcome::Lost as i32) =>
                    {
                        fate_now = Some(Fate::Migrated(Box::new(r)));
                        break;
                    }
                    _ => {}
                },
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    // Events went by unread: ask again what became of it.
                    match fate(engine, pid) {
                        Some(Fate::Here { .. }) => {}
                        Some(f) => {
                            fate_now = Some(f);
                            break;
                        }
                        None => {
                            let _ = tx
                                .send(Err(Status::data_loss(format!(
                                    "pid: {pid} left {node}'s management while this watch fell behind its events"
                                ))))
                                .await;
                            return None;
                        }
                    }
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

/// After a move: follows the process on the nodes it goes to, relaying
/// what they say (without their first `running`: the `moved` said it).
async fn follow_elsewhere(
    engine: &Arc<Engine>,
    mut moved: ProcessUpdate,
    tx: &mpsc::Sender<Result<ProcessUpdate, Status>>,
) {
    loop {
        let next = if moved.node == engine.node() {
            // Moved back here: followed from this node's own events.
            let events = engine.events.subscribe();
            match fate(engine, moved.pid) {
                Some(first) => watch_here(engine, moved.pid, first, events, tx, false).await,
                None => {
                    let _ = tx
                        .send(Err(Status::not_found(format!(
                            "pid: {} moved back to {} and is not managed here",
                            moved.pid,
                            engine.node()
                        ))))
                        .await;
                    None
                }
            }
        } else {
            relay_from(engine, &moved, tx).await
        };
        match next {
            Some(u) => moved = u,
            None => return,
        }
    }
}

/// Node `node`'s WaitProcess for `pid`, forwarded (that node does not
/// follow moves itself: this one does).
async fn open_at(
    engine: &Arc<Engine>,
    node: &str,
    pid: i32,
) -> Result<tonic::Streaming<ProcessUpdate>, Status> {
    let peer = engine.cluster.peer(node).ok_or_else(|| {
        Status::not_found(format!(
            "node: the process is on {node:?}, which this agent does not know"
        ))
    })?;
    let mut client = super::forward::client(&engine.cluster, &peer).await?;
    client
        .wait_process(super::forward::request(
            &engine.cluster,
            WaitProcessRequest {
                pid,
                node: node.to_owned(),
            },
        ))
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| super::forward::from_peer(&peer, s))
}

/// Relays `stream` (without its `running` update unless `announce`);
/// returns its `moved` update if the process moved on (already relayed).
async fn relay(
    mut stream: tonic::Streaming<ProcessUpdate>,
    tx: &mpsc::Sender<Result<ProcessUpdate, Status>>,
    announce: bool,
) -> Option<ProcessUpdate> {
    loop {
        match stream.message().await {
            Ok(Some(u)) => {
                let moved_on = matches!(u.update, Some(Update::Moved(_)));
                if !announce && matches!(u.update, Some(Update::Running(_))) {
                    continue;
                }
                tx.send(Ok(u.clone())).await.ok()?;
                if moved_on {
                    return Some(u);
                }
            }
            Ok(None) => return None,
            Err(s) => {
                let _ = tx.send(Err(s)).await;
                return None;
            }
        }
    }
}

/// Relays node `moved.node`'s WaitProcess for `moved.pid`, after a move;
/// returns its `moved` update if the process moved on.
async fn relay_from(
    engine: &Arc<Engine>,
    moved: &ProcessUpdate,
    tx: &mpsc::Sender<Result<ProcessUpdate, Status>>,
) -> Option<ProcessUpdate> {
    match open_at(engine, &moved.node, moved.pid).await {
        Ok(stream) => relay(stream, tx, false).await,
        Err(s) => {
            let _ = tx.send(Err(s)).await;
            None
        }
    }
}

/// Follows `pid`, managed by peer `node` now: that node's updates,
/// then wherever the process moves. NOT_FOUND (or the peer's error) as the
/// call's status when that node knows nothing of it.
pub async fn start_at(engine: Arc<Engine>, node: String, pid: i32) -> Result<Updates, Status> {
    let stream = open_at(&engine, &node, pid).await?;
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        if let Some(moved) = relay(stream, &tx, true).await {
            follow_elsewhere(&engine, moved, &tx).await;
        }
    });
    Ok(rx)
}
