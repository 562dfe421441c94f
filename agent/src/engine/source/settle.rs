//! Listen and Settle: CRIU can move neither a connection waiting in a
//! listener's accept queue nor a handshake half done, and would find them
//! only once the process is stopped. Listen reads the tree's listening
//! sockets before Arm; from Arm no handshake starts here (an armed port
//! takes no SYN: the destination replays it to the restored listener), and
//! Settle waits until the process has accepted what is queued and the
//! handshakes under way have ended, within a bound, or the migration stops
//! there, the process running.

use std::time::{Duration, Instant};

use super::Phase;
use super::carry::{Arming, Dumping, Listening, Settling};
use super::run::Run;
use crate::engine::{EngineError, blocking};
use crate::process;

/// How long the source waits before the freeze, new handshakes held, for
/// the process to accept what waits in its listeners' accept queues and
/// for handshakes under way to end. A process that serves its clients
/// accepts within milliseconds; a client answers a SYN-ACK within one
/// round trip.
const PENDING_CONNECTIONS_BOUND: Duration = Duration::from_millis(500);

pub(super) async fn listen(run: &mut Run, l: Listening) -> Result<Phase, EngineError> {
    let pid = run.p.pid;
    let listeners = blocking("reading the listeners", move || {
        process::Listeners::of_tree(&process::process_tree(pid))
    })
    .await??;
    Ok(if run.capture {
        Phase::Arm(Arming {
            listeners,
            incremental: l.incremental,
        })
    } else {
        Phase::Settle(Settling {
            listeners,
            incremental: l.incremental,
            armed_fixed: None,
        })
    })
}

pub(super) async fn settle(run: &mut Run, s: Settling) -> Result<Phase, EngineError> {
    pending_connections_done(run.p.pid, s.listeners).await?;
    Ok(Phase::Dump(Dumping {
        incremental: s.incremental,
        armed_fixed: s.armed_fixed,
    }))
}

/// Waits (bounded) until no connection waits in the accept queue of one
/// of `listeners` (the tree of `pid`'s) and no handshake is under way on
/// their ports; [`EngineError::NotMigratable`] with what is left if the
/// bound passes.
async fn pending_connections_done(
    pid: i32,
    listeners: process::Listeners,
) -> Result<(), EngineError> {
    if listeners.is_empty() {
        return Ok(());
    }
    tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        loop {
            let pending = listeners.pending()?;
            if pending.is_empty() {
                tracing::debug!(
                    waited_ms = started.elapsed().as_secs_f64() * 1000.0,
                    "no connection pending on the listeners"
                );
                return Ok(());
            }
            if started.elapsed() >= PENDING_CONNECTIONS_BOUND {
                return Err(EngineError::NotMigratable {
                    pid,
                    reason: format!(
                        "{pending}, still {} ms after new connections were held: the process \
                         does not accept them, and CRIU cannot move them",
                        PENDING_CONNECTIONS_BOUND.as_millis()
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    })
    .await
    .map_err(|source| EngineError::Task {
        what: "waiting for the pending connections",
        source,
    })?
}
