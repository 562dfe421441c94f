//! Cancelling an outgoing migration (`Control.CancelMigration`).
//!
//! A cancel is honoured only where the migration can still roll back on
//! its own terms: from its start up to the moment the source asks the
//! destination to restore the process. The engine checks at every phase
//! boundary and races the long phases (pre-copy rounds, the transfer)
//! against the request; a cancel then takes the same path as a failure
//! before the commit point, so the process runs on at the source with its
//! connections. Once the source has decided to restore, the decision and
//! any later cancel are ordered by one lock: the cancel is refused, never
//! half-honoured.

use std::sync::Mutex;

use ferry_proto::v1::MigrationReport;
use tokio::sync::watch;

use super::EngineError;

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Open,
    Requested {
        by: String,
    },
    /// The source asked the destination to restore: the migration ends by
    /// itself, committed or rolled back.
    Restoring,
}

/// One outgoing migration's cancel switch and its end.
#[derive(Debug)]
pub struct Cancel {
    state: Mutex<State>,
    requested: watch::Sender<bool>,
    finished: watch::Sender<Option<MigrationReport>>,
}

/// Why a cancel was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CancelRefused {
    #[error("it is restoring on the destination already; it commits or rolls back by itself")]
    Restoring,
}

impl Default for Cancel {
    fn default() -> Self {
        Cancel {
            state: Mutex::new(State::Open),
            requested: watch::channel(false).0,
            finished: watch::channel(None).0,
        }
    }
}

impl Cancel {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }

    /// Asks the migration to stop at its next safe point. Asking twice is
    /// fine (the first caller is named in the report).
    pub fn request(&self, by: &str) -> Result<(), CancelRefused> {
        let mut state = self.state();
        match &*state {
            State::Open => {
                *state = State::Requested { by: by.to_owned() };
                self.requested.send_replace(true);
                Ok(())
            }
            State::Requested { .. } => Ok(()),
            State::Restoring => Err(CancelRefused::Restoring),
        }
    }

    /// At a safe point: whether to stop here.
    pub fn check(&self) -> Result<(), EngineError> {
        match &*self.state() {
            State::Requested { by } => Err(EngineError::Cancelled { by: by.clone() }),
            _ => Ok(()),
        }
    }

    /// The last safe point: either the migration was cancelled, or from now
    /// on it cannot be.
    pub fn enter_restore(&self) -> Result<(), EngineError> {
        let mut state = self.state();
        if let State::Requested { by } = &*state {
            return Err(EngineError::Cancelled { by: by.clone() });
        }
        *state = State::Restoring;
        Ok(())
    }

    /// Resolves once a cancel was requested (never, if none is): raced
    /// against the long phases.
    pub async fn requested(&self) -> EngineError {
        let mut rx = self.requested.subscribe();
        let _ = rx.wait_for(|r| *r).await;
        match self.check() {
            Err(e) => e,
            // The sender lives in self: wait_for cannot fail while this
            // future is polled, and the flag never goes back to false.
            Ok(()) => EngineError::Cancelled {
                by: String::from("?"),
            },
        }
    }

    /// The migration ended with `report`.
    pub fn finish(&self, report: MigrationReport) {
        self.finished.send_replace(Some(report));
    }

    /// Waits for the migration's end.
    pub async fn finished(&self) -> MigrationReport {
        let mut rx = self.finished.subscribe();
        let report = match rx.wait_for(|r| r.is_some()).await {
            Ok(r) => r.clone(),
            Err(_) => None,
        };
        report.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_cancel_before_the_restore_stops_at_the_next_check() {
        let c = Cancel::default();
        assert!(c.check().is_ok());
        c.request("alice").unwrap();
        c.request("bob").unwrap();
        match c.check() {
            Err(EngineError::Cancelled { by }) => assert_eq!(by, "alice"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            c.enter_restore(),
            Err(EngineError::Cancelled { .. })
        ));
    }

    #[test]
    fn a_cancel_after_the_restore_decision_is_refused() {
        let c = Cancel::default();
        c.enter_restore().unwrap();
        assert_eq!(c.request("alice"), Err(CancelRefused::Restoring));
        assert!(c.check().is_ok());
    }

    #[tokio::test]
    async fn a_long_phase_learns_of_the_cancel_at_once() {
        let c = Arc::new(Cancel::default());
        let waiting = tokio::spawn({
            let c = c.clone();
            async move { c.requested().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        c.request("alice").unwrap();
        let e = waiting.await.unwrap();
        assert!(matches!(e, EngineError::Cancelled { by } if by == "alice"));
    }

    #[tokio::test]
    async fn the_caller_gets_the_final_report() {
        let c = Arc::new(Cancel::default());
        let waiting = tokio::spawn({
            let c = c.clone();
            async move { c.finished().await }
        });
        c.finish(MigrationReport {
            migration_id: "m1".into(),
            ..Default::default()
        });
        assert_eq!(waiting.await.unwrap().migration_id, "m1");
        // Asked after the end: the same report, at once.
        assert_eq!(c.finished().await.migration_id, "m1");
    }
}
