//! Selection policy: which process an overloaded node sends away.
//!
//! - [`ClosestToExcess`], Gerofi et al. (DVE) §IV-C: the process whose CPU use
//!   is closest to the local node's excess over the approximated average, so
//!   that sender and receiver both end near the average.
//! - [`RandomProcess`]: any eligible process, for comparison.
//!
//! Both honour openMosix's eligibility rules (Meehan & Wynne (openMosix) §3): a
//! process that is locked, being transferred, or has not yet reached residency
//! on this node (run long enough here to pay for the move) is not a candidate.
//! ferry adds a second residency for processes that came by migration
//! (`rehop_residency_ms`): a process that just arrived does not hop on. In
//! Meehan & Wynne (openMosix)'s experiment most of openMosix's excess
//! migrations are such second hops: a process lands on a moderately loaded
//! node that soon looks heavy and is passed on (docs/simulation.md).

use std::fmt;
use std::time::Duration;

use rand::RngCore;
use rand::seq::IndexedRandom;
use serde::{Deserialize, Serialize};

use crate::node::ProcessId;

/// A process as the selection policy sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessLoad {
    pub pid: ProcessId,
    /// What the process adds to its node's load (load units).
    pub load: f64,
    /// How long it has been resident on this node: wall time, or CPU time
    /// as openMosix counts it; the caller decides and says which.
    pub resident_for: Duration,
    /// False if locked by the operator or already in flight.
    pub migratable: bool,
    /// Wall time since it arrived here by migration; `None` if it started
    /// here (or arrived before anything here kept count).
    pub since_arrival: Option<Duration>,
}

pub trait SelectionPolicy: fmt::Debug + Send + Sync {
    fn select(
        &self,
        processes: &[ProcessLoad],
        excess: f64,
        rng: &mut dyn RngCore,
    ) -> Option<ProcessId>;
}

/// Which selection policy runs (`selection.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SelectionKind {
    ClosestToExcess,
    Random,
}

/// `[selection]` in ferryd's TOML.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SelectionConfig {
    pub kind: SelectionKind,
    /// Residency a process needs before it may move again.
    pub min_residency_ms: u64,
    /// A process that arrived by migration stays at least this long (wall
    /// time) before it may move on: no second hop while the cluster is still
    /// settling from the first. 0: no such rule (openMosix, Gerofi et al.).
    pub rehop_residency_ms: u64,
}

impl Default for SelectionConfig {
    fn default() -> Self {
        SelectionConfig {
            kind: SelectionKind::ClosestToExcess,
            min_residency_ms: 0,
            rehop_residency_ms: 0,
        }
    }
}

impl SelectionConfig {
    pub fn policy(&self) -> Box<dyn SelectionPolicy> {
        let rules = Eligibility {
            min_residency: Duration::from_millis(self.min_residency_ms),
            rehop_residency: Duration::from_millis(self.rehop_residency_ms),
        };
        match self.kind {
            SelectionKind::ClosestToExcess => Box::new(ClosestToExcess { rules }),
            SelectionKind::Random => Box::new(RandomProcess { rules }),
        }
    }
}

/// Which processes may move at all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Eligibility {
    /// Residency on this node, as the caller counts it (see
    /// [`ProcessLoad::resident_for`]).
    pub min_residency: Duration,
    /// Wall time since a migration brought it here.
    pub rehop_residency: Duration,
}

impl Eligibility {
    pub fn admits(&self, p: &ProcessLoad) -> bool {
        p.migratable
            && p.resident_for >= self.min_residency
            && p.since_arrival
                .is_none_or(|since| since >= self.rehop_residency)
            && p.load.is_finite()
    }
}

/// Gerofi et al. (DVE) §IV-C.
#[derive(Debug, Clone, Copy)]
pub struct ClosestToExcess {
    pub rules: Eligibility,
}

impl SelectionPolicy for ClosestToExcess {
    fn select(
        &self,
        processes: &[ProcessLoad],
        excess: f64,
        _rng: &mut dyn RngCore,
    ) -> Option<ProcessId> {
        processes
            .iter()
            .filter(|p| self.rules.admits(p))
            .min_by(|a, b| {
                (a.load - excess)
                    .abs()
                    .total_cmp(&(b.load - excess).abs())
                    .then(a.pid.cmp(&b.pid))
            })
            .map(|p| p.pid)
    }
}

/// Any eligible process.
#[derive(Debug, Clone, Copy)]
pub struct RandomProcess {
    pub rules: Eligibility,
}

impl SelectionPolicy for RandomProcess {
    fn select(
        &self,
        processes: &[ProcessLoad],
        _excess: f64,
        rng: &mut dyn RngCore,
    ) -> Option<ProcessId> {
        let candidates: Vec<&ProcessLoad> =
            processes.iter().filter(|p| self.rules.admits(p)).collect();
        candidates.choose(rng).map(|p| p.pid)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    fn proc(pid: u64, load: f64) -> ProcessLoad {
        ProcessLoad {
            pid: ProcessId(pid),
            load,
            resident_for: Duration::from_secs(60),
            migratable: true,
            since_arrival: None,
        }
    }

    fn residency(min: u64) -> Eligibility {
        Eligibility {
            min_residency: Duration::from_secs(min),
            rehop_residency: Duration::ZERO,
        }
    }

    #[test]
    fn picks_the_process_closest_to_the_excess() {
        let ps = [proc(1, 0.05), proc(2, 0.2), proc(3, 0.5)];
        let policy = ClosestToExcess {
            rules: residency(0),
        };
        let mut rng = StdRng::seed_from_u64(0);
        assert_eq!(policy.select(&ps, 0.25, &mut rng), Some(ProcessId(2)));
        assert_eq!(policy.select(&ps, 5.0, &mut rng), Some(ProcessId(3)));
        assert_eq!(policy.select(&ps, 0.0, &mut rng), Some(ProcessId(1)));
    }

    #[test]
    fn skips_locked_in_flight_and_new_processes() {
        let policy = ClosestToExcess {
            rules: residency(2),
        };
        let mut rng = StdRng::seed_from_u64(0);
        let locked = ProcessLoad {
            migratable: false,
            ..proc(1, 0.3)
        };
        let fresh = ProcessLoad {
            resident_for: Duration::from_secs(1),
            ..proc(2, 0.3)
        };
        assert_eq!(policy.select(&[locked, fresh], 0.3, &mut rng), None);
        assert_eq!(
            policy.select(&[locked, fresh, proc(3, 0.9)], 0.3, &mut rng),
            Some(ProcessId(3))
        );
        let random = RandomProcess {
            rules: residency(2),
        };
        assert_eq!(random.select(&[locked, fresh], 0.3, &mut rng), None);
    }

    #[test]
    fn a_process_that_just_arrived_does_not_hop_on() {
        let rules = Eligibility {
            min_residency: Duration::ZERO,
            rehop_residency: Duration::from_secs(20),
        };
        let policy = ClosestToExcess { rules };
        let mut rng = StdRng::seed_from_u64(0);
        let arrived = ProcessLoad {
            since_arrival: Some(Duration::from_secs(19)),
            ..proc(1, 0.3)
        };
        let settled = ProcessLoad {
            since_arrival: Some(Duration::from_secs(20)),
            ..proc(2, 0.9)
        };
        // Closest to the excess, but it came 19 s ago: the other goes.
        assert_eq!(
            policy.select(&[arrived, settled], 0.3, &mut rng),
            Some(ProcessId(2))
        );
        assert_eq!(policy.select(&[arrived], 0.3, &mut rng), None);
        // Born here: only the ordinary residency counts.
        assert_eq!(
            policy.select(&[proc(3, 0.3)], 0.3, &mut rng),
            Some(ProcessId(3))
        );
    }

    fn processes() -> impl Strategy<Value = Vec<ProcessLoad>> {
        proptest::collection::vec((0.0f64..2.0, 0u64..10, any::<bool>()), 0..30).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (load, resident, migratable))| ProcessLoad {
                    pid: ProcessId(i as u64),
                    load,
                    resident_for: Duration::from_secs(resident),
                    migratable,
                    since_arrival: None,
                })
                .collect()
        })
    }

    proptest! {
        /// The chosen process is eligible and no eligible process is closer
        /// to the excess; None only when nothing is eligible.
        #[test]
        fn selection_picks_the_closest_eligible(ps in processes(), excess in 0.0f64..3.0, seed: u64) {
            let min_residency = Duration::from_secs(3);
            let rules = Eligibility { min_residency, rehop_residency: Duration::ZERO };
            let policy = ClosestToExcess { rules };
            let chosen = policy.select(&ps, excess, &mut StdRng::seed_from_u64(seed));
            let eligible: Vec<&ProcessLoad> = ps.iter().filter(|p| p.migratable && p.resident_for >= min_residency).collect();
            match chosen {
                None => prop_assert!(eligible.is_empty()),
                Some(pid) => {
                    let c = ps.iter().find(|p| p.pid == pid).unwrap();
                    prop_assert!(c.migratable && c.resident_for >= min_residency);
                    for p in eligible {
                        prop_assert!((c.load - excess).abs() <= (p.load - excess).abs());
                    }
                }
            }
            let random = RandomProcess { rules }.select(&ps, excess, &mut StdRng::seed_from_u64(seed));
            prop_assert_eq!(random.is_some(), chosen.is_some());
        }
    }
}
