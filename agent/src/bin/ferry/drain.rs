//! `ferry drain`: follows a drain's events, with a bar of the processes
//! moved and the progress of the one moving.

use anyhow::Result;
use ferry_proto::v1::{DrainEvent, MigrationOutcome, drain_event, migration_event};
use serde_json::json;

use crate::progress::{Line, count_bar};

pub async fn follow(mut stream: tonic::Streaming<DrainEvent>, as_json: bool) -> Result<()> {
    let mut line = Line::new(!as_json);
    let (mut total, mut finished) = (0usize, 0usize);
    let mut summary = None;
    let mut node = String::new();
    loop {
        let next = tokio::select! {
            m = stream.message() => m,
            _ = tokio::signal::ctrl_c() => {
                // Leaving does not stop the drain: say how to.
                line.done();
                anyhow::bail!(
                    "stopped following; the drain of {node} goes on (stop it with `ferry --node {node} drain --cancel`)"
                );
            }
        };
        let ev = match next {
            Ok(Some(ev)) => ev,
            Ok(None) => break,
            Err(s) => {
                line.done();
                if as_json && let Some(f) = &summary {
                    println!("{f}");
                }
                return Err(crate::connection::status_error(s));
            }
        };
        match ev.event {
            Some(drain_event::Event::Started(s)) => {
                total = s.pids.len();
                node = s.node.clone();
                line.note(&format!(
                    "draining {}: {} process(es) {:?}",
                    s.node, total, s.pids
                ));
            }
            Some(drain_event::Event::Migration(m)) => {
                if !m.error.is_empty() {
                    line.note(&format!(
                        "  PID {} -> {}: {}",
                        m.pid, m.destination_node, m.error
                    ));
                }
                match m.event.and_then(|e| e.event) {
                    Some(migration_event::Event::Started(_)) => {
                        line.set_prefix(format!(
                            "{} PID {} -> {}: ",
                            count_bar(finished, total),
                            m.pid,
                            m.destination_node
                        ));
                    }
                    Some(migration_event::Event::Progress(p)) => line.phase(&p),
                    Some(migration_event::Event::Report(r)) => {
                        let committed = r.outcome == MigrationOutcome::Committed as i32;
                        if committed {
                            finished += 1;
                        }
                        line.note(&format!(
                            "  PID {} -> {}: {} (freeze {:.1} ms){}",
                            m.pid,
                            m.destination_node,
                            if committed { "moved" } else { "stayed" },
                            r.freeze_time_us as f64 / 1000.0,
                            if r.error.is_empty() {
                                String::new()
                            } else {
                                format!(": {}", r.error)
                            }
                        ));
                        if as_json {
                            println!(
                                "{}",
                                json!({"pid": m.pid, "destination_node": m.destination_node,
                                       "migration_id": r.migration_id, "committed": committed,
                                       "destination_pid": r.destination_pid,
                                       "freeze_time_us": r.freeze_time_us, "error": r.error})
                            );
                        }
                    }
                    None => {}
                }
            }
            Some(drain_event::Event::Finished(f)) => {
                line.note(&format!(
                    "{} {}: {} moved, {} left, {:.1} s",
                    count_bar(finished, total),
                    f.node,
                    f.moved,
                    f.remaining.len(),
                    f.elapsed_us as f64 / 1e6
                ));
                for r in &f.remaining {
                    line.note(&format!("  still here: {r}"));
                }
                let v = json!({"node": f.node, "moved": f.moved, "remaining": f.remaining,
                               "elapsed_us": f.elapsed_us});
                if as_json {
                    println!("{v}");
                }
                summary = Some(v);
            }
            None => {}
        }
    }
    line.done();
    Ok(())
}
