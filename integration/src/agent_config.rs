//! The `ferryd.toml` the harness writes for each node: `ferry init`'s
//! (`ferry_agent::config::init`, the step `docs/deploy.md` gives users),
//! plus the Control API tokens the security tests hand out.

use ferry_agent::config::init::NodeInit;
use ferry_agent::config::{Config, ConfigError};

#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// What `ferry init` would be given for this node.
    pub init: NodeInit,
    /// `[[tls.tokens]]` entries, verbatim (see `ClusterTls::token_section`).
    pub tls_tokens: String,
}

impl AgentConfig {
    /// The file, checked as ferryd reads it.
    pub fn render(&self) -> Result<String, ConfigError> {
        let mut t = self.init.render()?;
        if !self.tls_tokens.is_empty() {
            t.push_str(&self.tls_tokens);
            Config::parse(&t, std::path::Path::new("ferryd.toml (harness)"))?;
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn renders_the_contract() {
        let mut init = NodeInit::new(
            "node1",
            ("pub0", Ipv4Addr::new(198, 18, 0, 100).into()),
            ("clu0", Ipv4Addr::new(198, 19, 0, 1).into()),
        );
        init.work_dir = "/tmp/x/node1/work".into();
        init.control_socket = "/tmp/x/node1/control.sock".into();
        init.peers = vec![("node2".into(), "198.19.0.2:7100".parse().unwrap())];
        init.extra = "criu_log_level = 4\n".into();
        init.pin_dir = Some("/tmp/x/node1/bpf/pins".into());
        let c = AgentConfig {
            init,
            tls_tokens: String::new(),
        };
        let text = c.render().unwrap();
        let parsed = Config::parse(&text, std::path::Path::new("x")).unwrap();
        assert_eq!(parsed.node, "node1");
        assert_eq!(parsed.criu_log_level, 4);
        assert_eq!(
            parsed.dataplane.pin_dir,
            Some(std::path::PathBuf::from("/tmp/x/node1/bpf/pins"))
        );
        assert_eq!(parsed.peers[0].name, "node2");
        assert!(parsed.dataplane.capture);
        assert!(parsed.tls.is_none());
    }
}
