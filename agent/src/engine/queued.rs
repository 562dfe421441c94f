//! The UDP datagrams a migrating process left unread, across the Commit.
//!
//! CRIU does not carry UDP receive queues. The source peeks at them with
//! the process stopped (`sockstate::queued_datagrams`); this module puts
//! them in the Commit (whole from peer protocol 8, as keys before it) and,
//! on the destination, turns them back into the IP packets the restored
//! sockets get before the captured ones (`DataPlane::replay_and_open`).

use std::net::{IpAddr, SocketAddr};

use ferry_proto::v1 as pb;

use super::EngineError;
use crate::sockstate::QueuedDatagram;

/// The most payload one Commit carries. The peer service takes messages of
/// up to 16 MiB; the delivered log (8 bytes a packet) and the framing fit
/// in the rest. A queue past this is far beyond what a default receive
/// buffer holds (`net.core.rmem_max`: 208 KiB).
pub const COMMIT_PAYLOAD_BUDGET: usize = 12 << 20;

/// What a Commit says of the datagrams left unread.
#[derive(Debug, Default, PartialEq)]
pub struct ForCommit {
    /// Protocol 4 to 7: their keys.
    pub keys: Vec<u64>,
    /// Protocol 8: the datagrams.
    pub datagrams: Vec<pb::QueuedDatagram>,
    /// Datagrams past [`COMMIT_PAYLOAD_BUDGET`], left out.
    pub left_out: usize,
}

/// The Commit's account of `queued` for a destination of `version`. The
/// payloads move into it: this is inside the freeze.
pub fn for_commit(version: u32, queued: Vec<QueuedDatagram>) -> ForCommit {
    if version < ferry_proto::PEER_PROTOCOL_QUEUED_DATAGRAMS {
        return ForCommit {
            keys: queued.iter().map(QueuedDatagram::key).collect(),
            ..ForCommit::default()
        };
    }
    let mut out = ForCommit::default();
    let mut bytes = 0;
    for d in queued {
        bytes += d.payload.len();
        if bytes > COMMIT_PAYLOAD_BUDGET {
            out.left_out += 1;
            continue;
        }
        out.datagrams.push(pb::QueuedDatagram {
            peer: d.peer.to_string(),
            local: d.local.to_string(),
            payload: d.payload,
        });
    }
    out
}

/// The node addresses a carried datagram's destination is mapped with.
#[derive(Debug, Clone, Copy)]
pub struct LocalAddresses {
    /// The cluster's shared public addresses: the same on every node.
    pub public: crate::config::PublicAddresses,
    /// This node's cluster address, which takes the place of the source
    /// node's own addresses of its family.
    pub cluster: IpAddr,
}

/// Checks a Commit's datagrams and builds the packets to hand to the
/// stack, in order. Checked before the Commit does anything: bad input is
/// refused whole, naming the datagram and the field.
pub fn packets_from_commit(
    datagrams: &[pb::QueuedDatagram],
    here: LocalAddresses,
) -> Result<Vec<Vec<u8>>, EngineError> {
    datagrams
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let invalid = |field: &'static str, reason: String| EngineError::InvalidField {
                field,
                reason: format!("datagram {i}: {reason}"),
            };
            let addr = |field: &'static str, text: &str| {
                text.parse::<SocketAddr>()
                    .map(crate::inet::canonical)
                    .map_err(|e| {
                        invalid(field, format!("{text:?} is not an address and port: {e}"))
                    })
            };
            let peer = addr("queued_datagrams.peer", &d.peer)?;
            let local = addr("queued_datagrams.local", &d.local)?;
            if peer.is_ipv4() != local.is_ipv4() {
                return Err(invalid(
                    "queued_datagrams.local",
                    format!("{local} is not of the family of its sender, {peer}"),
                ));
            }
            let dst = map_local(local.ip(), here).ok_or_else(|| {
                invalid(
                    "queued_datagrams.local",
                    format!(
                        "sent to {}, an address of the source node's own, and this node has no cluster address of its family to take its place (its cluster address is {})",
                        local.ip(),
                        here.cluster
                    ),
                )
            })?;
            ferry_ebpf::udp_datagram(peer, SocketAddr::new(dst, local.port()), &d.payload)
                .ok_or_else(|| {
                    invalid(
                        "queued_datagrams.payload",
                        format!(
                            "{} bytes, more than one datagram holds ({})",
                            d.payload.len(),
                            ferry_ebpf::MAX_UDP_PAYLOAD
                        ),
                    )
                })
        })
        .collect()
}

/// Where a datagram sent to `ip` on the source goes here. The shared
/// address and loopback ones exist on every node. Any other was one of the
/// source node's own (the process's socket was bound to it, or to every
/// address): the restored socket has this node's cluster address instead
/// (the images' rewrite, `translation::rewrite_in_cluster`); None if this
/// node has no cluster address of its family. Never an address off this
/// node: the replay sends to the packet's destination.
fn map_local(ip: IpAddr, here: LocalAddresses) -> Option<IpAddr> {
    if here.public.contains(ip) || ip.is_loopback() {
        Some(ip)
    } else {
        (here.cluster.is_ipv4() == ip.is_ipv4()).then_some(here.cluster)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::net::{Ipv4Addr, Ipv6Addr};

    fn queued(peer_port: u16, len: usize) -> QueuedDatagram {
        QueuedDatagram {
            peer: (Ipv4Addr::new(198, 18, 1, 2), peer_port).into(),
            local: (Ipv4Addr::new(198, 18, 0, 100), 7000).into(),
            payload: vec![peer_port as u8; len],
        }
    }

    fn queued6(peer_port: u16, len: usize) -> QueuedDatagram {
        QueuedDatagram {
            peer: (Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 1, 2), peer_port).into(),
            local: (Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0x100), 7000).into(),
            payload: vec![peer_port as u8; len],
        }
    }

    const HERE: LocalAddresses = LocalAddresses {
        public: crate::config::PublicAddresses {
            v4: Some(Ipv4Addr::new(198, 18, 0, 100)),
            v6: Some(Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0x100)),
        },
        cluster: IpAddr::V4(Ipv4Addr::new(198, 19, 0, 2)),
    };

    #[test]
    fn an_older_destination_gets_keys_a_newer_one_the_datagrams() {
        let q = [queued(5000, 10), queued(5001, 0)];
        let old = for_commit(7, q.to_vec());
        assert_eq!(old.keys, vec![q[0].key(), q[1].key()]);
        assert!(old.datagrams.is_empty());
        let new = for_commit(8, q.to_vec());
        assert!(new.keys.is_empty());
        assert_eq!(new.left_out, 0);
        assert_eq!(new.datagrams.len(), 2);
        assert_eq!(new.datagrams[0].peer, "198.18.1.2:5000");
        assert_eq!(new.datagrams[0].local, "198.18.0.100:7000");
        assert_eq!(new.datagrams[0].payload, vec![0x88; 10]);
        // And they come back as the packets they arrived as.
        let packets = packets_from_commit(&new.datagrams, HERE).unwrap();
        let want = ferry_ebpf::udp_datagram(q[0].peer, q[0].local, &q[0].payload).unwrap();
        assert_eq!(packets[0], want);
        assert_eq!(
            crate::sockstate::key_of_packet(&packets[1]),
            Some(q[1].key())
        );
    }

    #[test]
    fn ipv6_datagrams_come_back_as_the_ipv6_packets_they_arrived_as() {
        let q = [queued6(5000, 10), queued(5001, 3), queued6(5002, 0)];
        let new = for_commit(8, q.to_vec());
        assert_eq!(new.datagrams[0].peer, "[2001:2::1:2]:5000");
        assert_eq!(new.datagrams[0].local, "[2001:2::100]:7000");
        let packets = packets_from_commit(&new.datagrams, HERE).unwrap();
        for (p, d) in packets.iter().zip(&q) {
            assert_eq!(
                *p,
                ferry_ebpf::udp_datagram(d.peer, d.local, &d.payload).unwrap()
            );
            assert_eq!(crate::sockstate::key_of_packet(p), Some(d.key()));
        }
        assert_eq!(packets[0][0] >> 4, 6);
        assert_eq!(packets[1][0] >> 4, 4);
        // Sent to the source node's own IPv6 address: this node has no
        // IPv6 cluster address to put in its place.
        let mut own = new.datagrams.clone();
        own[2].local = "[2001:2:0:1::1]:7000".into();
        match packets_from_commit(&own, HERE) {
            Err(EngineError::InvalidField { field, reason }) => {
                assert_eq!(field, "queued_datagrams.local");
                assert!(reason.starts_with("datagram 2:"), "{reason}");
                assert!(
                    reason.contains("no cluster address of its family"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_commit_carries_at_most_its_budget() {
        let big = 60_000;
        let q: Vec<_> = (0..250).map(|i| queued(i, big)).collect();
        let c = for_commit(8, q.to_vec());
        let fits = COMMIT_PAYLOAD_BUDGET / big;
        assert_eq!(c.datagrams.len(), fits);
        assert_eq!(c.left_out, 250 - fits);
        // The oldest are carried.
        assert_eq!(c.datagrams[0].peer, "198.18.1.2:0");
    }

    #[test]
    fn the_source_nodes_own_address_becomes_this_ones() {
        let mut d = for_commit(8, vec![queued(5000, 3)]).datagrams;
        d[0].local = "198.19.0.1:7000".into();
        d.push(pb::QueuedDatagram {
            local: "127.0.0.1:7000".into(),
            ..d[0].clone()
        });
        let p = packets_from_commit(&d, HERE).unwrap();
        assert_eq!(&p[0][16..20], &[198, 19, 0, 2]);
        assert_eq!(&p[1][16..20], &[127, 0, 0, 1]);
    }

    #[test]
    fn bad_datagrams_are_refused_naming_the_field() {
        let good = for_commit(8, vec![queued(5000, 3)]).datagrams.remove(0);
        for (bad, field) in [
            (
                pb::QueuedDatagram {
                    peer: "198.18.1.2".into(),
                    ..good.clone()
                },
                "queued_datagrams.peer",
            ),
            (
                pb::QueuedDatagram {
                    peer: "[2001:2::1:2]:5".into(),
                    ..good.clone()
                },
                "queued_datagrams.local",
            ),
            (
                pb::QueuedDatagram {
                    local: "198.18.0.100".into(),
                    ..good.clone()
                },
                "queued_datagrams.local",
            ),
            (
                pb::QueuedDatagram {
                    payload: vec![0; ferry_ebpf::MAX_UDP_PAYLOAD + 1],
                    ..good.clone()
                },
                "queued_datagrams.payload",
            ),
        ] {
            match packets_from_commit(&[good.clone(), bad], HERE) {
                Err(EngineError::InvalidField { field: f, reason }) => {
                    assert_eq!(f, field);
                    assert!(reason.starts_with("datagram 1:"), "{reason}");
                }
                other => panic!("{field}: {other:?}"),
            }
        }
    }
}
