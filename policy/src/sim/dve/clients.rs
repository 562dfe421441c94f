//! The DVE's clients over time: most stand still, part of the middle rows
//! walk to the corners. The simulation counts them per zone; the live
//! experiment's players (`ferry-dve-players`) walk by the same model.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{GRID, Params};

#[derive(Debug, Clone, Copy)]
struct Walker {
    from: (f64, f64),
    to: (f64, f64),
    start: f64,
    travel: f64,
}

/// Client positions over time: most stand still, walkers move in a line.
/// The live experiment's players (`cargo xtask dve`) move by the same
/// model, so that the simulation and the live run see the same drift.
pub struct Clients {
    still: Vec<(f64, f64)>,
    walkers: Vec<Walker>,
}

impl Clients {
    /// The clients of `params` (`clients`, `duration`, `middle_rows`,
    /// `walker_fraction`), placed by a generator seeded with `seed`.
    pub fn generate(params: &Params, seed: u64) -> Self {
        Self::new(params, &mut StdRng::seed_from_u64(seed))
    }

    /// How many clients there are.
    pub fn len(&self) -> usize {
        self.still.len() + self.walkers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Each client's zone (row * 10 + column) at `secs` into the run, in a
    /// fixed order of clients.
    pub fn zones(&self, secs: f64) -> Vec<usize> {
        let zone = |(r, c): (f64, f64)| {
            let r = (r.max(0.0) as usize).min(GRID - 1);
            let c = (c.max(0.0) as usize).min(GRID - 1);
            r * GRID + c
        };
        let walking = self.walkers.iter().map(|w| {
            let f = ((secs - w.start) / w.travel).clamp(0.0, 1.0);
            zone((
                w.from.0 + (w.to.0 - w.from.0) * f,
                w.from.1 + (w.to.1 - w.from.1) * f,
            ))
        });
        self.still.iter().map(|&p| zone(p)).chain(walking).collect()
    }

    fn new(params: &Params, rng: &mut StdRng) -> Self {
        let size = GRID as f64;
        let total = params.duration.as_secs_f64();
        let (first, last) = params.middle_rows;
        let middle = (first + last + 1) as f64 / 2.0;
        let mut still = Vec::new();
        let mut walkers = Vec::new();
        for _ in 0..params.clients {
            let p = (rng.random_range(0.0..size), rng.random_range(0.0..size));
            let row = p.0 as usize;
            if (first..=last).contains(&row) && rng.random_bool(params.walker_fraction) {
                // The upper half of the middle heads up-left, the lower
                // half down-right (Gerofi et al. (DVE) Fig. 5a), to a spot
                // in the corner's 2x3 block.
                let to = if p.0 < middle {
                    (rng.random_range(0.0..2.0), rng.random_range(0.0..3.0))
                } else {
                    (
                        rng.random_range(size - 2.0..size),
                        rng.random_range(size - 3.0..size),
                    )
                };
                let travel = rng.random_range(0.15..0.35) * total;
                let start = rng.random_range(0.0..(total * 0.9 - travel).max(0.0));
                walkers.push(Walker {
                    from: p,
                    to,
                    start,
                    travel,
                });
            } else {
                still.push(p);
            }
        }
        Clients { still, walkers }
    }

    pub(super) fn per_zone(&self, secs: f64) -> Vec<u32> {
        let mut counts = vec![0u32; GRID * GRID];
        for z in self.zones(secs) {
            counts[z] += 1;
        }
        counts
    }
}
