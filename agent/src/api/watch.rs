//! `Control.WatchEvents`: this node's events, merged with every peer's.
//!
//! Each peer's own stream is read through a forwarded call with
//! `this_node_only` (so no node relays another's, and nothing loops). A
//! peer that cannot be reached, or whose stream breaks, is reported as a
//! `watch` event and tried again every second; nodes that membership finds
//! later are picked up within a second. Everything ends when the watcher
//! goes.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use ferry_proto::v1::{self as pb, WatchStatus, cluster_event::Event};
use tokio::sync::{broadcast, mpsc};
use tonic::Status;

use super::forward;
use crate::config::PeerConfig;
use crate::engine::Engine;
use crate::events::unix_ms;

type Out = mpsc::Sender<Result<pb::ClusterEvent, Status>>;

/// How often a lost peer stream is tried again, and new peers looked for.
const RETRY: Duration = Duration::from_secs(1);

pub fn start(
    engine: Arc<Engine>,
    cluster: bool,
) -> mpsc::Receiver<Result<pb::ClusterEvent, Status>> {
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(local(engine.clone(), engine.events.subscribe(), tx.clone()));
    if cluster {
        tokio::spawn(peers(engine, tx));
    }
    rx
}

/// A status event made by this agent about `peer`'s stream.
fn status(engine: &Engine, status: WatchStatus) -> pb::ClusterEvent {
    pb::ClusterEvent {
        node: engine.node().to_owned(),
        at_unix_ms: unix_ms(),
        sequence: 0,
        event: Some(Event::Watch(status)),
    }
}

async fn local(engine: Arc<Engine>, mut rx: broadcast::Receiver<pb::ClusterEvent>, tx: Out) {
    loop {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            _ = tx.closed() => return,
            _ = engine.events.closed() => return,
        };
        let ev = match ev {
            Ok(ev) => ev,
            Err(broadcast::error::RecvError::Lagged(missed)) => status(
                &engine,
                WatchStatus {
                    peer: engine.node().to_owned(),
                    connected: true,
                    error: "the watcher read too slowly".into(),
                    missed,
                },
            ),
            Err(broadcast::error::RecvError::Closed) => return,
        };
        if tx.send(Ok(ev)).await.is_err() {
            return;
        }
    }
}

/// Watches every known peer, and those that appear later.
async fn peers(engine: Arc<Engine>, tx: Out) {
    let mut watched: HashSet<String> = HashSet::new();
    loop {
        for peer in engine.cluster.known_peers() {
            if watched.insert(peer.name.clone()) {
                tokio::spawn(peer_stream(engine.clone(), peer, tx.clone()));
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(RETRY) => {}
            _ = tx.closed() => return,
            _ = engine.events.closed() => return,
        }
    }
}

async fn peer_stream(engine: Arc<Engine>, peer: PeerConfig, tx: Out) {
    let mut last_error = String::new();
    loop {
        let opened = async {
            let mut client = forward::client(&engine.cluster, &peer).await?;
            client
                .watch_events(forward::request(
                    &engine.cluster,
                    pb::WatchEventsRequest {
                        this_node_only: true,
                    },
                ))
                .await
                .map(|r| r.into_inner())
                .map_err(|s| forward::from_peer(&peer, s))
        };
        let error = match opened.await {
            Ok(mut stream) => {
                last_error.clear();
                let up = status(
                    &engine,
                    WatchStatus {
                        peer: peer.name.clone(),
                        connected: true,
                        ..Default::default()
                    },
                );
                if tx.send(Ok(up)).await.is_err() {
                    return;
                }
                loop {
                    let next = tokio::select! {
                        m = stream.message() => m,
                        _ = tx.closed() => return,
                        _ = engine.events.closed() => return,
                    };
                    match next {
                        Ok(Some(ev)) => {
                            if tx.send(Ok(ev)).await.is_err() {
                                return;
                            }
                        }
                        Ok(None) => break "the stream ended".to_owned(),
                        Err(s) => break forward::from_peer(&peer, s).message().to_owned(),
                    }
                }
            }
            Err(s) => s.message().to_owned(),
        };
        // Said once per distinct failure, not every retry.
        if error != last_error {
            let down = status(
                &engine,
                WatchStatus {
                    peer: peer.name.clone(),
                    connected: false,
                    error: error.clone(),
                    missed: 0,
                },
            );
            if tx.send(Ok(down)).await.is_err() {
                return;
            }
            last_error = error;
        }
        tokio::select! {
            _ = tokio::time::sleep(RETRY) => {}
            _ = tx.closed() => return,
            _ = engine.events.closed() => return,
        }
    }
}
