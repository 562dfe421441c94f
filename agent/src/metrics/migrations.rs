//! What finished migrations add up to, recorded when a migration this
//! node ran as the source ends (`crate::reports::Reports::store`).

use ferry_proto::v1::{self as pb, MigrationReport};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

/// Freeze times: a few milliseconds (an idle process) to seconds (large
/// images, thousands of connections).
pub const FREEZE_BUCKETS: &[f64] = &[
    0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
];
/// Whole migrations, request to end.
pub const DURATION_BUCKETS: &[f64] = &[
    0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MigrationLabels {
    strategy: &'static str,
    outcome: &'static str,
    /// How the TCP connections moved: "collective" or "iterative".
    sockets: &'static str,
}

impl MigrationLabels {
    fn of(report: &MigrationReport) -> Self {
        Self {
            strategy: match pb::Strategy::try_from(report.strategy) {
                Ok(pb::Strategy::TotalCopy) => "total_copy",
                Ok(pb::Strategy::PreCopy) => "pre_copy",
                Ok(pb::Strategy::QueuedPreCopy) => "queued_pre_copy",
                Ok(pb::Strategy::PostCopy) => "post_copy",
                _ => "unspecified",
            },
            outcome: match pb::MigrationOutcome::try_from(report.outcome) {
                Ok(pb::MigrationOutcome::Committed) => "committed",
                Ok(pb::MigrationOutcome::Aborted) => "aborted",
                Ok(pb::MigrationOutcome::Lost) => "lost",
                _ => "unspecified",
            },
            sockets: match pb::SocketMigration::try_from(report.sockets) {
                Ok(pb::SocketMigration::Collective) => "collective",
                Ok(pb::SocketMigration::Iterative) => "iterative",
                Ok(pb::SocketMigration::Incremental) => "incremental",
                _ => "unspecified",
            },
        }
    }
}

type HistogramFamily = Family<MigrationLabels, Histogram, fn() -> Histogram>;

/// What finished migrations add up to. Cheap to clone: the clones share
/// their values (a registry holds one, the agent another).
#[derive(Debug, Clone)]
pub struct MigrationMetrics {
    migrations: Family<MigrationLabels, Counter>,
    freeze: HistogramFamily,
    duration: HistogramFamily,
    transferred: Family<MigrationLabels, Counter>,
    image: Family<MigrationLabels, Counter>,
}

impl Default for MigrationMetrics {
    /// Every strategy and outcome starts at zero, present from the first
    /// scrape on: Prometheus' `rate()` and `increase()` only see a series
    /// grow from a value they scraped.
    fn default() -> Self {
        let m = Self {
            migrations: Family::default(),
            freeze: Family::new_with_constructor(|| Histogram::new(FREEZE_BUCKETS.iter().copied())),
            duration: Family::new_with_constructor(|| {
                Histogram::new(DURATION_BUCKETS.iter().copied())
            }),
            transferred: Family::default(),
            image: Family::default(),
        };
        let outcomes = [
            pb::MigrationOutcome::Committed,
            pb::MigrationOutcome::Aborted,
        ];
        let socket_paths = [
            pb::SocketMigration::Collective,
            pb::SocketMigration::Iterative,
            pb::SocketMigration::Incremental,
        ];
        for (outcome, sockets) in outcomes
            .into_iter()
            .flat_map(|o| socket_paths.map(|s| (o, s)))
        {
            let labels = MigrationLabels::of(&MigrationReport {
                strategy: pb::Strategy::TotalCopy as i32,
                outcome: outcome as i32,
                sockets: sockets as i32,
                ..Default::default()
            });
            let _ = m.migrations.get_or_create(&labels);
            let _ = m.freeze.get_or_create(&labels);
            let _ = m.duration.get_or_create(&labels);
            let _ = m.transferred.get_or_create(&labels);
            let _ = m.image.get_or_create(&labels);
        }
        m
    }
}

impl MigrationMetrics {
    /// Counts a finished migration (this node was its source).
    pub fn record(&self, report: &MigrationReport) {
        let labels = MigrationLabels::of(report);
        self.migrations.get_or_create(&labels).inc();
        // A migration that failed before the freeze has none to count.
        if report.freeze_time_us > 0 {
            self.freeze
                .get_or_create(&labels)
                .observe(report.freeze_time_us as f64 / 1e6);
        }
        self.duration
            .get_or_create(&labels)
            .observe(report.total_time_us as f64 / 1e6);
        self.transferred
            .get_or_create(&labels)
            .inc_by(report.bytes_transferred);
        self.image.get_or_create(&labels).inc_by(report.image_bytes);
    }

    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "ferry_migrations",
            "Migrations this node ran as the source, by strategy, outcome and how the TCP \
             connections moved",
            self.migrations.clone(),
        );
        registry.register_with_unit(
            "ferry_migration_freeze",
            "How long the process was stopped: from the freeze on the source to running again \
             (on the destination, or on the source after an abort)",
            Unit::Seconds,
            self.freeze.clone(),
        );
        registry.register_with_unit(
            "ferry_migration_duration",
            "Whole migrations, from the request to the commit or the end of the rollback",
            Unit::Seconds,
            self.duration.clone(),
        );
        registry.register_with_unit(
            "ferry_migration_transferred",
            "Bytes sent to destinations over the peer connection",
            Unit::Bytes,
            self.transferred.clone(),
        );
        registry.register_with_unit(
            "ferry_migration_image",
            "Bytes of checkpoint images dumped",
            Unit::Bytes,
            self.image.clone(),
        );
    }
}
