//! Port ownership: which of the cluster's ports this node accepts packets
//! for. The eBPF filter on the public interface enforces it; this module
//! decides it, from the processes the node manages, and applies only the
//! difference to the kernel.
//!
//! Hand-over during a migration (exactly one node owns a port at a time):
//! the source marks the process's ports frozen (still its own, but every
//! packet dropped in both directions) before the dump; the destination
//! starts owning them only at commit, after the source has discarded its
//! copy; the source stops owning them at the same point. Between the two,
//! packets are dropped on both nodes and TCP's retransmission recovers them.

use std::collections::BTreeMap;

use crate::process::{PortKey, Transport};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    /// Packets pass to the local stack.
    Owned,
    /// Still ours, but a migration is freezing the process: drop everything.
    Frozen,
}

#[derive(Debug, thiserror::Error)]
#[error("data plane: {0}")]
pub struct DataPlaneError(pub String);

/// The privileged side: BPF map updates. Faked in unit tests.
pub trait PortFilter: Send {
    fn set(&mut self, port: PortKey, state: PortState) -> Result<(), DataPlaneError>;
    fn remove(&mut self, port: PortKey) -> Result<(), DataPlaneError>;
}

/// The ports this node owns, as last written to the filter.
pub struct Ownership {
    filter: Box<dyn PortFilter>,
    current: BTreeMap<PortKey, PortState>,
}

impl std::fmt::Debug for Ownership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ownership")
            .field("current", &self.current)
            .finish()
    }
}

impl Ownership {
    pub fn new(filter: Box<dyn PortFilter>) -> Self {
        Self {
            filter,
            current: BTreeMap::new(),
        }
    }

    pub fn current(&self) -> &BTreeMap<PortKey, PortState> {
        &self.current
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
        order.sort_by_key(|(_, s)| match s {
            Some(PortState::Frozen) => 0,
            None => 1,
            Some(PortState::Owned) => 2,
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
        let p = proto(port.transport);
        let e = |e: ferry_ebpf::DataPlaneError| DataPlaneError(format!("port {port}: {e}"));
        self.0.own(p, port.port).map_err(e)?;
        match state {
            PortState::Frozen => self.0.freeze(&[(p, port.port)]).map_err(e),
            PortState::Owned => self.0.thaw(&[(p, port.port)]).map_err(e),
        }
    }

    fn remove(&mut self, port: PortKey) -> Result<(), DataPlaneError> {
        self.0
            .disown(proto(port.transport), port.port)
            .map_err(|e| DataPlaneError(format!("port {port}: {e}")))
    }
}

#[cfg(test)]
pub mod fake {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Records every call, in order.
    #[derive(Default, Clone)]
    pub struct FakeFilter(pub Arc<Mutex<Vec<String>>>);

    impl PortFilter for FakeFilter {
        fn set(&mut self, port: PortKey, state: PortState) -> Result<(), DataPlaneError> {
            self.0.lock().unwrap().push(format!("set {port} {state:?}"));
            Ok(())
        }
        fn remove(&mut self, port: PortKey) -> Result<(), DataPlaneError> {
            self.0.lock().unwrap().push(format!("remove {port}"));
            Ok(())
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
        let mut o = Ownership::new(Box::new(fake.clone()));
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
