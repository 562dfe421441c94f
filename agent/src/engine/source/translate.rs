//! Translate (only with in-cluster connections): the destination restored
//! them on its own cluster address and holds them; the source has each
//! peer's node rewrite those flows (`Peer.AddTranslations`) before its own
//! copy goes. An abort from here on undoes it (`RemoveTranslations`) before
//! the process resumes on the source ([`untranslate_in_cluster`]). See
//! [`crate::dataplane::translation`] for the whole picture.

use std::sync::Arc;
use std::time::Instant;

use ferry_proto::v1::{InClusterFlow, TranslationsRequest};

use super::Phase;
use super::carry::{Releasing, Translating};
use super::run::Run;
use crate::config::PeerConfig;
use crate::engine::EngineError;
use crate::engine::journal::OutgoingStage;
use crate::engine::link::{PeerLink, peer_error, silent};

pub(super) async fn translate(run: &mut Run, t: Translating) -> Result<Phase, EngineError> {
    translate_in_cluster(run, t.in_cluster).await?;
    let translate_end = Instant::now();
    let delivered = run.delivered_log().await;
    Ok(Phase::Release(Releasing {
        restored: t.restored,
        translate_end,
        delivered,
    }))
}

/// The node whose cluster address is `flow`'s remote end (this one's
/// own included), by name.
fn node_of(run: &Run, flow: &InClusterFlow) -> Result<String, EngineError> {
    let flow = crate::dataplane::translation::InClusterFlow::from_pb(flow)?;
    let ip = flow.remote.ip();
    if ip == run.engine.config.cluster.address {
        // Prepare refuses such a process, and the destination a connection
        // opened since (`FlowError::PeerOnSource`).
        return Err(EngineError::Internal(format!(
            "the destination reported a peer at {ip}, this node itself"
        )));
    }
    match run.engine.cluster.peer_at(ip) {
        Some(p) => Ok(p.name),
        None => Err(EngineError::Internal(format!(
            "the destination reported a peer at {ip}, which is no node of this cluster"
        ))),
    }
}

/// Has the node of each in-cluster peer translate its flows; records what
/// was done in the undo ledger for an abort.
async fn translate_in_cluster(run: &mut Run, flows: Vec<InClusterFlow>) -> Result<(), EngineError> {
    let mut by_node: Vec<(String, Vec<InClusterFlow>)> = Vec::new();
    for f in flows {
        let node = node_of(run, &f)?;
        match by_node.iter_mut().find(|(n, _)| *n == node) {
            Some((_, v)) => v.push(f),
            None => by_node.push((node, vec![f])),
        }
    }
    // Recorded first, every node (in the undo ledger, and in the journal
    // for a restart of this agent): a call that times out may still have
    // landed, and one never made is undone as nothing.
    run.undo.translated.extend(by_node.iter().cloned());
    run.record(OutgoingStage::Started)?;
    for (node, flows) in by_node {
        let req = TranslationsRequest {
            migration_id: run.p.migration_id.clone(),
            flows,
        };
        let peer = run
            .engine
            .cluster
            .peer(&node)
            .ok_or_else(|| EngineError::Internal(format!("no peer config for {node}")))?;
        let link = peer_link(run, &peer).await?;
        match tokio::time::timeout(run.deadline, link.add_translations(req)).await {
            Ok(Ok(r)) => {
                tracing::info!(node = %node, rules = r.rules, "in-cluster peers translate")
            }
            Ok(Err(s)) => return Err(peer_error(&node, s)),
            Err(_) => return Err(silent(&peer, "adding translations", run.deadline)),
        }
    }
    Ok(())
}

/// The link to `peer` opened before the freeze (the migration's own for
/// the destination), or a new one (none was opened, or it failed:
/// connecting again gives the error now).
async fn peer_link(run: &mut Run, peer: &PeerConfig) -> Result<Arc<dyn PeerLink>, EngineError> {
    if peer.name == run.p.destination.name {
        return Ok(run.p.link.clone());
    }
    if let Some(i) = run.peer_links.iter().position(|(n, _)| *n == peer.name) {
        let (_, link) = run.peer_links.swap_remove(i);
        match link.await {
            Ok(Ok(link)) => return Ok(link),
            Ok(Err(e)) => {
                tracing::debug!(node = %peer.name, error = %e, "peer connection opened before the freeze failed; connecting again")
            }
            Err(e) => {
                tracing::debug!(node = %peer.name, error = %e, "peer connection task failed; connecting again")
            }
        }
    }
    Ok(run.engine.links.connect(peer).await?)
}
