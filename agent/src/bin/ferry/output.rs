//! What the CLI prints of the agent's records, as tables and text or as
//! JSON (`--json`): nodes, processes, migration reports, the data plane and
//! the balancer.

use anyhow::Result;
use ferry_proto::v1::{self as pb, MigrationReport};
use serde_json::json;

/// `ferry nodes`: a table of the cluster's nodes; `features`: then each
/// node's kernel features, present or not.
pub(crate) fn print_nodes(nodes: Vec<pb::Node>, features: bool, as_json: bool) -> Result<()> {
    if as_json {
        let v: Vec<_> = nodes.iter().map(|n| json!({
            "name": n.name, "peer_address": n.peer_address, "self": n.is_self,
            "public_addresses": n.public_addresses,
            "reachable": n.reachable, "peer_protocol_version": n.peer_protocol_version,
            "managed_processes": n.managed_processes, "error": n.error,
            "membership_state": n.membership_state, "load": if n.has_load { json!(n.load) } else { json!(null) },
            "load_age_ms": n.load_age_ms, "candidate": n.candidate, "not_candidate": n.not_candidate,
            "cordoned": n.cordoned,
            "kernel": n.kernel,
            "features": n.features.iter().map(|f| json!({
                "key": f.key, "name": f.name, "present": f.present,
            })).collect::<Vec<_>>(),
            "lacks": lacks(n),
        })).collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{:<16} {:<22} {:<28} {:<10} {:<8} {:>7} {:>9} {:>9}  {:<20} {:<28}  NOTE",
        "NODE",
        "PEER ADDRESS",
        "PUBLIC",
        "STATE",
        "SWIM",
        "LOAD",
        "PROTOCOL",
        "MANAGED",
        "KERNEL",
        "LACKS"
    );
    // A node whose public addresses are not this node's takes none of its
    // processes (and gives it none it could not serve).
    let own_public = nodes
        .iter()
        .find(|n| n.is_self)
        .map(|n| n.public_addresses.clone())
        .unwrap_or_default();
    for n in &nodes {
        let state = if n.reachable { "up" } else { "down" };
        let mut note = if n.is_self {
            "this node".to_owned()
        } else if n.candidate {
            format!("balancer candidate {}", n.error)
        } else if !n.not_candidate.is_empty() {
            format!("no balancer candidate: {} {}", n.not_candidate, n.error)
        } else {
            n.error.clone()
        };
        if n.cordoned {
            note = format!("cordoned; {note}");
        }
        if !n.public_addresses.is_empty() && n.public_addresses != own_public {
            note = format!("public addresses differ from this node's; {note}");
        }
        let public = if n.public_addresses.is_empty() {
            "-".to_owned()
        } else {
            n.public_addresses.join(",")
        };
        let load = if n.has_load {
            format!("{:.2}", n.load)
        } else {
            "-".into()
        };
        let lacking = lacks(n);
        let lacking = if n.features.is_empty() {
            "-".to_owned()
        } else if lacking.is_empty() {
            "nothing".to_owned()
        } else {
            lacking.join(",")
        };
        println!(
            "{:<16} {:<22} {:<28} {:<10} {:<8} {:>7} {:>9} {:>9}  {:<20} {:<28}  {}",
            n.name,
            n.peer_address,
            public,
            state,
            n.membership_state,
            load,
            n.peer_protocol_version,
            n.managed_processes,
            if n.kernel.is_empty() { "-" } else { &n.kernel },
            lacking,
            note
        );
    }
    if features {
        for n in nodes.iter().filter(|n| !n.features.is_empty()) {
            println!("\n{} (kernel {})", n.name, n.kernel);
            for f in &n.features {
                let mark = if f.present { "yes" } else { "NO " };
                println!("  {mark}  {:<24} {}", f.key, f.name);
            }
        }
    }
    Ok(())
}

/// The keys of the features node `n` lacks.
fn lacks(n: &pb::Node) -> Vec<&str> {
    n.features
        .iter()
        .filter(|f| !f.present)
        .map(|f| f.key.as_str())
        .collect()
}

/// `ferry ps`: a table of managed processes, with the ports refused them
/// and the nodes that did not answer.
pub(crate) fn print_processes(r: pb::ListProcessesResponse, as_json: bool) -> Result<()> {
    if as_json {
        let v: Vec<_> = r.processes.iter().map(|p| json!({
            "pid": p.pid, "argv": p.argv, "ports": p.ports.iter().map(port_str).collect::<Vec<_>>(),
            "tcp_listening": p.tcp_listening, "tcp_established": p.tcp_established,
            "udp_sockets": p.udp_sockets, "state": p.state, "origin": p.origin,
            "port_conflicts": p.port_conflicts, "node": p.node, "note": p.note,
        })).collect();
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"node": r.node, "processes": v, "unreachable": r.unreachable})
            )?
        );
    } else {
        println!(
            "{:<12} {:>8} {:<10} {:<12} {:<18} {:>6} {:>6} {:>4}  COMMAND",
            "NODE", "PID", "STATE", "ORIGIN", "PORTS", "LISTEN", "ESTAB", "UDP"
        );
        for p in r.processes {
            let ports = p.ports.iter().map(port_str).collect::<Vec<_>>().join(",");
            println!(
                "{:<12} {:>8} {:<10} {:<12} {:<18} {:>6} {:>6} {:>4}  {}",
                p.node,
                p.pid,
                p.state,
                p.origin,
                ports,
                p.tcp_listening,
                p.tcp_established,
                p.udp_sockets,
                p.argv.join(" ")
            );
            for c in &p.port_conflicts {
                println!("{:>21} refused: {c}; its packets go there", "");
            }
            if !p.note.is_empty() {
                println!("{:>21} {}", "", p.note);
            }
        }
        for u in &r.unreachable {
            eprintln!("not listed: {u}");
        }
    }
    Ok(())
}

/// A migration's report: how `ferry migrate` ends, `ferry report` and
/// `ferry cancel`.
pub(crate) fn print_report(r: &MigrationReport, as_json: bool) -> Result<()> {
    let names = ReportNames::of(r);
    if as_json {
        println!("{}", serde_json::to_string_pretty(&report_json(r, &names))?);
        return Ok(());
    }
    print_report_text(r, &names);
    Ok(())
}

/// The report's enums as the words printed for them.
struct ReportNames {
    outcome: &'static str,
    sockets: &'static str,
    strategy: &'static str,
}

impl ReportNames {
    fn of(r: &MigrationReport) -> Self {
        let outcome = match pb::MigrationOutcome::try_from(r.outcome) {
            Ok(pb::MigrationOutcome::Committed) => "committed",
            Ok(pb::MigrationOutcome::Aborted) => "aborted",
            Ok(pb::MigrationOutcome::Lost) => "lost",
            _ => "unknown",
        };
        let sockets = match pb::SocketMigration::try_from(r.sockets) {
            Ok(pb::SocketMigration::Collective) => "collective",
            Ok(pb::SocketMigration::Iterative) => "iterative",
            Ok(pb::SocketMigration::Incremental) => "incremental",
            _ => "unknown",
        };
        let strategy = match pb::Strategy::try_from(r.strategy) {
            Ok(pb::Strategy::TotalCopy) => "total-copy",
            Ok(pb::Strategy::PreCopy) => "pre-copy",
            Ok(pb::Strategy::QueuedPreCopy) => "queued-pre-copy",
            Ok(pb::Strategy::PostCopy) => "post-copy",
            Ok(pb::Strategy::AssistedPostCopy) => "assisted-post-copy",
            _ => "unknown",
        };
        ReportNames {
            outcome,
            sockets,
            strategy,
        }
    }
}

fn report_json(r: &MigrationReport, names: &ReportNames) -> serde_json::Value {
    let ReportNames {
        outcome,
        sockets,
        strategy,
    } = *names;
    let mut v = json!({
        "migration_id": r.migration_id, "outcome": outcome, "error": r.error,
        "strategy": strategy, "source_node": r.source_node, "destination_node": r.destination_node,
        "source_pid": r.source_pid, "destination_pid": r.destination_pid,
        "preparation_time_ms": ms(r.preparation_time_us), "freeze_time_ms": ms(r.freeze_time_us),
        "post_processing_time_ms": ms(r.post_processing_time_us), "total_time_ms": ms(r.total_time_us),
        "image_bytes": r.image_bytes, "image_files": r.image_files, "bytes_transferred": r.bytes_transferred,
        "compressed_page_bytes": r.compressed_page_bytes, "compressed_to_bytes": r.compressed_to_bytes,
        "tcp_established": r.tcp_established, "tcp_listening": r.tcp_listening, "udp_sockets": r.udp_sockets,
        "ports": r.ports.iter().map(port_str).collect::<Vec<_>>(),
        "phases": r.phases.iter().map(|p| json!({"phase": p.phase, "ms": ms(p.duration_us)})).collect::<Vec<_>>(),
        "freeze_parts": r.freeze_parts.iter().map(|p| json!({"part": p.phase, "ms": ms(p.duration_us)})).collect::<Vec<_>>(),
        "resumed_on_source": r.resumed_on_source, "started_at_unix_ms": r.started_at_unix_ms,
        "capture": r.capture,
        "memory_tracking": r.memory_tracking, "convergence": r.convergence,
        "throttled_to_percent": r.throttled_to_percent,
        "dumped_pages": r.dumped_pages, "freeze_pages": r.freeze_pages, "precopied_pages": r.precopied_pages,
        "postcopy_pages": r.postcopy_pages,
        "left_out_pages": r.left_out_pages, "filled_pages": r.filled_pages,
        "restored_from_store_pages": r.restored_from_store_pages,
        "fill_ms": ms(r.fill_time_us), "fill_faults": r.fill_faults,
        "fill_fault_wait_ms": ms(r.fill_fault_wait_us),
        "rounds": r.rounds.iter().map(|x| json!({
            "round": x.round, "written_pages": x.written_pages, "sent_pages": x.sent_pages,
            "sent_bytes": x.sent_bytes, "delayed_pages": x.delayed_pages, "ms": ms(x.duration_us),
        })).collect::<Vec<_>>(),
        "socket_migration": sockets, "socket_migration_note": r.sockets_note,
        "replay": r.replay.as_ref().map(|s| json!({
            "captured": s.captured, "replayed": s.replayed,
            "skipped_delivered": s.skipped_delivered, "failed": s.failed,
            "replay_time_ms": ms(s.replay_time_us), "carried": s.carried,
            "replayed_segments": s.replayed_segments,
            "input_backlog_drops": s.input_backlog_drops,
        })),
    });
    // Apart: one more field in the literal above is past json!'s
    // recursion limit.
    v["connections_preread"] = json!(r.connections_preread);
    v["connections_read_in_freeze"] = json!(r.connections_read_in_freeze);
    v["connections_staged"] = json!(r.connections_staged);
    v["drain_time_ms"] = json!(ms(r.drain_time_us));
    v["drain_bytes_at_start"] = json!(r.drain_bytes_at_start);
    v["drain_bytes_left"] = json!(r.drain_bytes_left);
    v["fallbacks"] = json!(
        r.fallbacks
            .iter()
            .map(|f| json!({"feature": f.feature, "node": f.node, "instead": f.instead}))
            .collect::<Vec<_>>()
    );
    if let Some(s) = &r.replay {
        v["replay"]["carried"] = json!(s.carried);
    }
    v
}

fn print_report_text(r: &MigrationReport, names: &ReportNames) {
    println!("migration {}  {}", r.migration_id, names.outcome);
    println!(
        "  {} PID {} -> {} PID {}",
        r.source_node, r.source_pid, r.destination_node, r.destination_pid
    );
    println!("  strategy            {}", names.strategy);
    print_memory(r);
    print_connections(r, names.sockets);
    print_phases(r);
    print_error(r);
}

/// The report's pre-copy rounds, freeze, post-copy and totals.
fn print_memory(r: &MigrationReport) {
    if !r.rounds.is_empty() {
        println!(
            "  preparation time    {:>10.1} ms  ({} rounds, {}; dirty pages by {})",
            ms(r.preparation_time_us),
            r.rounds.len(),
            r.convergence,
            r.memory_tracking
        );
        for x in &r.rounds {
            println!(
                "    round {:>3}  {:>8} written  {:>8} sent  {:>8} delayed  {:>8.1} ms",
                x.round,
                x.written_pages,
                x.sent_pages,
                x.delayed_pages,
                ms(x.duration_us)
            );
        }
        println!(
            "  pages in freeze     {} of {} dumped ({} pre-copied)",
            r.freeze_pages, r.dumped_pages, r.precopied_pages
        );
        if r.left_out_pages > 0 {
            println!(
                "  left out of dump    {} pages, {} filled from the store after the resume in {:.1} ms ({} faults, {:.1} ms waited)",
                r.left_out_pages,
                r.filled_pages,
                ms(r.fill_time_us),
                r.fill_faults,
                ms(r.fill_fault_wait_us)
            );
        }
        if r.restored_from_store_pages > 0 {
            println!(
                "  restored from store {} pages of file mappings and other areas not filled lazily, read on the destination in the freeze",
                r.restored_from_store_pages
            );
        }
    }
    println!("  freeze time         {:>10.1} ms", ms(r.freeze_time_us));
    if r.strategy == pb::Strategy::PostCopy as i32
        || r.strategy == pb::Strategy::AssistedPostCopy as i32
    {
        println!(
            "  post-processing     {:>10.1} ms  ({} pages after the resume, {} of them from the live pass)",
            ms(r.post_processing_time_us),
            r.postcopy_pages,
            r.postcopy_local_pages
        );
        println!(
            "  delay after resume  {:>10.1} ms  ({} page faults waited for)",
            ms(r.postcopy_fault_wait_us),
            r.postcopy_faults
        );
    }
    println!("  total time          {:>10.1} ms", ms(r.total_time_us));
    println!(
        "  bytes transferred   {:>10}  ({} image files)",
        r.bytes_transferred, r.image_files
    );
    if r.compressed_page_bytes > 0 {
        println!(
            "  compressed (LZ4)    {:>10}  bytes of pages, sent as {}",
            r.compressed_page_bytes, r.compressed_to_bytes
        );
    }
}

/// The report's sockets, how they moved, the drain and the packets
/// captured in the freeze.
fn print_connections(r: &MigrationReport, sockets: &str) {
    println!(
        "  sockets             {} established, {} listening, {} UDP; ports {}",
        r.tcp_established,
        r.tcp_listening,
        r.udp_sockets,
        r.ports.iter().map(port_str).collect::<Vec<_>>().join(",")
    );
    println!("  socket migration    {sockets}");
    if r.sockets == pb::SocketMigration::Incremental as i32 {
        println!(
            "                      {} connections read before the freeze, {} read whole in it, \
             {} rebuilt on sockets opened before it",
            r.connections_preread, r.connections_read_in_freeze, r.connections_staged
        );
    }
    if !r.sockets_note.is_empty() {
        println!("                      ({})", r.sockets_note);
    }
    for f in &r.fallbacks {
        println!("  without {} on {}: {}", f.feature, f.node, f.instead);
    }
    if r.drain_time_us > 0 || r.drain_bytes_at_start > 0 {
        println!(
            "  drain before freeze {:>10.1} ms  ({} bytes queued, {} left)",
            ms(r.drain_time_us),
            r.drain_bytes_at_start,
            r.drain_bytes_left
        );
    }
    match (&r.replay, r.capture) {
        (Some(s), _) => println!(
            "  packets in freeze   {} captured, {} replayed, {} already delivered, {} failed ({:.1} ms); {} unread UDP datagrams carried{}",
            s.captured,
            s.replayed,
            s.skipped_delivered,
            s.failed,
            ms(s.replay_time_us),
            s.carried,
            if s.input_backlog_drops > 0 {
                format!(
                    "; this node's input backlog dropped {} packets meanwhile",
                    s.input_backlog_drops
                )
            } else {
                String::new()
            }
        ),
        (None, false) => println!("  packets in freeze   dropped (capture off)"),
        (None, true) => {}
    }
}

fn print_phases(r: &MigrationReport) {
    println!("  phases:");
    for p in &r.phases {
        println!("    {:<10} {:>10.1} ms", p.phase, ms(p.duration_us));
    }
    if !r.freeze_parts.is_empty() {
        println!("  the freeze, part by part:");
        for p in &r.freeze_parts {
            println!("    {:<30} {:>10.1} ms", p.phase, ms(p.duration_us));
        }
    }
}

fn print_error(r: &MigrationReport) {
    if !r.error.is_empty() {
        println!("  error: {}", r.error);
        if r.resumed_on_source {
            println!("  the process was resumed on {}", r.source_node);
        }
        if r.outcome == pb::MigrationOutcome::Lost as i32 {
            println!("  the process runs nowhere: post-copy could not complete its memory");
        }
    }
}

pub(crate) fn print_data_plane(d: &pb::DataPlane, as_json: bool) -> Result<()> {
    let c = d.counters.unwrap_or_default();
    let rows = [
        ("passed", c.passed, "to owned ports, delivered"),
        (
            "dropped_not_owned",
            c.dropped_not_owned,
            "to other nodes' ports",
        ),
        (
            "dropped_frozen",
            c.dropped_frozen,
            "to frozen ports, not captured",
        ),
        (
            "passed_other",
            c.passed_other,
            "ARP, ICMP, IPv6, later fragments",
        ),
        ("egress_blocked", c.egress_blocked, "from frozen ports"),
        ("captured", c.captured, "kept while a process moved"),
        ("capture_lost", c.capture_lost, "capture ring full"),
        (
            "recorded",
            c.recorded,
            "delivered and logged before a freeze",
        ),
        ("replayed", c.replayed, "captured, then replayed here"),
        (
            "skipped_delivered",
            c.skipped_delivered,
            "captured, delivered on the source",
        ),
        ("replay_failed", c.replay_failed, "captured, replay failed"),
        ("translated", c.translated, "in-cluster packets rewritten"),
        ("held", c.held, "in-cluster packets held until a commit"),
    ];
    let ports: Vec<(String, &str)> = d
        .ports
        .iter()
        .map(|p| {
            (
                p.port.as_ref().map(port_str).unwrap_or_default(),
                p.state.as_str(),
            )
        })
        .collect();
    if as_json {
        let mut counters = serde_json::Map::new();
        for (name, v, _) in rows {
            counters.insert(name.to_owned(), json!(v));
        }
        let v = json!({
            "node": d.node, "interface": d.interface, "counters": counters,
            "ports": ports.iter().map(|(p, s)| json!({"port": p, "state": s})).collect::<Vec<_>>(),
            "cluster_interface": d.cluster_interface, "translations": d.translations,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("data plane of {} on {}", d.node, d.interface);
    for (name, v, what) in rows {
        println!("  {name:<18} {v:>12}  {what}");
    }
    println!("ports:");
    if ports.is_empty() {
        println!("  (none)");
    }
    for (p, s) in ports {
        println!("  {p:<12} {s}");
    }
    println!("in-cluster rules on {}:", d.cluster_interface);
    if d.translations.is_empty() {
        println!("  (none)");
    }
    for t in &d.translations {
        println!("  {t}");
    }
    Ok(())
}

pub(crate) fn print_balancer(b: &pb::Balancer, as_json: bool) -> Result<()> {
    let stats = b.stats.unwrap_or_default();
    if as_json {
        let v = json!({
            "node": b.node, "enabled": b.enabled, "local_load": b.local_load,
            "export_load": b.export_load, "cpus": b.cpus, "last_decision": b.last_decision,
            "calm_down_remaining_ms": b.calm_down_remaining_ms,
            "peers": b.peers.iter().map(|p| json!({"node": p.node, "load": p.load, "age_ms": p.age_ms})).collect::<Vec<_>>(),
            "processes": b.processes.iter().map(|p| json!({"pid": p.pid, "load": p.load, "resident_ms": p.resident_ms, "migratable": p.migratable, "argv": p.argv})).collect::<Vec<_>>(),
            "migrations": b.migrations.iter().map(|m| json!({
                "migration_id": m.migration_id, "source_pid": m.source_pid, "destination_pid": m.destination_pid,
                "argv": m.argv, "from": m.from_node, "to": m.to_node, "at_unix_ms": m.at_unix_ms,
                "committed": m.committed, "error": m.error,
                "decision": m.decision.as_ref().map(decision_json),
            })).collect::<Vec<_>>(),
            "last": b.last.as_ref().map(decision_json),
            "stats": {
                "ticks": stats.ticks, "offers_sent": stats.offers_sent, "offers_accepted": stats.offers_accepted,
                "offers_refused": stats.offers_refused, "offers_timed_out": stats.offers_timed_out,
                "migrations_committed": stats.migrations_committed, "migrations_aborted": stats.migrations_aborted,
                "incoming_accepted": stats.incoming_accepted, "incoming_refused": stats.incoming_refused,
                "gossip_received": stats.gossip_received, "gossip_stale_dropped": stats.gossip_stale_dropped,
                "gossip_future_dated": stats.gossip_future_dated,
                "pulls_sent": stats.pulls_sent, "pulls_answered": stats.pulls_answered,
                "pulls_given": stats.pulls_given,
            },
            "policy_toml": b.policy_toml,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "balancer of {}: {}",
        b.node,
        if b.enabled { "on" } else { "off" }
    );
    println!(
        "  load {:.2} (export {:.2}) on {} CPUs; last turn: {}",
        b.local_load, b.export_load, b.cpus, b.last_decision
    );
    if let Some(last) = &b.last {
        println!("  because {}", decision_why(last));
    }
    if b.calm_down_remaining_ms > 0 {
        println!("  calming down for {} ms more", b.calm_down_remaining_ms);
    }
    println!(
        "  offers {} sent, {} accepted, {} refused, {} timed out; migrations {} committed, {} aborted; incoming {} accepted, {} refused",
        stats.offers_sent,
        stats.offers_accepted,
        stats.offers_refused,
        stats.offers_timed_out,
        stats.migrations_committed,
        stats.migrations_aborted,
        stats.incoming_accepted,
        stats.incoming_refused
    );
    if stats.pulls_sent + stats.pulls_given > 0 {
        println!(
            "  pulls {} sent, {} answered with a process; {} processes given to nodes that asked",
            stats.pulls_sent, stats.pulls_answered, stats.pulls_given
        );
    }
    println!("peers (export load as believed here):");
    for p in &b.peers {
        println!("  {:<16} {:>8.2}  {:>6} ms old", p.node, p.load, p.age_ms);
    }
    println!("processes:");
    for p in &b.processes {
        println!(
            "  {:>8} {:>8.2}  resident {:>8} ms{}  {}",
            p.pid,
            p.load,
            p.resident_ms,
            if p.migratable { "" } else { " (moving)" },
            p.argv.join(" ")
        );
    }
    if !b.migrations.is_empty() {
        println!("migrations started here:");
        for m in &b.migrations {
            println!(
                "  PID {} -> {} PID {}  {}{}",
                m.source_pid,
                m.to_node,
                m.destination_pid,
                if m.committed { "committed" } else { "aborted" },
                if m.error.is_empty() {
                    String::new()
                } else {
                    format!(": {}", m.error)
                }
            );
            if let Some(d) = &m.decision {
                println!("    because {}", decision_why(d));
            }
        }
    }
    println!("policy:");
    for line in b.policy_toml.lines() {
        println!("  {line}");
    }
    Ok(())
}

/// A balancer turn's beliefs, as JSON.
pub(crate) fn decision_json(d: &pb::BalancerDecision) -> serde_json::Value {
    json!({
        "decision": d.decision, "load": d.load, "approximate_average": d.approximate_average,
        "candidates": d.candidates.iter().map(|p| json!({"node": p.node, "load": p.load, "age_ms": p.age_ms})).collect::<Vec<_>>(),
        "pid": d.pid, "process_load": d.process_load, "destinations": d.destinations,
        "at_unix_ms": d.at_unix_ms,
    })
}

/// Why a balancer turn decided what it did, in a line: the loads it
/// believed, and for a push the process and the destinations' order.
pub(crate) fn decision_why(d: &pb::BalancerDecision) -> String {
    let candidates = if d.candidates.is_empty() {
        "no candidate".to_owned()
    } else {
        d.candidates
            .iter()
            .map(|p| format!("{} {:.2} ({} ms old)", p.node, p.load, p.age_ms))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut why = format!(
        "load {:.2} against an approximate average of {:.2}; candidates: {candidates}",
        d.load, d.approximate_average
    );
    if d.pid != 0 {
        why.push_str(&format!(
            "; chose PID {} (load {:.2}), offered to {}",
            d.pid,
            d.process_load,
            d.destinations.join(", then ")
        ));
    }
    why
}

pub(crate) fn port_str(p: &pb::Port) -> String {
    let proto = match pb::Protocol::try_from(p.protocol) {
        Ok(pb::Protocol::Tcp) => "tcp",
        Ok(pb::Protocol::Udp) => "udp",
        _ => "?",
    };
    format!("{}/{}", p.port, proto)
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}
