//! What membership puts on the wire besides foca's own packets: the node
//! identity (also the discovery beacon) and the load broadcast.

use std::collections::HashMap;
use std::net::SocketAddr;

use ferry_policy::information::{LoadEntry, LoadMessage};
use ferry_policy::{Instant, NodeId};
use serde::{Deserialize, Serialize};

/// A node as SWIM knows it: its name, where it gossips, where its Peer
/// service listens, and a bump that orders its incarnations across agent
/// restarts (wall-clock ms at start), so that a restarted agent rejoins
/// under a fresh identity at the same address.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeIdent {
    pub name: String,
    pub gossip: SocketAddr,
    pub peer: SocketAddr,
    pub bump: u64,
}

impl foca::Identity for NodeIdent {
    type Addr = SocketAddr;

    /// Declared down while alive (a partition, a pause): rejoin at once
    /// under the next incarnation.
    fn renew(&self) -> Option<Self> {
        Some(NodeIdent {
            bump: self.bump.wrapping_add(1),
            ..self.clone()
        })
    }

    fn addr(&self) -> SocketAddr {
        self.gossip
    }

    fn win_addr_conflict(&self, adversary: &Self) -> bool {
        self.bump > adversary.bump
    }
}

/// The largest beacon accepted.
const MAX_BEACON: usize = 512;

pub fn encode_beacon(ident: &NodeIdent) -> Vec<u8> {
    postcard::to_stdvec(ident).unwrap_or_default()
}

pub fn decode_beacon(data: &[u8]) -> Option<NodeIdent> {
    if data.len() > MAX_BEACON {
        return None;
    }
    postcard::from_bytes(data).ok()
}

/// One entry of a load message on the wire (see
/// [`ferry_policy::information::LoadEntry`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WireEntry {
    pub node: u32,
    pub load: f64,
    /// On the origin's clock (ms since the Unix epoch, see the conductor).
    pub stamped_at_ms: u64,
    pub age_ms: u64,
}

/// A node's load message with what the policy needs to map node numbers
/// back to names and reach the node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadBroadcast {
    pub node: String,
    /// Newer wins; increasing across restarts.
    pub seq: u64,
    /// Processes the node manages.
    pub managed: u32,
    /// The policy's message: `entries[0]` is the sender's own load.
    pub entries: Vec<WireEntry>,
    /// Empty when the node knows its CPU capacity; else why it does not
    /// (its load then means nothing, and it is no location candidate).
    pub capacity_unknown: String,
}

/// The load broadcast of agents before `capacity_unknown` (postcard has no
/// optional trailing fields): still read, so that a cluster upgraded one
/// agent at a time keeps its load exchange. The older agents read the new
/// broadcasts as they are (postcard ignores the bytes after the fields a
/// type knows).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct LoadBroadcastBeforeCapacity {
    node: String,
    seq: u64,
    managed: u32,
    entries: Vec<WireEntry>,
}

impl LoadBroadcast {
    /// Reads a broadcast of this version or the one before.
    pub fn decode(data: &[u8]) -> Result<Self, postcard::Error> {
        postcard::from_bytes(data).or_else(|e| {
            let old: LoadBroadcastBeforeCapacity = postcard::from_bytes(data).map_err(|_| e)?;
            Ok(LoadBroadcast {
                node: old.node,
                seq: old.seq,
                managed: old.managed,
                entries: old.entries,
                capacity_unknown: String::new(),
            })
        })
    }
}

/// At most this many entries in one broadcast (hearsay vectors are small;
/// anything bigger is garbage).
pub const MAX_ENTRIES: usize = 64;

impl LoadBroadcast {
    pub fn from_message(node: &str, seq: u64, managed: u32, message: &LoadMessage) -> Self {
        LoadBroadcast {
            node: node.to_owned(),
            seq,
            managed,
            entries: message
                .entries
                .iter()
                .map(|e| WireEntry {
                    node: e.node.0,
                    load: e.load,
                    stamped_at_ms: e.stamped_at.as_millis(),
                    age_ms: e.age.as_millis() as u64,
                })
                .collect(),
            capacity_unknown: String::new(),
        }
    }

    /// The policy's message, `from` the node number of [`Self::node`].
    pub fn to_message(&self, from: NodeId) -> LoadMessage {
        LoadMessage {
            from,
            entries: self
                .entries
                .iter()
                .take(MAX_ENTRIES)
                .map(|e| LoadEntry {
                    node: NodeId(e.node),
                    load: e.load,
                    stamped_at: Instant::from_millis(e.stamped_at_ms),
                    age: std::time::Duration::from_millis(e.age_ms),
                })
                .collect(),
        }
    }

    /// The load the node reported for itself.
    pub fn own_load(&self) -> Option<f64> {
        self.entries.first().map(|e| e.load)
    }
}

/// Key of a load broadcast for foca: the newest per node replaces the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadKey {
    node: String,
    seq: u64,
}

impl foca::Invalidates for LoadKey {
    fn invalidates(&self, other: &Self) -> bool {
        self.node == other.node && self.seq > other.seq
    }
}

pub type Inbox = Box<dyn FnMut(LoadBroadcast) + Send>;

/// Decodes load broadcasts; passes each new one on, once.
pub struct LoadHandler {
    local: String,
    newest: HashMap<String, u64>,
    inbox: Inbox,
}

impl LoadHandler {
    pub fn new(local: String, inbox: Inbox) -> Self {
        LoadHandler {
            local,
            newest: HashMap::new(),
            inbox,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("bad load broadcast: {0}")]
pub struct BadBroadcast(String);

impl foca::BroadcastHandler<NodeIdent> for LoadHandler {
    type Key = LoadKey;
    type Error = BadBroadcast;

    fn receive_item(
        &mut self,
        data: &[u8],
        _sender: Option<&NodeIdent>,
    ) -> Result<Option<LoadKey>, BadBroadcast> {
        let b = LoadBroadcast::decode(data).map_err(|e| BadBroadcast(e.to_string()))?;
        if b.entries.len() > MAX_ENTRIES {
            return Err(BadBroadcast(format!("{} entries", b.entries.len())));
        }
        if self.newest.get(&b.node).is_some_and(|&s| s >= b.seq) {
            return Ok(None);
        }
        self.newest.insert(b.node.clone(), b.seq);
        let key = LoadKey {
            node: b.node.clone(),
            seq: b.seq,
        };
        if b.node != self.local {
            (self.inbox)(b);
        }
        Ok(Some(key))
    }
}

#[cfg(test)]
mod tests {
    use foca::BroadcastHandler;

    use super::*;

    fn bcast(node: &str, seq: u64) -> Vec<u8> {
        postcard::to_stdvec(&LoadBroadcast {
            node: node.into(),
            seq,
            managed: 1,
            entries: vec![WireEntry {
                node: 7,
                load: 0.5,
                stamped_at_ms: 1,
                age_ms: 0,
            }],
            capacity_unknown: String::new(),
        })
        .unwrap()
    }

    /// An agent of the version before and one of this version read each
    /// other's broadcasts (a cluster upgraded one agent at a time).
    #[test]
    fn broadcasts_of_the_version_before_are_read_and_read_ours() {
        let entries = vec![WireEntry {
            node: 3,
            load: 0.25,
            stamped_at_ms: 9,
            age_ms: 1,
        }];
        let old = postcard::to_stdvec(&LoadBroadcastBeforeCapacity {
            node: "old".into(),
            seq: 4,
            managed: 2,
            entries: entries.clone(),
        })
        .unwrap();
        let b = LoadBroadcast::decode(&old).unwrap();
        assert_eq!((b.node.as_str(), b.seq, b.managed), ("old", 4, 2));
        assert_eq!(
            (b.entries, b.capacity_unknown.as_str()),
            (entries.clone(), "")
        );
        let new = postcard::to_stdvec(&LoadBroadcast {
            node: "new".into(),
            seq: 5,
            managed: 1,
            entries: entries.clone(),
            capacity_unknown: "no cgroup".into(),
        })
        .unwrap();
        let seen_by_old: LoadBroadcastBeforeCapacity = postcard::from_bytes(&new).unwrap();
        assert_eq!(
            (seen_by_old.node.as_str(), seen_by_old.entries),
            ("new", entries)
        );
        assert_eq!(
            LoadBroadcast::decode(&new).unwrap().capacity_unknown,
            "no cgroup"
        );
        assert!(LoadBroadcast::decode(&[0xff, 0xff]).is_err());
    }

    #[test]
    fn newest_broadcast_per_node_wins_and_is_passed_on_once() {
        let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let g = got.clone();
        let mut h = LoadHandler::new(
            "me".into(),
            Box::new(move |b| g.lock().unwrap().push(b.seq)),
        );
        assert!(h.receive_item(&bcast("a", 5), None).unwrap().is_some());
        assert!(h.receive_item(&bcast("a", 5), None).unwrap().is_none());
        assert!(
            h.receive_item(&bcast("a", 3), None).unwrap().is_none(),
            "older"
        );
        assert!(h.receive_item(&bcast("a", 9), None).unwrap().is_some());
        assert!(
            h.receive_item(&bcast("me", 1), None).unwrap().is_some(),
            "own broadcasts are disseminated, not delivered"
        );
        assert_eq!(*got.lock().unwrap(), vec![5, 9]);
        assert!(h.receive_item(b"\xff\xff", None).is_err());
    }

    #[test]
    fn beacon_round_trips_and_rejects_garbage() {
        let id = NodeIdent {
            name: "node1".into(),
            gossip: "198.19.0.1:7946".parse().unwrap(),
            peer: "198.19.0.1:7100".parse().unwrap(),
            bump: 42,
        };
        assert_eq!(decode_beacon(&encode_beacon(&id)), Some(id));
        assert_eq!(decode_beacon(&[0xff; 3]), None);
        assert_eq!(decode_beacon(&[0; 600]), None);
    }

    #[test]
    fn message_round_trips() {
        let m = LoadMessage {
            from: NodeId(3),
            entries: vec![LoadEntry {
                node: NodeId(3),
                load: 1.25,
                stamped_at: Instant::from_millis(1000),
                age: std::time::Duration::from_millis(20),
            }],
        };
        let b = LoadBroadcast::from_message("n3", 1, 2, &m);
        assert_eq!(b.to_message(NodeId(3)), m);
        assert_eq!(b.own_load(), Some(1.25));
    }
}
