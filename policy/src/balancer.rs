//! The conductor's decision step (Gerofi et al. (DVE)'s `cond`): transfer,
//! selection and location policies run together on one node's view.

use rand::RngCore;

use crate::config::Config;
use crate::location::{Direction, LocationPolicy, LocationQuery};
use crate::node::{NodeId, PeerLoad, ProcessId, approximate_average};
use crate::selection::{ProcessLoad, SelectionPolicy};
use crate::time::Instant;
use crate::transfer::{ClusterView, MigrationGate, Role, TransferPolicy};

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
        }
    }

    pub fn stats(&self) -> BalancerStats {
        self.stats
    }

    /// The location policy alone: where a process adding `process_load`
    /// should go, best first. [`Self::plan`] calls it; a caller that picks
    /// the destination later than the process (openMosix's `consider()`
    /// runs when the marked process is next scheduled) calls it again then.
    pub fn locate(
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
                let candidates = self.locate(local_load, peers, process_load, rng);
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
