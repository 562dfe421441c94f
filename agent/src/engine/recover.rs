//! Settling, when the agent starts, the migrations a crash of the one
//! before left half done: from the journal ([`super::journal`], which
//! says what each record means) and, past the source's Release, from the
//! destination's word.
//!
//! Runs after the managed processes were adopted again (they run on while
//! their agent is down, their ports kept by the pinned filter) and before
//! the APIs serve. What needs no peer is done before it returns (a stopped
//! copy that never sent a Commit resumes, a restored copy that never ran
//! is killed); what needs the destination's word is asked in the
//! background, the process stopped and "in doubt" meanwhile (`ferry ps`
//! says so), for as long as the destination does not answer: resuming it
//! without that word could run it on two nodes. A source's settled
//! migration gets a report (`GetMigration`), saying it was settled after a
//! restart. The translations a source had its in-cluster peers' nodes add
//! are in its record, and undone when the migration did not commit.

use std::sync::Arc;
use std::time::Duration;

use ferry_proto::v1::{AbortRequest, MigrationOutcome, MigrationReport};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::journal::{COMMITTED_KEPT, IncomingStage, OutgoingStage, Record};
use super::{Engine, blocking, rollback};
use crate::managed::{Lifecycle, ManagedProcess, Origin, OutStage};

/// How long between two questions to a destination that did not answer.
const ASK_AGAIN: Duration = Duration::from_secs(2);

/// What was settled at start, for the log.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Recovered {
    /// Stopped copies resumed here (no Commit had been sent).
    pub resumed: usize,
    /// Restored copies that never ran, killed.
    pub killed: usize,
    /// Processes committed here, managed again (resumed if still stopped).
    pub committed: usize,
    /// Copies in doubt, the destination asked in the background.
    pub in_doubt: usize,
    /// Records that could not be read, left for an operator.
    pub unreadable: usize,
}

/// Settles what the journal holds; see the module's doc.
pub async fn recover(engine: &Arc<Engine>) -> Recovered {
    let journal = engine.journal.clone();
    let records = blocking("reading the journal", move || journal.records())
        .await
        .unwrap_or_default();
    let mut done = Recovered::default();
    for record in records {
        let record = match record {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "a journal record cannot be read; left for an operator");
                done.unreadable += 1;
                continue;
            }
        };
        tracing::warn!(?record, "settling a migration an earlier agent left");
        match record {
            Record::Outgoing {
                stage: OutgoingStage::Started,
                ..
            } => {
                resume_unreleased(engine, &record).await;
                done.resumed += 1;
            }
            Record::Outgoing {
                stage: OutgoingStage::Released,
                ..
            } => {
                hold_in_doubt(engine, &record).await;
                let engine = engine.clone();
                tokio::spawn(async move { settle_in_doubt(&engine, record).await });
                done.in_doubt += 1;
            }
            Record::Incoming {
                stage: IncomingStage::Prepared,
                ..
            } => {
                done.killed += kill_unrecorded(engine, &record).await;
            }
            Record::Incoming {
                stage: IncomingStage::Restored,
                ..
            } => {
                kill_restored(engine, &record).await;
                done.killed += 1;
            }
            Record::Incoming {
                stage: IncomingStage::Committed,
                ..
            } => {
                if manage_committed(engine, &record).await {
                    done.committed += 1;
                }
            }
        }
    }
    engine.journal.prune_committed(COMMITTED_KEPT);
    if done != Recovered::default() {
        tracing::warn!(?done, "migrations of the earlier agent settled");
    }
    done
}

/// The process a record names, if it still runs (PID and start time
/// match, not a zombie).
fn alive(pid: i32, start_ticks: u64) -> bool {
    matches!(
        crate::process::inspect(pid),
        Ok(i) if i.start_ticks == start_ticks && i.state != 'Z' && i.state != 'X'
    )
}

fn remove(engine: &Engine, record: &Record) {
    let id = record.migration_id();
    let removed = match record {
        Record::Outgoing { .. } => engine.journal.remove_outgoing(id),
        Record::Incoming { .. } => engine.journal.remove_incoming(id),
    };
    if let Err(e) = removed {
        tracing::error!(migration = id, error = %e, "removing a settled journal record");
    }
}

/// Source, before its Release: no Commit was sent, the destination never
/// resumed the process. The copy here resumes (sockets out of repair
/// mode; what was captured here while it was frozen went with the agent:
/// TCP sends it again), owns its ports again, and the destination is told
/// to drop its copy.
async fn resume_unreleased(engine: &Arc<Engine>, record: &Record) {
    let Record::Outgoing {
        migration_id,
        pid,
        start_ticks,
        destination,
        ..
    } = record
    else {
        return;
    };
    let (pid, start_ticks) = (*pid, *start_ticks);
    untranslate(engine, record).await;
    if alive(pid, start_ticks) {
        resume_here(engine, pid, migration_id).await;
    } else {
        tracing::warn!(pid, migration = %migration_id, "the process of an unfinished migration is gone");
    }
    settled(engine, record, false);
    remove(engine, record);
    let engine = engine.clone();
    let (id, destination) = (migration_id.clone(), destination.clone());
    tokio::spawn(async move {
        // The answer does not matter: the destination never had a Commit.
        ask_destination(&engine, &destination, &id, Some(300)).await;
    });
}

/// Source, not committed: the peers' nodes that were asked to translate
/// the process's in-cluster flows to the destination send them here
/// again (before the resume, as an abort does). None is this node: a
/// process with a peer here is refused before the freeze.
async fn untranslate(engine: &Arc<Engine>, record: &Record) {
    let Record::Outgoing {
        migration_id,
        translated,
        ..
    } = record
    else {
        return;
    };
    if translated.is_empty() {
        return;
    }
    tracing::warn!(migration = %migration_id, nodes = translated.len(), "undoing the translations of a migration that did not commit");
    super::source::untranslate_in_cluster(
        engine,
        migration_id,
        super::journal::Translated::by_node(translated),
    )
    .await;
}

/// Resumes the stopped copy `pid` here and gives it its ports back.
async fn resume_here(engine: &Arc<Engine>, pid: i32, migration_id: &str) {
    match blocking("resuming after a restart", move || {
        rollback::resume_on_source(pid)
    })
    .await
    {
        Ok(Ok(())) => {
            tracing::warn!(pid, migration = %migration_id, "process resumed here: its migration never committed")
        }
        Ok(Err(e)) | Err(e) => {
            tracing::error!(pid, migration = %migration_id, error = %e, "resuming the process of an unfinished migration")
        }
    }
    engine.processes.set_lifecycle(pid, Lifecycle::Running);
    own_ports(engine, pid).await;
    // Released ports come back by the peers' word.
    if let Err(e) = engine.ports.refresh().await {
        tracing::error!(error = %e, "claiming the ports of a resumed process");
    }
}

/// Source, past its Release: the copy stays stopped, without ports, and
/// shows as in doubt until the destination says what it decided.
async fn hold_in_doubt(engine: &Arc<Engine>, record: &Record) {
    let Record::Outgoing {
        migration_id,
        pid,
        start_ticks,
        ..
    } = record
    else {
        return;
    };
    if alive(*pid, *start_ticks) {
        engine.processes.set_lifecycle(
            *pid,
            Lifecycle::MigratingOut {
                migration_id: migration_id.clone(),
                stage: OutStage::InDoubt,
            },
        );
        if let Err(e) = engine.ports.apply().await {
            tracing::error!(error = %e, "holding the ports of a copy in doubt");
        }
    }
}

/// Asks the destination until it answers, then kills the copy here
/// (committed there) or resumes it (not).
async fn settle_in_doubt(engine: &Arc<Engine>, record: Record) {
    let Record::Outgoing {
        migration_id,
        pid,
        start_ticks,
        destination,
        protocol_version,
        ..
    } = &record
    else {
        return;
    };
    if *protocol_version < ferry_proto::PEER_PROTOCOL_DECIDED {
        tracing::error!(
            pid,
            migration = %migration_id,
            protocol_version,
            "{destination} speaks a protocol that does not say whether it committed: the copy here stays stopped; an operator decides (kill it if the process runs on {destination}, else SIGCONT it)"
        );
        return;
    }
    let Some(committed) = ask_destination(engine, destination, migration_id, None).await else {
        return;
    };
    if !alive(*pid, *start_ticks) {
        tracing::warn!(pid, migration = %migration_id, committed, "the copy in doubt is gone");
        engine.processes.depart(*pid);
        engine.processes.persist_soon();
    } else if committed {
        tracing::warn!(pid, migration = %migration_id, "{destination} committed the migration: the copy here goes");
        // The root is its PID namespace's init: the tree goes with it.
        if let Err(e) = kill(Pid::from_raw(*pid), Signal::SIGKILL) {
            tracing::error!(pid, error = %e, "killing the copy of a committed migration");
        }
        engine.processes.depart(*pid);
        super::wait_dead(*pid).await;
        engine.processes.persist_soon();
    } else {
        untranslate(engine, &record).await;
        resume_here(engine, *pid, migration_id).await;
    }
    settled(engine, &record, committed);
    remove(engine, &record);
}

/// The report of a migration settled after a restart, kept for
/// `GetMigration` and `ferry report`, and the process's end if it moved.
fn settled(engine: &Engine, record: &Record, committed: bool) {
    let Record::Outgoing {
        migration_id,
        pid,
        start_ticks,
        destination,
        ..
    } = record
    else {
        return;
    };
    let (outcome, how) = if committed {
        (MigrationOutcome::Committed, "had committed it")
    } else {
        (MigrationOutcome::Aborted, "had not committed it")
    };
    let report = MigrationReport {
        migration_id: migration_id.clone(),
        outcome: outcome as i32,
        source_node: engine.node().to_owned(),
        destination_node: destination.clone(),
        source_pid: *pid,
        resumed_on_source: !committed && alive(*pid, *start_ticks),
        error: format!(
            "settled after this node's agent restarted in the migration: {destination} {how}"
        ),
        ..Default::default()
    };
    engine.reports.store(report.clone());
    engine.processes.departed(&report);
}

/// `Peer.Abort` to `destination` until it answers (at most `attempts`
/// times if given): whether it had committed, or None if it never
/// answered.
async fn ask_destination(
    engine: &Arc<Engine>,
    destination: &str,
    migration_id: &str,
    attempts: Option<u32>,
) -> Option<bool> {
    let req = AbortRequest {
        migration_id: migration_id.to_owned(),
        reason: "the source agent restarted before the migration ended".into(),
    };
    let deadline = Duration::from_secs(engine.config.peer_timeout_secs);
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let answer = match engine.cluster.peer(destination) {
            None => Err(format!("{destination} is no node this agent knows")),
            Some(peer) => match engine.links.connect(&peer).await {
                Err(e) => Err(e.to_string()),
                Ok(link) => match tokio::time::timeout(deadline, link.abort(req.clone())).await {
                    Ok(Ok(r)) => Ok(r.committed),
                    Ok(Err(s)) => Err(s.to_string()),
                    Err(_) => Err(format!("no answer within {deadline:?}")),
                },
            },
        };
        match answer {
            Ok(committed) => {
                tracing::info!(
                    migration = migration_id,
                    committed,
                    attempt,
                    "{destination} answered"
                );
                return Some(committed);
            }
            Err(e) => {
                if attempt == 1 || attempt.is_multiple_of(30) {
                    tracing::warn!(migration = migration_id, attempt, error = %e, "{destination} does not say what it decided; asking again");
                }
                if attempts.is_some_and(|n| attempt >= n) {
                    tracing::error!(migration = migration_id, "{destination} never answered");
                    return None;
                }
            }
        }
        tokio::time::sleep(ASK_AGAIN).await;
    }
}

/// Destination, restored and never resumed: the source did not commit
/// (it could not have: the Commit would have found this agent), or will
/// hear that it did not. The copy goes.
async fn kill_restored(engine: &Arc<Engine>, record: &Record) {
    let Record::Incoming {
        migration_id,
        pid,
        start_ticks,
        ..
    } = record
    else {
        return;
    };
    if alive(*pid, *start_ticks) {
        tracing::warn!(pid, migration = %migration_id, "killing a restored copy that never ran");
        if let Err(e) = kill(Pid::from_raw(*pid), Signal::SIGKILL) {
            tracing::error!(pid, error = %e, "killing a restored copy");
        }
        super::wait_dead(*pid).await;
    }
    remove(engine, record);
}

/// Destination, prepared: if the agent died inside CRIU's restore, CRIU
/// finished it and left a stopped copy that no record names by PID (or,
/// killed too, left its tasks running); it never resumed as the process,
/// and the source resumed (it had no answer). Found by what only it is
/// ([`crate::process::unrecorded_copies`]), in any state, and killed with
/// its PID namespace. Returns how many were.
async fn kill_unrecorded(engine: &Arc<Engine>, record: &Record) -> usize {
    let Record::Incoming {
        migration_id,
        start_ticks: since,
        argv,
        ..
    } = record
    else {
        return 0;
    };
    let killed =
        super::destination::kill_unrecorded_copies(engine, migration_id, *since, argv).await;
    remove(engine, record);
    killed
}

/// Destination, committed: the process is this node's. Managed again
/// (the list on disk may predate the commit), and resumed if the agent
/// died between its decision and the resume. The record stays, for the
/// source's question. True if the process runs.
async fn manage_committed(engine: &Arc<Engine>, record: &Record) -> bool {
    let Record::Incoming {
        migration_id,
        pid,
        start_ticks,
        argv,
        from,
        ..
    } = record
    else {
        return false;
    };
    let pid = *pid;
    if !alive(pid, *start_ticks) {
        return false;
    }
    let adopted = engine.processes.adopt_if_new(ManagedProcess {
        pid,
        argv: argv.clone(),
        origin: Origin::MigratedIn {
            migration_id: migration_id.clone(),
            from: from.clone(),
        },
        lifecycle: Lifecycle::Running,
        sockets: Default::default(),
    });
    if adopted {
        tracing::warn!(pid, migration = %migration_id, "a process committed here before the restart, managed again");
        engine.supervisor.watch_exit(pid, "committed");
        engine.processes.persist_soon();
    }
    if crate::process::state_of(pid).is_some_and(|s| s == 'T' || s == 't') {
        // Still as CRIU restored it: stopped, its connections maybe in
        // repair mode. What the agent captured for it went with the agent:
        // TCP sends it again.
        match blocking("resuming a committed process", move || {
            rollback::resume_on_source(pid)
        })
        .await
        {
            Ok(Ok(())) => {
                tracing::warn!(pid, migration = %migration_id, "committed process resumed after the restart")
            }
            Ok(Err(e)) | Err(e) => {
                tracing::error!(pid, error = %e, "resuming a committed process")
            }
        }
    }
    own_ports(engine, pid).await;
    true
}

/// Reads the ports of `pid` (running, managed) and owns them: a process
/// adopted again after a restart is known without its sockets until the
/// next periodic read, and the filter must not drop its ports meanwhile.
async fn own_ports(engine: &Arc<Engine>, pid: i32) {
    match blocking("reading a process's sockets", move || {
        crate::managed::read_sockets(vec![pid])
    })
    .await
    {
        Ok(read) => engine.processes.refresh(read),
        Err(e) => tracing::error!(pid, error = %e, "reading a process's sockets"),
    }
    if let Err(e) = engine.ports.apply().await {
        tracing::error!(pid, error = %e, "owning the ports of a process");
    }
}
