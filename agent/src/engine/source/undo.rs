//! What a migration has done that an abort must undo, and the undoing of
//! what takes more than a call: the page server, the peers' translations.

use std::sync::Arc;
use std::time::Duration;

use ferry_proto::v1::TranslationsRequest;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::carry::{Dumped, PageServer};
use super::sockets::SocketsSent;
use crate::criu;
use crate::engine::link::peer_error;
use crate::engine::precopy::Precopy;
use crate::engine::{Engine, EngineError};
use crate::process;
use crate::sockstate;

/// What a migration has done that an abort must undo, filled in by the
/// phases as they do it and emptied as later phases hand it on.
#[derive(Default)]
pub(super) struct Undo {
    /// A capture session is open here for the migration (from Arm, until
    /// Release).
    pub capturing_here: bool,
    /// Pre-copy: dirty tracking on (from PreCopy until the dump is done).
    pub precopy: Option<Precopy>,
    /// Collective socket migration: the process's connections, held by
    /// ferryd in repair mode from the moment CRIU froze the tree (or the
    /// end of the dump, with a CRIU lacking ferry's patch). Turned back on
    /// an abort; closed (silently) after the commit.
    pub held: Option<Arc<sockstate::Held>>,
    /// Collective: the transfer of the connections' states, started with
    /// the dump; an abort waits for it, so that it reaches the destination
    /// after the states did.
    pub sockets_sending: Option<tokio::task::JoinHandle<SocketsSent>>,
    /// Post-copy: the lazy dump's CRIU, serving the stopped process's
    /// pages from the moment its images are written.
    pub page_server: Option<PageServer>,
    /// Post-copy whose pages follow by ferryd: the page stream, open from
    /// just before the Restore (dropped, it stops).
    pub page_sending: Option<crate::engine::pagesender::Sending>,
    /// The collection of this node's capture ring running during the
    /// transfer: whoever needs the delivered log or the captured packets
    /// next waits for it first (the ring has one reader at a time).
    pub collecting: Option<tokio::task::JoinHandle<()>>,
    /// In-cluster connections the peers' nodes translate for this
    /// migration, by node.
    pub translated: Vec<(String, Vec<ferry_proto::v1::InClusterFlow>)>,
}

/// Ends a post-copy dump's page server, if one runs (the process `pid`
/// stays stopped). `grace`: how long it may take to end by itself (the
/// daemon's close ends it); then, or at once with a zero grace, CRIU is
/// killed, the process kept stopped (SIGSTOP, pending while CRIU holds it,
/// takes effect when CRIU lets go).
pub(super) async fn stop_page_server(server: Option<PageServer>, pid: i32, grace: Duration) {
    let Some(server) = server else {
        return;
    };
    end_page_server_criu(pid, server.task, &server.criu_pid, grace).await;
    // CRIU's end of the tunnel is closed now; the pump passes that on and
    // ends. A tunnel the destination holds open is cut.
    if let Some(mut tunnel) = server.tunnel {
        match tokio::time::timeout(Duration::from_secs(2), &mut tunnel).await {
            Ok(Ok(Ok(moved))) => {
                tracing::info!(out = moved.out, into = moved.into, "page tunnel closed")
            }
            Ok(Ok(Err(e))) => tracing::info!(error = %e, "page tunnel ended"),
            Ok(Err(e)) => tracing::warn!(error = %e, "page tunnel task"),
            Err(_) => {
                tunnel.abort();
                tracing::warn!("page tunnel still open 2 s after the page server ended; cut");
            }
        }
    }
}

async fn end_page_server_criu(
    pid: i32,
    mut task: tokio::task::JoinHandle<Result<Dumped, criu::CriuError>>,
    criu_pid: &std::sync::atomic::AtomicI32,
    grace: Duration,
) {
    let log = |r: Result<Result<Dumped, criu::CriuError>, tokio::task::JoinError>| match r {
        Ok(Ok(_)) => tracing::info!("CRIU's page server ended"),
        Ok(Err(e)) => tracing::info!(error = %e, "CRIU's page server ended"),
        Err(e) => tracing::warn!(error = %e, "CRIU's page server task"),
    };
    if !grace.is_zero() {
        if let Ok(r) = tokio::time::timeout(grace, &mut task).await {
            log(r);
            return;
        }
        tracing::warn!("CRIU's page server still runs; killing it");
    }
    for p in process::process_tree(pid) {
        let _ = kill(Pid::from_raw(p), Signal::SIGSTOP);
    }
    let criu = criu_pid.load(std::sync::atomic::Ordering::SeqCst);
    if criu > 0
        && let Err(e) = kill(Pid::from_raw(criu), Signal::SIGKILL)
    {
        tracing::warn!(pid = criu, error = %e, "killing CRIU's page server");
    }
    match tokio::time::timeout(Duration::from_secs(10), task).await {
        Ok(r) => log(r),
        Err(_) => tracing::error!("CRIU's page server did not end 10 s after SIGKILL"),
    }
}

/// Undoes what the Translate phase had the peers' nodes do (an abort, or
/// a restarted agent settling a migration that did not commit): best
/// effort, logged.
pub(crate) async fn untranslate_in_cluster(
    engine: &Arc<Engine>,
    migration_id: &str,
    translated: Vec<(String, Vec<ferry_proto::v1::InClusterFlow>)>,
) {
    for (node, flows) in translated {
        let req = TranslationsRequest {
            migration_id: migration_id.to_owned(),
            flows,
        };
        // Never this node: a peer here is refused before the freeze.
        let result = match engine.cluster.peer(&node) {
            Some(peer) => match engine.links.connect(&peer).await {
                Ok(link) => link
                    .remove_translations(req)
                    .await
                    .map(|_| ())
                    .map_err(|s| peer_error(&node, s)),
                Err(e) => Err(e.into()),
            },
            None => Err(EngineError::Internal(format!("no peer config for {node}"))),
        };
        if let Err(e) = result {
            tracing::error!(node = %node, error = %e, "removing the translations of an aborted migration");
        }
    }
}
