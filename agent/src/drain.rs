//! Draining a node for maintenance (`Control.DrainNode`, seed 004 §2.1):
//! cordon it, then migrate its managed processes away one at a time.
//!
//! One at a time, because each migration freezes a process and loads the
//! link and the destination: a drain should not disturb the cluster more
//! than the balancer's own migrations do. Each process goes to the least
//! loaded node that answers and is not cordoned; a destination that turns
//! the migration down before it starts (busy, cordoned meanwhile, gone) is
//! skipped for the next, and a migration that aborts (the process runs on
//! here) is tried once more elsewhere. Whatever stays is listed at the
//! end, with why. The node stays cordoned: a drained node must not fill
//! up again before the operator says so.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_proto::v1::{
    self as pb, DrainEvent, DrainFinished, DrainMigration, DrainStarted, MigrationEvent,
    drain_event, migration_event,
};
use tokio::sync::mpsc;
use tonic::Status;
use tracing::Instrument;

use crate::agent::Agent;
use crate::engine::source::{self, MigrationOptions};
use crate::managed::Lifecycle;

/// Attempts per process (a migration that aborted keeps the process here,
/// so a second destination is safe to try).
const ATTEMPTS: usize = 2;
/// How long a drain waits for a process some other migration (the
/// balancer's) is moving, before it counts it as staying.
const BUSY_WAIT: Duration = Duration::from_secs(120);

type Events = mpsc::Sender<Result<DrainEvent, Status>>;

/// Starts draining this node; the events come on the returned channel.
/// The drain goes on if the caller stops listening.
pub fn start(
    agent: Arc<Agent>,
    options: MigrationOptions,
    by: String,
) -> Result<mpsc::Receiver<Result<DrainEvent, Status>>, Status> {
    agent.set_cordoned(true, &format!("drain by {by}"))?;
    let (tx, rx) = mpsc::channel(64);
    let span = tracing::info_span!("drain", by = %by);
    tokio::spawn(drain(agent, options, tx).instrument(span));
    Ok(rx)
}

async fn drain(agent: Arc<Agent>, options: MigrationOptions, tx: Events) {
    let started = Instant::now();
    let pids: Vec<i32> = agent.registry().iter().map(|p| p.pid).collect();
    tracing::info!(processes = pids.len(), "draining");
    let _ = tx
        .send(Ok(event(drain_event::Event::Started(DrainStarted {
            node: agent.node().to_owned(),
            pids: pids.clone(),
        }))))
        .await;
    let mut moved = 0u32;
    let mut why_not: Vec<(i32, String)> = Vec::new();
    for pid in pids {
        match drain_one(&agent, pid, options, &tx).await {
            Ok(true) => moved += 1,
            Ok(false) => {} // gone by itself (exited, or moved by another migration)
            Err(reason) => why_not.push((pid, reason)),
        }
    }
    // What is still managed here, with the reason if the drain knows it.
    let remaining: Vec<String> = agent
        .registry()
        .iter()
        .map(|p| {
            let why = why_not
                .iter()
                .find(|(pid, _)| *pid == p.pid)
                .map(|(_, r)| r.clone())
                .unwrap_or_else(|| "arrived during the drain".into());
            format!("{}: {why}", p.pid)
        })
        .collect();
    let finished = DrainFinished {
        node: agent.node().to_owned(),
        moved,
        remaining: remaining.clone(),
        elapsed_us: started.elapsed().as_micros() as u64,
    };
    tracing::info!(moved, remaining = remaining.len(), "drain finished");
    agent
        .events
        .publish(pb::cluster_event::Event::DrainFinished(finished.clone()));
    let _ = tx
        .send(Ok(event(drain_event::Event::Finished(finished))))
        .await;
    if !remaining.is_empty() {
        let _ = tx
            .send(Err(Status::aborted(format!(
                "{} still runs {} process(es): {}",
                agent.node(),
                remaining.len(),
                remaining.join("; ")
            ))))
            .await;
    }
}

fn event(e: drain_event::Event) -> DrainEvent {
    DrainEvent { event: Some(e) }
}

/// Moves one process away. Ok(true): moved; Ok(false): no longer here
/// for another reason; Err: it stays, and why.
async fn drain_one(
    agent: &Arc<Agent>,
    pid: i32,
    options: MigrationOptions,
    tx: &Events,
) -> Result<bool, String> {
    // Another migration (the balancer's) may have it: wait for its end.
    let waited = Instant::now();
    loop {
        let lifecycle = agent.registry().get(pid).map(|p| p.lifecycle.clone());
        match lifecycle {
            None => return Ok(false),
            Some(Lifecycle::Running) => break,
            Some(Lifecycle::MigratingOut { .. }) if waited.elapsed() < BUSY_WAIT => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Some(Lifecycle::MigratingOut { migration_id, .. }) => {
                return Err(format!(
                    "migration {migration_id} held it for over {} s",
                    BUSY_WAIT.as_secs()
                ));
            }
        }
    }
    let mut tried: Vec<String> = Vec::new();
    let mut last_error = String::from("no other node answers or takes processes");
    let mut attempts = 0;
    for destination in destinations(agent).await {
        if attempts == ATTEMPTS {
            break;
        }
        tried.push(destination.clone());
        let prepared = match source::prepare(agent, pid, &destination, options).await {
            Ok(p) => p,
            Err(e) => {
                // Turned down before anything happened: the next node.
                tracing::info!(pid, to = %destination, error = %e, "drain: destination declined");
                last_error = format!("{destination}: {e}");
                let _ = tx
                    .send(Ok(event(drain_event::Event::Migration(DrainMigration {
                        pid,
                        destination_node: destination.clone(),
                        event: None,
                        error: last_error.clone(),
                    }))))
                    .await;
                if matches!(
                    e,
                    crate::engine::EngineError::NoSuchProcess { .. }
                        | crate::engine::EngineError::NotMigratable { .. }
                ) {
                    // About the process, not the destination.
                    return Err(e.to_string());
                }
                continue;
            }
        };
        attempts += 1;
        let (mtx, mut mrx) = mpsc::channel::<Result<MigrationEvent, Status>>(32);
        let run = tokio::spawn(source::run(agent.clone(), prepared, mtx));
        while let Some(ev) = mrx.recv().await {
            let Ok(ev) = ev else { continue };
            let _ = tx
                .send(Ok(event(drain_event::Event::Migration(DrainMigration {
                    pid,
                    destination_node: destination.clone(),
                    event: Some(ev),
                    error: String::new(),
                }))))
                .await;
        }
        let report = match run.await {
            Ok(r) => r,
            Err(e) => return Err(format!("the migration task failed: {e}")),
        };
        let _ = tx
            .send(Ok(event(drain_event::Event::Migration(DrainMigration {
                pid,
                destination_node: destination.clone(),
                event: Some(MigrationEvent {
                    event: Some(migration_event::Event::Report(report.clone())),
                }),
                error: String::new(),
            }))))
            .await;
        match pb::MigrationOutcome::try_from(report.outcome) {
            Ok(pb::MigrationOutcome::Committed) => return Ok(true),
            // Post-copy lost it: it is not here any more either.
            Ok(pb::MigrationOutcome::Lost) => return Err(format!("lost: {}", report.error)),
            _ if report.error.starts_with("cancelled by") => return Err(report.error),
            _ => last_error = format!("{destination}: {}", report.error),
        }
    }
    Err(if tried.is_empty() {
        last_error
    } else {
        format!("tried {}: {last_error}", tried.join(", "))
    })
}

/// The nodes a drained process may go to, best first: those that answer
/// and are not cordoned, by the load the balancer knows (when membership
/// runs) and then by how many processes they manage.
async fn destinations(agent: &Arc<Agent>) -> Vec<String> {
    let loads: std::collections::HashMap<String, f64> = agent
        .conductor
        .get()
        .map(|c| {
            c.report()
                .peers
                .into_iter()
                .map(|p| (p.node, p.load))
                .collect()
        })
        .unwrap_or_default();
    let probes = agent.known_peers().into_iter().map(|peer| async move {
        let answer = agent.hello(&peer).await.ok();
        (peer.name, answer)
    });
    let mut candidates: Vec<(f64, u32, String)> = futures::future::join_all(probes)
        .await
        .into_iter()
        .filter_map(|(name, answer)| {
            let h = answer?;
            if h.cordoned {
                return None;
            }
            let load = loads.get(&name).copied().unwrap_or(0.0);
            Some((load, h.managed_processes, name))
        })
        .collect();
    candidates.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    candidates.into_iter().map(|(_, _, n)| n).collect()
}
