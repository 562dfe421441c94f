//! What each phase of a migration from this node hands the next: the
//! input of every [`super::Phase`] variant. The phases' files take their
//! input from here and build the next one's, so that none of them imports
//! another.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicI32;
use std::time::Instant;

use ferry_proto::v1::InClusterFlow;

use crate::criu::{self, CriuError};
use crate::engine::sockettaker::{Incremental, Taken};
use crate::engine::{EngineError, pagetunnel};
use crate::memtrack::RangeSet;
use crate::process;
use crate::sockstate;

/// Listen's input: what the pre-read found, if it ran.
pub(super) struct Listening {
    pub incremental: Option<Arc<Incremental>>,
}

/// Arm's input.
pub(super) struct Arming {
    pub listeners: process::Listeners,
    pub incremental: Option<Arc<Incremental>>,
}

/// Settle's input.
pub(super) struct Settling {
    pub listeners: process::Listeners,
    pub incremental: Option<Arc<Incremental>>,
    /// Incremental, protocol 9: the connections' fixed parts Arm carried.
    pub armed_fixed: Option<Arc<crate::sockstate::packed::FixedParts>>,
}

/// Dump's input.
pub(super) struct Dumping {
    pub incremental: Option<Arc<Incremental>>,
    /// Incremental, protocol 9: the connections' fixed parts Arm carried;
    /// the freeze sends those still described by them as packed records.
    pub armed_fixed: Option<Arc<sockstate::packed::FixedParts>>,
}

/// What a dump's blocking task returns: CRIU's notifications and what was
/// read from the stopped tree's sockets.
pub(super) type Dumped = (criu::Notifications, Taken);

/// A lazy dump still running as a page server.
pub(super) struct PageServer {
    pub task: tokio::task::JoinHandle<Result<Dumped, CriuError>>,
    /// The CRIU child's PID while it runs (0 once it answered).
    pub criu_pid: Arc<AtomicI32>,
    /// The page tunnel's pump: the page server's connection carried to
    /// the destination inside the peer connection (`pagetunnel.rs`).
    pub tunnel: Option<tokio::task::JoinHandle<Result<pagetunnel::Moved, EngineError>>>,
}

/// Transfer's input.
pub(super) struct Transferring {
    pub freeze_start: Instant,
    pub dump_end: Instant,
    /// Pre-copy: the pages the destination holds that are still current.
    pub held_pages: HashMap<u32, RangeSet>,
    /// Assisted post-copy: those the destination serves itself.
    pub local_pages: Vec<ferry_proto::v1::StoredPages>,
    /// The UDP datagrams the stopped process's sockets hold unread.
    pub unread: Vec<sockstate::QueuedDatagram>,
}

/// Restore's input.
pub(super) struct Restoring {
    pub freeze_start: Instant,
    pub dump_end: Instant,
    pub transfer_end: Instant,
    /// Assisted post-copy: the pages the destination serves itself.
    pub local_pages: Vec<ferry_proto::v1::StoredPages>,
    pub unread: Vec<sockstate::QueuedDatagram>,
}

/// A process the destination restored, and the times that lead to it.
pub(super) struct Restored {
    pub freeze_start: Instant,
    pub dump_end: Instant,
    pub transfer_end: Instant,
    pub restore_end: Instant,
    /// The destination's own timing of the restore.
    pub restore_criu_us: u64,
    pub criu_startup_us: u64,
    pub image_scan_us: u64,
    pub unread: Vec<sockstate::QueuedDatagram>,
}

/// Translate's input.
pub(super) struct Translating {
    pub restored: Restored,
    /// The in-cluster connections the destination holds, as restored there.
    pub in_cluster: Vec<InClusterFlow>,
}

/// Release's input.
pub(super) struct Releasing {
    pub restored: Restored,
    pub translate_end: Instant,
    /// Digests of what this node delivered between Arm and the freeze.
    pub delivered: Vec<u64>,
}

/// Commit's input.
pub(super) struct Committing {
    pub restored: Restored,
    pub translate_end: Instant,
    pub release_end: Instant,
    /// Digests of what this node delivered between Arm and the freeze.
    pub delivered: Vec<u64>,
}

/// PostCopy's input.
pub(super) struct Waiting {
    /// When the Commit was answered: the process runs on the destination.
    pub resumed: Instant,
    /// The Commit's last error, if it was never confirmed.
    pub commit_err: Option<EngineError>,
}
