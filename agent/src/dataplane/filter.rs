//! The ownership filter: which of the cluster's ports this node accepts
//! packets for, as written to the eBPF filter on the public interface
//! (`ferry_ebpf::OwnershipFilter`). `crate::ports` decides the states, from
//! the processes the node manages and the migrations under way; this
//! module writes only the differences to the kernel.
//!
//! Hand-over during a migration (exactly one node owns a port at a time,
//! and every packet is either delivered once or kept):
//!
//! | step                         | source      | destination |
//! |------------------------------|-------------|-------------|
//! | before                       | Owned       | -           |
//! | Prepare                      | Owned       | Frozen      |
//! | record (before Arm)          | Recording   | Frozen      |
//! | Arm                          | Recording   | Capturing   |
//! | armed (after Arm)            | Armed       | Capturing   |
//! | freeze                       | Capturing   | Capturing   |
//! | discard (commit point)       | -           | Capturing   |
//! | Commit: replay               | -           | Releasing   |
//! | Commit: done                 | -           | Owned       |
//!
//! From Arm to the freeze both nodes see the process's packets: the source
//! delivers and logs them (Recording), the destination keeps them. The log
//! tells the destination which of its first captured packets to skip. Once
//! the destination captures, the source starts no new TCP connection
//! (Armed): a SYN is left to the destination, whose restored listener
//! answers it, so none waits half done or queued where CRIU would find it. On
//! abort the source replays what it captured while frozen (Releasing) and
//! owns the ports again.

use std::collections::BTreeMap;

pub use ferry_ebpf::{CapturedPacket, Counters, Flow, FlowState, PortState};

use crate::process::{PortKey, Transport};

#[derive(Debug, thiserror::Error)]
#[error("data plane: {0}")]
pub struct DataPlaneError(pub String);

/// The privileged side: BPF map updates and the capture ring. Faked in unit
/// tests.
pub trait PortFilter: Send {
    fn set(&mut self, port: PortKey, state: PortState) -> Result<(), DataPlaneError>;
    fn remove(&mut self, port: PortKey) -> Result<(), DataPlaneError>;
    /// Takes every record out of the capture ring, oldest first.
    fn collect(&mut self, sink: &mut dyn FnMut(CapturedPacket));
    fn counters(&self) -> Result<Counters, DataPlaneError>;
    /// The interface the filter guards.
    fn interface(&self) -> &str;
    /// The ports as the filter holds them now: with pinned maps, what an
    /// earlier agent left (its processes may still run).
    fn ports(&self) -> Result<BTreeMap<PortKey, PortState>, DataPlaneError>;
    /// Puts one connection of a shared port in `state`.
    fn set_flow(&mut self, flow: Flow, state: FlowState) -> Result<(), DataPlaneError>;
    /// Forgets one connection of a shared port (its port decides again).
    fn remove_flow(&mut self, flow: Flow) -> Result<(), DataPlaneError>;
    /// How one connection of a shared port is decided (None: by its port).
    fn flow(&self, flow: Flow) -> Result<Option<FlowState>, DataPlaneError>;
    /// The connections decided one by one.
    fn flows(&self) -> Result<Vec<(Flow, FlowState)>, DataPlaneError>;
}

/// The ports this node owns, as last written to the filter.
pub struct PortTable {
    filter: Box<dyn PortFilter>,
    current: BTreeMap<PortKey, PortState>,
}

impl std::fmt::Debug for PortTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortTable")
            .field("current", &self.current)
            .finish()
    }
}

impl PortTable {
    /// Starts from what the filter holds: after an agent restart with
    /// pinned maps the ports are still owned, and the first refresh
    /// releases those no process holds any more, and only those.
    pub fn new(filter: Box<dyn PortFilter>) -> Self {
        let current = filter.ports().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "reading the filter's ports; starting from none");
            BTreeMap::new()
        });
        if !current.is_empty() {
            tracing::info!(
                ports = current.len(),
                "ports owned before this agent started"
            );
        }
        Self { filter, current }
    }

    pub fn current(&self) -> &BTreeMap<PortKey, PortState> {
        &self.current
    }

    pub fn collect(&mut self, sink: &mut dyn FnMut(CapturedPacket)) {
        self.filter.collect(sink)
    }

    pub fn counters(&self) -> Result<Counters, DataPlaneError> {
        self.filter.counters()
    }

    pub fn interface(&self) -> &str {
        self.filter.interface()
    }

    /// Puts one connection of a shared port in `state` (a handoff's step).
    pub fn set_flow(&mut self, flow: Flow, state: FlowState) -> Result<(), DataPlaneError> {
        self.filter.set_flow(flow, state)
    }

    /// Forgets one connection of a shared port.
    pub fn remove_flow(&mut self, flow: Flow) -> Result<(), DataPlaneError> {
        self.filter.remove_flow(flow)
    }

    /// How one connection of a shared port is decided (None: by its port).
    pub fn flow(&self, flow: Flow) -> Result<Option<FlowState>, DataPlaneError> {
        self.filter.flow(flow)
    }

    /// The connections of shared ports decided one by one.
    pub fn flows(&self) -> Result<Vec<(Flow, FlowState)>, DataPlaneError> {
        self.filter.flows()
    }

    /// Brings the filter to `desired`, touching only ports whose state
    /// changes. Freezes are written before anything else, so a process
    /// about to be dumped is cut off first.
    pub fn apply(&mut self, desired: &BTreeMap<PortKey, PortState>) -> Result<(), DataPlaneError> {
        let mut order: Vec<(PortKey, Option<PortState>)> = Vec::new();
        for (port, state) in desired {
            if self.current.get(port) != Some(state) {
                order.push((*port, Some(*state)));
            }
        }
        for port in self.current.keys() {
            if !desired.contains_key(port) {
                order.push((*port, None));
            }
        }
        // Cut-offs first (a process about to be dumped is isolated before
        // anything else changes), then releases, then what opens up.
        order.sort_by_key(|(_, s)| match s {
            Some(PortState::Capturing | PortState::Frozen) => 0,
            None => 1,
            Some(PortState::Recording | PortState::Armed) => 2,
            Some(PortState::Releasing) => 3,
            Some(PortState::Owned | PortState::SharedContact | PortState::SharedMember) => 4,
        });
        for (port, state) in order {
            match state {
                Some(s) => {
                    self.filter.set(port, s)?;
                    self.current.insert(port, s);
                    tracing::debug!(%port, state = ?s, "port ownership");
                }
                None => {
                    self.filter.remove(port)?;
                    self.current.remove(&port);
                    tracing::debug!(%port, "port released");
                }
            }
        }
        Ok(())
    }
}

/// The real filter: ferry's tc programs on the public interface.
pub struct EbpfPortFilter(pub ferry_ebpf::OwnershipFilter);

fn proto(t: Transport) -> ferry_ebpf::Protocol {
    match t {
        Transport::Tcp => ferry_ebpf::Protocol::Tcp,
        Transport::Udp => ferry_ebpf::Protocol::Udp,
    }
}

impl PortFilter for EbpfPortFilter {
    fn set(&mut self, port: PortKey, state: PortState) -> Result<(), DataPlaneError> {
        self.0
            .set(proto(port.transport), port.port, state)
            .map_err(|e| DataPlaneError(format!("port {port}: {e}")))
    }

    fn remove(&mut self, port: PortKey) -> Result<(), DataPlaneError> {
        self.0
            .remove(proto(port.transport), port.port)
            .map_err(|e| DataPlaneError(format!("port {port}: {e}")))
    }

    fn collect(&mut self, sink: &mut dyn FnMut(CapturedPacket)) {
        let (_, bad) = self.0.drain_captured(sink);
        if bad > 0 {
            tracing::warn!(bad, "undecodable records in the capture ring");
        }
    }

    fn counters(&self) -> Result<Counters, DataPlaneError> {
        self.0
            .counters()
            .map_err(|e| DataPlaneError(format!("counters: {e}")))
    }

    fn interface(&self) -> &str {
        self.0.iface()
    }

    fn ports(&self) -> Result<BTreeMap<PortKey, PortState>, DataPlaneError> {
        let ports = self
            .0
            .ports()
            .map_err(|e| DataPlaneError(format!("reading ports: {e}")))?;
        Ok(ports
            .into_iter()
            .map(|(p, port, state)| {
                let transport = match p {
                    ferry_ebpf::Protocol::Tcp => Transport::Tcp,
                    ferry_ebpf::Protocol::Udp => Transport::Udp,
                };
                (PortKey { transport, port }, state)
            })
            .collect())
    }

    fn set_flow(&mut self, flow: Flow, state: FlowState) -> Result<(), DataPlaneError> {
        self.0
            .set_flow(flow, state)
            .map_err(|e| DataPlaneError(format!("connection {flow}: {e}")))
    }

    fn remove_flow(&mut self, flow: Flow) -> Result<(), DataPlaneError> {
        self.0
            .remove_flow(flow)
            .map_err(|e| DataPlaneError(format!("connection {flow}: {e}")))
    }

    fn flow(&self, flow: Flow) -> Result<Option<FlowState>, DataPlaneError> {
        self.0
            .flow(flow)
            .map_err(|e| DataPlaneError(format!("connection {flow}: {e}")))
    }

    fn flows(&self) -> Result<Vec<(Flow, FlowState)>, DataPlaneError> {
        self.0
            .flows()
            .map_err(|e| DataPlaneError(format!("reading connections: {e}")))
    }
}

#[cfg(any(test, feature = "fuzzing"))]
pub mod fake {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Records every call, in order; `collect` hands out what a test put
    /// in the ring (the second list).
    #[derive(Default, Clone)]
    pub struct FakeFilter(
        pub Arc<Mutex<Vec<String>>>,
        pub Arc<Mutex<Vec<CapturedPacket>>>,
    );

    impl PortFilter for FakeFilter {
        fn set(&mut self, port: PortKey, state: PortState) -> Result<(), DataPlaneError> {
            self.0.lock().unwrap().push(format!("set {port} {state:?}"));
            Ok(())
        }
        fn remove(&mut self, port: PortKey) -> Result<(), DataPlaneError> {
            self.0.lock().unwrap().push(format!("remove {port}"));
            Ok(())
        }
        fn collect(&mut self, sink: &mut dyn FnMut(CapturedPacket)) {
            for p in self.1.lock().unwrap().drain(..) {
                sink(p);
            }
        }
        fn counters(&self) -> Result<Counters, DataPlaneError> {
            Ok(Counters::default())
        }
        fn interface(&self) -> &str {
            "fake0"
        }
        fn ports(&self) -> Result<BTreeMap<PortKey, PortState>, DataPlaneError> {
            Ok(BTreeMap::new())
        }
        fn set_flow(&mut self, flow: Flow, state: FlowState) -> Result<(), DataPlaneError> {
            self.0
                .lock()
                .unwrap()
                .push(format!("flow {flow} {state:?}"));
            Ok(())
        }
        fn remove_flow(&mut self, flow: Flow) -> Result<(), DataPlaneError> {
            self.0.lock().unwrap().push(format!("forget {flow}"));
            Ok(())
        }
        fn flow(&self, _flow: Flow) -> Result<Option<FlowState>, DataPlaneError> {
            Ok(None)
        }
        fn flows(&self) -> Result<Vec<(Flow, FlowState)>, DataPlaneError> {
            Ok(Vec::new())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake::FakeFilter;
    use super::*;

    fn tcp(port: u16) -> PortKey {
        PortKey {
            transport: Transport::Tcp,
            port,
        }
    }

    #[test]
    fn applies_only_differences_and_freezes_first() {
        let fake = FakeFilter::default();
        let mut o = PortTable::new(Box::new(fake.clone()));
        let mut want =
            BTreeMap::from([(tcp(7000), PortState::Owned), (tcp(7001), PortState::Owned)]);
        o.apply(&want).unwrap();
        o.apply(&want).unwrap();
        assert_eq!(
            fake.0.lock().unwrap().len(),
            2,
            "second apply must be a no-op"
        );

        fake.0.lock().unwrap().clear();
        want.insert(tcp(7002), PortState::Owned);
        want.insert(tcp(7001), PortState::Frozen);
        want.remove(&tcp(7000));
        o.apply(&want).unwrap();
        assert_eq!(
            *fake.0.lock().unwrap(),
            vec![
                "set 7001/tcp Frozen",
                "remove 7000/tcp",
                "set 7002/tcp Owned"
            ]
        );
        assert_eq!(o.current(), &want);
    }
}
