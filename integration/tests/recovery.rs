//! Agents that crash in the middle of a migration and come back: a
//! ferryd started with `FERRY_FAULT_AT=<side>:<point>` kills itself
//! (SIGKILL) there; restarted, it settles the migration from its journal
//! and, past the source's Release, from the destination's word. After
//! each: the process runs on exactly one node, never zero, never two; its
//! connections carry on with every byte once and in order; nothing of the
//! migration is left in either journal but the destination's record of a
//! commit. Root only; run by `cargo xtask test`.

use std::time::Duration;

use ferry_integration::cluster::Cluster;
use ferry_integration::faults::{
    Ends, carries_on_at_node1, carries_on_at_node2, cluster_with_fault, crashed, echo_server,
    eventually, field_of, pid_of, request,
};
use ferry_integration::managed::{follow_migration, process_state, runtime, wait_for_process};
use ferry_proto::v1::control_client::ControlClient;
use ferry_proto::v1::{MigrateRequest, MigrationOutcome, Strategy, migration_event};
use tonic::transport::Channel;

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

/// One agent killed at one point of a migration from node1 to node2, and
/// what must follow once it is restarted.
struct AgentKilled {
    /// `FERRY_FAULT_AT` (with `:kill`, the default): its side names the
    /// node whose agent dies.
    at: &'static str,
    strategy: Strategy,
    /// The stage of the dead agent's journal record of the migration
    /// (None: it had none yet).
    record: Option<&'static str>,
    ends: Ends,
}

/// Every point an agent is killed at, in the order a migration reaches
/// them; a new point is a new row. What each means: `docs/faults.md`.
const AGENT_KILLED: &[AgentKilled] = &[
    // The source's agent, before the freeze: the process runs on.
    AgentKilled {
        at: "source:PreCopy",
        strategy: Strategy::PreCopy,
        record: Some("started"),
        ends: Ends::OnSource,
    },
    AgentKilled {
        at: "source:Arm",
        strategy: Strategy::TotalCopy,
        record: Some("started"),
        ends: Ends::OnSource,
    },
    // In the freeze: CRIU holds the tree, the ports are cut off.
    AgentKilled {
        at: "source:TreeFrozen",
        strategy: Strategy::PreCopy,
        record: Some("started"),
        ends: Ends::OnSource,
    },
    // The case: dumped, stopped, the images about to leave.
    AgentKilled {
        at: "source:Dump",
        strategy: Strategy::TotalCopy,
        record: Some("started"),
        ends: Ends::OnSource,
    },
    AgentKilled {
        at: "source:Transfer",
        strategy: Strategy::PreCopy,
        record: Some("started"),
        ends: Ends::OnSource,
    },
    AgentKilled {
        at: "source:Restore",
        strategy: Strategy::TotalCopy,
        record: Some("started"),
        ends: Ends::OnSource,
    },
    // Released, the Commit not sent: node2, asked, aborts.
    AgentKilled {
        at: "source:Committing",
        strategy: Strategy::TotalCopy,
        record: Some("released"),
        ends: Ends::OnSource,
    },
    // The Commit answered, the stopped copy not yet killed: node2, asked,
    // says it committed. The pages left out of the dump come from node2's
    // own store: the process never waits for node1.
    AgentKilled {
        at: "source:Discard",
        strategy: Strategy::PreCopy,
        record: Some("released"),
        ends: Ends::Moved,
    },
    // node2 reserved itself for the migration and died before it
    // answered: node1 gives up before anything stops; node2, restarted,
    // holds nothing for it.
    AgentKilled {
        at: "destination:Prepared",
        strategy: Strategy::PreCopy,
        record: Some("prepared"),
        ends: Ends::OnSource,
    },
    // node2 armed its capture and died before it answered: node1 gives
    // up before the freeze.
    AgentKilled {
        at: "destination:Armed",
        strategy: Strategy::TotalCopy,
        record: Some("prepared"),
        ends: Ends::OnSource,
    },
    // node2 wrote the images and died before it answered: node1 resumes
    // its copy, which it had stopped.
    AgentKilled {
        at: "destination:Received",
        strategy: Strategy::TotalCopy,
        record: Some("prepared"),
        ends: Ends::OnSource,
    },
    // node2's agent died inside CRIU's restore: CRIU finished, the copy
    // it left is stopped and named by no record. node1 rolls back by
    // itself; node2, restarted, finds the copy by the `prepared` record
    // and kills it.
    AgentKilled {
        at: "destination:RestoredUnrecorded",
        strategy: Strategy::TotalCopy,
        record: Some("prepared"),
        ends: Ends::OnSource,
    },
    // node2 restored the process and died before it answered: node1 rolls
    // back by itself; node2, restarted, kills the copy that never ran.
    AgentKilled {
        at: "destination:Restored",
        strategy: Strategy::TotalCopy,
        record: Some("restored"),
        ends: Ends::OnSource,
    },
    // node2 recorded its decision and died before the resume: node1 keeps
    // its copy stopped, in doubt, and asks; node2, restarted, resumes the
    // process and says it committed.
    AgentKilled {
        at: "destination:Committed",
        strategy: Strategy::TotalCopy,
        record: Some("committed"),
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
    let mut cluster = cluster_with_fault(dead, case.at);
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
    assert_eq!(
        left.len(),
        usize::from(case.record.is_some()),
        "{}: {left:?}",
        case.at
    );
    if let Some(record) = case.record {
        assert!(
            left[0].1.contains(&format!("\"{record}\"")),
            "{}: {left:?}",
            case.at
        );
    }
    let recorded_pid = left.first().map(|(_, r)| pid_of(r));
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
    let orphans = stopped_in(&cluster, "node2");
    if case.at == "destination:RestoredUnrecorded" {
        assert_eq!(orphans.len(), 1, "{}: no copy left by CRIU", case.at);
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
    if case.record == Some("restored") {
        let recorded_pid = recorded_pid.expect("a restored copy's PID");
        assert_eq!(
            process_state(recorded_pid).filter(|s| *s != 'Z'),
            None,
            "{}: node2's restored copy, which never ran, still exists",
            case.at
        );
    }
    if let Some(migration) = migration {
        let (report, status) = rt.block_on(migration).expect("the migration task");
        let Some(report) = report else {
            // Refused before anything stopped (node2 died as it
            // prepared): the Migrate call itself failed.
            assert!(
                case.at == "destination:Prepared" && status.is_some(),
                "{}: no report ({status:?})",
                case.at
            );
            rt.block_on(carries_on_at_node1(&cluster, pid, client, &before));
            return;
        };
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
    let mut cluster = cluster_with_fault("node1", "source:Committing");
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
    let cluster = cluster_with_fault("node1", "source:Committing:pause-3000ms");
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

/// The stopped processes in `node`'s network namespace.
fn stopped_in(cluster: &Cluster, node: &str) -> Vec<i32> {
    cluster
        .pids_in(node)
        .into_iter()
        .filter(|&p| process_state(p) == Some('T'))
        .collect()
}

#[test]
fn a_source_agent_killed_after_translate_has_its_peers_send_the_session_back() {
    use ferry_integration::managed::{data_plane, run};
    use ferry_integration::pg_session;
    use ferry_integration::postgres::{PG_PORT, PostgresServer};
    use std::net::SocketAddrV4;

    if !ferry_integration::can_run(
        "a_source_agent_killed_after_translate_has_its_peers_send_the_session_back",
    ) {
        return;
    }
    // A process with a PostgreSQL session to node3 moves from node1 to
    // node2; node1's agent dies once node3 translates the session's flow
    // to node2 (the Release, after Translate). Restarted, node1 resumes
    // the process and has node3 send the flow to it again: the session
    // goes on, the same backend, no query failed.
    const STATUS_PORT: u16 = 7300;
    let mut spec = ferry_integration::ClusterSpec::new(3, 1);
    spec.extra_config = "peer_timeout_secs = 2\n".into();
    let mut cluster = Cluster::start(spec).expect("cluster");
    cluster
        .start_agent_with_env("node1", &[("FERRY_FAULT_AT", "source:Release")])
        .expect("node1's agent with its crash point");
    let pg_addr = SocketAddrV4::new(cluster.node_cluster_addr("node3"), PG_PORT);
    let _pg = PostgresServer::start(&cluster.netns_path("node3"), pg_addr).expect("PostgreSQL");
    let status_at = SocketAddrV4::new(cluster.public_addr(), STATUS_PORT);
    let client_netns = cluster.netns_path("client1");
    let queries = |since: u64| {
        pg_session::wait_for_queries(&client_netns, status_at, since, 5, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let rt = runtime();
    let pid = rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut argv = vec![env!("CARGO_BIN_EXE_ferry-pg-session").to_owned()];
        argv.extend(pg_session::args(pg_addr, status_at));
        let pid = run(&mut node1, argv).await;
        wait_for_process(&mut node1, pid, |p| p.tcp_listening == 1).await;
        pid
    });
    let first = queries(0);
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        migrate_into_a_crash(&mut node1, request(pid, Strategy::TotalCopy)).await;
    });
    crashed(&mut cluster, "node1");
    let left = cluster.journal_records("node1");
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(
        left[0].1.contains("\"translated\"") && left[0].1.contains("\"node3\""),
        "the record does not name node3's translations: {left:?}"
    );
    rt.block_on(async {
        let mut node3 = cluster.control("node3").await.expect("control node3");
        let dp = data_plane(&mut node3).await;
        assert!(
            !dp.translations.is_empty(),
            "node3 translated nothing: the crash came too early"
        );
    });
    cluster
        .start_agent("node1")
        .expect("node1's agent restarts");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        wait_for_process(&mut node1, pid, |p| p.state == "running").await;
        let mut node3 = cluster.control("node3").await.expect("control node3");
        eventually(
            "node3 undoes its translations",
            Duration::from_secs(20),
            async || data_plane(&mut node3).await.translations.is_empty(),
        )
        .await;
        let mut node2 = cluster.control("node2").await.expect("control node2");
        eventually(
            "node2 drops its copy",
            Duration::from_secs(20),
            async || {
                ferry_integration::managed::list(&mut node2)
                    .await
                    .is_empty()
                    && cluster.incoming_dir_is_empty("node2")
                    && cluster.pids_in("node2") == [cluster.agent_pid("node2")]
            },
        )
        .await;
    });
    let after = queries(first.queries_ok);
    assert_eq!(after.backend_pid, first.backend_pid, "{after:?}");
    assert_eq!(after.queries_failed, 0, "{after:?}");
    assert_eq!(
        after.client_addr,
        cluster.node_cluster_addr("node1").to_string(),
        "{after:?}"
    );
    assert_eq!(cluster.journal_records("node1"), vec![]);
}
