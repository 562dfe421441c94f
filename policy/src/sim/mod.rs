//! Discrete-event simulator running the policy code of this crate on a
//! virtual clock: the same [`crate::Balancer`], [`crate::information`]
//! policies, [`crate::load::NodeLoad`] and [`crate::transfer::MigrationGate`]
//! that ferryd runs, never copies of them.
//!
//! - [`openmosix`]: Meehan & Wynne (openMosix)'s experiment (20 nodes, 6 spikes
//!   of 70 CPU-bound processes), own-load-only against hearsay vectors;
//! - [`dve`]: Gerofi et al. (DVE)'s scenario (5 nodes, 100 zone servers,
//!   10,000 clients drifting to two corners), balancing off against on.
//!
//! Results are plain data plus rendering helpers ([`report`], [`svg`]);
//! writing files is the caller's business (`cargo xtask sim`), so the crate
//! stays free of side effects. A run is a function of its parameters and
//! seed: same seed, same numbers.

pub mod dve;
pub mod event;
pub mod openmosix;
pub mod report;
pub mod svg;

use crate::error::PolicyError;

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("invalid simulation parameter {field}: {reason}")]
    InvalidParameter { field: &'static str, reason: String },
    #[error("policy error in the simulated cluster: {0}")]
    Policy(#[from] PolicyError),
}

impl From<crate::load::LoadError> for SimError {
    fn from(e: crate::load::LoadError) -> Self {
        SimError::Policy(e.into())
    }
}

impl From<crate::transfer::TransferError> for SimError {
    fn from(e: crate::transfer::TransferError) -> Self {
        SimError::Policy(e.into())
    }
}

impl From<crate::information::InformationError> for SimError {
    fn from(e: crate::information::InformationError) -> Self {
        SimError::Policy(e.into())
    }
}

/// Mean and sample standard deviation.
pub fn mean_sd(values: &[f64]) -> (f64, f64) {
    if values.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if values.len() < 2 {
        return (mean, 0.0);
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}
