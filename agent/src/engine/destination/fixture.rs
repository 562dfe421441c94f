//! The agent the destination's unit tests and the peer-protocol fuzz
//! target (`fuzz/`, through `crate::fuzzing`) drive: a recording fake for
//! the eBPF filter, the replayer and the flow rules, and a "CRIU" that
//! only answers `--version` (Prepare checks it; any restore fails), so no
//! step touches the system outside its temporary directory.
use std::sync::Arc;

use crate::config::Config;
use crate::criu::InstalledCriu;
use crate::dataplane::filter::fake::FakeFilter;
use crate::dataplane::replay::fake::FakeReplayer;
use crate::dataplane::translation::fake::FakeFlowRules;
use crate::engine::Engine;
use crate::node::{Node, NodeParts};

pub struct Fixture {
    pub node: Arc<Node>,
    pub engine: Arc<Engine>,
    pub filter: FakeFilter,
    pub replayed: FakeReplayer,
    pub flows: FakeFlowRules,
    pub dir: tempfile::TempDir,
}

/// The state of an incoming slot, by name.
pub fn state_name(inc: &super::Incoming) -> &'static str {
    inc.state.name()
}

impl Fixture {
    /// Node "node2" (cluster address 198.19.0.2), knowing `peers`
    /// (name, cluster address) by configuration. With peers, nothing
    /// may make the agent call them: they are not there.
    pub fn new(peers: &[(&str, &str)]) -> Fixture {
        Self::with(peers, |_| None, None)
    }

    /// [`Fixture::new`], with the source's CRIU and Peer links given:
    /// `criu` gets the fake CRIU binary's path and may return another
    /// (`None`: that binary, which only answers `--version`).
    pub fn with(
        peers: &[(&str, &str)],
        source_criu: impl FnOnce(&std::path::Path) -> Option<Arc<dyn crate::criu::Checkpointer>>,
        links: Option<Arc<dyn crate::engine::link::Connector>>,
    ) -> Fixture {
        Self::configured("", peers, source_criu, links)
    }

    /// [`Fixture::new`] with `top_level` lines in its `ferryd.toml`
    /// (`features_off = ["uffd_events"]`).
    pub fn with_config(top_level: &str) -> Fixture {
        Self::configured(top_level, &[], |_| None, None)
    }

    fn configured(
        top_level: &str,
        peers: &[(&str, &str)],
        source_criu: impl FnOnce(&std::path::Path) -> Option<Arc<dyn crate::criu::Checkpointer>>,
        links: Option<Arc<dyn crate::engine::link::Connector>>,
    ) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let criu = dir.path().join("criu");
        std::fs::write(&criu, "#!/bin/sh\necho 'Version: 4.2.1'\n").unwrap();
        std::fs::set_permissions(&criu, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let mut toml = format!(
            r#"node = "node2"
work_dir = "{}"
criu_path = "{}"
{top_level}
[public]
interface = "pub0"
address = "198.18.0.100"
[cluster]
interface = "clu0"
address = "198.19.0.2"
peer_listen = "198.19.0.2:7100"
"#,
            dir.path().join("work").display(),
            criu.display()
        );
        for (name, address) in peers {
            toml.push_str(&format!(
                "[[peers]]\nname = \"{name}\"\naddress = \"{address}:7100\"\n"
            ));
        }
        let config = Config::parse(&toml, std::path::Path::new("test.toml")).unwrap();
        let filter = FakeFilter::default();
        let replayed = FakeReplayer::default();
        let flows = FakeFlowRules::default();
        let source_criu =
            source_criu(&criu).unwrap_or_else(|| Arc::new(InstalledCriu(criu.clone())));
        let node = Node::build(NodeParts {
            config,
            filter: Box::new(filter.clone()),
            replayer: Box::new(replayed.clone()),
            flows: Box::new(flows.clone()),
            tls: None,
            membership: None,
            criu: source_criu,
            links,
        });
        Fixture {
            engine: node.engine.clone(),
            node,
            filter,
            replayed,
            flows,
            dir,
        }
    }

    /// Registers a process that runs here (started by `ferry run`)
    /// holding `ports`.
    pub fn adopt_local(&self, pid: i32, ports: &[crate::process::PortKey]) {
        use crate::managed::{Lifecycle, ManagedProcess, Origin};
        self.engine.processes.adopt(ManagedProcess {
            pid,
            argv: vec!["local".into()],
            origin: Origin::Run,
            lifecycle: Lifecycle::Running,
            sockets: crate::process::SocketSummary {
                ports: ports.iter().copied().collect(),
                ..Default::default()
            },
        });
    }
}
