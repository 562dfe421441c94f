use std::sync::Arc;

use ferry_proto::v1::peer_server::Peer;
use ferry_proto::v1::{
    AbortRequest, AbortResponse, ArmRequest, ArmResponse, CommitRequest, CommitResponse,
    HelloRequest, HelloResponse, ImageChunk, PortOwnershipRequest, PortOwnershipResponse,
    PostCopyStatusRequest, PostCopyStatusResponse, PrepareRequest, PrepareResponse, RestoreRequest,
    RestoreResponse, TransferImagesResponse, TranslationsRequest, TranslationsResponse,
};
use tonic::{Request, Response, Status, Streaming};

use crate::engine::{Engine, EngineError, destination};

async fn finish<T>(
    task: tokio::task::JoinHandle<Result<T, crate::engine::EngineError>>,
) -> Result<T, Status> {
    match task.await {
        Ok(r) => r.map_err(Status::from),
        Err(e) => Err(Status::internal(format!("peer step task failed: {e}"))),
    }
}

/// Which translation change a call asks for.
#[derive(Debug, Clone, Copy)]
enum Change {
    Add,
    Remove,
}

#[derive(Debug, Clone)]
pub struct PeerService {
    engine: Arc<Engine>,
}

/// The node a call's client certificate names (the Peer port's TLS
/// layer puts it there); None without TLS.
fn caller<T>(request: &Request<T>) -> Option<String> {
    request
        .extensions()
        .get::<crate::security::authz::Caller>()
        .map(|c| c.name.clone())
}

/// Refuses a request whose claimed node is not the one its certificate
/// names: a node may speak only for itself.
fn claims_own_name<T>(request: &Request<T>, field: &str, claimed: &str) -> Result<(), Status> {
    match caller(request) {
        Some(node) if node != claimed => Err(Status::permission_denied(format!(
            "{field}: {claimed:?}, but the client certificate is {node:?}'s"
        ))),
        _ => Ok(()),
    }
}

/// A node may ask for translations only of flows whose process end was on
/// its own cluster address (it is the migration's source), moving to
/// another cluster node's: otherwise any member could redirect another
/// node's in-cluster connections to itself.
fn flows_are_callers(
    engine: &Engine,
    caller: &str,
    req: &TranslationsRequest,
) -> Result<(), Status> {
    let Some(own) = engine.cluster.cluster_address_of(caller) else {
        return Err(Status::permission_denied(format!(
            "{caller} has no cluster address this node knows: it cannot ask for translations"
        )));
    };
    let ip = |s: &str| {
        s.parse::<std::net::SocketAddr>()
            .ok()
            .map(|a| a.ip().to_canonical())
    };
    for (i, f) in req.flows.iter().enumerate() {
        // Unparsable addresses are left to the translation's own checks
        // (INVALID_ARGUMENT naming the field).
        if let Some(old) = ip(&f.old_local)
            && old != own
        {
            return Err(Status::permission_denied(format!(
                "flows[{i}].old_local: {} is not {caller}'s cluster address ({own}); a node asks only for its own connections",
                f.old_local
            )));
        }
        if let Some(new) = ip(&f.new_local)
            && engine.cluster.peer_at(new).is_none()
            && new != engine.config.cluster.address
        {
            return Err(Status::permission_denied(format!(
                "flows[{i}].new_local: {} is no cluster node's address",
                f.new_local
            )));
        }
    }
    Ok(())
}

impl PeerService {
    pub fn new(engine: Arc<Engine>) -> Self {
        Self { engine }
    }

    /// Refuses a step of incoming migration `migration_id` from any node but
    /// the one that prepared it.
    fn check_its_source<T>(&self, request: &Request<T>, migration_id: &str) -> Result<(), Status> {
        let Some(node) = caller(request) else {
            return Ok(());
        };
        // Not the incoming slot: TransferImages holds it for its whole
        // stream, and TransferSockets must not wait for that.
        match self.engine.incoming.source_of(migration_id) {
            Some(from) if from != node => Err(Status::permission_denied(format!(
                "migration_id: {migration_id} comes from {from:?}, not {node:?}"
            ))),
            _ => Ok(()),
        }
    }

    /// Runs a translation change (BPF maps: blocking) off the runtime.
    async fn translations(
        &self,
        request: Request<TranslationsRequest>,
        change: Change,
    ) -> Result<Response<TranslationsResponse>, Status> {
        if let Some(node) = caller(&request) {
            flows_are_callers(&self.engine, &node, request.get_ref())?;
        }
        let engine = self.engine.clone();
        let req = request.into_inner();
        let rules = finish(tokio::task::spawn_blocking(move || {
            let here = engine.here();
            let d = &engine.dataplane;
            match change {
                Change::Add => d.add_translations(here, &req),
                Change::Remove => d.remove_translations(here, &req),
            }
            .map_err(EngineError::from)
        }))
        .await?;
        Ok(Response::new(TranslationsResponse { rules }))
    }
}

/// This agent's own hard resource limits (read at each Hello: an operator
/// may change them with prlimit(1) while it runs); none if unreadable.
async fn own_hard_limits() -> Vec<ferry_proto::v1::ResourceLimit> {
    let read = tokio::task::spawn_blocking(|| std::fs::read_to_string("/proc/self/limits")).await;
    match read {
        Ok(Ok(text)) => crate::process::privileges::hard_limits(&text)
            .into_iter()
            .map(|(name, hard)| ferry_proto::v1::ResourceLimit { name, hard })
            .collect(),
        _ => Vec::new(),
    }
}

#[tonic::async_trait]
impl Peer for PeerService {
    async fn hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloResponse>, Status> {
        claims_own_name(&request, "node", &request.get_ref().node)?;
        let req = request.into_inner();
        let version =
            ferry_proto::negotiate_peer_version(&req.protocol_versions).ok_or_else(|| {
                Status::failed_precondition(format!(
                    "protocol_versions: {} offers {:?}, {} speaks {:?}",
                    req.node,
                    req.protocol_versions,
                    self.engine.node(),
                    ferry_proto::PEER_PROTOCOL_VERSIONS
                ))
            })?;
        let host = crate::host_features::host_off_runtime(&self.engine.config.features_off)
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        let hard_limits = own_hard_limits().await;
        Ok(Response::new(HelloResponse {
            node: self.engine.node().to_owned(),
            protocol_version: version,
            managed_processes: self.engine.processes.registry().len() as u32,
            cordoned: self.engine.cordon.is_on(),
            kernel: host.kernel.clone(),
            features: host.to_pb(),
            hard_limits,
            public_addresses: self.engine.config.public.addresses().to_strings(),
        }))
    }

    async fn prepare(
        &self,
        request: Request<PrepareRequest>,
    ) -> Result<Response<PrepareResponse>, Status> {
        claims_own_name(&request, "source_node", &request.get_ref().source_node)?;
        let takes = destination::prepare(&self.engine, request.into_inner()).await?;
        Ok(Response::new(takes))
    }

    async fn arm(&self, request: Request<ArmRequest>) -> Result<Response<ArmResponse>, Status> {
        self.check_its_source(&request, &request.get_ref().migration_id)?;
        // Spawned: once started, the capture is either fully armed and
        // recorded in the slot, or not at all.
        let engine = self.engine.clone();
        let req = request.into_inner();
        let staging = finish(tokio::spawn(
            async move { destination::arm(&engine, req).await },
        ))
        .await?;
        // Answered once the sockets are open: the source freezes the
        // process right after, and the freeze's rebuild takes them.
        destination::stage(staging).await;
        Ok(Response::new(ArmResponse {}))
    }

    async fn transfer_images(
        &self,
        request: Request<Streaming<ImageChunk>>,
    ) -> Result<Response<TransferImagesResponse>, Status> {
        let caller = caller(&request);
        Ok(Response::new(
            destination::transfer_images(&self.engine, caller, request.into_inner()).await?,
        ))
    }

    async fn transfer_pages(
        &self,
        request: Request<Streaming<ferry_proto::v1::PageBatch>>,
    ) -> Result<Response<ferry_proto::v1::TransferPagesResponse>, Status> {
        let caller = caller(&request);
        Ok(Response::new(
            destination::transfer_pages(&self.engine, caller, request.into_inner()).await?,
        ))
    }

    async fn transfer_sockets(
        &self,
        request: Request<ferry_proto::v1::TransferSocketsRequest>,
    ) -> Result<Response<ferry_proto::v1::TransferSocketsResponse>, Status> {
        claims_own_name(&request, "source_node", &request.get_ref().source_node)?;
        self.check_its_source(&request, &request.get_ref().migration_id)?;
        let engine = self.engine.clone();
        let req = request.into_inner();
        Ok(Response::new(
            finish(tokio::spawn(async move {
                destination::transfer_sockets(&engine, req).await
            }))
            .await?,
        ))
    }

    async fn restore(
        &self,
        request: Request<RestoreRequest>,
    ) -> Result<Response<RestoreResponse>, Status> {
        self.check_its_source(&request, &request.get_ref().migration_id)?;
        // Spawned, here and below: if the source gives up and cancels the
        // call, a step that started (a CRIU restore, a resume, a discard)
        // still runs to its end and records what it did.
        let engine = self.engine.clone();
        let req = request.into_inner();
        Ok(Response::new(
            finish(tokio::spawn(async move {
                destination::restore(&engine, req).await
            }))
            .await?,
        ))
    }

    async fn commit(
        &self,
        request: Request<CommitRequest>,
    ) -> Result<Response<CommitResponse>, Status> {
        self.check_its_source(&request, &request.get_ref().migration_id)?;
        let engine = self.engine.clone();
        let req = request.into_inner();
        Ok(Response::new(
            finish(tokio::spawn(async move {
                destination::commit(&engine, req).await
            }))
            .await?,
        ))
    }

    async fn abort(
        &self,
        request: Request<AbortRequest>,
    ) -> Result<Response<AbortResponse>, Status> {
        self.check_its_source(&request, &request.get_ref().migration_id)?;
        let engine = self.engine.clone();
        let caller = caller(&request);
        let req = request.into_inner();
        let committed = finish(tokio::spawn(async move {
            destination::abort(&engine, req, caller.as_deref()).await
        }))
        .await?;
        Ok(Response::new(AbortResponse { committed }))
    }

    type PageTunnelStream = destination::TunnelOut;

    async fn page_tunnel(
        &self,
        request: Request<Streaming<ferry_proto::v1::TunnelBytes>>,
    ) -> Result<Response<Self::PageTunnelStream>, Status> {
        let caller = caller(&request);
        Ok(Response::new(
            destination::page_tunnel(&self.engine, caller, request.into_inner()).await?,
        ))
    }

    type PostCopyPagesStream = destination::WantsOut;

    async fn post_copy_pages(
        &self,
        request: Request<Streaming<ferry_proto::v1::PageBatch>>,
    ) -> Result<Response<Self::PostCopyPagesStream>, Status> {
        let caller = caller(&request);
        Ok(Response::new(
            destination::post_copy_pages(&self.engine, caller, request.into_inner()).await?,
        ))
    }

    async fn post_copy_status(
        &self,
        request: Request<PostCopyStatusRequest>,
    ) -> Result<Response<PostCopyStatusResponse>, Status> {
        let engine = self.engine.clone();
        let caller = caller(&request);
        let req = request.into_inner();
        Ok(Response::new(
            destination::post_copy_status(&engine, caller, req)
                .await
                .map_err(Status::from)?,
        ))
    }

    async fn add_translations(
        &self,
        request: Request<TranslationsRequest>,
    ) -> Result<Response<TranslationsResponse>, Status> {
        self.translations(request, Change::Add).await
    }

    async fn remove_translations(
        &self,
        request: Request<TranslationsRequest>,
    ) -> Result<Response<TranslationsResponse>, Status> {
        self.translations(request, Change::Remove).await
    }

    async fn port_ownership(
        &self,
        request: Request<PortOwnershipRequest>,
    ) -> Result<Response<PortOwnershipResponse>, Status> {
        let req = request.into_inner();
        let asked = req
            .ports
            .iter()
            .map(crate::process::PortKey::from_pb)
            .collect::<Result<Vec<_>, _>>()
            .map_err(crate::engine::EngineError::from)?;
        let (owned, claiming) = self.engine.ports.ownership_answer(&asked);
        Ok(Response::new(PortOwnershipResponse {
            node: self.engine.node().to_owned(),
            owned: owned.iter().map(crate::process::PortKey::to_pb).collect(),
            claiming: claiming
                .iter()
                .map(crate::process::PortKey::to_pb)
                .collect(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::destination::fixture::Fixture;
    use ferry_proto::v1::{InClusterFlow, Protocol};

    fn flow(old_local: &str, new_local: &str) -> TranslationsRequest {
        TranslationsRequest {
            migration_id: "m1".into(),
            flows: vec![InClusterFlow {
                protocol: Protocol::Tcp as i32,
                old_local: old_local.into(),
                new_local: new_local.into(),
                remote: "198.19.0.2:5432".into(),
            }],
        }
    }

    #[test]
    fn a_node_asks_only_for_translations_of_its_own_connections() {
        let f = Fixture::new(&[("node1", "198.19.0.1"), ("node3", "198.19.0.3")]);
        let a = &f.engine;
        // node1's connection moving to node3: node1 may ask.
        flows_are_callers(a, "node1", &flow("198.19.0.1:40000", "198.19.0.3:40000")).unwrap();
        // node3 may not redirect node1's connection (to itself or anywhere).
        let e = flows_are_callers(a, "node3", &flow("198.19.0.1:40000", "198.19.0.3:40000"))
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(e.message().starts_with("flows[0].old_local"), "{e:?}");
        // Nor send it outside the cluster.
        let e = flows_are_callers(a, "node1", &flow("198.19.0.1:40000", "198.18.9.9:40000"))
            .unwrap_err();
        assert!(e.message().starts_with("flows[0].new_local"), "{e:?}");
        // A node this one does not know cannot ask at all.
        let e = flows_are_callers(a, "node9", &flow("198.19.0.9:1", "198.19.0.3:1")).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    }
}
