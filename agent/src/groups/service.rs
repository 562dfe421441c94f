//! The `Groups` service (served on the Peer port): what a node does when
//! another asks it to join a group or takes part in a handoff.

use std::sync::Arc;

use ferry_proto::v1 as pb;
use ferry_proto::v1::groups_server::Groups as GroupsApi;
use tonic::{Request, Response, Status};

use super::members::Change;
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
        let group = group_of(req.group.as_ref())?;
        self.groups.join(group).await?;
        Ok(Response::new(pb::JoinGroupResponse {}))
    }

    async fn leave(
        &self,
        request: Request<pb::LeaveGroupRequest>,
    ) -> Result<Response<pb::LeaveGroupResponse>, Status> {
        let port = port_of(request.into_inner().port)?;
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

    async fn record_connection(
        &self,
        request: Request<pb::RecordConnectionRequest>,
    ) -> Result<Response<pb::RecordConnectionResponse>, Status> {
        let req = request.into_inner();
        let flow = flow_from_pb(req.connection.as_ref())?;
        self.groups.record_connection(flow, &req.node)?;
        Ok(Response::new(pb::RecordConnectionResponse {}))
    }

    async fn connection_closed(
        &self,
        request: Request<pb::ConnectionClosedRequest>,
    ) -> Result<Response<pb::ConnectionClosedResponse>, Status> {
        let flow = flow_from_pb(request.into_inner().connection.as_ref())?;
        self.groups.forget_connection(flow).await;
        Ok(Response::new(pb::ConnectionClosedResponse {}))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let req = request.into_inner();
        let port = port_of(req.port)?;
        let group = self
            .groups
            .group(port)
            .ok_or_else(|| Status::not_found(format!("no group serves port {port} here")))?;
        // The asker missed a view (or was left out of it): it gets it, and
        // joins again.
        let newer = (group.epoch > req.epoch).then(|| group.to_pb());
        Ok(Response::new(pb::HeartbeatResponse {
            epoch: group.epoch,
            group: newer,
        }))
    }

    async fn view_prepare(
        &self,
        request: Request<pb::ViewPrepareRequest>,
    ) -> Result<Response<pb::ViewPrepareResponse>, Status> {
        let req = request.into_inner();
        let group = group_of(req.group.as_ref())?;
        let (accepted, epoch) = self.groups.promise(&group, &req.proposer);
        Ok(Response::new(pb::ViewPrepareResponse { accepted, epoch }))
    }

    async fn view_commit(
        &self,
        request: Request<pb::ViewCommitRequest>,
    ) -> Result<Response<pb::ViewCommitResponse>, Status> {
        let req = request.into_inner();
        let group = group_of(req.group.as_ref())?;
        let mut table = Vec::new();
        for c in &req.connections {
            table.push((flow_from_pb(c.connection.as_ref())?, c.node.clone()));
        }
        self.groups.apply_view(group, table).await?;
        Ok(Response::new(pb::ViewCommitResponse {}))
    }

    async fn get_view(
        &self,
        request: Request<pb::GetViewRequest>,
    ) -> Result<Response<pb::ViewCommitRequest>, Status> {
        let port = port_of(request.into_inner().port)?;
        Ok(Response::new(self.groups.view_and_table(port)?))
    }

    async fn change_members(
        &self,
        request: Request<pb::ChangeMembersRequest>,
    ) -> Result<Response<pb::Group>, Status> {
        let req = request.into_inner();
        let port = port_of(req.port)?;
        let change = Change::from_pb(req.change)?;
        let mut served = Vec::with_capacity(req.served.len());
        for c in &req.served {
            served.push(flow_from_pb(Some(c))?);
        }
        let g = self
            .groups
            .change_here(port, &req.node, change, served)
            .await?;
        Ok(Response::new(g.to_pb()))
    }
}

fn port_of(port: u32) -> Result<u16, Status> {
    u16::try_from(port)
        .map_err(|_| Status::invalid_argument(format!("port: {port} is not a TCP port")))
}

/// A request's group, checked: the error names the field.
pub fn group_of(g: Option<&pb::Group>) -> Result<Group, Status> {
    let g = g.ok_or_else(|| Status::invalid_argument("group: missing"))?;
    Ok(Group::from_pb(g)?)
}
