//! Port ownership: which of the cluster's ports this node serves, decided
//! from the processes it manages, the migrations under way and its peers'
//! word, and written to the data plane's filter
//! ([`crate::dataplane::filter`] has the hand-over table of a migration).
//!
//! **One port, one owner.** A port a managed process opens is owned here
//! only once no peer says it owns or claims it ([`Ports::check_claims`]):
//! each node marks its claim before it asks and answers "claiming" until it
//! owns the port, and two claims that see each other both back off for a
//! random delay and ask again.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cluster::Cluster;
use crate::dataplane::{DataPlane, DataPlaneError, PortState};
use crate::managed::{ManagedProcess, Processes};
use crate::process::PortKey;
use crate::sync::lock;

/// Where a port a managed process opened here stands: the claim protocol
/// of [`Ports::check_claims`].
#[derive(Debug, Clone, PartialEq, Eq)]
enum Claim {
    /// The peers are being asked.
    Claiming,
    /// No peer owns or claims it: owned here at the next ownership pass.
    Free,
    /// Another node owns it: refused here.
    OwnedBy(String),
    /// Another node claimed it in the same round: not owned here, asked
    /// again once `retry_at` (a random delay) has passed.
    Contested { retry_at: Instant },
}

/// The range of the random delay before a contested port is claimed again.
/// Two nodes that saw each other's claim both back off; the first to come
/// back finds the other not claiming and takes the port.
const CONTESTED_RETRY_MS: std::ops::Range<u64> = 50..1000;

/// How long a peer may take to say which ports it owns.
const ASK_TIMEOUT: Duration = Duration::from_millis(500);

/// A peer's answer on ports this node claims.
#[derive(Debug, Clone, Default)]
struct PeerAnswer {
    node: String,
    owned: BTreeSet<PortKey>,
    claiming: BTreeSet<PortKey>,
}

/// A port this node serves already, asked for by an incoming migration.
#[derive(Debug, Clone, thiserror::Error)]
#[error("port {port} is already owned on {node} by PID {pid}")]
pub struct PortTaken {
    pub port: String,
    pub node: String,
    pub pid: i32,
}

/// Why port ownership could not be brought in line.
#[derive(Debug, thiserror::Error)]
pub enum PortsError {
    #[error(transparent)]
    DataPlane(#[from] DataPlaneError),
    #[error("{what}: the task ended without an answer: {source}")]
    Task {
        what: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
}

/// This node's port ownership.
#[derive(Debug)]
pub struct Ports {
    processes: Arc<Processes>,
    dataplane: Arc<DataPlane>,
    cluster: Arc<Cluster>,
    /// Ports of an incoming migration, in the state the migration needs
    /// (overriding the registry's): frozen from Prepare, capturing from Arm,
    /// releasing during the replay at Commit. Until the commit no packet
    /// leaves them, so a restored copy that has to be killed on abort
    /// cannot reach the peers (its sockets are live: CRIU takes them out of
    /// repair mode at the end of the restore).
    reserved: Mutex<BTreeMap<PortKey, PortState>>,
    /// Ports this node's processes opened, on their way to being owned.
    claims: Mutex<BTreeMap<PortKey, Claim>>,
    /// Distributed servers' ports this node is a member of, in the state
    /// its role gives (`SharedContact` or `SharedMember`): a group's port
    /// is served by several nodes, so it is neither claimed nor refused
    /// here, and a peer asking is told it is owned ([`crate::groups`]).
    shared: Mutex<BTreeMap<PortKey, PortState>>,
    /// Serialises the socket reads of [`Self::refresh`], which run outside
    /// the registry's lock: a pass that read earlier cannot land after one
    /// that read later (a port the process opened between the two reads
    /// would be released until the next pass).
    refreshing: Mutex<()>,
}

impl Ports {
    pub fn new(
        processes: Arc<Processes>,
        dataplane: Arc<DataPlane>,
        cluster: Arc<Cluster>,
    ) -> Self {
        Self {
            processes,
            dataplane,
            cluster,
            reserved: Mutex::new(BTreeMap::new()),
            claims: Mutex::new(BTreeMap::new()),
            shared: Mutex::new(BTreeMap::new()),
            refreshing: Mutex::new(()),
        }
    }

    /// Re-reads the managed processes' sockets and brings the filter in
    /// line. procfs reads and BPF map updates block, so they run on the
    /// blocking pool. A port a process opened since is owned only once no
    /// peer says it owns it ([`Self::check_claims`]). Processes found gone
    /// (died in a migration that has let go of them) are forgotten and
    /// their ends announced.
    pub async fn refresh(self: &Arc<Self>) -> Result<(), PortsError> {
        let me = self.clone();
        let unclaimed = tokio::task::spawn_blocking(move || {
            let _one = lock(&me.refreshing);
            // Two statements: the registry's guard must be gone before the
            // reads (a temporary lives to the end of its statement).
            let running = me.processes.registry().running();
            let read = crate::managed::read_sockets(running);
            me.processes.refresh(read);
            me.unclaimed_ports()
        })
        .await
        .map_err(|source| PortsError::Task {
            what: "refreshing the ports",
            source,
        })?;
        if !unclaimed.is_empty() {
            self.check_claims(unclaimed).await;
        }
        self.apply().await
    }

    /// Ports managed processes hold that this node does not own yet (nor
    /// holds for an incoming migration), and ports refused earlier that a
    /// process still holds: those need the peers' word first.
    fn unclaimed_ports(&self) -> Vec<PortKey> {
        let mut wanted = self.processes.registry().desired_ports();
        wanted.retain(|p, _| !lock(&self.shared).contains_key(p));
        let owned: BTreeSet<PortKey> = self.dataplane.table().current().keys().copied().collect();
        let reserved = lock(&self.reserved);
        let mut claims = lock(&self.claims);
        // Forget verdicts on ports no process holds any more.
        claims.retain(|p, _| wanted.contains_key(p));
        let now = Instant::now();
        wanted
            .iter()
            .filter(|(p, s)| **s == PortState::Owned && !reserved.contains_key(p))
            .map(|(p, _)| *p)
            .filter(|p| !owned.contains(p))
            .filter(|p| {
                !matches!(claims.get(p), Some(Claim::Contested { retry_at, .. }) if *retry_at > now)
            })
            .collect()
    }

    /// What this node says of `asked` to a peer that claims them: those it
    /// owns (in any state), and those it is claiming itself (asking, or
    /// found free and not owned yet). Answering "claiming" until the port
    /// is owned is what keeps two simultaneous claims from both winning.
    pub fn ownership_answer(&self, asked: &[PortKey]) -> (Vec<PortKey>, Vec<PortKey>) {
        let owned = self.owned();
        let claims = lock(&self.claims);
        let mine = asked
            .iter()
            .filter(|p| owned.contains(p))
            .copied()
            .collect();
        let claiming = asked
            .iter()
            .filter(|p| !owned.contains(p))
            .filter(|p| matches!(claims.get(p), Some(Claim::Claiming | Claim::Free)))
            .copied()
            .collect();
        (mine, claiming)
    }

    /// Marks `ports` as being claimed, before the peers are asked: from
    /// here on this node answers "claiming" for them.
    fn begin_claims(&self, ports: &[PortKey]) {
        let mut claims = lock(&self.claims);
        for p in ports {
            // A port found free and not owned yet stays free: re-asking
            // must not make it look unclaimed to the ownership pass.
            if claims.get(p) != Some(&Claim::Free) {
                claims.insert(*p, Claim::Claiming);
            }
        }
    }

    /// Records the verdicts on `ports` from the peers' answers.
    fn settle_claims(&self, ports: &[PortKey], answers: &[PeerAnswer]) {
        let mut claims = lock(&self.claims);
        for port in ports {
            let owner = answers.iter().find(|a| a.owned.contains(port));
            let rival = answers.iter().find(|a| a.claiming.contains(port));
            let verdict = match (owner, rival) {
                (Some(a), _) => Claim::OwnedBy(a.node.clone()),
                (None, Some(a)) => {
                    tracing::info!(
                        %port,
                        rival = %a.node,
                        "another node claims this port at the same time: both back off, asked again shortly"
                    );
                    Claim::Contested {
                        retry_at: Instant::now()
                            + Duration::from_millis(rand::random_range(CONTESTED_RETRY_MS)),
                    }
                }
                (None, None) => Claim::Free,
            };
            let before = claims.insert(*port, verdict.clone());
            match (&before, &verdict) {
                (Some(Claim::OwnedBy(_)), Claim::Free) => {
                    tracing::info!(%port, "port no longer owned elsewhere: owned here now")
                }
                (b, Claim::OwnedBy(node)) if b.as_ref() != Some(&verdict) => tracing::error!(
                    %port,
                    owner = %node,
                    "a managed process opened a port another node owns: refused, packets stay with {node}"
                ),
                _ => {}
            }
        }
    }

    /// Asks every peer (concurrently, briefly) which of `ports` it owns or
    /// claims, and records the verdicts: a port another node owns is
    /// refused here (an error in the log and in `ListProcesses`); a port
    /// another node claims at the same time is contested (neither takes it
    /// now; each asks again after a random delay); the others may be owned.
    ///
    /// Two claims never both win: each node marks its claim before it
    /// asks, and answers "claiming" until the port is owned. Of two claims
    /// racing, the later one to mark asks after the earlier marked, so it
    /// sees the earlier one (claiming or owning) and does not take the
    /// port. `ports_race_and_never_both_win` checks every interleaving.
    ///
    /// A peer that does not answer in time is taken as owning none of
    /// them: refusing would leave a port nobody serves whenever any node
    /// is down.
    pub async fn check_claims(&self, ports: Vec<PortKey>) {
        self.begin_claims(&ports);
        let req = ferry_proto::v1::PortOwnershipRequest {
            ports: ports.iter().map(PortKey::to_pb).collect(),
        };
        let peers = self.cluster.known_peers();
        let asks = peers.iter().map(|peer| {
            let req = req.clone();
            async move {
                let answer = tokio::time::timeout(ASK_TIMEOUT, async {
                    let mut c = self
                        .cluster
                        .peer_client(peer)
                        .await
                        .map_err(|e| e.to_string())?;
                    c.port_ownership(req)
                        .await
                        .map(|r| r.into_inner())
                        .map_err(|s| s.message().to_owned())
                })
                .await;
                (peer.name.clone(), answer)
            }
        });
        let answers = futures::future::join_all(asks).await;
        let keys = |ports: &[ferry_proto::v1::Port]| -> BTreeSet<PortKey> {
            ports
                .iter()
                .filter_map(|p| PortKey::from_pb(p).ok())
                .collect()
        };
        let mut heard = Vec::new();
        for (peer, answer) in answers {
            match answer {
                Ok(Ok(r)) => heard.push(PeerAnswer {
                    node: peer,
                    owned: keys(&r.owned),
                    claiming: keys(&r.claiming),
                }),
                Ok(Err(e)) => tracing::warn!(peer = %peer, error = %e, "asking who owns new ports"),
                Err(_) => tracing::warn!(peer = %peer, "no answer on port ownership in time"),
            }
        }
        self.settle_claims(&ports, &heard);
    }

    /// The nodes that own ports this node's processes hold, by port.
    pub fn conflicts(&self) -> BTreeMap<PortKey, String> {
        lock(&self.claims)
            .iter()
            .filter_map(|(p, c)| match c {
                Claim::OwnedBy(n) => Some((*p, n.clone())),
                // Transient: asked again within a second.
                Claim::Claiming | Claim::Free | Claim::Contested { .. } => None,
            })
            .collect()
    }

    /// The ports this node owns in any state (for a peer's question).
    pub fn owned(&self) -> BTreeSet<PortKey> {
        let mut all: BTreeSet<PortKey> = self.dataplane.table().current().keys().copied().collect();
        all.extend(lock(&self.reserved).keys().copied());
        all.extend(lock(&self.shared).keys().copied());
        all
    }

    /// Puts an incoming migration's ports in `state` (see `reserved`); the
    /// filter follows at the next [`Self::apply`].
    pub fn reserve(&self, ports: &[PortKey], state: PortState) {
        let mut r = lock(&self.reserved);
        for p in ports {
            r.insert(*p, state);
        }
    }

    /// Makes `port` a distributed server's on this node, in `state`
    /// (`SharedContact` or `SharedMember`); the filter follows at the next
    /// [`Self::apply`].
    pub fn share(&self, port: PortKey, state: PortState) {
        lock(&self.shared).insert(port, state);
        lock(&self.claims).remove(&port);
    }

    /// Ends a distributed server's port on this node: the registry decides
    /// it again (a process still holding it claims it anew).
    pub fn unshare(&self, port: PortKey) {
        lock(&self.shared).remove(&port);
    }

    /// Gives an incoming migration's ports back to the registry's say.
    pub fn release(&self, ports: &[PortKey]) {
        let mut r = lock(&self.reserved);
        for p in ports {
            r.remove(p);
        }
    }

    /// Refuses ports that this node serves already (other than `ours`, the
    /// migration's own reservation): two nodes must never own one port.
    pub fn refuse_owned(&self, ports: &[PortKey], ours: &[PortKey]) -> Result<(), PortTaken> {
        let owned = self.dataplane.table().current().clone();
        let reg = self.processes.registry();
        for port in ports {
            if owned.contains_key(port) && !ours.contains(port) {
                let pid = reg
                    .iter()
                    .find(|p| p.sockets.ports.contains(port))
                    .map(|p: &ManagedProcess| p.pid)
                    .unwrap_or(0);
                return Err(PortTaken {
                    port: port.to_string(),
                    node: self.cluster.node().to_owned(),
                    pid,
                });
            }
        }
        Ok(())
    }

    /// Brings the filter in line with the registry as it is, without
    /// re-reading sockets from procfs: for the migration's freeze window,
    /// where every millisecond counts (each /proc/PID/net/tcp read walks
    /// the kernel's whole established-connection hash table, ~2 ms here).
    pub async fn apply(self: &Arc<Self>) -> Result<(), PortsError> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.apply_now())
            .await
            .map_err(|source| PortsError::Task {
                what: "applying port ownership",
                source,
            })?
            .map_err(PortsError::from)
    }

    /// [`Self::apply`] for blocking code.
    pub fn apply_now(&self) -> Result<(), DataPlaneError> {
        // The table's lock is held from computing the desired state to
        // writing it, so passes apply in the order they read the registry:
        // a periodic pass that read "owned" cannot land after the engine's
        // pass that froze the ports. Lock order: table, then registry.
        let mut table = self.dataplane.table();
        let mut desired = self.processes.registry().desired_ports();
        // A port is newly owned only once the peers said nobody owns it;
        // ports already owned stay (a migration moved them here, or they
        // were checked before). A group's port this node left is not owned
        // by having been shared: its server still listens, but the group
        // goes on elsewhere (the peers' answer decides).
        {
            let claims = lock(&self.claims);
            let current = table.current();
            desired.retain(|p, _| {
                current.get(p).is_some_and(|s| {
                    !matches!(s, PortState::SharedContact | PortState::SharedMember)
                }) || claims.get(p) == Some(&Claim::Free)
            });
        }
        // A group's port takes the state of this node's role in it,
        // whoever holds it here.
        for (port, state) in lock(&self.shared).iter() {
            desired.insert(*port, *state);
        }
        // An incoming migration's state wins: at Commit the adopted
        // process's ports stay releasing until the replay is done.
        for (port, state) in lock(&self.reserved).iter() {
            desired.insert(*port, *state);
        }
        table.apply(&desired)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::destination::fixture::Fixture;
    use crate::process::Transport;

    const PORT: PortKey = PortKey {
        transport: Transport::Tcp,
        port: 7000,
    };

    /// An agent whose managed process opened [`PORT`].
    fn node_with_a_process_on_the_port() -> Fixture {
        let f = Fixture::new(&[]);
        f.adopt_local(4242, &[PORT]);
        f
    }

    /// One node's steps of a claim, in their order.
    #[derive(Clone, Copy, Debug)]
    enum Step {
        Mark,
        Ask,
        Settle,
        Own,
    }
    const STEPS: [Step; 4] = [Step::Mark, Step::Ask, Step::Settle, Step::Own];

    /// Every way of interleaving two nodes' four steps: which node takes
    /// each of the 8 turns.
    fn interleavings() -> Vec<Vec<usize>> {
        (0u32..256)
            .filter(|m| m.count_ones() == 4)
            .map(|m| (0..8).map(|i| ((m >> i) & 1) as usize).collect())
            .collect()
    }

    fn step(me: &Ports, other: &Ports, other_name: &str, s: Step, heard: &mut Vec<PeerAnswer>) {
        match s {
            Step::Mark => me.begin_claims(&[PORT]),
            Step::Ask => {
                let (owned, claiming) = other.ownership_answer(&[PORT]);
                heard.push(PeerAnswer {
                    node: other_name.into(),
                    owned: owned.into_iter().collect(),
                    claiming: claiming.into_iter().collect(),
                });
            }
            Step::Settle => me.settle_claims(&[PORT], heard),
            Step::Own => me.apply_now().unwrap(),
        }
    }

    #[tokio::test]
    async fn ports_race_and_never_both_win() {
        let orders = interleavings();
        assert_eq!(orders.len(), 70);
        let mut outcomes = BTreeMap::new();
        for order in orders {
            let nodes = [
                node_with_a_process_on_the_port(),
                node_with_a_process_on_the_port(),
            ];
            let names = ["node-a", "node-b"];
            let mut next = [0usize; 2];
            let mut heard = [Vec::new(), Vec::new()];
            for &who in &order {
                let other = 1 - who;
                step(
                    &nodes[who].engine.ports,
                    &nodes[other].engine.ports,
                    names[other],
                    STEPS[next[who]],
                    &mut heard[who],
                );
                next[who] += 1;
            }
            let owns = nodes
                .each_ref()
                .map(|n| n.engine.ports.owned().contains(&PORT));
            assert!(!(owns[0] && owns[1]), "both own the port after {order:?}");
            *outcomes.entry(owns).or_insert(0) += 1;
        }
        // Run one after the other, the first takes the port and the second
        // is refused; neither is the only outcome.
        assert!(outcomes.contains_key(&[true, false]), "{outcomes:?}");
        assert!(outcomes.contains_key(&[false, true]), "{outcomes:?}");
        assert!(outcomes.contains_key(&[false, false]), "{outcomes:?}");
    }

    #[tokio::test]
    async fn a_node_that_leaves_a_group_does_not_own_its_port_by_having_shared_it() {
        // A member of a group whose server still listens on the port leaves
        // the group: the port is not its (the contact node goes on with
        // it) unless the peers say nobody owns it.
        let f = node_with_a_process_on_the_port();
        let ports = &f.engine.ports;
        ports.share(PORT, PortState::SharedMember);
        ports.apply_now().unwrap();
        assert_eq!(
            f.engine.dataplane.table().current().get(&PORT),
            Some(&PortState::SharedMember)
        );
        ports.unshare(PORT);
        ports.apply_now().unwrap();
        assert_eq!(f.engine.dataplane.table().current().get(&PORT), None);
        // Unless nobody owns it: then the process's port is its own again.
        ports.begin_claims(&[PORT]);
        ports.settle_claims(&[PORT], &[]);
        ports.apply_now().unwrap();
        assert_eq!(
            f.engine.dataplane.table().current().get(&PORT),
            Some(&PortState::Owned)
        );
    }

    #[tokio::test]
    async fn a_claim_after_anothers_takes_nothing_and_names_the_owner() {
        let a = node_with_a_process_on_the_port();
        let b = node_with_a_process_on_the_port();
        let mut heard = Vec::new();
        for s in STEPS {
            step(&a.engine.ports, &b.engine.ports, "node-b", s, &mut heard);
        }
        assert!(a.engine.ports.owned().contains(&PORT));
        let mut heard = Vec::new();
        for s in STEPS {
            step(&b.engine.ports, &a.engine.ports, "node-a", s, &mut heard);
        }
        assert!(!b.engine.ports.owned().contains(&PORT));
        assert_eq!(
            b.engine.ports.conflicts(),
            [(PORT, "node-a".to_owned())].into()
        );
    }

    #[tokio::test]
    async fn a_contested_port_is_asked_again_only_after_its_delay() {
        let a = node_with_a_process_on_the_port();
        let b = node_with_a_process_on_the_port();
        // Both mark, then both ask: each sees the other claiming.
        a.engine.ports.begin_claims(&[PORT]);
        b.engine.ports.begin_claims(&[PORT]);
        let (owned, claiming) = b.engine.ports.ownership_answer(&[PORT]);
        assert_eq!((owned.len(), claiming.as_slice()), (0, &[PORT][..]));
        let heard = vec![PeerAnswer {
            node: "node-b".into(),
            owned: owned.into_iter().collect(),
            claiming: claiming.into_iter().collect(),
        }];
        a.engine.ports.settle_claims(&[PORT], &heard);
        a.engine.ports.apply_now().unwrap();
        assert!(!a.engine.ports.owned().contains(&PORT));
        // Backing off, it neither claims (a peer asking finds it silent)
        // nor is asked about again before its delay.
        assert_eq!(a.engine.ports.ownership_answer(&[PORT]), (vec![], vec![]));
        assert!(a.engine.ports.unclaimed_ports().is_empty());
        // Once the delay passed, it is claimed again.
        if let Some(Claim::Contested { retry_at, .. }) = lock(&a.engine.ports.claims).get_mut(&PORT)
        {
            *retry_at = Instant::now();
        } else {
            panic!(
                "not contested: {:?}",
                lock(&a.engine.ports.claims).get(&PORT)
            );
        }
        assert_eq!(a.engine.ports.unclaimed_ports(), vec![PORT]);
    }
}
