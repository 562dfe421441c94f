//! `Peer.Abort`: every trace of the incoming migration removed, unless it
//! was committed here already: then nothing is undone and the answer says
//! so (`AbortResponse.committed`, protocol 11). A source that did not hear
//! the Commit's answer, or came back from a crash after its Release, asks
//! this way what the two-phase commit decided: the answer is final, since
//! a Commit after an Abort finds nothing to resume.

use std::sync::Arc;

use ferry_proto::v1::AbortRequest;

use super::discard;
use crate::engine::journal::{IncomingStage, Record};
use crate::engine::{Engine, EngineError};

/// Aborts `req`'s migration, asked by `caller` (the node its certificate
/// names; none without TLS). Returns whether it had been committed here
/// instead.
pub async fn abort(
    engine: &Arc<Engine>,
    req: AbortRequest,
    caller: Option<&str>,
) -> Result<bool, EngineError> {
    // Closed in repair mode: nothing reaches the peers.
    engine.incoming.drop_sockets_of(&req.migration_id);
    let mut slot = engine.incoming.lock().await;
    match slot.as_ref() {
        Some(inc) if inc.migration_id == req.migration_id => {
            tracing::warn!(migration = %req.migration_id, reason = %req.reason, state = inc.state.name(), "migration aborted by the source");
            discard(engine, inc).await;
            *slot = None;
            Ok(false)
        }
        // Not held: never reached us, already aborted, or committed; the
        // journal knows the last (under the slot's lock: a Commit records
        // its decision holding it).
        _ => match engine.journal.incoming(&req.migration_id) {
            Ok(Some(Record::Incoming {
                stage: IncomingStage::Committed,
                from,
                pid,
                ..
            })) => {
                if let Some(node) = caller
                    && node != from
                {
                    return Err(EngineError::NotItsSource {
                        migration_id: req.migration_id,
                        from,
                        caller: node.to_owned(),
                    });
                }
                tracing::info!(migration = %req.migration_id, pid, "abort for a migration committed here: nothing to undo");
                Ok(true)
            }
            Ok(_) => {
                tracing::info!(migration = %req.migration_id, "abort for a migration not held here");
                // Its Prepare may still be on its way (slow, or held on a
                // cut link): it must not reserve this node when it comes.
                engine.incoming.give_up(&req.migration_id);
                Ok(false)
            }
            // Unreadable: saying "not committed" could have the source
            // resume a copy that runs here too.
            Err(e) => Err(EngineError::Internal(format!(
                "what was decided for migration {} cannot be read: {e}",
                req.migration_id
            ))),
        },
    }
}
