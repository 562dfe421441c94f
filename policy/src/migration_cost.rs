//! What a migration costs, from parameters: the simulator charges it, and a
//! conductor can use the estimate as openMosix uses it for residency
//! (Meehan & Wynne (openMosix) §3: a process must have run long enough to
//! pay for its move).
//!
//! Words from Noack (2003) §2.2, as everywhere in ferry: preparation time (live
//! transfer before the freeze), downtime or freeze time, total time.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How memory crosses the wire.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Mechanism {
    /// Freeze, send everything, resume (openMosix, plain `criu dump`).
    StopAndCopy,
    /// Send while running; each round resends what was dirtied during the
    /// previous one, until the remainder fits `stop_bytes` or the rounds run
    /// out; then freeze and send the remainder.
    PreCopy {
        dirty_bytes_per_sec: f64,
        max_rounds: u32,
        stop_bytes: u64,
    },
}

/// The parameters of one migration path.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MigrationCostModel {
    pub bandwidth_bytes_per_sec: f64,
    /// Fixed part of the freeze: stopping, dumping, restoring, switching
    /// ownership, whatever the size.
    pub freeze_overhead: Duration,
    /// Extra freeze per socket (checkpoint, transfer, restore).
    pub per_connection: Duration,
    /// Extra freeze per MiB of the process's memory, beyond the pages
    /// sent in it (ferry's measured pre-copy freeze grows a little with
    /// memory: page tables scanned, areas restored).
    #[serde(default)]
    pub per_mib: Duration,
    pub mechanism: Mechanism,
}

/// Estimated phases of one migration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MigrationTimes {
    pub preparation: Duration,
    pub downtime: Duration,
    pub total: Duration,
    pub bytes: u64,
}

impl MigrationCostModel {
    pub fn estimate(&self, memory_bytes: u64, connections: u32) -> MigrationTimes {
        let bandwidth = self.bandwidth_bytes_per_sec.max(1.0);
        let send = |bytes: f64| Duration::from_secs_f64(bytes / bandwidth);
        let fixed = self.freeze_overhead
            + self.per_connection * connections
            + self
                .per_mib
                .mul_f64(memory_bytes as f64 / f64::from(1u32 << 20));
        match self.mechanism {
            Mechanism::StopAndCopy => {
                let downtime = fixed + send(memory_bytes as f64);
                MigrationTimes {
                    preparation: Duration::ZERO,
                    downtime,
                    total: downtime,
                    bytes: memory_bytes,
                }
            }
            Mechanism::PreCopy {
                dirty_bytes_per_sec,
                max_rounds,
                stop_bytes,
            } => {
                let memory = memory_bytes as f64;
                let mut to_send = memory;
                let mut preparation = Duration::ZERO;
                let mut bytes = 0.0;
                for _ in 0..max_rounds {
                    if to_send <= stop_bytes as f64 {
                        break;
                    }
                    let round = send(to_send);
                    preparation += round;
                    bytes += to_send;
                    // What was written while this round was on the wire, at
                    // most the whole memory.
                    let dirtied = (dirty_bytes_per_sec.max(0.0) * round.as_secs_f64()).min(memory);
                    if dirtied >= to_send {
                        // Not converging: more is dirtied than sent.
                        to_send = dirtied;
                        break;
                    }
                    to_send = dirtied;
                }
                let downtime = fixed + send(to_send);
                bytes += to_send;
                MigrationTimes {
                    preparation,
                    downtime,
                    total: preparation + downtime,
                    bytes: bytes as u64,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GBIT: f64 = 125_000_000.0;

    fn model(mechanism: Mechanism) -> MigrationCostModel {
        MigrationCostModel {
            bandwidth_bytes_per_sec: GBIT,
            freeze_overhead: Duration::from_millis(10),
            per_connection: Duration::from_micros(20),
            per_mib: Duration::ZERO,
            mechanism,
        }
    }

    #[test]
    fn stop_and_copy_freezes_for_the_whole_transfer() {
        let t = model(Mechanism::StopAndCopy).estimate(125_000_000, 100);
        assert_eq!(t.preparation, Duration::ZERO);
        assert_eq!(t.downtime, Duration::from_millis(1_000 + 10 + 2));
        assert_eq!(t.total, t.downtime);
    }

    #[test]
    fn pre_copy_shrinks_the_freeze_and_pays_in_preparation() {
        let pre = Mechanism::PreCopy {
            dirty_bytes_per_sec: 10_000_000.0,
            max_rounds: 10,
            stop_bytes: 1_000_000,
        };
        let p = model(pre).estimate(125_000_000, 100);
        let s = model(Mechanism::StopAndCopy).estimate(125_000_000, 100);
        assert!(p.downtime < s.downtime / 10, "{p:?} vs {s:?}");
        assert!(
            p.total >= s.total - Duration::from_millis(1),
            "resending costs time overall"
        );
        assert!(p.bytes > 125_000_000);
    }

    #[test]
    fn pre_copy_that_cannot_converge_stops_early() {
        let pre = Mechanism::PreCopy {
            dirty_bytes_per_sec: 1e12,
            max_rounds: 30,
            stop_bytes: 0,
        };
        let t = model(pre).estimate(1_000_000, 0);
        // One round, then the whole memory is dirty again and goes frozen.
        assert_eq!(t.bytes, 2_000_000);
    }
}
