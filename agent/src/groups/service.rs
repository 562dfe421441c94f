//! The `Groups` service (served on the Peer port): what a node does when
//! another asks it to join a group or takes part in a handoff.

use std::sync::Arc;

use ferry_proto::v1 as pb;
use ferry_proto::v1::groups_server::Groups as GroupsApi;
use tonic::{Request, Response, Status};

use super::{Group, Groups, flow_from_pb};

#[derive(Debug, Clone)]
pub struct GroupsService {
    groups: Arc<Groups>,
}

impl GroupsService {
    pub fn new(groups: Arc<Groups>) -> Self {
        Self { groups }
    }
}

#[tonic::async_trait]
impl GroupsApi for GroupsService {
    async fn join(
        &self,
        request: Request<pb::JoinGroupRequest>,
    ) -> Result<Response<pb::JoinGroupResponse>, Status> {
        let req = request.into_inner();
        let group = req
            .group
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("group: missing"))?;
        let group = Group::from_pb(group)?;
        self.groups.join(group).await?;
        Ok(Response::new(pb::JoinGroupResponse {}))
    }

    async fn leave(
        &self,
        request: Request<pb::LeaveGroupRequest>,
    ) -> Result<Response<pb::LeaveGroupResponse>, Status> {
        let port = u16::try_from(request.into_inner().port)
            .map_err(|_| Status::invalid_argument("port: not a TCP port"))?;
        self.groups.leave(port).await;
        Ok(Response::new(pb::LeaveGroupResponse {}))
    }

    async fn handoff_prepare(
        &self,
        request: Request<pb::HandoffPrepareRequest>,
    ) -> Result<Response<pb::HandoffPrepareResponse>, Status> {
        self.groups.accept_prepare(request.into_inner()).await?;
        Ok(Response::new(pb::HandoffPrepareResponse {}))
    }

    async fn handoff_transfer(
        &self,
        request: Request<pb::HandoffTransferRequest>,
    ) -> Result<Response<pb::HandoffTransferResponse>, Status> {
        let rebuild_us = self.groups.accept_transfer(request.into_inner()).await?;
        Ok(Response::new(pb::HandoffTransferResponse { rebuild_us }))
    }

    async fn handoff_commit(
        &self,
        request: Request<pb::HandoffCommitRequest>,
    ) -> Result<Response<pb::HandoffCommitResponse>, Status> {
        let id = request.into_inner().id;
        Ok(Response::new(self.groups.accept_commit(&id).await?))
    }

    async fn handoff_abort(
        &self,
        request: Request<pb::HandoffAbortRequest>,
    ) -> Result<Response<pb::HandoffAbortResponse>, Status> {
        let id = request.into_inner().id;
        let committed = self.groups.accept_abort(&id).await;
        Ok(Response::new(pb::HandoffAbortResponse { committed }))
    }

    async fn connection_moved(
        &self,
        request: Request<pb::ConnectionMovedRequest>,
    ) -> Result<Response<pb::ConnectionMovedResponse>, Status> {
        let req = request.into_inner();
        let flow = flow_from_pb(req.connection.as_ref())?;
        self.groups.connection_moved(flow, &req.node)?;
        Ok(Response::new(pb::ConnectionMovedResponse {}))
    }
}
