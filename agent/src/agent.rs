//! The agent's shared state: managed processes, port ownership, the
//! destination slot and finished migration reports.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use std::time::Instant;

use ferry_proto::v1::MigrationReport;
use ferry_proto::v1::peer_client::PeerClient;
use ferry_proto::v1::{self as pb, cluster_event::Event};
use tonic::transport::{Channel, Endpoint};

use crate::capture::{CaptureStore, DeliveredLog, PacketReplayer, digest};
use crate::config::{Config, PeerConfig};
use crate::engine::EngineError;
use crate::engine::destination::Incoming;
use crate::managed::{Lifecycle, ManagedProcess, Origin, Registry};
use crate::ownership::{Counters, Ownership, PortFilter, PortState};
use crate::process::PortKey;
use crate::translation::FlowRules;

pub struct Agent {
    pub config: Config,
    registry: Mutex<Registry>,
    ownership: Mutex<Ownership>,
    /// Ports of an incoming migration, in the state the migration needs
    /// (overriding the registry's): frozen from Prepare, capturing from Arm,
    /// releasing during the replay at Commit. Until the commit no packet
    /// leaves them, so a restored copy that has to be killed on abort
    /// cannot reach the peers (its sockets are live: CRIU takes them out of
    /// repair mode at the end of the restore).
    reserved: Mutex<BTreeMap<PortKey, PortState>>,
    /// Packets kept for migrations under way, by migration.
    pub capture: CaptureStore,
    /// Serialises [`Self::drain_capture`]: packets go into their sessions
    /// in the order they left the ring, whoever drains.
    draining: Mutex<()>,
    /// Translation and hold rules for in-cluster connections, on the
    /// cluster interface.
    flows: Mutex<Box<dyn FlowRules>>,
    /// Ports this node's processes opened, on their way to being owned:
    /// being asked about, free to own, owned by another node (refused
    /// here), or claimed by another node at the same time (asked again).
    claims: Mutex<BTreeMap<PortKey, Claim>>,
    /// Serialises [`Self::persist`].
    persisting: Mutex<()>,
    /// Serialises the socket refreshes of [`Self::reconcile`], which read
    /// outside the registry's lock: a pass that read earlier cannot land
    /// after one that read later (a port the process opened between the
    /// two reads would be released until the next pass).
    refreshing: Mutex<()>,
    /// What this node's translations changed per migration, for aborts.
    pub translation_log: crate::engine::translations::TranslationLog,
    replayer: Mutex<Box<dyn PacketReplayer>>,
    /// Replayers for the other lanes of a parallel replay (see
    /// [`Self::replay_pass`]), cloned from `replayer` when first needed.
    lane_replayers: Mutex<Vec<Box<dyn PacketReplayer>>>,
    /// How many threads replay a large batch: one per CPU, at most
    /// [`MAX_REPLAY_LANES`].
    replay_lanes: usize,
    replay_totals: Mutex<ReplayTotals>,
    /// The one incoming migration this node may be receiving.
    pub incoming: tokio::sync::Mutex<Option<Incoming>>,
    /// The id and source node of the incoming migration last prepared
    /// here, set with `incoming` at Prepare and left after it ends (ids do
    /// not repeat). The peer API checks a caller against it without
    /// waiting for `incoming`, which TransferImages holds for its whole
    /// stream, so that TransferSockets runs beside the images.
    pub incoming_source: std::sync::Mutex<Option<(String, String)>>,
    /// Connections rebuilt for an incoming migration by TransferSockets,
    /// which runs while TransferImages holds `incoming`: taken by its
    /// Restore, dropped (closed silently) by its abort or the next one.
    pub incoming_sockets: std::sync::Mutex<Option<crate::engine::destination::RebuiltSockets>>,
    /// The incoming migration's sockets opened at Arm (its id, and its
    /// slot's place for them), for TransferSockets, which does not take
    /// `incoming`. Weak: they close with the slot.
    pub incoming_staged: std::sync::Mutex<
        Option<(
            String,
            std::sync::Weak<crate::engine::destination::StagedSlot>,
        )>,
    >,
    /// Post-copy migrations committed here whose pages still follow (and,
    /// for a while, how they ended): `Peer.PostCopyStatus`.
    pub postcopies: crate::engine::destination::PostCopies,
    reports: Mutex<HashMap<String, MigrationReport>>,
    /// SWIM membership, when `[membership] enabled`.
    pub membership: std::sync::OnceLock<Arc<crate::membership::Membership>>,
    /// The load balancer's conductor, when membership runs.
    pub conductor: std::sync::OnceLock<Arc<crate::conductor::Conductor>>,
    /// Finished migrations, for `/metrics`.
    pub metrics: crate::metrics::MigrationMetrics,
    /// This node's certificate and the cluster CA, when `[tls]` is set:
    /// then every Peer connection is mutual TLS.
    pub tls: std::sync::OnceLock<crate::security::TlsMaterial>,
    /// This node's events, for `Control.WatchEvents`.
    pub events: crate::events::EventBus,
    /// Migrations this node runs as the source, by id: their cancel
    /// switches.
    outgoing: Mutex<HashMap<String, Arc<crate::engine::cancel::Cancel>>>,
    /// Cordoned: no incoming migration, offer or new process. Kept across
    /// restarts (a file in the work directory).
    cordoned: std::sync::atomic::AtomicBool,
    /// How the managed processes that left lately left (ended, or moved
    /// away), newest last, by PID: for a `WaitProcess` that comes just
    /// after. One list in time order, so that a PID used again is judged
    /// by its newest end.
    ends: Mutex<std::collections::VecDeque<(i32, ProcessEnd)>>,
    /// The drain running on this node (`crate::drain`).
    pub drain: Mutex<Option<Arc<crate::drain::DrainControl>>>,
    /// Processes a migration took away whose report is not stored yet, by
    /// PID, with their command lines ([`Self::depart`]).
    departing: Mutex<HashMap<i32, Vec<String>>>,
}

/// Ends remembered for late `WaitProcess` calls.
const RECENT_ENDS: usize = 256;

/// How a managed process stopped being this node's.
#[derive(Debug, Clone)]
pub enum ProcessEnd {
    Exited(pb::ProcessExit),
    /// A migration that committed (it runs elsewhere) or lost it.
    Migrated(Box<MigrationReport>),
}

/// The file whose presence says the node is cordoned.
const CORDON_FILE: &str = "cordoned";

/// Where a port a managed process opened here stands: the claim protocol
/// of [`Agent::check_claims`].
#[derive(Debug, Clone, PartialEq, Eq)]
enum Claim {
    /// The peers are being asked.
    Claiming,
    /// No peer owns or claims it: owned here at the next ownership pass.
    Free,
    /// Another node owns it: refused here.
    OwnedBy(String),
    /// Another node claimed it in the same round: not owned here, asked
    /// again once `retry_at` (a random delay) has passed.
    Contested { retry_at: Instant },
}

/// The range of the random delay before a contested port is claimed again.
/// Two nodes that saw each other's claim both back off; the first to come
/// back finds the other not claiming and takes the port.
const CONTESTED_RETRY_MS: std::ops::Range<u64> = 50..1000;

/// A peer's answer on ports this node claims.
#[derive(Debug, Clone, Default)]
struct PeerAnswer {
    node: String,
    owned: BTreeSet<PortKey>,
    claiming: BTreeSet<PortKey>,
}

/// How often [`Agent::drain_while_capturing`] empties the capture ring.
const BACKGROUND_DRAIN_EVERY: Duration = Duration::from_millis(2);

/// At most this many threads replay one batch.
const MAX_REPLAY_LANES: usize = 4;
/// Batches of fewer segments than this are replayed by one thread: a
/// thread costs more than it saves on them.
const PARALLEL_REPLAY_MIN: usize = 256;

/// At most this many drain-and-replay passes before the ports open.
const REPLAY_PASSES: usize = 3;
/// A pass that found fewer packets than this was the last before opening.
const REPLAY_TRICKLE: usize = 64;

/// What one replay thread did.
#[derive(Debug, Default)]
struct LaneDone {
    replayed: u64,
    segments: u64,
    failed: u64,
}

impl LaneDone {
    fn add(&mut self, other: LaneDone) {
        self.replayed += other.replayed;
        self.segments += other.segments;
        self.failed += other.failed;
    }
}

/// Replays `joined` in order through `replayer`.
fn replay_lane<'a>(
    replayer: &mut dyn PacketReplayer,
    joined: impl Iterator<Item = &'a ferry_ebpf::coalesce::Joined>,
) -> LaneDone {
    let mut done = LaneDone::default();
    for j in joined {
        match replayer.replay(&j.packet) {
            Ok(()) => {
                done.replayed += j.packets as u64;
                done.segments += 1;
            }
            Err(e) => {
                done.failed += j.packets as u64;
                tracing::warn!(packets = j.packets, error = %e, "replaying captured packets");
            }
        }
    }
    done
}

/// Captured packets replayed by this agent since it started.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplayTotals {
    pub replayed: u64,
    pub skipped_delivered: u64,
    pub failed: u64,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("node", &self.config.node)
            .finish()
    }
}

/// The `process_started` event of `p`.
fn started_event(p: &ManagedProcess) -> pb::ProcessStarted {
    pb::ProcessStarted {
        pid: p.pid,
        argv: p.argv.clone(),
        origin: p.origin.name().to_owned(),
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain data behind
    // (maps of processes and ports), still consistent enough to go on.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Agent {
    pub fn new(
        config: Config,
        filter: Box<dyn PortFilter>,
        replayer: Box<dyn PacketReplayer>,
        flows: Box<dyn FlowRules>,
    ) -> Arc<Self> {
        Arc::new(Self {
            registry: Mutex::new(Registry::default()),
            ownership: Mutex::new(Ownership::new(filter)),
            reserved: Mutex::new(Default::default()),
            capture: CaptureStore::default(),
            draining: Mutex::new(()),
            flows: Mutex::new(flows),
            translation_log: Default::default(),
            persisting: Mutex::new(()),
            refreshing: Mutex::new(()),
            claims: Mutex::new(BTreeMap::new()),
            replayer: Mutex::new(replayer),
            lane_replayers: Mutex::new(Vec::new()),
            replay_lanes: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(MAX_REPLAY_LANES),
            replay_totals: Mutex::new(ReplayTotals::default()),
            incoming: tokio::sync::Mutex::new(None),
            incoming_source: std::sync::Mutex::new(None),
            incoming_sockets: std::sync::Mutex::new(None),
            incoming_staged: std::sync::Mutex::new(None),
            postcopies: Default::default(),
            reports: Mutex::new(HashMap::new()),
            membership: std::sync::OnceLock::new(),
            conductor: std::sync::OnceLock::new(),
            metrics: Default::default(),
            tls: std::sync::OnceLock::new(),
            events: crate::events::EventBus::new(&config.node),
            outgoing: Mutex::new(HashMap::new()),
            cordoned: std::sync::atomic::AtomicBool::new(
                config.work_dir.join(CORDON_FILE).exists(),
            ),
            ends: Mutex::new(std::collections::VecDeque::new()),
            departing: Mutex::new(HashMap::new()),
            drain: Mutex::new(None),
            config,
        })
    }

    /// Whether this node takes no new work.
    pub fn cordoned(&self) -> bool {
        self.cordoned.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Cordons or uncordons this node; `by` says who, in the event.
    /// Returns whether it changed.
    pub fn set_cordoned(&self, cordoned: bool, by: &str) -> Result<bool, EngineError> {
        let file = self.config.work_dir.join(CORDON_FILE);
        let written = if cordoned {
            std::fs::write(&file, format!("{by}\n"))
        } else {
            std::fs::remove_file(&file).or_else(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    Ok(())
                } else {
                    Err(e)
                }
            })
        };
        written.map_err(EngineError::io(format!("writing {}", file.display())))?;
        let was = self
            .cordoned
            .swap(cordoned, std::sync::atomic::Ordering::SeqCst);
        if was != cordoned {
            tracing::info!(cordoned, by, "cordon changed");
            self.events
                .publish(ferry_proto::v1::cluster_event::Event::Cordon(
                    ferry_proto::v1::CordonChange {
                        cordoned,
                        by: by.to_owned(),
                    },
                ));
        }
        Ok(was != cordoned)
    }

    /// Refuses new work on a cordoned node.
    pub fn refuse_if_cordoned(&self) -> Result<(), EngineError> {
        if self.cordoned() {
            return Err(EngineError::Cordoned {
                node: self.node().to_owned(),
            });
        }
        Ok(())
    }

    /// A migration from this node started: it can be cancelled by id.
    pub fn outgoing_started(&self, id: &str, cancel: Arc<crate::engine::cancel::Cancel>) {
        lock(&self.outgoing).insert(id.to_owned(), cancel);
    }

    pub fn outgoing_finished(&self, id: &str) {
        lock(&self.outgoing).remove(id);
    }

    /// The cancel switch of a migration from this node still running.
    pub fn outgoing(&self, id: &str) -> Option<Arc<crate::engine::cancel::Cancel>> {
        lock(&self.outgoing).get(id).cloned()
    }

    /// The migrations from this node still running.
    pub fn outgoing_ids(&self) -> Vec<String> {
        lock(&self.outgoing).keys().cloned().collect()
    }

    pub fn node(&self) -> &str {
        &self.config.node
    }

    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        lock(&self.registry)
    }

    pub fn ownership(&self) -> MutexGuard<'_, Ownership> {
        lock(&self.ownership)
    }

    /// The in-cluster translation and hold rules (blocking: BPF maps).
    pub fn flows(&self) -> MutexGuard<'_, Box<dyn FlowRules>> {
        lock(&self.flows)
    }

    /// Every other node this agent knows: the configured `[[peers]]`, then
    /// the nodes membership found that the configuration does not list
    /// (alive or suspect, not down). A configured address wins.
    pub fn known_peers(&self) -> Vec<PeerConfig> {
        let mut peers = self.config.peers.clone();
        if let Some(m) = self.membership.get() {
            for member in m.members() {
                let name = &member.ident.name;
                if *name != self.config.node
                    && member.state != crate::membership::MemberState::Down
                    && !peers.iter().any(|p| p.name == *name)
                {
                    peers.push(PeerConfig {
                        name: name.clone(),
                        address: member.ident.peer,
                    });
                }
            }
        }
        peers
    }

    /// The Peer address of node `name`: configured, or found by membership.
    pub fn peer(&self, name: &str) -> Option<PeerConfig> {
        if let Some(p) = self.config.peer(name) {
            return Some(p.clone());
        }
        let address = self.membership.get()?.peer_address(name)?;
        Some(PeerConfig {
            name: name.to_owned(),
            address,
        })
    }

    /// The cluster address of node `name` (this node's own included).
    pub fn cluster_address_of(&self, name: &str) -> Option<std::net::Ipv4Addr> {
        if name == self.config.node {
            return Some(self.config.cluster.address);
        }
        match self.peer(name)?.address.ip() {
            std::net::IpAddr::V4(a) => Some(a),
            std::net::IpAddr::V6(_) => None,
        }
    }

    /// The peer whose cluster address is `ip`.
    pub fn peer_at(&self, ip: std::net::Ipv4Addr) -> Option<PeerConfig> {
        self.known_peers()
            .into_iter()
            .find(|p| p.address.ip() == std::net::IpAddr::V4(ip))
    }

    /// Re-reads the managed processes' sockets and brings the eBPF filter in
    /// line. procfs reads and BPF map updates block, so they run on the
    /// blocking pool. A port a process opened since is owned only once no
    /// peer says it owns it ([`Self::check_claims`]).
    pub async fn reconcile(self: &Arc<Self>) -> Result<(), EngineError> {
        let me = self.clone();
        let unclaimed = tokio::task::spawn_blocking(move || {
            let _one = lock(&me.refreshing);
            // Two statements: the registry's guard must be gone before the
            // reads (a temporary lives to the end of its statement).
            let running = me.registry().running();
            let read = crate::managed::read_sockets(running);
            let gone = me.registry().refresh(read);
            (gone, me.unclaimed_ports())
        })
        .await
        .map_err(|e| EngineError::Internal(format!("reconcile task: {e}")))?;
        let (gone, unclaimed) = unclaimed;
        for (p, exit) in gone {
            self.announce_exit(&p, exit);
        }
        if !unclaimed.is_empty() {
            self.check_claims(unclaimed).await;
        }
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.sync_ownership())
            .await
            .map_err(|e| EngineError::Internal(format!("reconcile task: {e}")))?
    }

    /// Ports managed processes hold that this node does not own yet (nor
    /// holds for an incoming migration), and ports refused earlier that a
    /// process still holds: those need the peers' word first.
    fn unclaimed_ports(&self) -> Vec<PortKey> {
        let wanted = self.registry().desired_ports();
        let owned: BTreeSet<PortKey> = self.ownership().current().keys().copied().collect();
        let reserved = lock(&self.reserved);
        let mut claims = lock(&self.claims);
        // Forget verdicts on ports no process holds any more.
        claims.retain(|p, _| wanted.contains_key(p));
        let now = Instant::now();
        wanted
            .iter()
            .filter(|(p, s)| **s == PortState::Owned && !reserved.contains_key(p))
            .map(|(p, _)| *p)
            .filter(|p| !owned.contains(p))
            .filter(|p| {
                !matches!(claims.get(p), Some(Claim::Contested { retry_at, .. }) if *retry_at > now)
            })
            .collect()
    }

    /// What this node says of `asked` to a peer that claims them: those it
    /// owns (in any state), and those it is claiming itself (asking, or
    /// found free and not owned yet). Answering "claiming" until the port
    /// is owned is what keeps two simultaneous claims from both winning.
    pub fn ownership_answer(&self, asked: &[PortKey]) -> (Vec<PortKey>, Vec<PortKey>) {
        let owned = self.owned_ports();
        let claims = lock(&self.claims);
        let mine = asked
            .iter()
            .filter(|p| owned.contains(p))
            .copied()
            .collect();
        let claiming = asked
            .iter()
            .filter(|p| !owned.contains(p))
            .filter(|p| matches!(claims.get(p), Some(Claim::Claiming | Claim::Free)))
            .copied()
            .collect();
        (mine, claiming)
    }

    /// Marks `ports` as being claimed, before the peers are asked: from
    /// here on this node answers "claiming" for them.
    fn begin_claims(&self, ports: &[PortKey]) {
        let mut claims = lock(&self.claims);
        for p in ports {
            // A port found free and not owned yet stays free: re-asking
            // must not make it look unclaimed to the ownership pass.
            if claims.get(p) != Some(&Claim::Free) {
                claims.insert(*p, Claim::Claiming);
            }
        }
    }

    /// Records the verdicts on `ports` from the peers' answers: (peer,
    /// ports it owns, ports it claims).
    fn settle_claims(&self, ports: &[PortKey], answers: &[PeerAnswer]) {
        let mut claims = lock(&self.claims);
        for port in ports {
            let owner = answers.iter().find(|a| a.owned.contains(port));
            let rival = answers.iter().find(|a| a.claiming.contains(port));
            let verdict = match (owner, rival) {
                (Some(a), _) => Claim::OwnedBy(a.node.clone()),
                (None, Some(a)) => {
                    tracing::info!(
                        %port,
                        rival = %a.node,
                        "another node claims this port at the same time: both back off, asked again shortly"
                    );
                    Claim::Contested {
                        retry_at: Instant::now()
                            + Duration::from_millis(rand::random_range(CONTESTED_RETRY_MS)),
                    }
                }
                (None, None) => Claim::Free,
            };
            let before = claims.insert(*port, verdict.clone());
            match (&before, &verdict) {
                (Some(Claim::OwnedBy(_)), Claim::Free) => {
                    tracing::info!(%port, "port no longer owned elsewhere: owned here now")
                }
                (b, Claim::OwnedBy(node)) if b.as_ref() != Some(&verdict) => tracing::error!(
                    %port,
                    owner = %node,
                    "a managed process opened a port another node owns: refused, packets stay with {node}"
                ),
                _ => {}
            }
        }
    }

    /// Asks every peer (concurrently, briefly) which of `ports` it owns or
    /// claims, and records the verdicts: a port another node owns is
    /// refused here (an error in the log and in `ListProcesses`); a port
    /// another node claims at the same time is contested (neither takes it
    /// now; each asks again after a random delay); the others may be owned.
    ///
    /// Two claims never both win: each node marks its claim before it
    /// asks, and answers "claiming" until the port is owned. Of two claims
    /// racing, the later one to mark asks after the earlier marked, so it
    /// sees the earlier one (claiming or owning) and does not take the
    /// port. `ports_race_and_never_both_win` checks every interleaving.
    ///
    /// A peer that does not answer in time is taken as owning none of
    /// them: refusing would leave a port nobody serves whenever any node
    /// is down.
    pub async fn check_claims(self: &Arc<Self>, ports: Vec<PortKey>) {
        const ASK_TIMEOUT: Duration = Duration::from_millis(500);
        self.begin_claims(&ports);
        let req = ferry_proto::v1::PortOwnershipRequest {
            ports: ports
                .iter()
                .map(crate::engine::source::port_to_pb)
                .collect(),
        };
        let peers = self.known_peers();
        let asks = peers.iter().map(|peer| {
            let req = req.clone();
            async move {
                let answer = tokio::time::timeout(ASK_TIMEOUT, async {
                    let mut c = self.peer_client(peer).await?;
                    c.port_ownership(req)
                        .await
                        .map(|r| r.into_inner())
                        .map_err(|s| EngineError::Internal(s.message().to_owned()))
                })
                .await;
                (peer.name.clone(), answer)
            }
        });
        let answers = futures::future::join_all(asks).await;
        let keys = |ports: &[ferry_proto::v1::Port]| -> BTreeSet<PortKey> {
            ports
                .iter()
                .filter_map(|p| crate::engine::destination::port_from_pb(p).ok())
                .collect()
        };
        let mut heard = Vec::new();
        for (peer, answer) in answers {
            match answer {
                Ok(Ok(r)) => heard.push(PeerAnswer {
                    node: peer,
                    owned: keys(&r.owned),
                    claiming: keys(&r.claiming),
                }),
                Ok(Err(e)) => tracing::warn!(peer = %peer, error = %e, "asking who owns new ports"),
                Err(_) => tracing::warn!(peer = %peer, "no answer on port ownership in time"),
            }
        }
        self.settle_claims(&ports, &heard);
    }

    /// The nodes that own ports this node's processes hold, by port.
    pub fn port_conflicts(&self) -> BTreeMap<PortKey, String> {
        lock(&self.claims)
            .iter()
            .filter_map(|(p, c)| match c {
                Claim::OwnedBy(n) => Some((*p, n.clone())),
                // Transient: asked again within a second.
                Claim::Claiming | Claim::Free | Claim::Contested { .. } => None,
            })
            .collect()
    }

    /// The ports this node owns in any state (for a peer's question).
    pub fn owned_ports(&self) -> BTreeSet<PortKey> {
        let mut all: BTreeSet<PortKey> = self.ownership().current().keys().copied().collect();
        all.extend(lock(&self.reserved).keys().copied());
        all
    }

    /// Brings the filter in line with the registry as it is, without
    /// re-reading sockets from procfs: for the migration's freeze window,
    /// where every millisecond counts (each /proc/PID/net/tcp read walks
    /// the kernel's whole established-connection hash table, ~2 ms here).
    pub async fn apply_ownership(self: &Arc<Self>) -> Result<(), EngineError> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.sync_ownership())
            .await
            .map_err(|e| EngineError::Internal(format!("ownership task: {e}")))?
    }

    /// [`apply_ownership`](Self::apply_ownership) for blocking code.
    pub fn reconcile_ownership(&self) -> Result<(), EngineError> {
        self.sync_ownership()
    }

    fn sync_ownership(&self) -> Result<(), EngineError> {
        // The ownership lock is held from computing the desired state to
        // writing it, so passes apply in the order they read the registry:
        // a periodic pass that read "owned" cannot land after the engine's
        // pass that froze the ports. Lock order: ownership, then registry.
        let mut ownership = self.ownership();
        let mut desired = self.registry().desired_ports();
        // A port is newly owned only once the peers said nobody owns it;
        // ports already owned stay (a migration moved them here, or they
        // were checked before).
        {
            let claims = lock(&self.claims);
            let current = ownership.current();
            desired.retain(|p, _| current.contains_key(p) || claims.get(p) == Some(&Claim::Free));
        }
        // An incoming migration's state wins: at Commit the adopted
        // process's ports stay releasing until the replay is done.
        for (port, state) in lock(&self.reserved).iter() {
            desired.insert(*port, *state);
        }
        ownership.apply(&desired)?;
        Ok(())
    }

    /// Moves everything in the capture ring into the capture sessions.
    pub fn drain_capture(&self) {
        let _in_order = lock(&self.draining);
        let mut packets = Vec::new();
        self.ownership().drain(&mut |p| packets.push(p));
        if packets.is_empty() {
            return;
        }
        let stray = self.capture.route(packets);
        if stray > 0 {
            tracing::debug!(stray, "captured packets of no migration dropped");
        }
    }

    /// Drains the capture ring every [`BACKGROUND_DRAIN_EVERY`], on a thread
    /// of its own, for as long as the capture session `id` is open. The
    /// destination starts it at Arm: what arrives during the freeze is then
    /// in its session by the commit, instead of thousands of packets taken
    /// from the ring inside it (~5 ms at 1024 connections, 11-17 ms with a
    /// bulk stream beside them), and the ring never fills.
    pub fn drain_while_capturing(self: &Arc<Self>, id: &str) {
        let (agent, id) = (Arc::downgrade(self), id.to_owned());
        let spawned = std::thread::Builder::new()
            .name("capture-drain".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(BACKGROUND_DRAIN_EVERY);
                    let Some(agent) = agent.upgrade() else { return };
                    if !agent.capture.is_open(&id) {
                        return;
                    }
                    agent.drain_capture();
                }
            });
        if let Err(e) = spawned {
            // The commit drains whatever is left: slower, not wrong.
            tracing::warn!(error = %e, "starting the capture drain thread");
        }
    }

    /// Replays what is captured for migration `id` (the ports must be
    /// releasing: capturing, egress open), then runs `open` (which must make
    /// the ports pass packets again) and replays what arrived in between.
    /// Packets are replayed in arrival order, except those found in
    /// `delivered` (digests of what the source delivered, see
    /// [`DeliveredLog`]), which are skipped. Blocking.
    ///
    /// The replay makes the restored sockets acknowledge, and busy peers
    /// answer with more data, which is captured in turn: chasing that until
    /// the ring is empty can go on for seconds under load. So the backlog
    /// is replayed in at most [`REPLAY_PASSES`] passes, fewer once a pass
    /// finds only a trickle, and the ports open after that: the last
    /// packets captured may then be overtaken by a few live ones, which TCP
    /// reorders and UDP allows.
    pub fn replay_and_open(
        &self,
        id: &str,
        carried: &[Vec<u8>],
        delivered: &[u64],
        unread: &[u64],
        open: impl FnOnce() -> Result<(), EngineError>,
    ) -> Result<ferry_proto::v1::ReplayStats, EngineError> {
        let mut stats = ferry_proto::v1::ReplayStats::default();
        let started = Instant::now();
        // First what the source's sockets held unread: it arrived before
        // anything the source left undelivered, which is all the replay
        // below hands over.
        if !carried.is_empty() {
            let mut main = lock(&self.replayer);
            for packet in carried {
                match main.replay(packet) {
                    Ok(()) => stats.carried += 1,
                    Err(e) => {
                        stats.failed += 1;
                        tracing::warn!(error = %e, "handing over a datagram the source left unread");
                    }
                }
            }
        }
        let mut delivered = DeliveredLog::new(delivered);
        // The same multiset type, keyed by datagram: delivered on the
        // source but never read there.
        let mut unread = DeliveredLog::new(unread);
        let mut draining = Duration::ZERO;
        let mut drain = |me: &Self| {
            let t = Instant::now();
            me.drain_capture();
            draining += t.elapsed();
        };
        for _ in 0..REPLAY_PASSES {
            drain(self);
            let batch = self.capture.take_captured(id);
            let trickle = batch.len() < REPLAY_TRICKLE;
            self.replay_pass(&batch, &mut delivered, &mut unread, &mut stats);
            if trickle {
                break;
            }
        }
        let opening = Instant::now();
        open()?;
        let opening = opening.elapsed();
        drain(self);
        let rest = self.capture.take_captured(id);
        self.replay_pass(&rest, &mut delivered, &mut unread, &mut stats);
        self.capture.close(id);
        stats.replay_time_us = started.elapsed().as_micros() as u64;
        tracing::debug!(
            total_us = stats.replay_time_us,
            draining_us = draining.as_micros() as u64,
            opening_us = opening.as_micros() as u64,
            segments = stats.replayed_segments,
            "replay timings"
        );
        let mut totals = lock(&self.replay_totals);
        totals.replayed += stats.replayed;
        totals.skipped_delivered += stats.skipped_delivered;
        totals.failed += stats.failed;
        Ok(stats)
    }

    /// Replays one batch, skipping what the source delivered.
    fn replay_pass(
        &self,
        batch: &[crate::ownership::CapturedPacket],
        delivered: &mut DeliveredLog,
        unread: &mut DeliveredLog,
        stats: &mut ferry_proto::v1::ReplayStats,
    ) {
        stats.captured += batch.len() as u64;
        let fresh = batch.iter().filter(|p| {
            let mut handled = !delivered.is_empty() && delivered.take(digest(&p.data));
            // Delivered, but left unread in a socket CRIU does not carry
            // the queue of: replayed after all.
            if handled
                && !unread.is_empty()
                && crate::sockstate::key_of_packet(&p.data).is_some_and(|k| unread.take(k))
            {
                handled = false;
            }
            if handled {
                stats.skipped_delivered += 1;
            }
            !handled
        });
        // Each connection's consecutive segments enter the stack as one
        // (ferry_ebpf::coalesce says why): the replay is inside the freeze.
        let joined = ferry_ebpf::coalesce::coalesce(fresh.map(|p| p.data.as_slice()));
        let mut main = lock(&self.replayer);
        let mut others = lock(&self.lane_replayers);
        let mut lanes = if joined.len() >= PARALLEL_REPLAY_MIN {
            self.replay_lanes
        } else {
            1
        };
        while others.len() + 1 < lanes {
            match main.try_clone() {
                Ok(r) => others.push(r),
                Err(e) => {
                    tracing::warn!(error = %e, "a replayer for another thread");
                    break;
                }
            }
        }
        lanes = lanes.min(others.len() + 1);
        // A replayed segment costs its whole receive path (and the ACK's
        // way out) on the CPU that sends it: with the process stopped the
        // other CPUs are mostly idle, so a large batch is cut by connection
        // (`capture::lane_of`) and replayed on one thread per CPU.
        let done = if lanes == 1 {
            replay_lane(&mut **main, joined.iter())
        } else {
            let mut split: Vec<Vec<&ferry_ebpf::coalesce::Joined>> = vec![Vec::new(); lanes];
            for j in &joined {
                split[crate::capture::lane_of(&j.packet, lanes)].push(j);
            }
            let mut split = split.into_iter();
            let first = split.next().unwrap_or_default();
            std::thread::scope(|s| {
                let threads: Vec<_> = others
                    .iter_mut()
                    .zip(split)
                    .map(|(r, lane)| {
                        let packets: usize = lane.iter().map(|j| j.packets).sum();
                        (
                            packets,
                            s.spawn(move || replay_lane(&mut **r, lane.into_iter())),
                        )
                    })
                    .collect();
                let mut done = replay_lane(&mut **main, first.into_iter());
                for (packets, t) in threads {
                    done.add(t.join().unwrap_or_else(|_| {
                        tracing::error!(packets, "a replay thread panicked");
                        LaneDone {
                            failed: packets as u64,
                            ..LaneDone::default()
                        }
                    }));
                }
                done
            })
        };
        stats.replayed += done.replayed;
        stats.replayed_segments += done.segments;
        stats.failed += done.failed;
    }

    /// The data plane's counters, with the agent's replay totals.
    pub fn data_plane_counters(&self) -> Result<(Counters, ReplayTotals), EngineError> {
        let c = self.ownership().counters()?;
        Ok((c, *lock(&self.replay_totals)))
    }

    /// Puts a process under management and reaps it when it exits.
    pub fn adopt(self: &Arc<Self>, p: ManagedProcess) {
        let started = started_event(&p);
        self.registry().insert(p);
        self.announce_start(started);
    }

    /// [`Self::adopt`], unless the PID is managed already (checked and
    /// inserted under one lock); false then.
    fn adopt_if_new(self: &Arc<Self>, p: ManagedProcess) -> bool {
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

    /// A managed process ended (its exit watcher saw it): forgotten, its
    /// ports released and its end announced, unless a migration stopped
    /// or moved it (see [`Registry::ended`]).
    async fn process_ended(self: &Arc<Self>, pid: i32, exit: pb::ProcessExit) {
        let ended = self.registry().ended(pid, &exit);
        let Some(p) = ended else { return };
        tracing::info!(pid, how = %exit.description, "managed process ended");
        self.announce_exit(&p, exit);
        self.persist_soon();
        if let Err(e) = self.reconcile().await {
            tracing::warn!(error = %e, "releasing ports of an exited process");
        }
    }

    /// Remembers how `p` ended and tells the event stream.
    fn announce_exit(&self, p: &ManagedProcess, exit: pb::ProcessExit) {
        self.remember_end(p.pid, ProcessEnd::Exited(exit.clone()));
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
    /// node's until its report is stored ([`Self::store_report`]): a
    /// `WaitProcess` in between learns that it is leaving, not gone.
    pub fn depart(&self, pid: i32) -> Option<ManagedProcess> {
        let p = self.registry().remove(pid)?;
        lock(&self.departing).insert(pid, p.argv.clone());
        Some(p)
    }

    /// The command line of `pid` if a migration is taking it away.
    pub fn departing(&self, pid: i32) -> Option<Vec<String>> {
        lock(&self.departing).get(&pid).cloned()
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
    /// restarted agent ([`Self::readopt`]). A failure is logged: the
    /// processes run on, only a restart would not find them. Blocking
    /// (procfs, a file write).
    pub fn persist(&self) {
        // One writer at a time, each writing what the registry holds when
        // it gets the lock: the last write is the newest state.
        let _one = lock(&self.persisting);
        let remembered: Vec<crate::state::Remembered> = self
            .registry()
            .iter()
            .filter_map(|p| {
                let start_ticks = crate::process::inspect(p.pid).ok()?.start_ticks;
                Some(crate::state::Remembered {
                    pid: p.pid,
                    start_ticks,
                    argv: p.argv.clone(),
                    adopted: p.origin == Origin::Adopted,
                    migrated_in: match &p.origin {
                        Origin::Run | Origin::Adopted => None,
                        Origin::MigratedIn { migration_id, from } => {
                            Some(crate::state::MigratedIn {
                                migration_id: migration_id.clone(),
                                from: from.clone(),
                            })
                        }
                    },
                })
            })
            .collect();
        let path = crate::state::path(&self.config.work_dir);
        if let Err(e) = crate::state::save(&path, &remembered) {
            tracing::error!(error = %e, "remembering the managed processes");
        }
    }

    /// At start-up: adopts again the processes an earlier agent managed
    /// that still run (same PID, same start time), watches them exit, and
    /// drops holds no migration will release (none survives a restart).
    /// Their ports stay owned throughout when the data-plane maps are
    /// pinned: the filter already holds them ([`Ownership::new`]).
    pub fn readopt(self: &Arc<Self>) -> usize {
        let path = crate::state::path(&self.config.work_dir);
        let remembered = crate::state::load(&path).unwrap_or_else(|e| {
            tracing::error!(error = %e, "reading the managed processes of an earlier agent");
            Vec::new()
        });
        let mut adopted = 0;
        for r in remembered {
            match crate::process::inspect(r.pid) {
                Ok(info) if info.start_ticks == r.start_ticks && info.state != 'Z' => {
                    self.registry().insert(ManagedProcess {
                        pid: r.pid,
                        argv: r.argv.clone(),
                        origin: r.origin(),
                        lifecycle: Lifecycle::Running,
                        sockets: Default::default(),
                    });
                    tracing::info!(pid = r.pid, argv = ?r.argv, "managed process adopted again");
                    // Not our child any more: watched through a pidfd.
                    self.forget_on_exit(r.pid, "adopted");
                    adopted += 1;
                }
                _ => tracing::info!(pid = r.pid, "a process of the earlier agent is gone"),
            }
        }
        self.persist();
        let mut flows = self.flows();
        match flows.rules() {
            Ok(rules) => {
                for r in rules
                    .into_iter()
                    .filter(|r| r.action == ferry_ebpf::RuleAction::Hold)
                {
                    if let Err(e) = flows.remove(&r) {
                        tracing::warn!(rule = %r, error = %e, "removing a stale hold");
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "reading translation rules"),
        }
        adopted
    }

    /// Waits (pidfd) for `pid` to exit, reaping it if it is our child (then
    /// its exit status is known), and handles its end
    /// ([`Self::process_ended`]).
    fn forget_on_exit(self: &Arc<Self>, pid: i32, what: &'static str) {
        let me = self.clone();
        tokio::spawn(async move {
            let exit = match crate::reaper::wait_exit(pid).await {
                Ok(Some(status)) => crate::managed::exit_from_wait_status(status),
                Ok(None) => crate::managed::exit_unknown(
                    "not this agent's child (adopted, or managed since an agent restart)",
                ),
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                    crate::managed::exit_unknown("gone before it could be watched")
                }
                Err(e) => {
                    tracing::warn!(pid, error = %e, "watching the {what} process");
                    return;
                }
            };
            tracing::info!(pid, "{what} process ended");
            me.process_ended(pid, exit).await;
        });
    }

    /// Puts an incoming migration's ports in `state` (see `reserved`).
    pub fn reserve_ports(&self, ports: &[PortKey], state: PortState) {
        let mut r = lock(&self.reserved);
        for p in ports {
            r.insert(*p, state);
        }
    }

    pub fn release_ports(&self, ports: &[crate::process::PortKey]) {
        let mut r = lock(&self.reserved);
        for p in ports {
            r.remove(p);
        }
    }

    pub fn set_lifecycle(&self, pid: i32, lifecycle: Lifecycle) {
        if let Some(p) = self.registry().get_mut(pid) {
            p.lifecycle = lifecycle;
        }
    }

    /// Keeps the report of a migration this node ran as the source, and
    /// counts it in the metrics.
    pub fn store_report(&self, report: MigrationReport) {
        self.metrics.record(&report);
        // The end first, then the departure: a reader that finds neither
        // comes after both.
        let pid = report.source_pid;
        if report.outcome == pb::MigrationOutcome::Committed as i32
            || report.outcome == pb::MigrationOutcome::Lost as i32
        {
            self.remember_end(pid, ProcessEnd::Migrated(Box::new(report.clone())));
        }
        lock(&self.reports).insert(report.migration_id.clone(), report);
        lock(&self.departing).remove(&pid);
    }

    pub fn report(&self, id: &str) -> Option<MigrationReport> {
        lock(&self.reports).get(id).cloned()
    }

    /// Starts `argv` under management (`ferry run`).
    pub async fn run_process(
        self: &Arc<Self>,
        argv: Vec<String>,
    ) -> Result<i32, crate::managed::SpawnError> {
        let to_spawn = argv.clone();
        // A clone and the wait for its exec: off the runtime.
        let pid = tokio::task::spawn_blocking(move || crate::managed::spawn(&to_spawn))
            .await
            .map_err(|e| crate::managed::SpawnError::Spawn {
                program: argv.first().cloned().unwrap_or_default(),
                source: std::io::Error::other(e.to_string()),
            })??;
        self.adopt(ManagedProcess {
            pid,
            argv,
            origin: Origin::Run,
            lifecycle: Lifecycle::Running,
            sockets: Default::default(),
        });
        self.persist_async().await;
        // Our child: its exit status is read when it ends.
        self.forget_on_exit(pid, "managed");
        Ok(pid)
    }

    /// Puts the running process `pid` under management (`ferry adopt`),
    /// once [`crate::process::shape_obstacles`] and
    /// [`crate::managed::tree_obstacles`] find nothing against it. It is not this agent's child: its end is seen through a pidfd,
    /// its exit status is not.
    pub async fn adopt_running(
        self: &Arc<Self>,
        pid: i32,
    ) -> Result<ManagedProcess, crate::managed::AdoptError> {
        use crate::managed::AdoptError;
        if pid == std::process::id() as i32 {
            return Err(AdoptError::Agent { pid });
        }
        if self.registry().get(pid).is_some() {
            return Err(AdoptError::AlreadyManaged { pid });
        }
        let node = self.node().to_owned();
        let (info, obstacles) = tokio::task::spawn_blocking(move || {
            let (info, mut obstacles) =
                crate::process::shape_obstacles(pid).map_err(|e| match e {
                    crate::process::ProcessError::NotFound { .. } => {
                        AdoptError::NotFound { pid, node }
                    }
                    source => AdoptError::Process { pid, source },
                })?;
            let tree = crate::process::process_tree(pid);
            obstacles.extend(
                crate::managed::tree_obstacles(&tree)
                    .map_err(|reason| AdoptError::Sockets { pid, reason })?,
            );
            Ok((info, obstacles))
        })
        .await
        .map_err(|e| AdoptError::Sockets {
            pid,
            reason: format!("the check's task failed: {e}"),
        })??;
        if !obstacles.is_empty() {
            return Err(AdoptError::Obstacles { pid, obstacles });
        }
        let p = ManagedProcess {
            pid,
            argv: info.argv,
            origin: Origin::Adopted,
            lifecycle: Lifecycle::Running,
            sockets: Default::default(),
        };
        // Two adoptions of one PID race: the second finds it managed.
        if !self.adopt_if_new(p.clone()) {
            return Err(AdoptError::AlreadyManaged { pid });
        }
        self.forget_on_exit(pid, "adopted");
        self.persist_async().await;
        if let Err(e) = self.reconcile().await {
            tracing::warn!(pid, error = %e, "claiming the ports of an adopted process");
        }
        Ok(self.registry().get(pid).cloned().unwrap_or(p))
    }

    /// Reaps a process that is this agent's child but not a tokio child
    /// (CRIU restored it as our child with `rst_sibling`), and forgets it
    /// when it exits.
    pub fn reap_restored(self: &Arc<Self>, pid: i32) {
        self.forget_on_exit(pid, "restored");
    }

    /// Where node `name`'s Peer port is reached: over mutual TLS when
    /// `[tls]` is set, the server's certificate checked against the CA and
    /// the node's name (an address from membership or the config only says
    /// where to dial, not whom the migration goes to).
    pub fn peer_endpoint(
        &self,
        name: &str,
        address: std::net::SocketAddr,
    ) -> Result<Endpoint, String> {
        match self.tls.get() {
            Some(tls) => Endpoint::from_shared(format!("https://{address}"))
                .and_then(|e| e.tls_config(tls.peer_client(name)))
                .map_err(|e| error_chain(&e)),
            None => Endpoint::from_shared(format!("http://{address}")).map_err(|e| error_chain(&e)),
        }
    }

    /// `Peer.Hello` to `peer`, answered within 2 s, or why not.
    pub async fn hello(&self, peer: &PeerConfig) -> Result<ferry_proto::v1::HelloResponse, String> {
        let hello = async {
            let mut client = self.peer_client(peer).await.map_err(|e| e.to_string())?;
            client
                .hello(ferry_proto::v1::HelloRequest {
                    node: self.node().to_owned(),
                    protocol_versions: ferry_proto::PEER_PROTOCOL_VERSIONS.to_vec(),
                })
                .await
                .map(|r| r.into_inner())
                .map_err(|s| s.message().to_owned())
        };
        match tokio::time::timeout(Duration::from_secs(2), hello).await {
            Ok(answer) => answer,
            Err(_) => Err("no answer within 2 s".into()),
        }
    }

    /// A Peer client for `peer`, connected with a short timeout.
    pub async fn peer_client(&self, peer: &PeerConfig) -> Result<PeerClient<Channel>, EngineError> {
        let unavailable = |reason: String| EngineError::PeerUnavailable {
            node: peer.name.clone(),
            address: peer.address.to_string(),
            reason,
        };
        let endpoint = self
            .peer_endpoint(&peer.name, peer.address)
            .map_err(unavailable)?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true);
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| unavailable(error_chain(&e)))?;
        Ok(PeerClient::new(channel)
            .max_decoding_message_size(16 << 20)
            .max_encoding_message_size(16 << 20))
    }
}

/// An error and its sources on one line ("transport error: connection refused").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod claim_tests {
    use super::*;
    use crate::engine::destination::fixture::Fixture;
    use crate::process::Transport;

    const PORT: PortKey = PortKey {
        transport: Transport::Tcp,
        port: 7000,
    };

    /// An agent whose managed process opened [`PORT`].
    fn node_with_a_process_on_the_port() -> Fixture {
        let f = Fixture::new(&[]);
        f.adopt_local(4242, &[PORT]);
        f
    }

    /// One node's steps of a claim, in their order.
    #[derive(Clone, Copy, Debug)]
    enum Step {
        Mark,
        Ask,
        Settle,
        Own,
    }
    const STEPS: [Step; 4] = [Step::Mark, Step::Ask, Step::Settle, Step::Own];

    /// Every way of interleaving two nodes' four steps: which node takes
    /// each of the 8 turns.
    fn interleavings() -> Vec<Vec<usize>> {
        (0u32..256)
            .filter(|m| m.count_ones() == 4)
            .map(|m| (0..8).map(|i| ((m >> i) & 1) as usize).collect())
            .collect()
    }

    fn step(me: &Agent, other: &Agent, other_name: &str, s: Step, heard: &mut Vec<PeerAnswer>) {
        match s {
            Step::Mark => me.begin_claims(&[PORT]),
            Step::Ask => {
                let (owned, claiming) = other.ownership_answer(&[PORT]);
                heard.push(PeerAnswer {
                    node: other_name.into(),
                    owned: owned.into_iter().collect(),
                    claiming: claiming.into_iter().collect(),
                });
            }
            Step::Settle => me.settle_claims(&[PORT], heard),
            Step::Own => me.reconcile_ownership().unwrap(),
        }
    }

    #[tokio::test]
    async fn ports_race_and_never_both_win() {
        let orders = interleavings();
        assert_eq!(orders.len(), 70);
        let mut outcomes = BTreeMap::new();
        for order in orders {
            let nodes = [
                node_with_a_process_on_the_port(),
                node_with_a_process_on_the_port(),
            ];
            let names = ["node-a", "node-b"];
            let mut next = [0usize; 2];
            let mut heard = [Vec::new(), Vec::new()];
            for &who in &order {
                let other = 1 - who;
                step(
                    &nodes[who].agent,
                    &nodes[other].agent,
                    names[other],
                    STEPS[next[who]],
                    &mut heard[who],
                );
                next[who] += 1;
            }
            let owns = nodes
                .each_ref()
                .map(|n| n.agent.owned_ports().contains(&PORT));
            assert!(!(owns[0] && owns[1]), "both own the port after {order:?}");
            *outcomes.entry(owns).or_insert(0) += 1;
        }
        // Run one after the other, the first takes the port and the second
        // is refused; neither is the only outcome.
        assert!(outcomes.contains_key(&[true, false]), "{outcomes:?}");
        assert!(outcomes.contains_key(&[false, true]), "{outcomes:?}");
        assert!(outcomes.contains_key(&[false, false]), "{outcomes:?}");
    }

    #[tokio::test]
    async fn a_claim_after_anothers_takes_nothing_and_names_the_owner() {
        let a = node_with_a_process_on_the_port();
        let b = node_with_a_process_on_the_port();
        let mut heard = Vec::new();
        for s in STEPS {
            step(&a.agent, &b.agent, "node-b", s, &mut heard);
        }
        assert!(a.agent.owned_ports().contains(&PORT));
        let mut heard = Vec::new();
        for s in STEPS {
            step(&b.agent, &a.agent, "node-a", s, &mut heard);
        }
        assert!(!b.agent.owned_ports().contains(&PORT));
        assert_eq!(
            b.agent.port_conflicts(),
            [(PORT, "node-a".to_owned())].into()
        );
    }

    #[tokio::test]
    async fn a_contested_port_is_asked_again_only_after_its_delay() {
        let a = node_with_a_process_on_the_port();
        let b = node_with_a_process_on_the_port();
        // Both mark, then both ask: each sees the other claiming.
        a.agent.begin_claims(&[PORT]);
        b.agent.begin_claims(&[PORT]);
        let (owned, claiming) = b.agent.ownership_answer(&[PORT]);
        assert_eq!((owned.len(), claiming.as_slice()), (0, &[PORT][..]));
        let heard = vec![PeerAnswer {
            node: "node-b".into(),
            owned: owned.into_iter().collect(),
            claiming: claiming.into_iter().collect(),
        }];
        a.agent.settle_claims(&[PORT], &heard);
        a.agent.reconcile_ownership().unwrap();
        assert!(!a.agent.owned_ports().contains(&PORT));
        // Backing off, it neither claims (a peer asking finds it silent)
        // nor is asked about again before its delay.
        assert_eq!(a.agent.ownership_answer(&[PORT]), (vec![], vec![]));
        assert!(a.agent.unclaimed_ports().is_empty());
        // Once the delay passed, it is claimed again.
        if let Some(Claim::Contested { retry_at, .. }) = lock(&a.agent.claims).get_mut(&PORT) {
            *retry_at = Instant::now();
        } else {
            panic!("not contested: {:?}", lock(&a.agent.claims).get(&PORT));
        }
        assert_eq!(a.agent.unclaimed_ports(), vec![PORT]);
    }
}
