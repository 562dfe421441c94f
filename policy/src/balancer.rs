//! The conductor's decision step (Gerofi et al. (DVE)'s `cond`): transfer,
//! selection and location policies run together on one node's view.

use std::borrow::Cow;
use std::time::Duration;

use rand::RngCore;

use crate::config::Config;
use crate::location::{Direction, LocationPolicy, LocationQuery};
use crate::node::{NodeId, PeerLoad, ProcessId, approximate_average};
use crate::selection::{ProcessLoad, SelectionPolicy};
use crate::time::Instant;
use crate::transfer::{ClusterView, MigrationGate, MigrationId, Outcome, Role, TransferPolicy};

/// How long a kept promise counts at most: beliefs older than this are gone
/// from every information policy's view anyway (`information.max_age_ms` is
/// 10 s by default).
const PROMISE_MEMORY: Duration = Duration::from_secs(60);

/// Load this node moved (or is moving) to a peer
/// ([`crate::transfer::TransferConfig::count_promised`]).
#[derive(Debug, Clone, Copy)]
struct Promise {
    id: MigrationId,
    to: NodeId,
    load: f64,
    /// When the peer took it: news of the peer made after this includes it.
    at: Instant,
    /// Still in flight: counts whatever the news's age.
    open: bool,
}

/// What the node should do now.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Offer `pid` to the candidates in order until one accepts.
    Push {
        pid: ProcessId,
        process_load: f64,
        candidates: Vec<NodeId>,
    },
    /// Ask the candidates, in order, to push a process here.
    Pull {
        deficit: f64,
        candidates: Vec<NodeId>,
    },
    Idle(IdleReason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleReason {
    /// The transfer policy sees no reason to move anything.
    Balanced,
    /// A migration out of this node is already under way.
    OutgoingBusy,
    CalmingDown,
    /// Overloaded, but no process is eligible.
    NoEligibleProcess,
    /// Overloaded, but no known node qualifies as a destination.
    NoDestination,
    /// Underloaded, but a migration to this node is reserved already: a
    /// pull now would only have its giver's offer refused as busy.
    IncomingBusy,
}

/// How often each step ran, for operators and the simulator
/// (Meehan & Wynne (openMosix) §3.2 count `choose()` runs: here, `selections`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BalancerStats {
    /// The transfer policy made this node a sender.
    pub sender_decisions: u64,
    /// The selection policy ran (openMosix's `choose()`), including runs
    /// cut short because a migration was already under way.
    pub selections: u64,
    pub pushes: u64,
    pub pulls: u64,
}

/// One node's policies and migration gate.
#[derive(Debug)]
pub struct Balancer {
    transfer: Box<dyn TransferPolicy>,
    location: Box<dyn LocationPolicy>,
    selection: Box<dyn SelectionPolicy>,
    pub gate: MigrationGate,
    stats: BalancerStats,
    count_promised: bool,
    promises: Vec<Promise>,
}

impl Balancer {
    /// Builds from a configuration that [`Config::validate`] accepted.
    pub fn new(config: &Config) -> Self {
        Balancer {
            transfer: config.transfer.policy(),
            location: config.location.policy(),
            selection: config.selection.policy(),
            gate: config.transfer.gate(),
            stats: BalancerStats::default(),
            count_promised: config.transfer.count_promised,
            promises: Vec::new(),
        }
    }

    /// `to` accepted migration `id` of a process adding `load`: until news
    /// of `to` is younger than the move, this node believes `to` that much
    /// busier (when `transfer.count_promised` is on).
    pub fn promise(&mut self, id: MigrationId, to: NodeId, load: f64, now: Instant) {
        if !self.count_promised || !load.is_finite() {
            return;
        }
        self.promises
            .retain(|p| p.open || now.saturating_duration_since(p.at) < PROMISE_MEMORY);
        self.promises.push(Promise {
            id,
            to,
            load,
            at: now,
            open: true,
        });
    }

    /// How migration `id` ended: committed, the promise counts until news
    /// of the receiver made after `now`; aborted, it is void.
    pub fn settle_promise(&mut self, id: MigrationId, outcome: Outcome, now: Instant) {
        match outcome {
            Outcome::Aborted => self.promises.retain(|p| p.id != id),
            Outcome::Committed => {
                for p in self.promises.iter_mut().filter(|p| p.id == id) {
                    p.at = now;
                    p.open = false;
                }
            }
        }
    }

    /// The peers as this node believes them, its own promises counted.
    pub fn believed<'a>(&self, now: Instant, peers: &'a [PeerLoad]) -> Cow<'a, [PeerLoad]> {
        if self.promises.is_empty() {
            return Cow::Borrowed(peers);
        }
        Cow::Owned(
            peers
                .iter()
                .map(|peer| {
                    // The news was made `age` ago, by this node's clock.
                    let news_at = now.saturating_sub(peer.age);
                    let promised: f64 = self
                        .promises
                        .iter()
                        .filter(|p| p.to == peer.node && (p.open || p.at >= news_at))
                        .map(|p| p.load)
                        .sum();
                    PeerLoad {
                        load: peer.load + promised,
                        ..*peer
                    }
                })
                .collect(),
        )
    }

    pub fn stats(&self) -> BalancerStats {
        self.stats
    }

    /// The loaded node's answer to a pull (receiver-initiated transfer):
    /// the process closest to half the gap between the two loads (the move
    /// that evens the pair), if moving it lowers the larger of the two;
    /// `None` otherwise. The caller checks the gate (calm-down, a move under
    /// way) first. Returns the process and its load.
    pub fn give(
        &self,
        processes: &[ProcessLoad],
        own_load: f64,
        requester_load: f64,
        rng: &mut dyn RngCore,
    ) -> Option<(ProcessId, f64)> {
        let half_gap = ((own_load - requester_load) / 2.0).max(0.0);
        let pid = self.selection.select(processes, half_gap, rng)?;
        let load = processes.iter().find(|p| p.pid == pid)?.load;
        (load > 0.0 && requester_load + load < own_load).then_some((pid, load))
    }

    /// The location policy alone: where a process adding `process_load`
    /// should go, best first. [`Self::plan`] calls it; a caller that picks
    /// the destination later than the process (openMosix's `consider()`
    /// runs when the marked process is next scheduled) calls it again then.
    pub fn locate(
        &self,
        now: Instant,
        local_load: f64,
        peers: &[PeerLoad],
        process_load: f64,
        rng: &mut dyn RngCore,
    ) -> Vec<NodeId> {
        self.rank_push(local_load, &self.believed(now, peers), process_load, rng)
    }

    /// [`Self::locate`] on peers already as believed.
    fn rank_push(
        &self,
        local_load: f64,
        peers: &[PeerLoad],
        process_load: f64,
        rng: &mut dyn RngCore,
    ) -> Vec<NodeId> {
        let query = LocationQuery {
            direction: Direction::Push,
            local_load,
            average: approximate_average(local_load, peers),
            process_load,
            peers,
        };
        self.location.rank(&query, rng)
    }

    /// Decides on this node's next move from its load, its view of the
    /// peers and its processes. Starts nothing: the caller offers (through
    /// [`MigrationGate::begin_offer`]) and migrates.
    pub fn plan(
        &mut self,
        now: Instant,
        local_load: f64,
        peers: &[PeerLoad],
        processes: &[ProcessLoad],
        rng: &mut dyn RngCore,
    ) -> Plan {
        let believed = self.believed(now, peers);
        let peers = &*believed;
        let view = ClusterView {
            local_load,
            average: approximate_average(local_load, peers),
            min_peer_load: peers.iter().map(|p| p.load).min_by(f64::total_cmp),
            max_peer_load: peers.iter().map(|p| p.load).max_by(f64::total_cmp),
        };
        match self.transfer.role(&view) {
            Role::Neither => Plan::Idle(IdleReason::Balanced),
            Role::Sender { excess } => {
                self.stats.sender_decisions += 1;
                if self.gate.calming_down(now) {
                    return Plan::Idle(IdleReason::CalmingDown);
                }
                // openMosix runs choose() and aborts it on finding a process
                // already selected: counted, as Meehan & Wynne (openMosix)
                // count it.
                self.stats.selections += 1;
                if !self.gate.can_send(now) {
                    return Plan::Idle(IdleReason::OutgoingBusy);
                }
                let Some(pid) = self.selection.select(processes, excess, rng) else {
                    return Plan::Idle(IdleReason::NoEligibleProcess);
                };
                let process_load = processes
                    .iter()
                    .find(|p| p.pid == pid)
                    .map_or(0.0, |p| p.load);
                let candidates = self.rank_push(local_load, peers, process_load, rng);
                if candidates.is_empty() {
                    return Plan::Idle(IdleReason::NoDestination);
                }
                self.stats.pushes += 1;
                Plan::Push {
                    pid,
                    process_load,
                    candidates,
                }
            }
            Role::Receiver { deficit } => {
                if !self.gate.can_send(now) {
                    return Plan::Idle(IdleReason::CalmingDown);
                }
                if self.gate.incoming().is_some() {
                    return Plan::Idle(IdleReason::IncomingBusy);
                }
                let query = LocationQuery {
                    direction: Direction::Pull,
                    local_load,
                    average: view.average,
                    process_load: deficit,
                    peers,
                };
                let candidates = self.location.rank(&query, rng);
                if candidates.is_empty() {
                    return Plan::Idle(IdleReason::NoDestination);
                }
                self.stats.pulls += 1;
                Plan::Pull {
                    deficit,
                    candidates,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;
    use crate::transfer::{Answer, MigrationId, Outcome};

    fn peers(loads: &[f64]) -> Vec<PeerLoad> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &load)| PeerLoad {
                node: NodeId(i as u32 + 1),
                load,
                age: Duration::ZERO,
            })
            .collect()
    }

    fn procs(loads: &[f64]) -> Vec<ProcessLoad> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &load)| ProcessLoad {
                pid: ProcessId(i as u64),
                load,
                resident_for: Duration::from_secs(100),
                migratable: true,
                since_arrival: None,
            })
            .collect()
    }

    #[test]
    fn seed_000_policies_together() {
        let mut b = Balancer::new(&Config::default());
        let mut rng = StdRng::seed_from_u64(1);
        // Average of 1.0, 0.2, 0.6 is 0.6: 0.4 above, the mirror is 0.2.
        let plan = b.plan(
            Instant::ZERO,
            1.0,
            &peers(&[0.2, 0.6]),
            &procs(&[0.1, 0.38, 0.7]),
            &mut rng,
        );
        assert_eq!(
            plan,
            Plan::Push {
                pid: ProcessId(1),
                process_load: 0.38,
                candidates: vec![NodeId(1)]
            }
        );
        let plan = b.plan(
            Instant::ZERO,
            0.5,
            &peers(&[0.45, 0.55]),
            &procs(&[0.1]),
            &mut rng,
        );
        assert_eq!(plan, Plan::Idle(IdleReason::Balanced));
    }

    #[test]
    fn receiver_initiated_pulls_from_the_heaviest() {
        let config = Config {
            transfer: crate::transfer::TransferConfig {
                mode: crate::transfer::TransferMode::ReceiverInitiated,
                ..Default::default()
            },
            ..Config::default()
        };
        let mut b = Balancer::new(&config);
        let plan = b.plan(
            Instant::ZERO,
            0.1,
            &peers(&[0.9, 0.5]),
            &[],
            &mut StdRng::seed_from_u64(0),
        );
        assert!(matches!(plan, Plan::Pull { ref candidates, .. } if candidates == &[NodeId(1)]));
        // With a migration to it reserved (the giver answered an earlier
        // pull), it waits for that one: another pull would only have its
        // giver's offer refused as busy.
        let offer = crate::transfer::Offer {
            id: MigrationId(7),
            from: NodeId(1),
            sender_load: 0.9,
            process_load: 0.2,
        };
        assert!(matches!(
            b.gate.on_offer(&offer, 0.1, Instant::ZERO),
            crate::transfer::Answer::Accept
        ));
        let plan = b.plan(
            Instant::ZERO,
            0.1,
            &peers(&[0.9, 0.5]),
            &[],
            &mut StdRng::seed_from_u64(0),
        );
        assert_eq!(plan, Plan::Idle(IdleReason::IncomingBusy));
    }

    #[test]
    fn a_pull_gets_the_process_that_evens_the_pair_if_it_helps() {
        let b = Balancer::new(&Config::default());
        let mut rng = StdRng::seed_from_u64(0);
        let ps = procs(&[0.1, 0.4, 0.9]);
        // 1.4 against 0.6: half the gap is 0.4.
        assert_eq!(b.give(&ps, 1.4, 0.6, &mut rng), Some((ProcessId(1), 0.4)));
        // 1.0 against 0.7: the closest (0.1) still helps.
        assert_eq!(b.give(&ps, 1.0, 0.7, &mut rng), Some((ProcessId(0), 0.1)));
        // The asker is not lighter by more than any process.
        assert_eq!(b.give(&ps, 1.0, 0.95, &mut rng), None);
        assert_eq!(b.give(&[], 5.0, 0.0, &mut rng), None);
    }

    #[test]
    fn a_sender_counts_what_it_promised_until_newer_news() {
        let config = Config {
            transfer: crate::transfer::TransferConfig {
                count_promised: true,
                ..Default::default()
            },
            ..Config::default()
        };
        let mut b = Balancer::new(&config);
        let at = |s: u64| Instant::from_millis(s * 1000);
        let news = |load, age_s| {
            vec![PeerLoad {
                node: NodeId(1),
                load,
                age: Duration::from_secs(age_s),
            }]
        };
        b.promise(MigrationId(7), NodeId(1), 0.5, at(10));
        // In flight: counted whatever the news's age.
        assert_eq!(b.believed(at(11), &news(0.25, 0)).to_vec()[0].load, 0.75);
        b.settle_promise(MigrationId(7), Outcome::Committed, at(12));
        // News from before the commit does not include the move...
        assert_eq!(b.believed(at(13), &news(0.25, 2)).to_vec()[0].load, 0.75);
        // ... news made after it does.
        assert_eq!(b.believed(at(13), &news(0.75, 0)).to_vec()[0].load, 0.75);
        // Another peer is untouched; an aborted move is void.
        let other = [PeerLoad {
            node: NodeId(2),
            load: 0.1,
            age: Duration::ZERO,
        }];
        assert_eq!(b.believed(at(13), &other).to_vec()[0].load, 0.1);
        b.promise(MigrationId(8), NodeId(2), 0.5, at(14));
        b.settle_promise(MigrationId(8), Outcome::Aborted, at(15));
        assert_eq!(b.believed(at(15), &other).to_vec()[0].load, 0.1);
        // Off by default (Gerofi et al. (DVE)'s policies have no such ledger).
        let mut plain = Balancer::new(&Config::default());
        plain.promise(MigrationId(9), NodeId(1), 0.5, at(10));
        assert_eq!(
            plain.believed(at(11), &news(0.25, 0)).to_vec()[0].load,
            0.25
        );
    }

    proptest! {
        /// No migration starts during the calm-down period after one was
        /// committed, however overloaded the node is.
        #[test]
        fn no_migration_during_calm_down(local in 0.0f64..5.0, loads in proptest::collection::vec(0.0f64..5.0, 1..10), wait_ms in 0u64..20_000) {
            let config = Config::default();
            let calm = config.transfer.calm_down_ms;
            let mut b = Balancer::new(&config);
            let mut rng = StdRng::seed_from_u64(0);
            b.gate.begin_offer(MigrationId(1), NodeId(1), Instant::ZERO).unwrap();
            b.gate.on_answer(MigrationId(1), Answer::Accept).unwrap();
            b.gate.finish_outgoing(MigrationId(1), Outcome::Committed, Instant::ZERO).unwrap();
            let now = Instant::from_millis(wait_ms);
            let plan = b.plan(now, local, &peers(&loads), &procs(&[0.2, 0.5, 1.0]), &mut rng);
            if wait_ms < calm {
                prop_assert!(matches!(plan, Plan::Idle(IdleReason::CalmingDown | IdleReason::Balanced)));
            }
        }

        /// A push only ever names a process this node has, and destinations
        /// below the average (Gerofi et al. (DVE)'s location policy).
        #[test]
        fn push_names_own_process_and_lighter_nodes(local in 0.0f64..5.0, loads in proptest::collection::vec(0.0f64..5.0, 1..10), ps in proptest::collection::vec(0.01f64..2.0, 1..10)) {
            let mut b = Balancer::new(&Config::default());
            let p = peers(&loads);
            let avg = approximate_average(local, &p);
            if let Plan::Push { pid, candidates, .. } = b.plan(Instant::ZERO, local, &p, &procs(&ps), &mut StdRng::seed_from_u64(0)) {
                prop_assert!((pid.0 as usize) < ps.len());
                for c in candidates {
                    prop_assert!(p.iter().any(|x| x.node == c && x.load < avg));
                }
            }
        }
    }
}
