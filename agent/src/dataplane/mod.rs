//! The data plane: ferryd's side of the eBPF programs, the role that
//! `cap_trans_mod` and `transd` play in Gerofi et al. (DVE).
//!
//! - [`filter`]: which ports this node owns, in what state (the ownership
//!   filter on the public interface), and the capture ring it fills;
//! - [`capture`]: the captured packets sorted into the migrations whose
//!   ports they are for, and the source's log of what it delivered;
//! - [`replay`]: those packets handed to this node's stack when the process
//!   resumes here;
//! - [`translation`] and [`translations`]: the in-cluster connections of
//!   migrated processes, held on the destination and rewritten on their
//!   peers' nodes.
//!
//! Everything here blocks (BPF maps, a ring buffer, raw sockets): callers
//! on the async runtime go through `spawn_blocking`.

pub mod capture;
pub mod filter;
pub mod replay;
pub mod softnet;
pub mod translation;
pub mod translations;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

pub use filter::{
    CapturedPacket, Counters, DataPlaneError, Flow, FlowState, PortFilter, PortState, PortTable,
};
pub use replay::{PacketReplayer, ReplayTotals};
pub use translation::{FlowError, FlowRules, InClusterFlow};

use crate::sync::lock;

/// How often [`DataPlane::collect_while_capturing`] empties the capture
/// ring.
const BACKGROUND_COLLECT_EVERY: Duration = Duration::from_millis(2);

/// The node's data plane, built once with the agent.
pub struct DataPlane {
    /// The ports as written to the ownership filter.
    table: Mutex<PortTable>,
    /// Packets kept for migrations under way, by migration.
    pub capture: capture::CaptureStore,
    /// Serialises [`Self::collect_captured`]: packets go into their
    /// sessions in the order they left the ring, whoever collects.
    collecting: Mutex<()>,
    replay: replay::Replay,
    /// Translation and hold rules for in-cluster connections, on the
    /// cluster interface.
    flows: Mutex<Box<dyn FlowRules>>,
    /// What this node's translations changed per migration, for aborts.
    translation_log: translations::TranslationLog,
}

impl std::fmt::Debug for DataPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataPlane").finish_non_exhaustive()
    }
}

impl DataPlane {
    pub fn new(
        filter: Box<dyn PortFilter>,
        replayer: Box<dyn PacketReplayer>,
        flows: Box<dyn FlowRules>,
    ) -> Self {
        Self {
            table: Mutex::new(PortTable::new(filter)),
            capture: capture::CaptureStore::default(),
            collecting: Mutex::new(()),
            replay: replay::Replay::new(replayer),
            flows: Mutex::new(flows),
            translation_log: translations::TranslationLog::default(),
        }
    }

    /// The ownership filter's ports (blocking: BPF maps).
    pub fn table(&self) -> MutexGuard<'_, PortTable> {
        lock(&self.table)
    }

    /// The in-cluster translation and hold rules (blocking: BPF maps).
    pub fn flows(&self) -> MutexGuard<'_, Box<dyn FlowRules>> {
        lock(&self.flows)
    }

    /// Moves everything in the capture ring into the capture sessions.
    pub fn collect_captured(&self) {
        let _in_order = lock(&self.collecting);
        let mut packets = Vec::new();
        self.table().collect(&mut |p| packets.push(p));
        if packets.is_empty() {
            return;
        }
        let stray = self.capture.route(packets);
        if stray > 0 {
            tracing::debug!(stray, "captured packets of no migration dropped");
        }
    }

    /// Empties the capture ring every `BACKGROUND_COLLECT_EVERY`, on a
    /// thread of its own, for as long as the capture session `id` is open.
    /// The destination starts it at Arm: what arrives during the freeze is
    /// then in its session by the commit, instead of thousands of packets
    /// taken from the ring inside it (~5 ms at 1024 connections, 11-17 ms
    /// with a bulk stream beside them), and the ring never fills.
    pub fn collect_while_capturing(self: &Arc<Self>, id: &str) {
        let (dataplane, id) = (Arc::downgrade(self), id.to_owned());
        let spawned = std::thread::Builder::new()
            .name("capture-collect".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(BACKGROUND_COLLECT_EVERY);
                    let Some(dataplane) = dataplane.upgrade() else {
                        return;
                    };
                    if !dataplane.capture.is_open(&id) {
                        return;
                    }
                    dataplane.collect_captured();
                }
            });
        if let Err(e) = spawned {
            // The commit collects whatever is left: slower, not wrong.
            tracing::warn!(error = %e, "starting the capture collector thread");
        }
    }

    /// The filter's counters, with the replay's totals since ferryd
    /// started.
    pub fn counters(&self) -> Result<(Counters, ReplayTotals), DataPlaneError> {
        let c = self.table().counters()?;
        Ok((c, self.replay.totals()))
    }
}
