//! Information policy: how a node learns the loads of the others.
//!
//! - [`Heartbeat`], Gerofi et al. (DVE) §IV-D: every period each node
//!   broadcasts its load to all nodes; the message doubles as the heartbeat
//!   that says the node is alive, so a silent peer drops out of the view.
//! - [`OwnLoadOnly`], Meehan & Wynne (openMosix) §3 (standard openMosix):
//!   every period each node tells two peers its own load, one picked among
//!   the nodes that contacted it recently and one among all nodes; a
//!   receiver keeps the last few messages in a circular queue.
//! - [`Hearsay`], Meehan & Wynne (openMosix) §4: the same two messages per
//!   period carry the sender's whole fixed-size vector of timestamped
//!   entries, its own load and what it heard about others.
//!
//! Beliefs about peers age on the local clock ([`crate::PeerLoad::age`]),
//! never by comparing another node's timestamp with ours: clocks of
//! different nodes disagree, and only the information policy handles remote
//! timestamps (see [`Hearsay`] for how).

mod contacts;
mod hearsay;
mod heartbeat;
mod own_load;

use std::fmt;
use std::time::Duration;

pub use contacts::GossipTargets;
pub use hearsay::Hearsay;
pub use heartbeat::Heartbeat;
pub use own_load::OwnLoadOnly;
use rand::RngCore;
use serde::{Deserialize, Serialize};

use crate::field::InvalidField;
use crate::node::{NodeId, PeerLoad};
use crate::time::Instant;

/// Bytes of a load message's header (fitted, with the two sizes below, to
/// the message sizes in Meehan & Wynne (openMosix) §5: 40 B for openMosix's
/// own-load message, 12 + 36 n bytes for a hearsay vector of n slots).
pub const MESSAGE_HEADER_BYTES: usize = 12;
/// Bytes of the single entry of an own-load message (node, load, speed,
/// free slots).
pub const OWN_LOAD_ENTRY_BYTES: usize = 28;
/// Bytes of one hearsay slot (an own-load entry plus its timestamp and age).
pub const HEARSAY_SLOT_BYTES: usize = 36;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum InformationError {
    #[error("load message from {0} carries no entry about its sender")]
    NoSenderEntry(NodeId),
    #[error("load message claims to come from this node ({0})")]
    FromSelf(NodeId),
    #[error("load of {node} is {load}, not a finite number >= 0")]
    InvalidLoad { node: NodeId, load: f64 },
}

/// One node's load as it travels: stamped by its origin on the origin's
/// clock, and aged by every node that held it, each on its own clock.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadEntry {
    pub node: NodeId,
    pub load: f64,
    /// When the origin measured it, on the origin's clock.
    pub stamped_at: Instant,
    /// How long the entry had been held on its way, when it was sent.
    pub age: Duration,
}

/// A load message. `entries[0]` is the sender's own load (slot 0 in
/// Meehan & Wynne (openMosix)'s vector); the rest, if any, is hearsay.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadMessage {
    pub from: NodeId,
    pub entries: Vec<LoadEntry>,
}

impl LoadMessage {
    /// Checks the structure every policy relies on.
    fn validate(&self, local: NodeId) -> Result<&LoadEntry, InformationError> {
        if self.from == local {
            return Err(InformationError::FromSelf(local));
        }
        for e in &self.entries {
            if !e.load.is_finite() || e.load < 0.0 {
                return Err(InformationError::InvalidLoad {
                    node: e.node,
                    load: e.load,
                });
            }
        }
        match self.entries.first() {
            Some(own) if own.node == self.from => Ok(own),
            _ => Err(InformationError::NoSenderEntry(self.from)),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destination {
    Broadcast,
    Node(NodeId),
}

/// A message to send, and what it costs on the wire.
#[derive(Debug, Clone, PartialEq)]
pub struct Outgoing {
    pub to: Destination,
    pub message: LoadMessage,
    pub wire_bytes: usize,
}

/// Counters an operator (or the simulator) reads to see the policy work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InformationStats {
    pub messages_received: u64,
    /// Entries dropped because they were older than `max_age` on arrival.
    pub stale_dropped: u64,
    /// Entries stamped further in the future than the allowed skew.
    pub future_dated: u64,
}

pub trait InformationPolicy: fmt::Debug + Send {
    /// Called once per period: the messages to send now.
    fn tick(&mut self, now: Instant, own_load: f64, rng: &mut dyn RngCore) -> Vec<Outgoing>;
    /// A message arrived.
    fn receive(&mut self, message: &LoadMessage, now: Instant) -> Result<(), InformationError>;
    /// What this node currently believes about its peers (one entry per
    /// peer, never the local node, nothing older than the policy allows).
    fn peers(&self, now: Instant) -> Vec<PeerLoad>;
    /// Membership changed (discovery, failure detection).
    fn set_members(&mut self, members: &[NodeId]);
    fn stats(&self) -> InformationStats;
}

/// Which information policy runs (`information.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InformationKind {
    Broadcast,
    OwnLoadOnly,
    Hearsay,
}

/// `[information]` in ferryd's TOML.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct InformationConfig {
    pub kind: InformationKind,
    /// How often a node sends its load.
    pub period_ms: u64,
    /// Slots in the load vector (own-load queue length, or hearsay vector
    /// size including the sender's own slot).
    pub vector_size: usize,
    /// Peers told per period (gossip policies).
    pub fanout: usize,
    /// Beliefs older than this (on the local clock) are forgotten.
    pub max_age_ms: u64,
    /// Clock skew between nodes tolerated before a timestamp is treated as
    /// future-dated.
    pub max_clock_skew_ms: u64,
    /// A node that sent to us within this window is in the "recent" group
    /// one gossip target is drawn from.
    pub recent_contact_ms: u64,
    /// A broadcasting peer silent this long is considered gone.
    pub failure_timeout_ms: u64,
}

impl Default for InformationConfig {
    fn default() -> Self {
        InformationConfig {
            kind: InformationKind::Broadcast,
            period_ms: 1_000,
            vector_size: 8,
            fanout: 2,
            max_age_ms: 10_000,
            max_clock_skew_ms: 500,
            recent_contact_ms: 10_000,
            failure_timeout_ms: 3_500,
        }
    }
}

impl InformationConfig {
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.period_ms == 0 {
            return Err(InvalidField::new("information.period_ms", "must be > 0"));
        }
        let min_vector = if self.kind == InformationKind::Hearsay {
            2
        } else {
            1
        };
        if self.vector_size < min_vector {
            return Err(InvalidField::new(
                "information.vector_size",
                format!(
                    "{} is too small: {:?} needs at least {min_vector}",
                    self.vector_size, self.kind
                ),
            ));
        }
        if self.fanout == 0 {
            return Err(InvalidField::new(
                "information.fanout",
                "must be at least 1",
            ));
        }
        if self.max_age_ms <= self.period_ms {
            return Err(InvalidField::new(
                "information.max_age_ms",
                format!(
                    "{} must exceed the period ({} ms), or every belief expires before it is renewed",
                    self.max_age_ms, self.period_ms
                ),
            ));
        }
        if self.failure_timeout_ms <= self.period_ms {
            return Err(InvalidField::new(
                "information.failure_timeout_ms",
                format!(
                    "{} must exceed the period ({} ms)",
                    self.failure_timeout_ms, self.period_ms
                ),
            ));
        }
        Ok(())
    }

    /// The policy for node `local` in a cluster of `members`.
    pub fn policy(&self, local: NodeId, members: &[NodeId]) -> Box<dyn InformationPolicy> {
        match self.kind {
            InformationKind::Broadcast => Box::new(Heartbeat::new(local, self)),
            InformationKind::OwnLoadOnly => Box::new(OwnLoadOnly::new(local, members, self)),
            InformationKind::Hearsay => Box::new(Hearsay::new(local, members, self)),
        }
    }
}

/// An entry as held by the receiving node.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Held {
    entry: LoadEntry,
    /// On the local clock.
    received_at: Instant,
    /// The entry's origin timestamp was too far ahead of what its age
    /// implies: it is ordered by age only.
    future_dated: bool,
}

impl Held {
    fn age(&self, now: Instant) -> Duration {
        self.entry.age + now.saturating_duration_since(self.received_at)
    }

    fn peer(&self, now: Instant) -> PeerLoad {
        PeerLoad {
            node: self.entry.node,
            load: self.entry.load,
            age: self.age(now),
        }
    }

    /// The entry to pass on: same origin stamp, older by the time held.
    fn relayed(&self, now: Instant) -> LoadEntry {
        LoadEntry {
            age: self.age(now),
            ..self.entry
        }
    }
}

/// Whether an origin timestamp lies further ahead than the skew allows:
/// the origin measured it `age` ago, so by our clock it should read about
/// `now - age`.
fn is_future_dated(entry: &LoadEntry, now: Instant, max_skew: Duration) -> bool {
    entry.stamped_at > now.saturating_sub(entry.age).saturating_add(max_skew)
}

fn own_entry(local: NodeId, load: f64, now: Instant) -> LoadEntry {
    LoadEntry {
        node: local,
        load,
        stamped_at: now,
        age: Duration::ZERO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_rejects_nonsense_naming_the_field() {
        let bad = |c: InformationConfig| match c.validate() {
            Err(InvalidField { field, .. }) => field,
            other => panic!("expected an invalid field, got {other:?}"),
        };
        let ok = InformationConfig::default();
        ok.validate().unwrap();
        assert_eq!(
            bad(InformationConfig {
                period_ms: 0,
                ..ok.clone()
            }),
            "information.period_ms"
        );
        assert_eq!(
            bad(InformationConfig {
                kind: InformationKind::Hearsay,
                vector_size: 1,
                ..ok.clone()
            }),
            "information.vector_size"
        );
        assert_eq!(
            bad(InformationConfig {
                max_age_ms: 1_000,
                ..ok.clone()
            }),
            "information.max_age_ms"
        );
        assert_eq!(
            bad(InformationConfig {
                fanout: 0,
                ..ok.clone()
            }),
            "information.fanout"
        );
    }

    #[test]
    fn wire_sizes_match_the_openmosix_paper() {
        // Meehan & Wynne (openMosix) §5 list 40 B for the standard kernel
        // and 300, 444, 588, 732 B for hearsay vectors of 8, 12, 16, 20 slots.
        assert_eq!(MESSAGE_HEADER_BYTES + OWN_LOAD_ENTRY_BYTES, 40);
        let sizes: Vec<usize> = [8, 12, 16, 20]
            .iter()
            .map(|n| MESSAGE_HEADER_BYTES + HEARSAY_SLOT_BYTES * n)
            .collect();
        assert_eq!(sizes, vec![300, 444, 588, 732]);
    }

    #[test]
    fn malformed_messages_are_rejected() {
        let e = |node, load| LoadEntry {
            node: NodeId(node),
            load,
            stamped_at: Instant::ZERO,
            age: Duration::ZERO,
        };
        let m = LoadMessage {
            from: NodeId(1),
            entries: vec![e(2, 1.0)],
        };
        assert_eq!(
            m.validate(NodeId(0)),
            Err(InformationError::NoSenderEntry(NodeId(1)))
        );
        let m = LoadMessage {
            from: NodeId(1),
            entries: vec![],
        };
        assert_eq!(
            m.validate(NodeId(0)),
            Err(InformationError::NoSenderEntry(NodeId(1)))
        );
        let m = LoadMessage {
            from: NodeId(0),
            entries: vec![e(0, 1.0)],
        };
        assert_eq!(
            m.validate(NodeId(0)),
            Err(InformationError::FromSelf(NodeId(0)))
        );
        let m = LoadMessage {
            from: NodeId(1),
            entries: vec![e(1, f64::INFINITY)],
        };
        assert!(matches!(
            m.validate(NodeId(0)),
            Err(InformationError::InvalidLoad { .. })
        ));
    }
}
