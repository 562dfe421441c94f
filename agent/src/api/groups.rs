//! The Control API's calls about distributed servers (`CreateGroup`,
//! `DeleteGroup`, `AddGroupMember`, `RemoveGroupMember`,
//! `HandoffConnection`): the request checked, the work
//! left to [`crate::groups`].

use std::time::Duration;

use ferry_proto::v1 as pb;
use tonic::Status;

use crate::groups::flow_from_pb;
use crate::groups::members::Change;
use crate::node::Node;

pub(super) async fn create(node: &Node, req: pb::CreateGroupRequest) -> Result<pb::Group, Status> {
    let g = req
        .group
        .as_ref()
        .ok_or_else(|| Status::invalid_argument("group: missing"))?;
    let group = crate::groups::Group::new_from_pb(g)?;
    Ok(node.groups.create(group).await?.to_pb())
}

pub(super) async fn delete(
    node: &Node,
    req: pb::DeleteGroupRequest,
) -> Result<pb::DeleteGroupResponse, Status> {
    let port = port_of(req.port)?;
    node.groups.delete(port).await?;
    Ok(pb::DeleteGroupResponse {})
}

/// A node joins a running group.
pub(super) async fn add_member(
    node: &Node,
    req: pb::AddGroupMemberRequest,
) -> Result<pb::Group, Status> {
    let port = port_of(req.port)?;
    let change = if req.backup {
        Change::AddBackup
    } else {
        Change::AddMember
    };
    Ok(node
        .groups
        .change_members(port, &req.node, change)
        .await?
        .to_pb())
}

/// A node leaves a running group.
pub(super) async fn remove_member(
    node: &Node,
    req: pb::RemoveGroupMemberRequest,
) -> Result<pb::Group, Status> {
    let port = port_of(req.port)?;
    Ok(node
        .groups
        .change_members(port, &req.node, Change::Remove)
        .await?
        .to_pb())
}

fn port_of(port: u32) -> Result<u16, Status> {
    u16::try_from(port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| Status::invalid_argument(format!("port: {port} is not a TCP port")))
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
