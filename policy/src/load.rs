//! The load model: what "load" means to every policy.
//!
//! Units: a node's load is its CPU demand normalised to its capacity, i.e.
//! the mean number of runnable processes per CPU over the last sample period
//! (1.0 = every CPU busy, 2.0 = twice as much work as CPUs). A process's
//! contribution is in the same unit, so "move this process" and "this node
//! is that much above the average" can be compared directly. Demand rather
//! than measured utilisation, because a saturated node measures 100% however
//! overloaded it is.
//!
//! Following openMosix (Meehan & Wynne (openMosix) §3), a node keeps two
//! values:
//! - the *internal* load, the previous value decayed plus the newly
//!   accumulated sample: what the node uses for its own decisions;
//! - the *export* load it tells others: a decaying maximum (the new sample
//!   if it is higher, else 7/8 of the old maximum plus 1/8 of the sample),
//!   plus a stabilising offset, plus the CPU of processes that arrived
//!   recently, plus a term growing with the process table's fill. Every node
//!   thus sees every other as slightly busier than it is: that offset is the
//!   anti-thrashing margin, and the recent-arrivals term keeps a node from
//!   being flooded before its own load catches up.

use std::collections::VecDeque;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::field::InvalidField;
use crate::node::ProcessId;
use crate::time::Instant;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LoadError {
    #[error("load sample {0} is not a finite non-negative number")]
    InvalidSample(f64),
    #[error("sample at {now:?} is earlier than the previous one at {previous:?}")]
    TimeWentBackwards { previous: Instant, now: Instant },
    #[error(
        "cumulative CPU time went backwards ({previous:?} then {now:?}): was the process replaced?"
    )]
    CpuTimeWentBackwards { previous: Duration, now: Duration },
}

/// Parameters of the load model (`[load]` in ferryd's TOML).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoadConfig {
    /// Weight of the previous internal load in each new value, in [0, 1):
    /// 0 follows the samples exactly, close to 1 smooths heavily.
    pub decay: f64,
    /// Constant added to the export load: the anti-thrashing margin, in load
    /// units (openMosix's "stabilizing factor").
    pub stabilizer: f64,
    /// How long a migrated-in process counts as "recent" and adds its CPU to
    /// the export load.
    pub recent_arrival_ms: u64,
    /// Export-load penalty of a full process table, scaled by its fill.
    pub process_table_weight: f64,
    /// The internal load follows a migration at once: a process leaving
    /// lowers it by the process's load, one arriving raises it, without
    /// waiting for the samples to show it (they take seconds through the
    /// decay). A sender moving several processes in a row then stops when
    /// it has shed its excess, not seconds later. A departure also lowers
    /// the export's decaying maximum (a node that has just shed looks light
    /// to the others at once); an arrival does not raise it (the export's
    /// recent-arrivals term counts arrivals).
    pub follow_migrations: bool,
    /// Process-table size the fill is measured against.
    pub process_table_size: u32,
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            decay: 0.5,
            stabilizer: 0.5,
            recent_arrival_ms: 5_000,
            process_table_weight: 0.5,
            process_table_size: 4096,
            follow_migrations: false,
        }
    }
}

impl LoadConfig {
    pub fn validate(&self) -> Result<(), InvalidField> {
        if !(0.0..1.0).contains(&self.decay) {
            return Err(InvalidField::new(
                "load.decay",
                format!("{} is not in [0, 1)", self.decay),
            ));
        }
        non_negative("load.stabilizer", self.stabilizer)?;
        non_negative("load.process_table_weight", self.process_table_weight)?;
        if self.process_table_size == 0 {
            return Err(InvalidField::new(
                "load.process_table_size",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

pub(crate) fn non_negative(field: &'static str, value: f64) -> Result<(), InvalidField> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(InvalidField::new(
            field,
            format!("{value} is not a finite number >= 0"),
        ))
    }
}

pub(crate) fn positive(field: &'static str, value: f64) -> Result<(), InvalidField> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(InvalidField::new(
            field,
            format!("{value} is not a finite number > 0"),
        ))
    }
}

/// A node's load over time (Meehan & Wynne (openMosix) §3).
#[derive(Debug, Clone, Default)]
pub struct NodeLoad {
    internal: f64,
    decaying_max: f64,
    last_sample: Option<Instant>,
    /// Migrations since the last sample (when, and the load they took away,
    /// negative, or brought), for [`LoadConfig::follow_migrations`].
    moved: Vec<(Instant, f64)>,
}

impl NodeLoad {
    pub fn new() -> Self {
        Self::default()
    }

    /// Folds in one sample: `accumulated` is the mean runnable processes per
    /// CPU over the period that ends at `now`.
    pub fn record(
        &mut self,
        now: Instant,
        accumulated: f64,
        config: &LoadConfig,
    ) -> Result<(), LoadError> {
        if !accumulated.is_finite() || accumulated < 0.0 {
            return Err(LoadError::InvalidSample(accumulated));
        }
        if let Some(previous) = self.last_sample
            && now < previous
        {
            return Err(LoadError::TimeWentBackwards { previous, now });
        }
        // A process that left during the period counts in the sample for
        // the part it spent here, one that arrived for the part after: the
        // internal load already took each move in full, so the sample is
        // made to read as if each move had happened at the period's start.
        let accumulated = match (config.follow_migrations, self.last_sample) {
            (true, Some(previous)) if now > previous => {
                let period = now.saturating_duration_since(previous).as_secs_f64();
                let missing: f64 = self
                    .moved
                    .iter()
                    .map(|&(at, load)| {
                        let before = at.saturating_duration_since(previous).as_secs_f64();
                        load * (before / period).min(1.0)
                    })
                    .sum();
                (accumulated + missing).max(0.0)
            }
            _ => accumulated,
        };
        self.moved.clear();
        self.internal = if self.last_sample.is_none() {
            accumulated
        } else {
            config.decay * self.internal + (1.0 - config.decay) * accumulated
        };
        // The maximum jumps up at once and creeps down by 1/8 of the gap per
        // sample: a node that has just shed load still looks busy for a while.
        self.decaying_max = if accumulated >= self.decaying_max {
            accumulated
        } else {
            (7.0 * self.decaying_max + accumulated) / 8.0
        };
        self.last_sample = Some(now);
        Ok(())
    }

    /// A process adding `load` left for another node (see
    /// [`LoadConfig::follow_migrations`]).
    pub fn departed(&mut self, now: Instant, load: f64, config: &LoadConfig) {
        if config.follow_migrations && load.is_finite() && load > 0.0 {
            self.internal = (self.internal - load).max(0.0);
            self.decaying_max = (self.decaying_max - load).max(self.internal);
            self.moved.push((now, -load));
        }
    }

    /// A process adding `load` arrived from another node.
    pub fn arrived(&mut self, now: Instant, load: f64, config: &LoadConfig) {
        if config.follow_migrations && load.is_finite() && load > 0.0 {
            self.internal += load;
            self.moved.push((now, load));
        }
    }

    /// The load this node uses for its own decisions.
    pub fn internal(&self) -> f64 {
        self.internal
    }

    /// The decaying maximum the export load starts from.
    pub fn decaying_max(&self) -> f64 {
        self.decaying_max
    }

    /// The pessimistic load told to other nodes. `recent_arrival_cpu` is the
    /// CPU (load units) used by processes that arrived within
    /// `recent_arrival_ms` (see [`RecentArrivals`]).
    pub fn export(
        &self,
        recent_arrival_cpu: f64,
        process_count: usize,
        config: &LoadConfig,
    ) -> f64 {
        let table_fill = process_count as f64 / f64::from(config.process_table_size);
        self.decaying_max
            + config.stabilizer
            + recent_arrival_cpu.max(0.0)
            + config.process_table_weight * table_fill
    }
}

/// Processes that migrated to this node recently, whose CPU the export load
/// adds so that the node is not chosen again before its load shows them.
#[derive(Debug, Clone, Default)]
pub struct RecentArrivals {
    arrivals: VecDeque<(Instant, ProcessId)>,
}

impl RecentArrivals {
    pub fn note(&mut self, now: Instant, pid: ProcessId) {
        self.arrivals.push_back((now, pid));
    }

    /// Forgets arrivals older than the window and returns the remaining ones.
    pub fn recent(
        &mut self,
        now: Instant,
        window: Duration,
    ) -> impl Iterator<Item = ProcessId> + '_ {
        while let Some(&(at, _)) = self.arrivals.front() {
            if now.saturating_duration_since(at) > window {
                self.arrivals.pop_front();
            } else {
                break;
            }
        }
        self.arrivals.iter().map(|&(_, pid)| pid)
    }
}

/// One process's CPU share, from its cumulative CPU time sampled over time
/// (what `/proc/<pid>/stat` gives), smoothed like the node load.
#[derive(Debug, Clone, Default)]
pub struct ProcessCpuMeter {
    last: Option<(Instant, Duration)>,
    share: f64,
}

impl ProcessCpuMeter {
    /// Returns the smoothed share of one CPU used since the last sample.
    pub fn sample(
        &mut self,
        now: Instant,
        cumulative_cpu: Duration,
        decay: f64,
    ) -> Result<f64, LoadError> {
        if let Some((at, cpu)) = self.last {
            if now < at {
                return Err(LoadError::TimeWentBackwards { previous: at, now });
            }
            if cumulative_cpu < cpu {
                return Err(LoadError::CpuTimeWentBackwards {
                    previous: cpu,
                    now: cumulative_cpu,
                });
            }
            let wall = now.saturating_duration_since(at);
            if wall.is_zero() {
                return Ok(self.share);
            }
            let current = (cumulative_cpu - cpu).as_secs_f64() / wall.as_secs_f64();
            self.share = decay * self.share + (1.0 - decay) * current;
        }
        self.last = Some((now, cumulative_cpu));
        Ok(self.share)
    }

    pub fn share(&self) -> f64 {
        self.share
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn at(s: u64) -> Instant {
        Instant::from_millis(s * 1000)
    }

    #[test]
    fn with_follow_migrations_the_load_moves_with_a_process_at_once() {
        let config = LoadConfig {
            decay: 0.5,
            follow_migrations: true,
            ..LoadConfig::default()
        };
        let mut load = NodeLoad::new();
        load.record(at(1), 4.0, &config).unwrap();
        load.record(at(2), 4.0, &config).unwrap();
        // One of four processes leaves a quarter into the period: down at
        // once, and the next sample (it counted a quarter of that process)
        // is read as if it had left at the start.
        let quarter = Instant::from_millis(2_250);
        load.departed(quarter, 1.0, &config);
        assert_eq!(load.internal(), 3.0);
        load.record(at(3), 3.25, &config).unwrap();
        assert!((load.internal() - 3.0).abs() < 1e-9, "{}", load.internal());
        // An arrival the same way, on the receiving side.
        load.arrived(Instant::from_millis(3_500), 1.0, &config);
        assert_eq!(load.internal(), 4.0);
        load.record(at(4), 3.5, &config).unwrap();
        assert!((load.internal() - 4.0).abs() < 1e-9, "{}", load.internal());
        // Off (openMosix, Gerofi et al.): the samples alone move it.
        let off = LoadConfig::default();
        let mut plain = NodeLoad::new();
        plain.record(at(1), 4.0, &off).unwrap();
        plain.departed(Instant::from_millis(1_500), 1.0, &off);
        assert_eq!(plain.internal(), 4.0);
    }

    #[test]
    fn decaying_max_jumps_up_and_creeps_down_by_an_eighth() {
        let config = LoadConfig {
            decay: 0.5,
            ..LoadConfig::default()
        };
        let mut load = NodeLoad::new();
        load.record(at(1), 8.0, &config).unwrap();
        assert_eq!(load.decaying_max(), 8.0);
        load.record(at(2), 0.0, &config).unwrap();
        assert_eq!(load.decaying_max(), 7.0, "7/8 of 8 plus 1/8 of 0");
        assert_eq!(load.internal(), 4.0, "half the old load plus half the new");
        load.record(at(3), 10.0, &config).unwrap();
        assert_eq!(load.decaying_max(), 10.0);
    }

    #[test]
    fn export_load_is_pessimistic() {
        let config = LoadConfig::default();
        let mut load = NodeLoad::new();
        load.record(at(1), 2.0, &config).unwrap();
        let bare = load.export(0.0, 0, &config);
        assert_eq!(bare, 2.0 + config.stabilizer);
        assert!(
            load.export(1.0, 0, &config) > bare,
            "recent arrivals make the node less attractive"
        );
        assert!(
            load.export(0.0, 4000, &config) > bare,
            "a full process table makes it less attractive"
        );
    }

    #[test]
    fn rejects_bad_samples_and_time_going_backwards() {
        let config = LoadConfig::default();
        let mut load = NodeLoad::new();
        assert_eq!(
            load.record(at(1), f64::NAN, &config)
                .map_err(|e| matches!(e, LoadError::InvalidSample(_))),
            Err(true)
        );
        assert_eq!(
            load.record(at(1), -1.0, &config),
            Err(LoadError::InvalidSample(-1.0))
        );
        load.record(at(2), 1.0, &config).unwrap();
        assert!(matches!(
            load.record(at(1), 1.0, &config),
            Err(LoadError::TimeWentBackwards { .. })
        ));
    }

    #[test]
    fn recent_arrivals_expire() {
        let mut recent = RecentArrivals::default();
        recent.note(at(0), ProcessId(1));
        recent.note(at(3), ProcessId(2));
        let window = Duration::from_secs(2);
        assert_eq!(
            recent.recent(at(4), window).collect::<Vec<_>>(),
            vec![ProcessId(2)]
        );
        assert_eq!(recent.recent(at(6), window).count(), 0);
    }

    #[test]
    fn cpu_meter_measures_share_and_rejects_replaced_processes() {
        let mut meter = ProcessCpuMeter::default();
        assert_eq!(meter.sample(at(0), Duration::ZERO, 0.0).unwrap(), 0.0);
        let share = meter.sample(at(2), Duration::from_secs(1), 0.0).unwrap();
        assert!((share - 0.5).abs() < 1e-9);
        assert!(matches!(
            meter.sample(at(3), Duration::from_millis(10), 0.0),
            Err(LoadError::CpuTimeWentBackwards { .. })
        ));
    }

    proptest! {
        /// Whatever the samples, the internal load stays within their range
        /// and the export load never under-reports the decaying maximum.
        #[test]
        fn load_stays_within_sample_range(samples in proptest::collection::vec(0.0f64..100.0, 1..50), decay in 0.0f64..0.99) {
            let config = LoadConfig { decay, ..LoadConfig::default() };
            let mut load = NodeLoad::new();
            for (i, &s) in samples.iter().enumerate() {
                load.record(at(i as u64), s, &config).unwrap();
            }
            let lo = samples.iter().cloned().fold(f64::INFINITY, f64::min);
            let hi = samples.iter().cloned().fold(0.0, f64::max);
            prop_assert!(load.internal() >= lo - 1e-9 && load.internal() <= hi + 1e-9);
            prop_assert!(load.decaying_max() <= hi + 1e-9);
            prop_assert!(load.decaying_max() >= *samples.last().unwrap() - 1e-9);
            prop_assert!(load.export(0.0, 0, &config) >= load.decaying_max());
        }
    }
}
