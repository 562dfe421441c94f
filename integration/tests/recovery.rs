//! Agents that crash in the middle of a migration and come back: a
//! ferryd started with `FERRY_FAULT_AT=<side>:<point>` kills itself
//! (SIGKILL) there; restarted, it settles the migration from its journal
//! and, past the source's Release, from the destination's word. After
//! each: the process runs on exactly one node, never zero, never two; its
//! connections carry on with every byte once and in order; nothing of the
//! migration is left in either journal but the destination's record of a
//! commit. Root only; run by `cargo xtask test`.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{
    follow_migration, list, process_state, run, runtime, wait_for_process,
};
use ferry_integration::workload::SeqClient;
use ferry_proto::v1::control_client::ControlClient;
use ferry_proto::v1::{MigrateRequest, MigrationOutcome, Strategy, migration_event};
use tonic::transport::Channel;

const SHARED_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
const ECHO_PORT: u16 = 7000;
const CONNECTIONS: usize = 4;

/// A two-node cluster (short peer timeout) whose `crashing` node's agent
/// runs with the crash point `at`.
fn cluster_crashing(crashing: &str, at: &str) -> Cluster {
    let mut spec = ClusterSpec::new(2, 1);
    spec.extra_config = "peer_timeout_secs = 2\n".into();
    let mut cluster = Cluster::start(spec).expect("cluster");
    cluster
        .start_agent_with_env(crashing, &[("FERRY_FAULT_AT", at)])
        .expect("the agent with its crash point");
    cluster
}

/// The echo server on node1 with [`CONNECTIONS`] clients from client1,
/// once node1 counts them all, and what each client had verified then.
async fn echo_server(cluster: &Cluster) -> (i32, SeqClient, Vec<u64>) {
    let mut node1 = cluster.control("node1").await.expect("control node1");
    let pid = run(
        &mut node1,
        vec![
            env!("CARGO_BIN_EXE_ferry-echo-server").to_owned(),
            "--port".into(),
            ECHO_PORT.to_string(),
        ],
    )
    .await;
    wait_for_process(&mut node1, pid, |p| p.tcp_listening == 1).await;
    let client = SeqClient::dve(
        cluster.netns_path("client1"),
        SocketAddrV4::new(SHARED_IP, ECHO_PORT),
        CONNECTIONS,
    )
    .expect("clients with traffic flowing");
    wait_for_process(&mut node1, pid, |p| {
        p.tcp_established as usize == CONNECTIONS
    })
    .await;
    let before = client.verified_per_connection();
    (pid, client, before)
}

fn request(pid: i32, strategy: Strategy) -> MigrateRequest {
    MigrateRequest {
        pid,
        destination_node: "node2".into(),
        strategy: strategy as i32,
        ..Default::default()
    }
}

/// Runs a migration whose source agent dies on the way: the stream breaks
/// without a report.
async fn migrate_into_a_crash(node1: &mut ControlClient<Channel>, req: MigrateRequest) {
    let mut stream = node1
        .migrate(req)
        .await
        .expect("migration starts")
        .into_inner();
    loop {
        match stream.message().await {
            Ok(Some(ev)) => {
                if let Some(migration_event::Event::Report(r)) = ev.event {
                    panic!("the migration ended although its agent was to die: {r:#?}");
                }
            }
            Ok(None) => panic!("the stream ended cleanly although its agent was to die"),
            Err(_) => return,
        }
    }
}

/// The node's agent died by its crash point (SIGKILL).
fn crashed(cluster: &mut Cluster, node: &str) {
    use std::os::unix::process::ExitStatusExt as _;
    let status = cluster
        .wait_agent_exit(node, Duration::from_secs(60))
        .unwrap_or_else(|| panic!("{node}'s agent did not reach its crash point"));
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "{node}'s agent ended otherwise: {status:?}\n{}",
        cluster.log_tail(node, 30)
    );
}

/// Waits (bounded) until `cond` holds, polling every 50 ms.
async fn eventually(what: &str, within: Duration, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond().await {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The process runs on node1 (the source) again and not on node2, every
/// connection carries on, and nothing of the migration is left.
async fn carries_on_at_node1(cluster: &Cluster, pid: i32, client: SeqClient, before: &[u64]) {
    let mut node1 = cluster.control("node1").await.expect("control node1");
    let mut node2 = cluster.control("node2").await.expect("control node2");
    let p = wait_for_process(&mut node1, pid, |p| p.state == "running").await;
    assert!(p.note.is_empty(), "{p:?}");
    assert_ne!(process_state(pid), Some('T'), "still stopped");
    client
        .wait_until_each_passes(before, 20, Duration::from_secs(30))
        .expect("every connection flows on node1");
    assert_eq!(
        cluster.established_tcp("node1", ECHO_PORT).len(),
        CONNECTIONS
    );
    assert!(cluster.established_tcp("node2", ECHO_PORT).is_empty());
    client.stop().assert_clean();
    eventually(
        "node2 drops its copy",
        Duration::from_secs(20),
        async || list(&mut node2).await.is_empty() && cluster.incoming_dir_is_empty("node2"),
    )
    .await;
    assert_eq!(cluster.journal_records("node1"), vec![]);
    assert_eq!(cluster.journal_records("node2"), vec![]);
}

/// The process runs on node2 (the destination) and not on node1, every
/// connection carries on there; node2 keeps only its record of the
/// commit.
async fn carries_on_at_node2(cluster: &Cluster, pid: i32, client: SeqClient, before: &[u64]) {
    let mut node1 = cluster.control("node1").await.expect("control node1");
    let mut node2 = cluster.control("node2").await.expect("control node2");
    eventually("node1's copy goes", Duration::from_secs(30), async || {
        process_state(pid).is_none_or(|s| s == 'Z') && list(&mut node1).await.is_empty()
    })
    .await;
    let moved = list(&mut node2).await;
    assert_eq!(moved.len(), 1, "{moved:?}");
    let p = wait_for_process(&mut node2, moved[0].pid, |p| {
        p.state == "running" && p.tcp_established as usize == CONNECTIONS
    })
    .await;
    assert_eq!(p.origin, "migrated-in");
    client
        .wait_until_each_passes(before, 20, Duration::from_secs(30))
        .expect("every connection flows on node2");
    assert!(cluster.established_tcp("node1", ECHO_PORT).is_empty());
    assert_eq!(
        cluster.established_tcp("node2", ECHO_PORT).len(),
        CONNECTIONS
    );
    client.stop().assert_clean();
    assert_eq!(cluster.journal_records("node1"), vec![]);
    let kept = cluster.journal_records("node2");
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert!(kept[0].1.contains("\"committed\""), "{kept:?}");
}

/// Where the process runs once the killed agent is back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ends {
    /// On node1, the source: the migration rolled back.
    OnSource,
    /// On node2, the destination: the migration committed.
    Moved,
}

/// One agent killed at one point of a migration from node1 to node2, and
/// what must follow once it is restarted.
struct AgentKilled {
    /// `FERRY_FAULT_AT` (with `:kill`, the default): its side names the
    /// node whose agent dies.
    at: &'static str,
    strategy: Strategy,
    /// The stage of the dead agent's journal record of the migration.
    record: &'static str,
    ends: Ends,
}

/// Every point an agent is killed at, in the order a migration reaches
/// them; a new point is a new row. What each means: `docs/faults.md`.
const AGENT_KILLED: &[AgentKilled] = &[
    // The source's agent, before the freeze: the process runs on.
    AgentKilled {
        at: "source:PreCopy",
        strategy: Strategy::PreCopy,
        record: "started",
        ends: Ends::OnSource,
    },
    AgentKilled {
        at: "source:Arm",
        strategy: Strategy::TotalCopy,
        record: "started",
        ends: Ends::OnSource,
    },
    // In the freeze: CRIU holds the tree, the ports are cut off.
    AgentKilled {
        at: "source:TreeFrozen",
        strategy: Strategy::PreCopy,
        record: "started",
        ends: Ends::OnSource,
    },
    // The case: dumped, stopped, the images about to leave.
    AgentKilled {
        at: "source:Transfer",
        strategy: Strategy::PreCopy,
        record: "started",
        ends: Ends::OnSource,
    },
    AgentKilled {
        at: "source:Restore",
        strategy: Strategy::TotalCopy,
        record: "started",
        ends: Ends::OnSource,
    },
    // Released, the Commit not sent: node2, asked, aborts.
    AgentKilled {
        at: "source:Committing",
        strategy: Strategy::TotalCopy,
        record: "released",
        ends: Ends::OnSource,
    },
    // The Commit answered, the stopped copy not yet killed: node2, asked,
    // says it committed. The pages left out of the dump come from node2's
    // own store: the process never waits for node1.
    AgentKilled {
        at: "source:Discard",
        strategy: Strategy::PreCopy,
        record: "released",
        ends: Ends::Moved,
    },
    // node2 restored the process and died before it answered: node1 rolls
    // back by itself; node2, restarted, kills the copy that never ran.
    AgentKilled {
        at: "destination:Restored",
        strategy: Strategy::TotalCopy,
        record: "restored",
        ends: Ends::OnSource,
    },
    // node2 recorded its decision and died before the resume: node1 keeps
    // its copy stopped, in doubt, and asks; node2, restarted, resumes the
    // process and says it committed.
    AgentKilled {
        at: "destination:Committed",
        strategy: Strategy::TotalCopy,
        record: "committed",
        ends: Ends::Moved,
    },
];

#[test]
fn an_agent_killed_at_each_point_of_a_migration_comes_back_and_settles_it() {
    if !ferry_integration::can_run(
        "an_agent_killed_at_each_point_of_a_migration_comes_back_and_settles_it",
    ) {
        return;
    }
    for case in AGENT_KILLED {
        eprintln!(
            "== {} ({:?}): expect {:?}",
            case.at, case.strategy, case.ends
        );
        agent_killed(case);
    }
}

fn agent_killed(case: &AgentKilled) {
    let dead = if case.at.starts_with("source:") {
        "node1"
    } else {
        "node2"
    };
    let mut cluster = cluster_crashing(dead, case.at);
    let rt = runtime();
    let (pid, client, before) = rt.block_on(echo_server(&cluster));
    let mut migration = Some({
        let _in_runtime = rt.enter();
        let mut node1 = cluster.control_lazy("node1");
        let req = request(pid, case.strategy);
        rt.spawn(async move {
            match follow_migration(&mut node1, req).await {
                Ok(ended) => ended,
                Err(s) => (None, Some(s)),
            }
        })
    });
    crashed(&mut cluster, dead);
    let left = cluster.journal_records(dead);
    assert_eq!(left.len(), 1, "{}: {left:?}", case.at);
    assert!(
        left[0].1.contains(&format!("\"{}\"", case.record)),
        "{}: {left:?}",
        case.at
    );
    let recorded_pid = pid_of(&left[0].1);
    if dead == "node1" {
        // The source's stream broke with its agent.
        let (report, status) = rt
            .block_on(migration.take().expect("the migration"))
            .expect("the migration task");
        assert!(
            report.is_none() && status.is_some(),
            "{}: {report:#?}",
            case.at
        );
    } else if case.ends == Ends::Moved {
        // Past the decision: node1 may neither resume nor kill its copy.
        rt.block_on(async {
            let mut node1 = cluster.control("node1").await.expect("control node1");
            let p = wait_for_process(&mut node1, pid, |p| p.note.contains("in doubt")).await;
            assert_eq!(p.state, "stopped", "{}: {p:?}", case.at);
        });
        assert_eq!(process_state(pid), Some('T'), "{}", case.at);
    }
    cluster.start_agent(dead).expect("the agent restarts");
    if dead == "node1" {
        // The restarted source keeps the settled migration's report.
        let id = field_of(&left[0].1, "migration_id");
        let settled = rt.block_on(async {
            let mut node1 = cluster.control("node1").await.expect("control node1");
            let mut report = None;
            eventually(
                "node1 settles the migration",
                Duration::from_secs(30),
                async || {
                    report = node1
                        .get_migration(ferry_proto::v1::GetMigrationRequest {
                            migration_id: id.clone(),
                            ..Default::default()
                        })
                        .await
                        .ok()
                        .map(|r| r.into_inner());
                    report.is_some()
                },
            )
            .await;
            report.expect("a report")
        });
        let outcome = match case.ends {
            Ends::Moved => MigrationOutcome::Committed,
            Ends::OnSource => MigrationOutcome::Aborted,
        };
        assert_eq!(settled.outcome, outcome as i32, "{}: {settled:#?}", case.at);
        assert!(
            settled.error.contains("restarted"),
            "{}: {settled:#?}",
            case.at
        );
    }
    if case.record == "restored" {
        assert_eq!(
            process_state(recorded_pid).filter(|s| *s != 'Z'),
            None,
            "{}: node2's restored copy, which never ran, still exists",
            case.at
        );
    }
    if let Some(migration) = migration {
        let (report, status) = rt.block_on(migration).expect("the migration task");
        let report = report.expect("a report");
        let committed = case.ends == Ends::Moved;
        assert_eq!(status.is_none(), committed, "{}: {status:?}", case.at);
        let outcome = if committed {
            MigrationOutcome::Committed
        } else {
            MigrationOutcome::Aborted
        };
        assert_eq!(report.outcome, outcome as i32, "{}: {report:#?}", case.at);
    }
    match case.ends {
        Ends::OnSource => rt.block_on(carries_on_at_node1(&cluster, pid, client, &before)),
        Ends::Moved => rt.block_on(carries_on_at_node2(&cluster, pid, client, &before)),
    }
}

#[test]
fn a_source_agent_that_cannot_ask_the_destination_keeps_the_copy_stopped_in_doubt() {
    if !ferry_integration::can_run(
        "a_source_agent_that_cannot_ask_the_destination_keeps_the_copy_stopped_in_doubt",
    ) {
        return;
    }
    // Past the Release with node2's agent gone too, nobody can say what
    // was decided: node1's copy stays stopped, and `ferry ps` says why.
    // node2 comes back (its restored copy never ran: killed), answers,
    // and the process resumes on node1.
    let mut cluster = cluster_crashing("node1", "source:Committing");
    let rt = runtime();
    let (pid, client, before) = rt.block_on(echo_server(&cluster));
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        migrate_into_a_crash(&mut node1, request(pid, Strategy::TotalCopy)).await;
    });
    crashed(&mut cluster, "node1");
    cluster.stop_agent("node2").expect("node2's agent stops");
    // node2's agent was stopped (SIGTERM) with a restored copy it had
    // recorded: the copy is still there, stopped.
    let restored = cluster.journal_records("node2");
    assert_eq!(restored.len(), 1, "{restored:?}");
    assert!(restored[0].1.contains("\"restored\""), "{restored:?}");
    let restored_pid = pid_of(&restored[0].1);
    assert_eq!(process_state(restored_pid), Some('T'));
    cluster
        .start_agent("node1")
        .expect("node1's agent restarts");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let p = wait_for_process(&mut node1, pid, |p| p.note.contains("in doubt")).await;
        assert_eq!(p.state, "stopped", "{p:?}");
        // Nothing resumes it while node2 cannot be asked.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(process_state(pid), Some('T'));
    });
    cluster
        .start_agent("node2")
        .expect("node2's agent restarts");
    assert_eq!(
        process_state(restored_pid).filter(|s| *s != 'Z'),
        None,
        "node2's restored copy, which never ran, still exists"
    );
    rt.block_on(carries_on_at_node1(&cluster, pid, client, &before));
}

#[test]
fn a_commit_lost_on_a_cut_link_leaves_one_copy_that_resumes_when_the_link_returns() {
    if !ferry_integration::can_run(
        "a_commit_lost_on_a_cut_link_leaves_one_copy_that_resumes_when_the_link_returns",
    ) {
        return;
    }
    // node2 is cut off the cluster network just before the Commit leaves
    // node1 (a fault point holds node1 there while the test cuts): no
    // Commit arrives, no answer comes. Neither copy may run, and neither
    // may go: node1 cannot know whether node2 resumed the process. When
    // the link returns node2 says it did not (its copy goes), and the
    // process resumes on node1.
    let cluster = cluster_crashing("node1", "source:Committing:pause-3000ms");
    let rt = runtime();
    let (pid, client, before) = rt.block_on(echo_server(&cluster));
    let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let migration = {
        let _in_runtime = rt.enter();
        let mut node1 = cluster.control_lazy("node1");
        let (cut, router) = (cut.clone(), cluster.link_cutter("node2"));
        rt.spawn(async move {
            let mut stream = node1
                .migrate(request(pid, Strategy::TotalCopy))
                .await
                .expect("migration starts")
                .into_inner();
            let mut report = None;
            let status = loop {
                match stream.message().await {
                    Ok(Some(ev)) => match ev.event {
                        Some(migration_event::Event::Progress(p)) if p.phase == "commit" => {
                            router.cut(true);
                            cut.store(true, std::sync::atomic::Ordering::SeqCst);
                        }
                        Some(migration_event::Event::Report(r)) => report = Some(r),
                        _ => {}
                    },
                    Ok(None) => break None,
                    Err(s) => break Some(s),
                }
            };
            (report.expect("a report"), status)
        })
    };
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let p = wait_for_process(&mut node1, pid, |p| p.note.contains("in doubt")).await;
        assert!(cut.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(p.state, "stopped", "{p:?}");
    });
    assert_eq!(process_state(pid), Some('T'), "node1's copy runs");
    // Every Commit sent into the cut link is lost (none returns with the
    // link: node1 gives up retrying it) before node1 asks instead.
    rt.block_on(eventually(
        "node1 gives up the Commit and asks node2 what it decided",
        Duration::from_secs(60),
        async || {
            cluster
                .log_text("node1")
                .contains("asking the destination what it decided")
        },
    ));
    assert_eq!(process_state(pid), Some('T'), "node1's copy runs");
    let restored = cluster.journal_records("node2");
    assert_eq!(restored.len(), 1, "{restored:?}");
    assert!(restored[0].1.contains("\"restored\""), "{restored:?}");
    cluster.cut_cluster_link("node2", false);
    let (report, status) = rt.block_on(migration).expect("the migration task");
    assert_eq!(status.map(|s| s.code()), Some(tonic::Code::Aborted));
    assert_eq!(
        report.outcome,
        MigrationOutcome::Aborted as i32,
        "{report:#?}"
    );
    assert!(report.resumed_on_source, "{report:#?}");
    rt.block_on(carries_on_at_node1(&cluster, pid, client, &before));
}

/// The `pid` of a journal record.
fn pid_of(record: &str) -> i32 {
    field_of(record, "pid")
        .parse()
        .unwrap_or_else(|e| panic!("no pid in {record}: {e}"))
}

/// A field of a journal record (JSON), as text.
fn field_of(record: &str, field: &str) -> String {
    let v: serde_json::Value =
        serde_json::from_str(record).unwrap_or_else(|e| panic!("{record}: {e}"));
    match &v[field] {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => panic!("no {field} in {record}"),
        other => other.to_string(),
    }
}
