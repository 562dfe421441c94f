//! The variants of Meehan & Wynne (openMosix)'s experiment: openMosix's
//! policies with each kind of knowledge (the paper's table), and ferry's,
//! whole or with one part off.

use serde::Serialize;

use crate::location::LocationKind;

/// What a node knows of the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Knowledge {
    /// Standard openMosix: own load only, circular queue of 8.
    OwnLoadOnly,
    /// Hearsay vector of the given size.
    Hearsay(usize),
}

impl Knowledge {
    pub fn label(self) -> String {
        match self {
            Knowledge::OwnLoadOnly => "own load only (8)".into(),
            Knowledge::Hearsay(n) => format!("hearsay {n}"),
        }
    }
}

/// Which policies a variant runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Variant {
    /// Standard openMosix: own load only, circular queue of 8 (test A).
    OwnLoadOnly,
    /// Hearsay vector of the given size (tests C, D, E, B).
    Hearsay(usize),
    /// ferry's policies ([`FerryPart`]: every part on) with the same load
    /// model, knowledge and mechanism (stop-and-copy, 4 MiB over 1 Gb/s).
    /// Not in Meehan & Wynne (openMosix)'s table.
    Ferry(Knowledge, LocationKind),
    /// ferry's policies with hearsay 8 and least-loaded location, one part
    /// off: what that part is worth.
    FerryWithout(FerryPart),
}

/// The parts of ferry's policies that openMosix's lack, each switchable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum FerryPart {
    /// A node sends only while above the average it knows
    /// (`transfer.mode = "sender_threshold"`, no absolute threshold: every
    /// node here has more processes than CPUs), not whenever some peer looks
    /// lighter (openMosix): a node that has shed down to the average stops.
    AboveAverage,
    /// The load follows a migration at once (`load.follow_migrations`).
    FollowMigrations,
    /// The sender counts what it moved to a peer until newer news of it
    /// (`transfer.count_promised`).
    CountPromised,
    /// The next move is planned as soon as one commits
    /// (`transfer.replan_on_commit`).
    ReplanOnCommit,
    /// The process is picked at once: ferryd freezes a process wherever it
    /// is, openMosix's `consider()` waits for the dispatcher to run it.
    SelectAtOnce,
    /// The receiver checks the offer against its own export load and the
    /// average it knows (`transfer.receiver_check`,
    /// `transfer.receiver_up_to_average`).
    ReceiverUpToAverage,
    /// A process that arrived stays 30 s before it may hop on
    /// (`selection.rehop_residency_ms`).
    RehopResidency,
}

impl FerryPart {
    pub const ALL: [FerryPart; 7] = [
        FerryPart::AboveAverage,
        FerryPart::FollowMigrations,
        FerryPart::CountPromised,
        FerryPart::ReplanOnCommit,
        FerryPart::SelectAtOnce,
        FerryPart::ReceiverUpToAverage,
        FerryPart::RehopResidency,
    ];

    pub fn label(self) -> &'static str {
        match self {
            FerryPart::AboveAverage => "sender above the average",
            FerryPart::FollowMigrations => "load follows migrations",
            FerryPart::CountPromised => "promised load counted",
            FerryPart::ReplanOnCommit => "next move at commit",
            FerryPart::SelectAtOnce => "process picked at once",
            FerryPart::ReceiverUpToAverage => "receiver up to the average",
            FerryPart::RehopResidency => "no second hop within 30 s",
        }
    }
}

impl Variant {
    /// The variants of Meehan & Wynne (openMosix)'s table, in its order.
    pub const SEED_TABLE: [Variant; 5] = [
        Variant::OwnLoadOnly,
        Variant::Hearsay(8),
        Variant::Hearsay(12),
        Variant::Hearsay(16),
        Variant::Hearsay(20),
    ];

    /// ferry's policies with each of the table's kinds of knowledge.
    pub const FERRY_TABLE: [Variant; 5] = [
        Variant::Ferry(Knowledge::OwnLoadOnly, LocationKind::LeastLoaded),
        Variant::Ferry(Knowledge::Hearsay(8), LocationKind::LeastLoaded),
        Variant::Ferry(Knowledge::Hearsay(12), LocationKind::LeastLoaded),
        Variant::Ferry(Knowledge::Hearsay(16), LocationKind::LeastLoaded),
        Variant::Ferry(Knowledge::Hearsay(20), LocationKind::LeastLoaded),
    ];

    /// The other location policies, on ferry's policies with hearsay 8.
    pub const LOCATION_ALTERNATIVES: [Variant; 3] = [
        Variant::Ferry(Knowledge::Hearsay(8), LocationKind::Random),
        Variant::Ferry(Knowledge::Hearsay(8), LocationKind::PowerOfTwo),
        Variant::Ferry(Knowledge::Hearsay(8), LocationKind::MirrorAverage),
    ];

    /// ferry's policies without one part each, on hearsay 8.
    pub fn ablations() -> impl Iterator<Item = Variant> {
        FerryPart::ALL.into_iter().map(Variant::FerryWithout)
    }

    /// Runs ferry's policies rather than openMosix's.
    pub fn is_ferry(&self) -> bool {
        matches!(self, Variant::Ferry(..) | Variant::FerryWithout(_))
    }

    /// Whether this variant runs that part of ferry's policies.
    pub fn has(&self, part: FerryPart) -> bool {
        match *self {
            Variant::Ferry(..) => true,
            Variant::FerryWithout(off) => off != part,
            Variant::OwnLoadOnly | Variant::Hearsay(_) => false,
        }
    }

    pub fn knowledge(&self) -> Knowledge {
        match *self {
            Variant::OwnLoadOnly => Knowledge::OwnLoadOnly,
            Variant::Hearsay(n) => Knowledge::Hearsay(n),
            Variant::Ferry(k, _) => k,
            Variant::FerryWithout(_) => Knowledge::Hearsay(8),
        }
    }

    pub fn label(&self) -> String {
        match self {
            Variant::OwnLoadOnly | Variant::Hearsay(_) => self.knowledge().label(),
            Variant::Ferry(k, LocationKind::LeastLoaded) => format!("ferry, {}", k.label()),
            Variant::Ferry(k, location) => format!(
                "ferry, {}, {} location",
                k.label(),
                match location {
                    LocationKind::MirrorAverage => "mirror-average",
                    LocationKind::LeastLoaded => "least-loaded",
                    LocationKind::Random => "random",
                    LocationKind::PowerOfTwo => "power-of-two",
                }
            ),
            Variant::FerryWithout(part) => format!("ferry, hearsay 8, without: {}", part.label()),
        }
    }
}

/// Meehan & Wynne (openMosix) §5's table, the reference the simulation is
/// compared with: recovery time (s), choose() count per node, migrations per
/// node, and load-message size (B). These are the paper's measurements, not
/// outputs.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SeedReference {
    pub test: &'static str,
    pub recovery_secs: f64,
    pub choose_per_node: f64,
    pub migrations_per_node: f64,
    pub message_bytes: u32,
}

pub fn seed_reference(variant: Variant) -> Option<SeedReference> {
    let r = |test, recovery_secs, choose_per_node, migrations_per_node, message_bytes| {
        Some(SeedReference {
            test,
            recovery_secs,
            choose_per_node,
            migrations_per_node,
            message_bytes,
        })
    };
    match variant {
        Variant::OwnLoadOnly => r("A", 81.1, 74.5, 13.4, 40),
        Variant::Hearsay(8) => r("C", 77.7, 66.7, 13.7, 300),
        Variant::Hearsay(12) => r("D", 76.1, 73.1, 13.7, 444),
        Variant::Hearsay(16) => r("E", 87.4, 85.9, 14.7, 588),
        Variant::Hearsay(20) => r("B", 96.0, 88.6, 14.9, 732),
        Variant::Hearsay(_) | Variant::Ferry(..) | Variant::FerryWithout(_) => None,
    }
}
