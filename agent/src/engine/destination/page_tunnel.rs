//! `Peer.PageTunnel`: the source's page server, carried in the peer
//! connection, for a post-copy's lazy-pages daemon.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use ferry_proto::v1::{self as pb};
use futures::StreamExt;

use super::{Step, check_source, expect};
use crate::engine::localpages::LocalPages;
use crate::engine::{Engine, EngineError};

/// A post-copy's page tunnel on the destination: the pump between the
/// tunnel and a loopback connection, whose other end waits here for the
/// lazy-pages daemon.
#[derive(Debug)]
pub(in crate::engine) struct IncomingTunnel {
    pub(super) daemon_end: Option<OwnedFd>,
    pub(super) pump: tokio::task::AbortHandle,
    /// Assisted post-copy: the pages answered here (set by Restore).
    pub(super) local: Arc<std::sync::OnceLock<LocalPages>>,
    /// Pages answered from the store so far.
    pub(super) served_locally: Arc<std::sync::atomic::AtomicU64>,
}

/// The stream a PageTunnel answers with: the daemon's bytes.
pub type TunnelOut = tokio_stream::wrappers::ReceiverStream<Result<pb::TunnelBytes, tonic::Status>>;

/// `Peer.PageTunnel`: the source's page server, carried in the peer
/// connection. Opened once per post-copy migration, by the node that
/// prepared it, before Restore; the daemon that Restore starts gets the
/// loopback end. `caller`: the node the peer's certificate names (`None`
/// without TLS).
pub async fn page_tunnel(
    engine: &Arc<Engine>,
    caller: Option<String>,
    mut stream: tonic::Streaming<pb::TunnelBytes>,
) -> Result<TunnelOut, EngineError> {
    let first = stream
        .next()
        .await
        .ok_or_else(|| EngineError::InvalidField {
            field: "migration_id",
            reason: "the page tunnel ended before its first message".into(),
        })?
        .map_err(|s| EngineError::BadImage(format!("page tunnel broke: {}", s.message())))?;
    let mut slot = engine.incoming.lock().await;
    let inc = expect(&mut slot, &first.migration_id, Step::PageTunnel)?;
    check_source(inc, caller.as_deref())?;
    if inc.protocol_version < ferry_proto::PEER_PROTOCOL_POSTCOPY {
        return Err(EngineError::WrongState {
            migration_id: inc.migration_id.clone(),
            state: "prepared with a protocol without post-copy",
            step: "page tunnel",
        });
    }
    if inc.tunnel.is_some() {
        return Err(EngineError::WrongState {
            migration_id: inc.migration_id.clone(),
            state: "already tunnelling pages",
            step: "page tunnel",
        });
    }
    let pair = crate::engine::pagetunnel::loopback_pair().await?;
    let (tx, rx) = tokio::sync::mpsc::channel(crate::engine::pagetunnel::DEPTH);
    if !first.data.is_empty() {
        return Err(EngineError::InvalidField {
            field: "data",
            reason: "the page tunnel's first message only names the migration".into(),
        });
    }
    let id = inc.migration_id.clone();
    let local = Arc::new(std::sync::OnceLock::new());
    let served_locally = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let pump = tokio::spawn({
        let (local, counter) = (local.clone(), served_locally.clone());
        async move {
            match crate::engine::localpages::serve(pair.ours, stream, tx, local, counter).await {
                Ok(served) => {
                    tracing::info!(
                        migration = %id,
                        local_pages = served.local_pages,
                        local_requests = served.local_requests,
                        remote_pages = served.remote_pages,
                        remote_requests = served.remote_requests,
                        "page tunnel closed"
                    )
                }
                Err(e) => tracing::warn!(migration = %id, error = %e, "page tunnel ended"),
            }
        }
    });
    inc.tunnel = Some(IncomingTunnel {
        daemon_end: Some(pair.criu),
        pump: pump.abort_handle(),
        local,
        served_locally,
    });
    Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
}
