//! What a migration from this node carries from its first phase to its
//! last: the prepared request, the report being written, the events, and
//! the ledger of what an abort must undo.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

use ferry_proto::v1::{
    MigrationEvent, MigrationOutcome, MigrationPhase, MigrationProgress, MigrationReport,
    MigrationStarted, PhaseTiming, cluster_event, migration_event,
};
use tokio::sync::mpsc;

use super::carry::Listening;
use super::peers::PendingLink;
use super::undo::Undo;
use super::{Phase, Prepared, Stop};
use crate::criu::{Checkpointer, OPTS_BY_CALLER_MARK};
use crate::engine::journal::{OutgoingStage, Record, Translated};
use crate::engine::{Engine, EngineError};
use crate::managed::{Lifecycle, OutStage};
use crate::process::PortKey;
use crate::sockstate::SocketMigration;

/// Where a migration's progress goes (`Control.Migrate`'s stream).
pub type Events = mpsc::Sender<Result<MigrationEvent, tonic::Status>>;

/// A migration from this node, from its first phase to its end.
pub(super) struct Run {
    pub engine: Arc<Engine>,
    pub p: Prepared,
    events: Events,
    pub report: MigrationReport,
    last_phase: Instant,
    /// `<work_dir>/outgoing/<id>`: CRIU's images and logs.
    pub dir: PathBuf,
    /// Whether packets are captured (here while frozen, and on the
    /// destination from Arm) rather than dropped.
    pub capture: bool,
    /// The process's ports, as Prepare read them.
    pub ports: Vec<PortKey>,
    /// The bound on each answer of the destination (`peer_timeout_secs`).
    pub deadline: Duration,
    /// When the process's ports were frozen, if they were.
    pub freeze_start: Option<Instant>,
    pub undo: Undo,
    /// Connections to the nodes at the far end of the process's
    /// connections, opened at Start (see `translate.rs`).
    pub peer_links: Vec<(String, PendingLink)>,
    /// perf's scheduler hooks for CRIU's breakpoints: opening from Start,
    /// held from the dump to the end of the migration.
    pub sched_hooks: Option<tokio::task::JoinHandle<std::io::Result<crate::criu::SchedHooks>>>,
    pub held_sched_hooks: Option<crate::criu::SchedHooks>,
    /// The dump left pages out that the destination holds: it fills them
    /// after the resume ([`super::Phase::Fill`] asks how).
    pub held_left_out: bool,
    /// Post-copy whose pages follow by ferryd: the processes of the tree,
    /// (PID in its namespace, host PID), as the dump found them; their
    /// stopped copies are what the pages are read from.
    pub pages_follow_from: Vec<(u32, i32)>,
    /// The process's start time, as the journal records it.
    start_ticks: Option<u64>,
}

impl Run {
    /// The report's start, the migration known as outgoing here, and its
    /// `MigrationStarted` event sent.
    pub async fn begin(engine: Arc<Engine>, p: Prepared, events: Events) -> Self {
        let report = MigrationReport {
            migration_id: p.migration_id.clone(),
            strategy: p.strategy.to_pb() as i32,
            memory_tracking: if p.strategy.is_precopy() {
                "uffd-wp-async+pagemap-scan".into()
            } else {
                String::new()
            },
            outcome: MigrationOutcome::Unspecified as i32,
            source_node: engine.node().to_owned(),
            destination_node: p.destination.name.clone(),
            source_pid: p.pid,
            tcp_established: p.sockets.tcp_established,
            tcp_listening: p.sockets.tcp_listening,
            udp_sockets: p.sockets.udp,
            ports: p.sockets.ports.iter().map(PortKey::to_pb).collect(),
            capture: engine.config.dataplane.capture,
            sockets: p.socket_migration.to_pb() as i32,
            sockets_note: p.socket_note.clone().unwrap_or_default(),
            fallbacks: p.fallbacks.clone(),
            started_at_unix_ms: p
                .started_wall
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            phases: vec![PhaseTiming {
                phase: "prepare".into(),
                duration_us: 0,
            }],
            ..Default::default()
        };
        engine.outgoing.started(&p.migration_id, p.cancel.clone());
        let started = MigrationStarted {
            migration_id: p.migration_id.clone(),
            source_node: engine.node().to_owned(),
            destination_node: p.destination.name.clone(),
            pid: p.pid,
        };
        engine
            .events
            .publish(cluster_event::Event::MigrationStarted(started.clone()));
        let _ = events
            .send(Ok(MigrationEvent {
                event: Some(migration_event::Event::Started(started)),
            }))
            .await;
        let dir = engine
            .config
            .work_dir
            .join("outgoing")
            .join(&p.migration_id);
        Self {
            capture: engine.config.dataplane.capture,
            ports: p.sockets.ports.iter().copied().collect(),
            deadline: Duration::from_secs(engine.config.peer_timeout_secs),
            // "prepare" runs from the request to the first phase after it.
            last_phase: p.started,
            freeze_start: None,
            undo: Undo::default(),
            peer_links: Vec::new(),
            sched_hooks: None,
            held_sched_hooks: None,
            held_left_out: false,
            pages_follow_from: Vec::new(),
            start_ticks: None,
            engine,
            p,
            events,
            report,
            dir,
        }
    }

    /// Records the migration at `stage` in the journal, for a restart of
    /// this agent ([`crate::engine::journal`]); the start ticks are read
    /// once, at the first record.
    pub fn record(&mut self, stage: OutgoingStage) -> Result<(), EngineError> {
        let pid = self.p.pid;
        let start_ticks = match self.start_ticks {
            Some(t) => t,
            None => *self
                .start_ticks
                .insert(crate::process::inspect(pid)?.start_ticks),
        };
        let argv = self
            .engine
            .processes
            .registry()
            .get(pid)
            .map(|p| p.argv.clone())
            .unwrap_or_default();
        self.engine.journal.write(&Record::Outgoing {
            migration_id: self.p.migration_id.clone(),
            pid,
            start_ticks,
            argv,
            destination: self.p.destination.name.clone(),
            protocol_version: self.p.protocol_version,
            stage,
            translated: Translated::of(&self.undo.translated),
        })?;
        Ok(())
    }

    /// The images' directory.
    pub fn images(&self) -> PathBuf {
        self.dir.join("images")
    }

    /// Says in the report (and the log) that the migration does without
    /// `feature`, which `node` lacks, and what it does `instead`.
    pub fn fall_back(&mut self, feature: &str, node: &str, instead: String) {
        tracing::info!(feature, node, instead = %instead, "a feature the node lacks: fallback");
        self.report.fallbacks.push(ferry_proto::v1::Fallback {
            feature: feature.to_owned(),
            node: node.to_owned(),
            instead,
        });
    }

    /// A progress event with the migration's time and bytes so far.
    pub fn progress(&self, phase: String) -> MigrationProgress {
        MigrationProgress {
            phase,
            elapsed_us: self.p.started.elapsed().as_micros() as u64,
            bytes_transferred: self.report.bytes_transferred,
        }
    }

    /// A sender of progress events that does not wait (pre-copy's rounds).
    pub fn events(&self) -> Events {
        self.events.clone()
    }

    /// Starts the report's phase `name` and says so (log, events).
    pub async fn phase(&mut self, name: &str) {
        let now = Instant::now();
        if let Some(last) = self.report.phases.last_mut() {
            last.duration_us = (now - self.last_phase).as_micros() as u64;
        }
        self.last_phase = now;
        self.report.phases.push(PhaseTiming {
            phase: name.to_owned(),
            duration_us: 0,
        });
        tracing::info!(phase = name, "migration phase");
        let progress = self.progress(name.to_owned());
        self.engine
            .events
            .publish(cluster_event::Event::MigrationPhase(MigrationPhase {
                migration_id: self.p.migration_id.clone(),
                progress: Some(progress.clone()),
            }));
        // The migration goes on if the caller stopped listening.
        let _ = self
            .events
            .send(Ok(MigrationEvent {
                event: Some(migration_event::Event::Progress(progress)),
            }))
            .await;
    }

    fn close_phases(&mut self) {
        if let Some(last) = self.report.phases.last_mut() {
            last.duration_us = self.last_phase.elapsed().as_micros() as u64;
        }
    }

    /// The phase after pre-copy, or instead of it.
    pub fn after_pre_copy(&self) -> Phase {
        if self.p.socket_migration == SocketMigration::Incremental {
            Phase::PreRead
        } else {
            Phase::Listen(Listening { incremental: None })
        }
    }

    /// Digests of what this node delivered while recording, once the
    /// capture ring's collection started at the transfer is done.
    pub async fn delivered_log(&mut self) -> Vec<u64> {
        if let Err(e) = self.finish_collecting().await {
            // The destination holds a restored copy: go on without the
            // log; the replay then also feeds what the source delivered,
            // and TCP drops those duplicates (a UDP datagram could be
            // doubled).
            tracing::error!(error = %e, "collecting the delivered log");
        }
        let delivered = self
            .engine
            .dataplane
            .capture
            .take_delivered(&self.p.migration_id);
        tracing::debug!(packets = delivered.len(), "delivered while recording");
        delivered
    }

    /// Waits for the collection of the capture ring started at the
    /// transfer, if any.
    pub async fn finish_collecting(&mut self) -> Result<(), EngineError> {
        match self.undo.collecting.take() {
            Some(task) => task.await.map_err(|source| EngineError::Task {
                what: "collecting the capture ring",
                source,
            }),
            None => Ok(()),
        }
    }

    /// The migration's end: the report completed, kept and announced, the
    /// images gone (the logs kept if it failed, or at log level 4).
    /// The destination's figure for its peak extra memory so far (the
    /// Commit's, then the one after the resume's work): the report keeps
    /// the highest.
    pub fn note_destination_peak(&mut self, bytes: u64) {
        let peak = &mut self.report.destination_peak_extra_bytes;
        *peak = (*peak).max(bytes);
    }

    pub async fn end(mut self, stop: Stop) -> MigrationReport {
        let engine = self.engine.clone();
        match stop {
            // The rollback wrote its part of the report.
            Stop::Aborted => {}
            Stop::Committed(err) => {
                // The source copy was killed once the destination answered
                // the Commit; by the time the report says "committed" it
                // is dead (a zombie at most, its sockets closed), no CRIU
                // here holds one of its connections, and this node no
                // longer remembers it.
                crate::engine::wait_dead(self.p.pid).await;
                crate::engine::settle_criu_exits().await;
                engine.processes.persist_soon();
                self.report.outcome = MigrationOutcome::Committed as i32;
                if let Some(e) = err {
                    self.report.error = format!(
                        "the process moved, but {} did not confirm it resumed it: {e}",
                        self.p.destination.name
                    );
                }
            }
            Stop::Lost(err) => {
                tracing::error!(error = %err, "post-copy failed after the resume: the process is lost");
                crate::engine::wait_dead(self.p.pid).await;
                crate::engine::settle_criu_exits().await;
                engine.processes.persist_soon();
                self.report.outcome = MigrationOutcome::Lost as i32;
                self.report.error = err.to_string();
                self.report.error_code = err.code() as i32;
            }
        }
        let id = self.p.migration_id.clone();
        if self.report.outcome != MigrationOutcome::Committed as i32
            || crate::engine::keeps_every_log(&engine.config)
        {
            crate::engine::keep_logs(&engine.config.work_dir, &self.dir, &id);
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %self.dir.display(), error = %e, "removing images");
        }
        self.report.total_time_us = self.p.started.elapsed().as_micros() as u64;
        self.close_phases();
        engine.reports.store(self.report.clone());
        engine.processes.departed(&self.report);
        engine
            .events
            .publish(cluster_event::Event::MigrationFinished(self.report.clone()));
        // Settled: a restart has nothing left to decide.
        if let Err(e) = engine.journal.remove_outgoing(&id) {
            tracing::error!(error = %e, "removing the migration's journal record");
        }
        engine.outgoing.finished(&id);
        self.p.cancel.finish(self.report.clone());
        tracing::info!(
            outcome = self.report.outcome,
            freeze_ms = self.report.freeze_time_us as f64 / 1000.0,
            total_ms = self.report.total_time_us as f64 / 1000.0,
            bytes = self.report.bytes_transferred,
            error = %self.report.error,
            "migration finished"
        );
        self.report
    }
}

/// The lifecycle of a process migration `migration_id` moves out at
/// `stage`.
pub(super) fn out_stage(migration_id: &str, stage: OutStage) -> Lifecycle {
    Lifecycle::MigratingOut {
        migration_id: migration_id.to_owned(),
        stage,
    }
}

/// Whether ferryd reads and carries the connections' socket options
/// (collective, the destination takes them, and this node's CRIU leaves
/// them out). The pre-read and the dump must agree on it.
pub(super) fn options_by_ferryd(
    collective: bool,
    destination_takes: bool,
    criu: &dyn Checkpointer,
) -> bool {
    collective && destination_takes && criu.has_patch(OPTS_BY_CALLER_MARK)
}
