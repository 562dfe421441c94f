//! The port ownership filter: `ferry_ingress` and `ferry_egress` from
//! c/ownership.bpf.c on the node's public interface, and the map that says
//! which ports this node owns.
//!
//! Attached with [`OwnershipFilter::attach`] it lives as long as the
//! object. With [`OwnershipFilter::attach_pinned`] its maps and links are
//! pinned (see [`crate::pin`]) and outlive the agent: a restarted ferryd
//! finds the same port states, unread capture records and counters, and
//! swaps its programs into the attached links without a moment in which
//! the interface is unfiltered.

use std::path::{Path, PathBuf};

use aya::maps::{HashMap, MapData, MapError, MapType, PerCpuArray, RingBuf};
use aya::programs::links::FdLink;
use aya::programs::tc::SchedClassifierLink;
use aya::programs::{SchedClassifier, TcAttachType, tc};
use aya::util::KernelVersion;
use aya::{Ebpf, include_bytes_aligned};

use crate::DataPlaneError;
use crate::error::prog_err;
use crate::maps::{self, Flow6Key, FlowKey, PortKey};
use crate::pin::{MapSpec, PinDir};

static OBJECT: &[u8] = include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ownership.bpf.o"));

const PORTS_MAP: &str = "FERRY_PORTS";
const COUNTERS_MAP: &str = "FERRY_COUNTERS";
const CAPTURE_MAP: &str = "FERRY_CAPTURE";
const FRAGS_MAP: &str = "FERRY_FRAGS";
const FLOWS_MAP: &str = "FERRY_FLOWS";
const FRAGS6_MAP: &str = "FERRY_FRAGS6";
const FLOWS6_MAP: &str = "FERRY_FLOWS6";
const INGRESS: &str = "ferry_ingress";
const EGRESS: &str = "ferry_egress";

/// The programs and where they attach. Egress first: the guard that keeps
/// a frozen port silent is in place before anything is let in.
const PROGRAMS: [(&str, TcAttachType); 2] = [
    (EGRESS, TcAttachType::Egress),
    (INGRESS, TcAttachType::Ingress),
];

// The sizes of c/ownership.bpf.c's map definitions.
/// `FERRY_PORTS`' max_entries.
const PORTS_MAX: u32 = 65536;
/// `FERRY_COUNTERS`' max_entries, `FERRY_CNT_MAX`.
const CNT_MAX: u32 = 8;
const _: () = assert!(CNT_MAX == maps::CNT_RECORDED + 1);
/// `FERRY_CAPTURE`'s size in bytes (its max_entries).
const CAPTURE_BYTES: u32 = 32 << 20;
/// `struct ferry_frag_key`: saddr, daddr, id, proto, pad.
const FRAG_KEY_SIZE: u32 = 4 + 4 + 2 + 1 + 1;
/// `struct ferry_frag6_key`: saddr, daddr, id, proto, pad.
const FRAG6_KEY_SIZE: u32 = 16 + 16 + 4 + 1 + 3;
/// `FERRY_FRAGS`' and `FERRY_FRAGS6`' value, the datagram's port (`__u16`).
const FRAG_VALUE_SIZE: u32 = 2;
/// `FERRY_FRAGS`' max_entries.
const FRAGS_MAX: u32 = 4096;
/// `FERRY_FLOWS`' max_entries.
const FLOWS_MAX: u32 = 65536;

/// Every map of the object, as c/ownership.bpf.c defines it: all are
/// pinned, so that programs swapped into the links find the same port
/// states, capture records (the ring keeps its producer and consumer
/// positions), fragments in flight and counters. These sizes are the only
/// layout check a pin gets: a change in what a map's bytes mean must
/// change one of them.
static MAP_SPECS: [MapSpec; 7] = [
    MapSpec {
        name: PORTS_MAP,
        map_type: MapType::Hash,
        key_size: size_of::<PortKey>() as u32,
        value_size: 4,
        max_entries: PORTS_MAX,
    },
    MapSpec {
        name: COUNTERS_MAP,
        map_type: MapType::PerCpuArray,
        key_size: 4,
        value_size: 8,
        max_entries: CNT_MAX,
    },
    MapSpec {
        name: CAPTURE_MAP,
        map_type: MapType::RingBuf,
        key_size: 0,
        value_size: 0,
        max_entries: CAPTURE_BYTES,
    },
    MapSpec {
        name: FRAGS_MAP,
        map_type: MapType::LruHash,
        key_size: FRAG_KEY_SIZE,
        value_size: FRAG_VALUE_SIZE,
        max_entries: FRAGS_MAX,
    },
    MapSpec {
        name: FLOWS_MAP,
        map_type: MapType::Hash,
        key_size: size_of::<FlowKey>() as u32,
        value_size: 4,
        max_entries: FLOWS_MAX,
    },
    // IPv6's maps are maps of their own: the four above keep the layout
    // an earlier ferryd pinned, so an upgrade swaps the programs in place.
    MapSpec {
        name: FRAGS6_MAP,
        map_type: MapType::LruHash,
        key_size: FRAG6_KEY_SIZE,
        value_size: FRAG_VALUE_SIZE,
        max_entries: FRAGS_MAX,
    },
    MapSpec {
        name: FLOWS6_MAP,
        map_type: MapType::Hash,
        key_size: size_of::<Flow6Key>() as u32,
        value_size: 4,
        max_entries: FLOWS_MAX,
    },
];

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
/// Along a migration the source goes `Owned -> Recording -> Armed -> Capturing ->`
/// (gone, or on abort `Releasing -> Owned`) and the destination
/// `Frozen -> Capturing -> Releasing -> Owned`; see
/// include/ferry_dataplane.h for what each does to packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortState {
    /// Delivered to this node's stack.
    Owned,
    /// Delivered, and a copy logged in the capture ring as delivered.
    Recording,
    /// As `Recording`, but a TCP SYN is not delivered: no new connection
    /// starts here (the destination, capturing, replays the SYN).
    Armed,
    /// Every packet to or from the port is dropped.
    Frozen,
    /// Incoming packets are kept in the capture ring (and dropped);
    /// nothing goes out.
    Capturing,
    /// Incoming packets are kept in the capture ring; outgoing ones pass.
    Releasing,
    /// A distributed server's port, on its contact node: new connections
    /// and the connections not listed in the flow table are delivered
    /// here; a listed one goes by its [`FlowState`].
    SharedContact,
    /// A distributed server's port, on a member that is not the contact
    /// node: only connections listed here as [`FlowState::Owned`] (or
    /// capturing, releasing) are taken; everything else is dropped.
    SharedMember,
}

impl PortState {
    fn flags(self) -> u32 {
        match self {
            PortState::Owned => maps::PORT_OWNED,
            PortState::Recording => maps::PORT_OWNED | maps::PORT_RECORD,
            PortState::Armed => maps::PORT_OWNED | maps::PORT_RECORD | maps::PORT_HOLD_NEW,
            PortState::Frozen => maps::PORT_FROZEN,
            PortState::Capturing => maps::PORT_FROZEN | maps::PORT_CAPTURE,
            PortState::Releasing => maps::PORT_OWNED | maps::PORT_CAPTURE,
            PortState::SharedContact => maps::PORT_OWNED | maps::PORT_SHARED,
            PortState::SharedMember => maps::PORT_SHARED,
        }
    }

    fn from_flags(flags: u32) -> Option<Self> {
        [
            PortState::Owned,
            PortState::Recording,
            PortState::Armed,
            PortState::Frozen,
            PortState::Capturing,
            PortState::Releasing,
            PortState::SharedContact,
            PortState::SharedMember,
        ]
        .into_iter()
        .find(|s| s.flags() == flags)
    }
}

/// One TCP connection of a shared port, as this node's filter knows it:
/// the client's end and the port it connected to. An IPv4 client seen
/// through a dual-stack socket (`::ffff:a.b.c.d`) is the IPv4 client its
/// packets come from: build flows with [`Flow::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Flow {
    pub remote: std::net::SocketAddr,
    pub local_port: u16,
}

impl std::fmt::Display for Flow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} -> :{}", self.remote, self.local_port)
    }
}

/// A flow's key in its family's map.
enum AnyFlowKey {
    V4(FlowKey),
    V6(Flow6Key),
}

impl Flow {
    /// The connection of `remote` to `local_port`, an IPv4-mapped IPv6
    /// address taken as the IPv4 address it maps.
    pub fn new(remote: std::net::SocketAddr, local_port: u16) -> Self {
        Self {
            remote: std::net::SocketAddr::new(remote.ip().to_canonical(), remote.port()),
            local_port,
        }
    }

    fn key(self) -> AnyFlowKey {
        match self.remote.ip().to_canonical() {
            std::net::IpAddr::V4(ip) => AnyFlowKey::V4(FlowKey {
                remote_addr: ip.octets(),
                remote_port: self.remote.port(),
                local_port: self.local_port,
            }),
            std::net::IpAddr::V6(ip) => AnyFlowKey::V6(Flow6Key {
                remote_addr: ip.octets(),
                remote_port: self.remote.port(),
                local_port: self.local_port,
            }),
        }
    }

    fn from_key(k: FlowKey) -> Self {
        Self {
            remote: (std::net::Ipv4Addr::from(k.remote_addr), k.remote_port).into(),
            local_port: k.local_port,
        }
    }

    fn from_key6(k: Flow6Key) -> Self {
        Self {
            remote: (std::net::Ipv6Addr::from(k.remote_addr), k.remote_port).into(),
            local_port: k.local_port,
        }
    }
}

/// How this node's filter treats one connection of a shared port: the
/// per-connection ownership of a distributed server, beside the per-port
/// [`PortState`]. Exactly one node has a connection `Owned` (or
/// `Releasing`); along a handoff the donor goes `Owned -> Capturing ->
/// Elsewhere` (on abort `Releasing -> Owned`) and the acceptor
/// `(none) -> Capturing -> Releasing -> Owned`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlowState {
    /// Delivered to this node's stack.
    Owned,
    /// Another node serves it: dropped both ways, never answered (no RST
    /// from a node whose stack has no such connection).
    Elsewhere,
    /// Incoming packets are kept in the capture ring; nothing goes out.
    Capturing,
    /// Incoming packets are kept in the capture ring; outgoing ones pass
    /// (the captured ones are being replayed).
    Releasing,
}

impl FlowState {
    fn flags(self) -> u32 {
        match self {
            FlowState::Owned => maps::PORT_OWNED,
            FlowState::Elsewhere => maps::PORT_FROZEN,
            FlowState::Capturing => maps::PORT_FROZEN | maps::PORT_CAPTURE,
            FlowState::Releasing => maps::PORT_OWNED | maps::PORT_CAPTURE,
        }
    }

    fn from_flags(flags: u32) -> Option<Self> {
        [
            FlowState::Owned,
            FlowState::Elsewhere,
            FlowState::Capturing,
            FlowState::Releasing,
        ]
        .into_iter()
        .find(|s| s.flags() == flags)
    }
}

/// Packet counts of the filter, summed over CPUs, since attach (pinned:
/// since the counters map was created, across agent restarts).
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
    /// The IP packet, header included: IPv4 or IPv6 (its first byte's
    /// version field tells).
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
/// [`attach`](Self::attach); dropping the filter detaches both programs,
/// unless it was attached with [`attach_pinned`](Self::attach_pinned).
pub struct OwnershipFilter {
    // Unpinned: owns the programs and their links, and dropping it detaches
    // them. Pinned: only descriptors; the pins keep everything attached.
    _ebpf: Ebpf,
    ports: HashMap<MapData, PortKey, u32>,
    flows: HashMap<MapData, FlowKey, u32>,
    flows6: HashMap<MapData, Flow6Key, u32>,
    counters: PerCpuArray<MapData, u64>,
    capture: RingBuf<MapData>,
    iface: String,
    pins: Option<PathBuf>,
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
            .field("pins", &self.pins)
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

fn flows_err(source: MapError) -> DataPlaneError {
    DataPlaneError::Map {
        name: FLOWS_MAP,
        source,
    }
}

fn flows6_err(source: MapError) -> DataPlaneError {
    DataPlaneError::Map {
        name: FLOWS6_MAP,
        source,
    }
}

fn counters_err(source: MapError) -> DataPlaneError {
    DataPlaneError::Map {
        name: COUNTERS_MAP,
        source,
    }
}

fn link_err(name: &'static str) -> impl Fn(aya::programs::links::LinkError) -> DataPlaneError {
    move |source| DataPlaneError::Link { name, source }
}

/// Loads (verifies) program `name` of `ebpf` into the kernel.
fn load_program(ebpf: &mut Ebpf, name: &'static str) -> Result<(), DataPlaneError> {
    program(ebpf, name)?.load().map_err(prog_err(name))
}

fn program<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut SchedClassifier, DataPlaneError> {
    crate::object::program(ebpf, name)
}

/// Whether `link` still attaches a program at `direction` of `iface` (in
/// the calling thread's network namespace). A link whose device went away
/// is defunct, and one pinned for another interface is not ours to reuse.
fn link_attached(
    link: &FdLink,
    name: &'static str,
    iface: &str,
    direction: TcAttachType,
) -> Result<bool, DataPlaneError> {
    let info = link.info().map_err(link_err(name))?;
    let (_, progs) = SchedClassifier::query_tcx(iface, direction).map_err(prog_err(name))?;
    Ok(progs.iter().any(|p| p.id() == info.program_id()))
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
        for (name, direction) in PROGRAMS {
            load_program(&mut ebpf, name)?;
            program(&mut ebpf, name)?
                .attach(iface, direction)
                .map_err(prog_err(name))?;
        }
        tracing::info!(iface, "ownership filter attached");
        Self::new(ebpf, iface, None)
    }

    /// Like [`attach`](Self::attach), but the maps and links are pinned in
    /// `pins` and outlive this object: dropping it (ferryd exiting,
    /// crashing) leaves the filter attached, with its port states, and it
    /// goes on filtering and capturing.
    ///
    /// When the same call finds the pins (ferryd restarting), it reuses
    /// them: the maps are reopened as they are (ports, unread capture
    /// records, fragments in flight, counters), this build's programs are
    /// loaded, and each is swapped into its pinned link atomically
    /// (BPF_LINK_UPDATE): the old program runs until the new one replaces
    /// it in the same slot, so no packet passes unfiltered and the
    /// interface is never without the filter. Missing pieces (a first
    /// start; a link whose interface was recreated, or that was pinned for
    /// another interface) are created and pinned; a first start owns
    /// nothing, as [`attach`](Self::attach). A map pinned with another
    /// layout than this build's is refused
    /// ([`PinError::Mismatch`](crate::pin::PinError::Mismatch), naming the
    /// map and both layouts) before anything is loaded or attached.
    ///
    /// [`unpin`](Self::unpin) detaches and removes it all. Needs tcx links
    /// (Linux 6.6+): the clsact filters of older kernels cannot be pinned.
    pub fn attach_pinned(iface: &str, pins: &PinDir) -> Result<Self, DataPlaneError> {
        let mut ebpf = pins.loader(&MAP_SPECS)?.load(OBJECT)?;
        // Both programs pass the verifier before either link changes: a
        // build whose programs do not load leaves the running ones alone.
        for (name, _) in PROGRAMS {
            load_program(&mut ebpf, name)?;
        }
        for (name, direction) in PROGRAMS {
            let prog = program(&mut ebpf, name)?;
            let old = match pins.open_link(name)? {
                Some(link) if link_attached(&link, name, iface, direction)? => Some(link),
                Some(_) => {
                    tracing::info!(iface, program = name, "pinned link is stale, replacing it");
                    pins.remove_link(name)?;
                    None
                }
                None => None,
            };
            if let Some(link) = old {
                let link = SchedClassifierLink::try_from(link).map_err(link_err(name))?;
                // BPF_LINK_UPDATE: the link, its pin and its place among
                // the interface's programs stay; only the program changes,
                // in one step.
                let id = prog.attach_to_link(link).map_err(prog_err(name))?;
                // Our descriptor of it is not needed: the pin holds the
                // link (closing a descriptor detaches nothing pinned).
                drop(prog.take_link(id).map_err(prog_err(name))?);
                tracing::debug!(iface, program = name, "pinned link reused");
            } else {
                let id = prog.attach(iface, direction).map_err(prog_err(name))?;
                let link: FdLink = prog
                    .take_link(id)
                    .map_err(prog_err(name))?
                    .try_into()
                    .map_err(link_err(name))?;
                pins.pin_link(name, link)?;
                tracing::debug!(iface, program = name, "link attached and pinned");
            }
        }
        tracing::info!(iface, pins = %pins.path().display(), "ownership filter attached (pinned)");
        Self::new(ebpf, iface, Some(pins.path().to_owned()))
    }

    /// Detaches the programs pinned in `pins` and removes every pin: from
    /// then on the interface is unfiltered, and the port states, unread
    /// capture records and counters are gone. A filter object still open
    /// on them keeps readable maps but filters nothing. No pins is no
    /// error.
    pub fn unpin(pins: &PinDir) -> Result<(), DataPlaneError> {
        pins.remove()?;
        Ok(())
    }

    fn new(mut ebpf: Ebpf, iface: &str, pins: Option<PathBuf>) -> Result<Self, DataPlaneError> {
        let mut take =
            |name: &'static str| ebpf.take_map(name).ok_or(DataPlaneError::Missing(name));
        let ports = HashMap::try_from(take(PORTS_MAP)?).map_err(ports_err)?;
        let flows = HashMap::try_from(take(FLOWS_MAP)?).map_err(flows_err)?;
        let flows6 = HashMap::try_from(take(FLOWS6_MAP)?).map_err(flows6_err)?;
        let counters = PerCpuArray::try_from(take(COUNTERS_MAP)?).map_err(counters_err)?;
        // A reopened ring is mapped afresh: its consumer position lives in
        // the kernel's consumer page, so this reader starts at the first
        // record no earlier one consumed.
        let capture =
            RingBuf::try_from(take(CAPTURE_MAP)?).map_err(|source| DataPlaneError::Map {
                name: CAPTURE_MAP,
                source,
            })?;
        Ok(Self {
            _ebpf: ebpf,
            ports,
            flows,
            flows6,
            counters,
            capture,
            iface: iface.to_owned(),
            pins,
        })
    }

    /// The interface the filter is attached to.
    pub fn iface(&self) -> &str {
        &self.iface
    }

    /// The pin directory, if attached with [`attach_pinned`](Self::attach_pinned).
    pub fn pin_dir(&self) -> Option<&Path> {
        self.pins.as_deref()
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

    /// Puts one connection of a shared port in `state` (see [`FlowState`]).
    pub fn set_flow(&mut self, flow: Flow, state: FlowState) -> Result<(), DataPlaneError> {
        match flow.key() {
            AnyFlowKey::V4(k) => self.flows.insert(k, state.flags(), 0).map_err(flows_err)?,
            AnyFlowKey::V6(k) => self
                .flows6
                .insert(k, state.flags(), 0)
                .map_err(flows6_err)?,
        }
        tracing::debug!(iface = %self.iface, %flow, ?state, "connection state");
        Ok(())
    }

    /// Forgets one connection: its port's state decides it again. Not
    /// knowing it is no error.
    pub fn remove_flow(&mut self, flow: Flow) -> Result<(), DataPlaneError> {
        let removed = match flow.key() {
            AnyFlowKey::V4(k) => self.flows.remove(&k).map_err(|e| (e, FLOWS_MAP)),
            AnyFlowKey::V6(k) => self.flows6.remove(&k).map_err(|e| (e, FLOWS6_MAP)),
        };
        match removed {
            Ok(()) | Err((MapError::KeyNotFound, _)) => {}
            Err((source, name)) => return Err(DataPlaneError::Map { name, source }),
        }
        tracing::debug!(iface = %self.iface, %flow, "connection forgotten");
        Ok(())
    }

    /// How the filter treats one connection of a shared port (None: by its
    /// port): one map lookup.
    pub fn flow(&self, flow: Flow) -> Result<Option<FlowState>, DataPlaneError> {
        let found = match flow.key() {
            AnyFlowKey::V4(k) => self.flows.get(&k, 0).map_err(|e| (e, FLOWS_MAP)),
            AnyFlowKey::V6(k) => self.flows6.get(&k, 0).map_err(|e| (e, FLOWS6_MAP)),
        };
        match found {
            Ok(flags) => Ok(FlowState::from_flags(flags)),
            Err((MapError::KeyNotFound, _)) => Ok(None),
            Err((source, name)) => Err(DataPlaneError::Map { name, source }),
        }
    }

    /// Every connection this node's filter decides one by one, sorted.
    pub fn flows(&self) -> Result<Vec<(Flow, FlowState)>, DataPlaneError> {
        let mut out = Vec::new();
        for item in self.flows.iter() {
            let (k, flags) = item.map_err(flows_err)?;
            if let Some(state) = FlowState::from_flags(flags) {
                out.push((Flow::from_key(k), state));
            }
        }
        for item in self.flows6.iter() {
            let (k, flags) = item.map_err(flows6_err)?;
            if let Some(state) = FlowState::from_flags(flags) {
                out.push((Flow::from_key6(k), state));
            }
        }
        out.sort_by_key(|&(f, _)| f);
        Ok(out)
    }

    /// Takes every record out of the capture ring, oldest first, and
    /// hands it to `f`. Never blocks; records this program cannot have
    /// written are skipped (and counted in the return value's second half).
    /// On a pinned filter this includes what was captured while no agent
    /// ran, and what an earlier agent left undrained.
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
        match &self.pins {
            Some(p) => tracing::info!(
                iface = %self.iface,
                pins = %p.display(),
                "ownership filter closed, stays attached"
            ),
            // `_ebpf` drops right after this and closes the links, which
            // detaches both programs: from then on this node filters
            // nothing.
            None => tracing::info!(iface = %self.iface, "ownership filter detached"),
        }
    }
}
