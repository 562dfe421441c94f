//! The conductor (the `cond` of Gerofi et al. (DVE)): samples this node's load, exchanges
//! loads with the other nodes through membership, runs the policies of
//! `ferry_policy` and, when the transfer policy makes this node a sender,
//! negotiates with the chosen receiver (the crate's two-phase commit, over
//! the `Balance` RPC) and starts the migration through the same engine the
//! Control API's `Migrate` uses.
//!
//! # What "load" is here
//!
//! A node's load is the CPU *demand* of the processes this node manages,
//! in runnable processes per CPU (the unit of `ferry_policy::load`): for
//! each managed process, the time its whole process tree (every thread of
//! every descendant) spent running plus waiting for a CPU, from
//! `/proc/PID/task/TID/schedstat`, per second of wall time; summed over the
//! node's processes and divided by the CPUs. Demand rather than measured
//! use, so that a node whose processes compete for a saturated CPU still
//! shows how much work it has (a busy loop counts 1.0 whatever else runs);
//! where schedstat is missing, `utime + stime` from `/proc/PID/stat` (use)
//! stands in. Not `/proc/loadavg`: ferry's unit of migration is a managed
//! process, so the load it can act on is theirs; and in the test cluster,
//! where nodes are network namespaces on one kernel, loadavg is the same on
//! every node.
//!
//! # A turn ([`Conductor::tick`], every `balancer.period_ms`)
//!
//! 1. sample (procfs, on the blocking pool) and fold into the load model
//!    (decayed internal load, pessimistic export load, recent arrivals);
//! 2. take the load messages membership received, hand them to the
//!    information policy (which drops stale and flags future-dated
//!    entries), and publish this node's message through membership;
//! 3. the peers SWIM counts alive, as the information policy believes
//!    them, are the location candidates: a failed node leaves them as soon
//!    as SWIM declares it down;
//! 4. plan; on a push, offer to the candidates in order: a refusal or no
//!    answer within `balancer.offer_timeout_ms` moves on to the next;
//!    an acceptance starts the migration; its end is told to the receiver
//!    (phase 2), and a commit starts the calm-down on both ends.

pub mod capacity;
mod pull;
mod receive;
mod sampler;
mod service;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ferry_policy::balancer::{IdleReason, Plan};
use ferry_policy::information::{InformationPolicy, LoadEntry, LoadMessage};
use ferry_policy::load::{NodeLoad, ProcessCpuMeter, RecentArrivals};
use ferry_policy::selection::ProcessLoad;
use ferry_policy::transfer::{Answer, MigrationId, Outcome, Refusal};
use ferry_policy::{Balancer, Instant, NodeId, PeerLoad, ProcessId};
use ferry_proto::v1 as pb;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

use crate::membership::LoadBroadcast;
pub use sampler::{EngineStarter, GrpcNegotiator, ProcfsSampler, WallClock};
pub use service::BalanceService;

/// A node's number in the policies: a hash of its name, the same on every
/// node, so that hearsay entries about third nodes mean the same node
/// everywhere.
pub fn node_id(name: &str) -> NodeId {
    NodeId(xxhash_rust::xxh3::xxh3_64(name.as_bytes()) as u32)
}

/// One managed process as sampled.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcSample {
    pub pid: i32,
    /// Cumulative CPU demand (or use) of its process tree.
    pub cpu: Duration,
    /// False while a migration holds it.
    pub migratable: bool,
    pub argv: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sample {
    /// The machine's CPUs.
    pub cpus: u32,
    /// What the managed processes may use of them.
    pub capacity: capacity::Capacity,
    pub processes: Vec<ProcSample>,
}

/// Reads the node's processes (blocking: procfs).
pub trait LoadSampler: Send + Sync {
    fn sample(&self) -> Sample;
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Migrated {
    pub migration_id: String,
    pub destination_pid: i32,
}

/// Why a migration the conductor started did not move the process.
#[derive(Debug, Clone, thiserror::Error)]
pub enum MigrationFailed {
    /// Refused before anything was touched (validation, the destination's
    /// Prepare).
    #[error("{0}")]
    NotStarted(String),
    /// It ran and rolled back (or was lost): the report's error.
    #[error("{0}")]
    NotCommitted(String),
}

/// Why a `Balance` call to another node's conductor failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NegotiationFailed {
    /// No connection to its agent.
    #[error("{0}")]
    Unreachable(String),
    /// Its agent answered with an error.
    #[error("{}", .0.message())]
    Refused(tonic::Status),
}

/// Starts a migration and waits for its end.
#[tonic::async_trait]
pub trait MigrationStarter: Send + Sync {
    /// Whether the engine can migrate to `node` at all.
    fn can_reach(&self, node: &str) -> bool;
    async fn migrate(&self, pid: i32, to: &str) -> Result<Migrated, MigrationFailed>;
}

/// The `Balance` RPC to another node's conductor.
#[tonic::async_trait]
pub trait PeerNegotiator: Send + Sync {
    async fn offer(
        &self,
        to: &str,
        req: pb::OfferRequest,
    ) -> Result<pb::OfferResponse, NegotiationFailed>;
    async fn finish(&self, to: &str, req: pb::FinishRequest) -> Result<(), NegotiationFailed>;
    /// Receiver-initiated transfer: asks `to` for work.
    async fn pull(
        &self,
        to: &str,
        req: pb::PullRequest,
    ) -> Result<pb::PullResponse, NegotiationFailed>;
}

/// Membership as the conductor uses it.
pub trait Gossip: Send + Sync {
    fn publish(&self, message: &LoadBroadcast);
    fn take_inbox(&self) -> Vec<LoadBroadcast>;
    /// Nodes SWIM counts alive (never this node).
    fn alive(&self) -> Vec<String>;
}

impl Gossip for crate::membership::Membership {
    fn publish(&self, message: &LoadBroadcast) {
        crate::membership::Membership::publish(self, message)
    }
    fn take_inbox(&self) -> Vec<LoadBroadcast> {
        crate::membership::Membership::take_inbox(self)
    }
    fn alive(&self) -> Vec<String> {
        crate::membership::Membership::alive(self)
    }
}

/// The clock the policies run on (see [`WallClock`]).
pub trait Clock: Send + Sync {
    fn now(&self) -> Instant;
}

/// Settings of the conductor outside the policy crate.
#[derive(Debug, Clone)]
pub struct Settings {
    pub enabled: bool,
    pub offer_timeout: Duration,
    pub policy: ferry_policy::Config,
}

#[derive(Debug, thiserror::Error)]
pub enum SetError {
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
    #[error("a migration is under way; change the policy once it ended")]
    Busy,
}

struct TrackedProcess {
    meter: ProcessCpuMeter,
    first_seen: Instant,
    argv: Vec<String>,
    migratable: bool,
}

struct State {
    settings: Settings,
    balancer: Balancer,
    load: NodeLoad,
    export: f64,
    cpus: u32,
    capacity: capacity::Capacity,
    /// Peers that said their capacity is unknown: not location candidates.
    no_capacity: std::collections::HashSet<NodeId>,
    procs: HashMap<i32, TrackedProcess>,
    arrivals: RecentArrivals,
    info: Box<dyn InformationPolicy>,
    names: HashMap<NodeId, String>,
    alive: Vec<String>,
    rng: StdRng,
    seq: u64,
    stats: pb::BalancerStats,
    last_decision: String,
    /// The beliefs the last turn acted on (its decision text is
    /// `last_decision`, which the steps after the plan update).
    beliefs: pb::BalancerDecision,
    migrations: Vec<pb::BalancerMigration>,
    /// When the last committed migration in or out ended (calm-down shown).
    calm_from: Option<Instant>,
    /// Processes that arrived by migration, and when (their PID here): the
    /// selection's `rehop_residency_ms`.
    arrived_at: HashMap<i32, Instant>,
    /// The offer this node reserved its incoming slot for, and what the
    /// process adds (the load follows it at the commit).
    incoming: Option<(u64, f64)>,
}

/// The conductor of one node.
pub struct Conductor {
    node: String,
    local: NodeId,
    state: Mutex<State>,
    sampler: Arc<dyn LoadSampler>,
    starter: Arc<dyn MigrationStarter>,
    negotiator: Arc<dyn PeerNegotiator>,
    gossip: Arc<dyn Gossip>,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for Conductor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conductor")
            .field("node", &self.node)
            .finish()
    }
}

/// The most migrations kept for `GetBalancer`.
const HISTORY: usize = 256;

/// The most pushes one turn makes with `transfer.replan_on_commit`.
const MOVES_PER_TURN: usize = 16;

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn refusal_name(r: Refusal) -> &'static str {
    match r {
        Refusal::Busy => "busy",
        Refusal::CalmingDown => "calming_down",
        Refusal::WouldOverload => "would_overload",
    }
}

impl Conductor {
    /// `settings.policy` must have passed validation (config load does it).
    pub fn new(
        node: &str,
        settings: Settings,
        sampler: Arc<dyn LoadSampler>,
        starter: Arc<dyn MigrationStarter>,
        negotiator: Arc<dyn PeerNegotiator>,
        gossip: Arc<dyn Gossip>,
        clock: Arc<dyn Clock>,
    ) -> Arc<Self> {
        let local = node_id(node);
        let state = State {
            balancer: Balancer::new(&settings.policy),
            info: settings.policy.information.policy(local, &[]),
            settings,
            load: NodeLoad::new(),
            export: 0.0,
            cpus: 1,
            capacity: capacity::Capacity::Machine,
            no_capacity: Default::default(),
            procs: HashMap::new(),
            arrivals: RecentArrivals::default(),
            names: HashMap::from([(local, node.to_owned())]),
            alive: Vec::new(),
            rng: StdRng::seed_from_u64(u64::from(local.0) ^ unix_ms()),
            seq: 0,
            stats: pb::BalancerStats::default(),
            last_decision: "not run yet".into(),
            beliefs: pb::BalancerDecision::default(),
            migrations: Vec::new(),
            calm_from: None,
            arrived_at: HashMap::new(),
            incoming: None,
        };
        Arc::new(Conductor {
            node: node.to_owned(),
            local,
            state: Mutex::new(state),
            sampler,
            starter,
            negotiator,
            gossip,
            clock,
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }

    pub fn enabled(&self) -> bool {
        self.state().settings.enabled
    }

    pub fn settings(&self) -> Settings {
        self.state().settings.clone()
    }

    /// This node's internal load.
    pub fn local_load(&self) -> f64 {
        self.state().load.internal()
    }

    /// Turns the balancer on or off and replaces the policy configuration
    /// (validated here: the error names the field). Policies are rebuilt,
    /// which also clears the calm-down; refused while a migration is
    /// negotiated or under way.
    pub fn set(&self, enabled: Option<bool>, policy: ferry_policy::Config) -> Result<(), SetError> {
        if let Err(e) = policy.validate() {
            return Err(match e {
                ferry_policy::PolicyError::InvalidField { field, reason } => SetError::Invalid {
                    field: field.to_owned(),
                    reason,
                },
                e => SetError::Invalid {
                    field: "policy".into(),
                    reason: e.to_string(),
                },
            });
        }
        let mut s = self.state();
        if policy != s.settings.policy {
            if s.balancer.gate.outgoing().is_some() || s.balancer.gate.incoming().is_some() {
                return Err(SetError::Busy);
            }
            s.balancer = Balancer::new(&policy);
            if policy.information != s.settings.policy.information {
                let members: Vec<NodeId> = s.alive.iter().map(|n| node_id(n)).collect();
                s.info = policy.information.policy(self.local, &members);
            }
            s.settings.policy = policy;
        }
        if let Some(on) = enabled {
            if on != s.settings.enabled {
                tracing::info!(enabled = on, "balancer switched");
            }
            s.settings.enabled = on;
        }
        Ok(())
    }

    /// Folds a sample into the load model.
    fn observe(&self, s: &mut State, now: Instant, sample: Sample) {
        let decay = s.settings.policy.load.decay;
        s.cpus = sample.cpus.max(1);
        if sample.capacity != s.capacity {
            match sample.capacity.unknown() {
                Some(why) => tracing::warn!(
                    %why,
                    "CPU capacity unknown: not a location candidate for the others"
                ),
                None => tracing::info!(cores = sample.capacity.cores(s.cpus), "CPU capacity"),
            }
            s.capacity = sample.capacity;
        }
        let mut seen = Vec::with_capacity(sample.processes.len());
        for p in sample.processes {
            seen.push(p.pid);
            let t = s.procs.entry(p.pid).or_insert_with(|| TrackedProcess {
                meter: ProcessCpuMeter::default(),
                first_seen: now,
                argv: p.argv.clone(),
                migratable: p.migratable,
            });
            t.migratable = p.migratable;
            if let Err(e) = t.meter.sample(now, p.cpu, decay) {
                // A thread exited (its time left the sum) or the PID was
                // reused: start measuring again.
                tracing::debug!(pid = p.pid, error = %e, "CPU meter restarted");
                t.meter = ProcessCpuMeter::default();
                let _ = t.meter.sample(now, p.cpu, decay);
            }
        }
        s.procs.retain(|pid, _| seen.contains(pid));
        // An arrival is kept while its process runs here, and a minute for
        // one not sampled yet.
        let procs = &s.procs;
        s.arrived_at.retain(|pid, at| {
            procs.contains_key(pid) || now.saturating_duration_since(*at) < Duration::from_secs(60)
        });
        let cpus = s.capacity.cores(s.cpus);
        let total: f64 = s.procs.values().map(|t| t.meter.share()).sum::<f64>() / cpus;
        let load_cfg = s.settings.policy.load.clone();
        if let Err(e) = s.load.record(now, total, &load_cfg) {
            tracing::warn!(error = %e, "load sample rejected");
        }
        let window = Duration::from_millis(load_cfg.recent_arrival_ms);
        let recent: Vec<ProcessId> = s.arrivals.recent(now, window).collect();
        let recent_cpu: f64 = recent
            .iter()
            .filter_map(|pid| s.procs.get(&(pid.0 as i32)))
            .map(|t| t.meter.share())
            .sum::<f64>()
            / cpus;
        s.export = s.load.export(recent_cpu, s.procs.len(), &load_cfg);
    }

    /// Takes membership's news and publishes this node's load.
    fn exchange(&self, s: &mut State, now: Instant) {
        let alive = self.gossip.alive();
        for n in &alive {
            s.names.insert(node_id(n), n.clone());
        }
        let members: Vec<NodeId> = alive.iter().map(|n| node_id(n)).collect();
        s.info.set_members(&members);
        s.alive = alive;
        for b in self.gossip.take_inbox() {
            let from = node_id(&b.node);
            s.names.insert(from, b.node.clone());
            if b.capacity_unknown.is_empty() {
                s.no_capacity.remove(&from);
            } else {
                s.no_capacity.insert(from);
            }
            if let Err(e) = s.info.receive(&b.to_message(from), now) {
                tracing::debug!(from = %b.node, error = %e, "load message rejected");
            }
        }
        let export = s.export;
        let mut rng = StdRng::seed_from_u64(s.rng.next_u64());
        let message = s
            .info
            .tick(now, export, &mut rng)
            .into_iter()
            .next()
            .map(|o| o.message)
            .unwrap_or_else(|| LoadMessage {
                from: self.local,
                entries: vec![LoadEntry {
                    node: self.local,
                    load: export,
                    stamped_at: now,
                    age: Duration::ZERO,
                }],
            });
        s.seq = s.seq.max(unix_ms()).max(s.seq + 1);
        let mut b = LoadBroadcast::from_message(&self.node, s.seq, s.procs.len() as u32, &message);
        b.capacity_unknown = s.capacity.unknown().unwrap_or_default().to_owned();
        self.gossip.publish(&b);
        let st = s.info.stats();
        s.stats.gossip_received = st.messages_received;
        s.stats.gossip_stale_dropped = st.stale_dropped;
        s.stats.gossip_future_dated = st.future_dated;
    }

    /// The location candidates: peers the information policy knows that
    /// SWIM counts alive and the engine can reach.
    fn candidates(&self, s: &State, now: Instant) -> Vec<PeerLoad> {
        s.info
            .peers(now)
            .into_iter()
            .filter(|p| !s.no_capacity.contains(&p.node))
            .filter(|p| {
                s.names.get(&p.node).is_some_and(|name| {
                    s.alive.contains(name) && self.starter.can_reach(name) && name != &self.node
                })
            })
            .collect()
    }

    /// The node names that would be location candidates now.
    pub fn candidate_names(&self) -> Vec<String> {
        let now = self.clock.now();
        let s = self.state();
        self.candidates(&s, now)
            .iter()
            .filter_map(|p| s.names.get(&p.node).cloned())
            .collect()
    }

    /// One turn; returns what it decided.
    pub async fn tick(&self) -> String {
        let sampler = self.sampler.clone();
        let sample = match tokio::task::spawn_blocking(move || sampler.sample()).await {
            Ok(s) => s,
            Err(e) => return format!("sampling failed: {e}"),
        };
        {
            let mut s = self.state();
            s.stats.ticks += 1;
            let now = self.clock.now();
            self.observe(&mut s, now, sample);
            self.exchange(&mut s, now);
            if !s.settings.enabled {
                s.last_decision = "off".into();
                return s.last_decision.clone();
            }
        }
        // With `transfer.replan_on_commit`, a committed push is followed at
        // once by the next plan: a node far above the average sheds its
        // excess in one turn (bounded, so that a turn ends).
        for _ in 0..MOVES_PER_TURN {
            match self.plan() {
                Plan::Push {
                    pid,
                    process_load,
                    candidates,
                } => {
                    // The turn's beliefs go with the migration's record.
                    let why = self.last_decision();
                    let committed = self
                        .push(pid.0 as i32, process_load, candidates, None, why)
                        .await;
                    let s = self.state();
                    if !(committed && s.settings.policy.transfer.replan_on_commit) {
                        break;
                    }
                }
                Plan::Pull {
                    deficit,
                    candidates,
                } => {
                    self.pull(deficit, candidates).await;
                    break;
                }
                Plan::Idle(_) => break,
            }
        }
        self.state().last_decision.clone()
    }

    /// Runs the policies on what this node believes now.
    fn plan(&self) -> Plan {
        let mut s = self.state();
        let now = self.clock.now();
        let peers = self.candidates(&s, now);
        let procs = process_loads(&s, now);
        let local = s.load.internal();
        let mut rng = StdRng::seed_from_u64(s.rng.next_u64());
        let plan = s.balancer.plan(now, local, &peers, &procs, &mut rng);
        s.beliefs = beliefs(&s, local, &peers, &plan);
        let name = |s: &State, c: &NodeId| s.names.get(c).cloned();
        s.last_decision = match &plan {
            Plan::Idle(IdleReason::Balanced) => "balanced".into(),
            Plan::Idle(IdleReason::CalmingDown) => "calming down".into(),
            Plan::Idle(IdleReason::OutgoingBusy) => "a migration is under way".into(),
            Plan::Idle(IdleReason::NoEligibleProcess) => "overloaded, no eligible process".into(),
            Plan::Idle(IdleReason::NoDestination) => "overloaded, no destination".into(),
            Plan::Idle(IdleReason::IncomingBusy) => {
                "underloaded, a migration here is reserved".into()
            }
            Plan::Push {
                pid, candidates, ..
            } => format!(
                "push {} to {}",
                pid.0,
                candidates
                    .iter()
                    .filter_map(|c| name(&s, c))
                    .collect::<Vec<_>>()
                    .join(" or ")
            ),
            Plan::Pull { candidates, .. } => format!(
                "pull from {}",
                candidates
                    .iter()
                    .filter_map(|c| name(&s, c))
                    .collect::<Vec<_>>()
                    .join(" or ")
            ),
        };
        plan
    }

    /// The last turn: its decision and the beliefs it acted on.
    pub fn last_decision(&self) -> pb::BalancerDecision {
        let s = self.state();
        pb::BalancerDecision {
            decision: s.last_decision.clone(),
            ..s.beliefs.clone()
        }
    }

    /// Offers `pid` to the candidates in order; migrates to the first that
    /// accepts. True when the migration committed. `marked`: the gate
    /// already holds this migration (a pull answered), the first offer
    /// takes it over. `why`: the decision and the beliefs it acted on, kept
    /// with the migration's record.
    async fn push(
        &self,
        pid: i32,
        process_load: f64,
        candidates: Vec<NodeId>,
        mut marked: Option<MigrationId>,
        why: pb::BalancerDecision,
    ) -> bool {
        let (timeout, sender_load) = {
            let s = self.state();
            (s.settings.offer_timeout, s.load.internal())
        };
        for node in candidates {
            let Some(name) = self.state().names.get(&node).cloned() else {
                continue;
            };
            let id = {
                let mut s = self.state();
                let id = marked
                    .take()
                    .unwrap_or_else(|| MigrationId(s.rng.next_u64()));
                if let Err(e) = s.balancer.gate.begin_offer(id, node, self.clock.now()) {
                    s.last_decision = format!("offer not started: {e}");
                    return false;
                }
                s.stats.offers_sent += 1;
                id
            };
            let req = pb::OfferRequest {
                offer_id: id.0,
                from_node: self.node.clone(),
                sender_load,
                process_load,
                pid,
            };
            let answer = tokio::time::timeout(timeout, self.negotiator.offer(&name, req)).await;
            let accepted = match answer {
                Ok(Ok(r)) if r.accepted => true,
                Ok(Ok(r)) => {
                    tracing::info!(to = %name, pid, refusal = %r.refusal, "offer refused");
                    self.state().stats.offers_refused += 1;
                    false
                }
                Ok(Err(e)) => {
                    tracing::info!(to = %name, pid, error = %e, "offer failed");
                    self.state().stats.offers_refused += 1;
                    false
                }
                Err(_) => {
                    tracing::warn!(to = %name, pid, ?timeout, "no answer to the offer in time: next candidate");
                    self.state().stats.offers_timed_out += 1;
                    // It may have reserved for us after all: free it (its
                    // reservation also times out on its own).
                    let negotiator = self.negotiator.clone();
                    let (to, from) = (name.clone(), self.node.clone());
                    tokio::spawn(async move {
                        let req = pb::FinishRequest {
                            offer_id: id.0,
                            from_node: from,
                            committed: false,
                            destination_pid: 0,
                        };
                        let _ = tokio::time::timeout(timeout, negotiator.finish(&to, req)).await;
                    });
                    false
                }
            };
            {
                let mut s = self.state();
                let a = if accepted {
                    Answer::Accept
                } else {
                    Answer::Refuse(Refusal::Busy)
                };
                if let Err(e) = s.balancer.gate.on_answer(id, a) {
                    tracing::warn!(error = %e, "gate out of step");
                }
                if accepted {
                    s.stats.offers_accepted += 1;
                    let now = self.clock.now();
                    s.balancer.promise(id, node, process_load, now);
                }
            }
            if accepted {
                return self.migrate(id, pid, &name, process_load, why).await;
            }
        }
        let mut s = self.state();
        if let Some(id) = marked {
            // Never offered: free the gate.
            let _ = s
                .balancer
                .gate
                .finish_outgoing(id, Outcome::Aborted, self.clock.now());
        }
        s.last_decision = format!("no candidate accepted process {pid}");
        false
    }

    /// Migrates `pid` to `to` (accepted offer `id`); true when committed.
    async fn migrate(
        &self,
        id: MigrationId,
        pid: i32,
        to: &str,
        process_load: f64,
        why: pb::BalancerDecision,
    ) -> bool {
        let argv = self
            .state()
            .procs
            .get(&pid)
            .map(|t| t.argv.clone())
            .unwrap_or_default();
        let at = unix_ms();
        tracing::info!(pid, to, "balancer: migrating");
        let result = self.starter.migrate(pid, to).await;
        let committed = result.is_ok();
        {
            let mut s = self.state();
            let now = self.clock.now();
            let outcome = if committed {
                Outcome::Committed
            } else {
                Outcome::Aborted
            };
            if let Err(e) = s.balancer.gate.finish_outgoing(id, outcome, now) {
                tracing::warn!(error = %e, "gate out of step");
            }
            s.balancer.settle_promise(id, outcome, now);
            if committed {
                let load_cfg = s.settings.policy.load.clone();
                s.load.departed(now, process_load, &load_cfg);
            }
            let mut record = pb::BalancerMigration {
                source_pid: pid,
                argv,
                from_node: self.node.clone(),
                to_node: to.to_owned(),
                at_unix_ms: at,
                committed,
                decision: Some(why),
                ..Default::default()
            };
            match &result {
                Ok(m) => {
                    s.stats.migrations_committed += 1;
                    s.calm_from = Some(now);
                    record.migration_id = m.migration_id.clone();
                    record.destination_pid = m.destination_pid;
                    s.last_decision = format!("migrated {pid} to {to}");
                }
                Err(e) => {
                    s.stats.migrations_aborted += 1;
                    record.error = e.to_string();
                    s.last_decision = format!("migration of {pid} to {to} failed: {e}");
                }
            }
            s.migrations.push(record);
            let len = s.migrations.len();
            if len > HISTORY {
                s.migrations.drain(..len - HISTORY);
            }
        }
        let req = pb::FinishRequest {
            offer_id: id.0,
            from_node: self.node.clone(),
            committed,
            destination_pid: result.as_ref().map(|m| m.destination_pid).unwrap_or(0),
        };
        let timeout = self.state().settings.offer_timeout;
        match tokio::time::timeout(timeout, self.negotiator.finish(to, req)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(to, error = %e, "telling the receiver how it ended"),
            Err(_) => tracing::warn!(to, "receiver did not take the outcome in time"),
        }
        committed
    }

    /// What `GetBalancer` shows.
    pub fn report(&self) -> pb::Balancer {
        let now = self.clock.now();
        let s = self.state();
        let calm = Duration::from_millis(s.settings.policy.transfer.calm_down_ms);
        let calm_down_remaining_ms = match s.calm_from {
            Some(at) if s.balancer.gate.calming_down(now) => calm
                .saturating_sub(now.saturating_duration_since(at))
                .as_millis() as u64,
            _ => 0,
        };
        let mut processes: Vec<pb::BalancerProcess> = s
            .procs
            .iter()
            .map(|(&pid, t)| pb::BalancerProcess {
                pid,
                load: t.meter.share() / s.capacity.cores(s.cpus),
                resident_ms: now.saturating_duration_since(t.first_seen).as_millis() as u64,
                migratable: t.migratable,
                argv: t.argv.clone(),
            })
            .collect();
        processes.sort_by_key(|p| p.pid);
        pb::Balancer {
            node: self.node.clone(),
            enabled: s.settings.enabled,
            policy_toml: toml::to_string(&s.settings.policy).unwrap_or_default(),
            local_load: s.load.internal(),
            export_load: s.export,
            peers: s
                .info
                .peers(now)
                .iter()
                .map(|p| pb::BalancerPeer {
                    node: s
                        .names
                        .get(&p.node)
                        .cloned()
                        .unwrap_or_else(|| p.node.to_string()),
                    load: p.load,
                    age_ms: p.age.as_millis() as u64,
                })
                .collect(),
            processes,
            stats: Some(s.stats),
            last_decision: s.last_decision.clone(),
            calm_down_remaining_ms,
            migrations: s.migrations.clone(),
            cpus: s.cpus,
            last: Some(pb::BalancerDecision {
                decision: s.last_decision.clone(),
                ..s.beliefs.clone()
            }),
        }
    }
}

/// This node's processes as the selection policy sees them.
fn process_loads(s: &State, now: Instant) -> Vec<ProcessLoad> {
    s.procs
        .iter()
        .map(|(&pid, t)| ProcessLoad {
            pid: ProcessId(pid as u64),
            load: t.meter.share() / s.capacity.cores(s.cpus),
            resident_for: now.saturating_duration_since(t.first_seen),
            migratable: t.migratable,
            since_arrival: s
                .arrived_at
                .get(&pid)
                .map(|&at| now.saturating_duration_since(at)),
        })
        .collect()
}

/// What a turn believed: this node's load, the cluster average it
/// approximates from its candidates, the candidates' loads, and for a push
/// the process and the destinations in order (the decision's text is
/// filled in by the caller).
fn beliefs(s: &State, local: f64, peers: &[PeerLoad], plan: &Plan) -> pb::BalancerDecision {
    let name = |n: &NodeId| s.names.get(n).cloned().unwrap_or_else(|| n.to_string());
    let mut d = pb::BalancerDecision {
        load: local,
        approximate_average: ferry_policy::node::approximate_average(local, peers),
        candidates: peers
            .iter()
            .map(|p| pb::BalancerPeer {
                node: name(&p.node),
                load: p.load,
                age_ms: p.age.as_millis() as u64,
            })
            .collect(),
        at_unix_ms: unix_ms(),
        ..Default::default()
    };
    if let Plan::Push {
        pid,
        process_load,
        candidates,
    } = plan
    {
        d.pid = pid.0 as i32;
        d.process_load = *process_load;
        d.destinations = candidates.iter().map(name).collect();
    }
    d
}

/// Runs the conductor's turns until shutdown. `on_change` hears each
/// decision that differs from the one before, with the beliefs it acted
/// on.
pub async fn run(
    conductor: Arc<Conductor>,
    period: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
    on_change: impl Fn(pb::BalancerDecision) + Send,
) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = String::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let decision = conductor.tick().await;
                let load = conductor.local_load();
                tracing::debug!(%decision, load, "balancer turn");
                if decision != last {
                    on_change(conductor.last_decision());
                    last = decision;
                }
            }
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests;
