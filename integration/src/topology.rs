//! The single-IP cluster's addressing plan and the `ip` scripts that wire it.
//!
//! ```text
//!            client1 eth0 198.18.0.11   client2 eth0 198.18.0.12 ...
//!                         2001:2::1:b               2001:2::1:c
//!                   |                         |
//!   router:  [ bridge "pub" ] ------------------------------ floods frames for
//!                   |                         |              ff:ff:ff:ff:ff:ff
//!            node1 pub0 198.18.0.100    node2 pub0 198.18.0.100 ...
//!                       2001:2::100                2001:2::100
//!            node1 clu0 198.19.0.1      node2 clu0 198.19.0.2
//!                   |                         |
//!   router:  [ bridge "clu" ] ---------------------------------
//! ```
//!
//! Clients hold a permanent neighbour entry mapping the shared address to
//! the broadcast MAC, so the bridge floods every frame for it to every node:
//! the seed's broadcasting router. Only the owner's ownership filter lets a
//! frame through as PACKET_HOST; without it TCP on the nodes drops them.
//!
//! The public side is dual-stack: the IPv6 addresses are in 2001:2::/48,
//! the benchmarking prefix (RFC 5180), as the IPv4 ones are in
//! 198.18.0.0/15 (RFC 2544). The cluster network is IPv4.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The address every node carries on its public interface.
pub const PUBLIC_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
/// The IPv6 address every node carries on its public interface.
pub const PUBLIC_ADDR6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0x100);

/// An address family of the public side, for tests that run in both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    /// The shared address of this family.
    pub fn public_addr(self) -> IpAddr {
        match self {
            Family::V4 => PUBLIC_ADDR.into(),
            Family::V6 => PUBLIC_ADDR6.into(),
        }
    }

    /// Client `j`'s address of this family.
    pub fn client_addr(self, j: usize) -> IpAddr {
        match self {
            Family::V4 => client_addr(j).into(),
            Family::V6 => client_addr6(j).into(),
        }
    }
}
/// Where ferryd's Peer service listens on each node's cluster address.
pub const PEER_PORT: u16 = 7100;
/// Interface names inside the namespaces (the router side gets `n<i>p`,
/// `n<i>c`, `c<j>e`).
pub const PUBLIC_IFACE: &str = "pub0";
pub const CLUSTER_IFACE: &str = "clu0";
pub const CLIENT_IFACE: &str = "eth0";
/// Bridge names inside the router namespace.
pub const PUBLIC_BRIDGE: &str = "pub";
pub const CLUSTER_BRIDGE: &str = "clu";

/// Client addresses are 198.18.0.(10+j) and must stay below the shared .100.
pub const MAX_CLIENTS: usize = 89;
/// Nodes are 198.19.0.i; any more than this is no longer a test of ferry.
pub const MAX_NODES: usize = 64;

/// Node `i` (1-based) on an IPv6 cluster network: 2001:2:0:1::i.
pub fn node_cluster_addr6(i: usize) -> Ipv6Addr {
    assert!((1..=MAX_NODES).contains(&i), "node index {i} out of range");
    Ipv6Addr::new(0x2001, 2, 0, 1, 0, 0, 0, i as u16)
}

/// Node `i` (1-based) on the cluster network.
pub fn node_cluster_addr(i: usize) -> Ipv4Addr {
    assert!((1..=MAX_NODES).contains(&i), "node index {i} out of range");
    Ipv4Addr::new(198, 19, 0, i as u8)
}

/// Client `j` (1-based) on the public network.
pub fn client_addr(j: usize) -> Ipv4Addr {
    assert!(
        (1..=MAX_CLIENTS).contains(&j),
        "client index {j} out of range"
    );
    Ipv4Addr::new(198, 18, 0, 10 + j as u8)
}

/// Client `j` (1-based) on the public network, IPv6: 2001:2::1:(10+j).
pub fn client_addr6(j: usize) -> Ipv6Addr {
    assert!(
        (1..=MAX_CLIENTS).contains(&j),
        "client index {j} out of range"
    );
    Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 1, 10 + j as u16)
}

/// The IPv6 sysctls of a namespace. The public side is dual-stack, so
/// nodes and clients keep IPv6, quiet: no router solicitations, no router
/// advertisements taken, no duplicate address detection (the shared
/// address is on every node by design), so that what crosses the public
/// bridge is the tests' own traffic. The router namespace, a bridge only,
/// has IPv6 off.
pub fn ipv6_settings(router: bool) -> &'static [(&'static str, &'static str)] {
    if router {
        &[
            ("net.ipv6.conf.all.disable_ipv6", "1"),
            ("net.ipv6.conf.default.disable_ipv6", "1"),
        ]
    } else {
        &[
            ("net.ipv6.conf.all.accept_ra", "0"),
            ("net.ipv6.conf.default.accept_ra", "0"),
            ("net.ipv6.conf.all.router_solicitations", "0"),
            ("net.ipv6.conf.default.router_solicitations", "0"),
            ("net.ipv6.conf.all.accept_dad", "0"),
            ("net.ipv6.conf.default.accept_dad", "0"),
        ]
    }
}

/// Bridges and every veth pair, run inside the router namespace. Each veth
/// is created with its far end directly in the endpoint's namespace, so no
/// interface ever appears in the host namespace (where concurrent clusters
/// would clash on names).
pub fn router_script(nodes: &[&str], clients: &[&str]) -> Vec<String> {
    let mut s = vec!["link set lo up".to_owned()];
    for br in [PUBLIC_BRIDGE, CLUSTER_BRIDGE] {
        s.push(format!("link add {br} type bridge"));
        s.push(format!("link set {br} up"));
    }
    for (i, ns) in nodes.iter().enumerate() {
        let i = i + 1;
        for (side, iface, br) in [
            ('p', PUBLIC_IFACE, PUBLIC_BRIDGE),
            ('c', CLUSTER_IFACE, CLUSTER_BRIDGE),
        ] {
            let port = format!("n{i}{side}");
            s.push(format!(
                "link add {port} type veth peer name {iface} netns {ns}"
            ));
            s.push(format!("link set {port} master {br} up"));
        }
    }
    for (j, ns) in clients.iter().enumerate() {
        let port = format!("c{}e", j + 1);
        s.push(format!(
            "link add {port} type veth peer name {CLIENT_IFACE} netns {ns}"
        ));
        s.push(format!("link set {port} master {PUBLIC_BRIDGE} up"));
    }
    s
}

/// `packaging/ferry-network`: the network steps `docs/deploy.md` gives for
/// real hosts, which the harness runs in its namespaces too.
pub fn network_script() -> std::path::PathBuf {
    crate::paths::workspace_root()
        .join("packaging")
        .join("ferry-network")
}

/// `ferry-network node`'s arguments for node `i` (1-based), run inside its
/// namespace: the shared addresses on the public interface, no ARP answered
/// for it, its own address on the cluster network (of `cluster`'s family).
pub fn node_network_args(i: usize, cluster: Family) -> Vec<String> {
    let own = match cluster {
        Family::V4 => format!("{}/24", node_cluster_addr(i)),
        Family::V6 => format!("{}/64", node_cluster_addr6(i)),
    };
    [
        "node",
        "--public",
        PUBLIC_IFACE,
        "--shared",
        &format!("{PUBLIC_ADDR}/24"),
        "--shared",
        &format!("{PUBLIC_ADDR6}/64"),
        "--cluster",
        CLUSTER_IFACE,
        "--address",
        &own,
    ]
    .map(str::to_owned)
    .to_vec()
}

/// Address of client `j` (1-based), run inside its namespace.
pub fn client_script(j: usize) -> Vec<String> {
    vec![
        "link set lo up".to_owned(),
        format!("addr add {}/24 dev {CLIENT_IFACE}", client_addr(j)),
        // nodad: usable at once, as the nodes' shared one.
        format!("addr add {}/64 dev {CLIENT_IFACE} nodad", client_addr6(j)),
        format!("link set {CLIENT_IFACE} up"),
    ]
}

/// `ferry-network gateway`'s arguments for a client, which stands where a
/// real cluster's gateway router does (on the clients' segment, sending
/// to the shared address): its neighbour entry for the shared address is
/// the broadcast MAC.
pub fn gateway_network_args() -> Vec<String> {
    [
        "gateway",
        "--lan",
        CLIENT_IFACE,
        "--shared",
        &PUBLIC_ADDR.to_string(),
        "--shared",
        &PUBLIC_ADDR6.to_string(),
    ]
    .map(str::to_owned)
    .to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_stay_in_the_benchmark_range() {
        let bench = |a: Ipv4Addr| a.octets()[0] == 198 && (a.octets()[1] & 0xfe) == 18;
        assert!(bench(PUBLIC_ADDR));
        assert!(bench(node_cluster_addr(1)) && bench(node_cluster_addr(MAX_NODES)));
        assert!(bench(client_addr(1)) && bench(client_addr(MAX_CLIENTS)));
        assert!(client_addr(MAX_CLIENTS) < PUBLIC_ADDR);
        // 2001:2::/48.
        let bench6 = |a: Ipv6Addr| a.segments()[..3] == [0x2001, 2, 0];
        assert!(bench6(PUBLIC_ADDR6));
        assert!(bench6(client_addr6(1)) && bench6(client_addr6(MAX_CLIENTS)));
        assert!(bench6(node_cluster_addr6(1)) && bench6(node_cluster_addr6(MAX_NODES)));
        assert_ne!(client_addr6(MAX_CLIENTS), PUBLIC_ADDR6);
    }

    #[test]
    fn router_ports_fit_interface_names() {
        let s = router_script(&["fy1-0-n64"; MAX_NODES], &["fy1-0-c89"; MAX_CLIENTS]);
        for line in s.iter().filter(|l| l.starts_with("link add")) {
            let name = line.split_whitespace().nth(2).unwrap();
            assert!(name.len() <= 15, "{name}");
        }
    }
}
