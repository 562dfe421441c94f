//! The conductor's logic against fakes: a scripted clock, sampler,
//! membership, receivers and engine.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use ferry_policy::information::InformationKind;

use super::*;
use crate::membership::WireEntry;

#[derive(Default)]
struct FakeClock(AtomicU64);

impl FakeClock {
    fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Instant {
        Instant::from_millis(self.0.load(Ordering::SeqCst))
    }
}

/// Processes with a constant CPU demand (CPUs busy per second).
struct FakeSampler {
    clock: Arc<FakeClock>,
    procs: Mutex<Vec<(i32, f64)>>,
    capacity: Mutex<capacity::Capacity>,
}

impl LoadSampler for FakeSampler {
    fn sample(&self) -> Sample {
        let now = self.clock.now().as_millis() as f64;
        Sample {
            cpus: 1,
            capacity: self.capacity.lock().unwrap().clone(),
            processes: self
                .procs
                .lock()
                .unwrap()
                .iter()
                .map(|&(pid, rate)| ProcSample {
                    pid,
                    cpu: Duration::from_secs_f64(now * rate / 1000.0),
                    migratable: true,
                    argv: vec![format!("p{pid}")],
                })
                .collect(),
        }
    }
}

#[derive(Default)]
struct FakeGossip {
    alive: Mutex<Vec<String>>,
    inbox: Mutex<Vec<LoadBroadcast>>,
    published: Mutex<Vec<LoadBroadcast>>,
}

impl Gossip for FakeGossip {
    fn publish(&self, m: &LoadBroadcast) {
        self.published.lock().unwrap().push(m.clone());
    }
    fn take_inbox(&self) -> Vec<LoadBroadcast> {
        std::mem::take(&mut self.inbox.lock().unwrap())
    }
    fn alive(&self) -> Vec<String> {
        self.alive.lock().unwrap().clone()
    }
}

/// How a fake receiver answers an offer.
#[derive(Clone, Copy, PartialEq)]
enum Receiver {
    Accept,
    Refuse,
    /// Never answers.
    Silent,
}

struct FakePeers {
    receivers: Mutex<HashMap<String, Receiver>>,
    offers: Mutex<Vec<String>>,
    finishes: Mutex<Vec<(String, bool)>>,
    pulls: Mutex<Vec<String>>,
}

#[tonic::async_trait]
impl PeerNegotiator for FakePeers {
    async fn offer(
        &self,
        to: &str,
        _req: pb::OfferRequest,
    ) -> Result<pb::OfferResponse, NegotiationFailed> {
        self.offers.lock().unwrap().push(to.to_owned());
        let r = self.receivers.lock().unwrap().get(to).copied();
        match r {
            Some(Receiver::Accept) => Ok(pb::OfferResponse {
                accepted: true,
                refusal: String::new(),
            }),
            Some(Receiver::Refuse) => Ok(pb::OfferResponse {
                accepted: false,
                refusal: "busy".into(),
            }),
            Some(Receiver::Silent) => std::future::pending().await,
            None => Err(NegotiationFailed::Unreachable("unknown".into())),
        }
    }
    async fn finish(&self, to: &str, req: pb::FinishRequest) -> Result<(), NegotiationFailed> {
        self.finishes
            .lock()
            .unwrap()
            .push((to.to_owned(), req.committed));
        Ok(())
    }
    async fn pull(
        &self,
        to: &str,
        _req: pb::PullRequest,
    ) -> Result<pb::PullResponse, NegotiationFailed> {
        self.pulls.lock().unwrap().push(to.to_owned());
        let r = self.receivers.lock().unwrap().get(to).copied();
        match r {
            Some(Receiver::Accept) => Ok(pb::PullResponse {
                will_push: true,
                pid: 1,
                process_load: 1.0,
                refusal: String::new(),
            }),
            Some(Receiver::Refuse) => Ok(pb::PullResponse {
                refusal: "no_eligible_process".into(),
                ..Default::default()
            }),
            Some(Receiver::Silent) => std::future::pending().await,
            None => Err(NegotiationFailed::Unreachable("unknown".into())),
        }
    }
}

/// Moves the process out of the sampler's list, as a commit does.
struct FakeEngine {
    sampler: Arc<FakeSampler>,
    migrated: Mutex<Vec<(i32, String)>>,
    fail: bool,
}

#[tonic::async_trait]
impl MigrationStarter for FakeEngine {
    fn can_reach(&self, _node: &str) -> bool {
        true
    }
    async fn migrate(&self, pid: i32, to: &str) -> Result<Migrated, MigrationFailed> {
        if self.fail {
            return Err(MigrationFailed::NotCommitted("CRIU said no".into()));
        }
        self.sampler
            .procs
            .lock()
            .unwrap()
            .retain(|&(p, _)| p != pid);
        self.migrated.lock().unwrap().push((pid, to.to_owned()));
        Ok(Migrated {
            migration_id: format!("m{pid}"),
            destination_pid: pid + 1000,
        })
    }
}

struct Rig {
    /// Peers whose broadcasts say their capacity is unknown, and why.
    unknown_capacity: Mutex<HashMap<String, String>>,
    sampler: Arc<FakeSampler>,
    clock: Arc<FakeClock>,
    gossip: Arc<FakeGossip>,
    peers: Arc<FakePeers>,
    engine: Arc<FakeEngine>,
    conductor: Arc<Conductor>,
}

fn policy() -> ferry_policy::Config {
    let mut p = ferry_policy::Config::default();
    // Follow samples exactly and no margin: the arithmetic stays readable.
    p.load.decay = 0.0;
    p.load.stabilizer = 0.0;
    p.load.process_table_weight = 0.0;
    p.transfer.threshold = 100.0;
    p.transfer.average_gap = 0.2;
    p.transfer.calm_down_ms = 5_000;
    p
}

fn rig(procs: &[(i32, f64)], receivers: &[(&str, Receiver)], policy: ferry_policy::Config) -> Rig {
    let clock = Arc::new(FakeClock(AtomicU64::new(1_000_000)));
    let sampler = Arc::new(FakeSampler {
        clock: clock.clone(),
        procs: Mutex::new(procs.to_vec()),
        capacity: Mutex::default(),
    });
    let gossip = Arc::new(FakeGossip::default());
    *gossip.alive.lock().unwrap() = receivers.iter().map(|(n, _)| n.to_string()).collect();
    let peers = Arc::new(FakePeers {
        receivers: Mutex::new(receivers.iter().map(|(n, r)| (n.to_string(), *r)).collect()),
        offers: Mutex::default(),
        finishes: Mutex::default(),
        pulls: Mutex::default(),
    });
    let engine = Arc::new(FakeEngine {
        sampler: sampler.clone(),
        migrated: Mutex::default(),
        fail: false,
    });
    let conductor = Conductor::new(
        "a",
        Settings {
            enabled: true,
            offer_timeout: Duration::from_millis(100),
            policy,
        },
        sampler.clone(),
        engine.clone(),
        peers.clone(),
        gossip.clone(),
        clock.clone(),
    );
    Rig {
        unknown_capacity: Mutex::default(),
        sampler,
        clock,
        gossip,
        peers,
        engine,
        conductor,
    }
}

impl Rig {
    /// `node` says its load is `load`, stamped `skew_ms` off our clock.
    fn hear(&self, node: &str, load: f64) {
        self.hear_entries(node, vec![self.entry(node, load, 0, 0)]);
    }

    fn entry(&self, node: &str, load: f64, skew_ms: i64, age_ms: u64) -> WireEntry {
        WireEntry {
            node: node_id(node).0,
            load,
            stamped_at_ms: (self.clock.now().as_millis() as i64 + skew_ms) as u64,
            age_ms,
        }
    }

    fn hear_entries(&self, node: &str, entries: Vec<WireEntry>) {
        self.gossip.inbox.lock().unwrap().push(LoadBroadcast {
            node: node.into(),
            seq: self.clock.now().as_millis(),
            managed: 1,
            entries,
            capacity_unknown: self
                .unknown_capacity
                .lock()
                .unwrap()
                .get(node)
                .cloned()
                .unwrap_or_default(),
        });
    }

    /// One period: the peers' news, a second later a turn.
    async fn turn(&self, peer_loads: &[(&str, f64)]) -> String {
        self.clock.advance(1_000);
        for (n, l) in peer_loads {
            self.hear(n, *l);
        }
        self.conductor.tick().await
    }

    fn offers(&self) -> Vec<String> {
        self.peers.offers.lock().unwrap().clone()
    }
}

#[tokio::test]
async fn pushes_to_the_lighter_node_and_publishes_its_load() {
    let r = rig(
        &[(1, 1.0), (2, 1.0), (3, 1.0)],
        &[("b", Receiver::Accept)],
        policy(),
    );
    r.turn(&[("b", 0.0)]).await; // first sample: no rate yet
    let d = r.turn(&[("b", 0.0)]).await;
    assert!(d.starts_with("migrated"), "{d}");
    assert_eq!(r.engine.migrated.lock().unwrap().len(), 1);
    assert_eq!(r.offers(), vec!["b"]);
    assert_eq!(
        *r.peers.finishes.lock().unwrap(),
        vec![("b".to_owned(), true)],
        "phase 2 tells the receiver"
    );
    let published = r.gossip.published.lock().unwrap();
    let last = published.last().unwrap();
    assert_eq!(last.node, "a");
    assert!((last.own_load().unwrap() - 3.0).abs() < 1e-6, "{last:?}");
    let report = r.conductor.report();
    assert_eq!(report.migrations.len(), 1);
    assert_eq!(
        report.migrations[0].destination_pid,
        report.migrations[0].source_pid + 1000
    );
    // Why: the beliefs the push acted on, with the migration and as the
    // last turn (whose text is the outcome).
    let why = report.migrations[0]
        .decision
        .clone()
        .expect("the push's beliefs");
    assert!(why.decision.starts_with("push"), "{why:?}");
    assert_eq!(why.pid, report.migrations[0].source_pid);
    assert!(why.process_load > 0.0, "{why:?}");
    assert_eq!(why.destinations, ["b"]);
    assert!((why.load - 3.0).abs() < 1e-6, "{why:?}");
    assert_eq!(why.candidates.len(), 1, "{why:?}");
    assert_eq!(why.candidates[0].node, "b");
    assert!(why.candidates[0].load.abs() < 1e-6, "{why:?}");
    assert!((why.approximate_average - 1.5).abs() < 1e-6, "{why:?}");
    let last = report.last.expect("the last turn");
    assert_eq!(last.decision, d);
    assert_eq!(last.pid, why.pid);
    assert_eq!(r.conductor.last_decision(), last);
}

#[tokio::test]
async fn no_migration_during_calm_down() {
    let r = rig(
        &[(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0)],
        &[("b", Receiver::Accept)],
        policy(),
    );
    r.turn(&[("b", 0.0)]).await;
    assert!(r.turn(&[("b", 0.0)]).await.starts_with("migrated"));
    // Still three processes against an idle peer, but within the 5 s
    // calm-down: nothing is offered.
    for _ in 0..4 {
        let d = r.turn(&[("b", 0.0)]).await;
        assert_eq!(d, "calming down");
    }
    assert_eq!(r.offers().len(), 1);
    assert!(r.conductor.report().calm_down_remaining_ms > 0);
    // 5 s after the commit the node may send again.
    r.turn(&[("b", 0.0)]).await;
    assert_eq!(
        r.offers().len(),
        2,
        "{:?}",
        r.conductor.report().last_decision
    );
}

#[tokio::test]
async fn silent_receiver_times_out_and_the_next_candidate_is_offered() {
    let r = rig(
        &[(1, 1.0), (2, 1.0), (3, 1.0)],
        &[("b", Receiver::Silent), ("c", Receiver::Accept)],
        policy(),
    );
    // Average 1.0 (3 + 0 + 0 over 3); b is the better mirror, so it comes
    // first; it never answers.
    let loads = [("b", 0.0), ("c", 0.05)];
    r.turn(&loads).await;
    let d = r.turn(&loads).await;
    assert_eq!(r.offers(), vec!["b", "c"], "{d}");
    let migrated = r.engine.migrated.lock().unwrap().clone();
    assert_eq!(migrated.len(), 1);
    assert_eq!(migrated[0].1, "c");
    let stats = r.conductor.report().stats.unwrap();
    assert_eq!(stats.offers_timed_out, 1);
    assert_eq!(stats.offers_accepted, 1);
    // The silent node is told to drop whatever it reserved.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        r.peers
            .finishes
            .lock()
            .unwrap()
            .contains(&("b".to_owned(), false))
    );
}

#[tokio::test]
async fn refusal_moves_on_and_an_aborted_migration_leaves_no_calm_down() {
    let mut r = rig(
        &[(1, 1.0), (2, 1.0), (3, 1.0)],
        &[("b", Receiver::Refuse), ("c", Receiver::Accept)],
        policy(),
    );
    r.engine = Arc::new(FakeEngine {
        sampler: Arc::new(FakeSampler {
            clock: r.clock.clone(),
            procs: Mutex::default(),
            capacity: Mutex::default(),
        }),
        migrated: Mutex::default(),
        fail: true,
    });
    // Rebuild with the failing engine.
    let sampler = Arc::new(FakeSampler {
        clock: r.clock.clone(),
        procs: Mutex::new(vec![(1, 1.0), (2, 1.0), (3, 1.0)]),
        capacity: Mutex::default(),
    });
    r.conductor = Conductor::new(
        "a",
        Settings {
            enabled: true,
            offer_timeout: Duration::from_millis(100),
            policy: policy(),
        },
        sampler,
        r.engine.clone(),
        r.peers.clone(),
        r.gossip.clone(),
        r.clock.clone(),
    );
    let loads = [("b", 0.0), ("c", 0.05)];
    r.turn(&loads).await;
    let d = r.turn(&loads).await;
    assert!(d.contains("failed"), "{d}");
    assert_eq!(r.offers(), vec!["b", "c"]);
    assert_eq!(
        *r.peers.finishes.lock().unwrap(),
        vec![("c".to_owned(), false)]
    );
    // Nothing moved: no calm-down, the next turn offers again.
    r.turn(&loads).await;
    assert_eq!(r.offers().len(), 4);
    assert_eq!(r.conductor.report().stats.unwrap().migrations_aborted, 2);
}

#[tokio::test]
async fn a_dead_node_leaves_the_candidates() {
    let r = rig(
        &[(1, 1.0), (2, 1.0), (3, 1.0)],
        &[("b", Receiver::Accept), ("c", Receiver::Accept)],
        policy(),
    );
    r.turn(&[("b", 0.0), ("c", 0.0)]).await;
    let mut names = r.conductor.candidate_names();
    names.sort();
    assert_eq!(names, vec!["b", "c"]);
    // SWIM declares b down: even with its load fresh, it is no candidate.
    r.gossip.alive.lock().unwrap().retain(|n| n != "b");
    r.turn(&[("c", 0.0)]).await;
    assert_eq!(r.conductor.candidate_names(), vec!["c"]);
    assert_eq!(r.offers(), vec!["c"]);
}

#[tokio::test]
async fn silent_peers_age_out_of_the_view() {
    let r = rig(&[(1, 0.1)], &[("b", Receiver::Accept)], policy());
    r.turn(&[("b", 0.0)]).await;
    assert_eq!(r.conductor.candidate_names(), vec!["b"]);
    // Alive for SWIM but no load for longer than information.failure_timeout_ms.
    for _ in 0..5 {
        r.turn(&[]).await;
    }
    assert!(r.conductor.candidate_names().is_empty());
}

#[tokio::test]
async fn stale_and_future_dated_gossip_is_handled() {
    let mut p = policy();
    p.information.kind = InformationKind::Hearsay;
    p.information.vector_size = 4;
    let r = rig(&[(1, 1.0)], &[("b", Receiver::Accept)], p.clone());
    r.clock.advance(1_000);
    // b's own (fresh) load, plus hearsay about c: one entry older than
    // max_age, then (from another message) one stamped an hour ahead.
    let own = r.entry("b", 0.5, 0, 0);
    let stale = r.entry("c", 0.1, -60_000, p.information.max_age_ms + 1);
    r.hear_entries("b", vec![own, stale]);
    r.conductor.tick().await;
    let s = r.conductor.report().stats.unwrap();
    assert_eq!(s.gossip_stale_dropped, 1);
    assert!(
        !r.conductor.report().peers.iter().any(|x| x.node == "c"),
        "a stale entry never enters the view"
    );
    r.clock.advance(1_000);
    let own = r.entry("b", 0.5, 0, 0);
    let future = r.entry("c", 0.1, 3_600_000, 0);
    r.hear_entries("b", vec![own, future]);
    r.conductor.tick().await;
    let report = r.conductor.report();
    assert_eq!(report.stats.unwrap().gossip_future_dated, 1);
    // Kept, but ordered by age only; and it ages out like any other.
    for _ in 0..12 {
        r.clock.advance(1_000);
        r.hear("b", 0.5);
        r.conductor.tick().await;
    }
    assert!(
        !r.conductor.report().peers.iter().any(|x| x.node == "c"),
        "a future-dated entry does not live forever: {:?}",
        r.conductor.report().peers
    );
}

#[tokio::test]
async fn receiver_takes_one_offer_at_a_time_then_calms_down() {
    let r = rig(&[], &[], policy());
    r.turn(&[]).await;
    let offer = |id, from: &str| pb::OfferRequest {
        offer_id: id,
        from_node: from.into(),
        sender_load: 5.0,
        process_load: 1.0,
        pid: 1,
    };
    assert!(r.conductor.on_offer(&offer(1, "x")).accepted);
    let second = r.conductor.on_offer(&offer(2, "y"));
    assert_eq!((second.accepted, second.refusal.as_str()), (false, "busy"));
    r.conductor.on_finish(&pb::FinishRequest {
        offer_id: 1,
        from_node: "x".into(),
        committed: true,
        destination_pid: 77,
    });
    let third = r.conductor.on_offer(&offer(3, "y"));
    assert_eq!(third.refusal, "calming_down");
    r.clock.advance(6_000);
    assert!(r.conductor.on_offer(&offer(4, "y")).accepted);
    // An aborted one frees the slot without calm-down.
    r.conductor.on_finish(&pb::FinishRequest {
        offer_id: 4,
        from_node: "y".into(),
        committed: false,
        destination_pid: 0,
    });
    assert!(r.conductor.on_offer(&offer(5, "z")).accepted);
    let bad = pb::OfferRequest {
        sender_load: f64::NAN,
        ..offer(6, "z")
    };
    assert_eq!(r.conductor.on_offer(&bad).refusal, "invalid");
}

#[tokio::test]
async fn a_light_node_pulls_from_the_loaded_one() {
    let mut p = policy();
    p.transfer.mode = ferry_policy::transfer::TransferMode::ReceiverInitiated;
    let r = rig(&[], &[("b", Receiver::Refuse), ("c", Receiver::Accept)], p);
    let d = r.turn(&[("b", 3.0), ("c", 2.0)]).await;
    // The most loaded first (it had nothing to give), then the next.
    assert_eq!(*r.peers.pulls.lock().unwrap(), vec!["b", "c"]);
    assert_eq!(d, "pulled 1 from c");
    assert!(r.offers().is_empty(), "the giver offers, not the asker");
    let stats = r.conductor.report().stats.unwrap();
    assert_eq!((stats.pulls_sent, stats.pulls_answered), (2, 1));
}

#[tokio::test]
async fn a_pull_is_answered_with_a_push_that_evens_the_pair() {
    // Receiver-initiated on every node: this one never pushes on its own.
    let mut p = policy();
    p.transfer.mode = ferry_policy::transfer::TransferMode::ReceiverInitiated;
    let r = rig(
        &[(1, 1.0), (2, 1.0), (3, 1.0)],
        &[("b", Receiver::Accept)],
        p,
    );
    r.turn(&[("b", 0.0)]).await;
    r.turn(&[("b", 0.0)]).await;
    assert!(r.offers().is_empty());
    let pull = |load: f64| pb::PullRequest {
        from_node: "b".into(),
        requester_load: load,
        deficit: 1.0,
    };
    // 3.0 against 2.5: moving a 1.0 process would not lower the larger.
    assert_eq!(r.conductor.on_pull(&pull(2.5)).refusal, "would_not_help");
    assert_eq!(r.conductor.on_pull(&pull(f64::NAN)).refusal, "invalid");
    let answer = r.conductor.on_pull(&pull(0.0));
    assert!(answer.will_push, "{answer:?}");
    // The gate holds the slot: a second asker waits its turn.
    assert_eq!(r.conductor.on_pull(&pull(0.0)).refusal, "busy");
    // The push runs on its own task: offer, migration, phase 2.
    for _ in 0..100 {
        if !r.peers.finishes.lock().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(r.offers(), vec!["b"]);
    assert_eq!(
        *r.engine.migrated.lock().unwrap(),
        vec![(answer.pid, "b".to_owned())]
    );
    assert_eq!(
        *r.peers.finishes.lock().unwrap(),
        vec![("b".to_owned(), true)]
    );
    let report = r.conductor.report();
    assert_eq!(report.stats.unwrap().pulls_given, 1);
    let why = report.migrations[0].decision.clone().unwrap();
    assert!(why.decision.contains("(pulled)"), "{why:?}");
    assert_eq!(
        (why.pid, why.destinations.clone()),
        (answer.pid, vec!["b".to_owned()])
    );
    // Committed: the calm-down holds the next pull.
    assert_eq!(r.conductor.on_pull(&pull(0.0)).refusal, "calming_down");
}

#[tokio::test]
async fn with_replan_on_commit_a_turn_sheds_the_whole_excess() {
    let mut p = policy();
    p.transfer.calm_down_ms = 0;
    p.transfer.replan_on_commit = true;
    p.transfer.count_promised = true;
    p.load.follow_migrations = true;
    let procs = [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0)];
    let receivers = [("b", Receiver::Accept), ("c", Receiver::Accept)];
    let r = rig(&procs, &receivers, p.clone());
    r.turn(&[("b", 0.0), ("c", 0.0)]).await;
    r.turn(&[("b", 0.0), ("c", 0.0)]).await;
    // 4 against 0 and 0: after each move the load follows (3, 2) and the
    // promised load is counted (b 1, c 1); the node stops within the gap
    // of the average.
    let moved = r.engine.migrated.lock().unwrap().clone();
    assert!(moved.len() >= 2, "{moved:?}");
    let to_b = moved.iter().filter(|(_, to)| to == "b").count();
    assert!(
        to_b >= 1 && to_b < moved.len(),
        "spread over both: {moved:?}"
    );
    // Without it, one move a turn.
    p.transfer.replan_on_commit = false;
    let r = rig(&procs, &receivers, p);
    r.turn(&[("b", 0.0), ("c", 0.0)]).await;
    r.turn(&[("b", 0.0), ("c", 0.0)]).await;
    assert_eq!(r.engine.migrated.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn a_process_that_arrived_does_not_hop_on_within_its_residency() {
    let mut p = policy();
    p.selection.rehop_residency_ms = 30_000;
    p.transfer.calm_down_ms = 0;
    let r = rig(&[(77, 1.0), (78, 1.0)], &[("b", Receiver::Accept)], p);
    r.turn(&[]).await;
    let offer = pb::OfferRequest {
        offer_id: 1,
        from_node: "b".into(),
        sender_load: 5.0,
        process_load: 1.0,
        pid: 7,
    };
    assert!(r.conductor.on_offer(&offer).accepted);
    r.conductor.on_finish(&pb::FinishRequest {
        offer_id: 1,
        from_node: "b".into(),
        committed: true,
        destination_pid: 77,
    });
    // 78 started here and goes; 77 arrived a second ago and stays.
    r.turn(&[("b", 0.0)]).await;
    r.clock.advance(2_000);
    r.turn(&[("b", 0.0)]).await;
    assert_eq!(
        *r.engine.migrated.lock().unwrap(),
        vec![(78, "b".to_owned())]
    );
    let d = r.turn(&[("b", 0.0)]).await;
    assert_eq!(d, "overloaded, no eligible process");
    r.clock.advance(30_000);
    let d = r.turn(&[("b", 0.0)]).await;
    assert!(d.starts_with("migrated 77"), "{d}");
}

#[tokio::test]
async fn loads_are_measured_against_the_capacity_and_an_unknown_one_is_no_candidate() {
    let r = rig(
        &[(1, 0.25), (2, 0.25)],
        &[("b", Receiver::Accept), ("c", Receiver::Accept)],
        policy(),
    );
    *r.sampler.capacity.lock().unwrap() = capacity::Capacity::Cgroup(0.5);
    r.unknown_capacity.lock().unwrap().insert(
        "c".into(),
        "/sys/fs/cgroup/cpu/ferry/c: not readable".into(),
    );
    r.turn(&[("b", 0.4), ("c", 0.0)]).await;
    let d = r.turn(&[("b", 0.4), ("c", 0.0)]).await;
    // Two quarter-CPU loops on half a CPU: load 1.0, not 0.5.
    assert!((r.conductor.local_load() - 1.0).abs() < 1e-6);
    // c looks idle but cannot say what its load means: b gets the push.
    assert_eq!(r.conductor.candidate_names(), vec!["b"]);
    assert!(d.starts_with("migrated"), "{d}");
    assert_eq!(r.offers(), vec!["b"]);
    // This node's own capacity unknown: its message says why.
    *r.sampler.capacity.lock().unwrap() = capacity::Capacity::Unknown("no cgroup".into());
    r.turn(&[]).await;
    let published = r.gossip.published.lock().unwrap();
    assert_eq!(published.last().unwrap().capacity_unknown, "no cgroup");
}

#[tokio::test]
async fn off_means_no_offers_and_refusals() {
    let r = rig(&[(1, 1.0), (2, 1.0)], &[("b", Receiver::Accept)], policy());
    r.conductor.set(Some(false), policy()).unwrap();
    r.turn(&[("b", 0.0)]).await;
    assert_eq!(r.turn(&[("b", 0.0)]).await, "off");
    assert!(r.offers().is_empty());
    assert!(
        !r.gossip.published.lock().unwrap().is_empty(),
        "load is still published"
    );
    let o = r.conductor.on_offer(&pb::OfferRequest {
        offer_id: 1,
        from_node: "b".into(),
        sender_load: 9.0,
        process_load: 0.1,
        pid: 3,
    });
    assert_eq!(o.refusal, "disabled");
}

#[test]
fn set_rejects_invalid_values_naming_the_field() {
    let r = rig(&[], &[], policy());
    let mut p = policy();
    p.transfer.threshold = -1.0;
    match r.conductor.set(None, p) {
        Err(SetError::Invalid { field, .. }) => assert_eq!(field, "transfer.threshold"),
        other => panic!("{other:?}"),
    }
    let mut p = policy();
    p.transfer.calm_down_ms = 1;
    r.conductor.set(Some(true), p).unwrap();
    assert_eq!(r.conductor.settings().policy.transfer.calm_down_ms, 1);
}

#[test]
fn node_ids_are_stable() {
    assert_eq!(node_id("node1"), node_id("node1"));
    assert_ne!(node_id("node1"), node_id("node2"));
}
