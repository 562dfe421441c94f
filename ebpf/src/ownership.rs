//! The port ownership filter: `ferry_ingress` and `ferry_egress` from
//! c/ownership.bpf.c on the node's public interface, and the map that says
//! which ports this node owns.

use aya::maps::{HashMap, MapData, MapError, PerCpuArray};
use aya::programs::{SchedClassifier, TcAttachType, tc};
use aya::util::KernelVersion;
use aya::{Ebpf, include_bytes_aligned};

use crate::DataPlaneError;
use crate::maps::{self, PortKey};

static OBJECT: &[u8] = include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ownership.bpf.o"));

const PORTS_MAP: &str = "FERRY_PORTS";
const COUNTERS_MAP: &str = "FERRY_COUNTERS";
const INGRESS: &str = "ferry_ingress";
const EGRESS: &str = "ferry_egress";

/// Transport protocol of a port on the public address.
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

/// State of a port in the filter. Ports not listed belong to other nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    /// Delivered to this node's stack.
    Owned,
    /// Every packet to or from the port is dropped (a migration is dumping
    /// the process); it stays owned, or becomes nothing, when thawed.
    Frozen,
}

/// Packet counts of the filter, summed over CPUs, since attach.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Ingress to owned ports, delivered to this node's stack.
    pub passed: u64,
    /// Ingress to ports this node does not own (or without readable
    /// ports), dropped.
    pub dropped_not_owned: u64,
    /// Ingress to frozen ports, dropped.
    pub dropped_frozen: u64,
    /// Ingress without ports (ARP, ICMP, IPv6, later IPv4 fragments),
    /// passed.
    pub passed_other: u64,
    /// Egress from frozen ports (RSTs or data), dropped.
    pub egress_blocked: u64,
}

/// The ownership filter attached to one interface. Nothing is owned after
/// [`attach`](Self::attach); dropping the filter detaches both programs.
pub struct OwnershipFilter {
    // Owns the programs and their links: dropping it detaches them.
    _ebpf: Ebpf,
    ports: HashMap<MapData, PortKey, u32>,
    counters: PerCpuArray<MapData, u64>,
    iface: String,
}

// The agent keeps the filter in a Mutex shared by its blocking tasks.
const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<OwnershipFilter>();
};

impl std::fmt::Debug for OwnershipFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnershipFilter")
            .field("iface", &self.iface)
            .finish_non_exhaustive()
    }
}

fn key(proto: Protocol, port: u16) -> PortKey {
    PortKey {
        proto: proto.ip_proto(),
        pad: 0,
        port,
    }
}

fn ports_err(source: MapError) -> DataPlaneError {
    DataPlaneError::Map {
        name: PORTS_MAP,
        source,
    }
}

fn counters_err(source: MapError) -> DataPlaneError {
    DataPlaneError::Map {
        name: COUNTERS_MAP,
        source,
    }
}

impl OwnershipFilter {
    /// Loads the programs and attaches them at tc ingress and egress of
    /// `iface`, looked up in the calling thread's network namespace. From
    /// here on the node drops all TCP and UDP on `iface` until it
    /// [`own`](Self::own)s ports.
    ///
    /// From Linux 6.6 the programs are tcx links, which need no qdisc and
    /// go away with the file descriptors, so a crashed agent leaves nothing
    /// behind. Older kernels attach through the clsact qdisc, added here if
    /// missing and left in place on drop (empty, harmless; aya has no call
    /// to delete a qdisc).
    pub fn attach(iface: &str) -> Result<Self, DataPlaneError> {
        let mut ebpf = Ebpf::load(OBJECT)?;
        // The same test aya makes to choose tcx (an unknown version means
        // netlink there too).
        let tcx = KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0));
        if !tcx {
            match tc::qdisc_add_clsact(iface) {
                Ok(()) => tracing::debug!(iface, "clsact qdisc added"),
                Err(tc::TcError::AlreadyAttached) => {}
                Err(tc::TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
                Err(source) => {
                    return Err(DataPlaneError::Qdisc {
                        iface: iface.to_owned(),
                        source,
                    });
                }
            }
        }
        // The map starts empty, so from the ingress attach on every TCP and
        // UDP packet is dropped until the agent owns ports.
        for (name, direction) in [
            (EGRESS, TcAttachType::Egress),
            (INGRESS, TcAttachType::Ingress),
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
        let ports = ebpf
            .take_map(PORTS_MAP)
            .ok_or(DataPlaneError::Missing(PORTS_MAP))?;
        let ports = HashMap::try_from(ports).map_err(ports_err)?;
        let counters = ebpf
            .take_map(COUNTERS_MAP)
            .ok_or(DataPlaneError::Missing(COUNTERS_MAP))?;
        let counters = PerCpuArray::try_from(counters).map_err(counters_err)?;
        tracing::info!(iface, "ownership filter attached");
        Ok(Self {
            _ebpf: ebpf,
            ports,
            counters,
            iface: iface.to_owned(),
        })
    }

    /// The interface the filter is attached to.
    pub fn iface(&self) -> &str {
        &self.iface
    }

    fn flags(&self, k: &PortKey) -> Result<u32, DataPlaneError> {
        match self.ports.get(k, 0) {
            Ok(f) => Ok(f),
            Err(MapError::KeyNotFound) => Ok(0),
            Err(e) => Err(ports_err(e)),
        }
    }

    fn set_flags(&mut self, k: PortKey, flags: u32) -> Result<(), DataPlaneError> {
        if flags == 0 {
            match self.ports.remove(&k) {
                Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
                Err(e) => Err(ports_err(e)),
            }
        } else {
            self.ports.insert(k, flags, 0).map_err(ports_err)
        }
    }

    /// Starts delivering the port's packets to this node. A freeze stays.
    pub fn own(&mut self, proto: Protocol, port: u16) -> Result<(), DataPlaneError> {
        let k = key(proto, port);
        let flags = self.flags(&k)? | maps::PORT_OWNED;
        self.set_flags(k, flags)?;
        tracing::debug!(iface = %self.iface, ?proto, port, "port owned");
        Ok(())
    }

    /// Stops delivering the port's packets: another node owns it now.
    /// Clears a freeze too. Not owning the port is no error.
    pub fn disown(&mut self, proto: Protocol, port: u16) -> Result<(), DataPlaneError> {
        self.set_flags(key(proto, port), 0)?;
        tracing::debug!(iface = %self.iface, ?proto, port, "port disowned");
        Ok(())
    }

    /// Drops every packet to or from these ports until
    /// [`thaw`](Self::thaw); owned ports stay owned.
    pub fn freeze(&mut self, ports: &[(Protocol, u16)]) -> Result<(), DataPlaneError> {
        for &(proto, port) in ports {
            let k = key(proto, port);
            let flags = self.flags(&k)? | maps::PORT_FROZEN;
            self.set_flags(k, flags)?;
        }
        tracing::debug!(iface = %self.iface, ?ports, "ports frozen");
        Ok(())
    }

    /// Lifts a freeze: owned ports deliver again, the others are dropped as
    /// before.
    pub fn thaw(&mut self, ports: &[(Protocol, u16)]) -> Result<(), DataPlaneError> {
        for &(proto, port) in ports {
            let k = key(proto, port);
            let flags = self.flags(&k)? & !maps::PORT_FROZEN;
            self.set_flags(k, flags)?;
        }
        tracing::debug!(iface = %self.iface, ?ports, "ports thawed");
        Ok(())
    }

    /// Every port this node owns or has frozen, sorted.
    pub fn ports(&self) -> Result<Vec<(Protocol, u16, PortState)>, DataPlaneError> {
        let mut out = Vec::new();
        for item in self.ports.iter() {
            let (k, flags) = item.map_err(ports_err)?;
            // Only this crate writes the map, always with TCP or UDP.
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
        out.sort_by_key(|&(proto, port, _)| (proto, port));
        Ok(out)
    }

    /// The packet counters, summed over CPUs.
    pub fn counters(&self) -> Result<Counters, DataPlaneError> {
        let get = |i: u32| -> Result<u64, DataPlaneError> {
            let per_cpu = self.counters.get(&i, 0).map_err(counters_err)?;
            Ok(per_cpu.iter().sum())
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

impl Drop for OwnershipFilter {
    fn drop(&mut self) {
        // `_ebpf` drops right after this and closes the links, which
        // detaches both programs: from then on this node filters nothing.
        tracing::info!(iface = %self.iface, "ownership filter detached");
    }
}
