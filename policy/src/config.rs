//! The balancer's configuration: `[policy]` in ferryd's TOML, settable
//! through the Control API, hence serde and a validation that names the
//! offending field.

use serde::{Deserialize, Serialize};

use crate::error::PolicyError;
use crate::information::InformationConfig;
use crate::load::LoadConfig;
use crate::location::LocationConfig;
use crate::selection::SelectionConfig;
use crate::transfer::TransferConfig;

/// Defaults are Gerofi et al. (DVE)'s policies: threshold sender, mirror
/// location, closest-to-excess selection, broadcast heartbeat.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub load: LoadConfig,
    pub transfer: TransferConfig,
    pub location: LocationConfig,
    pub selection: SelectionConfig,
    pub information: InformationConfig,
}

impl Config {
    /// Checks every field; the first invalid one is named in the error.
    pub fn validate(&self) -> Result<(), PolicyError> {
        self.load.validate()?;
        self.transfer.validate()?;
        self.information.validate()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::information::InformationKind;
    use crate::location::LocationKind;

    fn field_of(config: &Config) -> &'static str {
        match config.validate() {
            Err(PolicyError::InvalidField { field, .. }) => field,
            other => panic!("expected an invalid field, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_valid() {
        Config::default().validate().unwrap();
    }

    #[test]
    fn invalid_thresholds_are_rejected_by_name() {
        let mut c = Config::default();
        c.transfer.threshold = -1.0;
        assert_eq!(field_of(&c), "transfer.threshold");
        c.transfer.threshold = f64::NAN;
        assert_eq!(field_of(&c), "transfer.threshold");
        let mut c = Config::default();
        c.transfer.average_gap = f64::INFINITY;
        assert_eq!(field_of(&c), "transfer.average_gap");
        let mut c = Config::default();
        c.load.decay = 1.0;
        assert_eq!(field_of(&c), "load.decay");
        let mut c = Config::default();
        c.load.stabilizer = -0.1;
        assert_eq!(field_of(&c), "load.stabilizer");
        let mut c = Config::default();
        c.information.failure_timeout_ms = 10;
        assert_eq!(field_of(&c), "information.failure_timeout_ms");
    }

    #[test]
    fn error_message_names_field_and_reason() {
        let mut c = Config::default();
        c.transfer.threshold = 0.0;
        let message = c.validate().unwrap_err().to_string();
        assert!(
            message.contains("transfer.threshold") && message.contains("> 0"),
            "{message}"
        );
    }

    #[test]
    fn loads_from_ferryd_toml_and_round_trips() {
        let text = r#"
            [transfer]
            threshold = 0.8
            average_gap = 0.15

            [location]
            kind = "power_of_two"

            [information]
            kind = "hearsay"
            vector_size = 12
        "#;
        let c: Config = toml::from_str(text).unwrap();
        c.validate().unwrap();
        assert_eq!(c.transfer.threshold, 0.8);
        assert_eq!(c.location.kind, LocationKind::PowerOfTwo);
        assert_eq!(c.information.kind, InformationKind::Hearsay);
        assert_eq!(c.information.vector_size, 12);
        assert_eq!(
            c.information.period_ms, 1_000,
            "unset fields keep their defaults"
        );
        let back: Config = toml::from_str(&toml::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        assert!(
            toml::from_str::<Config>("[transfer]\nthreshhold = 1.0\n").is_err(),
            "typos are errors, not defaults"
        );
    }
}
