//! A node's `ferryd.toml` from the few facts that differ between nodes
//! (`ferry init`): its name, its two interfaces and addresses, its peers
//! and where `ferry cert` put its certificates. The rest keeps the
//! defaults `packaging/ferryd.toml.example` explains.
//!
//! The integration harness writes its agents' configurations with this
//! too (`docs/deploy.md`'s step), so what the guide tells users to run is
//! what every test cluster runs.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

use super::{Config, ConfigError};
use crate::security::certs;

/// What `ferry init` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInit {
    pub node: String,
    /// The interface on the clients' segment, and the cluster's shared
    /// address (the same on every node), IPv4 or IPv6.
    pub public_interface: String,
    pub public_address: IpAddr,
    /// A dual-stack cluster's shared IPv6 address, beside an IPv4 one.
    pub public_address6: Option<Ipv6Addr>,
    /// The interface and this node's own address on the cluster network,
    /// IPv4 or IPv6.
    pub cluster_interface: String,
    pub cluster_address: IpAddr,
    /// The Peer API's port on every node.
    pub peer_port: u16,
    /// The other nodes: name and Peer address.
    pub peers: Vec<(String, SocketAddr)>,
    /// A directory laid out as `ferry cert` writes it: `ca.crt`,
    /// `membership.key`, `<node>.crt`, `<node>.key`. None: no `[tls]`
    /// (plaintext, unauthenticated; ferryd warns).
    pub tls_dir: Option<PathBuf>,
    pub work_dir: PathBuf,
    pub criu_path: PathBuf,
    pub control_socket: PathBuf,
    pub handoff_socket: PathBuf,
    /// Where the data plane pins its maps (a bpffs directory); None: the
    /// default.
    pub pin_dir: Option<PathBuf>,
    /// Whether packets of a migrating process are captured and replayed
    /// (`[dataplane] capture`); written only when off.
    pub capture: bool,
    /// More top-level settings, verbatim (`features_off = [...]`).
    pub extra: String,
}

impl NodeInit {
    /// A node with the packaged defaults for the rest (`/var/lib/ferry`,
    /// `/opt/ferry/criu/bin/criu`, `/run/ferry/control.sock`, port 7100).
    pub fn new(
        node: &str,
        (public_interface, public_address): (&str, IpAddr),
        (cluster_interface, cluster_address): (&str, IpAddr),
    ) -> Self {
        Self {
            node: node.to_owned(),
            public_interface: public_interface.to_owned(),
            public_address,
            public_address6: None,
            cluster_interface: cluster_interface.to_owned(),
            cluster_address,
            peer_port: 7100,
            peers: Vec::new(),
            tls_dir: None,
            work_dir: PathBuf::from("/var/lib/ferry"),
            criu_path: PathBuf::from("/opt/ferry/criu/bin/criu"),
            control_socket: PathBuf::from("/run/ferry/control.sock"),
            handoff_socket: PathBuf::from(ferry_handoff::DEFAULT_SOCKET),
            pin_dir: None,
            capture: true,
            extra: String::new(),
        }
    }

    /// The node's `[tls]` files: (ca, cert, key, membership key).
    pub fn tls_files(&self) -> Option<(PathBuf, PathBuf, PathBuf, PathBuf)> {
        self.tls_dir.as_ref().map(|d| {
            (
                d.join(certs::CA_CERT),
                d.join(format!("{}.crt", self.node)),
                d.join(format!("{}.key", self.node)),
                d.join(certs::MEMBERSHIP_KEY),
            )
        })
    }

    /// The `ferryd.toml`, checked as ferryd reads it (`ferryd
    /// --check-config`): an error names the field.
    pub fn render(&self) -> Result<String, ConfigError> {
        let mut t = String::new();
        let q = |s: &str| toml_string(s);
        let p = |p: &Path| toml_string(&p.to_string_lossy());
        // Writing to a String cannot fail.
        let _ = writeln!(
            t,
            "# ferryd.toml of {}, written by `ferry init`; every setting is explained in\n\
             # packaging/ferryd.toml.example in ferry's source.\n",
            self.node
        );
        let _ = writeln!(t, "node = {}", q(&self.node));
        let _ = writeln!(t, "work_dir = {}", p(&self.work_dir));
        let _ = writeln!(t, "criu_path = {}", p(&self.criu_path));
        let _ = writeln!(t, "control_socket = {}", p(&self.control_socket));
        let _ = writeln!(t, "handoff_socket = {}", p(&self.handoff_socket));
        if !self.extra.trim().is_empty() {
            let _ = writeln!(t, "{}", self.extra.trim_end());
        }
        if !self.capture || self.pin_dir.is_some() {
            let _ = writeln!(t, "\n[dataplane]");
            if !self.capture {
                let _ = writeln!(t, "capture = false");
            }
            if let Some(pins) = &self.pin_dir {
                let _ = writeln!(t, "pin_dir = {}", p(pins));
            }
        }
        let _ = writeln!(
            t,
            "\n# The clients' segment: the shared address, the same on every node.\n[public]"
        );
        let _ = writeln!(t, "interface = {}", q(&self.public_interface));
        let _ = writeln!(t, "address = {}", q(&self.public_address.to_string()));
        if let Some(v6) = self.public_address6 {
            let _ = writeln!(t, "address6 = {}", q(&v6.to_string()));
        }
        let _ = writeln!(
            t,
            "\n# The cluster network: this node's own address.\n[cluster]"
        );
        let _ = writeln!(t, "interface = {}", q(&self.cluster_interface));
        let _ = writeln!(t, "address = {}", q(&self.cluster_address.to_string()));
        let _ = writeln!(
            t,
            "peer_listen = {}",
            q(&SocketAddr::from((self.cluster_address, self.peer_port)).to_string())
        );
        for (name, address) in &self.peers {
            let _ = writeln!(t, "\n[[peers]]");
            let _ = writeln!(t, "name = {}", q(name));
            let _ = writeln!(t, "address = {}", q(&address.to_string()));
        }
        if let Some((ca, cert, key, membership)) = self.tls_files() {
            let _ = writeln!(t, "\n[tls]");
            let _ = writeln!(t, "ca = {}", p(&ca));
            let _ = writeln!(t, "cert = {}", p(&cert));
            let _ = writeln!(t, "key = {}", p(&key));
            let _ = writeln!(t, "membership_key = {}", p(&membership));
        }
        Config::parse(&t, Path::new("ferryd.toml (ferry init)"))?;
        Ok(t)
    }
}

/// A TOML basic string: JSON's string syntax is a subset of TOML's.
fn toml_string(s: &str) -> String {
    serde_json::to_string(s).expect("serialising a str cannot fail")
}

/// Parses `NAME=ADDRESS[:PORT]` (a peer on the command line), the port
/// `default_port` when left out.
pub fn parse_peer(text: &str, default_port: u16) -> Result<(String, SocketAddr), String> {
    let (name, address) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?}: expected NAME=ADDRESS[:PORT]"))?;
    if name.is_empty() {
        return Err(format!("{text:?}: the peer's name is empty"));
    }
    let address = match address.parse::<SocketAddr>() {
        Ok(a) => a,
        Err(_) => address
            .parse::<std::net::IpAddr>()
            .map(|ip| SocketAddr::new(ip, default_port))
            .map_err(|e| format!("{text:?}: {address:?} is no address: {e}"))?,
    };
    Ok((name.to_owned(), address))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn node1() -> NodeInit {
        let mut n = NodeInit::new(
            "node1",
            ("eth0", Ipv4Addr::new(198, 18, 0, 100).into()),
            ("eth1", Ipv4Addr::new(198, 19, 0, 1).into()),
        );
        n.peers = vec![
            ("node2".into(), "198.19.0.2:7100".parse().unwrap()),
            ("node3".into(), "198.19.0.3:7100".parse().unwrap()),
        ];
        n
    }

    #[test]
    fn what_it_writes_is_what_ferryd_reads() {
        let mut n = node1();
        n.tls_dir = Some("/etc/ferry/tls".into());
        n.extra = "features_off = [\"soft_dirty\"]".into();
        n.capture = false;
        let text = n.render().unwrap();
        let c = Config::parse(&text, Path::new("x")).unwrap();
        assert_eq!(c.node, "node1");
        assert_eq!(c.public.interface, "eth0");
        assert_eq!(c.public.address, Ipv4Addr::new(198, 18, 0, 100));
        assert_eq!(c.public.address6, None);
        assert_eq!(c.cluster.address, Ipv4Addr::new(198, 19, 0, 1));
        assert_eq!(c.cluster.peer_listen, "198.19.0.1:7100".parse().unwrap());
        assert_eq!(c.peers.len(), 2);
        assert_eq!(c.peers[1].name, "node3");
        let tls = c.tls.expect("[tls]");
        assert_eq!(tls.cert, PathBuf::from("/etc/ferry/tls/node1.crt"));
        assert_eq!(tls.key, PathBuf::from("/etc/ferry/tls/node1.key"));
        assert_eq!(tls.ca, PathBuf::from("/etc/ferry/tls/ca.crt"));
        assert_eq!(
            tls.membership_key,
            Some(PathBuf::from("/etc/ferry/tls/membership.key"))
        );
        assert_eq!(c.features_off, ["soft_dirty"]);
        assert!(!c.dataplane.capture);
    }

    #[test]
    fn a_dual_stack_or_ipv6_public_side_is_written_and_read() {
        let v6: Ipv6Addr = "2001:db8::100".parse().unwrap();
        let mut n = node1();
        n.public_address6 = Some(v6);
        let c = Config::parse(&n.render().unwrap(), Path::new("x")).unwrap();
        assert_eq!(c.public.address6, Some(v6));
        assert_eq!(
            c.public.addresses().v4,
            Some(Ipv4Addr::new(198, 18, 0, 100))
        );
        assert_eq!(c.public.addresses().v6, Some(v6));
        assert!(
            c.public
                .addresses()
                .contains("::ffff:198.18.0.100".parse().unwrap())
        );
        let mut n = node1();
        n.public_address = v6.into();
        let c = Config::parse(&n.render().unwrap(), Path::new("x")).unwrap();
        assert_eq!(c.public.addresses().v4, None);
        assert_eq!(c.public.addresses().v6, Some(v6));
        // Two IPv6 addresses, or one that no cluster can share: refused.
        n.public_address6 = Some(v6);
        let err = n.render().unwrap_err().to_string();
        assert!(err.contains("public.address6"), "{err}");
        for bad in ["::1", "fe80::1", "ff02::1", "::", "::ffff:198.18.0.100"] {
            let mut n = node1();
            n.public_address = bad.parse().unwrap();
            let err = n.render().unwrap_err().to_string();
            assert!(
                err.contains("public.address") && err.contains(bad),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn a_bad_value_is_refused_naming_the_field() {
        let mut n = node1();
        n.extra = "features_off = [\"no_such_feature\"]".into();
        let err = n.render().unwrap_err().to_string();
        assert!(err.contains("features_off"), "{err}");
        let mut n = node1();
        n.node = String::new();
        assert!(n.render().is_err());
    }

    #[test]
    fn peers_parse_with_or_without_a_port() {
        assert_eq!(
            parse_peer("node2=198.19.0.2", 7100).unwrap(),
            ("node2".into(), "198.19.0.2:7100".parse().unwrap())
        );
        assert_eq!(
            parse_peer("node2=198.19.0.2:7200", 7100).unwrap().1,
            "198.19.0.2:7200".parse().unwrap()
        );
        for bad in ["node2", "=198.19.0.2", "node2=not-an-address"] {
            assert!(parse_peer(bad, 7100).is_err(), "{bad}");
        }
    }
}
