//! What the migration engine works with: the node's services it uses, and
//! the migrations under way in each direction.

use std::sync::Arc;

use crate::cluster::Cluster;
use crate::config::Config;
use crate::cordon::Cordon;
use crate::dataplane::DataPlane;
use crate::events::EventBus;
use crate::managed::Processes;
use crate::ports::Ports;
use crate::reports::Reports;
use crate::supervisor::Supervisor;

use super::destination::IncomingSlot;
use super::journal::Journal;
use super::link::Connector;
use super::source::Outgoing;
use crate::criu::Checkpointer;

/// The engine of one node: the source side (`source`) and the
/// destination side (`destination`) of its migrations.
#[derive(Debug)]
pub struct Engine {
    pub config: Arc<Config>,
    pub processes: Arc<Processes>,
    pub supervisor: Arc<Supervisor>,
    pub ports: Arc<Ports>,
    pub dataplane: Arc<DataPlane>,
    pub cluster: Arc<Cluster>,
    pub cordon: Arc<Cordon>,
    pub events: Arc<EventBus>,
    pub reports: Arc<Reports>,
    /// CRIU, as the source's dump uses it.
    pub criu: Arc<dyn Checkpointer>,
    /// Opens Peer links to other agents.
    pub links: Arc<dyn Connector>,
    /// Migrations this node runs as the source: their cancel switches.
    pub outgoing: Outgoing,
    /// The one incoming migration this node may be receiving.
    pub incoming: IncomingSlot,
    /// What a restart of this agent must know of its migrations.
    pub journal: Journal,
}

/// The services an [`Engine`] is built from.
#[derive(Debug, Clone)]
pub struct Services {
    pub config: Arc<Config>,
    pub processes: Arc<Processes>,
    pub supervisor: Arc<Supervisor>,
    pub ports: Arc<Ports>,
    pub dataplane: Arc<DataPlane>,
    pub cluster: Arc<Cluster>,
    pub cordon: Arc<Cordon>,
    pub events: Arc<EventBus>,
    pub reports: Arc<Reports>,
    pub criu: Arc<dyn Checkpointer>,
    pub links: Arc<dyn Connector>,
}

impl Engine {
    pub fn new(s: Services) -> Self {
        Self {
            journal: Journal::new(&s.config.work_dir),
            config: s.config,
            processes: s.processes,
            supervisor: s.supervisor,
            ports: s.ports,
            dataplane: s.dataplane,
            cluster: s.cluster,
            cordon: s.cordon,
            events: s.events,
            reports: s.reports,
            criu: s.criu,
            links: s.links,
            outgoing: Outgoing::default(),
            incoming: IncomingSlot::default(),
        }
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.config.node
    }

    /// This node, as in-cluster translations name it.
    pub fn here(&self) -> crate::dataplane::translations::Here<'_> {
        crate::dataplane::translations::Here {
            node: &self.config.node,
            cluster_address: self.config.cluster.address,
        }
    }
}
