//! Draining a node for maintenance (`Control.DrainNode`, Noack (2003) §2.1):
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
//!
//! One drain per node at a time. `CancelDrain` stops it: no further
//! process is moved, and the migration under way gets the same cancel as
//! `CancelMigration`'s (its own flag, set under the same order: the drain
//! publishes the migration's switch before it checks its own flag, the
//! canceller sets the flag before it reads the switch, so one of them
//! always pulls it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_proto::v1::{
    self as pb, DrainEvent, DrainFinished, DrainMigration, DrainStarted, MigrationEvent,
    drain_event, migration_event,
};
use tokio::sync::mpsc;
use tonic::Status;
use tracing::Instrument;

use crate::conductor::Conductor;
use crate::engine::Engine;
use crate::engine::cancel::Cancel;
use crate::engine::source::{self, MigrationOptions};
use crate::managed::Lifecycle;
use crate::sync::lock;

/// Attempts per process (a migration that aborted keeps the process here,
/// so a second destination is safe to try).
const ATTEMPTS: usize = 2;
/// How long a drain waits for a process some other migration (the
/// balancer's) is moving, before it counts it as staying.
const BUSY_WAIT: Duration = Duration::from_secs(120);

type Events = mpsc::Sender<Result<DrainEvent, Status>>;

/// The drain running on this node, as `CancelDrain` reaches it.
#[derive(Debug)]
pub struct DrainControl {
    /// Who started it.
    by: String,
    cancelled_by: std::sync::Mutex<Option<String>>,
    /// The cancel switch of the migration under way.
    current: std::sync::Mutex<Option<Arc<Cancel>>>,
    finished: tokio::sync::watch::Sender<Option<DrainFinished>>,
}

impl DrainControl {
    fn new(by: &str) -> Self {
        DrainControl {
            by: by.to_owned(),
            cancelled_by: std::sync::Mutex::new(None),
            current: std::sync::Mutex::new(None),
            finished: tokio::sync::watch::channel(None).0,
        }
    }

    fn cancelled(&self) -> Option<String> {
        lock(&self.cancelled_by).clone()
    }

    /// Stops the drain (`CancelDrain`); the first caller is named.
    pub fn cancel(&self, by: &str) {
        lock(&self.cancelled_by).get_or_insert_with(|| by.to_owned());
        if let Some(cancel) = lock(&self.current).as_ref() {
            // Refused only once it is restoring: then it ends by itself.
            let _ = cancel.request(by);
        }
    }

    /// The migration `cancel` switches off is under way, or none is.
    fn under_way(&self, cancel: Option<Arc<Cancel>>) {
        let mut current = lock(&self.current);
        *current = cancel;
        if let (Some(c), Some(by)) = (current.as_ref(), self.cancelled()) {
            let _ = c.request(&by);
        }
    }

    /// The drain's summary, once it has stopped.
    pub async fn finished(&self) -> DrainFinished {
        let mut rx = self.finished.subscribe();
        match rx.wait_for(Option::is_some).await {
            Ok(f) => f.clone().unwrap_or_default(),
            Err(_) => DrainFinished::default(),
        }
    }
}

/// The drain running on this node, if one is, and what a drain ranks
/// destinations by.
#[derive(Debug, Default)]
pub struct Drains {
    current: std::sync::Mutex<Option<Arc<DrainControl>>>,
    /// The balancer's conductor, when membership runs: the peers' loads.
    conductor: Option<Arc<Conductor>>,
}

impl Drains {
    pub fn new(conductor: Option<Arc<Conductor>>) -> Self {
        Self {
            current: std::sync::Mutex::new(None),
            conductor,
        }
    }

    /// The drain running on this node, if one is.
    pub fn running(&self) -> Option<Arc<DrainControl>> {
        lock(&self.current).clone()
    }
}

/// Starts draining this node; the events come on the returned channel.
/// The drain goes on if the caller stops listening (`CancelDrain` stops
/// it). FAILED_PRECONDITION if a drain runs already.
pub fn start(
    engine: Arc<Engine>,
    drains: Arc<Drains>,
    options: MigrationOptions,
    by: String,
) -> Result<mpsc::Receiver<Result<DrainEvent, Status>>, Status> {
    let control = Arc::new(DrainControl::new(&by));
    {
        let mut slot = lock(&drains.current);
        if let Some(other) = slot.as_ref() {
            return Err(Status::failed_precondition(format!(
                "node: a drain of {} runs already (started by {}); stop it with CancelDrain or wait for its end",
                engine.node(),
                other.by
            )));
        }
        *slot = Some(control.clone());
    }
    if let Err(e) = engine.cordon.set(true, &format!("drain by {by}")) {
        *lock(&drains.current) = None;
        return Err(Status::internal(e.to_string()));
    }
    let (tx, rx) = mpsc::channel(64);
    let span = tracing::info_span!("drain", by = %by);
    tokio::spawn(drain(engine, drains, options, tx, control).instrument(span));
    Ok(rx)
}

async fn drain(
    engine: Arc<Engine>,
    drains: Arc<Drains>,
    options: MigrationOptions,
    tx: Events,
    control: Arc<DrainControl>,
) {
    let started = Instant::now();
    let pids: Vec<i32> = engine.processes.registry().iter().map(|p| p.pid).collect();
    tracing::info!(processes = pids.len(), "draining");
    let _ = tx
        .send(Ok(event(drain_event::Event::Started(DrainStarted {
            node: engine.node().to_owned(),
            pids: pids.clone(),
        }))))
        .await;
    let mut moved = 0u32;
    let mut why_not: Vec<(i32, String)> = Vec::new();
    for pid in pids {
        if let Some(by) = control.cancelled() {
            why_not.push((pid, format!("not moved: the drain was cancelled by {by}")));
            continue;
        }
        match drain_one(&engine, &drains, pid, options, &tx, &control).await {
            Ok(true) => moved += 1,
            Ok(false) => {} // gone by itself (exited, or moved by another migration)
            Err(reason) => why_not.push((pid, reason)),
        }
    }
    // What is still managed here, with the reason if the drain knows it.
    let remaining: Vec<String> = engine
        .processes
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
    let cancelled_by = control.cancelled();
    let finished = DrainFinished {
        node: engine.node().to_owned(),
        moved,
        remaining: remaining.clone(),
        elapsed_us: started.elapsed().as_micros() as u64,
        cancelled_by: cancelled_by.clone().unwrap_or_default(),
    };
    tracing::info!(moved, remaining = remaining.len(), cancelled_by = ?cancelled_by, "drain finished");
    engine
        .events
        .publish(pb::cluster_event::Event::DrainFinished(finished.clone()));
    // The next drain may start; CancelDrain callers get the summary.
    {
        let mut slot = lock(&drains.current);
        if slot.as_ref().is_some_and(|d| Arc::ptr_eq(d, &control)) {
            *slot = None;
        }
    }
    control.finished.send_replace(Some(finished.clone()));
    let _ = tx
        .send(Ok(event(drain_event::Event::Finished(finished))))
        .await;
    if let Some(by) = cancelled_by {
        let _ = tx
            .send(Err(Status::cancelled(format!(
                "drain cancelled by {by}; {} still runs {} process(es): {}",
                engine.node(),
                remaining.len(),
                remaining.join("; ")
            ))))
            .await;
    } else if !remaining.is_empty() {
        let _ = tx
            .send(Err(Status::aborted(format!(
                "{} still runs {} process(es): {}",
                engine.node(),
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
    engine: &Arc<Engine>,
    drains: &Drains,
    pid: i32,
    options: MigrationOptions,
    tx: &Events,
    control: &DrainControl,
) -> Result<bool, String> {
    let cancelled = |by: String| format!("not moved: the drain was cancelled by {by}");
    // Another migration (the balancer's) may have it: wait for its end.
    let waited = Instant::now();
    loop {
        if let Some(by) = control.cancelled() {
            return Err(cancelled(by));
        }
        let lifecycle = engine
            .processes
            .registry()
            .get(pid)
            .map(|p| p.lifecycle.clone());
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
    for destination in destinations(engine, drains).await {
        if attempts == ATTEMPTS {
            break;
        }
        if let Some(by) = control.cancelled() {
            return Err(cancelled(by));
        }
        tried.push(destination.clone());
        let prepared = match source::prepare(engine, pid, &destination, options).await {
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
        control.under_way(Some(prepared.cancel.clone()));
        let (mtx, mut mrx) = mpsc::channel::<Result<MigrationEvent, Status>>(32);
        let run = tokio::spawn(source::run(engine.clone(), prepared, mtx));
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
        let report = run.await;
        control.under_way(None);
        let report = match report {
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
async fn destinations(engine: &Arc<Engine>, drains: &Drains) -> Vec<String> {
    let loads: std::collections::HashMap<String, f64> = drains
        .conductor
        .as_ref()
        .map(|c| {
            c.report()
                .peers
                .into_iter()
                .map(|p| (p.node, p.load))
                .collect()
        })
        .unwrap_or_default();
    let probes = engine
        .cluster
        .known_peers()
        .into_iter()
        .map(|peer| async move {
            let answer = engine.cluster.hello(&peer).await.ok();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cancel_reaches_the_migration_under_way_whichever_comes_first() {
        // The cancel comes while a migration runs.
        let control = DrainControl::new("op");
        let running = Arc::new(Cancel::default());
        control.under_way(Some(running.clone()));
        assert!(running.check().is_ok());
        control.cancel("alice");
        assert!(matches!(
            running.check(),
            Err(crate::engine::EngineError::Cancelled { by }) if by == "alice"
        ));

        // The cancel comes between two migrations: the next one is
        // switched off as soon as it is published.
        let control = DrainControl::new("op");
        control.cancel("bob");
        let next = Arc::new(Cancel::default());
        control.under_way(Some(next.clone()));
        assert!(next.check().is_err());
        // The first canceller is the one named.
        control.cancel("carol");
        assert_eq!(control.cancelled().as_deref(), Some("bob"));
        control.under_way(None);
    }

    #[tokio::test]
    async fn cancellers_get_the_summary_once_the_drain_stops() {
        let control = Arc::new(DrainControl::new("op"));
        let waiting = tokio::spawn({
            let control = control.clone();
            async move { control.finished().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        control.finished.send_replace(Some(DrainFinished {
            node: "node1".into(),
            moved: 1,
            ..Default::default()
        }));
        let f = waiting.await.unwrap();
        assert_eq!((f.node.as_str(), f.moved), ("node1", 1));
    }
}
