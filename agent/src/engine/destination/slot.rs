//! The one incoming migration a node may be receiving, and what its steps
//! leave each other outside the slot's own lock: TransferImages holds that
//! lock for its whole stream, and TransferSockets (and the peer API's
//! check of its caller) must run beside it.

use std::sync::{Arc, Mutex, Weak};

use super::{Follows, Incoming, PostCopies, RebuiltSockets, StagedSlot};
use crate::sync::lock;

/// How many given-up migrations a node remembers
/// ([`IncomingSlot::give_up`]).
const GIVEN_UP_KEPT: usize = 256;

#[derive(Debug, Default)]
pub struct IncomingSlot {
    incoming: tokio::sync::Mutex<Option<Incoming>>,
    /// The id and source node of the incoming migration last prepared
    /// here, set with the slot at Prepare and left after it ends (ids do
    /// not repeat).
    prepared: Mutex<Option<(String, String)>>,
    /// Migrations their source gave up before this node held them (an
    /// Abort that found nothing), newest last: a Prepare of one of them
    /// that comes after (slow, or late on a cut link) is refused, so that
    /// no reservation outlives its source's interest.
    given_up: Mutex<std::collections::VecDeque<String>>,
    /// Connections rebuilt for an incoming migration by TransferSockets:
    /// taken by its Restore, dropped (closed silently) by its abort or the
    /// next one.
    sockets: Mutex<Option<RebuiltSockets>>,
    /// The incoming migration's sockets opened at Arm (its id, and its
    /// slot's place for them), for TransferSockets. Weak: they close with
    /// the slot.
    staged: Mutex<Option<(String, Weak<StagedSlot>)>>,
    /// Post-copy migrations committed here whose pages still follow (and,
    /// for a while, how they ended): `Peer.PostCopyStatus`.
    pub postcopies: PostCopies,
    /// Post-copies committed here whose pages follow by ferryd, for the
    /// source's `Peer.PostCopyPages`.
    pub follows: Follows,
}

impl IncomingSlot {
    /// The incoming migration, held for a step.
    pub async fn lock(&self) -> tokio::sync::MutexGuard<'_, Option<Incoming>> {
        self.incoming.lock().await
    }

    /// The source node of migration `migration_id`, if it is the one last
    /// prepared here. Does not wait for the slot.
    pub fn source_of(&self, migration_id: &str) -> Option<String> {
        match lock(&self.prepared).as_ref() {
            Some((id, from)) if id == migration_id => Some(from.clone()),
            _ => None,
        }
    }

    pub(super) fn prepared(&self, migration_id: &str, from: &str) {
        *lock(&self.prepared) = Some((migration_id.to_owned(), from.to_owned()));
    }

    /// Remembers that the source gave `migration_id` up before it was held
    /// here (the last [`GIVEN_UP_KEPT`]).
    pub(super) fn give_up(&self, migration_id: &str) {
        let mut given_up = lock(&self.given_up);
        if given_up.len() == GIVEN_UP_KEPT {
            given_up.pop_front();
        }
        given_up.push_back(migration_id.to_owned());
    }

    /// Whether the source gave `migration_id` up ([`Self::give_up`]).
    pub(super) fn was_given_up(&self, migration_id: &str) -> bool {
        lock(&self.given_up).iter().any(|id| id == migration_id)
    }

    /// Keeps `rebuilt` for its Restore, closing whatever an earlier
    /// migration left.
    pub(super) fn put_sockets(&self, rebuilt: RebuiltSockets) {
        *lock(&self.sockets) = Some(rebuilt);
    }

    pub(super) fn take_sockets(&self) -> Option<RebuiltSockets> {
        lock(&self.sockets).take()
    }

    /// Closes (in repair mode: nothing reaches the peers) the connections
    /// rebuilt for `migration_id`, if any.
    pub(super) fn drop_sockets_of(&self, migration_id: &str) {
        let mut sockets = lock(&self.sockets);
        if sockets
            .as_ref()
            .is_some_and(|s| s.migration_id == migration_id)
        {
            *sockets = None;
        }
    }

    /// Points TransferSockets at migration `migration_id`'s place for the
    /// sockets Arm opens.
    pub(super) fn point_staged(&self, migration_id: &str, place: &Arc<StagedSlot>) {
        *lock(&self.staged) = Some((migration_id.to_owned(), Arc::downgrade(place)));
    }

    /// Migration `migration_id`'s place for what Arm left, if it still
    /// lives.
    pub(super) fn staged_for(&self, migration_id: &str) -> Option<Arc<StagedSlot>> {
        match lock(&self.staged).as_ref() {
            Some((id, place)) if id == migration_id => place.upgrade(),
            _ => None,
        }
    }
}
