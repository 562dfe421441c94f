//! A distributed server's group as the API gives it and the agents hold
//! it: its port, contact node, backups, members, view and placement.

use ferry_proto::v1 as pb;
use std::collections::BTreeSet;

use super::GroupsError;
use crate::process::{PortKey, Transport};

/// A distributed server's group, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub port: u16,
    pub contact: String,
    /// The nodes that take over from the contact node, in order.
    pub backups: Vec<String>,
    /// Every member, the contact node and backups included, in the order
    /// given.
    pub members: Vec<String>,
    /// The view's number (1 for a new group).
    pub epoch: u64,
    /// How new connections are placed on the members.
    pub placement: ferry_policy::placement::Placement,
}

impl Group {
    /// Checks a group from the API or a peer: the error names the field.
    pub fn from_pb(g: &pb::Group) -> Result<Self, GroupsError> {
        let invalid = |field: &'static str, reason: String| GroupsError::Invalid { field, reason };
        let port = u16::try_from(g.port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| invalid("group.port", format!("{} is not a TCP port", g.port)))?;
        if g.contact.is_empty() {
            return Err(invalid("group.contact", "no contact node given".into()));
        }
        let mut seen = BTreeSet::new();
        for m in &g.members {
            if m.is_empty() {
                return Err(invalid("group.members", "an empty node name".into()));
            }
            if !seen.insert(m.as_str()) {
                return Err(invalid("group.members", format!("{m} is listed twice")));
            }
        }
        let mut members = g.members.clone();
        if !seen.contains(g.contact.as_str()) {
            members.insert(0, g.contact.clone());
        }
        let mut chain = BTreeSet::from([g.contact.as_str()]);
        for b in &g.backups {
            if !chain.insert(b.as_str()) {
                return Err(invalid(
                    "group.backups",
                    format!("{b} is the contact node or listed twice"),
                ));
            }
            if !members.contains(b) {
                members.push(b.clone());
            }
        }
        let placement =
            ferry_policy::placement::Placement::parse(&g.placement).ok_or_else(|| {
                invalid(
                    "group.placement",
                    format!("{:?} is not round-robin or least-connections", g.placement),
                )
            })?;
        Ok(Self {
            port,
            contact: g.contact.clone(),
            backups: g.backups.clone(),
            members,
            epoch: g.epoch.max(1),
            placement,
        })
    }

    /// Checks a new group from the API ([`Self::from_pb`]): it needs a
    /// member beside its contact node. A view after a failure may have
    /// none (the contact node alone serves until one joins).
    pub fn new_from_pb(g: &pb::Group) -> Result<Self, GroupsError> {
        let group = Self::from_pb(g)?;
        if group.members.len() < 2 {
            return Err(GroupsError::Invalid {
                field: "group.members",
                reason: "a group needs a member beside its contact node".into(),
            });
        }
        Ok(group)
    }

    pub fn to_pb(&self) -> pb::Group {
        pb::Group {
            port: u32::from(self.port),
            contact: self.contact.clone(),
            members: self.members.clone(),
            backups: self.backups.clone(),
            epoch: self.epoch,
            placement: self.placement.name().to_owned(),
        }
    }

    /// The contact node, then its backups in order: who takes over from
    /// whom.
    pub fn chain(&self) -> Vec<String> {
        std::iter::once(self.contact.clone())
            .chain(self.backups.iter().cloned())
            .collect()
    }

    /// The view without `node`: if it was the contact node, its first
    /// backup takes its place.
    pub fn without(&self, node: &str) -> Option<Group> {
        let mut chain: Vec<String> = self.chain().into_iter().filter(|n| n != node).collect();
        if chain.is_empty() {
            return None;
        }
        let contact = chain.remove(0);
        Some(Group {
            port: self.port,
            contact,
            backups: chain,
            members: self
                .members
                .iter()
                .filter(|n| *n != node)
                .cloned()
                .collect(),
            epoch: self.epoch + 1,
            placement: self.placement,
        })
    }

    /// The view with `node` added as a member, and also as the last backup
    /// if `backup`; `None` if it has that place already.
    pub fn with(&self, node: &str, backup: bool) -> Option<Group> {
        let member = self.members.iter().any(|m| m == node);
        let in_chain = self.chain().iter().any(|m| m == node);
        if member && (!backup || in_chain) {
            return None;
        }
        let mut next = self.clone();
        if !member {
            next.members.push(node.to_owned());
        }
        if backup && !in_chain {
            next.backups.push(node.to_owned());
        }
        next.epoch = self.epoch + 1;
        Some(next)
    }

    pub(super) fn port_key(&self) -> PortKey {
        PortKey {
            transport: Transport::Tcp,
            port: self.port,
        }
    }
}
