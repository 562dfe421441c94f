//! The port ownership filter: `ferry_ingress` and `ferry_egress` from
//! c/ownership.bpf.c on the node's public interface, and the map that says
//! which ports this node owns.

use aya::maps::{HashMap, MapData, MapError, PerCpuArray, RingBuf};
use aya::programs::{SchedClassifier, TcAttachType, tc};
use aya::util::KernelVersion;
use aya::{Ebpf, include_bytes_aligned};

use crate::DataPlaneError;
use crate::maps::{self, PortKey};

static OBJECT: &[u8] = include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ownership.bpf.o"));

const PORTS_MAP: &str = "FERRY_PORTS";
const COUNTERS_MAP: &str = "FERRY_COUNTERS";
const CAPTURE_MAP: &str = "FERRY_CAPTURE";
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
/// Along a migration the source goes `Owned -> Recording -> Capturing ->`
/// (gone, or on abort `Releasing -> Owned`) and the destination
/// `Frozen -> Capturing -> Releasing -> Owned`; see
/// include/ferry_dataplane.h for what each does to packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortState {
    /// Delivered to this node's stack.
    Owned,
    /// Delivered, and a copy logged in the capture ring as delivered.
    Recording,
    /// Every packet to or from the port is dropped.
    Frozen,
    /// Incoming packets are kept in the capture ring (and dropped);
    /// nothing goes out.
    Capturing,
    /// Incoming packets are kept in the capture ring; outgoing ones pass.
    Releasing,
}

impl PortState {
    fn flags(self) -> u32 {
        match self {
            PortState::Owned => maps::PORT_OWNED,
            PortState::Recording => maps::PORT_OWNED | maps::PORT_RECORD,
            PortState::Frozen => maps::PORT_FROZEN,
            PortState::Capturing => maps::PORT_FROZEN | maps::PORT_CAPTURE,
            PortState::Releasing => maps::PORT_OWNED | maps::PORT_CAPTURE,
        }
    }

    fn from_flags(flags: u32) -> Option<Self> {
        [
            PortState::Owned,
            PortState::Recording,
            PortState::Frozen,
            PortState::Capturing,
            PortState::Releasing,
        ]
        .into_iter()
        .find(|s| s.flags() == flags)
    }
}

/// Packet counts of the filter, summed over CPUs, since attach.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Ingress to owned ports, delivered to this node's stack.
    pub passed: u64,
    /// Ingress to ports this node does not own (or without readable
    /// ports), dropped.
    pub dropped_not_owned: u64,
    /// Ingress to frozen ports, dropped without capture.
    pub dropped_frozen: u64,
    /// Ingress without ports (ARP, ICMP, IPv6, later IPv4 fragments),
    /// passed.
    pub passed_other: u64,
    /// Egress from frozen ports (RSTs or data), dropped.
    pub egress_blocked: u64,
    /// Ingress kept in the capture ring for a replay.
    pub captured: u64,
    /// Ingress to capture that did not fit in the ring, dropped.
    pub capture_lost: u64,
    /// Ingress delivered and logged as delivered.
    pub recorded: u64,
}

/// Why a packet is in the capture ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CaptureKind {
    /// Dropped on ingress; to be replayed into a stack.
    Captured,
    /// Delivered to this node's stack, logged (a `Recording` port).
    Delivered,
}

/// One packet out of the capture ring.
#[derive(Clone, PartialEq, Eq)]
pub struct CapturedPacket {
    pub kind: CaptureKind,
    pub protocol: Protocol,
    /// The local port the packet was for.
    pub port: u16,
    /// CLOCK_MONOTONIC at ingress.
    pub ktime_ns: u64,
    /// The IPv4 packet, header included.
    pub data: Vec<u8>,
}

impl std::fmt::Debug for CapturedPacket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedPacket")
            .field("kind", &self.kind)
            .field("protocol", &self.protocol)
            .field("port", &self.port)
            .field("len", &self.data.len())
            .finish()
    }
}

impl CapturedPacket {
    /// Decodes one ring record; None for a record this crate's program
    /// cannot have written (too short, unknown kind or protocol).
    fn from_record(rec: &[u8]) -> Option<Self> {
        let hdr = maps::CaptureHdr::parse(rec)?;
        let kind = match hdr.kind {
            maps::KIND_CAPTURED => CaptureKind::Captured,
            maps::KIND_DELIVERED => CaptureKind::Delivered,
            _ => return None,
        };
        let start = std::mem::size_of::<maps::CaptureHdr>();
        let data = rec.get(start..start + hdr.cap_len as usize)?.to_vec();
        Some(Self {
            kind,
            protocol: Protocol::from_ip_proto(hdr.proto)?,
            port: hdr.port,
            ktime_ns: hdr.ktime_ns,
            data,
        })
    }
}

/// The ownership filter attached to one interface. Nothing is owned after
/// [`attach`](Self::attach); dropping the filter detaches both programs.
pub struct OwnershipFilter {
    // Owns the programs and their links: dropping it detaches them.
    _ebpf: Ebpf,
    ports: HashMap<MapData, PortKey, u32>,
    counters: PerCpuArray<MapData, u64>,
    capture: RingBuf<MapData>,
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
        let capture = ebpf
            .take_map(CAPTURE_MAP)
            .ok_or(DataPlaneError::Missing(CAPTURE_MAP))?;
        let capture = RingBuf::try_from(capture).map_err(|source| DataPlaneError::Map {
            name: CAPTURE_MAP,
            source,
        })?;
        tracing::info!(iface, "ownership filter attached");
        Ok(Self {
            _ebpf: ebpf,
            ports,
            counters,
            capture,
            iface: iface.to_owned(),
        })
    }

    /// The interface the filter is attached to.
    pub fn iface(&self) -> &str {
        &self.iface
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

    /// Puts the port in `state` (see [`PortState`]).
    pub fn set(
        &mut self,
        proto: Protocol,
        port: u16,
        state: PortState,
    ) -> Result<(), DataPlaneError> {
        self.set_flags(key(proto, port), state.flags())?;
        tracing::debug!(iface = %self.iface, ?proto, port, ?state, "port state");
        Ok(())
    }

    /// Forgets the port: another node owns it. Not knowing it is no error.
    pub fn remove(&mut self, proto: Protocol, port: u16) -> Result<(), DataPlaneError> {
        self.set_flags(key(proto, port), 0)?;
        tracing::debug!(iface = %self.iface, ?proto, port, "port removed");
        Ok(())
    }

    /// Every port this node knows, sorted.
    pub fn ports(&self) -> Result<Vec<(Protocol, u16, PortState)>, DataPlaneError> {
        let mut out = Vec::new();
        for item in self.ports.iter() {
            let (k, flags) = item.map_err(ports_err)?;
            // Only this crate writes the map, always with TCP or UDP and
            // one of the states' flag sets.
            let (Some(proto), Some(state)) = (
                Protocol::from_ip_proto(k.proto),
                PortState::from_flags(flags),
            ) else {
                continue;
            };
            out.push((proto, k.port, state));
        }
        out.sort_by_key(|&(proto, port, _)| (proto, port));
        Ok(out)
    }

    /// Takes every record out of the capture ring, oldest first, and
    /// hands it to `f`. Never blocks; records this program cannot have
    /// written are skipped (and counted in the return value's second half).
    pub fn drain_captured(&mut self, mut f: impl FnMut(CapturedPacket)) -> (usize, usize) {
        let (mut taken, mut bad) = (0, 0);
        while let Some(item) = self.capture.next() {
            match CapturedPacket::from_record(&item) {
                Some(p) => {
                    taken += 1;
                    f(p)
                }
                None => bad += 1,
            }
        }
        (taken, bad)
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
            captured: get(maps::CNT_CAPTURED)?,
            capture_lost: get(maps::CNT_CAPTURE_LOST)?,
            recorded: get(maps::CNT_RECORDED)?,
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
