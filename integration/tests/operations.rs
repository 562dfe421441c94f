//! Operating a cluster through any of its agents: draining a node (its
//! processes move, their connections survive, it stays cordoned),
//! cancelling a migration (the process runs on at the source), calls
//! forwarded to the node they are about, and the cluster-wide event
//! stream. Root only; run by `cargo xtask test` (or `cargo xtask
//! integration`).

use std::net::SocketAddrV4;
use std::time::Duration;

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{list, runtime, stream_end, wait_for_process, wait_until_gone};
use ferry_integration::memwriter::{MemWriter, write_protected};
use ferry_integration::workload::SeqClient;
use ferry_proto::v1::control_client::ControlClient;
use ferry_proto::v1::{
    self as pb, ClusterEvent, DrainEvent, ListNodesRequest, ListProcessesRequest, MigrateRequest,
    MigrationOutcome, MigrationReport, RunProcessRequest, Strategy, cluster_event, drain_event,
    migration_event,
};
use tonic::transport::Channel;

const CONNECTIONS: usize = 8;

fn echo_server(port: u16) -> Vec<String> {
    vec![
        env!("CARGO_BIN_EXE_ferry-echo-server").to_owned(),
        "--port".into(),
        port.to_string(),
    ]
}

/// Starts an echo server on the node `control` talks to, through that
/// agent, and waits until it listens.
async fn start_echo(control: &mut ControlClient<Channel>, port: u16) -> i32 {
    let pid = control
        .run_process(RunProcessRequest {
            argv: echo_server(port),
            ..Default::default()
        })
        .await
        .expect("RunProcess")
        .into_inner()
        .pid;
    wait_for_process(control, pid, |p| p.tcp_listening == 1).await;
    pid
}

/// Reads a cluster event stream into a channel, in the background.
fn collect_events(
    mut stream: tonic::Streaming<ClusterEvent>,
) -> tokio::sync::mpsc::UnboundedReceiver<ClusterEvent> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(Some(ev)) = stream.message().await {
            if tx.send(ev).is_err() {
                return;
            }
        }
    });
    rx
}

/// Takes events until one satisfies `done` (bounded by `within`); returns
/// all taken.
async fn events_until(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<ClusterEvent>,
    within: Duration,
    mut done: impl FnMut(&ClusterEvent) -> bool,
) -> Vec<ClusterEvent> {
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(ev)) => {
                let stop = done(&ev);
                seen.push(ev);
                if stop {
                    return seen;
                }
            }
            Ok(None) => panic!("the event stream ended; saw {seen:#?}"),
            Err(_) => panic!("the awaited event did not come within {within:?}; saw {seen:#?}"),
        }
    }
}

/// Waits until the merged stream says it watches every peer in `peers`.
async fn watching_all(rx: &mut tokio::sync::mpsc::UnboundedReceiver<ClusterEvent>, peers: &[&str]) {
    let mut missing: Vec<&str> = peers.to_vec();
    events_until(rx, Duration::from_secs(10), |ev| {
        if let Some(cluster_event::Event::Watch(w)) = &ev.event
            && w.connected
        {
            missing.retain(|p| *p != w.peer);
        }
        missing.is_empty()
    })
    .await;
}

#[test]
fn a_drain_empties_the_node_and_every_connection_survives() {
    if !ferry_integration::can_run("a_drain_empties_the_node_and_every_connection_survives") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(3, 1)).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut node2 = cluster.control("node2").await.expect("control node2");
        let mut node3 = cluster.control("node3").await.expect("control node3");
        // Two servers on node1, each with clients talking all the time.
        let ports = [7010u16, 7011];
        let mut pids = Vec::new();
        let mut clients = Vec::new();
        for port in ports {
            pids.push(start_echo(&mut node1, port).await);
            let client = SeqClient::dve(
                cluster.netns_path("client1"),
                SocketAddrV4::new(cluster.public_addr(), port),
                CONNECTIONS,
            )
            .expect("clients with traffic flowing");
            clients.push(client);
        }
        for &pid in &pids {
            wait_for_process(&mut node1, pid, |p| {
                p.tcp_established == CONNECTIONS as u32
            })
            .await;
        }
        let marks: Vec<Vec<u64>> = clients.iter().map(|c| c.verified_per_connection()).collect();

        // node2 watches the whole cluster while node3 drains node1: the
        // events of node1 reach node2 through its merged stream.
        let mut events = collect_events(
            node2
                .watch_events(pb::WatchEventsRequest::default())
                .await
                .expect("WatchEvents")
                .into_inner(),
        );
        watching_all(&mut events, &["node1", "node3"]).await;

        let mut drain = node3
            .drain_node(pb::DrainNodeRequest {
                node: "node1".into(),
                ..Default::default()
            })
            .await
            .expect("DrainNode forwarded to node1")
            .into_inner();
        let mut started = None;
        let mut reports: Vec<(i32, String, MigrationReport)> = Vec::new();
        let mut finished = None;
        while let Some(DrainEvent { event }) = drain.message().await.expect("the drain succeeds") {
            match event {
                Some(drain_event::Event::Started(s)) => started = Some(s),
                Some(drain_event::Event::Migration(m)) => {
                    assert!(m.error.is_empty(), "a destination declined: {m:?}");
                    if let Some(migration_event::Event::Report(r)) =
                        m.event.and_then(|e| e.event)
                    {
                        reports.push((m.pid, m.destination_node, r));
                    }
                }
                Some(drain_event::Event::Finished(f)) => finished = Some(f),
                None => {}
            }
        }
        let started = started.expect("a started event");
        assert_eq!(started.node, "node1");
        let mut listed = started.pids.clone();
        listed.sort_unstable();
        let mut expected = pids.clone();
        expected.sort_unstable();
        assert_eq!(listed, expected);
        let finished = finished.expect("a finished event");
        assert_eq!(finished.moved, 2, "{finished:?}");
        assert!(finished.remaining.is_empty(), "{finished:?}");
        assert_eq!(reports.len(), 2, "{reports:#?}");
        // Least loaded first: the first goes to node2 (both empty, by
        // name), the second to node3, which then has fewer processes.
        let destinations: Vec<&str> = reports.iter().map(|(_, d, _)| d.as_str()).collect();
        assert_eq!(destinations, ["node2", "node3"], "{reports:#?}");
        for (pid, _, r) in &reports {
            assert_eq!(r.outcome, MigrationOutcome::Committed as i32, "{r:#?}");
            wait_until_gone(*pid);
        }

        // node1 is empty and cordoned; the processes run where the drain put them.
        assert!(list(&mut node1).await.is_empty());
        for (_, to, r) in &reports {
            let control = if to == "node2" { &mut node2 } else { &mut node3 };
            wait_for_process(control, r.destination_pid, |p| p.state == "running").await;
        }
        for (client, mark) in clients.iter().zip(&marks) {
            client
                .wait_until_each_passes(mark, 20, Duration::from_secs(20))
                .expect("every connection exchanges messages after the drain");
        }
        for client in clients {
            let report = client.stop();
            for c in &report.connections {
                assert!(c.is_clean(), "a connection lost bytes or failed: {c:?}");
            }
        }
        let nodes = node2
            .list_nodes(ListNodesRequest {})
            .await
            .expect("ListNodes")
            .into_inner()
            .nodes;
        let n1 = nodes.iter().find(|n| n.name == "node1").expect("node1 listed");
        assert!(n1.cordoned, "{n1:?}");

        // The events node2 saw from node1: the cordon, both migrations
        // started and committed, and the drain's end.
        let seen = events_until(&mut events, Duration::from_secs(10), |ev| {
            matches!(ev.event, Some(cluster_event::Event::DrainFinished(_)))
        })
        .await;
        let from_node1 = |f: &dyn Fn(&cluster_event::Event) -> bool| {
            seen.iter()
                .filter(|e| e.node == "node1" && e.event.as_ref().is_some_and(f))
                .count()
        };
        assert_eq!(
            from_node1(&|e| matches!(e, cluster_event::Event::Cordon(c) if c.cordoned && c.by.starts_with("drain"))),
            1,
            "{seen:#?}"
        );
        assert_eq!(
            from_node1(&|e| matches!(e, cluster_event::Event::MigrationStarted(_))),
            2
        );
        assert_eq!(
            from_node1(&|e| matches!(e, cluster_event::Event::MigrationFinished(r) if r.outcome == MigrationOutcome::Committed as i32)),
            2
        );
        let sequences: Vec<u64> = seen.iter().filter(|e| e.node == "node1").map(|e| e.sequence).collect();
        assert!(sequences.windows(2).all(|w| w[0] < w[1]), "node1's events out of order: {sequences:?}");

        // Cordoned: no new process, no incoming migration, until lifted.
        let refused = node1
            .run_process(RunProcessRequest {
                argv: echo_server(7012),
                ..Default::default()
            })
            .await
            .expect_err("a cordoned node started a process");
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
        assert!(refused.message().contains("cordoned"), "{refused:?}");
        let (_, back_to, back) = &reports[0];
        assert_eq!(back_to, "node2");
        let refused = ferry_integration::managed::migrate_request(
            &mut node2,
            MigrateRequest {
                pid: back.destination_pid,
                destination_node: "node1".into(),
                strategy: Strategy::TotalCopy as i32,
                ..Default::default()
            },
        )
        .await
        .expect_err("a migration into a cordoned node started");
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
        assert!(refused.message().contains("cordoned"), "{refused:?}");
        node3
            .set_cordon(pb::SetCordonRequest {
                node: "node1".into(),
                cordoned: false,
            })
            .await
            .expect("SetCordon forwarded");
        ferry_integration::managed::migrate_committed(
            &mut node2,
            MigrateRequest {
                pid: back.destination_pid,
                destination_node: "node1".into(),
                strategy: Strategy::TotalCopy as i32,
                ..Default::default()
            },
        )
        .await;
    });
}

#[test]
fn a_cancelled_migration_leaves_the_process_running_on_the_source() {
    if !ferry_integration::can_run("a_cancelled_migration_leaves_the_process_running_on_the_source")
    {
        return;
    }
    const WRITER: MemWriter = MemWriter { port: 7320 };
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    // 64 MiB over 10 Mb/s takes about a minute: the cancel comes first.
    cluster.shape_cluster_links(Some(("10mbit", 32768, "400ms")));
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut node2 = cluster.control("node2").await.expect("control node2");
        let pid = WRITER.start(&mut node1, 64, 10).await;
        let mut writes = WRITER.check(&cluster);
        // Pre-copy is cancelled during its first round's transfer; total
        // copy during its image transfer, with the process stopped.
        for (strategy, cancel_at) in [
            (Strategy::PreCopy, "pre-copy"),
            (Strategy::TotalCopy, "transfer"),
        ] {
            let mut stream = node1
                .migrate(MigrateRequest {
                    pid,
                    destination_node: "node2".into(),
                    strategy: strategy as i32,
                    ..Default::default()
                })
                .await
                .expect("migration starts")
                .into_inner();
            let mut id = String::new();
            loop {
                let ev = stream
                    .message()
                    .await
                    .expect("events")
                    .expect("no report before the cancel");
                match ev.event {
                    Some(migration_event::Event::Started(s)) => id = s.migration_id,
                    Some(migration_event::Event::Progress(p)) if p.phase == cancel_at => break,
                    Some(migration_event::Event::Report(r)) => {
                        panic!("ended before the cancel: {r:#?}")
                    }
                    _ => {}
                }
            }
            // Through the other node's agent: forwarded to node1.
            let report = node2
                .cancel_migration(pb::CancelMigrationRequest {
                    migration_id: id.clone(),
                    node: "node1".into(),
                })
                .await
                .expect("CancelMigration")
                .into_inner();
            assert_eq!(report.migration_id, id);
            assert_eq!(
                report.outcome,
                MigrationOutcome::Aborted as i32,
                "{report:#?}"
            );
            assert!(report.error.starts_with("cancelled by"), "{report:#?}");
            assert!(report.resumed_on_source, "{report:#?}");
            // The Migrate stream ends with the report and CANCELLED.
            let end = stream_end(&mut stream)
                .await
                .expect("a cancelled migration ends with a status");
            assert_eq!(end.code(), tonic::Code::Cancelled, "{end:?}");

            // The process runs on node1, intact, not write-protected, and
            // node2 keeps nothing.
            let here = wait_for_process(&mut node1, pid, |p| p.state == "running").await;
            assert_eq!(here.origin, "run");
            assert!(list(&mut node2).await.is_empty());
            assert!(!write_protected(pid), "{strategy:?}: still write-protected");
            let now = WRITER.check(&cluster);
            assert!(
                now > writes,
                "{strategy:?}: the writer does not run ({writes} -> {now})"
            );
            writes = now;

            // Asked again: it has ended.
            let again = node1
                .cancel_migration(pb::CancelMigrationRequest {
                    migration_id: id,
                    ..Default::default()
                })
                .await
                .expect_err("a finished migration was cancelled");
            assert_eq!(again.code(), tonic::Code::FailedPrecondition, "{again:?}");
        }
        let unknown = node1
            .cancel_migration(pb::CancelMigrationRequest {
                migration_id: "0123456789abcdef".into(),
                ..Default::default()
            })
            .await
            .expect_err("an unknown migration was cancelled");
        assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");

        // The destination was left clean: a migration after the cancels
        // goes through (full speed again).
        cluster.shape_cluster_links(None);
        let report = ferry_integration::managed::migrate_committed(
            &mut node1,
            MigrateRequest {
                pid,
                destination_node: "node2".into(),
                strategy: Strategy::PreCopy as i32,
                ..Default::default()
            },
        )
        .await;
        WRITER
            .moved_intact(
                &cluster,
                &mut node1,
                &mut node2,
                pid,
                report.destination_pid,
                writes,
            )
            .await;
    });
}

#[test]
fn a_cancelled_drain_stops_and_every_process_runs_on() {
    if !ferry_integration::can_run("a_cancelled_drain_stops_and_every_process_runs_on") {
        return;
    }
    const WRITERS: [MemWriter; 2] = [MemWriter { port: 7330 }, MemWriter { port: 7331 }];
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    // 64 MiB over 10 Mb/s takes about a minute: the cancel comes first.
    cluster.shape_cluster_links(Some(("10mbit", 32768, "400ms")));
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut node2 = cluster.control("node2").await.expect("control node2");
        let mut pids = Vec::new();
        let mut writes = Vec::new();
        for w in &WRITERS {
            pids.push(w.start(&mut node1, 64, 10).await);
            writes.push(w.check(&cluster));
        }
        let mut drain = node1
            .drain_node(pb::DrainNodeRequest {
                strategy: Strategy::PreCopy as i32,
                ..Default::default()
            })
            .await
            .expect("DrainNode")
            .into_inner();
        // Into its first migration's pre-copy.
        loop {
            let ev = drain
                .message()
                .await
                .expect("drain events")
                .expect("no end before the cancel");
            if let Some(drain_event::Event::Migration(m)) = &ev.event
                && let Some(migration_event::Event::Progress(p)) =
                    m.event.as_ref().and_then(|e| e.event.as_ref())
                && p.phase == "pre-copy"
            {
                break;
            }
            if let Some(drain_event::Event::Finished(f)) = &ev.event {
                panic!("the drain finished before the cancel: {f:?}");
            }
        }
        // One drain at a time.
        let e = node2
            .drain_node(pb::DrainNodeRequest {
                node: "node1".into(),
                ..Default::default()
            })
            .await
            .expect_err("a second drain started");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("runs already"), "{e:?}");

        // Cancelled through node2's agent: forwarded to node1.
        let summary = node2
            .cancel_drain(pb::CancelDrainRequest {
                node: "node1".into(),
            })
            .await
            .expect("CancelDrain")
            .into_inner();
        assert_eq!(summary.node, "node1");
        assert_eq!(summary.moved, 0, "{summary:?}");
        assert_eq!(summary.remaining.len(), 2, "{summary:?}");
        assert!(!summary.cancelled_by.is_empty(), "{summary:?}");
        // The stream ends with the summary and CANCELLED.
        let end = stream_end(&mut drain)
            .await
            .expect("a cancelled drain ends with a status");
        assert_eq!(end.code(), tonic::Code::Cancelled, "{end:?}");

        // Both run on node1, intact and writing; node2 keeps nothing;
        // node1 stays cordoned.
        for ((w, &pid), before) in WRITERS.iter().zip(&pids).zip(&writes) {
            let here = wait_for_process(&mut node1, pid, |p| p.state == "running").await;
            assert_eq!(here.origin, "run");
            assert!(!write_protected(pid), "{pid} still write-protected");
            let now = w.check(&cluster);
            assert!(now > *before, "{pid} does not write ({before} -> {now})");
        }
        assert!(list(&mut node2).await.is_empty());
        let nodes = node2
            .list_nodes(ListNodesRequest {})
            .await
            .expect("ListNodes")
            .into_inner()
            .nodes;
        assert!(
            nodes.iter().any(|n| n.name == "node1" && n.cordoned),
            "{nodes:?}"
        );
        let e = node1
            .cancel_drain(pb::CancelDrainRequest::default())
            .await
            .expect_err("no drain runs");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    });
}

#[test]
fn any_agent_answers_for_the_whole_cluster() {
    if !ferry_integration::can_run("any_agent_answers_for_the_whole_cluster") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(3, 1)).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut node3 = cluster.control("node3").await.expect("control node3");
        // Started on node1 by node3's agent.
        let started = node3
            .run_process(RunProcessRequest {
                argv: echo_server(7030),
                node: "node1".into(),
                ..Default::default()
            })
            .await
            .expect("RunProcess forwarded")
            .into_inner();
        assert_eq!(started.node, "node1");
        let pid = started.pid;
        wait_for_process(&mut node1, pid, |p| p.tcp_listening == 1).await;

        let all = node3
            .list_processes(ListProcessesRequest {
                all_nodes: true,
                ..Default::default()
            })
            .await
            .expect("ListProcesses all_nodes")
            .into_inner();
        assert!(all.unreachable.is_empty(), "{all:?}");
        let found: Vec<(&str, i32)> = all
            .processes
            .iter()
            .map(|p| (p.node.as_str(), p.pid))
            .collect();
        assert_eq!(found, [("node1", pid)]);

        // Migrated from node1 to node2 by a call to node3.
        let report = ferry_integration::managed::migrate_committed(
            &mut node3,
            MigrateRequest {
                pid,
                destination_node: "node2".into(),
                strategy: Strategy::TotalCopy as i32,
                source_node: "node1".into(),
                ..Default::default()
            },
        )
        .await;
        assert_eq!(report.source_node, "node1");
        let kept = node3
            .get_migration(pb::GetMigrationRequest {
                migration_id: report.migration_id.clone(),
                node: "node1".into(),
            })
            .await
            .expect("GetMigration forwarded")
            .into_inner();
        assert_eq!(kept.destination_pid, report.destination_pid);
        let on_node2 = node3
            .list_processes(ListProcessesRequest {
                node: "node2".into(),
                ..Default::default()
            })
            .await
            .expect("ListProcesses forwarded")
            .into_inner();
        assert_eq!(on_node2.node, "node2");
        assert_eq!(
            on_node2.processes.iter().map(|p| p.pid).collect::<Vec<_>>(),
            [report.destination_pid]
        );
        let dp = node3
            .get_data_plane(pb::GetDataPlaneRequest {
                node: "node2".into(),
            })
            .await
            .expect("GetDataPlane forwarded")
            .into_inner();
        assert_eq!(dp.node, "node2");

        // Errors keep their code and say which node and field.
        let err = node3
            .get_migration(pb::GetMigrationRequest {
                migration_id: "nope".into(),
                node: "node2".into(),
            })
            .await
            .expect_err("a report that does not exist");
        assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
        assert!(err.message().starts_with("node2: "), "{err:?}");
        let err = node3
            .list_processes(ListProcessesRequest {
                node: "node9".into(),
                ..Default::default()
            })
            .await
            .expect_err("an unknown node");
        assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
        assert!(err.message().starts_with("node: "), "{err:?}");
    });
}
