//! The reports of the migrations this node ran as the source, and the
//! metrics they add up to.

use std::collections::HashMap;
use std::sync::Mutex;

use ferry_proto::v1::MigrationReport;

use crate::metrics::migrations::MigrationMetrics;
use crate::sync::lock;

#[derive(Debug, Default)]
pub struct Reports {
    by_id: Mutex<HashMap<String, MigrationReport>>,
    /// Finished migrations, for `/metrics`.
    pub metrics: MigrationMetrics,
}

impl Reports {
    /// Keeps a finished migration's report and counts it.
    pub fn store(&self, report: MigrationReport) {
        self.metrics.record(&report);
        lock(&self.by_id).insert(report.migration_id.clone(), report);
    }

    pub fn get(&self, id: &str) -> Option<MigrationReport> {
        lock(&self.by_id).get(id).cloned()
    }
}
