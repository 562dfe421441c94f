//! The `ferryd.toml` the harness writes for each node (the agent's config
//! contract; see `ferry_agent::config`).

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub node: String,
    pub work_dir: PathBuf,
    pub criu_path: PathBuf,
    pub control_socket: PathBuf,
    pub public_interface: String,
    pub public_address: Ipv4Addr,
    pub cluster_interface: String,
    pub cluster_address: Ipv4Addr,
    pub peer_listen: SocketAddrV4,
    /// (name, peer address) of every other node.
    pub peers: Vec<(String, SocketAddrV4)>,
    /// `[dataplane] capture`.
    pub capture: bool,
    /// `[dataplane] pin_dir`: on the node's own bpffs mount.
    pub pin_dir: PathBuf,
    /// Extra top-level `key = value` lines, verbatim (e.g. `criu_log_level = 4`).
    pub extra: String,
    /// The `[tls]` section, verbatim, last (see `ClusterTls::config_section`).
    pub tls: Option<String>,
}

/// A TOML basic string. JSON string syntax is a subset of TOML's basic
/// strings (same escapes, `\uXXXX` included), so serde_json quotes it right.
fn quote(s: &str) -> String {
    serde_json::to_string(s).expect("serialising a str cannot fail")
}

fn quote_path(p: &std::path::Path) -> String {
    quote(&p.to_string_lossy())
}

impl AgentConfig {
    pub fn render(&self) -> String {
        let mut t = String::new();
        // Writing to a String cannot fail; the results are ignored for brevity.
        let _ = writeln!(t, "node = {}", quote(&self.node));
        let _ = writeln!(t, "work_dir = {}", quote_path(&self.work_dir));
        let _ = writeln!(t, "criu_path = {}", quote_path(&self.criu_path));
        let _ = writeln!(t, "control_socket = {}", quote_path(&self.control_socket));
        if !self.extra.trim().is_empty() {
            let _ = writeln!(t, "{}", self.extra.trim_end());
        }
        let _ = writeln!(t, "\n[dataplane]");
        let _ = writeln!(t, "capture = {}", self.capture);
        let _ = writeln!(t, "pin_dir = {}", quote_path(&self.pin_dir));
        let _ = writeln!(t, "\n[public]");
        let _ = writeln!(t, "interface = {}", quote(&self.public_interface));
        let _ = writeln!(t, "address = {}", quote(&self.public_address.to_string()));
        let _ = writeln!(t, "\n[cluster]");
        let _ = writeln!(t, "interface = {}", quote(&self.cluster_interface));
        let _ = writeln!(t, "address = {}", quote(&self.cluster_address.to_string()));
        let _ = writeln!(t, "peer_listen = {}", quote(&self.peer_listen.to_string()));
        for (name, addr) in &self.peers {
            let _ = writeln!(t, "\n[[peers]]");
            let _ = writeln!(t, "name = {}", quote(name));
            let _ = writeln!(t, "address = {}", quote(&addr.to_string()));
        }
        if let Some(tls) = &self.tls {
            t.push_str(tls);
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_contract() {
        let c = AgentConfig {
            node: "node1".into(),
            work_dir: "/tmp/x/node1/work".into(),
            criu_path: "/opt/ferry/criu/bin/criu".into(),
            control_socket: "/tmp/x/node1/control.sock".into(),
            public_interface: "pub0".into(),
            public_address: Ipv4Addr::new(198, 18, 0, 100),
            cluster_interface: "clu0".into(),
            cluster_address: Ipv4Addr::new(198, 19, 0, 1),
            peer_listen: "198.19.0.1:7100".parse().unwrap(),
            peers: vec![("node2".into(), "198.19.0.2:7100".parse().unwrap())],
            extra: "criu_log_level = 4\n".into(),
            capture: true,
            pin_dir: "/tmp/x/node1/bpf/pins".into(),
            tls: None,
        };
        let expected = r#"node = "node1"
work_dir = "/tmp/x/node1/work"
criu_path = "/opt/ferry/criu/bin/criu"
control_socket = "/tmp/x/node1/control.sock"
criu_log_level = 4

[dataplane]
capture = true
pin_dir = "/tmp/x/node1/bpf/pins"

[public]
interface = "pub0"
address = "198.18.0.100"

[cluster]
interface = "clu0"
address = "198.19.0.1"
peer_listen = "198.19.0.1:7100"

[[peers]]
name = "node2"
address = "198.19.0.2:7100"
"#;
        assert_eq!(c.render(), expected);
    }

    #[test]
    fn quotes_awkward_paths() {
        assert_eq!(quote("a\"b\\c"), r#""a\"b\\c""#);
    }
}
