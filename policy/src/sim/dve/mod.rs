//! Gerofi et al. (DVE)'s scenario (§VI-C, Fig. 5d-f), simulated with this
//! crate's policies: 5 server nodes, a 10x10 grid of zones, one zone server
//! process per zone, 20 per node at the start (node i serves rows 2i and 2i+1).
//! 10,000 clients start uniformly spread; over 15 minutes part of the clients
//! of the middle rows walk to the up-left and down-right corners. A zone
//! server's CPU grows in proportion to its clients.
//!
//! Balancing uses Gerofi et al. (DVE)'s policies end to end
//! ([`Config::default`]): threshold sender, mirror-of-the-average location,
//! closest-to-excess selection, broadcast heartbeat, two-phase commit,
//! calm-down. A migration's cost comes from [`MigrationCostModel`]: the zone
//! keeps running on the source while pre-copy rounds go out, and serves nobody
//! while frozen. Comparing a pre-copy mechanism with stop-and-copy shows what a
//! better mechanism buys: the same balance, far less frozen time.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::SimError;
use super::event::EventQueue;
use crate::balancer::{Balancer, Plan};
use crate::config::Config;
use crate::information::{Destination, InformationPolicy, LoadMessage};
use crate::load::{LoadConfig, NodeLoad, RecentArrivals};
use crate::location::{LocationConfig, LocationKind};
use crate::measured_cost::MeasuredCost;
use crate::migration_cost::{Mechanism, MigrationCostModel};
use crate::node::approximate_average;
use crate::node::{NodeId, ProcessId};
use crate::selection::{ProcessLoad, SelectionConfig};
use crate::time::Instant;
use crate::transfer::{
    Answer, MigrationId, Offer, Outcome, ReceiverView, TransferConfig, TransferMode,
};

mod clients;

pub use clients::Clients;

pub const GRID: usize = 10;

#[derive(Debug, Clone, Serialize)]
pub struct Params {
    pub nodes: usize,
    pub cores_per_node: f64,
    pub clients: usize,
    pub duration: Duration,
    /// Rows whose clients may walk to a corner: `[first, last]`.
    pub middle_rows: (usize, usize),
    /// Share of the middle rows' clients that walk.
    pub walker_fraction: f64,
    /// CPU (cores) one client costs its zone server.
    pub cores_per_client: f64,
    /// CPU (cores) of an empty zone server.
    pub cores_per_zone: f64,
    pub zone_memory_bytes: u64,
    pub memory_per_client_bytes: u64,
    /// Sampling interval of the reported time series.
    pub report_every: Duration,
    pub latency: Duration,
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            nodes: 5,
            // Gerofi et al. (DVE) §VI-A: dual-core Opterons.
            cores_per_node: 2.0,
            clients: 10_000,
            duration: Duration::from_secs(15 * 60),
            middle_rows: (3, 6),
            walker_fraction: 0.5,
            // 2,000 clients per node use 70% of it at the start.
            cores_per_client: 0.0007,
            cores_per_zone: 0.0,
            zone_memory_bytes: 64 << 20,
            memory_per_client_bytes: 16 << 10,
            report_every: Duration::from_secs(5),
            latency: Duration::from_millis(1),
            seed: 0,
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
        if self.nodes == 0 || self.nodes > GRID * GRID {
            return bad("nodes", "need 1 to 100 nodes");
        }
        if !self.cores_per_node.is_finite() || self.cores_per_node <= 0.0 {
            return bad("cores_per_node", "must be > 0");
        }
        if !(0.0..=1.0).contains(&self.walker_fraction) {
            return bad("walker_fraction", "must be in [0, 1]");
        }
        if self.middle_rows.0 > self.middle_rows.1 || self.middle_rows.1 >= GRID {
            return bad("middle_rows", "need first <= last < 10");
        }
        if self.report_every.is_zero() {
            return bad("report_every", "must be > 0");
        }
        Ok(())
    }

    /// The policy configuration in this scenario's load units (share of a
    /// node's CPUs): Gerofi et al. (DVE)'s policies, or ferry's.
    pub fn config(&self, policies: Policies) -> Config {
        let defaults = Config::default();
        let ferry = matches!(policies, Policies::Ferry | Policies::FerrySymmetric);
        let symmetric = policies == Policies::FerrySymmetric;
        Config {
            load: LoadConfig {
                decay: 0.5,
                stabilizer: 0.02,
                recent_arrival_ms: 10_000,
                process_table_weight: 0.0,
                process_table_size: 4096,
                follow_migrations: ferry,
            },
            transfer: TransferConfig {
                mode: if symmetric {
                    TransferMode::Symmetric
                } else {
                    TransferMode::SenderThreshold
                },
                threshold: 0.9,
                // ferry: a node above the average it knows sends; whether a
                // move helps is the location's and the receiver's call.
                average_gap: if symmetric {
                    0.05
                } else if ferry {
                    0.0
                } else {
                    0.1
                },
                calm_down_ms: 20_000,
                receiver_up_to_average: ferry,
                count_promised: ferry,
                replan_on_commit: ferry,
                ..defaults.transfer
            },
            location: LocationConfig {
                kind: if ferry {
                    LocationKind::LeastLoaded
                } else {
                    LocationKind::MirrorAverage
                },
            },
            selection: SelectionConfig {
                min_residency_ms: 30_000,
                rehop_residency_ms: if ferry { 30_000 } else { 0 },
                ..defaults.selection
            },
            ..defaults
        }
    }
}

/// Whose policies balance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Policies {
    /// Gerofi et al. (DVE) §IV: threshold sender (above 90 % or 10 points
    /// above the average), mirror-of-the-average location.
    GerofiEtAl,
    /// ferry's, as in `sim openmosix` ([`super::openmosix::FerryPart`]): a
    /// sender above the average it knows, least-loaded location (a move must
    /// lower the pair's maximum), the receiver up to the average, the load
    /// following migrations, promised load counted, no second hop within
    /// 30 s; the same calm-down and residency as Gerofi et al.
    Ferry,
    /// ferry's policies with symmetric transfer: a node more than 5 points
    /// below the average also asks the most loaded node it knows for a
    /// zone (`transfer.mode = "symmetric"`).
    FerrySymmetric,
}

/// A migration mechanism to compare.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct MechanismVariant {
    pub label: &'static str,
    pub cost: MigrationCostModel,
    pub policies: Policies,
}

impl MechanismVariant {
    /// The same mechanism balanced by other policies.
    pub fn with_policies(self, policies: Policies) -> Self {
        MechanismVariant { policies, ..self }
    }
}

/// ferry's pre-copy with incremental socket migration, at what ferry
/// measured (`cost`: [`crate::measured_cost::fit`] of the committed
/// freeze and memory results, incremental mode and pre-copy), over 1 Gb/s.
pub fn precopy_mechanism(cost: &MeasuredCost) -> MechanismVariant {
    MechanismVariant {
        label: "pre-copy",
        cost: MigrationCostModel {
            bandwidth_bytes_per_sec: 125_000_000.0,
            freeze_overhead: cost.fixed,
            per_connection: cost.per_connection,
            per_mib: cost.per_mib,
            mechanism: Mechanism::PreCopy {
                dirty_bytes_per_sec: 20_000_000.0,
                max_rounds: 8,
                stop_bytes: 2 << 20,
            },
        },
        policies: Policies::GerofiEtAl,
    }
}

/// A plain checkpoint/restore: freeze, dump everything, send, restore, at
/// what ferry measured of CRIU's own per-socket path (`cost`: the fit of
/// the freeze results' iterative mode), the memory over 1 Gb/s inside the
/// freeze.
pub fn stop_and_copy_mechanism(cost: &MeasuredCost) -> MechanismVariant {
    MechanismVariant {
        label: "stop-and-copy",
        cost: MigrationCostModel {
            bandwidth_bytes_per_sec: 125_000_000.0,
            freeze_overhead: cost.fixed,
            per_connection: cost.per_connection,
            per_mib: Duration::ZERO,
            mechanism: Mechanism::StopAndCopy,
        },
        policies: Policies::GerofiEtAl,
    }
}

/// One point of the time series.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub secs: f64,
    /// Per node: CPU utilisation (0..1, demand capped at capacity).
    pub utilisation: Vec<f64>,
    /// Per node: zone servers it runs (in flight excluded).
    pub zones: Vec<usize>,
}

#[derive(Debug, Clone, Serialize)]
pub struct DveRun {
    pub label: String,
    pub balancing: bool,
    pub samples: Vec<Sample>,
    pub migrations: u64,
    pub refused_offers: u64,
    /// Receiver-initiated pulls sent, and those answered with a zone.
    pub pulls: u64,
    pub pulls_given: u64,
    /// Sum of freeze times.
    pub frozen_secs: f64,
    pub max_freeze_ms: f64,
    /// Sum over migrations of clients x freeze: updates nobody got.
    pub client_frozen_secs: f64,
}

impl DveRun {
    /// Per node, mean utilisation over the samples at or after `from_secs`.
    pub fn mean_utilisation_from(&self, from_secs: f64) -> Vec<f64> {
        let tail: Vec<&Sample> = self
            .samples
            .iter()
            .filter(|s| s.secs >= from_secs)
            .collect();
        let nodes = self.samples.first().map_or(0, |s| s.utilisation.len());
        (0..nodes)
            .map(|n| tail.iter().map(|s| s.utilisation[n]).sum::<f64>() / tail.len().max(1) as f64)
            .collect()
    }

    /// Seconds during which some node was above 95% (sampled).
    pub fn secs_any_node_above(&self, threshold: f64, every: Duration) -> f64 {
        self.samples
            .iter()
            .filter(|s| s.utilisation.iter().any(|&u| u > threshold))
            .count() as f64
            * every.as_secs_f64()
    }
}

/// Balancing off, then on with each mechanism.
pub fn run_all(params: &Params, mechanisms: &[MechanismVariant]) -> Result<Vec<DveRun>, SimError> {
    params.validate()?;
    let mut out = vec![run(params, None)?];
    for m in mechanisms {
        out.push(run(params, Some(m))?);
    }
    Ok(out)
}

struct DveNode {
    zones: Vec<usize>,
    /// Zone -> when it arrived (for residency).
    arrived: Vec<(usize, Instant)>,
    load: NodeLoad,
    recent: RecentArrivals,
    info: Box<dyn InformationPolicy>,
    balancer: Balancer,
    /// The export load told at the last tick.
    export: f64,
}

enum Event {
    Clients,
    Tick(usize),
    /// Receiver-initiated: `from` asks the first of `to` for a zone.
    Pull {
        to: Vec<NodeId>,
        from: usize,
        from_load: f64,
    },
    Observe,
    Deliver {
        to: usize,
        message: LoadMessage,
    },
    Offer {
        to: usize,
        offer: Offer,
        zone: usize,
        rest: Vec<NodeId>,
    },
    Answer {
        to: usize,
        from: usize,
        id: MigrationId,
        answer: Answer,
        zone: usize,
        rest: Vec<NodeId>,
    },
    Freeze {
        from: usize,
        to: usize,
        id: MigrationId,
        zone: usize,
    },
    Arrive {
        from: usize,
        to: usize,
        id: MigrationId,
        zone: usize,
    },
}

struct World<'p> {
    params: &'p Params,
    config: Config,
    mechanism: Option<MechanismVariant>,
    nodes: Vec<DveNode>,
    clients_per_zone: Vec<u32>,
    queue: EventQueue<Event>,
    rng: StdRng,
    next_id: u64,
    result: DveRun,
}

fn run(params: &Params, mechanism: Option<&MechanismVariant>) -> Result<DveRun, SimError> {
    let config = params.config(mechanism.map_or(Policies::GerofiEtAl, |m| m.policies));
    config.validate()?;
    // The same clients in every variant: their generator is seeded alone.
    let clients = Clients::generate(params, params.seed);
    let members: Vec<NodeId> = (0..params.nodes as u32).map(NodeId).collect();
    let rows_per_node = GRID as f64 / params.nodes as f64;
    let nodes = (0..params.nodes)
        .map(|n| DveNode {
            zones: (0..GRID * GRID)
                .filter(|z| ((z / GRID) as f64 / rows_per_node) as usize == n)
                .collect(),
            arrived: Vec::new(),
            load: NodeLoad::new(),
            recent: RecentArrivals::default(),
            info: config.information.policy(NodeId(n as u32), &members),
            balancer: Balancer::new(&config),
            export: 0.0,
        })
        .collect();
    let label = match mechanism {
        None => "balancing off".to_string(),
        Some(m) => match m.policies {
            Policies::GerofiEtAl => format!("balancing on, {}", m.label),
            Policies::Ferry => format!("balancing on, {}, ferry's policies", m.label),
            Policies::FerrySymmetric => {
                format!("balancing on, {}, ferry's policies, symmetric", m.label)
            }
        },
    };
    let mut world = World {
        params,
        config,
        mechanism: mechanism.copied(),
        nodes,
        clients_per_zone: clients.per_zone(0.0),
        queue: EventQueue::default(),
        rng: StdRng::seed_from_u64(params.seed ^ 0x5eed),
        next_id: 0,
        result: DveRun {
            label,
            balancing: mechanism.is_some(),
            samples: Vec::new(),
            migrations: 0,
            refused_offers: 0,
            pulls: 0,
            pulls_given: 0,
            frozen_secs: 0.0,
            max_freeze_ms: 0.0,
            client_frozen_secs: 0.0,
        },
    };
    world.queue.schedule_at(Instant::ZERO, Event::Clients);
    world.queue.schedule_at(Instant::ZERO, Event::Observe);
    for n in 0..params.nodes {
        let phase = world.rng.random_range(0..1_000);
        world
            .queue
            .schedule_at(Instant::from_millis(phase), Event::Tick(n));
    }
    let end = params.duration.as_millis() as u64;
    while let Some(event) = world.queue.pop() {
        let now = world.queue.now();
        if now.as_millis() > end {
            break;
        }
        if let Event::Clients = event {
            world.clients_per_zone = clients.per_zone(now.as_millis() as f64 / 1000.0);
            world
                .queue
                .schedule_in(Duration::from_secs(1), Event::Clients);
            continue;
        }
        world.handle(event)?;
    }
    Ok(world.result)
}

impl World<'_> {
    fn zone_cores(&self, zone: usize) -> f64 {
        self.params.cores_per_zone
            + self.params.cores_per_client * f64::from(self.clients_per_zone[zone])
    }

    /// Demand of a node, in its load units (share of its CPUs).
    fn node_load(&self, n: usize) -> f64 {
        self.nodes[n]
            .zones
            .iter()
            .map(|&z| self.zone_cores(z))
            .sum::<f64>()
            / self.params.cores_per_node
    }

    fn zone_memory(&self, zone: usize) -> u64 {
        self.params.zone_memory_bytes
            + self.params.memory_per_client_bytes * u64::from(self.clients_per_zone[zone])
    }

    fn handle(&mut self, event: Event) -> Result<(), SimError> {
        let now = self.queue.now();
        let latency = self.params.latency;
        match event {
            Event::Clients => {}
            Event::Observe => {
                let utilisation = (0..self.nodes.len())
                    .map(|n| self.node_load(n).min(1.0))
                    .collect();
                let zones = self.nodes.iter().map(|n| n.zones.len()).collect();
                self.result.samples.push(Sample {
                    secs: now.as_millis() as f64 / 1000.0,
                    utilisation,
                    zones,
                });
                self.queue
                    .schedule_in(self.params.report_every, Event::Observe);
            }
            Event::Tick(n) => {
                self.queue
                    .schedule_in(Duration::from_secs(1), Event::Tick(n));
                if self.mechanism.is_none() {
                    return Ok(());
                }
                let demand = self.node_load(n);
                let window = Duration::from_millis(self.config.load.recent_arrival_ms);
                let recent: Vec<ProcessId> = self.nodes[n].recent.recent(now, window).collect();
                let recent_load: f64 = recent
                    .iter()
                    .filter(|pid| self.nodes[n].zones.contains(&(pid.0 as usize)))
                    .map(|pid| self.zone_cores(pid.0 as usize) / self.params.cores_per_node)
                    .sum();
                let mut rng = StdRng::seed_from_u64(self.rng.random());
                let config = self.config.load.clone();
                let node = &mut self.nodes[n];
                node.load.record(now, demand, &config)?;
                let export = node.load.export(recent_load, node.zones.len(), &config);
                node.export = export;
                for o in node.info.tick(now, export, &mut rng) {
                    if let Destination::Broadcast = o.to {
                        for to in (0..self.params.nodes).filter(|&to| to != n) {
                            self.queue.schedule_in(
                                latency,
                                Event::Deliver {
                                    to,
                                    message: o.message.clone(),
                                },
                            );
                        }
                    } else if let Destination::Node(to) = o.to {
                        self.queue.schedule_in(
                            latency,
                            Event::Deliver {
                                to: to.0 as usize,
                                message: o.message,
                            },
                        );
                    }
                }
                self.conduct(n, &mut rng)?;
            }
            Event::Deliver { to, message } => self.nodes[to].info.receive(&message, now)?,
            Event::Pull {
                to,
                from,
                from_load,
            } => {
                let mut rng = StdRng::seed_from_u64(self.rng.random());
                self.pull(to, from, from_load, &mut rng)?;
            }
            Event::Offer {
                to,
                offer,
                zone,
                rest,
            } => {
                // ferry's receiver compares what its peers see of it (its
                // last export load) with the average it knows.
                let node = &self.nodes[to];
                let view = if self.config.transfer.receiver_up_to_average {
                    ReceiverView {
                        load: node.export,
                        average: Some(approximate_average(node.export, &node.info.peers(now))),
                    }
                } else {
                    ReceiverView {
                        load: node.load.internal(),
                        average: None,
                    }
                };
                let answer = self.nodes[to]
                    .balancer
                    .gate
                    .on_offer_with(&offer, &view, now);
                let from = offer.from.0 as usize;
                self.queue.schedule_in(
                    latency,
                    Event::Answer {
                        to: from,
                        from: to,
                        id: offer.id,
                        answer,
                        zone,
                        rest,
                    },
                );
            }
            Event::Answer {
                to,
                from,
                id,
                answer,
                zone,
                mut rest,
            } => {
                self.nodes[to].balancer.gate.on_answer(id, answer)?;
                match answer {
                    Answer::Accept => {
                        let Some(mechanism) = self.mechanism else {
                            return Ok(());
                        };
                        let zone_load = self.zone_cores(zone) / self.params.cores_per_node;
                        self.nodes[to]
                            .balancer
                            .promise(id, NodeId(from as u32), zone_load, now);
                        let times = mechanism
                            .cost
                            .estimate(self.zone_memory(zone), self.clients_per_zone[zone]);
                        // Pre-copy rounds run while the zone keeps serving.
                        self.queue.schedule_in(
                            times.preparation,
                            Event::Freeze {
                                from: to,
                                to: from,
                                id,
                                zone,
                            },
                        );
                    }
                    Answer::Refuse(_) => {
                        self.result.refused_offers += 1;
                        if !rest.is_empty() {
                            let next = rest.remove(0);
                            self.offer(to, next, zone, rest)?;
                        }
                    }
                }
            }
            Event::Freeze { from, to, id, zone } => {
                let Some(mechanism) = self.mechanism else {
                    return Ok(());
                };
                let clients = self.clients_per_zone[zone];
                let times = mechanism.cost.estimate(self.zone_memory(zone), clients);
                let zone_load = self.zone_cores(zone) / self.params.cores_per_node;
                self.nodes[from].zones.retain(|&z| z != zone);
                self.nodes[from].arrived.retain(|&(z, _)| z != zone);
                self.nodes[from]
                    .load
                    .departed(now, zone_load, &self.config.load);
                let downtime = times.downtime.as_secs_f64();
                self.result.frozen_secs += downtime;
                self.result.max_freeze_ms = self.result.max_freeze_ms.max(downtime * 1000.0);
                self.result.client_frozen_secs += downtime * f64::from(clients);
                self.queue
                    .schedule_in(times.downtime, Event::Arrive { from, to, id, zone });
            }
            Event::Arrive { from, to, id, zone } => {
                self.result.migrations += 1;
                self.nodes[from]
                    .balancer
                    .gate
                    .finish_outgoing(id, Outcome::Committed, now)?;
                self.nodes[from]
                    .balancer
                    .settle_promise(id, Outcome::Committed, now);
                let zone_load = self.zone_cores(zone) / self.params.cores_per_node;
                let node = &mut self.nodes[to];
                node.load.arrived(now, zone_load, &self.config.load);
                node.zones.push(zone);
                node.arrived.push((zone, now));
                node.recent.note(now, ProcessId(zone as u64));
                node.balancer
                    .gate
                    .finish_incoming(id, Outcome::Committed, now)?;
            }
        }
        Ok(())
    }

    /// Gerofi et al. (DVE)'s conductor step on node `n`.
    fn conduct(&mut self, n: usize, rng: &mut StdRng) -> Result<(), SimError> {
        let now = self.queue.now();
        let processes = self.processes(n);
        let node = &mut self.nodes[n];
        let peers = node.info.peers(now);
        let load = node.load.internal();
        match node.balancer.plan(now, load, &peers, &processes, rng) {
            Plan::Push {
                pid,
                mut candidates,
                ..
            } => {
                let to = candidates.remove(0);
                self.offer(n, to, pid.0 as usize, candidates)?;
            }
            Plan::Pull { candidates, .. } => {
                self.result.pulls += 1;
                self.queue.schedule_in(
                    self.params.latency,
                    Event::Pull {
                        to: candidates,
                        from: n,
                        from_load: load,
                    },
                );
            }
            Plan::Idle(_) => {}
        }
        Ok(())
    }

    /// A receiver-initiated pull reached the first of `to`: it gives what
    /// [`Balancer::give`] picks (ferryd's conductor answers a pull with the
    /// same call), else the next is asked.
    fn pull(
        &mut self,
        mut to: Vec<NodeId>,
        from: usize,
        from_load: f64,
        rng: &mut StdRng,
    ) -> Result<(), SimError> {
        if to.is_empty() {
            return Ok(());
        }
        let giver = to.remove(0).0 as usize;
        let now = self.queue.now();
        let processes = self.processes(giver);
        let node = &self.nodes[giver];
        let own = node.load.internal();
        let can = node.balancer.gate.can_send(now);
        let pick = node.balancer.give(&processes, own, from_load, rng);
        match pick {
            Some((pid, _)) if can => {
                self.result.pulls_given += 1;
                self.offer(giver, NodeId(from as u32), pid.0 as usize, Vec::new())
            }
            _ => {
                if !to.is_empty() {
                    self.queue.schedule_in(
                        self.params.latency,
                        Event::Pull {
                            to,
                            from,
                            from_load,
                        },
                    );
                }
                Ok(())
            }
        }
    }

    /// Node `n`'s zone servers as the selection policy sees them.
    fn processes(&self, n: usize) -> Vec<ProcessLoad> {
        let now = self.queue.now();
        let start = Instant::ZERO;
        self.nodes[n]
            .zones
            .iter()
            .map(|&z| {
                let since = self.nodes[n]
                    .arrived
                    .iter()
                    .find(|&&(a, _)| a == z)
                    .map_or(start, |&(_, at)| at);
                ProcessLoad {
                    pid: ProcessId(z as u64),
                    load: self.zone_cores(z) / self.params.cores_per_node,
                    // Zones that never moved have run here since before
                    // the experiment.
                    resident_for: now.saturating_duration_since(since)
                        + if since == start {
                            Duration::from_secs(3600)
                        } else {
                            Duration::ZERO
                        },
                    migratable: true,
                    since_arrival: (since != start).then(|| now.saturating_duration_since(since)),
                }
            })
            .collect()
    }

    fn offer(
        &mut self,
        from: usize,
        to: NodeId,
        zone: usize,
        rest: Vec<NodeId>,
    ) -> Result<(), SimError> {
        let now = self.queue.now();
        self.next_id += 1;
        let id = MigrationId(self.next_id);
        let process_load = self.zone_cores(zone) / self.params.cores_per_node;
        let node = &mut self.nodes[from];
        node.balancer.gate.begin_offer(id, to, now)?;
        let offer = Offer {
            id,
            from: NodeId(from as u32),
            sender_load: node.load.internal(),
            process_load,
        };
        self.queue.schedule_in(
            self.params.latency,
            Event::Offer {
                to: to.0 as usize,
                offer,
                zone,
                rest,
            },
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests;
