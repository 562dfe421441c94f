//! `ferry events`: one line (or one JSON object) per cluster event.

use ferry_proto::v1::{ClusterEvent, MigrationOutcome, cluster_event::Event};
use serde_json::json;

pub fn line(ev: &ClusterEvent) -> String {
    let what = match &ev.event {
        Some(Event::MigrationStarted(s)) => format!(
            "migration {} started: PID {} {} -> {}",
            s.migration_id, s.pid, s.source_node, s.destination_node
        ),
        Some(Event::MigrationPhase(p)) => {
            let pr = p.progress.clone().unwrap_or_default();
            format!(
                "migration {}: {} ({:.1} ms, {} bytes)",
                p.migration_id,
                pr.phase,
                pr.elapsed_us as f64 / 1000.0,
                pr.bytes_transferred
            )
        }
        Some(Event::MigrationFinished(r)) => format!(
            "migration {} {}: freeze {:.1} ms, total {:.1} ms{}",
            r.migration_id,
            MigrationOutcome::try_from(r.outcome)
                .map(|o| o
                    .as_str_name()
                    .trim_start_matches("MIGRATION_OUTCOME_")
                    .to_lowercase())
                .unwrap_or_else(|_| "?".into()),
            r.freeze_time_us as f64 / 1000.0,
            r.total_time_us as f64 / 1000.0,
            if r.error.is_empty() {
                String::new()
            } else {
                format!(": {}", r.error)
            }
        ),
        Some(Event::Membership(m)) => {
            if m.previous.is_empty() {
                format!("member {} seen: {}", m.member, m.state)
            } else {
                format!("member {}: {} -> {}", m.member, m.previous, m.state)
            }
        }
        Some(Event::Balancer(b)) => format!(
            "balancer: {}, because {}",
            b.decision,
            crate::output::decision_why(b)
        ),
        Some(Event::Cordon(c)) => format!(
            "{} by {}",
            if c.cordoned { "cordoned" } else { "uncordoned" },
            c.by
        ),
        Some(Event::DrainFinished(d)) => format!(
            "drain {}: {} moved, {} left",
            if d.cancelled_by.is_empty() {
                "finished".to_owned()
            } else {
                format!("cancelled by {}", d.cancelled_by)
            },
            d.moved,
            d.remaining.len()
        ),
        Some(Event::Watch(w)) => {
            if w.missed > 0 {
                format!("missed {} events of {}", w.missed, w.peer)
            } else if w.connected {
                format!("watching {}", w.peer)
            } else {
                format!("not watching {}: {}", w.peer, w.error)
            }
        }
        Some(Event::Group(g)) => format!("group on port {}: {} {}", g.port, g.what, g.detail),
        Some(Event::ProcessStarted(p)) => format!(
            "process {} under management ({}): {}",
            p.pid,
            p.origin,
            p.argv.join(" ")
        ),
        Some(Event::ProcessExited(p)) => format!(
            "process {} {}: {}",
            p.pid,
            p.exit
                .as_ref()
                .map(|e| e.description.as_str())
                .unwrap_or("ended"),
            p.argv.join(" ")
        ),
        None => "?".into(),
    };
    format!("{} {:<10} {what}", time(ev.at_unix_ms), ev.node)
}

/// HH:MM:SS.mmm in UTC.
fn time(unix_ms: u64) -> String {
    let s = unix_ms / 1000;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        (s / 3600) % 24,
        (s / 60) % 60,
        s % 60,
        unix_ms % 1000
    )
}

pub fn to_json(ev: &ClusterEvent) -> serde_json::Value {
    let (kind, detail) = match &ev.event {
        Some(Event::MigrationStarted(s)) => (
            "migration_started",
            json!({
            "migration_id": s.migration_id, "pid": s.pid,
            "source_node": s.source_node, "destination_node": s.destination_node}),
        ),
        Some(Event::MigrationPhase(p)) => {
            let pr = p.progress.clone().unwrap_or_default();
            (
                "migration_phase",
                json!({"migration_id": p.migration_id, "phase": pr.phase,
                "elapsed_us": pr.elapsed_us, "bytes_transferred": pr.bytes_transferred}),
            )
        }
        Some(Event::MigrationFinished(r)) => (
            "migration_finished",
            json!({
            "migration_id": r.migration_id, "outcome": r.outcome, "error": r.error,
            "source_pid": r.source_pid, "destination_pid": r.destination_pid,
            "freeze_time_us": r.freeze_time_us, "total_time_us": r.total_time_us}),
        ),
        Some(Event::Membership(m)) => (
            "membership",
            json!({
            "member": m.member, "state": m.state, "previous": m.previous}),
        ),
        Some(Event::Balancer(b)) => ("balancer", crate::output::decision_json(b)),
        Some(Event::Cordon(c)) => ("cordon", json!({"cordoned": c.cordoned, "by": c.by})),
        Some(Event::DrainFinished(d)) => (
            "drain_finished",
            json!({
            "moved": d.moved, "remaining": d.remaining, "elapsed_us": d.elapsed_us,
            "cancelled_by": d.cancelled_by}),
        ),
        Some(Event::Watch(w)) => (
            "watch",
            json!({
            "peer": w.peer, "connected": w.connected, "error": w.error, "missed": w.missed}),
        ),
        Some(Event::Group(g)) => (
            "group",
            json!({"port": g.port, "what": g.what, "detail": g.detail}),
        ),
        Some(Event::ProcessStarted(p)) => (
            "process_started",
            json!({"pid": p.pid, "argv": p.argv, "origin": p.origin}),
        ),
        Some(Event::ProcessExited(p)) => {
            let e = p.exit.clone().unwrap_or_default();
            (
                "process_exited",
                json!({"pid": p.pid, "argv": p.argv, "status_known": e.status_known,
                "code": e.code, "signal": e.signal, "description": e.description}),
            )
        }
        None => ("unknown", json!({})),
    };
    json!({"node": ev.node, "at_unix_ms": ev.at_unix_ms, "sequence": ev.sequence,
           "kind": kind, "event": detail})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_utc_clock_times() {
        // 2026-11-23T14:40:50.469Z
        assert_eq!(time(1_795_444_850_469), "14:40:50.469");
    }
}
