//! The source side of a migration, as a typed state machine: each
//! [`Phase`] variant carries what that phase needs from the ones before it,
//! and each phase's step (one file each, in the order they run) returns the
//! next phase or an error, which turns into [`Phase::Abort`].
//!
//! `Control.Migrate` calls [`prepare`] (validate, `Peer.Hello`,
//! `Peer.Prepare`: nothing is touched yet, an error leaves no trace) and
//! then [`run`], which drives the phases from [`Phase::Start`] to
//! [`Phase::Done`]. The protocol both sides speak is described in
//! [`crate::engine`]; what each phase does, in its file:
//!
//! ```text
//! Start ─> (PreCopy) ─> (PreRead) ─> Listen ─> (Arm) ─> Settle ─> Dump ─> Transfer ─> Restore ─> (Translate) ─> Release ─> Commit ─> (PostCopy) ─> Discard ─> (Fill) ─> Done
//!   │          │            │           │        │        │        │         │           │            │                      │
//!   └──────────┴────────────┴───────────┴────────┴────────┴────────┴─────────┴───────────┴────────────┴─> Abort ─> Done <────┘ (post-copy)
//! ```
//!
//! A phase in parentheses is skipped when the migration does not need it
//! (a strategy without pre-copy, connections moved without a pre-read,
//! capture off, no in-cluster connection, not post-copy, no page left
//! out of the dump for the destination to fill).
//!
//! | phase | file | next | may abort | cancel | report phase |
//! |---|---|---|---|---|---|
//! | Start | `start.rs` | PreCopy, PreRead, Listen | yes | checked | - |
//! | PreCopy | `pre_copy.rs` | PreRead, Listen | yes | checked | pre-copy |
//! | PreRead | `pre_read.rs` | Listen | yes | checked | sockets pre-read |
//! | Listen | `settle.rs` | Arm, Settle | yes | - | - |
//! | Arm | `arm.rs` | Settle | yes | checked | arm |
//! | Settle | `settle.rs` | Dump | yes | checked | - |
//! | Dump | `dump.rs` | Transfer | yes | checked | dump |
//! | Transfer | `transfer.rs` | Restore | yes | checked | transfer |
//! | Restore | `restore.rs` | Translate, Release | yes | closed | restore |
//! | Translate | `translate.rs` | Release | yes | - | translate |
//! | Release | `release.rs` | Commit | no | - | release |
//! | Commit | `commit.rs` | Discard, PostCopy | if not committed | - | commit |
//! | PostCopy | `post_copy.rs` | Discard | no | - | post-copy |
//! | Discard | `discard.rs` | Fill, Done | no | - | discard |
//! | Fill | `fill.rs` | Done | no | - | fill |
//! | Abort | `abort.rs` | Done | no | - | abort |
//! | Done | `mod.rs` | - | no | - | - |
//!
//! "may abort": an error in the phase rolls the migration back (the
//! process resumes here, with its sockets out of repair mode, and the
//! destination drops its copy). Release is the commit point: from there the
//! destination holds the process, and what fails is reported, not undone,
//! unless the destination did not commit: it refused the Commit (a copy
//! that lost its pages: the source's is intact), or, asked after a Commit
//! whose answer was lost, says it never resumed the process (protocol 11;
//! the copy here waits stopped, "in doubt", until it says). The journal
//! ([`crate::engine::journal`]) records the migration from Start, and as
//! released just before the first Commit, for a restart of this agent.
//! "cancel":
//! `Control.CancelMigration` stops the migration at the start of a phase
//! that checks it; at Restore the cancel switch closes: from there the
//! migration commits or rolls back by itself
//! ([`super::cancel::Cancel::enter_restore`]). "report phase": the name the
//! report and the progress events give the time from that phase on; a phase
//! without one counts in the one before, and the report's first phase,
//! `prepare`, runs from the request to the first phase that has one.
//! `phases_and_the_table_agree` checks this table against [`PhaseName`].

mod abort;
mod arm;
mod carry;
mod commit;
mod discard;
mod dump;
mod fill;
mod outgoing;
mod peers;
mod post_copy;
mod pre_copy;
mod pre_read;
mod prepare;
mod release;
mod restore;
mod run;
mod settle;
mod sockets;
mod start;
#[cfg(test)]
mod tests;
mod transfer;
mod translate;
mod undo;

use std::sync::Arc;

use ferry_proto::v1::MigrationReport;
use tracing::Instrument;

pub use outgoing::Outgoing;
pub use prepare::{MigrationOptions, Prepared, prepare};
pub use run::Events;
pub(crate) use undo::untranslate_in_cluster;

use super::Engine;
use super::EngineError;
use run::Run;

/// A phase of a migration from this node, with what it needs from the
/// phases before it (see the table above).
enum Phase {
    Start,
    PreCopy,
    PreRead,
    Listen(carry::Listening),
    Arm(carry::Arming),
    Settle(carry::Settling),
    Dump(carry::Dumping),
    Transfer(carry::Transferring),
    Restore(carry::Restoring),
    Translate(carry::Translating),
    Release(carry::Releasing),
    Commit(carry::Committing),
    PostCopy(carry::Waiting),
    Discard(Stop),
    Fill(Stop),
    Abort(EngineError),
    Done(Stop),
}

/// The phases by name, for the table's guards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PhaseName {
    Start,
    PreCopy,
    PreRead,
    Listen,
    Arm,
    Settle,
    Dump,
    Transfer,
    Restore,
    Translate,
    Release,
    Commit,
    PostCopy,
    Discard,
    Fill,
    Abort,
    Done,
}

/// Where a phase stands to `Control.CancelMigration`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelPoint {
    /// A cancel asked before the phase starts stops the migration there.
    Checked,
    /// From this phase on a cancel is refused (the destination restores).
    Closed,
    /// Not checked here.
    Unchecked,
}

impl PhaseName {
    pub const ALL: [PhaseName; 17] = [
        PhaseName::Start,
        PhaseName::PreCopy,
        PhaseName::PreRead,
        PhaseName::Listen,
        PhaseName::Arm,
        PhaseName::Settle,
        PhaseName::Dump,
        PhaseName::Transfer,
        PhaseName::Restore,
        PhaseName::Translate,
        PhaseName::Release,
        PhaseName::Commit,
        PhaseName::PostCopy,
        PhaseName::Discard,
        PhaseName::Fill,
        PhaseName::Abort,
        PhaseName::Done,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PhaseName::Start => "Start",
            PhaseName::PreCopy => "PreCopy",
            PhaseName::PreRead => "PreRead",
            PhaseName::Listen => "Listen",
            PhaseName::Arm => "Arm",
            PhaseName::Settle => "Settle",
            PhaseName::Dump => "Dump",
            PhaseName::Transfer => "Transfer",
            PhaseName::Restore => "Restore",
            PhaseName::Translate => "Translate",
            PhaseName::Release => "Release",
            PhaseName::Commit => "Commit",
            PhaseName::PostCopy => "PostCopy",
            PhaseName::Discard => "Discard",
            PhaseName::Fill => "Fill",
            PhaseName::Abort => "Abort",
            PhaseName::Done => "Done",
        }
    }

    /// The phases this one may lead to, besides [`PhaseName::Abort`].
    pub fn next(self) -> &'static [PhaseName] {
        use PhaseName::*;
        match self {
            Start => &[PreCopy, PreRead, Listen],
            PreCopy => &[PreRead, Listen],
            PreRead => &[Listen],
            Listen => &[Arm, Settle],
            Arm => &[Settle],
            Settle => &[Dump],
            Dump => &[Transfer],
            Transfer => &[Restore],
            Restore => &[Translate, Release],
            Translate => &[Release],
            Release => &[Commit],
            Commit => &[Discard, PostCopy],
            PostCopy => &[Discard],
            Discard => &[Fill, Done],
            Fill | Abort => &[Done],
            Done => &[],
        }
    }

    /// Whether an error in this phase rolls the migration back; for Commit
    /// only when the destination did not commit (see the table).
    pub fn may_abort(self) -> bool {
        use PhaseName::*;
        matches!(
            self,
            Start
                | PreCopy
                | PreRead
                | Listen
                | Arm
                | Settle
                | Dump
                | Transfer
                | Restore
                | Translate
                | Commit
        )
    }

    pub fn cancel(self) -> CancelPoint {
        use PhaseName::*;
        match self {
            Start | PreCopy | PreRead | Arm | Settle | Dump | Transfer => CancelPoint::Checked,
            Restore => CancelPoint::Closed,
            _ => CancelPoint::Unchecked,
        }
    }

    /// The report's name for the time from this phase on, if it starts one.
    pub fn report_phase(self) -> Option<&'static str> {
        use PhaseName::*;
        Some(match self {
            PreCopy => "pre-copy",
            PreRead => "sockets pre-read",
            Arm => "arm",
            Dump => "dump",
            Transfer => "transfer",
            Restore => "restore",
            Translate => "translate",
            Release => "release",
            Commit => "commit",
            PostCopy => "post-copy",
            Discard => "discard",
            Fill => "fill",
            Abort => "abort",
            Start | Listen | Settle | Done => return None,
        })
    }
}

impl Phase {
    fn name(&self) -> PhaseName {
        match self {
            Phase::Start => PhaseName::Start,
            Phase::PreCopy => PhaseName::PreCopy,
            Phase::PreRead => PhaseName::PreRead,
            Phase::Listen(_) => PhaseName::Listen,
            Phase::Arm(_) => PhaseName::Arm,
            Phase::Settle(_) => PhaseName::Settle,
            Phase::Dump(_) => PhaseName::Dump,
            Phase::Transfer(_) => PhaseName::Transfer,
            Phase::Restore(_) => PhaseName::Restore,
            Phase::Translate(_) => PhaseName::Translate,
            Phase::Release(_) => PhaseName::Release,
            Phase::Commit(_) => PhaseName::Commit,
            Phase::PostCopy(_) => PhaseName::PostCopy,
            Phase::Discard(_) => PhaseName::Discard,
            Phase::Fill(_) => PhaseName::Fill,
            Phase::Abort(_) => PhaseName::Abort,
            Phase::Done(_) => PhaseName::Done,
        }
    }
}

/// How a migration ended.
#[derive(Debug)]
enum Stop {
    /// Failed before the commit point and rolled back: the process runs
    /// here.
    Aborted,
    /// Committed (the source copy is gone); maybe the destination's
    /// confirmation of the resume failed.
    Committed(Option<EngineError>),
    /// Post-copy: committed, then the pages could not all follow; the
    /// destination killed the process and the source's copy is gone too.
    Lost(EngineError),
}

/// Runs one phase: its step, then the phase it leads to. An error in a
/// phase that may abort leads to [`Phase::Abort`].
async fn step(run: &mut Run, phase: Phase) -> Phase {
    let from = phase.name();
    crate::engine::fault_point::reached(crate::engine::fault_point::Side::Source, from.as_str())
        .await;
    if let Some(name) = from.report_phase() {
        run.phase(name).await;
    }
    let next = match phase {
        Phase::Start => start::start(run).await,
        Phase::PreCopy => pre_copy::pre_copy(run).await,
        Phase::PreRead => pre_read::pre_read(run).await,
        Phase::Listen(l) => settle::listen(run, l).await,
        Phase::Arm(a) => arm::arm(run, a).await,
        Phase::Settle(s) => settle::settle(run, s).await,
        Phase::Dump(d) => dump::dump(run, d).await,
        Phase::Transfer(t) => transfer::transfer(run, t).await,
        Phase::Restore(r) => restore::restore(run, r).await,
        Phase::Translate(t) => translate::translate(run, t).await,
        Phase::Release(r) => Ok(release::release(run, r).await),
        Phase::Commit(c) => commit::commit(run, c).await,
        Phase::PostCopy(w) => Ok(post_copy::post_copy(run, w).await),
        Phase::Discard(stop) => Ok(discard::discard(run, stop).await),
        Phase::Fill(stop) => Ok(fill::fill(run, stop).await),
        Phase::Abort(e) => Ok(abort::abort(run, e).await),
        Phase::Done(stop) => Ok(Phase::Done(stop)),
    };
    let next = match next {
        Ok(next) => next,
        Err(e) if from.may_abort() => Phase::Abort(e),
        // Only phases that may abort return errors; this would be a bug.
        Err(e) => {
            tracing::error!(phase = from.as_str(), error = %e, "an error after the commit point");
            Phase::Done(Stop::Committed(Some(e)))
        }
    };
    debug_assert!(
        from.next().contains(&next.name()) || (from.may_abort() && next.name() == PhaseName::Abort),
        "{} -> {} is not in the table",
        from.as_str(),
        next.name().as_str()
    );
    // A cancel asked for meanwhile stops the migration before the next
    // phase that checks it; the one that closes the switch refuses later
    // ones.
    let cancelled = match next.name().cancel() {
        CancelPoint::Checked => run.p.cancel.check(),
        CancelPoint::Closed => run.p.cancel.enter_restore(),
        CancelPoint::Unchecked => Ok(()),
    };
    match cancelled {
        Ok(()) => next,
        Err(e) => Phase::Abort(e),
    }
}

/// Runs a prepared migration to its end and returns its report. Meant to be
/// spawned: it must finish (commit or roll back) even if the caller goes.
pub async fn run(engine: Arc<Engine>, p: Prepared, events: Events) -> MigrationReport {
    let span = tracing::info_span!("migration", id = %p.migration_id, pid = p.pid, to = %p.destination.name);
    async move {
        let mut run = Run::begin(engine.clone(), p, events).await;
        let mut phase = match run.p.cancel.check() {
            Ok(()) => Phase::Start,
            Err(e) => Phase::Abort(e),
        };
        let stop = loop {
            phase = match phase {
                Phase::Done(stop) => break stop,
                phase => step(&mut run, phase).await,
            };
        };
        run.end(stop).await
    }
    .instrument(span)
    .await
}
