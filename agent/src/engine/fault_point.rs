//! Fault points, for the tests of agents that crash and come back and of
//! links that fail at a given step: a ferryd started with
//! `FERRY_FAULT_AT=<side>:<point>[:<fault>]` injects the fault when it
//! reaches that point. Faults: `kill` (the default: SIGKILL to itself, as
//! the kernel's OOM killer or an operator would; nothing is cleaned up,
//! nothing flushed), `pause-<ms>` (the migration waits there, e.g.
//! for a test to cut a link before the next step's call) and `kill-criu`
//! (`destination:Restoring`: the CRIU restoring is killed once the tasks
//! exist, the agent lives on).
//!
//! The source's points are its phases, as [`super::source::PhaseName`]
//! names them (`source:Transfer`: the process stopped, its images about
//! to leave), `source:TreeFrozen` (CRIU's `query-ext-files`: CRIU holds
//! the tree stopped, the ports are cut off) and `source:Committing` (its
//! journal says released, no
//! Commit sent); the destination's are `destination:Prepared` (the node
//! reserved, the answer not sent), `destination:Armed` (the capture
//! armed, the answer not sent), `destination:Received` (the images
//! written, the answer not sent), `destination:RestoredUnrecorded` (CRIU
//! restored the tree, no record names it yet: an agent killed there is
//! one killed inside CRIU's restore) and its journal records
//! (`destination:Restored`, `destination:Committed`: written, and the next
//! step not taken), and a distributed server's acceptor's
//! `destination:HandoffRebuilt` (the handed-off connection rebuilt, the
//! answer not sent). A pause longer than the peer timeout makes a late
//! answer. Unset (every deployment), a check is one read of a `OnceLock`.

use std::sync::OnceLock;
use std::time::Duration;

/// The environment variable that names the fault point.
pub const ENV: &str = "FERRY_FAULT_AT";

/// Which side of a migration a point is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Source,
    Destination,
}

impl Side {
    fn as_str(self) -> &'static str {
        match self {
            Side::Source => "source",
            Side::Destination => "destination",
        }
    }
}

/// What happens at the point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Kill,
    Pause(Duration),
    /// `kill-criu`: the CRIU process at work there is SIGKILLed (the
    /// agent lives on). Only `destination:Restoring` (CRIU's
    /// "post-restore": the tasks exist, not yet resumed).
    KillCriu,
}

/// A configured fault point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultAt {
    pub side: String,
    pub point: String,
    pub fault: Fault,
}

/// Parses `<side>:<point>[:<fault>]`.
pub fn parse(v: &str) -> Option<FaultAt> {
    let mut parts = v.split(':');
    let side = parts
        .next()
        .filter(|s| *s == "source" || *s == "destination")?;
    let point = parts.next().filter(|p| !p.is_empty())?;
    let fault = match parts.next() {
        None | Some("kill") => Fault::Kill,
        Some("kill-criu") => Fault::KillCriu,
        Some(f) => Fault::Pause(Duration::from_millis(
            f.strip_prefix("pause-")?.strip_suffix("ms")?.parse().ok()?,
        )),
    };
    if parts.next().is_some() {
        return None;
    }
    Some(FaultAt {
        side: side.to_owned(),
        point: point.to_owned(),
        fault,
    })
}

fn configured() -> Option<&'static FaultAt> {
    static AT: OnceLock<Option<FaultAt>> = OnceLock::new();
    AT.get_or_init(|| {
        let v = std::env::var(ENV).ok()?;
        let parsed = parse(&v);
        if parsed.is_none() {
            tracing::error!(value = %v, "{ENV} is not <source|destination>:<point>[:kill|:pause-<N>ms|:kill-criu]; ignored");
        }
        parsed
    })
    .as_ref()
}

/// Logs the configured fault point, if any (at start, so that a test's
/// log says why the agent died or waited).
pub fn announce() {
    if let Some(at) = configured() {
        tracing::warn!(?at, "{ENV} set: this agent injects a fault there");
    }
}

/// The configured fault, if `side:point` is its point (killed here if
/// the fault is `kill`): how long to pause.
fn fault_at(side: Side, point: &str) -> Option<Duration> {
    let at = configured()?;
    if at.side != side.as_str() || at.point != point {
        return None;
    }
    match at.fault {
        Fault::Kill => {
            tracing::warn!(side = at.side, point, "fault point reached: SIGKILL");
            // Nothing after this runs: the signal is delivered before the
            // call returns, and every thread dies with the process.
            let _ =
                nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL);
            None
        }
        Fault::KillCriu => None,
        Fault::Pause(d) => {
            tracing::warn!(
                side = at.side,
                point,
                ms = d.as_millis() as u64,
                "fault point reached: pausing"
            );
            Some(d)
        }
    }
}

/// Whether the CRIU at work at `side:point` is to be killed
/// ([`Fault::KillCriu`]).
pub fn kills_criu(side: Side, point: &str) -> bool {
    configured().is_some_and(|at| {
        at.fault == Fault::KillCriu && at.side == side.as_str() && at.point == point
    })
}

/// Injects the configured fault if `side:point` is its point.
pub async fn reached(side: Side, point: &str) {
    if let Some(pause) = fault_at(side, point) {
        tokio::time::sleep(pause).await;
    }
}

/// [`reached`], on a thread that may block (CRIU's notifications).
pub fn reached_blocking(side: Side, point: &str) {
    if let Some(pause) = fault_at(side, point) {
        std::thread::sleep(pause);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_points_parse_as_documented() {
        assert_eq!(
            parse("source:Transfer"),
            Some(FaultAt {
                side: "source".into(),
                point: "Transfer".into(),
                fault: Fault::Kill
            })
        );
        assert_eq!(
            parse("destination:Committed:kill").map(|f| f.fault),
            Some(Fault::Kill)
        );
        assert_eq!(
            parse("destination:Restoring:kill-criu").map(|f| f.fault),
            Some(Fault::KillCriu)
        );
        assert_eq!(
            parse("source:Committing:pause-3000ms").map(|f| f.fault),
            Some(Fault::Pause(Duration::from_secs(3)))
        );
        for bad in [
            "",
            "source",
            "source:",
            "node:Transfer",
            "source:Transfer:pause-3s",
            "source:Transfer:kill:x",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }
}
