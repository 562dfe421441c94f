//! In-cluster connections of migrated processes.
//!
//! A process on node A1 with a TCP connection to a peer on A3 (over the
//! cluster network, from A1's cluster address) moves to A2. Three nodes
//! take part, each through its own translator on its cluster interface
//! (`ferry_ebpf::Translator`):
//!
//! - A2, the destination, finds those connections in the images, rewrites
//!   their local address to its own cluster address (`ferry-criu-image`)
//!   and **holds** each flow (nothing in or out) before restoring: the
//!   restored socket's repair-off probe would otherwise reach A3
//!   untranslated and draw an RST, and A3's packets, once translated, would
//!   otherwise meet A2's stack before the socket exists. The holds go at
//!   Commit (or abort).
//! - A1, the source, asks A3 (`Peer.AddTranslations`) to **translate**
//!   each flow once A2 has restored, before discarding its own copy; on
//!   abort it asks A3 to remove them again.
//! - A3 rewrites the flow's packets (destination A1 -> A2 on egress, source
//!   A2 -> A1 on ingress) until the connection closes, then removes the
//!   rule after a linger ([`FlowRules::remove_closed`]).
//!
//! Packets of these flows in flight between the freeze and the translation
//! (at most an RTT's worth on an in-cluster link) are dropped, by the
//! frozen source or by the hold, and TCP retransmits them: the capture ring
//! covers the public interface only.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use ferry_ebpf::{Protocol, TranslationCounters, TranslationRule, Translator};
use ferry_proto::v1::InClusterFlow as PbFlow;

use super::filter::DataPlaneError;

/// The rules of this node's translator. Faked in unit tests.
pub trait FlowRules: Send {
    fn add(&mut self, rule: TranslationRule) -> Result<(), DataPlaneError>;
    /// Whether the rule was there.
    fn remove(&mut self, rule: &TranslationRule) -> Result<bool, DataPlaneError>;
    /// Removes the translate rules of connections closed and idle for
    /// `linger`; returns them.
    fn remove_closed(&mut self, linger: Duration) -> Result<Vec<TranslationRule>, DataPlaneError>;
    fn rules(&self) -> Result<Vec<TranslationRule>, DataPlaneError>;
    fn counters(&self) -> Result<TranslationCounters, DataPlaneError>;
    /// The cluster interface the rules apply on.
    fn interface(&self) -> &str;
}

/// The kernel's translator.
pub struct EbpfFlowRules(pub Translator);

fn err(e: impl std::fmt::Display) -> DataPlaneError {
    DataPlaneError(format!("translator: {e}"))
}

impl FlowRules for EbpfFlowRules {
    fn add(&mut self, rule: TranslationRule) -> Result<(), DataPlaneError> {
        self.0.add(rule).map_err(err)
    }

    fn remove(&mut self, rule: &TranslationRule) -> Result<bool, DataPlaneError> {
        self.0.remove(rule).map_err(err)
    }

    fn remove_closed(&mut self, linger: Duration) -> Result<Vec<TranslationRule>, DataPlaneError> {
        self.0.remove_closed(linger).map_err(err)
    }

    fn rules(&self) -> Result<Vec<TranslationRule>, DataPlaneError> {
        Ok(self
            .0
            .rules()
            .map_err(err)?
            .into_iter()
            .map(|(r, _)| r)
            .collect())
    }

    fn counters(&self) -> Result<TranslationCounters, DataPlaneError> {
        self.0.counters().map_err(err)
    }

    fn interface(&self) -> &str {
        self.0.iface()
    }
}

/// A connection of a migrating process to a peer on another node, over
/// the cluster network (IPv4 or IPv6: its three addresses of one family).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InClusterFlow {
    pub protocol: Protocol,
    pub old_local: SocketAddr,
    pub new_local: SocketAddr,
    pub remote: SocketAddr,
}

/// Why a migration's in-cluster connections cannot be carried over.
#[derive(Debug, thiserror::Error)]
pub enum FlowError {
    #[error("reading the socket images: {0}")]
    Images(#[from] ferry_criu_image::ImageError),
    #[error(
        "connection {local} -> {remote} is to a process on the destination node itself: \
         ferry cannot turn it into a local connection"
    )]
    PeerOnDestination {
        local: SocketAddr,
        remote: SocketAddr,
    },
    /// Opened after the source's check before the freeze (which refuses
    /// such a process): found in its images or socket states.
    #[error(
        "connection {local} -> {remote} is to a process on the source node itself: it never \
         crosses the cluster interface, where ferry translates connections"
    )]
    PeerOnSource {
        local: SocketAddr,
        remote: SocketAddr,
    },
    #[error("in-cluster flow field `{field}`: {reason}")]
    BadFlow { field: &'static str, reason: String },
    /// A field of a translation request that is not this node's to serve.
    #[error("{field}: {reason}")]
    InvalidField { field: &'static str, reason: String },
    #[error(transparent)]
    DataPlane(#[from] DataPlaneError),
}

impl InClusterFlow {
    /// The hold the destination keeps on its end until Commit.
    pub fn hold(&self) -> TranslationRule {
        TranslationRule::hold(self.protocol, self.new_local, self.remote)
    }

    /// The translation the peer's node installs: seen from the peer, its
    /// socket (`local`) talks to the old address, now at the new one.
    pub fn translation(&self) -> TranslationRule {
        TranslationRule::translate(
            self.protocol,
            self.remote,
            self.old_local,
            self.new_local.ip(),
        )
    }

    pub fn to_pb(self) -> PbFlow {
        PbFlow {
            protocol: match self.protocol {
                Protocol::Tcp => ferry_proto::v1::Protocol::Tcp as i32,
                Protocol::Udp => ferry_proto::v1::Protocol::Udp as i32,
            },
            old_local: self.old_local.to_string(),
            new_local: self.new_local.to_string(),
            remote: self.remote.to_string(),
        }
    }

    pub fn from_pb(pb: &PbFlow) -> Result<Self, FlowError> {
        let addr = |field: &'static str, s: &str| {
            s.parse::<SocketAddr>()
                .map(crate::inet::canonical)
                .map_err(|e| FlowError::BadFlow {
                    field,
                    reason: format!("{s:?} is not an address:port ({e})"),
                })
        };
        let protocol = match ferry_proto::v1::Protocol::try_from(pb.protocol) {
            Ok(ferry_proto::v1::Protocol::Tcp) => Protocol::Tcp,
            Ok(ferry_proto::v1::Protocol::Udp) => Protocol::Udp,
            _ => {
                return Err(FlowError::BadFlow {
                    field: "protocol",
                    reason: format!("{} is neither TCP nor UDP", pb.protocol),
                });
            }
        };
        let flow = Self {
            protocol,
            old_local: addr("old_local", &pb.old_local)?,
            new_local: addr("new_local", &pb.new_local)?,
            remote: addr("remote", &pb.remote)?,
        };
        if flow.old_local.port() != flow.new_local.port() {
            return Err(FlowError::BadFlow {
                field: "new_local",
                reason: "a migrated socket keeps its port".into(),
            });
        }
        for (field, a) in [("new_local", flow.new_local), ("remote", flow.remote)] {
            if a.is_ipv4() != flow.old_local.is_ipv4() {
                return Err(FlowError::BadFlow {
                    field,
                    reason: format!("{a} is not of old_local's family ({})", flow.old_local),
                });
            }
        }
        Ok(flow)
    }
}

/// Finds, in the images of a process dumped on the node whose cluster
/// address is `source`, its TCP connections to peers on `other_nodes`, and
/// rewrites them to `destination`'s address. Returns what it rewrote. A
/// connection to `destination` itself is refused: it would have to become
/// a connection on one host, which no rewrite of one end can do. So is one
/// to `source` itself, which never crosses the cluster interface where the
/// peer's translator works.
pub fn rewrite_in_cluster(
    images: &Path,
    source: IpAddr,
    destination: IpAddr,
    other_nodes: &[IpAddr],
) -> Result<Vec<InClusterFlow>, FlowError> {
    let tcp = libc::IPPROTO_TCP as u32;
    let mut flows = Vec::new();
    for s in ferry_criu_image::inet_sockets(images)? {
        let (local, Some(remote)) = (s.local_canonical(), s.remote_canonical()) else {
            continue;
        };
        if s.proto != tcp || local.ip() != source || remote.port() == 0 {
            continue;
        }
        if remote.ip() == destination {
            return Err(FlowError::PeerOnDestination { local, remote });
        }
        if remote.ip() == source {
            return Err(FlowError::PeerOnSource { local, remote });
        }
        if !other_nodes.contains(&remote.ip()) {
            continue;
        }
        flows.push(InClusterFlow {
            protocol: Protocol::Tcp,
            old_local: local,
            new_local: SocketAddr::new(destination, local.port()),
            remote,
        });
    }
    if flows.is_empty() {
        return Ok(flows);
    }
    let rewrites: Vec<_> = flows
        .iter()
        .map(|f| ferry_criu_image::LocalAddressRewrite {
            matches: ferry_criu_image::SocketMatch {
                proto: tcp as u8,
                local: f.old_local,
                remote: Some(f.remote),
            },
            new_local: destination,
        })
        .collect();
    ferry_criu_image::rewrite_local_addresses(images, &rewrites)?;
    Ok(flows)
}

#[cfg(any(test, feature = "fuzzing"))]
pub mod fake {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// Rules in a list; `add` refuses a second rule for the same flow.
    #[derive(Debug, Clone, Default)]
    pub struct FakeFlowRules(pub Arc<Mutex<Vec<TranslationRule>>>);

    impl FlowRules for FakeFlowRules {
        fn add(&mut self, rule: TranslationRule) -> Result<(), DataPlaneError> {
            let mut rules = self.0.lock().unwrap();
            if rules
                .iter()
                .any(|r| r.local == rule.local && r.remote == rule.remote)
            {
                return Err(DataPlaneError(format!("{rule}: conflict")));
            }
            rules.push(rule);
            Ok(())
        }
        fn remove(&mut self, rule: &TranslationRule) -> Result<bool, DataPlaneError> {
            let mut rules = self.0.lock().unwrap();
            let before = rules.len();
            rules.retain(|r| r != rule);
            Ok(rules.len() != before)
        }
        fn remove_closed(&mut self, _: Duration) -> Result<Vec<TranslationRule>, DataPlaneError> {
            Ok(Vec::new())
        }
        fn rules(&self) -> Result<Vec<TranslationRule>, DataPlaneError> {
            Ok(self.0.lock().unwrap().clone())
        }
        fn counters(&self) -> Result<TranslationCounters, DataPlaneError> {
            Ok(TranslationCounters::default())
        }
        fn interface(&self) -> &str {
            "fake-cluster0"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flows_round_trip_and_bad_fields_are_named() {
        let flow = InClusterFlow {
            protocol: Protocol::Tcp,
            old_local: "198.19.0.1:40000".parse().unwrap(),
            new_local: "198.19.0.2:40000".parse().unwrap(),
            remote: "198.19.0.3:5432".parse().unwrap(),
        };
        assert_eq!(InClusterFlow::from_pb(&flow.to_pb()).unwrap(), flow);
        let t = flow.translation();
        assert_eq!(t.local, flow.remote);
        assert_eq!(t.remote, flow.old_local);
        assert_eq!(
            t.action,
            ferry_ebpf::RuleAction::Translate {
                remote_new: flow.new_local.ip()
            }
        );
        let h = flow.hold();
        assert_eq!((h.local, h.remote), (flow.new_local, flow.remote));

        let mut pb = flow.to_pb();
        pb.remote = "nowhere".into();
        let e = InClusterFlow::from_pb(&pb).unwrap_err().to_string();
        assert!(e.contains("`remote`"), "{e}");
        let mut pb = flow.to_pb();
        pb.new_local = "198.19.0.2:1".into();
        let e = InClusterFlow::from_pb(&pb).unwrap_err().to_string();
        assert!(e.contains("`new_local`") && e.contains("port"), "{e}");
        let mut pb = flow.to_pb();
        pb.protocol = 99;
        let e = InClusterFlow::from_pb(&pb).unwrap_err().to_string();
        assert!(e.contains("`protocol`"), "{e}");
    }
}
