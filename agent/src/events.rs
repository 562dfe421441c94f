//! This node's event stream (`Control.WatchEvents`): migrations it runs as
//! the source, membership changes it sees, its balancer's decisions, its
//! cordon and drains. A broadcast channel: publishing never waits for a
//! watcher, and a watcher that reads too slowly loses the oldest events
//! (it learns how many from the sequence numbers and a `watch` event).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use ferry_proto::v1::{self as pb, cluster_event::Event};
use tokio::sync::broadcast;

/// Events kept for watchers that fall behind.
const BACKLOG: usize = 1024;

#[derive(Debug)]
pub struct EventBus {
    node: String,
    sequence: AtomicU64,
    tx: broadcast::Sender<pb::ClusterEvent>,
    closed: tokio::sync::watch::Sender<bool>,
}

impl EventBus {
    pub fn new(node: &str) -> Self {
        let (tx, _) = broadcast::channel(BACKLOG);
        EventBus {
            node: node.to_owned(),
            sequence: AtomicU64::new(0),
            tx,
            closed: tokio::sync::watch::channel(false).0,
        }
    }

    /// Sends `event` to whoever watches now; nobody watching is fine.
    pub fn publish(&self, event: Event) {
        let sequence = self.sequence.fetch_add(1, Ordering::Relaxed) + 1;
        let _ = self.tx.send(pb::ClusterEvent {
            node: self.node.clone(),
            at_unix_ms: unix_ms(),
            sequence,
            event: Some(event),
        });
    }

    pub fn subscribe(&self) -> broadcast::Receiver<pb::ClusterEvent> {
        self.tx.subscribe()
    }

    /// The agent is stopping: watchers' streams end.
    pub fn close(&self) {
        self.closed.send_replace(true);
    }

    /// Resolves once [`Self::close`] was called.
    pub async fn closed(&self) {
        let mut rx = self.closed.subscribe();
        let _ = rx.wait_for(|c| *c).await;
    }
}

pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn watchers_get_events_in_order_with_sequence_numbers() {
        let bus = EventBus::new("node1");
        bus.publish(Event::Cordon(pb::CordonChange {
            cordoned: true,
            by: "nobody watching".into(),
        }));
        let mut rx = bus.subscribe();
        for by in ["a", "b"] {
            bus.publish(Event::Cordon(pb::CordonChange {
                cordoned: true,
                by: by.into(),
            }));
        }
        let first = rx.recv().await.unwrap();
        let second = rx.recv().await.unwrap();
        assert_eq!((first.sequence, second.sequence), (2, 3));
        assert_eq!(first.node, "node1");
        assert!(matches!(first.event, Some(Event::Cordon(c)) if c.by == "a"));
    }

    #[tokio::test]
    async fn a_slow_watcher_learns_how_many_it_missed() {
        let bus = EventBus::new("node1");
        let mut rx = bus.subscribe();
        for _ in 0..BACKLOG + 5 {
            bus.publish(Event::Cordon(pb::CordonChange::default()));
        }
        match rx.recv().await {
            Err(broadcast::error::RecvError::Lagged(n)) => assert_eq!(n, 5),
            other => panic!("expected a lag, got {other:?}"),
        }
        assert_eq!(rx.recv().await.unwrap().sequence, 6);
    }
}
