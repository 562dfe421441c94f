//! The commands about the cluster and its nodes: `ferry nodes`, `cordon`,
//! `drain`, `balancer`, `events` and `dataplane`.

use anyhow::{Result, bail};
use ferry_proto::v1::{self as pb, GetDataPlaneRequest, ListNodesRequest};
use serde_json::json;

use crate::args::{BalancerAction, sockets_arg, strategy_arg};
use crate::connection::{Client, status_error};
use crate::output::{print_balancer, print_data_plane, print_nodes};
use crate::{drain, events};

pub(crate) async fn nodes(client: &mut Client, features: bool, as_json: bool) -> Result<()> {
    let nodes = client
        .list_nodes(ListNodesRequest {})
        .await
        .map_err(status_error)?
        .into_inner()
        .nodes;
    print_nodes(nodes, features, as_json)
}

pub(crate) async fn cordon(
    client: &mut Client,
    node: String,
    off: bool,
    as_json: bool,
) -> Result<()> {
    let r = client
        .set_cordon(pb::SetCordonRequest {
            node,
            cordoned: !off,
        })
        .await
        .map_err(status_error)?
        .into_inner();
    if as_json {
        println!("{}", json!({"node": r.node, "cordoned": r.cordoned}));
    } else if r.cordoned {
        println!("{} is cordoned", r.node);
    } else {
        println!("{} takes work again", r.node);
    }
    Ok(())
}

/// Starts a drain of the node and follows it to its end.
pub(crate) async fn drain(
    client: &mut Client,
    node: String,
    strategy: Option<String>,
    sockets: Option<String>,
    as_json: bool,
) -> Result<()> {
    let stream = client
        .drain_node(pb::DrainNodeRequest {
            node,
            strategy: strategy_arg(strategy.as_deref()) as i32,
            sockets: sockets_arg(sockets.as_deref()) as i32,
            downtime_budget_ms: 0,
        })
        .await
        .map_err(status_error)?
        .into_inner();
    drain::follow(stream, as_json).await
}

/// `ferry drain --cancel`: stops the drain running on the node.
pub(crate) async fn cancel_drain(client: &mut Client, node: String, as_json: bool) -> Result<()> {
    let f = client
        .cancel_drain(pb::CancelDrainRequest { node })
        .await
        .map_err(status_error)?
        .into_inner();
    if as_json {
        println!(
            "{}",
            json!({"node": f.node, "moved": f.moved, "remaining": f.remaining,
                   "cancelled_by": f.cancelled_by})
        );
    } else {
        println!(
            "drain of {} stopped: {} moved, {} stay{}",
            f.node,
            f.moved,
            f.remaining.len(),
            if f.remaining.is_empty() {
                String::new()
            } else {
                format!(" ({})", f.remaining.join("; "))
            }
        );
    }
    Ok(())
}

pub(crate) async fn balancer(
    client: &mut Client,
    node: String,
    action: Option<BalancerAction>,
    as_json: bool,
) -> Result<()> {
    let b = match action.unwrap_or(BalancerAction::Show) {
        BalancerAction::Show => client.get_balancer(pb::GetBalancerRequest { node }).await,
        BalancerAction::On => {
            client
                .set_balancer(pb::SetBalancerRequest {
                    enabled: Some(true),
                    settings: vec![],
                    node,
                })
                .await
        }
        BalancerAction::Off => {
            client
                .set_balancer(pb::SetBalancerRequest {
                    enabled: Some(false),
                    settings: vec![],
                    node,
                })
                .await
        }
        BalancerAction::Set { settings } => {
            let mut parsed = Vec::new();
            for s in settings {
                let Some((k, v)) = s.split_once('=') else {
                    bail!("{s:?}: give KEY=VALUE, e.g. transfer.threshold=1.2");
                };
                parsed.push(pb::PolicySetting {
                    key: k.trim().to_owned(),
                    value: v.trim().to_owned(),
                });
            }
            client
                .set_balancer(pb::SetBalancerRequest {
                    enabled: None,
                    settings: parsed,
                    node,
                })
                .await
        }
    }
    .map_err(status_error)?
    .into_inner();
    print_balancer(&b, as_json)
}

/// Prints the cluster's events as they come, until the agent ends the
/// stream (or Ctrl-C ends the CLI).
pub(crate) async fn events(client: &mut Client, this_node_only: bool, as_json: bool) -> Result<()> {
    let mut stream = client
        .watch_events(pb::WatchEventsRequest { this_node_only })
        .await
        .map_err(status_error)?
        .into_inner();
    while let Some(ev) = stream.message().await.map_err(status_error)? {
        if as_json {
            println!("{}", events::to_json(&ev));
        } else {
            println!("{}", events::line(&ev));
        }
    }
    Ok(())
}

pub(crate) async fn dataplane(client: &mut Client, node: String, as_json: bool) -> Result<()> {
    let d = client
        .get_data_plane(GetDataPlaneRequest { node })
        .await
        .map_err(status_error)?
        .into_inner();
    print_data_plane(&d, as_json)
}
