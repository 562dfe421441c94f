//! Meehan & Wynne (openMosix)'s load-spike experiment, simulated with this
//! crate's policies.
//!
//! The cluster: 20 single-CPU nodes on one switch; every second each node
//! samples its run queue ([`NodeLoad`]) and tells two peers its export load
//! (own load only, standard openMosix) or its whole hearsay vector. Each
//! received load message re-runs the transfer policy ("is some node in my
//! vector below me?", [`TransferMode::LowerPeerExists`]); if so `choose()`
//! (the selection policy) runs and `consider()` (least-loaded location,
//! local node included) picks a target; the receiver answers through the
//! two-phase commit. A migration is stop-and-copy: the process does not run
//! while its memory crosses the wire ([`MigrationCostModel`]).
//!
//! The load: 6 spikes 5 s apart, each starting 70 CPU-bound processes on one
//! node, always the same nodes. Recovery time is measured as
//! Meehan & Wynne (openMosix) measure it: from the first spike to the last
//! migration before the cluster settles (no migration for `quiet_period`).
//!
//! What differs between variants is only the information policy and its
//! vector size; everything else, every parameter, is shared. Whatever
//! separates the variants therefore comes from what they know and how old
//! it is: a shared slot keeps the freshest news of any of its nodes, a slot
//! of its own keeps one node's news only as fresh as gossip brings it.

use std::collections::BTreeMap;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::event::EventQueue;
use super::{SimError, mean_sd};
use crate::balancer::{Balancer, Plan};
use crate::config::Config;
use crate::information::{
    Destination, InformationConfig, InformationKind, InformationPolicy, LoadMessage, Outgoing,
};
use crate::load::{LoadConfig, NodeLoad, RecentArrivals};
use crate::location::{LocationConfig, LocationKind};
use crate::migration_cost::{Mechanism, MigrationCostModel};
use crate::node::approximate_average;
use crate::node::{NodeId, ProcessId};
use crate::selection::{ProcessLoad, SelectionConfig, SelectionKind};
use crate::time::Instant;
use crate::transfer::{
    Answer, MigrationId, Offer, Outcome, ReceiverView, TransferConfig, TransferMode,
};

mod variant;

pub use variant::{FerryPart, Knowledge, SeedReference, Variant, seed_reference};

/// Everything the experiment depends on besides the variant.
#[derive(Debug, Clone, Serialize)]
pub struct Params {
    pub nodes: u32,
    pub spikes: u32,
    pub processes_per_spike: u32,
    pub spike_interval: Duration,
    /// Quiet time before the first spike, for the load vectors to fill.
    pub warmup: Duration,
    /// Memory of one CPU-bound test process.
    pub process_memory_bytes: u64,
    /// Scheduler time slice: a process marked by `choose()` is looked at by
    /// `consider()` only when the dispatcher next runs it
    /// (Meehan & Wynne (openMosix) §3), so on a node with n runnable processes
    /// it waits up to n - 1 slices. Linux 2.4 gives a nice-0 process 6 ticks at
    /// HZ=100: 60 ms.
    pub timeslice: Duration,
    pub migration: MigrationCostModel,
    /// One-way latency of a message on the switch.
    pub latency: Duration,
    /// Largest clock offset of a node (NTP keeps them close:
    /// Meehan & Wynne (openMosix) §4).
    pub clock_skew: Duration,
    /// The cluster is settled after this long without a migration.
    pub quiet_period: Duration,
    /// Give up (and report it) after this long.
    pub time_limit: Duration,
    pub runs: u32,
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            nodes: 20,
            spikes: 6,
            processes_per_spike: 70,
            spike_interval: Duration::from_secs(5),
            warmup: Duration::from_secs(10),
            process_memory_bytes: 4 << 20,
            timeslice: Duration::from_millis(60),
            migration: MigrationCostModel {
                // 1 Gb/s links (Meehan & Wynne (openMosix) §2), openMosix's
                // stop-and-copy.
                bandwidth_bytes_per_sec: 125_000_000.0,
                freeze_overhead: Duration::from_millis(20),
                per_connection: Duration::ZERO,
                per_mib: Duration::ZERO,
                mechanism: Mechanism::StopAndCopy,
            },
            latency: Duration::from_millis(1),
            clock_skew: Duration::from_millis(1),
            quiet_period: Duration::from_secs(30),
            time_limit: Duration::from_secs(900),
            runs: 5,
            seed: 2,
        }
    }
}

impl Params {
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |field, reason: &str| {
            Err(SimError::InvalidParameter {
                field,
                reason: reason.into(),
            })
        };
        if self.nodes < 2 {
            return bad("nodes", "need at least 2");
        }
        if self.spikes == 0 || self.spikes > self.nodes {
            return bad("spikes", "need 1 to `nodes` spikes (one node each)");
        }
        if self.runs == 0 {
            return bad("runs", "need at least 1");
        }
        if self.migration.bandwidth_bytes_per_sec.is_nan()
            || self.migration.bandwidth_bytes_per_sec <= 0.0
        {
            return bad("migration.bandwidth_bytes_per_sec", "must be > 0");
        }
        Ok(())
    }

    /// The node spike `k` lands on: spread over the cluster, the same in
    /// every run and variant.
    pub fn spike_node(&self, k: u32) -> NodeId {
        NodeId(k * self.nodes / self.spikes)
    }

    /// The policy configuration shared by every variant, with the variant's
    /// information policy.
    pub fn config(&self, variant: Variant) -> Config {
        let residency = self.migration.estimate(self.process_memory_bytes, 0).total;
        let (kind, vector_size) = match variant.knowledge() {
            Knowledge::OwnLoadOnly => (InformationKind::OwnLoadOnly, 8),
            Knowledge::Hearsay(n) => (InformationKind::Hearsay, n),
        };
        let location = match variant {
            Variant::Ferry(_, location) => location,
            _ => LocationKind::LeastLoaded,
        };
        let has = |part| variant.has(part);
        Config {
            load: LoadConfig {
                decay: 0.5,
                // One process's worth: a node never sends to a peer that
                // only looks one process lighter.
                stabilizer: 1.0,
                recent_arrival_ms: 5_000,
                process_table_weight: 0.5,
                process_table_size: 4096,
                follow_migrations: has(FerryPart::FollowMigrations),
            },
            transfer: TransferConfig {
                // ferry's sender must be above the average it knows, not
                // merely above some lighter peer: a node that has shed down
                // to the average stops, and later spikes fill the light nodes.
                // Every node here is above any absolute threshold (one CPU,
                // tens of processes), so only the average decides.
                mode: if has(FerryPart::AboveAverage) {
                    TransferMode::SenderThreshold
                } else {
                    TransferMode::LowerPeerExists
                },
                threshold: if has(FerryPart::AboveAverage) {
                    f64::MAX
                } else {
                    1.0
                },
                average_gap: 0.0,
                // openMosix has no calm-down: the export load's recent-
                // arrivals term does that job.
                calm_down_ms: 0,
                reservation_timeout_ms: 10_000,
                receiver_check: has(FerryPart::ReceiverUpToAverage),
                receiver_up_to_average: has(FerryPart::ReceiverUpToAverage),
                count_promised: has(FerryPart::CountPromised),
                replan_on_commit: has(FerryPart::ReplanOnCommit),
            },
            location: LocationConfig { kind: location },
            selection: SelectionConfig {
                kind: SelectionKind::ClosestToExcess,
                // Meehan & Wynne (openMosix) §3: residency is the estimated
                // migration time, in CPU time used on this node.
                min_residency_ms: u64::try_from(residency.as_millis()).unwrap_or(u64::MAX),
                rehop_residency_ms: if has(FerryPart::RehopResidency) {
                    FERRY_REHOP_RESIDENCY_MS
                } else {
                    0
                },
            },
            information: InformationConfig {
                kind,
                period_ms: 1_000,
                vector_size,
                fanout: 2,
                max_age_ms: 10_000,
                max_clock_skew_ms: 500,
                recent_contact_ms: 10_000,
                failure_timeout_ms: 3_500,
            },
        }
    }
}

/// ferry's variants: a process that arrived stays this long (wall time)
/// before it may hop on.
pub const FERRY_REHOP_RESIDENCY_MS: u64 = 30_000;

/// The cluster at one second of a run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct TimelinePoint {
    /// Since the first spike.
    pub secs: f64,
    /// Processes on the busiest and the idlest node (in flight excluded).
    pub max_processes: usize,
    pub min_processes: usize,
    pub migrations_so_far: u64,
}

/// One run's measurements.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    /// From the first spike to the last migration (Meehan & Wynne (openMosix)'s
    /// definition).
    pub recovery_secs: f64,
    /// The cluster did not settle within the time limit.
    pub timed_out: bool,
    pub choose_per_node: f64,
    pub migrations_per_node: f64,
    /// Processes that moved more than once.
    pub remigrated_processes: u32,
    pub message_bytes: usize,
    pub load_bytes_per_node_per_sec: f64,
    /// Mean age of the beliefs a node acted on when it chose a target.
    pub mean_belief_age_secs: f64,
    /// Mean, over decisions, of how far the chosen target's believed load
    /// was below its real load at that moment (processes).
    pub mean_target_error: f64,
    pub refused_offers: u64,
    /// Most minus fewest processes on a node at the end.
    pub final_spread: u32,
    /// Once a second from the first spike.
    pub timeline: Vec<TimelinePoint>,
}

/// A variant's runs, summarised.
#[derive(Debug, Clone, Serialize)]
pub struct VariantResult {
    pub variant: Variant,
    pub label: String,
    pub runs: Vec<RunResult>,
}

impl VariantResult {
    pub fn mean(&self, f: impl Fn(&RunResult) -> f64) -> (f64, f64) {
        mean_sd(&self.runs.iter().map(f).collect::<Vec<_>>())
    }
}

/// Runs every variant `params.runs` times; run `r` of every variant uses
/// the same seed, so variants differ only by their policy.
pub fn run_all(params: &Params, variants: &[Variant]) -> Result<Vec<VariantResult>, SimError> {
    params.validate()?;
    variants
        .iter()
        .map(|&variant| {
            let runs = (0..params.runs)
                .map(|r| run_once(params, variant, params.seed.wrapping_add(u64::from(r))))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(VariantResult {
                variant,
                label: variant.label(),
                runs,
            })
        })
        .collect()
}

struct SimProcess {
    pid: ProcessId,
    /// The node's per-process CPU clock when the process arrived.
    cpu_clock_at_arrival: f64,
    /// True time (ms) a migration brought it here; `None` if born here.
    arrived_ms: Option<u64>,
}

struct SimNode {
    /// Offset of this node's clock from true time (ms, may be negative).
    clock_offset: i64,
    processes: Vec<SimProcess>,
    /// Integral of the run-queue length since the last sample (process·s).
    runnable_integral: f64,
    /// CPU seconds each resident process has received since time 0 (all
    /// processes on a node are CPU-bound and share the CPU equally).
    cpu_clock: f64,
    last_advance: u64,
    load: NodeLoad,
    recent: RecentArrivals,
    info: Box<dyn InformationPolicy>,
    balancer: Balancer,
    migrations_in: u64,
}

impl SimNode {
    /// Brings the integrals up to `now_ms` (true time).
    fn advance(&mut self, now_ms: u64) {
        let dt = now_ms.saturating_sub(self.last_advance) as f64 / 1000.0;
        let n = self.processes.len() as f64;
        self.runnable_integral += n * dt;
        if n > 0.0 {
            self.cpu_clock += dt / n.max(1.0);
        }
        self.last_advance = now_ms;
    }

    fn local(&self, now: Instant) -> Instant {
        Instant::from_millis(now.as_millis().saturating_add_signed(self.clock_offset))
    }

    fn export_load(&mut self, now: Instant, config: &LoadConfig) -> f64 {
        let window = Duration::from_millis(config.recent_arrival_ms);
        let share = 1.0 / (self.processes.len().max(1) as f64);
        let local = self.local(now);
        let recent_present = {
            let recent: Vec<ProcessId> = self.recent.recent(local, window).collect();
            self.processes
                .iter()
                .filter(|p| recent.contains(&p.pid))
                .count()
        };
        self.load.export(
            recent_present as f64 * share.min(1.0),
            self.processes.len(),
            config,
        )
    }

    fn process_loads(&self, now_ms: u64) -> Vec<ProcessLoad> {
        self.processes
            .iter()
            .map(|p| ProcessLoad {
                pid: p.pid,
                load: 1.0,
                resident_for: Duration::from_secs_f64(
                    (self.cpu_clock - p.cpu_clock_at_arrival).max(0.0),
                ),
                migratable: true,
                since_arrival: p
                    .arrived_ms
                    .map(|at| Duration::from_millis(now_ms.saturating_sub(at))),
            })
            .collect()
    }
}

enum Event {
    Spike(u32),
    Sample(NodeId),
    /// Record the timeline.
    Observe,
    Gossip(NodeId),
    Deliver {
        to: NodeId,
        message: LoadMessage,
    },
    /// The marked process is scheduled: `consider()` picks its target.
    Dispatch {
        node: NodeId,
        id: MigrationId,
        pid: ProcessId,
    },
    Offer {
        to: NodeId,
        offer: Offer,
        pid: ProcessId,
        rest: Vec<NodeId>,
    },
    Answer {
        to: NodeId,
        from: NodeId,
        id: MigrationId,
        answer: Answer,
        pid: ProcessId,
        rest: Vec<NodeId>,
    },
    Arrive {
        from: NodeId,
        to: NodeId,
        id: MigrationId,
        pid: ProcessId,
    },
}

struct Cluster<'p> {
    params: &'p Params,
    config: Config,
    /// ferry's selection: picks the process at once (no dispatcher wait).
    select_at_once: bool,
    /// ferry's receiver: checks an offer against its export load and the
    /// average it knows.
    receiver_up_to_average: bool,
    nodes: Vec<SimNode>,
    queue: EventQueue<Event>,
    rng: StdRng,
    next_pid: u64,
    next_migration: u64,
    last_migration_ms: Option<u64>,
    moves: BTreeMap<ProcessId, u32>,
    bytes_sent: usize,
    message_bytes: usize,
    belief_ages: Vec<f64>,
    target_errors: Vec<f64>,
    refused: u64,
    migrations: u64,
    timeline: Vec<TimelinePoint>,
    first_spike_ms: u64,
}

fn run_once(params: &Params, variant: Variant, seed: u64) -> Result<RunResult, SimError> {
    let config = params.config(variant);
    config.validate()?;
    let mut rng = StdRng::seed_from_u64(seed);
    let members: Vec<NodeId> = (0..params.nodes).map(NodeId).collect();
    let skew = i64::try_from(params.clock_skew.as_millis()).unwrap_or(i64::MAX);
    // True time starts well past zero so that skewed clocks never underflow.
    let epoch: u64 = 1_000_000;
    let nodes = members
        .iter()
        .map(|&id| SimNode {
            clock_offset: rng.random_range(-skew..=skew),
            processes: Vec::new(),
            runnable_integral: 0.0,
            cpu_clock: 0.0,
            last_advance: epoch,
            load: NodeLoad::new(),
            recent: RecentArrivals::default(),
            info: config.information.policy(id, &members),
            balancer: Balancer::new(&config),
            migrations_in: 0,
        })
        .collect();
    let mut queue = EventQueue::default();
    queue.schedule_at(Instant::from_millis(epoch), Event::Spike(u32::MAX));
    let first_spike_ms = epoch + params.warmup.as_millis() as u64;
    let mut cluster = Cluster {
        params,
        config,
        select_at_once: variant.has(FerryPart::SelectAtOnce),
        receiver_up_to_average: variant.has(FerryPart::ReceiverUpToAverage),
        nodes,
        queue,
        rng,
        next_pid: 0,
        next_migration: 0,
        last_migration_ms: None,
        moves: BTreeMap::new(),
        bytes_sent: 0,
        message_bytes: 0,
        belief_ages: Vec::new(),
        target_errors: Vec::new(),
        refused: 0,
        migrations: 0,
        timeline: Vec::new(),
        first_spike_ms,
    };
    cluster
        .queue
        .schedule_at(Instant::from_millis(first_spike_ms), Event::Observe);
    // Independent phases: real nodes' timers are not synchronised.
    for n in 0..params.nodes {
        let sample_phase = cluster.rng.random_range(0..1_000);
        let gossip_phase = cluster.rng.random_range(0..1_000);
        cluster.queue.schedule_at(
            Instant::from_millis(epoch + sample_phase),
            Event::Sample(NodeId(n)),
        );
        cluster.queue.schedule_at(
            Instant::from_millis(epoch + gossip_phase),
            Event::Gossip(NodeId(n)),
        );
    }
    for k in 0..params.spikes {
        let at = first_spike_ms + k as u64 * params.spike_interval.as_millis() as u64;
        cluster
            .queue
            .schedule_at(Instant::from_millis(at), Event::Spike(k));
    }
    let last_spike_ms =
        first_spike_ms + u64::from(params.spikes - 1) * params.spike_interval.as_millis() as u64;
    let limit_ms = first_spike_ms + params.time_limit.as_millis() as u64;
    let quiet_ms = params.quiet_period.as_millis() as u64;
    let mut timed_out = false;
    while let Some(event) = cluster.queue.pop() {
        let now = cluster.queue.now().as_millis();
        let settled_since = cluster
            .last_migration_ms
            .unwrap_or(last_spike_ms)
            .max(last_spike_ms);
        if now >= settled_since + quiet_ms {
            break;
        }
        if now >= limit_ms {
            timed_out = true;
            break;
        }
        cluster.handle(event)?;
    }
    let nodes = f64::from(params.nodes);
    let counts: Vec<usize> = cluster.nodes.iter().map(|n| n.processes.len()).collect();
    let elapsed_secs = (cluster.queue.now().as_millis() - epoch) as f64 / 1000.0;
    Ok(RunResult {
        recovery_secs: cluster
            .last_migration_ms
            .map_or(0.0, |t| t.saturating_sub(first_spike_ms) as f64 / 1000.0),
        timed_out,
        choose_per_node: cluster
            .nodes
            .iter()
            .map(|n| n.balancer.stats().selections as f64)
            .sum::<f64>()
            / nodes,
        migrations_per_node: cluster
            .nodes
            .iter()
            .map(|n| n.migrations_in as f64)
            .sum::<f64>()
            / nodes,
        remigrated_processes: cluster.moves.values().filter(|&&m| m > 1).count() as u32,
        message_bytes: cluster.message_bytes,
        load_bytes_per_node_per_sec: cluster.bytes_sent as f64 / nodes / elapsed_secs.max(1e-9),
        mean_belief_age_secs: mean_sd(&cluster.belief_ages).0,
        mean_target_error: mean_sd(&cluster.target_errors).0,
        refused_offers: cluster.refused,
        timeline: cluster.timeline,
        final_spread: (counts.iter().max().copied().unwrap_or(0)
            - counts.iter().min().copied().unwrap_or(0)) as u32,
    })
}

impl Cluster<'_> {
    fn node(&mut self, id: NodeId) -> &mut SimNode {
        &mut self.nodes[id.0 as usize]
    }

    fn handle(&mut self, event: Event) -> Result<(), SimError> {
        let now = self.queue.now();
        match event {
            Event::Spike(u32::MAX) => {}
            Event::Observe => {
                let counts = self.nodes.iter().map(|n| n.processes.len());
                self.timeline.push(TimelinePoint {
                    secs: now.as_millis().saturating_sub(self.first_spike_ms) as f64 / 1000.0,
                    max_processes: counts.clone().max().unwrap_or(0),
                    min_processes: counts.min().unwrap_or(0),
                    migrations_so_far: self.migrations,
                });
                self.queue
                    .schedule_in(Duration::from_secs(1), Event::Observe);
            }
            Event::Spike(k) => {
                let id = self.params.spike_node(k);
                let count = self.params.processes_per_spike;
                let first = self.next_pid;
                self.next_pid += u64::from(count);
                let node = self.node(id);
                node.advance(now.as_millis());
                let clock = node.cpu_clock;
                node.processes
                    .extend((first..first + u64::from(count)).map(|pid| SimProcess {
                        pid: ProcessId(pid),
                        cpu_clock_at_arrival: clock,
                        arrived_ms: None,
                    }));
            }
            Event::Sample(id) => {
                let config = self.config.load.clone();
                let node = self.node(id);
                node.advance(now.as_millis());
                // One CPU per node: runnable processes per CPU is the mean
                // run-queue length over the second.
                let accumulated = node.runnable_integral;
                node.runnable_integral = 0.0;
                let local = node.local(now);
                node.load.record(local, accumulated, &config)?;
                self.queue
                    .schedule_in(Duration::from_secs(1), Event::Sample(id));
            }
            Event::Gossip(id) => {
                let config = self.config.load.clone();
                let mut rng = StdRng::seed_from_u64(self.rng.random());
                let node = self.node(id);
                node.advance(now.as_millis());
                let export = node.export_load(now, &config);
                let local = node.local(now);
                let out: Vec<Outgoing> = node.info.tick(local, export, &mut rng);
                for o in out {
                    self.bytes_sent += o.wire_bytes;
                    self.message_bytes = o.wire_bytes;
                    let latency = self.params.latency;
                    match o.to {
                        Destination::Node(to) => self.queue.schedule_in(
                            latency,
                            Event::Deliver {
                                to,
                                message: o.message,
                            },
                        ),
                        Destination::Broadcast => {
                            for to in 0..self.params.nodes {
                                if NodeId(to) != id {
                                    let message = o.message.clone();
                                    self.queue.schedule_in(
                                        latency,
                                        Event::Deliver {
                                            to: NodeId(to),
                                            message,
                                        },
                                    );
                                }
                            }
                        }
                    }
                }
                self.queue.schedule_in(
                    Duration::from_millis(self.config.information.period_ms),
                    Event::Gossip(id),
                );
            }
            Event::Deliver { to, message } => {
                let node = self.node(to);
                let local = node.local(now);
                node.info.receive(&message, local)?;
                self.consider_migrating(to)?;
            }
            Event::Dispatch { node, id, pid } => self.dispatch(node, id, pid)?,
            Event::Offer {
                to,
                offer,
                pid,
                rest,
            } => {
                let config = self.config.load.clone();
                let ferry = self.receiver_up_to_average;
                let node = self.node(to);
                node.advance(now.as_millis());
                let local = node.local(now);
                // ferry's receiver checks the offer against the load its
                // peers see of it (its export load), as fresh as it gets: the
                // sender compared that same figure, as old as gossip made it.
                let own = if ferry {
                    let load = node.export_load(now, &config);
                    let peers = node.info.peers(local);
                    ReceiverView {
                        load,
                        average: Some(approximate_average(load, &peers)),
                    }
                } else {
                    ReceiverView {
                        load: node.load.internal(),
                        average: None,
                    }
                };
                let answer = node.balancer.gate.on_offer_with(&offer, &own, local);
                let latency = self.params.latency;
                self.queue.schedule_in(
                    latency,
                    Event::Answer {
                        to: offer.from,
                        from: to,
                        id: offer.id,
                        answer,
                        pid,
                        rest,
                    },
                );
            }
            Event::Answer {
                to,
                from,
                id,
                answer,
                pid,
                mut rest,
            } => {
                let estimate = self
                    .params
                    .migration
                    .estimate(self.params.process_memory_bytes, 0);
                let load_config = self.config.load.clone();
                let node = self.node(to);
                node.balancer.gate.on_answer(id, answer)?;
                match answer {
                    Answer::Accept => {
                        let local = node.local(now);
                        node.balancer.promise(id, from, 1.0, local);
                        node.advance(now.as_millis());
                        let Some(index) = node.processes.iter().position(|p| p.pid == pid) else {
                            // Cannot happen while the gate holds the
                            // process, but a simulator must not panic on it.
                            node.balancer.gate.finish_outgoing(
                                id,
                                Outcome::Aborted,
                                node.local(now),
                            )?;
                            node.balancer
                                .settle_promise(id, Outcome::Aborted, node.local(now));
                            let peer = self.node(from);
                            peer.balancer.gate.finish_incoming(
                                id,
                                Outcome::Aborted,
                                peer.local(now),
                            )?;
                            return Ok(());
                        };
                        // Stop-and-copy: the process leaves the run queue
                        // for the whole transfer.
                        node.processes.remove(index);
                        let local = node.local(now);
                        node.load.departed(local, 1.0, &load_config);
                        self.queue.schedule_in(
                            estimate.total,
                            Event::Arrive {
                                from: to,
                                to: from,
                                id,
                                pid,
                            },
                        );
                    }
                    Answer::Refuse(_) => {
                        self.refused += 1;
                        if !rest.is_empty() {
                            let next = rest.remove(0);
                            let id = self.new_migration();
                            self.offer(to, id, next, pid, rest)?;
                        }
                    }
                }
            }
            Event::Arrive { from, to, id, pid } => {
                let load_config = self.config.load.clone();
                self.last_migration_ms = Some(now.as_millis());
                self.migrations += 1;
                *self.moves.entry(pid).or_default() += 1;
                let source = self.node(from);
                let local = source.local(now);
                source
                    .balancer
                    .gate
                    .finish_outgoing(id, Outcome::Committed, local)?;
                source
                    .balancer
                    .settle_promise(id, Outcome::Committed, local);
                let node = self.node(to);
                node.advance(now.as_millis());
                let clock = node.cpu_clock;
                node.processes.push(SimProcess {
                    pid,
                    cpu_clock_at_arrival: clock,
                    arrived_ms: Some(now.as_millis()),
                });
                let local = node.local(now);
                node.recent.note(local, pid);
                node.load.arrived(local, 1.0, &load_config);
                node.migrations_in += 1;
                node.balancer
                    .gate
                    .finish_incoming(id, Outcome::Committed, local)?;
                if self.config.transfer.replan_on_commit {
                    self.consider_migrating(from)?;
                }
            }
        }
        Ok(())
    }

    /// A load message arrived at `id`: openMosix re-runs its balancing
    /// (`choose()`), which marks a process for `consider()`.
    fn consider_migrating(&mut self, id: NodeId) -> Result<(), SimError> {
        let now = self.queue.now();
        let mut rng = StdRng::seed_from_u64(self.rng.random());
        let migration = self.new_migration();
        let slice = self.params.timeslice;
        let at_once = self.select_at_once;
        let node = self.node(id);
        node.advance(now.as_millis());
        let local = node.local(now);
        let peers = node.info.peers(local);
        let processes = node.process_loads(now.as_millis());
        let load = node.load.internal();
        let plan = node
            .balancer
            .plan(local, load, &peers, &processes, &mut rng);
        if let Plan::Push { pid, .. } = plan {
            node.balancer.gate.mark(migration, local)?;
            // Round robin among CPU-bound processes: the marked one runs
            // again after anywhere between 0 and n - 1 other slices.
            // ferryd freezes the process wherever it is: no wait.
            let others = node.processes.len().saturating_sub(1) as u32;
            let wait = if at_once {
                Duration::ZERO
            } else {
                slice * rng.random_range(0..=others)
            };
            self.queue.schedule_in(
                wait,
                Event::Dispatch {
                    node: id,
                    id: migration,
                    pid,
                },
            );
        }
        Ok(())
    }

    /// `consider()`: the marked process is about to run; pick its target
    /// from what the node knows now, or keep it if no node is better.
    fn dispatch(
        &mut self,
        id: NodeId,
        migration: MigrationId,
        pid: ProcessId,
    ) -> Result<(), SimError> {
        let now = self.queue.now();
        let mut rng = StdRng::seed_from_u64(self.rng.random());
        let node = self.node(id);
        node.advance(now.as_millis());
        let local = node.local(now);
        let peers = node.info.peers(local);
        let load = node.load.internal();
        let mut candidates = node.balancer.locate(local, load, &peers, 1.0, &mut rng);
        if candidates.is_empty() {
            node.balancer
                .gate
                .finish_outgoing(migration, Outcome::Aborted, local)?;
            return Ok(());
        }
        let target = candidates.remove(0);
        if let Some(belief) = peers.iter().find(|p| p.node == target) {
            self.belief_ages.push(belief.age.as_secs_f64());
            let real = self.nodes[target.0 as usize].processes.len() as f64;
            self.target_errors.push(real - belief.load);
        }
        self.offer(id, migration, target, pid, candidates)
    }

    fn new_migration(&mut self) -> MigrationId {
        self.next_migration += 1;
        MigrationId(self.next_migration)
    }

    fn offer(
        &mut self,
        from: NodeId,
        migration: MigrationId,
        to: NodeId,
        pid: ProcessId,
        rest: Vec<NodeId>,
    ) -> Result<(), SimError> {
        let now = self.queue.now();
        let node = self.node(from);
        let local = node.local(now);
        node.balancer.gate.begin_offer(migration, to, local)?;
        let offer = Offer {
            id: migration,
            from,
            sender_load: node.load.internal(),
            process_load: 1.0,
        };
        self.queue.schedule_in(
            self.params.latency,
            Event::Offer {
                to,
                offer,
                pid,
                rest,
            },
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests;
