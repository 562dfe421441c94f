//! Time as the policies see it: a value handed in by the caller, never read
//! from the system, so that decisions are reproducible and the simulator can
//! run the same code on a virtual clock.
//!
//! Each node has its own clock. Instants from different nodes are NOT
//! comparable (clock skew between nodes is normal); only the information
//! policy deals with remote timestamps, and it says how.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A point on one node's clock, in milliseconds since an arbitrary epoch.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Instant(u64);

impl Instant {
    pub const ZERO: Instant = Instant(0);

    pub const fn from_millis(millis: u64) -> Self {
        Instant(millis)
    }

    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// Time elapsed since `earlier`, zero if `earlier` is in the future.
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }

    pub fn saturating_add(self, duration: Duration) -> Instant {
        Instant(self.0.saturating_add(millis(duration)))
    }

    pub fn saturating_sub(self, duration: Duration) -> Instant {
        Instant(self.0.saturating_sub(millis(duration)))
    }
}

/// Whole milliseconds of a duration, saturating (policies never deal with
/// durations anywhere near 584 million years).
pub(crate) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// A source of [`Instant`]s: ferryd's is the monotonic system clock, the
/// simulator's is its event queue's virtual time.
pub trait Clock {
    fn now(&self) -> Instant;
}

/// A clock that says what it was last told: for tests and the simulator.
#[derive(Debug, Clone, Copy, Default)]
pub struct ManualClock(pub Instant);

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates_instead_of_wrapping() {
        let t = Instant::from_millis(5);
        assert_eq!(t.saturating_sub(Duration::from_secs(1)), Instant::ZERO);
        assert_eq!(
            Instant::ZERO.saturating_duration_since(t),
            Duration::ZERO,
            "an instant in the future is zero time ago, not a huge one"
        );
        assert_eq!(
            Instant::from_millis(u64::MAX).saturating_add(Duration::from_secs(1)),
            Instant::from_millis(u64::MAX)
        );
        assert_eq!(
            t.saturating_add(Duration::from_millis(7))
                .saturating_duration_since(t),
            Duration::from_millis(7)
        );
    }
}
