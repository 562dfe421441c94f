//! `ferry group`: distributed servers (create, list, delete, add and
//! remove a member).

use anyhow::Result;
use ferry_proto::v1 as pb;
use serde_json::json;

use crate::args::GroupAction;
use crate::connection::{Client, status_error};

pub(crate) async fn run(client: &mut Client, action: GroupAction, as_json: bool) -> Result<()> {
    match action {
        GroupAction::Create {
            port,
            contact,
            backups,
            members,
            placement,
        } => {
            let g = client
                .create_group(pb::CreateGroupRequest {
                    group: Some(pb::Group {
                        port: u32::from(port),
                        contact,
                        members,
                        backups,
                        epoch: 0,
                        placement,
                    }),
                })
                .await
                .map_err(status_error)?
                .into_inner();
            print_group(&g, as_json);
        }
        GroupAction::Add { port, node, backup } => {
            let g = client
                .add_group_member(pb::AddGroupMemberRequest {
                    port: u32::from(port),
                    node,
                    backup,
                })
                .await
                .map_err(status_error)?
                .into_inner();
            print_group(&g, as_json);
        }
        GroupAction::Remove { port, node } => {
            let g = client
                .remove_group_member(pb::RemoveGroupMemberRequest {
                    port: u32::from(port),
                    node,
                })
                .await
                .map_err(status_error)?
                .into_inner();
            print_group(&g, as_json);
        }
        GroupAction::Delete { port } => {
            client
                .delete_group(pb::DeleteGroupRequest {
                    port: u32::from(port),
                })
                .await
                .map_err(status_error)?;
            if as_json {
                println!("{}", json!({"port": port, "deleted": true}));
            } else {
                println!("group on port {port} deleted");
            }
        }
        GroupAction::List => {
            let groups = client
                .list_groups(pb::ListGroupsRequest {})
                .await
                .map_err(status_error)?
                .into_inner()
                .groups;
            if as_json {
                let v: Vec<_> = groups.iter().map(view_json).collect();
                println!("{}", serde_json::Value::Array(v));
            } else {
                print_groups(&groups);
            }
        }
    }
    Ok(())
}

/// `ferry handoff`: one connection, by the operator.
pub(crate) async fn handoff(
    client: &mut Client,
    node: String,
    (port, remote): (u16, String),
    to: String,
    drain_ms: u32,
    as_json: bool,
) -> Result<()> {
    let r = client
        .handoff_connection(pb::HandoffConnectionRequest {
            node,
            connection: Some(pb::GroupConnection {
                remote: remote.clone(),
                port: u32::from(port),
            }),
            to,
            drain_ms,
        })
        .await
        .map_err(status_error)?
        .into_inner();
    let total: u64 = r.phases.iter().map(|p| p.micros).sum();
    if as_json {
        println!(
            "{}",
            json!({
                "acceptor": r.acceptor,
                "donor_pid": r.donor_pid,
                "queued_bytes": r.queued_bytes,
                "phases": r.phases.iter().map(|p| json!({"name": p.name, "us": p.micros})).collect::<Vec<_>>(),
            })
        );
    } else {
        println!(
            "{remote} -> :{port} handed from PID {} to {} in {:.1} ms ({} queued bytes crossed): {}",
            r.donor_pid,
            r.acceptor,
            total as f64 / 1e3,
            r.queued_bytes,
            r.phases
                .iter()
                .map(|p| format!("{} {:.2}", p.name, p.micros as f64 / 1e3))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

/// A group's view, as a create or a change of members left it.
fn print_group(g: &pb::Group, as_json: bool) {
    if as_json {
        println!(
            "{}",
            json!({"port": g.port, "contact": g.contact, "backups": g.backups, "members": g.members, "epoch": g.epoch, "placement": g.placement})
        );
    } else {
        println!(
            "group on port {} (view {}): contact {}, backups {}, members {}",
            g.port,
            g.epoch,
            g.contact,
            backups_text(g),
            g.members.join(", ")
        );
    }
}

/// A group's backups, or "none".
fn backups_text(g: &pb::Group) -> String {
    if g.backups.is_empty() {
        "none".to_owned()
    } else {
        g.backups.join(", ")
    }
}

fn view_json(v: &pb::GroupView) -> serde_json::Value {
    let g = v.group.clone().unwrap_or_default();
    json!({
        "port": g.port,
        "contact": g.contact,
        "backups": g.backups,
        "members": g.members,
        "epoch": g.epoch,
        "role": v.role,
        "server_pids": v.server_pids,
        "connections": v.connections.iter().map(|c| {
            let conn = c.connection.clone().unwrap_or_default();
            json!({"remote": conn.remote, "port": conn.port, "node": c.node})
        }).collect::<Vec<_>>(),
        "handoffs_given": v.handoffs_given,
        "handoffs_taken": v.handoffs_taken,
        "handoffs_failed": v.handoffs_failed,
    })
}

fn print_groups(groups: &[pb::GroupView]) {
    if groups.is_empty() {
        println!("no group on this node");
        return;
    }
    for v in groups {
        let g = v.group.clone().unwrap_or_default();
        println!(
            "port {} (view {}): contact {}, backups {}, members {} (this node: {}; servers: {}; handoffs given {}, taken {}, failed {})",
            g.port,
            g.epoch,
            g.contact,
            backups_text(&g),
            g.members.join(", "),
            v.role,
            if v.server_pids.is_empty() {
                "none".to_owned()
            } else {
                v.server_pids
                    .iter()
                    .map(i32::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            },
            v.handoffs_given,
            v.handoffs_taken,
            v.handoffs_failed,
        );
        for c in &v.connections {
            let conn = c.connection.clone().unwrap_or_default();
            println!("  {} -> :{}  served by {}", conn.remote, conn.port, c.node);
        }
    }
}
