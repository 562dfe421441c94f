//! Processes under this node's management.
//!
//! A managed process is the init of its own PID namespace and the leader of
//! its own session. That is what lets CRIU move it: restoring it on another
//! node needs no particular PID to be free there (a process in the node's
//! PID namespace would need its old PID, which the stopped source copy still
//! holds until the commit), and CRIU refuses a process whose session leader
//! is outside its PID namespace.

mod adopt;
mod exit;
pub mod persist;
mod processes;
mod registry;
mod spawn;

pub use adopt::{AdoptError, tree_obstacles};
pub use exit::{exit_from_wait_status, exit_unknown, signal_name, signal_reaches, signal_to_send};
pub use processes::{ProcessEnd, Processes};
pub use registry::{Registry, SocketsRead, read_sockets};
pub use spawn::{RunAs, SpawnError, SpawnOptions, spawn};

use crate::process::SocketSummary;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Started by `ferry run` on this node.
    Run,
    /// Running already, adopted by `ferry adopt` on this node.
    Adopted,
    /// Arrived by migration.
    MigratedIn { migration_id: String, from: String },
}

impl Origin {
    /// As the API says it ("run", "adopted", "migrated-in").
    pub fn name(&self) -> &'static str {
        match self {
            Origin::Run => "run",
            Origin::Adopted => "adopted",
            Origin::MigratedIn { .. } => "migrated-in",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lifecycle {
    Running,
    /// Claimed by an outgoing migration; `stage` says what its ports do.
    MigratingOut {
        migration_id: String,
        stage: OutStage,
    },
}

/// Where an outgoing migration is, as far as the process's ports go (see
/// the hand-over table in `crate::dataplane::filter`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutStage {
    /// Prepared, still running and served as usual.
    Live,
    /// Running; what it receives is logged, since the destination is about
    /// to capture too.
    Recording,
    /// Running, the destination capturing (from Arm): logged as in
    /// `Recording`, and no new TCP connection starts here (a SYN is left
    /// to the destination).
    Armed,
    /// Stopped for the dump: nothing in or out; incoming packets kept
    /// (`capture`) or dropped.
    Frozen { capture: bool },
    /// Resuming after an abort: outgoing packets pass, incoming ones are
    /// still kept while the captured ones are replayed.
    Resuming,
    /// Post-copy, from just before the Commit: the destination owns the
    /// ports; the stopped copy here only backs CRIU's page server until
    /// every page is on the destination. No ports.
    PagesOnly,
    /// From just before the Commit (the other strategies): the
    /// destination owns the ports; the stopped copy here is killed once
    /// the destination answered the Commit. No ports.
    Released,
    /// Past the Release, the destination's answer to the Commit not
    /// heard (lost, or this agent restarted since): stopped, no ports,
    /// until the destination says whether it resumed the process. Then
    /// the copy here is killed or resumed.
    InDoubt,
}

#[derive(Debug, Clone)]
pub struct ManagedProcess {
    pub pid: i32,
    pub argv: Vec<String>,
    pub origin: Origin,
    pub lifecycle: Lifecycle,
    pub sockets: SocketSummary,
}
