use aya::maps::{HashMap, MapData, PerCpuArray};
use aya::programs::{SchedClassifier, TcAttachType, tc};
use aya::{Ebpf, include_bytes_aligned};

use crate::DataPlaneError;
use crate::maps::{self, PortKey};

static OBJECT: &[u8] = include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ownership.bpf.o"));

const PORTS_MAP: &str = "FERRY_PORTS";
const COUNTERS_MAP: &str = "FERRY_COUNTERS";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    fn ip_proto(self) -> u8 {
        match self {
            Protocol::Tcp => libc::IPPROTO_TCP as u8,
            Protocol::Udp => libc::IPPROTO_UDP as u8,
        }
    }

    fn from_ip_proto(p: u8) -> Option<Self> {
        match i32::from(p) {
            libc::IPPROTO_TCP => Some(Protocol::Tcp),
            libc::IPPROTO_UDP => Some(Protocol::Udp),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    Owned,
    /// Owned, but every packet is dropped in both directions.
    Frozen,
}

/// Packet counts of the filter, summed over CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Packets to owned ports, delivered to this node's stack.
    pub passed: u64,
    /// Packets to ports this node does not own, dropped.
    pub dropped_not_owned: u64,
    /// Packets to frozen ports, dropped.
    pub dropped_frozen: u64,
    /// Other traffic (ARP, ICMP, non-IPv4), passed untouched.
    pub passed_other: u64,
    /// Packets leaving frozen ports, dropped.
    pub egress_blocked: u64,
}

/// The ownership filter attached to one interface. Dropping it detaches the
/// programs.
pub struct OwnershipFilter {
    // Owns the programs and their links: dropping it detaches them.
    _ebpf: Ebpf,
    ports: HashMap<MapData, PortKey, u32>,
    counters: PerCpuArray<MapData, u64>,
    iface: String,
}

impl std::fmt::Debug for OwnershipFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnershipFilter")
            .field("iface", &self.iface)
            .finish()
    }
}

fn key(proto: Protocol, port: u16) -> PortKey {
    PortKey {
        proto: proto.ip_proto(),
        pad: 0,
        port,
    }
}

impl OwnershipFilter {
    /// Loads the programs and attaches them at tc ingress and egress of
    /// `iface` in the calling thread's network namespace. Nothing is owned
    /// yet: from here on the node drops all TCP and UDP on `iface`.
    pub fn attach(iface: &str) -> Result<Self, DataPlaneError> {
        let mut ebpf = Ebpf::load(OBJECT)?;
        // Kernels before 6.6 attach tc programs through the clsact qdisc;
        // from 6.6 aya uses tcx links, which need none (and adding one again
        // after a restart fails with EEXIST).
        let tcx = aya::util::KernelVersion::current()
            .map(|v| v >= aya::util::KernelVersion::new(6, 6, 0))
            .unwrap_or(false);
        if !tcx {
            match tc::qdisc_add_clsact(iface) {
                Ok(()) | Err(tc::TcError::AlreadyAttached) => {}
                Err(tc::TcError::NetlinkError(e)) if e.to_string().contains("File exists") => {}
                Err(source) => {
                    return Err(DataPlaneError::Qdisc {
                        iface: iface.to_owned(),
                        source,
                    });
                }
            }
        }
        for (name, direction) in [
            ("ferry_egress", TcAttachType::Egress),
            ("ferry_ingress", TcAttachType::Ingress),
        ] {
            let prog: &mut SchedClassifier = ebpf
                .program_mut(name)
                .ok_or(DataPlaneError::Missing(name))?
                .try_into()
                .map_err(|source| DataPlaneError::Program { name, source })?;
            prog.load()
                .map_err(|source| DataPlaneError::Program { name, source })?;
            prog.attach(iface, direction)
                .map_err(|source| DataPlaneError::Program { name, source })?;
        }
        let ports = HashMap::try_from(
            ebpf.take_map(PORTS_MAP)
                .ok_or(DataPlaneError::Missing(PORTS_MAP))?,
        )
        .map_err(|source| DataPlaneError::Map {
            name: PORTS_MAP,
            source,
        })?;
        let counters = PerCpuArray::try_from(
            ebpf.take_map(COUNTERS_MAP)
                .ok_or(DataPlaneError::Missing(COUNTERS_MAP))?,
        )
        .map_err(|source| DataPlaneError::Map {
            name: COUNTERS_MAP,
            source,
        })?;
        tracing::debug!(iface, "ownership filter attached");
        Ok(Self {
            _ebpf: ebpf,
            ports,
            counters,
            iface: iface.to_owned(),
        })
    }

    fn map_err(source: aya::maps::MapError) -> DataPlaneError {
        DataPlaneError::Map {
            name: PORTS_MAP,
            source,
        }
    }

    fn flags(&self, k: &PortKey) -> Result<u32, DataPlaneError> {
        match self.ports.get(k, 0) {
            Ok(f) => Ok(f),
            Err(aya::maps::MapError::KeyNotFound) => Ok(0),
            Err(e) => Err(Self::map_err(e)),
        }
    }

    /// Starts delivering packets for the port to this node (keeps a freeze).
    pub fn own(&mut self, proto: Protocol, port: u16) -> Result<(), DataPlaneError> {
        let k = key(proto, port);
        let flags = self.flags(&k)? | maps::PORT_OWNED;
        self.ports.insert(k, flags, 0).map_err(Self::map_err)
    }

    /// Stops delivering packets for the port: another node owns it now.
    pub fn disown(&mut self, proto: Protocol, port: u16) -> Result<(), DataPlaneError> {
        match self.ports.remove(&key(proto, port)) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(Self::map_err(e)),
        }
    }

    /// Drops every packet to or from these ports until [`thaw`](Self::thaw).
    pub fn freeze(&mut self, ports: &[(Protocol, u16)]) -> Result<(), DataPlaneError> {
        for &(proto, port) in ports {
            let k = key(proto, port);
            let flags = self.flags(&k)? | maps::PORT_FROZEN;
            self.ports.insert(k, flags, 0).map_err(Self::map_err)?;
        }
        Ok(())
    }

    /// Lifts a freeze; owned ports deliver again.
    pub fn thaw(&mut self, ports: &[(Protocol, u16)]) -> Result<(), DataPlaneError> {
        for &(proto, port) in ports {
            let k = key(proto, port);
            let flags = self.flags(&k)? & !maps::PORT_FROZEN;
            if flags == 0 {
                self.disown(proto, port)?;
            } else {
                self.ports.insert(k, flags, 0).map_err(Self::map_err)?;
            }
        }
        Ok(())
    }

    /// Every port in the map with its state.
    pub fn ports(&self) -> Result<Vec<(Protocol, u16, PortState)>, DataPlaneError> {
        let mut out = Vec::new();
        for item in self.ports.iter() {
            let (k, flags) = item.map_err(Self::map_err)?;
            let Some(proto) = Protocol::from_ip_proto(k.proto) else {
                continue;
            };
            let state = if flags & maps::PORT_FROZEN != 0 {
                PortState::Frozen
            } else {
                PortState::Owned
            };
            out.push((proto, k.port, state));
        }
        out.sort_by_key(|(p, port, _)| (*p, *port));
        Ok(out)
    }

    pub fn counters(&self) -> Result<Counters, DataPlaneError> {
        let get = |i: u32| -> Result<u64, DataPlaneError> {
            let v = self
                .counters
                .get(&i, 0)
                .map_err(|source| DataPlaneError::Map {
                    name: COUNTERS_MAP,
                    source,
                })?;
            Ok(v.iter().sum())
        };
        Ok(Counters {
            passed: get(maps::CNT_PASSED)?,
            dropped_not_owned: get(maps::CNT_DROPPED_NOT_OWNED)?,
            dropped_frozen: get(maps::CNT_DROPPED_FROZEN)?,
            passed_other: get(maps::CNT_PASSED_OTHER)?,
            egress_blocked: get(maps::CNT_EGRESS_BLOCKED)?,
        })
    }
}
