//! The groups outlive their agent: a restarted ferryd (an upgrade, a
//! crash) serves them again.
//!
//! What the node's kernel keeps needs no saving: the filter's maps are
//! pinned (each connection's entry stays), and the connections this node
//! serves are in its stack. What ferryd alone knew is each group's view:
//! it is written to `<work_dir>/groups.json` at each change here. At start
//! ([`Groups::restore`]) the view is read back, the port filtered as it
//! says, and this node's own connections found in its stack; then, once
//! the APIs serve, the node asks the others of its view's chain for theirs
//! ([`Groups::resync`]): a newer view that keeps it is taken with the
//! table of connections; one that left it out (its agent was away longer
//! than the failure detector waits) makes it join again with the
//! connections it serves, as any node taken as failed does.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferry_proto::v1 as pb;
use serde::{Deserialize, Serialize};

use super::{Group, GroupState, Groups, GroupsError, flow_from_pb};
use crate::dataplane::{Flow, FlowState, PortState};
use crate::sync::lock;

/// How long one question to another node of the chain may take.
const ASK_TIMEOUT: Duration = Duration::from_millis(500);

/// How long a restored group waits for any node of its chain to answer
/// before its saved view is taken as the group's.
const SILENT_CHAIN: Duration = Duration::from_secs(3);

/// One group's view as saved.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct SavedView {
    port: u16,
    contact: String,
    backups: Vec<String>,
    members: Vec<String>,
    epoch: u64,
    placement: String,
}

impl SavedView {
    fn of(g: &Group) -> Self {
        Self {
            port: g.port,
            contact: g.contact.clone(),
            backups: g.backups.clone(),
            members: g.members.clone(),
            epoch: g.epoch,
            placement: g.placement.name().to_owned(),
        }
    }

    fn group(&self) -> Result<Group, GroupsError> {
        Group::from_pb(&pb::Group {
            port: u32::from(self.port),
            contact: self.contact.clone(),
            members: self.members.clone(),
            backups: self.backups.clone(),
            epoch: self.epoch,
            placement: self.placement.clone(),
        })
    }
}

/// Where and how the views are written: the newest snapshot wins, whatever
/// order the blocking pool runs the writes in.
#[derive(Debug)]
pub(super) struct ViewsFile {
    path: PathBuf,
    taken: AtomicU64,
    written: std::sync::Mutex<u64>,
}

impl ViewsFile {
    pub(super) fn new(path: PathBuf) -> Self {
        Self {
            path,
            taken: AtomicU64::new(0),
            written: std::sync::Mutex::new(0),
        }
    }

    /// Writes `views` unless a newer snapshot was written already; a temp
    /// file renamed over the old one, so a crash leaves one or the other.
    fn write(&self, snapshot: u64, views: &[SavedView]) -> std::io::Result<()> {
        let mut written = lock(&self.written);
        if *written >= snapshot {
            return Ok(());
        }
        let text = serde_json::to_vec_pretty(views).map_err(std::io::Error::other)?;
        let tmp = self.path.with_extension("json.tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &self.path)?;
        *written = snapshot;
        Ok(())
    }

    fn read(&self) -> std::io::Result<Vec<SavedView>> {
        match std::fs::read(&self.path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(std::io::Error::other),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }
}

impl Groups {
    /// Saves the views held now (after a change here), off the runtime.
    pub(super) fn save_views(&self) {
        let Some(file) = self.saved.clone() else {
            return;
        };
        // Numbered under the groups' lock: a later number is a later state.
        let (views, snapshot) = {
            let groups = self.groups();
            let views: Vec<SavedView> = groups.values().map(|g| SavedView::of(&g.group)).collect();
            (views, file.taken.fetch_add(1, Ordering::SeqCst) + 1)
        };
        tokio::task::spawn_blocking(move || {
            if let Err(e) = file.write(snapshot, &views) {
                tracing::warn!(path = %file.path.display(), error = %e, "saving the groups' views");
            }
        });
    }

    /// At start, before the port reconciler runs: the saved groups are
    /// this node's again, their ports filtered as their views say, and the
    /// connections this node serves (in its stack) owned and recorded as
    /// its. Returns how many; each is then confirmed by [`Self::resync`].
    pub async fn restore(self: &Arc<Self>) -> Result<usize, GroupsError> {
        let Some(file) = self.saved.clone() else {
            return Ok(0);
        };
        let saved = tokio::task::spawn_blocking(move || file.read())
            .await
            .map_err(|e| GroupsError::Internal(e.to_string()))?
            .map_err(|e| GroupsError::Internal(format!("reading the saved groups: {e}")))?;
        let mut restored = 0;
        for s in saved {
            let group = s.group()?;
            if !group.members.contains(&self.node) {
                continue;
            }
            let port = group.port;
            self.groups().insert(port, GroupState::new(group.clone()));
            // Its own connections by their entries (kept in the pinned map
            // for a member; a contact node's were the port's), recorded as
            // its so that the sweep forgets them when they end.
            let own = self
                .own_connections(port, group.contact == self.node)
                .await?;
            if let Some(g) = self.groups().get_mut(&port) {
                for f in &own {
                    g.connections.insert(*f, self.node.clone());
                }
            }
            self.set_flows(own.clone(), FlowState::Owned).await?;
            // New connections wait for the chain's word: a contact node
            // replaced while its agent was away must not answer them too.
            self.share_port(port, PortState::SharedMember).await?;
            lock(&self.unsynced).insert(port, Instant::now());
            restored += 1;
            tracing::info!(port, epoch = group.epoch, contact = %group.contact, serving = own.len(), "a group served again after the agent restarted");
            self.publish(
                port,
                "restored",
                format!(
                    "view {} after the agent restarted, {} connections served here",
                    group.epoch,
                    own.len()
                ),
            );
        }
        Ok(restored)
    }

    /// The connections of `port` this node serves: its live sockets on
    /// the port that its filter gives it (`Owned`), and if `port_owner`
    /// (it is, or was until now, the contact node) also those without an
    /// entry (the port's). The filter is the truth here, as it outlives
    /// the agent: a socket whose connection went elsewhere (an operator's
    /// handoff leaves the server's descriptor, inert) has an `Elsewhere`
    /// entry on a contact node and none on a member.
    pub(super) async fn own_connections(
        &self,
        port: u16,
        port_owner: bool,
    ) -> Result<Vec<Flow>, GroupsError> {
        let live = tokio::task::spawn_blocking(super::chain::tcp_ends)
            .await
            .map_err(|e| GroupsError::Internal(e.to_string()))?
            .map_err(|e| GroupsError::Internal(format!("reading this node's sockets: {e}")))?;
        let dp = self.dataplane.clone();
        let entries: std::collections::BTreeMap<Flow, FlowState> =
            tokio::task::spawn_blocking(move || dp.table().flows())
                .await
                .map_err(|e| GroupsError::Internal(e.to_string()))?
                .map_err(|e| GroupsError::Internal(e.to_string()))?
                .into_iter()
                .collect();
        Ok(live
            .into_iter()
            .filter(|(_, p)| *p == port)
            .map(|(remote, _)| Flow::new(remote, port))
            .filter(|f| match entries.get(f) {
                Some(FlowState::Owned) => true,
                None => port_owner,
                Some(_) => false,
            })
            .collect())
    }

    /// Confirms each restored group with the others of its chain; a group
    /// none of them answered for stays to confirm at the next call, for
    /// [`SILENT_CHAIN`]: then its saved view is taken as the group's (the
    /// failure detector's judgment on a chain that silent).
    pub(super) async fn resync_restored(self: &Arc<Self>) {
        let ports: Vec<(u16, Instant)> =
            lock(&self.unsynced).iter().map(|(p, t)| (*p, *t)).collect();
        for (port, since) in ports {
            let done = match self.resync(port).await {
                Ok(true) => true,
                Ok(false) if since.elapsed() >= SILENT_CHAIN => {
                    tracing::warn!(
                        port,
                        "no node of the chain answers: the saved view is the group's"
                    );
                    if self.group(port).is_some_and(|g| g.contact == self.node)
                        && let Err(e) = self.take_over(port).await
                    {
                        tracing::warn!(port, error = %e, "taking a restored group's port");
                    }
                    true
                }
                Ok(false) => false,
                Err(e) => {
                    tracing::warn!(port, error = %e, "confirming a restored group");
                    false
                }
            };
            if done {
                lock(&self.unsynced).remove(&port);
            }
        }
    }

    /// Asks every other node of the chain (the contact node and backups)
    /// of the saved view for its view and table, and takes the newest
    /// answer: a view that keeps this node (with the table), or one that
    /// left it out (this node joins again). `false`: nobody answered.
    pub async fn resync(self: &Arc<Self>, port: u16) -> Result<bool, GroupsError> {
        let Some(mine) = self.group(port) else {
            return Ok(true);
        };
        let asked: Vec<String> = mine
            .chain()
            .into_iter()
            .filter(|n| *n != self.node)
            .collect();
        let answers = futures::future::join_all(asked.iter().map(|n| async move {
            self.call(n, ASK_TIMEOUT, |mut c| async move {
                c.get_view(pb::GetViewRequest {
                    port: u32::from(port),
                })
                .await
            })
            .await
        }))
        .await;
        let mut newest: Option<(Group, Vec<(Flow, String)>)> = None;
        for answer in answers.into_iter().flatten() {
            let Some(g) = answer.group.as_ref() else {
                continue;
            };
            let view = Group::from_pb(g)?;
            if newest.as_ref().is_some_and(|(n, _)| n.epoch >= view.epoch) {
                continue;
            }
            let mut table = Vec::with_capacity(answer.connections.len());
            for c in &answer.connections {
                table.push((flow_from_pb(c.connection.as_ref())?, c.node.clone()));
            }
            newest = Some((view, table));
        }
        let Some((view, table)) = newest else {
            if mine.chain() == [self.node.clone()] {
                // No other node to ask: the saved view is the group's.
                self.take_over(port).await?;
                return Ok(true);
            }
            return Ok(false);
        };
        if view.epoch < mine.epoch || view.members.contains(&self.node) {
            tracing::info!(
                port,
                epoch = view.epoch,
                "a restored group confirmed by its chain"
            );
            self.apply_view(view, table).await?;
            if self.group(port).is_some_and(|g| g.contact == self.node) {
                self.take_over(port).await?;
            }
        } else {
            self.start_rejoin(mine, view);
        }
        Ok(true)
    }

    /// This node's view and table (the `GetView` call).
    pub fn view_and_table(&self, port: u16) -> Result<pb::ViewCommitRequest, GroupsError> {
        let groups = self.groups();
        let g = groups.get(&port).ok_or_else(|| GroupsError::NoGroup {
            port,
            node: self.node.clone(),
        })?;
        Ok(pb::ViewCommitRequest {
            group: Some(g.group.to_pb()),
            connections: super::table_pb(&g.connections),
        })
    }
}
