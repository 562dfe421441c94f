//! The frozen tree's sockets, read beside CRIU's dump.
//!
//! What the source reads from the migrating tree's sockets (the UDP
//! datagrams left unread, and in a collective migration the state of every
//! TCP connection) needs the tree stopped and nothing else. CRIU stops it a
//! few milliseconds into the dump (PTRACE_SEIZE) and then spends most of
//! the dump on its descriptors, one at a time: ~85 ms of ~100 for 1,025
//! sockets here (measured in commit d83d1aa). Right after the tree is frozen CRIU asks
//! its RPC caller for external files (`query-ext-files`): from there the
//! reading runs on its own thread beside the dump, and the connections'
//! states leave for the destination as soon as they are read, so that it
//! rebuilds them while the source still dumps.
//!
//! Turning repair on while CRIU may still give the tree back is safe only
//! with ferry's patch to CRIU (`xtask/criu/notify-dump-rollback.patch`): a
//! dump that fails then says `network-unlock` before the tasks run again,
//! and the connections leave repair mode first (a task running with its
//! connections in repair mode gets EINVAL from send and EPERM from recv).
//! A CRIU without the patch gets the order from before: everything is read
//! after the dump, with the tree left stopped by CRIU.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::process;
use crate::sockstate::{self, Held, Preread, ReadCounts, SockStateError, TcpConnectionState};

/// The most the reading after a dump waits for the dumped process's
/// threads to take CRIU's SIGSTOP (only when nothing was read during it).
const GROUP_STOP_WAIT: Duration = Duration::from_millis(100);

/// A collective migration's connections, read: held by ferryd (in repair
/// mode from the first read on, even when a later one failed), their
/// states, and how long the reading took.
pub(super) struct ReadConnections {
    pub held: Arc<Held>,
    pub states: Result<Vec<TcpConnectionState>, SockStateError>,
    pub took: Duration,
    /// Incremental: how the connections were read.
    pub counts: Option<ReadCounts>,
}

/// An incremental migration's connections read before the freeze, and
/// the watch that says which of them a setsockopt call touched since
/// (attached before the read). The freeze reads the watch once and
/// detaches it; an abort before that detaches it when this is dropped.
pub(super) struct Incremental {
    pub preread: Preread,
    pub watch: std::sync::Mutex<Option<ferry_ebpf::SockoptWatch>>,
}

/// Where the connections' states go as soon as they are read: the task
/// that sends them to the destination.
pub(super) type StatesTo = tokio::sync::oneshot::Sender<Result<ReadConnections, SockStateError>>;

/// What the source keeps of the stopped tree's sockets.
#[derive(Default)]
pub(super) struct Taken {
    /// The UDP datagrams left unread (with capture on).
    pub unread: Vec<sockstate::QueuedDatagram>,
    /// Collective migration: the connections, for the rollback and the
    /// commit.
    pub held: Option<Arc<Held>>,
}

/// What is read from the stopped tree's sockets.
#[derive(Clone)]
pub(super) struct ReadPlan {
    pub pid: i32,
    /// The UDP datagrams left unread (capture on).
    pub capture: bool,
    /// Every TCP connection's state (collective migration).
    pub collective: bool,
    /// The connections' socket options too (CRIU's dump leaves them out).
    pub with_options: bool,
    /// Incremental: what was read before the freeze.
    pub incremental: Option<Arc<Incremental>>,
}

/// Reads the stopped tree's sockets once per dump, during it when it can.
/// Lives in the dump's blocking task; driven by CRIU's notifications.
pub(super) struct SocketTaker {
    plan: ReadPlan,
    /// CRIU tells before a failed dump lets the tree run again.
    during_dump: bool,
    states_to: Option<StatesTo>,
    reading: Option<std::thread::JoinHandle<Taken>>,
    /// Set once the tree was given back: nothing more is read.
    thawed: bool,
}

impl SocketTaker {
    pub fn new(plan: ReadPlan, during_dump: bool, states_to: Option<StatesTo>) -> Self {
        Self {
            plan,
            during_dump,
            states_to,
            reading: None,
            thawed: false,
        }
    }

    fn has_work(&self) -> bool {
        self.plan.capture || self.plan.collective
    }

    /// CRIU froze the tree (`query-ext-files`): the reading starts on its
    /// own thread.
    pub fn tree_frozen(&mut self) {
        self.tree_frozen_taken(None);
    }

    /// Takes the frozen tree's sockets into ferryd now (for a flush before
    /// the freeze, which needs the connections before the reading).
    pub fn take_now(&self) -> Result<sockstate::StoppedSockets, SockStateError> {
        let preread = self.plan.incremental.as_ref().map(|i| &i.preread);
        sockstate::take_sockets(&process::process_tree(self.plan.pid), preread)
    }

    /// [`SocketTaker::tree_frozen`], with the sockets already taken (by
    /// [`SocketTaker::take_now`]) when `taken` is given.
    pub fn tree_frozen_taken(&mut self, taken: Option<sockstate::StoppedSockets>) {
        if !self.during_dump || !self.has_work() || self.reading.is_some() || self.thawed {
            return;
        }
        let (plan, states_to) = (self.plan.clone(), self.states_to.take());
        let spawned = std::thread::Builder::new()
            .name("ferry-sockets".into())
            .spawn(move || read(plan, states_to, taken));
        match spawned {
            Ok(handle) => self.reading = Some(handle),
            // The channel went with the closure: the sender then reports
            // that nothing was read, and the migration rolls back.
            Err(e) => tracing::error!(error = %e, "starting the socket reader"),
        }
    }

    /// CRIU is about to let the tree run again (a failed dump): the
    /// reading ends and every connection leaves repair mode first.
    pub fn tree_thawing(&mut self) {
        self.thawed = true;
        self.states_to = None;
        let Some(held) = self.join().and_then(|t| t.held) else {
            return;
        };
        match held.resume() {
            Ok(()) => tracing::info!(
                connections = held.len(),
                "the dump failed: its connections left repair mode before CRIU resumes the process"
            ),
            Err(e) => tracing::error!(
                error = %e,
                "the dump failed: taking its connections out of repair mode before CRIU resumes the process"
            ),
        }
    }

    /// The tree stays stopped: what was read, or, when nothing was read
    /// during the dump, what is read now. `after_dump`: CRIU has let go of
    /// the tree, stopped by its SIGSTOP (otherwise CRIU holds it frozen
    /// still: a lazy dump serving pages).
    pub fn finish(mut self, after_dump: bool) -> Taken {
        if let Some(taken) = self.join() {
            return taken;
        }
        if self.thawed || !self.has_work() {
            return Taken::default();
        }
        if self.during_dump {
            tracing::warn!(
                "CRIU sent no query-ext-files notification: the sockets are read after the dump"
            );
        }
        // CRIU leaves the process stopped with a SIGSTOP it queues as it
        // lets go; until every thread has taken it, one could still read
        // or write a socket. Seen once in a while ('R' at this point).
        let waited = if after_dump {
            process::wait_group_stopped(self.plan.pid, GROUP_STOP_WAIT)
        } else {
            Ok(None)
        };
        match waited {
            Ok(Some(waited)) if waited > Duration::from_micros(100) => {
                tracing::info!(
                    pid = self.plan.pid,
                    waited_us = waited.as_micros() as u64,
                    "waited for the group stop"
                );
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(pid = self.plan.pid, error = %e, "the process's group stop was not seen; its sockets are read anyway")
            }
        }
        read(self.plan.clone(), self.states_to.take(), None)
    }

    fn join(&mut self) -> Option<Taken> {
        let handle = self.reading.take()?;
        Some(handle.join().unwrap_or_else(|_| {
            tracing::error!("the socket reader panicked");
            Taken::default()
        }))
    }
}

/// Takes the stopped tree's sockets into ferryd in one pass (unless
/// `taken` holds them), peeks at the UDP queues (capture) and reads every
/// connection (collective), whose states go to `states_to` at once.
/// Blocking.
fn read(
    plan: ReadPlan,
    states_to: Option<StatesTo>,
    taken: Option<sockstate::StoppedSockets>,
) -> Taken {
    let ReadPlan {
        pid,
        capture,
        collective,
        with_options,
        incremental,
    } = plan;
    if !capture && !collective {
        return Taken::default();
    }
    // The tree is stopped: no setsockopt call of its own can come after
    // this read of the watch, whose work is then done. Detached at once,
    // on a thread of its own: until then every setsockopt call in its
    // cgroups runs it, and ferryd's own repair calls and the destination's
    // rebuild and restore (on this node too, in a test cluster) are tens
    // of thousands.
    let preread = incremental.as_ref().and_then(|inc| {
        let watch = crate::sync::lock(&inc.watch).take()?;
        let touched = watch.touched();
        let _ = std::thread::Builder::new()
            .name("ferry-sockopt-off".into())
            .spawn(move || drop(watch));
        match touched {
            Ok(touched) => Some((&inc.preread, touched)),
            Err(e) => {
                tracing::warn!(error = %e, "reading the setsockopt watch; every connection is read whole");
                None
            }
        }
    });
    let take_started = Instant::now();
    let sockets = match taken {
        Some(s) => Ok(s),
        None => sockstate::take_sockets(
            &process::process_tree(pid),
            preread.as_ref().map(|(p, _)| *p),
        ),
    };
    tracing::debug!(
        ms = take_started.elapsed().as_secs_f64() * 1000.0,
        listed = sockets.as_ref().is_ok_and(|s| s.from_list()),
        "the tree's sockets taken"
    );
    let unread = match &sockets {
        Ok(s) if capture => sockstate::queued_datagrams(s).map_err(|e| e.to_string()),
        Err(e) if capture => Err(e.to_string()),
        _ => Ok(Vec::new()),
    }
    .unwrap_or_else(|e| {
        tracing::warn!(error = %e, "reading the UDP receive queues; their datagrams may be lost");
        Vec::new()
    });
    if !collective {
        return Taken { unread, held: None };
    }
    let (held, read) = match sockets {
        Ok(s) => {
            let started = Instant::now();
            let held = Arc::new(s.into_held());
            let (states, counts) = match &preread {
                Some((p, touched)) => {
                    match held.extract_incremental(with_options, Some((p, touched))) {
                        Ok((states, counts)) => (Ok(states), Some(counts)),
                        Err(e) => (Err(e), None),
                    }
                }
                None => (held.extract(with_options), None),
            };
            let read = ReadConnections {
                held: held.clone(),
                states,
                took: started.elapsed(),
                counts,
            };
            (Some(held), Ok(read))
        }
        Err(e) => (None, Err(e)),
    };
    if let Some(to) = states_to {
        // The sender may be gone (the migration ended): the held
        // connections still reach the rollback through `Taken`.
        let _ = to.send(read);
    }
    Taken { unread, held }
}
