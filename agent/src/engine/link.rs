//! The source's connections to other agents: the destination's Peer API as
//! a migration uses it ([`PeerLink`]), and a way to open one to any node
//! ([`Connector`]). Behind traits so that the source side runs in unit
//! tests against a scripted destination; ferryd uses gRPC ([`GrpcLink`]).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ferry_proto::v1 as pb;
use ferry_proto::v1::peer_client::PeerClient;
use futures::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tonic::transport::Channel;

use super::EngineError;
use crate::cluster::{Cluster, Unreachable};
use crate::config::PeerConfig;

/// What a page tunnel's destination end sends back.
pub type TunnelIn = Pin<Box<dyn Stream<Item = Result<pb::TunnelBytes, Status>> + Send>>;

/// What a post-copy's destination asks for first.
pub type WantsIn = Pin<Box<dyn Stream<Item = Result<pb::PageWant, Status>> + Send>>;

/// Another agent's Peer API, as the source of a migration calls it. Each
/// call stands alone: several may run at once (the images beside the
/// connections' states).
#[tonic::async_trait]
pub trait PeerLink: Send + Sync + std::fmt::Debug {
    async fn hello(&self, req: pb::HelloRequest) -> Result<pb::HelloResponse, Status>;
    async fn prepare(&self, req: pb::PrepareRequest) -> Result<pb::PrepareResponse, Status>;
    async fn transfer_pages(
        &self,
        batches: ReceiverStream<pb::PageBatch>,
    ) -> Result<pb::TransferPagesResponse, Status>;
    async fn arm(&self, req: pb::ArmRequest) -> Result<pb::ArmResponse, Status>;
    async fn transfer_images(
        &self,
        chunks: ReceiverStream<pb::ImageChunk>,
    ) -> Result<pb::TransferImagesResponse, Status>;
    async fn transfer_sockets(
        &self,
        req: pb::TransferSocketsRequest,
    ) -> Result<pb::TransferSocketsResponse, Status>;
    async fn page_tunnel(&self, out: ReceiverStream<pb::TunnelBytes>) -> Result<TunnelIn, Status>;
    async fn post_copy_pages(&self, out: ReceiverStream<pb::PageBatch>) -> Result<WantsIn, Status>;
    async fn restore(&self, req: pb::RestoreRequest) -> Result<pb::RestoreResponse, Status>;
    async fn commit(&self, req: pb::CommitRequest) -> Result<pb::CommitResponse, Status>;
    async fn abort(&self, req: pb::AbortRequest) -> Result<pb::AbortResponse, Status>;
    async fn post_copy_status(
        &self,
        req: pb::PostCopyStatusRequest,
    ) -> Result<pb::PostCopyStatusResponse, Status>;
    async fn add_translations(
        &self,
        req: pb::TranslationsRequest,
    ) -> Result<pb::TranslationsResponse, Status>;
    async fn remove_translations(
        &self,
        req: pb::TranslationsRequest,
    ) -> Result<pb::TranslationsResponse, Status>;
}

/// Opens Peer links to the cluster's nodes.
#[tonic::async_trait]
pub trait Connector: Send + Sync + std::fmt::Debug {
    async fn connect(&self, peer: &PeerConfig) -> Result<Arc<dyn PeerLink>, Unreachable>;
}

/// A Peer link over gRPC (mutual TLS with `[tls]`).
#[derive(Debug, Clone)]
pub struct GrpcLink(PeerClient<Channel>);

#[tonic::async_trait]
impl PeerLink for GrpcLink {
    async fn hello(&self, req: pb::HelloRequest) -> Result<pb::HelloResponse, Status> {
        Ok(self.0.clone().hello(req).await?.into_inner())
    }
    async fn prepare(&self, req: pb::PrepareRequest) -> Result<pb::PrepareResponse, Status> {
        Ok(self.0.clone().prepare(req).await?.into_inner())
    }
    async fn transfer_pages(
        &self,
        batches: ReceiverStream<pb::PageBatch>,
    ) -> Result<pb::TransferPagesResponse, Status> {
        Ok(self.0.clone().transfer_pages(batches).await?.into_inner())
    }
    async fn arm(&self, req: pb::ArmRequest) -> Result<pb::ArmResponse, Status> {
        Ok(self.0.clone().arm(req).await?.into_inner())
    }
    async fn transfer_images(
        &self,
        chunks: ReceiverStream<pb::ImageChunk>,
    ) -> Result<pb::TransferImagesResponse, Status> {
        Ok(self.0.clone().transfer_images(chunks).await?.into_inner())
    }
    async fn transfer_sockets(
        &self,
        req: pb::TransferSocketsRequest,
    ) -> Result<pb::TransferSocketsResponse, Status> {
        Ok(self.0.clone().transfer_sockets(req).await?.into_inner())
    }
    async fn page_tunnel(&self, out: ReceiverStream<pb::TunnelBytes>) -> Result<TunnelIn, Status> {
        Ok(Box::pin(
            self.0.clone().page_tunnel(out).await?.into_inner(),
        ))
    }
    async fn post_copy_pages(&self, out: ReceiverStream<pb::PageBatch>) -> Result<WantsIn, Status> {
        Ok(Box::pin(
            self.0.clone().post_copy_pages(out).await?.into_inner(),
        ))
    }
    async fn restore(&self, req: pb::RestoreRequest) -> Result<pb::RestoreResponse, Status> {
        Ok(self.0.clone().restore(req).await?.into_inner())
    }
    async fn commit(&self, req: pb::CommitRequest) -> Result<pb::CommitResponse, Status> {
        Ok(self.0.clone().commit(req).await?.into_inner())
    }
    async fn abort(&self, req: pb::AbortRequest) -> Result<pb::AbortResponse, Status> {
        Ok(self.0.clone().abort(req).await?.into_inner())
    }
    async fn post_copy_status(
        &self,
        req: pb::PostCopyStatusRequest,
    ) -> Result<pb::PostCopyStatusResponse, Status> {
        Ok(self.0.clone().post_copy_status(req).await?.into_inner())
    }
    async fn add_translations(
        &self,
        req: pb::TranslationsRequest,
    ) -> Result<pb::TranslationsResponse, Status> {
        Ok(self.0.clone().add_translations(req).await?.into_inner())
    }
    async fn remove_translations(
        &self,
        req: pb::TranslationsRequest,
    ) -> Result<pb::TranslationsResponse, Status> {
        Ok(self.0.clone().remove_translations(req).await?.into_inner())
    }
}

#[tonic::async_trait]
impl Connector for Cluster {
    async fn connect(&self, peer: &PeerConfig) -> Result<Arc<dyn PeerLink>, Unreachable> {
        Ok(Arc::new(GrpcLink(self.peer_client(peer).await?)))
    }
}

/// What a peer's refusal means to the migration.
pub fn peer_error(node: &str, s: Status) -> EngineError {
    match s.code() {
        // The transport's cause (a keepalive ping unanswered, a reset...)
        // is in the status's source, its message only says "http2 error".
        tonic::Code::Unavailable => EngineError::PeerUnavailable {
            node: node.to_owned(),
            address: String::new(),
            reason: crate::error_chain::with_sources(
                s.message().to_owned(),
                std::error::Error::source(&s),
            ),
        },
        code => EngineError::Peer {
            node: node.to_owned(),
            code,
            message: s.message().to_owned(),
        },
    }
}

/// A peer that did not answer `step` within `waited`.
pub fn silent(peer: &PeerConfig, step: &str, waited: Duration) -> EngineError {
    EngineError::PeerUnavailable {
        node: peer.name.clone(),
        address: peer.address.to_string(),
        reason: format!(
            "no answer to {step} within {} s (peer_timeout_secs)",
            waited.as_secs()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_connection_names_its_cause() {
        let mut s = Status::unavailable("http2 error");
        s.set_source(std::sync::Arc::new(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "keep-alive timed out",
        )));
        let e = peer_error("node2", s);
        assert!(matches!(e, EngineError::PeerUnavailable { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "node2 unreachable: http2 error: keep-alive timed out"
        );
        // A refusal keeps its code and message.
        let e = peer_error("node2", Status::resource_exhausted("full"));
        assert_eq!(e.to_string(), "node2: full");
    }
}
