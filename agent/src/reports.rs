//! The reports of the migrations this node ran as the source, and the
//! metrics they add up to.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use ferry_proto::v1::MigrationReport;

use crate::metrics::migrations::MigrationMetrics;
use crate::sync::lock;

/// How many reports a node keeps for `GetMigration`, the newest: an agent
/// that runs for months must not keep every one (the soak showed its
/// memory growing with them). The metrics count them all.
pub const REPORTS_KEPT: usize = 1024;

#[derive(Debug, Default)]
pub struct Reports {
    kept: Mutex<Kept>,
    /// Finished migrations, for `/metrics`.
    pub metrics: MigrationMetrics,
}

#[derive(Debug, Default)]
struct Kept {
    by_id: HashMap<String, MigrationReport>,
    /// Their ids, oldest first.
    order: VecDeque<String>,
}

impl Reports {
    /// Keeps a finished migration's report (dropping the oldest beyond
    /// [`REPORTS_KEPT`]) and counts it.
    pub fn store(&self, report: MigrationReport) {
        self.metrics.record(&report);
        let mut kept = lock(&self.kept);
        let id = report.migration_id.clone();
        if kept.by_id.insert(id.clone(), report).is_none() {
            kept.order.push_back(id);
        }
        while kept.order.len() > REPORTS_KEPT {
            if let Some(old) = kept.order.pop_front() {
                kept.by_id.remove(&old);
            }
        }
    }

    pub fn get(&self, id: &str) -> Option<MigrationReport> {
        lock(&self.kept).by_id.get(id).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_newest_reports_are_kept() {
        let reports = Reports::default();
        for i in 0..REPORTS_KEPT + 10 {
            reports.store(MigrationReport {
                migration_id: format!("m{i}"),
                ..Default::default()
            });
        }
        assert!(reports.get("m0").is_none());
        assert!(reports.get("m9").is_none());
        assert!(reports.get("m10").is_some());
        assert!(reports.get(&format!("m{}", REPORTS_KEPT + 9)).is_some());
        // A report stored again (a cancel's) replaces its own.
        reports.store(MigrationReport {
            migration_id: "m10".into(),
            error: "again".into(),
            ..Default::default()
        });
        assert_eq!(reports.get("m10").unwrap().error, "again");
        assert!(reports.get("m11").is_some());
    }
}
