//! `Peer.Abort`: every trace of the incoming migration removed.

use std::sync::Arc;

use ferry_proto::v1::AbortRequest;

use super::discard;
use crate::engine::{Engine, EngineError};

pub async fn abort(engine: &Arc<Engine>, req: AbortRequest) -> Result<(), EngineError> {
    // Closed in repair mode: nothing reaches the peers.
    engine.incoming.drop_sockets_of(&req.migration_id);
    let mut slot = engine.incoming.lock().await;
    match slot.as_ref() {
        Some(inc) if inc.migration_id == req.migration_id => {
            tracing::warn!(migration = %req.migration_id, reason = %req.reason, state = inc.state.name(), "migration aborted by the source");
            discard(engine, inc).await;
            *slot = None;
        }
        // Idempotent: an abort for something we do not hold (never reached
        // us, or already aborted) has nothing to undo.
        _ => tracing::info!(migration = %req.migration_id, "abort for a migration not held here"),
    }
    Ok(())
}
