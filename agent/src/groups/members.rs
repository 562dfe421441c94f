//! A running group's members change (the XtreemOS distributed servers:
//! serving nodes register with the contact node; a node taken as failed
//! is told to join again).
//!
//! Every change is made by the contact node, by the chain's two-phase
//! commit ([`super::chain`]), one at a time: an operator's
//! (`AddGroupMember`, `RemoveGroupMember` on any node, passed to the
//! contact node), or a node's own when a heartbeat's answer shows a newer
//! view that it missed or that left it out ([`Groups::rejoin`]). A node
//! that joins again brings the connections it serves: the contact node
//! records them on the chain and leaves them to it before the view that
//! takes it back, so a node that was only slow loses none of them.
//!
//! What cannot be helped: while a contact node that was only slow still
//! believes it is one, its successor has taken over, and both answer new
//! connections until it finds out (at its next heartbeat); packets of the
//! connections it kept for itself that reach the new contact node in that
//! time are reset there. A group is as safe as its failure detector is
//! right, as in the original.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use ferry_proto::v1 as pb;

use super::{Group, Groups, GroupsError, connection_pb};
use crate::dataplane::{Flow, FlowState, PortState};

/// How long a change of members may take: the contact node's two phases
/// and the recording of a rejoining node's connections on the chain.
const CHANGE_TIMEOUT: Duration = Duration::from_secs(5);

/// A change of a group's members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    AddMember,
    /// Also into the chain, after the last backup.
    AddBackup,
    Remove,
}

impl Change {
    pub fn from_pb(c: i32) -> Result<Self, GroupsError> {
        match pb::MemberChange::try_from(c) {
            Ok(pb::MemberChange::AddMember) => Ok(Change::AddMember),
            Ok(pb::MemberChange::AddBackup) => Ok(Change::AddBackup),
            Ok(pb::MemberChange::Remove) => Ok(Change::Remove),
            _ => Err(GroupsError::Invalid {
                field: "change",
                reason: format!("{c} is not a change of members"),
            }),
        }
    }

    fn to_pb(self) -> pb::MemberChange {
        match self {
            Change::AddMember => pb::MemberChange::AddMember,
            Change::AddBackup => pb::MemberChange::AddBackup,
            Change::Remove => pb::MemberChange::Remove,
        }
    }
}

impl Groups {
    /// The Control API's change of members, on any node of the group: made
    /// here if this node is the contact node, else passed to it.
    pub async fn change_members(
        self: &Arc<Self>,
        port: u16,
        node: &str,
        change: Change,
    ) -> Result<Group, GroupsError> {
        if node.is_empty() {
            return Err(GroupsError::Invalid {
                field: "node",
                reason: "no node given".into(),
            });
        }
        let group = self.group(port).ok_or_else(|| GroupsError::NoGroup {
            port,
            node: self.node.clone(),
        })?;
        if group.contact == self.node {
            self.change_here(port, node, change, Vec::new()).await
        } else {
            self.ask_contact(&group.contact, port, node, change, Vec::new())
                .await
        }
    }

    async fn ask_contact(
        &self,
        contact: &str,
        port: u16,
        node: &str,
        change: Change,
        served: Vec<Flow>,
    ) -> Result<Group, GroupsError> {
        let req = pb::ChangeMembersRequest {
            port: u32::from(port),
            node: node.to_owned(),
            change: change.to_pb() as i32,
            served: served.into_iter().map(connection_pb).collect(),
        };
        let g = self
            .call(contact, CHANGE_TIMEOUT, |mut c| async move {
                c.change_members(req).await
            })
            .await?;
        Group::from_pb(&g)
    }

    /// On the contact node: makes and commits the view with `node` added
    /// or removed, and returns it. `served`: the connections a node joining
    /// again serves.
    pub async fn change_here(
        self: &Arc<Self>,
        port: u16,
        node: &str,
        change: Change,
        served: Vec<Flow>,
    ) -> Result<Group, GroupsError> {
        let _turn = self.changing.lock().await;
        let group = self.group(port).ok_or_else(|| GroupsError::NoGroup {
            port,
            node: self.node.clone(),
        })?;
        if group.contact != self.node {
            return Err(GroupsError::NotContact {
                port,
                node: self.node.clone(),
                contact: group.contact,
            });
        }
        match change {
            Change::Remove => self.remove_member(group, node).await,
            Change::AddMember | Change::AddBackup => {
                self.add_member(group, node, change == Change::AddBackup, served)
                    .await
            }
        }
    }

    async fn add_member(
        self: &Arc<Self>,
        group: Group,
        node: &str,
        backup: bool,
        served: Vec<Flow>,
    ) -> Result<Group, GroupsError> {
        if node != self.node && self.cluster.peer(node).is_none() {
            return Err(GroupsError::UnknownNode {
                node: node.to_owned(),
                here: self.node.clone(),
            });
        }
        for flow in &served {
            if flow.local_port != group.port {
                return Err(GroupsError::Invalid {
                    field: "served",
                    reason: format!("{flow} is not a connection of port {}", group.port),
                });
            }
        }
        // The connections of a node joining again are left to it before
        // any view takes it back: recorded here, kept out of this node's
        // stack by an `Elsewhere` entry, and recorded on the chain.
        if !served.is_empty() {
            for flow in &served {
                self.record_connection(*flow, node)?;
            }
            self.set_flows(served.clone(), FlowState::Elsewhere).await?;
            for flow in &served {
                self.record_on_chain(&group, *flow, node).await;
            }
            tracing::info!(
                port = group.port,
                node,
                connections = served.len(),
                "the connections of a node joining again left to it"
            );
        }
        let Some(next) = group.with(node, backup) else {
            // Already there: the node missed the view; it gets it again,
            // with the table.
            if node != self.node {
                self.commit_view(group.clone(), vec![node.to_owned()], false)
                    .await;
            }
            return Ok(group);
        };
        let next = self
            .commit_change(
                &group,
                next,
                Some(node),
                false,
                &format!("that adds {node}"),
            )
            .await?;
        tracing::info!(
            port = group.port,
            node,
            backup,
            epoch = next.epoch,
            "a node joined the group"
        );
        Ok(next)
    }

    async fn remove_member(
        self: &Arc<Self>,
        group: Group,
        node: &str,
    ) -> Result<Group, GroupsError> {
        if !group.members.iter().any(|m| m == node) {
            return Err(GroupsError::NodeNotInGroup {
                node: node.to_owned(),
                port: group.port,
                members: group.members.join(", "),
            });
        }
        let serving = if node == self.node {
            self.own_connections(group.port, true).await?.len()
        } else {
            self.groups()
                .get(&group.port)
                .map(|g| g.connections.values().filter(|n| *n == node).count())
                .unwrap_or(0)
        };
        if serving > 0 {
            return Err(GroupsError::Refused {
                port: group.port,
                reason: format!(
                    "{node} serves {serving} of its connections: hand them off first (ferry handoff)"
                ),
            });
        }
        let next = group.without(node).ok_or_else(|| GroupsError::Refused {
            port: group.port,
            reason: format!("{node} is its contact node and no backup can take its place"),
        })?;
        if next.members.len() < 2 {
            return Err(GroupsError::Refused {
                port: group.port,
                reason: format!(
                    "without {node} it would have no member beside its contact node: delete the group instead"
                ),
            });
        }
        // The node removed is told too: it leaves (gives its port back),
        // first if it is this node (see `commit_view`).
        let next = self
            .commit_change(
                &group,
                next,
                None,
                node == self.node,
                &format!("without {node}"),
            )
            .await?;
        tracing::info!(
            port = group.port,
            node,
            epoch = next.epoch,
            "a node left the group"
        );
        Ok(next)
    }

    /// Both phases of a change from `group` to `next` (its epoch set
    /// here): `joining` votes too; every member of either view is told.
    /// A silent voter changes nothing: the error names it.
    async fn commit_change(
        self: &Arc<Self>,
        group: &Group,
        mut next: Group,
        joining: Option<&str>,
        here_first: bool,
        what: &str,
    ) -> Result<Group, GroupsError> {
        next.epoch = self.next_epoch(group.port)?;
        let also: Vec<String> = joining.map(str::to_owned).into_iter().collect();
        let silent = self.prepare(&next, &also).await?;
        if !silent.is_empty() {
            return Err(GroupsError::Unreachable {
                node: silent.join(", "),
                reason: format!(
                    "no vote on the view at epoch {} {what}; nothing changed",
                    next.epoch
                ),
            });
        }
        let targets = union(&group.members, &next.members);
        self.commit_view(next.clone(), targets, here_first).await;
        Ok(next)
    }

    /// A contact node that is one no longer: its own connections get
    /// `Owned` entries (they were its by the port) and are recorded as
    /// its, then the port stops taking new connections here. Twice, for
    /// a connection accepted between the first reading and the switch.
    pub(super) async fn step_down(self: &Arc<Self>, port: u16) -> Result<(), GroupsError> {
        let mut kept = BTreeSet::new();
        for pass in 0..2 {
            let own = self.own_connections(port, true).await?;
            let new: Vec<Flow> = own.into_iter().filter(|f| kept.insert(*f)).collect();
            if let Some(g) = self.groups().get_mut(&port) {
                for f in &new {
                    g.connections.insert(*f, self.node.clone());
                }
            }
            self.set_flows(new, FlowState::Owned).await?;
            if pass == 0 {
                self.share_port(port, PortState::SharedMember).await?;
            }
        }
        tracing::warn!(
            port,
            kept = kept.len(),
            "this node is not the group's contact node any more"
        );
        self.publish(
            port,
            "member",
            format!(
                "no longer the contact node: {} connections of its own kept",
                kept.len()
            ),
        );
        Ok(())
    }

    /// A heartbeat's answer showed `newer`, a view after `mine`: asks its
    /// contact node, in the background and one call at a time, to take this
    /// node back or send the view again.
    pub(super) fn start_rejoin(self: &Arc<Self>, mine: Group, newer: Group) {
        {
            let mut groups = self.groups();
            let Some(g) = groups.get_mut(&mine.port) else {
                return;
            };
            if g.rejoining || g.group.epoch >= newer.epoch {
                return;
            }
            g.rejoining = true;
        }
        let me = Arc::clone(self);
        tokio::spawn(async move {
            let port = mine.port;
            if let Err(e) = me.rejoin(&mine, &newer).await {
                tracing::warn!(port, contact = %newer.contact, error = %e, "joining the group again failed; tried again at a next heartbeat");
            }
            if let Some(g) = me.groups().get_mut(&port) {
                g.rejoining = false;
            }
        });
    }

    /// Joins the group again (it left this node out: taken as failed) or
    /// gets the view it missed, with the connections this node serves. A
    /// contact node that was replaced stops taking new connections first.
    async fn rejoin(self: &Arc<Self>, mine: &Group, newer: &Group) -> Result<(), GroupsError> {
        let port = mine.port;
        if newer.contact == self.node {
            return self.apply_view(newer.clone(), Vec::new()).await;
        }
        if mine.contact == self.node {
            self.step_down(port).await?;
        }
        let served: Vec<Flow> = self
            .groups()
            .get(&port)
            .map(|g| {
                g.connections
                    .iter()
                    .filter(|(_, n)| **n == self.node)
                    .map(|(f, _)| *f)
                    .collect()
            })
            .unwrap_or_default();
        let left_out = !newer.members.contains(&self.node);
        let in_chain = if left_out {
            mine.chain().contains(&self.node)
        } else {
            newer.chain().contains(&self.node)
        };
        let change = if in_chain {
            Change::AddBackup
        } else {
            Change::AddMember
        };
        if left_out {
            tracing::warn!(port, epoch = newer.epoch, contact = %newer.contact, serving = served.len(), "left out of the group's view (taken as failed): joining again");
            self.publish(
                port,
                "rejoin",
                format!(
                    "left out of the view at epoch {}: joining again with {} connections",
                    newer.epoch,
                    served.len()
                ),
            );
        } else {
            tracing::info!(
                port,
                epoch = newer.epoch,
                "a view missed here: asking for it"
            );
        }
        let g = self
            .ask_contact(&newer.contact, port, &self.node, change, served)
            .await?;
        tracing::info!(port, epoch = g.epoch, "back in the group's view");
        Ok(())
    }
}

/// `a`, then what of `b` is not in it.
fn union(a: &[String], b: &[String]) -> Vec<String> {
    let mut all = a.to_vec();
    for n in b {
        if !all.contains(n) {
            all.push(n.clone());
        }
    }
    all
}
