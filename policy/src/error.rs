//! The crate's error, gathering each module's own.

use crate::field::InvalidField;
use crate::information::InformationError;
use crate::load::LoadError;
use crate::transfer::TransferError;

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// A configuration value is out of range; `field` is its dotted path in
    /// ferryd's TOML (`transfer.threshold`), so the operator knows what to fix.
    #[error("invalid {field}: {reason}")]
    InvalidField { field: &'static str, reason: String },
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Transfer(#[from] TransferError),
    #[error(transparent)]
    Information(#[from] InformationError),
}

impl From<InvalidField> for PolicyError {
    fn from(InvalidField { field, reason }: InvalidField) -> Self {
        PolicyError::InvalidField { field, reason }
    }
}
