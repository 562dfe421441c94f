//! Automatic load balancing in the namespace cluster: SWIM membership, the
//! conductors' load exchange and two-phase commit, real migrations. Root
//! only; run by `cargo xtask integration -- balancing`.
//!
//! Load here is what the agents measure: the CPU demand (run + runqueue
//! wait, schedstat) of the processes each node manages, per CPU of the
//! machine. The nodes are network namespaces on one 2-core kernel, so
//! /proc/loadavg is the same on every node and says nothing about one
//! node; the managed processes' demand does.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{list, migrate, run, runtime, wait_for_process};
use ferry_integration::topology::Family;
use ferry_proto::v1::control_client::ControlClient;
use ferry_proto::v1::{
    Balancer, GetBalancerRequest, ListNodesRequest, MigrationOutcome, SetBalancerRequest,
};
use tonic::transport::Channel;

/// Busy loops started on node1.
const BURNS: usize = 6;
/// Calm-down after each migration, on both ends (`policy.transfer`), and
/// the residency a process needs before it may move again.
const CALM_DOWN_MS: u64 = 8_000;
/// The spread (max minus min of the nodes' loads as the agents measure
/// them) must fall to this... One busy loop is 0.5 on 2 CPUs: 0.75 means
/// the 6 loops sit 2/2/2 (3/2/1 is a spread of 1.0).
const SPREAD_BOUND: f64 = 0.75;
/// ...within this long after the loops started (generous: 2 cores run 3
/// agents, 6 loops, CRIU, and another engineer's benchmarks).
const SPREAD_WITHIN: Duration = Duration::from_secs(180);
/// A killed agent must leave the other nodes' candidates within this long
/// (SWIM: probe period 0.5 s, suspicion 2 s).
const DETECT_WITHIN: Duration = Duration::from_secs(15);

const CONFIG: &str = r#"
[membership]
enabled = true
probe_period_ms = 500
suspect_to_down_ms = 2000
beacon_interval_ms = 1000

[balancer]
enabled = true
period_ms = 1000
offer_timeout_ms = 2000

[policy.load]
decay = 0.3
stabilizer = 0.25

[policy.transfer]
threshold = 100.0
average_gap = 0.2
calm_down_ms = 8000

[policy.selection]
min_residency_ms = 8000
"#;

fn burn_bin() -> String {
    env!("CARGO_BIN_EXE_ferry-burn").to_owned()
}

async fn balancer(c: &mut ControlClient<Channel>) -> Balancer {
    c.get_balancer(GetBalancerRequest::default())
        .await
        .expect("GetBalancer")
        .into_inner()
}

/// Waits until `control`'s node sees `others` members alive.
async fn wait_for_members(cluster: &Cluster, control: &mut ControlClient<Channel>, others: usize) {
    let t0 = Instant::now();
    loop {
        let r = control
            .list_nodes(ListNodesRequest {})
            .await
            .expect("ListNodes")
            .into_inner();
        let alive = r
            .nodes
            .iter()
            .filter(|n| !n.is_self && n.membership_state == "alive")
            .count();
        if alive == others {
            eprintln!(
                "membership: {others} alive members seen after {:?}",
                t0.elapsed()
            );
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "membership did not form: {:#?}\n{}",
            r.nodes,
            cluster.log_tail("node1", 30)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Samples the nodes' loads once a second until the spread (max minus min
/// of the loads the agents measure) is within [`SPREAD_BOUND`] with every
/// node running some of the `processes`; fails after [`SPREAD_WITHIN`].
/// Returns when, and every node's balancer then.
async fn until_spread(
    cluster: &Cluster,
    controls: &mut [ControlClient<Channel>],
    processes: usize,
) -> (Duration, Vec<Balancer>) {
    let started = Instant::now();
    let mut last_print = Instant::now() - Duration::from_secs(10);
    loop {
        let mut loads = Vec::new();
        let mut counts = Vec::new();
        for c in controls.iter_mut() {
            loads.push(balancer(c).await.local_load);
            counts.push(list(c).await.len());
        }
        let max = loads.iter().cloned().fold(f64::MIN, f64::max);
        let min = loads.iter().cloned().fold(f64::MAX, f64::min);
        let spread = max - min;
        let shown: Vec<String> = loads.iter().map(|l| format!("{l:.2}")).collect();
        if last_print.elapsed() >= Duration::from_secs(5) {
            eprintln!(
                "t={:>5.1}s loads {shown:?} processes {counts:?} spread {spread:.2}",
                started.elapsed().as_secs_f64(),
            );
            last_print = Instant::now();
        }
        if spread <= SPREAD_BOUND
            && counts.iter().sum::<usize>() == processes
            && counts.iter().all(|&c| c > 0)
        {
            let reached = started.elapsed();
            eprintln!(
                "spread {spread:.2} <= {SPREAD_BOUND} after {:.1} s: loads {shown:?}, processes per node {counts:?}",
                reached.as_secs_f64(),
            );
            let mut reports = Vec::new();
            for c in controls.iter_mut() {
                reports.push(balancer(c).await);
            }
            return (reached, reports);
        }
        if started.elapsed() > SPREAD_WITHIN {
            let mut reports = Vec::new();
            for c in controls.iter_mut() {
                reports.push(balancer(c).await);
            }
            panic!(
                "spread did not fall to {SPREAD_BOUND} within {SPREAD_WITHIN:?}: {:#?}\n{}",
                reports,
                cluster.log_tail("node1", 40)
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Checks every committed migration's reason (the push that chose it
/// believed the destination lighter than its own node) and that no process
/// moved twice within `min_gap_ms`; returns how many committed.
fn check_moves(reports: &[Balancer], min_gap_ms: u64, reached: Duration) -> usize {
    let mut by_process: BTreeMap<Vec<String>, Vec<(u64, String, String)>> = BTreeMap::new();
    let mut committed = 0;
    for r in reports {
        for m in r.migrations.iter().filter(|m| m.committed) {
            committed += 1;
            let why = m.decision.as_ref().expect("the turn's beliefs");
            assert_eq!(why.pid, m.source_pid, "{why:?}");
            assert!(why.destinations.contains(&m.to_node), "{why:?}");
            let believed = why
                .candidates
                .iter()
                .find(|c| c.node == m.to_node)
                .unwrap_or_else(|| panic!("{} not among the candidates: {why:?}", m.to_node));
            assert!(believed.load < why.load, "{why:?}");
            by_process.entry(m.argv.clone()).or_default().push((
                m.at_unix_ms,
                m.from_node.clone(),
                m.to_node.clone(),
            ));
        }
    }
    for (argv, moves) in by_process.iter_mut() {
        moves.sort();
        for w in moves.windows(2) {
            assert!(
                w[1].0 - w[0].0 >= min_gap_ms,
                "{argv:?} moved twice within {min_gap_ms} ms: {moves:?}"
            );
        }
    }
    let aborted: u64 = reports
        .iter()
        .map(|r| r.stats.unwrap_or_default().migrations_aborted)
        .sum();
    eprintln!(
        "balanced in {:.1} s with {committed} committed migrations ({aborted} aborted); moves per process {:?}",
        reached.as_secs_f64(),
        by_process.values().map(|v| v.len()).collect::<Vec<_>>()
    );
    committed
}

#[test]
fn balancing_spreads_cpu_bound_processes_and_drops_a_dead_node() {
    if !ferry_integration::can_run("balancing_spreads_cpu_bound_processes_and_drops_a_dead_node") {
        return;
    }
    let rt = runtime();
    let spec = ClusterSpec {
        extra_config: CONFIG.into(),
        ..ClusterSpec::new(3, 1)
    };
    let mut cluster = Cluster::start(spec).expect("cluster");
    let nodes = ["node1", "node2", "node3"];
    rt.block_on(async {
        let mut controls = Vec::new();
        for n in nodes {
            controls.push(cluster.control(n).await.expect("control"));
        }

        wait_for_members(&cluster, &mut controls[0], 2).await;

        // Bad input through Control: the field is named, nothing changes.
        let err = controls[0]
            .set_balancer(SetBalancerRequest {
                enabled: None,
                settings: vec![ferry_proto::v1::PolicySetting {
                    key: "transfer.threshold".into(),
                    value: "-1".into(),
                }],
                ..Default::default()
            })
            .await
            .expect_err("a negative threshold is refused");
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("transfer.threshold"), "{err:?}");

        for i in 0..BURNS {
            run(&mut controls[0], vec![burn_bin(), "--id".into(), i.to_string()]).await;
        }
        let (reached, reports) = until_spread(&cluster, &mut controls, BURNS).await;
        let committed = check_moves(&reports, CALM_DOWN_MS, reached);
        assert!(committed >= 2, "at least two loops had to leave node1");

        // Kill node3's agent (SIGKILL: no goodbye); node1 must see it down
        // and drop it from the location candidates.
        let pid = cluster.agent_pid("node3");
        // SAFETY: kill(2) on a PID this test's cluster started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let killed = Instant::now();
        loop {
            let r = controls[0]
                .list_nodes(ListNodesRequest {})
                .await
                .expect("ListNodes")
                .into_inner();
            let n3 = r.nodes.iter().find(|n| n.name == "node3").expect("node3 listed");
            if n3.membership_state == "down" && !n3.candidate {
                eprintln!(
                    "node3's agent killed: node1 saw it down and dropped it from the candidates after {:.2} s",
                    killed.elapsed().as_secs_f64()
                );
                let n2 = r.nodes.iter().find(|n| n.name == "node2").expect("node2 listed");
                assert_eq!(n2.membership_state, "alive");
                break;
            }
            assert!(
                killed.elapsed() < DETECT_WITHIN,
                "node3 still {} / candidate {} after {DETECT_WITHIN:?}",
                n3.membership_state,
                n3.candidate
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let _ = cluster.stop_agent("node3");
}

/// No `[[peers]]` at all: the agents find each other by membership's
/// beacon on the cluster network, list each other, and a process migrates
/// to a node that no configuration names.
#[test]
fn nodes_found_by_membership_alone_are_listed_and_migrated_to() {
    if !ferry_integration::can_run("nodes_found_by_membership_alone_are_listed_and_migrated_to") {
        return;
    }
    nodes_found_by_membership_alone_in(Family::V4);
}

/// The same on an IPv6 cluster network: the beacon goes to the link's
/// all-nodes group, SWIM and the Peer API (mutual TLS) run over IPv6.
#[test]
fn nodes_found_by_membership_alone_on_an_ipv6_cluster_network_are_migrated_to() {
    if !ferry_integration::can_run(
        "nodes_found_by_membership_alone_on_an_ipv6_cluster_network_are_migrated_to",
    ) {
        return;
    }
    nodes_found_by_membership_alone_in(Family::V6);
}

fn nodes_found_by_membership_alone_in(cluster_family: Family) {
    let rt = runtime();
    let spec = ClusterSpec {
        extra_config: "[membership]\nenabled = true\nbeacon_interval_ms = 500\n".into(),
        static_peers: false,
        cluster_family,
        ..ClusterSpec::new(2, 1)
    };
    let cluster = Cluster::start(spec).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut node2 = cluster.control("node2").await.expect("control node2");
        let t0 = Instant::now();
        loop {
            let r = node1
                .list_nodes(ListNodesRequest {})
                .await
                .expect("ListNodes")
                .into_inner();
            if let Some(n) = r
                .nodes
                .iter()
                .find(|n| n.name == "node2" && n.membership_state == "alive")
            {
                eprintln!("node1 found node2 by its beacon after {:?}", t0.elapsed());
                let at: std::net::SocketAddr = n.peer_address.parse().expect("peer address");
                assert_eq!(at.ip(), cluster.node_cluster_ip("node2"), "{n:?}");
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "node1 never found node2: {:#?}\n{}",
                r.nodes,
                cluster.log_tail("node1", 30)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let pid = run(&mut node1, vec![burn_bin(), "--id".into(), "0".into()]).await;
        let (report, status) = migrate(&mut node1, pid, "node2")
            .await
            .expect("Migrate to a discovered node");
        assert!(status.is_none(), "{status:?}\n{report:#?}");
        assert_eq!(
            report.outcome,
            MigrationOutcome::Committed as i32,
            "{report:#?}"
        );
        wait_for_process(&mut node2, report.destination_pid, |p| p.state == "running").await;
        assert!(
            !list(&mut node1).await.iter().any(|p| p.pid == pid),
            "the process is still managed on node1"
        );
        assert!(
            matches!(
                ferry_integration::managed::process_state(pid),
                None | Some('Z')
            ),
            "the source copy still runs"
        );
    });
}

/// Receiver-initiated transfer (`transfer.mode = "receiver_initiated"` on
/// every node, so that no node pushes on its own): the idle node asks the
/// loaded one for work, the loaded one gives a process at a time through
/// the two-phase commit, until the two are within the gap.
#[test]
fn an_idle_node_pulls_work_from_a_loaded_one() {
    if !ferry_integration::can_run("an_idle_node_pulls_work_from_a_loaded_one") {
        return;
    }
    const LOOPS: usize = 4;
    let config = CONFIG
        .replace(
            "threshold = 100.0",
            "mode = \"receiver_initiated\"\nthreshold = 100.0",
        )
        .replace("calm_down_ms = 8000", "calm_down_ms = 4000")
        .replace("min_residency_ms = 8000", "min_residency_ms = 4000");
    let rt = runtime();
    let spec = ClusterSpec {
        extra_config: config,
        ..ClusterSpec::new(2, 1)
    };
    let cluster = Cluster::start(spec).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control");
        let mut node2 = cluster.control("node2").await.expect("control");
        let mode = balancer(&mut node2).await.policy_toml;
        assert!(mode.contains("receiver_initiated"), "{mode}");
        for i in 0..LOOPS {
            run(&mut node1, vec![burn_bin(), "--id".into(), i.to_string()]).await;
        }
        // Four loops on node1, none on node2: two must move, by pulls.
        let started = Instant::now();
        let mut last_print = Instant::now() - Duration::from_secs(10);
        loop {
            let counts = (list(&mut node1).await.len(), list(&mut node2).await.len());
            if last_print.elapsed() >= Duration::from_secs(5) {
                eprintln!(
                    "t={:>5.1}s processes {counts:?}",
                    started.elapsed().as_secs_f64()
                );
                last_print = Instant::now();
            }
            if counts == (2, 2) {
                eprintln!("2/2 after {:.1} s", started.elapsed().as_secs_f64());
                break;
            }
            assert!(
                started.elapsed() < SPREAD_WITHIN,
                "processes {counts:?} after {SPREAD_WITHIN:?}: {:#?}\n{:#?}\n{}",
                balancer(&mut node1).await,
                balancer(&mut node2).await,
                cluster.log_tail("node1", 40)
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let (giver, asker) = (balancer(&mut node1).await, balancer(&mut node2).await);
        let (gs, ask) = (
            giver.stats.unwrap_or_default(),
            asker.stats.unwrap_or_default(),
        );
        eprintln!(
            "node2 sent {} pulls, {} answered; node1 gave {}",
            ask.pulls_sent, ask.pulls_answered, gs.pulls_given
        );
        assert!(
            ask.pulls_answered >= 2 && gs.pulls_given >= 2,
            "{ask:?} {gs:?}"
        );
        assert_eq!(
            gs.offers_sent, gs.pulls_given,
            "node1 offered only what was asked for"
        );
        assert!(
            asker.migrations.is_empty(),
            "node2 never pushed: {:?}",
            asker.migrations
        );
        let committed: Vec<_> = giver.migrations.iter().filter(|m| m.committed).collect();
        assert_eq!(committed.len(), 2, "{:#?}", giver.migrations);
        for m in committed {
            let why = m.decision.as_ref().expect("the pull's beliefs");
            assert!(why.decision.contains("(pulled)"), "{why:?}");
            assert_eq!(m.to_node, "node2");
            // Given because it lowers the larger load: the asker said it
            // was lighter by more than the process.
            let asked = &why.candidates[0];
            assert!(asked.load + why.process_load < why.load, "{why:?}");
        }
    });
}

/// ferry's own policies, as docs/balancing.md gives them, in ferryd: the
/// six loops spread 2 / 2 / 2 with no process moving twice (a process
/// that arrived stays 30 s).
#[test]
fn ferrys_policies_spread_cpu_bound_processes() {
    if !ferry_integration::can_run("ferrys_policies_spread_cpu_bound_processes") {
        return;
    }
    let config = format!(
        "{}\n{}",
        CONFIG
            .replace("average_gap = 0.2", "average_gap = 0.0")
            .replace("calm_down_ms = 8000", "calm_down_ms = 2000"),
        r#"
[policy.location]
kind = "least_loaded"
"#
    )
    .replace(
        "[policy.load]",
        "[policy.load]\nfollow_migrations = true",
    )
    .replace(
        "[policy.transfer]",
        "[policy.transfer]\nreceiver_up_to_average = true\ncount_promised = true\nreplan_on_commit = true",
    )
    .replace(
        "[policy.selection]",
        "[policy.selection]\nrehop_residency_ms = 30000",
    );
    let rt = runtime();
    let spec = ClusterSpec {
        extra_config: config,
        ..ClusterSpec::new(3, 1)
    };
    let cluster = Cluster::start(spec).expect("cluster");
    rt.block_on(async {
        let mut controls = Vec::new();
        for n in ["node1", "node2", "node3"] {
            controls.push(cluster.control(n).await.expect("control"));
        }
        let policy = balancer(&mut controls[1]).await.policy_toml;
        for key in [
            "follow_migrations = true",
            "count_promised = true",
            "rehop_residency_ms = 30000",
        ] {
            assert!(policy.contains(key), "{key} not in force: {policy}");
        }
        wait_for_members(&cluster, &mut controls[0], 2).await;
        for i in 0..BURNS {
            run(
                &mut controls[0],
                vec![burn_bin(), "--id".into(), i.to_string()],
            )
            .await;
        }
        let (reached, reports) = until_spread(&cluster, &mut controls, BURNS).await;
        // 30 s: within the test no process moves twice.
        let committed = check_moves(&reports, 30_000, reached);
        assert!(committed >= 4, "four loops had to leave node1: {committed}");
    });
}

/// `[balancer] cpu_cgroup`: node1's managed processes are kept in a cgroup
/// with half a CPU and its load is measured against that; a process that
/// migrates to node2 ends in node2's cgroup (a whole CPU); node3's cgroup
/// does not exist, so its capacity is unknown and node1 does not count it a
/// location candidate, saying why.
#[test]
fn a_node_measures_its_load_against_its_cpu_cgroup() {
    if !ferry_integration::can_run("a_node_measures_its_load_against_its_cpu_cgroup") {
        return;
    }
    use ferry_integration::cpu_cgroup::CpuCgroup;
    let name = format!("ferry-test-{}", std::process::id());
    let half = CpuCgroup::create(&format!("{name}-node1"), 0.5).expect("a CPU cgroup");
    let whole = CpuCgroup::create(&format!("{name}-node2"), 1.0).expect("a CPU cgroup");
    let missing = half.path().with_file_name(format!("{name}-missing"));
    let balancer_table = |cgroup: &std::path::Path| {
        format!(
            "[balancer]\nenabled = true\nperiod_ms = 1000\ncpu_cgroup = \"{}\"\n",
            cgroup.display()
        )
    };
    // CONFIG without its [balancer] table (each node has its own).
    let (membership, rest) = CONFIG.split_once("[balancer]").unwrap();
    let policy = &rest[rest.find("[policy.load]").unwrap()..];
    let spec = ClusterSpec {
        extra_config: format!("{membership}{policy}"),
        node_config: vec![
            ("node1".into(), balancer_table(half.path())),
            ("node2".into(), balancer_table(whole.path())),
            ("node3".into(), balancer_table(&missing)),
        ],
        ..ClusterSpec::new(3, 1)
    };
    let rt = runtime();
    let cluster = Cluster::start(spec).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control");
        let mut node2 = cluster.control("node2").await.expect("control");
        wait_for_members(&cluster, &mut node1, 2).await;
        let pid = run(&mut node1, vec![burn_bin(), "--id".into(), "0".into()]).await;
        let started = Instant::now();
        loop {
            let load = balancer(&mut node1).await.local_load;
            let nodes = node1
                .list_nodes(ListNodesRequest {})
                .await
                .expect("ListNodes")
                .into_inner()
                .nodes;
            let node3 = nodes
                .iter()
                .find(|n| n.name == "node3")
                .expect("node3 listed");
            // One busy loop: 0.5 against the machine's 2 CPUs, about 1.0
            // against half a CPU (its whole share).
            if half.pids().contains(&pid) && load >= 0.9 && !node3.not_candidate.is_empty() {
                eprintln!(
                    "the loop is in {}; load {load:.2}; node3: {}",
                    half.path().display(),
                    node3.not_candidate
                );
                assert!(!node3.candidate);
                assert!(
                    node3.not_candidate.contains("CPU capacity is unknown")
                        && node3.not_candidate.contains(&format!("{name}-missing")),
                    "{}",
                    node3.not_candidate
                );
                let node2 = nodes
                    .iter()
                    .find(|n| n.name == "node2")
                    .expect("node2 listed");
                assert!(node2.not_candidate.is_empty(), "{node2:?}");
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "in the cgroup: {:?}, load {load}, node3 {node3:?}\n{}",
                half.pids(),
                cluster.log_tail("node1", 30)
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let (report, status) = migrate(&mut node1, pid, "node2").await.expect("Migrate");
        assert!(status.is_none(), "{status:?}\n{report:#?}");
        assert_eq!(
            report.outcome,
            MigrationOutcome::Committed as i32,
            "{report:#?}"
        );
        let moved = report.destination_pid;
        let started = Instant::now();
        loop {
            let load = balancer(&mut node2).await.local_load;
            // About 1.0: the loop has its whole CPU there.
            if whole.pids().contains(&moved) && !half.pids().contains(&moved) && load >= 0.8 {
                eprintln!(
                    "after the migration the loop is in {}; node2's load {load:.2}",
                    whole.path().display()
                );
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "node2's cgroup holds {:?}, node1's {:?}; node2's load {load}\n{}",
                whole.pids(),
                half.pids(),
                cluster.log_tail("node2", 30)
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    drop(cluster);
}
