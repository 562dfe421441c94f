//! A Migrate (or DrainNode) request's fields checked before anything
//! starts: the error names the field and the range (fuzzed in
//! `fuzzing::control_request`).

use ferry_proto::v1::{self as pb, MigrateRequest};
use tonic::Status;

use crate::engine::source;
use crate::sockstate::SocketMigration;

/// A Migrate request's fields, checked: the PID, the destination and the
/// options; the error names the field.
pub fn migrate_options(
    req: &MigrateRequest,
) -> Result<(i32, String, source::MigrationOptions), Status> {
    if req.pid <= 0 {
        return Err(Status::invalid_argument(format!(
            "pid: {} is not a process ID",
            req.pid
        )));
    }
    if req.destination_node.is_empty() {
        return Err(Status::invalid_argument(
            "destination_node: name the node to migrate to",
        ));
    }
    let strategy = match pb::Strategy::try_from(req.strategy) {
        Ok(s) => crate::engine::precopy::MemoryStrategy::from_pb(s),
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "strategy: {} is not a strategy this agent implements (1 total-copy, 2 pre-copy, 3 queued-pre-copy, 4 post-copy, 5 assisted-post-copy)",
                req.strategy
            )));
        }
    };
    if req.downtime_budget_ms > crate::config::MAX_DOWNTIME_BUDGET_MS {
        return Err(Status::invalid_argument(format!(
            "downtime_budget_ms: {} is above {}",
            req.downtime_budget_ms,
            crate::config::MAX_DOWNTIME_BUDGET_MS
        )));
    }
    if req.max_rounds > crate::config::MAX_PRECOPY_ROUNDS {
        return Err(Status::invalid_argument(format!(
            "max_rounds: {} is above {}",
            req.max_rounds,
            crate::config::MAX_PRECOPY_ROUNDS
        )));
    }
    if req.drain_send_queues_ms > crate::config::MAX_DRAIN_SEND_QUEUES_MS {
        return Err(Status::invalid_argument(format!(
            "drain_send_queues_ms: {} is above {}",
            req.drain_send_queues_ms,
            crate::config::MAX_DRAIN_SEND_QUEUES_MS
        )));
    }
    let sockets = match pb::SocketMigration::try_from(req.sockets) {
        Ok(pb::SocketMigration::Unspecified) => None,
        Ok(pb::SocketMigration::Iterative) => Some(SocketMigration::Iterative),
        Ok(pb::SocketMigration::Collective) => Some(SocketMigration::Collective),
        Ok(pb::SocketMigration::Incremental) => Some(SocketMigration::Incremental),
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "sockets: {} is not a socket migration mode (1 iterative, 2 collective, 3 incremental)",
                req.sockets
            )));
        }
    };
    let throttle = match pb::PrecopyThrottle::try_from(req.throttle) {
        Ok(pb::PrecopyThrottle::Unspecified) => None,
        Ok(pb::PrecopyThrottle::Off) => Some(false),
        Ok(pb::PrecopyThrottle::Auto) => Some(true),
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "throttle: {} is not a throttle mode (1 off, 2 auto)",
                req.throttle
            )));
        }
    };
    let options = source::MigrationOptions {
        sockets,
        strategy,
        downtime_budget: (req.downtime_budget_ms > 0)
            .then(|| std::time::Duration::from_millis(u64::from(req.downtime_budget_ms))),
        max_rounds: (req.max_rounds > 0).then_some(req.max_rounds),
        throttle,
        flush_send_queues: (req.drain_send_queues_ms > 0)
            .then(|| std::time::Duration::from_millis(u64::from(req.drain_send_queues_ms))),
    };
    Ok((req.pid, req.destination_node.clone(), options))
}

/// A DrainNode request's migration options, checked as Migrate's are.
pub fn drain_options(req: &pb::DrainNodeRequest) -> Result<source::MigrationOptions, Status> {
    let as_migrate = MigrateRequest {
        pid: 1,
        destination_node: "-".into(),
        strategy: req.strategy,
        sockets: req.sockets,
        downtime_budget_ms: req.downtime_budget_ms,
        ..Default::default()
    };
    migrate_options(&as_migrate).map(|(_, _, o)| o)
}
