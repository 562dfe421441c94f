//! The managed processes as a service of the node: the registry, how the
//! ones that left lately left, and the list a restarted agent adopts again.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use ferry_proto::v1::{self as pb, MigrationReport, cluster_event::Event};

use super::persist::{self, MigratedIn, Remembered};
use super::{Lifecycle, ManagedProcess, Origin, Registry};
use crate::events::EventBus;
use crate::sync::lock;

/// Ends remembered for late `WaitProcess` calls.
const RECENT_ENDS: usize = 256;

/// How a managed process stopped being this node's.
#[derive(Debug, Clone)]
pub enum ProcessEnd {
    Exited(pb::ProcessExit),
    /// A migration that committed (it runs elsewhere) or lost it.
    Migrated(Box<MigrationReport>),
}

/// Why a managed process must stay on this node, for as long as `holds`
/// says so (checked at each question, so a pin ends with its reason).
struct Pin {
    reason: String,
    holds: Box<dyn Fn() -> bool + Send>,
}

impl std::fmt::Debug for Pin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pin").field("reason", &self.reason).finish()
    }
}

/// The processes this node manages.
#[derive(Debug)]
pub struct Processes {
    registry: Mutex<Registry>,
    /// How the managed processes that left lately left (ended, or moved
    /// away), newest last, by PID: for a `WaitProcess` that comes just
    /// after. One list in time order, so that a PID used again is judged
    /// by its newest end.
    ends: Mutex<VecDeque<(i32, ProcessEnd)>>,
    /// Processes a migration took away whose report is not stored yet, by
    /// PID, with their command lines ([`Self::depart`]).
    departing: Mutex<HashMap<i32, Vec<String>>>,
    /// Serialises [`Self::persist`].
    persisting: Mutex<()>,
    /// Processes that must not migrate, by PID ([`Self::pin`]).
    pins: Mutex<HashMap<i32, Pin>>,
    /// `<work_dir>/managed.json`.
    state_file: PathBuf,
    events: Arc<EventBus>,
}

/// The `process_started` event of `p`.
fn started_event(p: &ManagedProcess) -> pb::ProcessStarted {
    pb::ProcessStarted {
        pid: p.pid,
        argv: p.argv.clone(),
        origin: p.origin.name().to_owned(),
    }
}

impl Processes {
    pub fn new(work_dir: &std::path::Path, events: Arc<EventBus>) -> Self {
        Self {
            registry: Mutex::new(Registry::default()),
            ends: Mutex::new(VecDeque::new()),
            departing: Mutex::new(HashMap::new()),
            persisting: Mutex::new(()),
            pins: Mutex::new(HashMap::new()),
            state_file: persist::path(work_dir),
            events,
        }
    }

    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        lock(&self.registry)
    }

    /// `pid` must stay on this node while `holds()` (e.g. it serves a
    /// distributed server, whose connections move one by one): migrations
    /// of it are refused with `reason`, and the balancer leaves it.
    /// A second pin of the same process holds while either does.
    pub fn pin(&self, pid: i32, reason: String, holds: Box<dyn Fn() -> bool + Send>) {
        let mut pins = lock(&self.pins);
        let holds = match pins.remove(&pid) {
            Some(old) => Box::new(move || (old.holds)() || holds()),
            None => holds,
        };
        pins.insert(pid, Pin { reason, holds });
    }

    /// Why `pid` must stay here, if it must.
    pub fn pinned(&self, pid: i32) -> Option<String> {
        let mut pins = lock(&self.pins);
        pins.retain(|_, p| (p.holds)());
        pins.get(&pid).map(|p| p.reason.clone())
    }

    pub fn set_lifecycle(&self, pid: i32, lifecycle: Lifecycle) {
        if let Some(p) = self.registry().get_mut(pid) {
            p.lifecycle = lifecycle;
        }
    }

    /// Puts a process under management and announces it. Its end is
    /// watched by the caller (`crate::supervisor`).
    pub fn adopt(&self, p: ManagedProcess) {
        let started = started_event(&p);
        self.registry().insert(p);
        self.announce_start(started);
    }

    /// [`Self::adopt`], unless the PID is managed already (checked and
    /// inserted under one lock); false then.
    pub fn adopt_if_new(&self, p: ManagedProcess) -> bool {
        let started = started_event(&p);
        {
            let mut reg = self.registry();
            if reg.get(p.pid).is_some() {
                return false;
            }
            reg.insert(p);
        }
        self.announce_start(started);
        true
    }

    fn announce_start(&self, started: pb::ProcessStarted) {
        tracing::info!(pid = started.pid, "process under management");
        self.events.publish(Event::ProcessStarted(started));
    }

    /// Process `pid` ended (its exit watcher saw it go): forgotten and its
    /// end announced if it ended by itself ([`Registry::ended`]), else
    /// left to the migration that holds it. The end is remembered under
    /// the registry's lock, so a `WaitProcess` that reads both finds the
    /// process or its end, never neither.
    pub fn ended(&self, pid: i32, exit: pb::ProcessExit) -> Option<ManagedProcess> {
        let p = {
            let mut reg = self.registry();
            let p = reg.ended(pid, &exit)?;
            self.remember_end(pid, ProcessEnd::Exited(exit.clone()));
            p
        };
        self.publish_exit(&p, exit);
        Some(p)
    }

    /// Takes the sockets `read` ([`Registry::refresh`]); the processes it
    /// finds gone (died in a migration that let go of them) are forgotten
    /// and their ends remembered under the same lock, then announced.
    pub fn refresh(&self, read: Vec<super::SocketsRead>) {
        let gone = {
            let mut reg = self.registry();
            let gone = reg.refresh(read);
            for (p, exit) in &gone {
                self.remember_end(p.pid, ProcessEnd::Exited(exit.clone()));
            }
            gone
        };
        for (p, exit) in gone {
            self.publish_exit(&p, exit);
        }
    }

    fn publish_exit(&self, p: &ManagedProcess, exit: pb::ProcessExit) {
        self.events.publish(Event::ProcessExited(pb::ProcessExited {
            pid: p.pid,
            argv: p.argv.clone(),
            exit: Some(exit),
        }));
    }

    fn remember_end(&self, pid: i32, end: ProcessEnd) {
        let mut ends = lock(&self.ends);
        if ends.len() == RECENT_ENDS {
            ends.pop_front();
        }
        ends.push_back((pid, end));
    }

    /// How `pid` last stopped being this node's, if lately.
    pub fn recent_end(&self, pid: i32) -> Option<ProcessEnd> {
        lock(&self.ends)
            .iter()
            .rev()
            .find(|(p, _)| *p == pid)
            .map(|(_, e)| e.clone())
    }

    /// Forgets a process a migration moved away, which is no longer this
    /// node's until its report is in ([`Self::departed`]): a `WaitProcess`
    /// in between learns that it is leaving, not gone.
    pub fn depart(&self, pid: i32) -> Option<ManagedProcess> {
        let p = self.registry().remove(pid)?;
        lock(&self.departing).insert(pid, p.argv.clone());
        Some(p)
    }

    /// The command line of `pid` if a migration is taking it away.
    pub fn departing(&self, pid: i32) -> Option<Vec<String>> {
        lock(&self.departing).get(&pid).cloned()
    }

    /// The migration of `report.source_pid` from this node ended: a process
    /// that moved (or was lost) has that as its end. The end is recorded
    /// before the departure is forgotten, so a reader that finds neither
    /// comes after both.
    pub fn departed(&self, report: &MigrationReport) {
        let pid = report.source_pid;
        if report.outcome == pb::MigrationOutcome::Committed as i32
            || report.outcome == pb::MigrationOutcome::Lost as i32
        {
            self.remember_end(pid, ProcessEnd::Migrated(Box::new(report.clone())));
        }
        lock(&self.departing).remove(&pid);
    }

    /// [`Self::persist`] on the blocking pool, not waited for: callers in a
    /// migration call it once the freeze is over, and a restart within the
    /// millisecond it takes is the only thing that could miss the change.
    pub fn persist_soon(self: &Arc<Self>) {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.persist());
    }

    /// [`Self::persist`] on the blocking pool, waited for.
    pub async fn persist_async(self: &Arc<Self>) {
        let me = self.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || me.persist()).await {
            tracing::error!(error = %e, "remembering the managed processes");
        }
    }

    /// Writes the managed processes to `<work_dir>/managed.json`, for a
    /// restarted agent (`crate::supervisor::Supervisor::readopt`). A
    /// failure is logged: the processes run on, only a restart would not
    /// find them. Blocking (procfs, a file write).
    pub fn persist(&self) {
        // One writer at a time, each writing what the registry holds when
        // it gets the lock: the last write is the newest state.
        let _one = lock(&self.persisting);
        let remembered: Vec<Remembered> = self
            .registry()
            .iter()
            .filter_map(|p| {
                let start_ticks = crate::process::inspect(p.pid).ok()?.start_ticks;
                Some(Remembered {
                    pid: p.pid,
                    start_ticks,
                    argv: p.argv.clone(),
                    adopted: p.origin == Origin::Adopted,
                    migrated_in: match &p.origin {
                        Origin::Run | Origin::Adopted => None,
                        Origin::MigratedIn { migration_id, from } => Some(MigratedIn {
                            migration_id: migration_id.clone(),
                            from: from.clone(),
                        }),
                    },
                })
            })
            .collect();
        if let Err(e) = persist::save(&self.state_file, &remembered) {
            tracing::error!(error = %e, "remembering the managed processes");
        }
    }

    /// What an earlier agent remembered (blocking: a file read); nothing if
    /// the list cannot be read, which is logged.
    pub fn remembered(&self) -> Vec<Remembered> {
        persist::load(&self.state_file).unwrap_or_else(|e| {
            tracing::error!(error = %e, "reading the managed processes of an earlier agent");
            Vec::new()
        })
    }
}
