//! A configuration value out of range, as each policy's `validate` reports
//! it (a leaf: the crate's `PolicyError` wraps it, and the policies need
//! nothing else of that error).

/// `field` is its dotted path in ferryd's TOML (`transfer.threshold`), so
/// the operator knows what to fix.
#[derive(Debug, thiserror::Error)]
#[error("invalid {field}: {reason}")]
pub struct InvalidField {
    pub field: &'static str,
    pub reason: String,
}

impl InvalidField {
    pub(crate) fn new(field: &'static str, reason: impl Into<String>) -> Self {
        Self {
            field,
            reason: reason.into(),
        }
    }
}
