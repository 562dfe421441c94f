//! Transfer policy: whether this node takes part in a migration now, and the
//! two-phase commit that lets a receiver take at most one at a time.
//!
//! Gerofi et al. (DVE) §IV-A: the sender side is threshold driven: a node
//! becomes a migration initiator when its load exceeds a critical threshold or
//! when it is more than a set gap above its approximation of the cluster
//! average ([`SenderThreshold`]). The receiver is chosen by the location policy
//! and joins through a two-phase commit, one incoming migration at a time
//! ([`MigrationGate`]). After a migration both ends calm down for a while so
//! their load indicators settle before they decide again.
//!
//! Alternatives to compare: openMosix's trigger, "some node in my vector is
//! less loaded than me" (Meehan & Wynne (openMosix) §3, [`LowerPeerExists`]),
//! the receiver-initiated policy of the load-sharing literature, where an
//! underloaded node asks a loaded one for work ([`ReceiverInitiated`]), and
//! the symmetric one, where both happen ([`Symmetric`]).
//!
//! The gate's state machine, per node (one outgoing and one incoming slot):
//!
//! ```text
//! sender:   Idle --begin_offer--> Offered --Accept--> Transferring --Committed--> Idle + calm-down
//!            |                      ^   |                     \--Aborted--> Idle (no calm-down)
//!            \--mark--> Marked -----/   \--Refuse--> Idle (may offer to the next candidate)
//!                         \--Aborted (the local node won after all)--> Idle
//! receiver: Idle --on_offer: Accept--> Reserved --Committed--> Idle + calm-down
//!                 (Refuse if Reserved,     |---Aborted---> Idle
//!                  calming down, or        \---reservation timeout (sender gone)--> Idle
//!                  it would overload)
//! ```

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::field::InvalidField;
use crate::load::{non_negative, positive};
use crate::node::NodeId;
use crate::time::Instant;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TransferError {
    #[error("an outgoing migration ({0:?}) is already in progress")]
    OutgoingBusy(MigrationId),
    #[error("calming down after a migration until {0:?}")]
    CalmingDown(Instant),
    #[error("no migration {0:?} is in progress here")]
    UnknownMigration(MigrationId),
    #[error("migration {id:?} is {actual} but this step needs it {expected}")]
    WrongState {
        id: MigrationId,
        expected: &'static str,
        actual: &'static str,
    },
}

/// Which transfer policy runs (`transfer.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferMode {
    /// Gerofi et al. (DVE): threshold on the local load or on the gap to the
    /// average.
    SenderThreshold,
    /// Meehan & Wynne (openMosix): send as soon as a known peer is less loaded.
    LowerPeerExists,
    /// An underloaded node asks a loaded one for work.
    ReceiverInitiated,
    /// Both: a node above the threshold or the gap sends, a node below the
    /// gap asks for work.
    Symmetric,
}

/// `[transfer]` in ferryd's TOML.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransferConfig {
    pub mode: TransferMode,
    /// Critical local load above which a node sends whatever the average.
    pub threshold: f64,
    /// Gap to the approximated cluster average above (sender) or below
    /// (receiver-initiated) which a node acts.
    pub average_gap: f64,
    /// Quiet period on both ends after a committed migration.
    pub calm_down_ms: u64,
    /// A receiver drops a reservation whose sender stays silent this long.
    pub reservation_timeout_ms: u64,
    /// The receiver refuses an offer that would leave it busier than the
    /// sender was: a guard against the sender's stale view of it.
    pub receiver_check: bool,
    /// The receiver also refuses an offer that would leave it further above
    /// the cluster average (as it knows it) than it is below it now: senders
    /// that all saw it light at once do not pile onto it.
    pub receiver_up_to_average: bool,
    /// A sender counts the load it has moved to a peer in what it believes
    /// of that peer until news of the peer is younger than the move: several
    /// moves in a row do not all go to the node that looked lightest before
    /// the first one.
    pub count_promised: bool,
    /// After a committed migration the sender plans its next one at once
    /// (when no calm-down holds it), instead of at its next turn: a node far
    /// above the average moves as many processes as its excess warrants, one
    /// after another.
    pub replan_on_commit: bool,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            mode: TransferMode::SenderThreshold,
            threshold: 0.9,
            average_gap: 0.1,
            calm_down_ms: 10_000,
            reservation_timeout_ms: 30_000,
            receiver_check: true,
            receiver_up_to_average: false,
            count_promised: false,
            replan_on_commit: false,
        }
    }
}

impl TransferConfig {
    pub fn validate(&self) -> Result<(), InvalidField> {
        positive("transfer.threshold", self.threshold)?;
        non_negative("transfer.average_gap", self.average_gap)?;
        if self.reservation_timeout_ms == 0 {
            return Err(InvalidField::new(
                "transfer.reservation_timeout_ms",
                "must be > 0",
            ));
        }
        Ok(())
    }

    pub fn policy(&self) -> Box<dyn TransferPolicy> {
        match self.mode {
            TransferMode::SenderThreshold => Box::new(SenderThreshold {
                threshold: self.threshold,
                average_gap: self.average_gap,
            }),
            TransferMode::LowerPeerExists => Box::new(LowerPeerExists),
            TransferMode::ReceiverInitiated => Box::new(ReceiverInitiated {
                average_gap: self.average_gap,
            }),
            TransferMode::Symmetric => Box::new(Symmetric {
                sender: SenderThreshold {
                    threshold: self.threshold,
                    average_gap: self.average_gap,
                },
                receiver: ReceiverInitiated {
                    average_gap: self.average_gap,
                },
            }),
        }
    }

    pub fn gate(&self) -> MigrationGate {
        MigrationGate::new(
            Duration::from_millis(self.calm_down_ms),
            Duration::from_millis(self.reservation_timeout_ms),
            self.receiver_check,
        )
        .up_to_average(self.receiver_up_to_average)
    }
}

/// What the node knows when the transfer policy runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClusterView {
    pub local_load: f64,
    /// The approximated cluster average, local node included.
    pub average: f64,
    /// The least loaded known peer's load, if any peer is known.
    pub min_peer_load: Option<f64>,
    /// The most loaded known peer's load, if any peer is known.
    pub max_peer_load: Option<f64>,
}

/// The part a node should play now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Role {
    /// Send a process away; `excess` is how far above the average it is.
    Sender {
        excess: f64,
    },
    /// Ask a loaded node for a process; `deficit` is how far below.
    Receiver {
        deficit: f64,
    },
    Neither,
}

pub trait TransferPolicy: fmt::Debug + Send + Sync {
    fn role(&self, view: &ClusterView) -> Role;
}

/// Gerofi et al. (DVE) §IV-A.
#[derive(Debug, Clone, Copy)]
pub struct SenderThreshold {
    pub threshold: f64,
    pub average_gap: f64,
}

impl TransferPolicy for SenderThreshold {
    fn role(&self, view: &ClusterView) -> Role {
        let above = view.local_load - view.average;
        if view.local_load > self.threshold || above > self.average_gap {
            Role::Sender {
                excess: above.max(0.0),
            }
        } else {
            Role::Neither
        }
    }
}

/// Meehan & Wynne (openMosix) §3: openMosix runs `choose()` whenever a node in
/// its load vector shows a lower load than the local one; no explicit margin,
/// the export load's offsets are the margin.
#[derive(Debug, Clone, Copy)]
pub struct LowerPeerExists;

impl TransferPolicy for LowerPeerExists {
    fn role(&self, view: &ClusterView) -> Role {
        match view.min_peer_load {
            Some(min) if min < view.local_load => Role::Sender {
                excess: (view.local_load - view.average).max(0.0),
            },
            _ => Role::Neither,
        }
    }
}

/// Receiver-initiated: a node more than `average_gap` below the average asks.
#[derive(Debug, Clone, Copy)]
pub struct ReceiverInitiated {
    pub average_gap: f64,
}

impl TransferPolicy for ReceiverInitiated {
    fn role(&self, view: &ClusterView) -> Role {
        let below = view.average - view.local_load;
        if below > self.average_gap && view.max_peer_load.is_some_and(|max| max > view.local_load) {
            Role::Receiver { deficit: below }
        } else {
            Role::Neither
        }
    }
}

/// Names one migration attempt between two nodes.
/// A loaded node sends as [`SenderThreshold`] does; a node that is not a
/// sender asks for work as [`ReceiverInitiated`] does.
#[derive(Debug, Clone, Copy)]
pub struct Symmetric {
    pub sender: SenderThreshold,
    pub receiver: ReceiverInitiated,
}

impl TransferPolicy for Symmetric {
    fn role(&self, view: &ClusterView) -> Role {
        match self.sender.role(view) {
            Role::Neither => self.receiver.role(view),
            sender => sender,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct MigrationId(pub u64);

/// Phase 1 of the commit: the sender asks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Offer {
    pub id: MigrationId,
    pub from: NodeId,
    /// The sender's load when it offered.
    pub sender_load: f64,
    /// What the process would add to the receiver's load.
    pub process_load: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Already reserved for another incoming migration.
    Busy,
    CalmingDown,
    /// Taking the process would leave the receiver busier than the sender.
    WouldOverload,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Accept,
    Refuse(Refusal),
}

/// Phase 2: how the migration ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Committed,
    Aborted,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OutgoingPhase {
    /// Selected, destination not yet chosen (openMosix marks the process in
    /// `choose()` and picks the target later, in `consider()`).
    Marked,
    Offered,
    Transferring,
}

impl OutgoingPhase {
    fn name(self) -> &'static str {
        match self {
            OutgoingPhase::Marked => "marked",
            OutgoingPhase::Offered => "offered",
            OutgoingPhase::Transferring => "transferring",
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Outgoing {
    id: MigrationId,
    to: Option<NodeId>,
    phase: OutgoingPhase,
}

#[derive(Debug, Clone, Copy)]
struct Incoming {
    id: MigrationId,
    from: NodeId,
    reserved_at: Instant,
}

/// One node's two-phase-commit state for migrations in and out, and its
/// calm-down period. See the module documentation for the state machine.
/// What a receiver knows of itself when an offer comes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReceiverView {
    /// Its load, in the units the sender compared.
    pub load: f64,
    /// The cluster average as it approximates it, if it knows one.
    pub average: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct MigrationGate {
    calm_down: Duration,
    reservation_timeout: Duration,
    receiver_check: bool,
    up_to_average: bool,
    outgoing: Option<Outgoing>,
    incoming: Option<Incoming>,
    calm_until: Option<Instant>,
}

impl MigrationGate {
    pub fn new(calm_down: Duration, reservation_timeout: Duration, receiver_check: bool) -> Self {
        MigrationGate {
            calm_down,
            reservation_timeout,
            receiver_check,
            up_to_average: false,
            outgoing: None,
            incoming: None,
            calm_until: None,
        }
    }

    /// See [`TransferConfig::receiver_up_to_average`].
    pub fn up_to_average(mut self, on: bool) -> Self {
        self.up_to_average = on;
        self
    }

    pub fn calming_down(&self, now: Instant) -> bool {
        self.calm_until.is_some_and(|until| now < until)
    }

    /// Whether this node may start an outgoing migration now.
    pub fn can_send(&self, now: Instant) -> bool {
        self.outgoing.is_none() && !self.calming_down(now)
    }

    /// The migration currently reserved here, and its sender.
    pub fn incoming(&self) -> Option<(MigrationId, NodeId)> {
        self.incoming.map(|i| (i.id, i.from))
    }

    /// The outgoing migration, its destination if chosen yet, and whether
    /// the destination accepted.
    pub fn outgoing(&self) -> Option<(MigrationId, Option<NodeId>, bool)> {
        self.outgoing
            .map(|o| (o.id, o.to, o.phase == OutgoingPhase::Transferring))
    }

    /// Sender: a process is selected for migration `id`, its destination to
    /// be chosen later; until then no other outgoing migration starts. Undo
    /// with [`Self::finish_outgoing`] and [`Outcome::Aborted`].
    pub fn mark(&mut self, id: MigrationId, now: Instant) -> Result<(), TransferError> {
        self.ensure_can_start(now)?;
        self.outgoing = Some(Outgoing {
            id,
            to: None,
            phase: OutgoingPhase::Marked,
        });
        Ok(())
    }

    /// Sender, phase 1: records that `id` was offered to `to`, either fresh
    /// or after [`Self::mark`] with the same id.
    pub fn begin_offer(
        &mut self,
        id: MigrationId,
        to: NodeId,
        now: Instant,
    ) -> Result<(), TransferError> {
        match self.outgoing {
            Some(o) if o.id == id && o.phase == OutgoingPhase::Marked => {}
            _ => self.ensure_can_start(now)?,
        }
        self.outgoing = Some(Outgoing {
            id,
            to: Some(to),
            phase: OutgoingPhase::Offered,
        });
        Ok(())
    }

    fn ensure_can_start(&self, now: Instant) -> Result<(), TransferError> {
        if let Some(o) = self.outgoing {
            return Err(TransferError::OutgoingBusy(o.id));
        }
        if let Some(until) = self.calm_until.filter(|&until| now < until) {
            return Err(TransferError::CalmingDown(until));
        }
        Ok(())
    }

    /// Receiver, phase 1: accept (and reserve) or refuse an offer.
    pub fn on_offer(&mut self, offer: &Offer, own_load: f64, now: Instant) -> Answer {
        let view = ReceiverView {
            load: own_load,
            average: None,
        };
        self.on_offer_with(offer, &view, now)
    }

    /// [`Self::on_offer`] with the receiver's view of the average.
    pub fn on_offer_with(&mut self, offer: &Offer, own: &ReceiverView, now: Instant) -> Answer {
        let own_load = own.load;
        if let Some(i) = self.incoming
            && now.saturating_duration_since(i.reserved_at) >= self.reservation_timeout
        {
            // The sender went silent: a lost commit must not block this
            // node from receiving forever.
            self.incoming = None;
        }
        if self.incoming.is_some() {
            return Answer::Refuse(Refusal::Busy);
        }
        if self.calming_down(now) {
            return Answer::Refuse(Refusal::CalmingDown);
        }
        if self.receiver_check && own_load + offer.process_load >= offer.sender_load {
            return Answer::Refuse(Refusal::WouldOverload);
        }
        // After the move it would be `own + p - average` above the average;
        // it is `average - own` below it now.
        if let (true, Some(average)) = (self.up_to_average, own.average)
            && own_load + offer.process_load / 2.0 > average
        {
            return Answer::Refuse(Refusal::WouldOverload);
        }
        self.incoming = Some(Incoming {
            id: offer.id,
            from: offer.from,
            reserved_at: now,
        });
        Answer::Accept
    }

    /// Sender: the receiver's answer to our offer arrived.
    pub fn on_answer(&mut self, id: MigrationId, answer: Answer) -> Result<(), TransferError> {
        let outgoing = self.outgoing_mut(id)?;
        if outgoing.phase != OutgoingPhase::Offered {
            return Err(TransferError::WrongState {
                id,
                expected: "offered",
                actual: outgoing.phase.name(),
            });
        }
        match answer {
            Answer::Accept => outgoing.phase = OutgoingPhase::Transferring,
            Answer::Refuse(_) => self.outgoing = None,
        }
        Ok(())
    }

    /// Sender, phase 2: the migration ended. A commit starts the calm-down;
    /// an abort does not, since nothing moved.
    pub fn finish_outgoing(
        &mut self,
        id: MigrationId,
        outcome: Outcome,
        now: Instant,
    ) -> Result<(), TransferError> {
        let outgoing = self.outgoing_mut(id)?;
        if outcome == Outcome::Committed && outgoing.phase != OutgoingPhase::Transferring {
            return Err(TransferError::WrongState {
                id,
                expected: "transferring",
                actual: outgoing.phase.name(),
            });
        }
        self.outgoing = None;
        if outcome == Outcome::Committed {
            self.calm_until = Some(now.saturating_add(self.calm_down));
        }
        Ok(())
    }

    /// Receiver, phase 2.
    pub fn finish_incoming(
        &mut self,
        id: MigrationId,
        outcome: Outcome,
        now: Instant,
    ) -> Result<(), TransferError> {
        match self.incoming {
            Some(i) if i.id == id => {
                self.incoming = None;
                if outcome == Outcome::Committed {
                    self.calm_until = Some(now.saturating_add(self.calm_down));
                }
                Ok(())
            }
            _ => Err(TransferError::UnknownMigration(id)),
        }
    }

    fn outgoing_mut(&mut self, id: MigrationId) -> Result<&mut Outgoing, TransferError> {
        match self.outgoing.as_mut() {
            Some(o) if o.id == id => Ok(o),
            _ => Err(TransferError::UnknownMigration(id)),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn view(local: f64, average: f64) -> ClusterView {
        ClusterView {
            local_load: local,
            average,
            min_peer_load: Some(0.0),
            max_peer_load: Some(2.0),
        }
    }

    fn ms(m: u64) -> Instant {
        Instant::from_millis(m)
    }

    fn offer(id: u64, from: u32) -> Offer {
        Offer {
            id: MigrationId(id),
            from: NodeId(from),
            sender_load: 10.0,
            process_load: 1.0,
        }
    }

    #[test]
    fn sender_threshold_triggers_on_either_condition() {
        let p = SenderThreshold {
            threshold: 0.9,
            average_gap: 0.2,
        };
        assert_eq!(
            p.role(&view(0.95, 0.95)),
            Role::Sender { excess: 0.0 },
            "above the critical load"
        );
        assert!(
            matches!(p.role(&view(0.6, 0.3)), Role::Sender { excess } if (excess - 0.3).abs() < 1e-12)
        );
        assert_eq!(p.role(&view(0.6, 0.5)), Role::Neither);
    }

    #[test]
    fn lower_peer_exists_is_openmosix_trigger() {
        let mut v = view(1.0, 1.0);
        assert!(matches!(LowerPeerExists.role(&v), Role::Sender { .. }));
        v.min_peer_load = Some(1.0);
        assert_eq!(
            LowerPeerExists.role(&v),
            Role::Neither,
            "equal is not lower"
        );
        v.min_peer_load = None;
        assert_eq!(LowerPeerExists.role(&v), Role::Neither);
    }

    #[test]
    fn receiver_initiated_asks_only_when_well_below() {
        let p = ReceiverInitiated { average_gap: 0.2 };
        assert!(matches!(p.role(&view(0.2, 0.6)), Role::Receiver { .. }));
        assert_eq!(p.role(&view(0.5, 0.6)), Role::Neither);
    }

    #[test]
    fn symmetric_sends_when_above_and_asks_when_below() {
        let p = TransferConfig {
            mode: TransferMode::Symmetric,
            threshold: 0.9,
            average_gap: 0.1,
            ..TransferConfig::default()
        }
        .policy();
        assert!(matches!(p.role(&view(0.95, 0.9)), Role::Sender { .. }));
        assert!(matches!(p.role(&view(0.75, 0.6)), Role::Sender { .. }));
        assert!(matches!(p.role(&view(0.4, 0.6)), Role::Receiver { .. }));
        assert_eq!(p.role(&view(0.55, 0.6)), Role::Neither);
    }

    #[test]
    fn two_phase_commit_happy_path_and_calm_down_on_both_ends() {
        let calm = Duration::from_secs(10);
        let mut sender = MigrationGate::new(calm, Duration::from_secs(30), true);
        let mut receiver = MigrationGate::new(calm, Duration::from_secs(30), true);
        let o = offer(1, 0);
        sender.begin_offer(o.id, NodeId(1), ms(0)).unwrap();
        assert!(!sender.can_send(ms(0)), "one outgoing migration at a time");
        assert_eq!(receiver.on_offer(&o, 2.0, ms(1)), Answer::Accept);
        sender.on_answer(o.id, Answer::Accept).unwrap();
        assert_eq!(sender.outgoing(), Some((o.id, Some(NodeId(1)), true)));
        sender
            .finish_outgoing(o.id, Outcome::Committed, ms(500))
            .unwrap();
        receiver
            .finish_incoming(o.id, Outcome::Committed, ms(500))
            .unwrap();
        assert!(!sender.can_send(ms(9_000)), "sender calms down");
        assert_eq!(
            receiver.on_offer(&offer(2, 3), 0.0, ms(9_000)),
            Answer::Refuse(Refusal::CalmingDown)
        );
        assert!(sender.can_send(ms(10_500)));
        assert_eq!(
            receiver.on_offer(&offer(2, 3), 0.0, ms(10_500)),
            Answer::Accept
        );
    }

    #[test]
    fn abort_releases_without_calm_down_and_refusal_frees_the_sender() {
        let mut sender = MigrationGate::new(Duration::from_secs(10), Duration::from_secs(30), true);
        sender
            .begin_offer(MigrationId(1), NodeId(1), ms(0))
            .unwrap();
        sender
            .on_answer(MigrationId(1), Answer::Refuse(Refusal::Busy))
            .unwrap();
        assert!(
            sender.can_send(ms(0)),
            "refused: free to offer to the next candidate"
        );
        sender
            .begin_offer(MigrationId(2), NodeId(2), ms(0))
            .unwrap();
        sender.on_answer(MigrationId(2), Answer::Accept).unwrap();
        sender
            .finish_outgoing(MigrationId(2), Outcome::Aborted, ms(5))
            .unwrap();
        assert!(
            sender.can_send(ms(5)),
            "an abort moved nothing: no calm-down"
        );
    }

    #[test]
    fn a_marked_process_blocks_other_migrations_until_offered_or_released() {
        let mut g = MigrationGate::new(Duration::ZERO, Duration::from_secs(30), true);
        g.mark(MigrationId(1), ms(0)).unwrap();
        assert_eq!(g.outgoing(), Some((MigrationId(1), None, false)));
        assert_eq!(
            g.mark(MigrationId(2), ms(0)),
            Err(TransferError::OutgoingBusy(MigrationId(1)))
        );
        assert_eq!(
            g.begin_offer(MigrationId(2), NodeId(3), ms(0)),
            Err(TransferError::OutgoingBusy(MigrationId(1)))
        );
        g.begin_offer(MigrationId(1), NodeId(3), ms(0)).unwrap();
        assert_eq!(g.outgoing(), Some((MigrationId(1), Some(NodeId(3)), false)));
        g.finish_outgoing(MigrationId(1), Outcome::Aborted, ms(0))
            .unwrap();
        g.mark(MigrationId(4), ms(0)).unwrap();
        g.finish_outgoing(MigrationId(4), Outcome::Aborted, ms(0))
            .unwrap();
        assert!(
            g.can_send(ms(0)),
            "released: the local node kept the process"
        );
    }

    #[test]
    fn protocol_errors_are_reported_not_ignored() {
        let mut g = MigrationGate::new(Duration::ZERO, Duration::from_secs(30), true);
        assert_eq!(
            g.on_answer(MigrationId(9), Answer::Accept),
            Err(TransferError::UnknownMigration(MigrationId(9)))
        );
        g.begin_offer(MigrationId(1), NodeId(1), ms(0)).unwrap();
        assert!(matches!(
            g.finish_outgoing(MigrationId(1), Outcome::Committed, ms(1)),
            Err(TransferError::WrongState { .. })
        ));
        assert_eq!(
            g.begin_offer(MigrationId(2), NodeId(2), ms(0)),
            Err(TransferError::OutgoingBusy(MigrationId(1)))
        );
        assert_eq!(
            g.finish_incoming(MigrationId(3), Outcome::Committed, ms(0)),
            Err(TransferError::UnknownMigration(MigrationId(3)))
        );
    }

    #[test]
    fn receiver_refuses_what_would_overload_it() {
        let mut g = MigrationGate::new(Duration::ZERO, Duration::from_secs(30), true);
        let o = Offer {
            id: MigrationId(1),
            from: NodeId(0),
            sender_load: 3.0,
            process_load: 1.0,
        };
        assert_eq!(
            g.on_offer(&o, 2.0, ms(0)),
            Answer::Refuse(Refusal::WouldOverload)
        );
        assert_eq!(g.on_offer(&o, 1.5, ms(0)), Answer::Accept);
    }

    #[test]
    fn stale_reservation_expires() {
        let mut g = MigrationGate::new(Duration::ZERO, Duration::from_secs(30), false);
        assert_eq!(g.on_offer(&offer(1, 0), 0.0, ms(0)), Answer::Accept);
        assert_eq!(
            g.on_offer(&offer(2, 1), 0.0, ms(29_999)),
            Answer::Refuse(Refusal::Busy)
        );
        assert_eq!(g.on_offer(&offer(2, 1), 0.0, ms(30_000)), Answer::Accept);
        assert_eq!(g.incoming(), Some((MigrationId(2), NodeId(1))));
    }

    #[derive(Debug, Clone)]
    enum Step {
        Offer(u32),
        Commit,
        Abort,
        Wait(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u32..5).prop_map(Step::Offer),
            Just(Step::Commit),
            Just(Step::Abort),
            (0u64..5_000).prop_map(Step::Wait),
        ]
    }

    proptest! {
        /// Whatever arrives in whatever order, a receiver holds at most one
        /// accepted migration at a time (a reservation only gives way once
        /// its timeout has passed), and accepts nothing while calming down.
        #[test]
        fn receiver_accepts_at_most_one_incoming(steps in proptest::collection::vec(step(), 1..100)) {
            const TIMEOUT: u64 = 20_000;
            const CALM: u64 = 3_000;
            let mut g = MigrationGate::new(Duration::from_millis(CALM), Duration::from_millis(TIMEOUT), false);
            let mut now = 0;
            let mut next_id = 0;
            // The reservation this test believes is open, and when it began.
            let mut open: Option<(MigrationId, u64)> = None;
            let mut last_commit: Option<u64> = None;
            for s in steps {
                match s {
                    Step::Offer(from) => {
                        next_id += 1;
                        let o = Offer { id: MigrationId(next_id), from: NodeId(from), sender_load: 10.0, process_load: 1.0 };
                        if g.on_offer(&o, 0.0, ms(now)) == Answer::Accept {
                            prop_assert!(
                                open.is_none_or(|(_, at)| now >= at + TIMEOUT),
                                "accepted while another migration was reserved"
                            );
                            prop_assert!(last_commit.is_none_or(|c| now >= c + CALM), "accepted during calm-down");
                            open = Some((o.id, now));
                        }
                    }
                    Step::Commit => if let Some((id, at)) = open.take() {
                        let result = g.finish_incoming(id, Outcome::Committed, ms(now));
                        // Only an expired reservation may be unknown at commit.
                        prop_assert!(result.is_ok() || now >= at + TIMEOUT);
                        if result.is_ok() {
                            last_commit = Some(now);
                        }
                    },
                    Step::Abort => if let Some((id, at)) = open.take() {
                        let result = g.finish_incoming(id, Outcome::Aborted, ms(now));
                        prop_assert!(result.is_ok() || now >= at + TIMEOUT);
                    },
                    Step::Wait(d) => now += d,
                }
                if let Some((id, _)) = open {
                    prop_assert_eq!(g.incoming().map(|i| i.0), Some(id));
                } else {
                    prop_assert_eq!(g.incoming(), None);
                }
            }
        }
    }
}
