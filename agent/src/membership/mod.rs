//! Membership: who is in the cluster, who failed, and what load each node
//! carries (the paper's heartbeat and the information policy's transport).
//!
//! SWIM through the `foca` crate over UDP on the cluster interface does the
//! membership proper: joins (announce), probes, indirect probes, suspicion,
//! declaring a node down, and the dissemination of those updates by
//! piggybacking them on the probe traffic. ferry adds two things around it:
//!
//! - **Discovery without a static list**: every `beacon_interval_ms` a node
//!   sends a one-datagram beacon carrying its identity to the cluster
//!   network's broadcast address (the interface's, or 255.255.255.255 if
//!   it has none; on an IPv6 cluster network the link's all-nodes group,
//!   ff02::1), heard on a socket bound to that address and to the
//!   cluster interface; a node that hears the beacon of a node it
//!   does not count as alive announces itself to it through SWIM. The
//!   static `[[peers]]` of ferryd's config are announced to at start and
//!   whenever the node knows no member: they are seeds, not the membership.
//! - **Load dissemination**: the conductor's load message (the information
//!   policy's own message, see `ferry_policy::information`) is a foca custom
//!   broadcast, so load travels with the membership traffic. Each node's
//!   messages carry an increasing sequence number (its wall clock in ms at
//!   publication, so it also increases across agent restarts); foca keeps
//!   disseminating only the newest per node.
//!
//! Every datagram starts with one tag byte: [`TAG_SWIM`] for foca's own
//! packets, [`TAG_BEACON`] for the discovery beacon. With a membership key
//! (`[tls] membership_key`) every datagram is also sealed with a MAC and
//! unsealed ones are dropped and counted ([`auth`]).

pub mod auth;
pub(crate) mod wire;

use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use foca::{AccumulatingRuntime, Foca, OwnedNotification, PostcardCodec, Timer};
use rand_foca::SeedableRng;
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, watch};

use crate::config::{Config, MembershipConfig};
use crate::sync::lock;
pub use wire::{LoadBroadcast, NodeIdent, WireEntry};
use wire::{LoadHandler, decode_beacon, encode_beacon};

pub const TAG_SWIM: u8 = 1;
pub const TAG_BEACON: u8 = 2;

/// A member's SWIM state, as this node sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberState {
    Alive,
    /// Failed a probe; treated as alive until it refutes or is declared down.
    Suspect,
    Down,
}

impl MemberState {
    pub fn as_str(self) -> &'static str {
        match self {
            MemberState::Alive => "alive",
            MemberState::Suspect => "suspect",
            MemberState::Down => "down",
        }
    }
}

/// What this node knows of another.
#[derive(Debug, Clone)]
pub struct Member {
    pub ident: NodeIdent,
    pub state: MemberState,
    /// The newest load broadcast heard from it, and when (local clock).
    pub load: Option<(LoadBroadcast, std::time::Instant)>,
}

#[derive(Debug, Default)]
struct Shared {
    members: BTreeMap<String, Member>,
    /// Datagrams dropped for want of a valid MAC, by reason.
    rejected: auth::RejectCounts,
    /// Load broadcasts not yet taken by the conductor.
    inbox: Vec<LoadBroadcast>,
    /// Members' state changes, for the agent's event stream.
    changes: ChangeFeed,
}

/// A member's state changed (`previous` is `None` for a node first seen).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberChange {
    pub name: String,
    pub state: MemberState,
    pub previous: Option<MemberState>,
}

#[derive(Debug)]
struct ChangeFeed(tokio::sync::broadcast::Sender<MemberChange>);

impl Default for ChangeFeed {
    fn default() -> Self {
        ChangeFeed(tokio::sync::broadcast::channel(256).0)
    }
}

#[derive(Debug)]
enum Command {
    Publish(Vec<u8>),
}

/// The running membership of this node.
#[derive(Debug)]
pub struct Membership {
    local: NodeIdent,
    shared: Arc<Mutex<Shared>>,
    commands: mpsc::Sender<Command>,
}

#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    #[error("binding the membership socket {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("membership socket: {0}")]
    Socket(std::io::Error),
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The broadcast address configured on `interface` for `address`, if it
/// has a real one. An address added without `brd` has none: the kernel
/// then treats the subnet's top address as a unicast one, and glibc's
/// `getifaddrs` reports the interface's own address in its place.
fn interface_broadcast(interface: &str, address: Ipv4Addr) -> Option<Ipv4Addr> {
    let addrs = nix::ifaddrs::getifaddrs().ok()?;
    for a in addrs {
        let own = a
            .address
            .as_ref()
            .and_then(|x| x.as_sockaddr_in())
            .map(|x| x.ip());
        if a.interface_name != interface || own != Some(address) {
            continue;
        }
        if let Some(b) = a.broadcast.as_ref().and_then(|b| b.as_sockaddr_in()) {
            let b = b.ip();
            if b != address && !b.is_unspecified() {
                return Some(b);
            }
        }
    }
    None
}

/// Where discovery beacons go: the configured address, else the cluster
/// interface's broadcast address, else the limited broadcast
/// (255.255.255.255), which the kernel sends out of the interface that owns
/// the socket's source address (the cluster address) and no router passes.
fn beacon_address(m: &MembershipConfig, interface: &str, address: Ipv4Addr) -> Ipv4Addr {
    m.broadcast
        .or_else(|| interface_broadcast(interface, address))
        .unwrap_or(Ipv4Addr::BROADCAST)
}

/// Where discovery beacons go on an IPv6 cluster network: the link's
/// all-nodes group on the cluster interface, which every IPv6 interface
/// has joined (no group to join, no router passes it).
fn beacon_address6(interface: &str, port: u16) -> Result<SocketAddr, MembershipError> {
    let index = nix::net::if_::if_nametoindex(interface).map_err(|e| MembershipError::Bind {
        addr: SocketAddr::new(Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1).into(), port),
        source: std::io::Error::other(format!("the cluster interface {interface}: {e}")),
    })?;
    Ok(SocketAddrV6::new(Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1), port, 0, index).into())
}

/// A socket that hears beacons: bound to the broadcast address or the
/// IPv6 all-nodes group (a socket bound to a unicast address is never
/// handed those datagrams) and to the cluster interface, so beacons from
/// other networks are not heard.
/// Several agents on one host (the namespace test cluster has one per
/// namespace, each with its own stack) or a restart may bind it again.
fn beacon_listener(
    interface: &str,
    to: SocketAddr,
) -> Result<std::net::UdpSocket, MembershipError> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrStorage, bind, setsockopt, socket, sockopt,
    };
    let err = |e: nix::Error| MembershipError::Bind {
        addr: to,
        source: std::io::Error::from(e),
    };
    let fd = socket(
        if to.is_ipv4() {
            AddressFamily::Inet
        } else {
            AddressFamily::Inet6
        },
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .map_err(err)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true).map_err(err)?;
    setsockopt(
        &fd,
        sockopt::BindToDevice,
        &std::ffi::OsString::from(interface),
    )
    .map_err(err)?;
    bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(to),
    )
    .map_err(err)?;
    Ok(std::net::UdpSocket::from(fd))
}

impl Membership {
    /// Binds the membership socket on the cluster address and starts SWIM.
    /// With `key` (the cluster's membership key) every datagram is sealed
    /// and only sealed ones are heard.
    pub async fn start(
        config: &Config,
        key: Option<&[u8]>,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Arc<Self>, MembershipError> {
        let m = &config.membership;
        let bind = SocketAddr::new(config.cluster.address, m.port);
        let socket = UdpSocket::bind(bind)
            .await
            .map_err(|source| MembershipError::Bind { addr: bind, source })?;
        if bind.is_ipv4() {
            socket
                .set_broadcast(true)
                .map_err(MembershipError::Socket)?;
        }
        let local = NodeIdent {
            name: config.node.clone(),
            gossip: bind,
            peer: config.cluster.peer_listen,
            bump: unix_ms(),
        };
        let seeds: Vec<NodeIdent> = config
            .peers
            .iter()
            .map(|p| NodeIdent {
                name: p.name.clone(),
                gossip: SocketAddr::new(p.address.ip(), m.port),
                peer: p.address,
                bump: 0,
            })
            .collect();
        let beacon_to = match (m.discovery, config.cluster.address) {
            (false, _) => None,
            (true, IpAddr::V4(own)) => Some(SocketAddr::new(
                IpAddr::V4(beacon_address(m, &config.cluster.interface, own)),
                m.port,
            )),
            (true, IpAddr::V6(_)) => Some(beacon_address6(&config.cluster.interface, m.port)?),
        };
        let beacon_rx = match beacon_to {
            Some(to) => {
                let std = beacon_listener(&config.cluster.interface, to)?;
                Some(UdpSocket::from_std(std).map_err(MembershipError::Socket)?)
            }
            None => None,
        };
        let shared = Arc::new(Mutex::new(Shared::default()));
        let (tx, rx) = mpsc::channel(64);
        let me = Arc::new(Membership {
            local: local.clone(),
            shared: shared.clone(),
            commands: tx,
        });
        let mut swim = Swim::new(local, m, shared, seeds, beacon_to, socket, beacon_rx);
        swim.sealer = key.map(auth::Sealer::new);
        let authenticated = swim.sealer.is_some();
        tokio::spawn(swim.run(rx, shutdown));
        tracing::info!(gossip = %bind, beacon = ?beacon_to, authenticated, "membership started (SWIM)");
        Ok(me)
    }

    pub fn local(&self) -> &NodeIdent {
        &self.local
    }

    /// Members' state changes from now on.
    pub fn changes(&self) -> tokio::sync::broadcast::Receiver<MemberChange> {
        lock(&self.shared).changes.0.subscribe()
    }

    /// Every node known, alive or not (never this node).
    pub fn members(&self) -> Vec<Member> {
        lock(&self.shared).members.values().cloned().collect()
    }

    /// Names of the members SWIM counts as alive (suspects included).
    pub fn alive(&self) -> Vec<String> {
        lock(&self.shared)
            .members
            .values()
            .filter(|m| m.state != MemberState::Down)
            .map(|m| m.ident.name.clone())
            .collect()
    }

    /// The Peer address of a live member.
    pub fn peer_address(&self, name: &str) -> Option<SocketAddr> {
        lock(&self.shared)
            .members
            .get(name)
            .filter(|m| m.state != MemberState::Down)
            .map(|m| m.ident.peer)
    }

    /// Datagrams dropped since start for want of a valid MAC.
    pub fn rejected(&self) -> auth::RejectCounts {
        lock(&self.shared).rejected
    }

    /// Load broadcasts heard since the last call.
    pub fn take_inbox(&self) -> Vec<LoadBroadcast> {
        std::mem::take(&mut lock(&self.shared).inbox)
    }

    /// Disseminates this node's load message with the membership traffic.
    pub fn publish(&self, message: &LoadBroadcast) {
        match postcard::to_stdvec(message) {
            Ok(bytes) => {
                if self.commands.try_send(Command::Publish(bytes)).is_err() {
                    tracing::debug!("membership busy: load broadcast skipped");
                }
            }
            Err(e) => tracing::warn!(error = %e, "encoding the load broadcast"),
        }
    }
}

/// `recv_from` on the socket if there is one; pending forever otherwise.
async fn recv_opt(
    socket: Option<&UdpSocket>,
    buf: &mut [u8],
) -> std::io::Result<(usize, SocketAddr)> {
    match socket {
        Some(s) => s.recv_from(buf).await,
        None => std::future::pending().await,
    }
}

type FocaInstance = Foca<NodeIdent, PostcardCodec, rand_foca::rngs::StdRng, LoadHandler>;

/// The task that owns foca and the socket.
struct Swim {
    foca: FocaInstance,
    runtime: AccumulatingRuntime<NodeIdent>,
    local: NodeIdent,
    shared: Arc<Mutex<Shared>>,
    seeds: Vec<NodeIdent>,
    beacon_to: Option<SocketAddr>,
    beacon_interval: Duration,
    socket: UdpSocket,
    /// Hears the other nodes' beacons (see [`beacon_listener`]).
    beacon_rx: Option<UdpSocket>,
    timers: BinaryHeap<std::cmp::Reverse<(tokio::time::Instant, u64, TimerSlot)>>,
    timer_seq: u64,
    /// Seals what is sent and opens what is heard, with a membership key.
    sealer: Option<auth::Sealer>,
    /// When a rejection was last logged at warn level (not every one is:
    /// an outsider can send many).
    last_reject_log: Option<std::time::Instant>,
}

/// Wraps a foca timer so the heap orders by deadline, then by submission.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TimerSlot(Timer<NodeIdent>);

impl PartialOrd for TimerSlot {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for TimerSlot {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.cmp(&other.0)
    }
}

impl Swim {
    fn new(
        local: NodeIdent,
        m: &MembershipConfig,
        shared: Arc<Mutex<Shared>>,
        seeds: Vec<NodeIdent>,
        beacon_to: Option<SocketAddr>,
        socket: UdpSocket,
        beacon_rx: Option<UdpSocket>,
    ) -> Self {
        let mut fc = foca::Config::new_lan(std::num::NonZeroU32::new(16).unwrap());
        fc.probe_period = Duration::from_millis(m.probe_period_ms);
        fc.probe_rtt = Duration::from_millis((m.probe_period_ms / 2).max(50));
        fc.suspect_to_down_after = Duration::from_millis(m.suspect_to_down_ms);
        fc.remove_down_after = Some(Duration::from_secs(60));
        let rng = rand_foca::rngs::StdRng::seed_from_u64(local.bump ^ 0x0066_6572_7279);
        let handler = LoadHandler::new(local.name.clone(), shared_inbox(&shared));
        Swim {
            foca: Foca::with_custom_broadcast(local.clone(), fc, rng, PostcardCodec, handler),
            runtime: AccumulatingRuntime::new(),
            local,
            shared,
            seeds,
            beacon_to,
            beacon_interval: Duration::from_millis(m.beacon_interval_ms),
            socket,
            beacon_rx,
            timers: BinaryHeap::new(),
            timer_seq: 0,
            sealer: None,
            last_reject_log: None,
        }
    }

    async fn run(mut self, mut commands: mpsc::Receiver<Command>, mut stop: watch::Receiver<bool>) {
        for seed in self.seeds.clone() {
            let _ = self.foca.announce(seed, &mut self.runtime);
        }
        self.flush().await;
        let mut beacon = tokio::time::interval(self.beacon_interval);
        let mut buf = vec![0u8; 2048];
        let mut beacon_buf = vec![0u8; 2048];
        loop {
            let next_timer = self.timers.peek().map(|t| t.0.0);
            tokio::select! {
                r = self.socket.recv_from(&mut buf) => match r {
                    Ok((n, from)) => self.on_datagram(&buf[..n], from),
                    Err(e) => tracing::debug!(error = %e, "membership receive"),
                },
                r = recv_opt(self.beacon_rx.as_ref(), &mut beacon_buf) => match r {
                    Ok((n, from)) => self.on_datagram(&beacon_buf[..n], from),
                    Err(e) => tracing::debug!(error = %e, "beacon receive"),
                },
                _ = sleep_until_opt(next_timer) => {
                    let now = tokio::time::Instant::now();
                    while let Some(t) = self.timers.peek() {
                        if t.0.0 > now {
                            break;
                        }
                        let Some(std::cmp::Reverse((_, _, TimerSlot(timer)))) = self.timers.pop() else { break };
                        if let Err(e) = self.foca.handle_timer(timer, &mut self.runtime) {
                            tracing::debug!(error = %e, "membership timer");
                        }
                    }
                }
                Some(cmd) = commands.recv() => match cmd {
                    Command::Publish(bytes) => {
                        if let Err(e) = self.foca.add_broadcast(&bytes) {
                            tracing::debug!(error = %e, "adding the load broadcast");
                        }
                        // Push it out now rather than waiting for the next probe.
                        let _ = self.foca.broadcast(&mut self.runtime);
                    }
                },
                _ = beacon.tick() => self.beacon().await,
                _ = stop.changed() => {
                    // Tell the others now rather than letting them time us out.
                    let _ = self.foca.leave_cluster(&mut self.runtime);
                    self.flush().await;
                    tracing::info!("left the cluster");
                    return;
                }
            }
            self.flush().await;
        }
    }

    fn on_datagram(&mut self, data: &[u8], from: SocketAddr) {
        let data = match &self.sealer {
            None => data,
            Some(s) => match s.open(data, unix_ms()) {
                Ok(d) => d,
                Err(reason) => {
                    self.reject(reason, from);
                    return;
                }
            },
        };
        match data.split_first() {
            Some((&TAG_SWIM, rest)) => {
                if let Err(e) = self.foca.handle_data(rest, &mut self.runtime) {
                    tracing::trace!(%from, error = %e, "membership packet ignored");
                }
            }
            Some((&TAG_BEACON, rest)) => {
                let Some(ident) = decode_beacon(rest) else {
                    tracing::debug!(%from, "malformed discovery beacon");
                    return;
                };
                if ident.name == self.local.name || ident.gossip == self.local.gossip {
                    return;
                }
                let known_alive = self.foca.iter_members().any(|m| m.id() == &ident);
                if !known_alive {
                    tracing::debug!(node = %ident.name, "discovered by beacon: announcing");
                    let _ = self.foca.announce(ident, &mut self.runtime);
                }
            }
            _ => tracing::trace!(%from, "unknown membership datagram"),
        }
    }

    /// Counts a dropped datagram; logs the first of a burst as a warning
    /// (once per 10 s), the rest at debug level.
    fn reject(&mut self, reason: auth::Reject, from: SocketAddr) {
        let total = {
            let mut shared = lock(&self.shared);
            shared.rejected.count(reason);
            shared.rejected
        };
        let now = std::time::Instant::now();
        if self
            .last_reject_log
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(10))
        {
            self.last_reject_log = Some(now);
            tracing::warn!(
                %from,
                %reason,
                unauthenticated = total.unauthenticated,
                stale = total.stale,
                "membership datagram rejected"
            );
        } else {
            tracing::debug!(%from, %reason, "membership datagram rejected");
        }
    }

    /// The tag, the payload and, with a key, the seal.
    fn packet(&self, tag: u8, payload: &[u8]) -> Vec<u8> {
        let mut pkt = Vec::with_capacity(1 + payload.len() + auth::OVERHEAD);
        pkt.push(tag);
        pkt.extend_from_slice(payload);
        if let Some(s) = &self.sealer {
            s.seal(&mut pkt, unix_ms());
        }
        pkt
    }

    async fn beacon(&mut self) {
        if let Some(to) = self.beacon_to {
            let pkt = self.packet(TAG_BEACON, &encode_beacon(&self.local));
            if let Err(e) = self.socket.send_to(&pkt, to).await {
                tracing::debug!(error = %e, %to, "discovery beacon");
            }
        }
        if self.foca.num_members() == 0 {
            for seed in self.seeds.clone() {
                let _ = self.foca.announce(seed, &mut self.runtime);
            }
        }
    }

    /// Sends what foca queued, schedules its timers, and refreshes the
    /// shared view.
    async fn flush(&mut self) {
        while let Some((to, data)) = self.runtime.to_send() {
            let pkt = self.packet(TAG_SWIM, &data);
            if let Err(e) = self.socket.send_to(&pkt, to.gossip).await {
                tracing::trace!(error = %e, to = %to.gossip, "membership send");
            }
        }
        let now = tokio::time::Instant::now();
        while let Some((after, timer)) = self.runtime.to_schedule() {
            self.timer_seq += 1;
            self.timers.push(std::cmp::Reverse((
                now + after,
                self.timer_seq,
                TimerSlot(timer),
            )));
        }
        while let Some(n) = self.runtime.to_notify() {
            match n {
                OwnedNotification::MemberUp(id) => {
                    tracing::info!(node = %id.name, gossip = %id.gossip, "member up")
                }
                OwnedNotification::MemberDown(id) => tracing::warn!(node = %id.name, "member down"),
                OwnedNotification::Rename(old, new) => {
                    tracing::info!(node = %new.name, old = old.bump, new = new.bump, "member rejoined")
                }
                other => tracing::debug!(notification = ?other, "membership"),
            }
        }
        self.refresh_view();
    }

    fn refresh_view(&self) {
        let rank = |s: foca::State| match s {
            foca::State::Alive => 0,
            foca::State::Suspect => 1,
            foca::State::Down => 2,
        };
        // Several identities of one node (an agent restarted): the liveliest wins.
        let mut best: HashMap<String, (NodeIdent, foca::State)> = HashMap::new();
        for m in self.foca.iter_membership_state() {
            let id = m.id();
            if id.name == self.local.name {
                continue;
            }
            match best.get(&id.name) {
                Some((_, s)) if rank(*s) <= rank(m.state()) => {}
                _ => {
                    best.insert(id.name.clone(), (id.clone(), m.state()));
                }
            }
        }
        let mut shared = lock(&self.shared);
        let mut changes = Vec::new();
        for (name, (ident, state)) in best {
            let state = match state {
                foca::State::Alive => MemberState::Alive,
                foca::State::Suspect => MemberState::Suspect,
                foca::State::Down => MemberState::Down,
            };
            let previous = shared.members.get(&name).map(|m| m.state);
            if previous != Some(state) {
                changes.push(MemberChange {
                    name: name.clone(),
                    state,
                    previous,
                });
            }
            let entry = shared.members.entry(name).or_insert_with(|| Member {
                ident: ident.clone(),
                state,
                load: None,
            });
            entry.ident = ident;
            entry.state = state;
        }
        // Forgotten by foca (removed after being down): still listed, down.
        let alive: Vec<String> = self
            .foca
            .iter_members()
            .map(|m| m.id().name.clone())
            .collect();
        for (name, m) in shared.members.iter_mut() {
            if !alive.contains(name) && m.state != MemberState::Down {
                let still = self
                    .foca
                    .iter_membership_state()
                    .any(|x| &x.id().name == name);
                if !still {
                    changes.push(MemberChange {
                        name: name.clone(),
                        state: MemberState::Down,
                        previous: Some(m.state),
                    });
                    m.state = MemberState::Down;
                }
            }
        }
        for change in changes {
            // Nobody listening is fine.
            let _ = shared.changes.0.send(change);
        }
    }
}

/// Where the broadcast handler drops decoded load messages.
fn shared_inbox(shared: &Arc<Mutex<Shared>>) -> wire::Inbox {
    let shared = shared.clone();
    Box::new(move |b: LoadBroadcast| {
        let mut s = lock(&shared);
        if let Some(m) = s.members.get_mut(&b.node) {
            m.load = Some((b.clone(), std::time::Instant::now()));
        }
        s.inbox.push(b);
        // Bound: a conductor that is off must not let the inbox grow.
        let len = s.inbox.len();
        if len > 256 {
            s.inbox.drain(..len - 256);
        }
    })
}

async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beacons_go_to_the_configured_address_else_a_real_broadcast_else_the_limited_one() {
        let configured = MembershipConfig {
            broadcast: Some(Ipv4Addr::new(198, 19, 0, 255)),
            ..MembershipConfig::default()
        };
        assert_eq!(
            beacon_address(&configured, "no-such-if", Ipv4Addr::new(198, 19, 0, 1)),
            Ipv4Addr::new(198, 19, 0, 255)
        );
        let default = MembershipConfig::default();
        assert_eq!(
            beacon_address(&default, "no-such-if", Ipv4Addr::new(198, 19, 0, 1)),
            Ipv4Addr::BROADCAST
        );
        // Loopback has no broadcast address: never its own address back.
        assert_eq!(
            beacon_address(&default, "lo", Ipv4Addr::LOCALHOST),
            Ipv4Addr::BROADCAST
        );
    }
}
