//! A node's agent: every service, built once, in one place, in the order
//! they depend on each other (each holds only what it uses):
//!
//! ```text
//! events ─┬─> processes ─┬─> ports ──> supervisor ─┐
//!         │  dataplane ──┤    ^                    ├─> engine ──> conductor, drains
//!         │  cluster ────┴────┘                    │
//!         └─> cordon, reports ─────────────────────┘
//! ```
//!
//! The API (`crate::api`) serves a [`Node`]; the engine (`crate::engine`)
//! sees only its [`Engine`] context.

use std::sync::Arc;
use std::time::Duration;

use crate::cluster::Cluster;
use crate::conductor::{self, Conductor};
use crate::config::Config;
use crate::cordon::Cordon;
use crate::criu::Checkpointer;
use crate::dataplane::{DataPlane, FlowRules, PacketReplayer, PortFilter};
use crate::drain::Drains;
use crate::engine::link::Connector;
use crate::engine::{Engine, Services};
use crate::events::EventBus;
use crate::groups::Groups;
use crate::managed::Processes;
use crate::membership::Membership;
use crate::ports::Ports;
use crate::reports::Reports;
use crate::security::TlsMaterial;
use crate::supervisor::Supervisor;

/// What a node is built from: its configuration, the privileged parts of
/// its data plane (faked in unit tests), and what was started before it.
pub struct NodeParts {
    pub config: Config,
    pub filter: Box<dyn PortFilter>,
    pub replayer: Box<dyn PacketReplayer>,
    pub flows: Box<dyn FlowRules>,
    /// This node's certificate and the cluster CA, when `[tls]` is set.
    pub tls: Option<TlsMaterial>,
    /// SWIM membership, when `[membership] enabled`: the balancer's
    /// conductor runs with it.
    pub membership: Option<Arc<Membership>>,
    /// CRIU as the source's dump uses it: the configured `criu_path`, or a
    /// script in unit tests.
    pub criu: Arc<dyn Checkpointer>,
    /// How the engine reaches other agents: `None` for gRPC through the
    /// cluster's addresses (mutual TLS with `[tls]`); a scripted peer in
    /// unit tests.
    pub links: Option<Arc<dyn Connector>>,
}

/// One node's agent.
#[derive(Debug)]
pub struct Node {
    pub config: Arc<Config>,
    pub events: Arc<EventBus>,
    pub processes: Arc<Processes>,
    pub dataplane: Arc<DataPlane>,
    pub cluster: Arc<Cluster>,
    pub ports: Arc<Ports>,
    pub supervisor: Arc<Supervisor>,
    pub cordon: Arc<Cordon>,
    pub reports: Arc<Reports>,
    pub engine: Arc<Engine>,
    /// The load balancer's conductor, when membership runs.
    pub conductor: Option<Arc<Conductor>>,
    /// The drain running on this node, if one is.
    pub drains: Arc<Drains>,
    /// The distributed servers this node is a member of.
    pub groups: Arc<Groups>,
}

impl Node {
    pub fn build(parts: NodeParts) -> Arc<Self> {
        let NodeParts {
            config,
            filter,
            replayer,
            flows,
            tls,
            membership,
            criu,
            links,
        } = parts;
        let config = Arc::new(config);
        let events = Arc::new(EventBus::new(&config.node));
        let processes = Arc::new(Processes::new(&config.work_dir, events.clone()));
        let dataplane = Arc::new(DataPlane::new(filter, replayer, flows));
        let cluster = Arc::new(Cluster::new(&config, membership.clone(), tls));
        let ports = Arc::new(Ports::new(
            processes.clone(),
            dataplane.clone(),
            cluster.clone(),
        ));
        let supervisor = Arc::new(Supervisor::new(
            &config.node,
            processes.clone(),
            ports.clone(),
            dataplane.clone(),
        ));
        let cordon = Arc::new(Cordon::new(&config.node, &config.work_dir, events.clone()));
        let reports = Arc::new(Reports::default());
        let engine = Arc::new(Engine::new(Services {
            config: config.clone(),
            processes: processes.clone(),
            supervisor: supervisor.clone(),
            ports: ports.clone(),
            dataplane: dataplane.clone(),
            cluster: cluster.clone(),
            cordon: cordon.clone(),
            events: events.clone(),
            reports: reports.clone(),
            criu,
            links: links.unwrap_or_else(|| cluster.clone()),
        }));
        let conductor = membership.map(|membership| {
            Conductor::new(
                &config.node,
                conductor::Settings {
                    enabled: config.balancer.enabled,
                    offer_timeout: Duration::from_millis(config.balancer.offer_timeout_ms),
                    policy: config.policy.clone(),
                },
                Arc::new(conductor::ProcfsSampler::new(
                    processes.clone(),
                    config.balancer.cpu_cgroup.clone(),
                )),
                Arc::new(conductor::EngineStarter::new(engine.clone())),
                Arc::new(conductor::GrpcNegotiator::new(cluster.clone())),
                membership,
                Arc::new(conductor::WallClock::default()),
            )
        });
        let drains = Arc::new(Drains::new(conductor.clone()));
        let groups = Arc::new(
            Groups::new(
                &config.node,
                config.public.addresses(),
                ports.clone(),
                dataplane.clone(),
                cluster.clone(),
                processes.clone(),
                events.clone(),
            )
            .saved_in(config.work_dir.join("groups.json")),
        );
        Arc::new(Self {
            config,
            events,
            processes,
            dataplane,
            cluster,
            ports,
            supervisor,
            cordon,
            reports,
            engine,
            conductor,
            drains,
            groups,
        })
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.config.node
    }
}
