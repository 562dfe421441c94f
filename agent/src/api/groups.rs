//! The Control API's calls about distributed servers (`CreateGroup`,
//! `DeleteGroup`, `HandoffConnection`): the request checked, the work
//! left to [`crate::groups`].

use std::time::Duration;

use ferry_proto::v1 as pb;
use tonic::Status;

use crate::groups::{flow_from_pb, service::group_of};
use crate::node::Node;

pub(super) async fn create(node: &Node, req: pb::CreateGroupRequest) -> Result<pb::Group, Status> {
    let group = group_of(req.group.as_ref())?;
    Ok(node.groups.create(group).await?.to_pb())
}

pub(super) async fn delete(
    node: &Node,
    req: pb::DeleteGroupRequest,
) -> Result<pb::DeleteGroupResponse, Status> {
    let port = u16::try_from(req.port)
        .map_err(|_| Status::invalid_argument(format!("port: {} is not a TCP port", req.port)))?;
    node.groups.delete(port).await?;
    Ok(pb::DeleteGroupResponse {})
}

/// The operator's handoff, on the node serving the connection.
pub(super) async fn handoff(
    node: &Node,
    req: pb::HandoffConnectionRequest,
) -> Result<pb::HandoffConnectionResponse, Status> {
    let flow = flow_from_pb(req.connection.as_ref())?;
    if req.to.is_empty() {
        return Err(Status::invalid_argument("to: no node given"));
    }
    let drain = Duration::from_millis(u64::from(req.drain_ms));
    let (pid, done) = node.groups.handoff_held(flow, req.to, drain).await?;
    Ok(pb::HandoffConnectionResponse {
        acceptor: done.acceptor,
        donor_pid: pid,
        phases: done
            .phases
            .into_iter()
            .map(|p| pb::HandoffPhase {
                name: p.name,
                micros: p.micros,
            })
            .collect(),
        queued_bytes: done.queued_bytes,
    })
}
