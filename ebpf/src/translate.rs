//! In-cluster address translation: `ferry_xlate_out` and `ferry_xlate_in`
//! from c/translate.bpf.c on the cluster interface of a migrated process's
//! PEER node, and the rules that tell them which flows to rewrite.
//!
//! When a process moves from node A1 to node A2, its sockets' local
//! address becomes A2; a peer on node A3 still has a socket connected to
//! A1. For each such flow the agent on A3 adds a [`TranslationRule`]; from
//! then on A3 sends the flow's packets to A2 and makes A2's answers look as
//! if they came from A1, so the peer's socket never notices the move.
//! See include/ferry_translate.h for what the programs do per packet.
//!
//! The other kind of rule, [`RuleAction::Hold`], is for A2's own
//! translator during the migration: A2 restores a socket whose local
//! address is A2's and whose peer is on A3, and until the migration
//! commits neither may anything of that flow leave A2 (the socket's
//! window probe, leaving repair mode, would reach A3 untranslated and be
//! answered with an RST) nor may A2's stack see its incoming packets
//! (before the socket exists the stack would answer them with an RST). A
//! hold rule drops the exact flow both ways and counts it until it is
//! removed; TCP's retransmissions then deliver what it held. Other flows,
//! also between the same two hosts, pass.
//!
//! The rules live in two maps the agent keeps in step: `FERRY_XL_RULES`
//! (the flow as the local socket sees it, for egress, with the action and
//! per-rule state) and `FERRY_XL_REV` (the flow as incoming packets carry
//! it, for ingress), and for an IPv6 cluster network in their twins
//! `FERRY_XL_RULES6` and `FERRY_XL_REV6` (`translate_table.rs` keeps
//! either pair; the programs fix IPv6's transport checksum by the
//! addresses' difference, as IPv6 has no header checksum).

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use aya::maps::{HashMap, MapData, MapType, PerCpuArray};
use aya::programs::links::FdLink;
use aya::programs::tc::{SchedClassifierLink, TcError};
use aya::programs::{SchedClassifier, TcAttachType, tc};
use aya::util::KernelVersion;
use aya::{Ebpf, include_bytes_aligned};

use crate::error::{map_err, prog_err};
use crate::pin::{MapSpec, PinDir};
use crate::translate_maps::{self as maps, Xlate6Key, Xlate6Rule, XlateKey, XlateRule};
use crate::translate_table::{Table, V4, V6};
use crate::{DataPlaneError, Protocol};

static OBJECT: &[u8] = include_bytes_aligned!(concat!(env!("OUT_DIR"), "/translate.bpf.o"));

const RULES_MAP: &str = "FERRY_XL_RULES";
const REV_MAP: &str = "FERRY_XL_REV";
const FRAGS_MAP: &str = "FERRY_XL_FRAGS";
const RULES6_MAP: &str = "FERRY_XL_RULES6";
const REV6_MAP: &str = "FERRY_XL_REV6";
const FRAGS6_MAP: &str = "FERRY_XL_FRAGS6";
const COUNTERS_MAP: &str = "FERRY_XL_COUNT";
const EGRESS: &str = "ferry_xlate_out";
const INGRESS: &str = "ferry_xlate_in";

/// The programs and where they attach. Egress first: from the ingress
/// attach on, answers are translated, and their requests must already be.
const PROGRAMS: [(&str, TcAttachType); 2] = [
    (EGRESS, TcAttachType::Egress),
    (INGRESS, TcAttachType::Ingress),
];

/// Every map of the object, as c/translate.bpf.c defines it: all are
/// pinned, so that a new program swapped into the links finds the same
/// rules, state, fragments in flight and counters. These sizes are the
/// only layout check a pin gets (there is no version number): a change in
/// what a map's bytes mean must change one of them. Hold rules did
/// (`FERRY_XL_FRAGS`' value 4 -> 8 bytes, `FERRY_XL_COUNT` 6 -> 7
/// entries), so pins of the build before them are refused.
static MAP_SPECS: [MapSpec; 7] = [
    MapSpec {
        name: RULES_MAP,
        map_type: MapType::Hash,
        key_size: size_of::<XlateKey>() as u32,
        value_size: size_of::<XlateRule>() as u32,
        max_entries: maps::RULES_MAX,
    },
    MapSpec {
        name: REV_MAP,
        map_type: MapType::Hash,
        key_size: size_of::<XlateKey>() as u32,
        value_size: 4,
        max_entries: maps::RULES_MAX,
    },
    MapSpec {
        name: FRAGS_MAP,
        map_type: MapType::LruHash,
        key_size: maps::FRAG_KEY_SIZE,
        value_size: maps::FRAG_VALUE_SIZE,
        max_entries: maps::FRAGS_MAX,
    },
    MapSpec {
        name: COUNTERS_MAP,
        map_type: MapType::PerCpuArray,
        key_size: 4,
        value_size: 8,
        max_entries: maps::CNT_MAX,
    },
    // IPv6's, maps of their own: those above keep the layout an earlier
    // ferryd pinned.
    MapSpec {
        name: RULES6_MAP,
        map_type: MapType::Hash,
        key_size: size_of::<Xlate6Key>() as u32,
        value_size: size_of::<Xlate6Rule>() as u32,
        max_entries: maps::RULES_MAX,
    },
    MapSpec {
        name: REV6_MAP,
        map_type: MapType::Hash,
        key_size: size_of::<Xlate6Key>() as u32,
        value_size: 16,
        max_entries: maps::RULES_MAX,
    },
    MapSpec {
        name: FRAGS6_MAP,
        map_type: MapType::LruHash,
        key_size: maps::FRAG6_KEY_SIZE,
        value_size: maps::FRAG6_VALUE_SIZE,
        max_entries: maps::FRAGS_MAX,
    },
];

/// One exact flow, as this node's socket sees it, and what to do with it.
/// At most one rule per flow (protocol, `local`, `remote`). Its addresses
/// are of one family: IPv4 or IPv6 (a cluster network's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TranslationRule {
    pub protocol: Protocol,
    /// The local socket's own address on this node: the peer's
    /// ([`Translate`](RuleAction::Translate)), or the restored socket's
    /// ([`Hold`](RuleAction::Hold)).
    pub local: SocketAddr,
    /// The remote end as the local socket knows it: the migrated socket's
    /// old address (translate), or the peer's address (hold).
    pub remote: SocketAddr,
    pub action: RuleAction,
}

/// What a [`TranslationRule`] does with its flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RuleAction {
    /// On the peer's node: the migrated socket is now at `remote_new` (its
    /// port stays the rule's `remote`'s). Egress destination `remote` ->
    /// `remote_new`, ingress source `remote_new` -> `remote`.
    Translate { remote_new: IpAddr },
    /// On the migrated process's new node, while the migration is under
    /// way: drop the flow's packets both ways, and count them, until the
    /// rule is removed (see the module documentation).
    Hold,
}

impl fmt::Display for TranslationRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let proto = match self.protocol {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        };
        match self.action {
            RuleAction::Translate { remote_new } => write!(
                f,
                "{proto} {} -> {} (now at {remote_new})",
                self.local, self.remote
            ),
            RuleAction::Hold => write!(f, "{proto} {} <-> {} (held)", self.local, self.remote),
        }
    }
}

pub(crate) fn ip_proto(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => libc::IPPROTO_TCP as u8,
        Protocol::Udp => libc::IPPROTO_UDP as u8,
    }
}

pub(crate) fn from_ip_proto(p: u8) -> Option<Protocol> {
    match i32::from(p) {
        libc::IPPROTO_TCP => Some(Protocol::Tcp),
        libc::IPPROTO_UDP => Some(Protocol::Udp),
        _ => None,
    }
}

impl TranslationRule {
    /// On a peer's node: `protocol` traffic between `local` and the
    /// migrated socket that was at `remote_old` goes to `remote_new`.
    pub fn translate(
        protocol: Protocol,
        local: impl Into<SocketAddr>,
        remote_old: impl Into<SocketAddr>,
        remote_new: impl Into<IpAddr>,
    ) -> Self {
        Self {
            protocol,
            local: local.into(),
            remote: remote_old.into(),
            action: RuleAction::Translate {
                remote_new: remote_new.into(),
            },
        }
    }

    /// On a migrated process's new node: hold (drop both ways) the
    /// `protocol` flow between the restored socket at `local` and its peer
    /// at `remote`.
    pub fn hold(
        protocol: Protocol,
        local: impl Into<SocketAddr>,
        remote: impl Into<SocketAddr>,
    ) -> Self {
        Self {
            protocol,
            local: local.into(),
            remote: remote.into(),
            action: RuleAction::Hold,
        }
    }

    /// The source address of the flow's incoming packets: the new address
    /// of a translate rule, the remote one of a hold rule. `new_addr` of
    /// the rule's value.
    fn incoming_addr(&self) -> IpAddr {
        match self.action {
            RuleAction::Translate { remote_new } => remote_new,
            RuleAction::Hold => self.remote.ip(),
        }
    }

    fn check(&self) -> Result<(), DataPlaneError> {
        let moved_nowhere = matches!(
            self.action,
            RuleAction::Translate { remote_new } if remote_new == self.remote.ip()
        );
        let addresses = [self.incoming_addr(), self.remote.ip(), self.local.ip()];
        let reason = if moved_nowhere {
            "the new address is the old one"
        } else if addresses
            .iter()
            .any(|a| a.is_ipv4() != self.local.is_ipv4())
        {
            "addresses must be of one family"
        } else if addresses.iter().any(|a| {
            a.is_unspecified()
                || a.is_multicast()
                || a.to_canonical() != *a
                || matches!(a, IpAddr::V4(v4) if v4.is_broadcast())
        }) {
            "addresses must be unicast"
        } else if self.local.port() == 0 || self.remote.port() == 0 {
            "ports must not be 0"
        } else {
            return Ok(());
        };
        Err(DataPlaneError::InvalidRule {
            rule: self.to_string(),
            reason,
        })
    }
}

/// What the programs saw of a rule's flow. For a hold rule: of the packets
/// it dropped, egress those this node sent, ingress those that arrived
/// (datagrams, not their later fragments).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RuleState {
    /// Packets translated from the peer to the migrated process.
    pub packets_egress: u64,
    /// Packets translated from the migrated process to the peer.
    pub packets_ingress: u64,
    /// CLOCK_MONOTONIC of the last translated (held) packet, 0 if none yet.
    pub last_seen_ns: u64,
    /// TCP segments with FIN the peer sent.
    pub fin_egress: u32,
    /// TCP segments with FIN the process sent.
    pub fin_ingress: u32,
    /// TCP segments with RST the peer sent.
    pub rst_egress: u32,
    /// TCP segments with RST the process sent.
    pub rst_ingress: u32,
}

impl RuleState {
    /// The TCP connection is over: a FIN went each way, or an RST either
    /// way. (The last ACK may still be under way: see
    /// [`Translator::remove_closed`].) Never true for UDP.
    pub fn closed(&self) -> bool {
        self.rst_egress > 0 || self.rst_ingress > 0 || (self.fin_egress > 0 && self.fin_ingress > 0)
    }

    /// Time since the last translated packet, None if there was none.
    pub fn idle(&self) -> Option<Duration> {
        (self.last_seen_ns != 0)
            .then(|| Duration::from_nanos(monotonic_ns().saturating_sub(self.last_seen_ns)))
    }
}

/// CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns().
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `ts`, a live local;
    // CLOCK_MONOTONIC always exists, so it cannot fail.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Packet counts of both programs, summed over CPUs, since the counters
/// map was created (with pins: across agent restarts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TranslationCounters {
    /// Packets (and later fragments) sent to a migrated process's new node.
    pub translated_egress: u64,
    /// Packets (and later fragments) from a new node made to look as if
    /// from the old one.
    pub translated_ingress: u64,
    /// Left alone: no rule, not TCP or UDP, neither IPv4 nor IPv6 (and translated
    /// packets on their second pass after bpf_redirect_neigh()).
    pub passed: u64,
    /// IPv4 or IPv6 with unreadable or inconsistent headers: left alone.
    pub malformed: u64,
    /// Translated egress sent with bpf_redirect_neigh(), which routes and
    /// resolves the new node's MAC in the kernel: every one on a node
    /// without forwarding (the FIB helper refuses there), otherwise
    /// those sent before the neighbour was known. Included in
    /// `translated_egress`; each passes tc egress once more and counts in
    /// `passed` then.
    pub neigh_redirects: u64,
    /// Matched a rule but dropped: no route to the new node, or a rewrite
    /// failed (TCP retransmits).
    pub dropped: u64,
    /// Packets (and later fragments) of held flows, both ways: dropped on
    /// purpose, not in `dropped`.
    pub held: u64,
}

/// The translation programs on one interface; see the module documentation.
pub struct Translator {
    // Unpinned: owns the programs and their links, and dropping it detaches
    // them. Pinned: only descriptors; the pins keep everything attached.
    _ebpf: Ebpf,
    v4: Table<V4>,
    v6: Table<V6>,
    counters: PerCpuArray<MapData, u64>,
    iface: String,
    pins: Option<PathBuf>,
}

// The agent keeps the translator in a Mutex shared by its blocking tasks.
const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<Translator>();
};

impl fmt::Debug for Translator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Translator")
            .field("iface", &self.iface)
            .field("pins", &self.pins)
            .finish_non_exhaustive()
    }
}

/// Before tcx (Linux 6.6) programs attach through the clsact qdisc; aya
/// makes the same test to choose.
fn ensure_clsact(iface: &str) -> Result<(), DataPlaneError> {
    let tcx = KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0));
    if tcx {
        return Ok(());
    }
    match tc::qdisc_add_clsact(iface) {
        Ok(()) | Err(TcError::AlreadyAttached) => Ok(()),
        Err(TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        Err(source) => Err(DataPlaneError::Qdisc {
            iface: iface.to_owned(),
            source,
        }),
    }
}

fn program<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut SchedClassifier, DataPlaneError> {
    let prog: &mut SchedClassifier = crate::object::program(ebpf, name)?;
    prog.load().map_err(prog_err(name))?;
    Ok(prog)
}

/// Whether `link` still attaches its program at `direction` of `iface` (in
/// the calling thread's network namespace). A link whose device went away
/// is defunct, and one pinned for another interface is not ours to reuse.
fn link_attached(
    link: &FdLink,
    name: &'static str,
    iface: &str,
    direction: TcAttachType,
) -> Result<bool, DataPlaneError> {
    let info = link
        .info()
        .map_err(|source| DataPlaneError::Link { name, source })?;
    let (_, progs) = match SchedClassifier::query_tcx(iface, direction) {
        Ok(r) => r,
        Err(e) => return Err(prog_err(name)(e)),
    };
    Ok(progs.iter().any(|p| p.id() == info.program_id()))
}

impl Translator {
    /// Loads the programs and attaches them at tc egress and ingress of
    /// `iface`, looked up in the calling thread's network namespace, with
    /// no rules. Dropping the translator detaches them (tcx links go with
    /// their descriptors); for an agent that must survive its own restart
    /// see [`attach_pinned`](Self::attach_pinned).
    pub fn attach(iface: &str) -> Result<Self, DataPlaneError> {
        let mut ebpf = Ebpf::load(OBJECT)?;
        ensure_clsact(iface)?;
        for (name, direction) in PROGRAMS {
            program(&mut ebpf, name)?
                .attach(iface, direction)
                .map_err(prog_err(name))?;
        }
        tracing::info!(iface, "translator attached");
        Self::new(ebpf, iface, None)
    }

    /// Like [`attach`](Self::attach), but everything is pinned in `pins`
    /// and outlives this object: after a restart the same call finds the
    /// links still attached and the maps with their rules, state and
    /// counters, swaps this build's programs into the links atomically
    /// (no packet goes untranslated), and goes on. Missing pieces (a first
    /// start, a link whose interface was recreated) are created and
    /// pinned. [`unpin`](Self::unpin) removes it all. Needs tcx (6.6+).
    pub fn attach_pinned(iface: &str, pins: &PinDir) -> Result<Self, DataPlaneError> {
        let mut ebpf = pins.loader(&MAP_SPECS)?.load(OBJECT)?;
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
                let link = SchedClassifierLink::try_from(link)
                    .map_err(|source| DataPlaneError::Link { name, source })?;
                // BPF_LINK_UPDATE: the link, its pin and its place among
                // the interface's programs stay; only the program changes.
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
                    .map_err(|source| DataPlaneError::Link { name, source })?;
                pins.pin_link(name, link)?;
                tracing::debug!(iface, program = name, "link attached and pinned");
            }
        }
        tracing::info!(iface, pins = %pins.path().display(), "translator attached (pinned)");
        Self::new(ebpf, iface, Some(pins.path().to_owned()))
    }

    /// Detaches the programs pinned in `pins` and removes every pin: all
    /// rules are gone. A translator object still open on them keeps
    /// readable maps but translates nothing.
    pub fn unpin(pins: &PinDir) -> Result<(), DataPlaneError> {
        pins.remove()?;
        Ok(())
    }

    fn new(mut ebpf: Ebpf, iface: &str, pins: Option<PathBuf>) -> Result<Self, DataPlaneError> {
        let mut take =
            |name: &'static str| ebpf.take_map(name).ok_or(DataPlaneError::Missing(name));
        let rules: HashMap<MapData, XlateKey, XlateRule> =
            HashMap::try_from(take(RULES_MAP)?).map_err(map_err(RULES_MAP))?;
        let reverse = HashMap::try_from(take(REV_MAP)?).map_err(map_err(REV_MAP))?;
        let rules6: HashMap<MapData, Xlate6Key, Xlate6Rule> =
            HashMap::try_from(take(RULES6_MAP)?).map_err(map_err(RULES6_MAP))?;
        let reverse6 = HashMap::try_from(take(REV6_MAP)?).map_err(map_err(REV6_MAP))?;
        let counters = PerCpuArray::try_from(take(COUNTERS_MAP)?).map_err(map_err(COUNTERS_MAP))?;
        Ok(Self {
            _ebpf: ebpf,
            v4: Table::new(rules, reverse),
            v6: Table::new(rules6, reverse6),
            counters,
            iface: iface.to_owned(),
            pins,
        })
    }

    /// The interface the programs are attached to.
    pub fn iface(&self) -> &str {
        &self.iface
    }

    /// The pin directory, if attached with [`attach_pinned`](Self::attach_pinned).
    pub fn pin_dir(&self) -> Option<&Path> {
        self.pins.as_deref()
    }

    /// Starts translating or holding `rule`'s flow. Adding a rule that is
    /// there is a no-op (its state stays); adding a translate rule for a
    /// translated flow with another new address re-targets it (a process
    /// that moved again) and keeps its state. Fails with
    /// [`DataPlaneError::RuleConflict`] on a rule for a flow that has a
    /// rule of the other kind, and on one whose incoming packets would be
    /// indistinguishable from another rule's (same local socket, same
    /// source address and port). IPv4 and IPv6 rules go to maps of their
    /// own.
    pub fn add(&mut self, rule: TranslationRule) -> Result<(), DataPlaneError> {
        rule.check()?;
        if Table::<V4>::holds(&rule) {
            self.v4.add(&rule)?;
        } else {
            self.v6.add(&rule)?;
        }
        tracing::debug!(iface = %self.iface, %rule, "translation rule added");
        Ok(())
    }

    /// Stops translating or holding the flow of `rule` (found by
    /// protocol, local and remote address and the kind of action; a
    /// translate rule's `remote_new` does not matter). False if there was
    /// no such rule.
    pub fn remove(&mut self, rule: &TranslationRule) -> Result<bool, DataPlaneError> {
        let removed = if rule.local.is_ipv4() {
            self.v4.remove(rule)?
        } else {
            self.v6.remove(rule)?
        };
        if removed {
            tracing::debug!(iface = %self.iface, %rule, "translation rule removed");
        }
        Ok(removed)
    }

    /// The state of `rule`'s flow, None if there is no such rule (found as
    /// by [`remove`](Self::remove)).
    pub fn state(&self, rule: &TranslationRule) -> Result<Option<RuleState>, DataPlaneError> {
        if rule.local.is_ipv4() {
            self.v4.state(rule)
        } else {
            self.v6.state(rule)
        }
    }

    /// Every rule with its state, sorted.
    pub fn rules(&self) -> Result<Vec<(TranslationRule, RuleState)>, DataPlaneError> {
        let mut out = Vec::new();
        self.v4.rules(&mut out)?;
        self.v6.rules(&mut out)?;
        out.sort_by_key(|(rule, _)| *rule);
        Ok(out)
    }

    /// Removes the translate rules of closed TCP connections
    /// ([`RuleState::closed`]) that have been idle for at least `linger`,
    /// and returns them. The linger covers what may still follow the FINs:
    /// the last ACK, a retransmitted FIN (a few RTTs; TIME_WAIT's 60 s
    /// covers everything). UDP has no close: remove its rules by
    /// [`RuleState::idle`]. Hold rules stay whatever they dropped: the
    /// migration removes them.
    pub fn remove_closed(
        &mut self,
        linger: Duration,
    ) -> Result<Vec<TranslationRule>, DataPlaneError> {
        let done: Vec<TranslationRule> = self
            .rules()?
            .into_iter()
            .filter(|(rule, s)| {
                matches!(rule.action, RuleAction::Translate { .. })
                    && s.closed()
                    && s.idle().is_none_or(|idle| idle >= linger)
            })
            .map(|(rule, _)| rule)
            .collect();
        for rule in &done {
            self.remove(rule)?;
        }
        Ok(done)
    }

    /// The packet counters, summed over CPUs.
    pub fn counters(&self) -> Result<TranslationCounters, DataPlaneError> {
        let get = |i: u32| -> Result<u64, DataPlaneError> {
            let per_cpu = self.counters.get(&i, 0).map_err(map_err(COUNTERS_MAP))?;
            Ok(per_cpu.iter().sum())
        };
        Ok(TranslationCounters {
            translated_egress: get(maps::CNT_EGRESS)?,
            translated_ingress: get(maps::CNT_INGRESS)?,
            passed: get(maps::CNT_PASSED)?,
            malformed: get(maps::CNT_MALFORMED)?,
            neigh_redirects: get(maps::CNT_REDIRECT_NEIGH)?,
            dropped: get(maps::CNT_DROPPED)?,
            held: get(maps::CNT_HELD)?,
        })
    }
}

impl Drop for Translator {
    fn drop(&mut self) {
        match &self.pins {
            Some(p) => {
                tracing::info!(iface = %self.iface, pins = %p.display(), "translator closed, stays attached")
            }
            // `_ebpf` drops right after this and closes the links.
            None => tracing::info!(iface = %self.iface, "translator detached"),
        }
    }
}
