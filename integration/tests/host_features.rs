//! What ferry does on a host that lacks a kernel feature it uses, forced
//! through `features_off` (this machine's kernel has them all): a request
//! that needs the feature is refused before anything stops, naming the
//! feature and the node (the source's or the destination's), a migration
//! that can do without it falls back and its report says how
//! (`MigrationReport.fallbacks`), and `ferry nodes` shows what each node
//! lacks. Root only; run by `cargo xtask test`.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{
    migrate_committed, migrate_request, process_state, run, runtime, wait_for_process,
    wait_until_gone,
};
use ferry_integration::redis::Redis;
use ferry_integration::workload::SeqClient;
use ferry_proto::v1::control_client::ControlClient;
use ferry_proto::v1::{
    ListNodesRequest, MigrateRequest, MigrationOutcome, MigrationReport, SocketMigration, Strategy,
};
use tonic::transport::Channel;

/// `features_off = [...]` for a `ferryd.toml`.
fn features_off(features: &[&str]) -> String {
    let keys: Vec<String> = features.iter().map(|f| format!("{f:?}")).collect();
    format!("features_off = [{}]\n", keys.join(", "))
}

/// A cluster whose agents treat `features` as missing.
fn cluster_without(features: &[&str]) -> Cluster {
    let mut spec = ClusterSpec::new(2, 1);
    spec.extra_config = features_off(features);
    Cluster::start(spec).expect("cluster")
}

/// A cluster whose node `node` alone treats `features` as missing.
fn cluster_with_one_node_without(node: &str, features: &[&str]) -> Cluster {
    let mut spec = ClusterSpec::new(2, 1);
    spec.node_config = vec![(node.to_owned(), features_off(features))];
    Cluster::start(spec).expect("cluster")
}

/// The fallbacks of `report`, as "feature@node".
fn fallbacks(report: &MigrationReport) -> Vec<String> {
    report
        .fallbacks
        .iter()
        .map(|f| format!("{}@{}", f.feature, f.node))
        .collect()
}

/// Redis started under node1's agent, listening: node1's control client
/// and its PID.
async fn redis_on_node1(
    cluster: &Cluster,
    redis: &Redis,
    dir: &std::path::Path,
) -> (ControlClient<Channel>, i32) {
    let mut node1 = cluster.control("node1").await.expect("control node1");
    let pid = run(&mut node1, redis.argv(dir)).await;
    wait_for_process(&mut node1, pid, |p| p.tcp_listening >= 1).await;
    (node1, pid)
}

/// Ends `pid` and waits until it is gone.
fn kill(pid: i32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    wait_until_gone(pid);
}

/// Without `PAGEMAP_SCAN` pre-copy cannot track written pages: refused
/// before the process is touched, naming the feature and the node; total
/// copy, which does not need it, moves the same process.
#[test]
fn pre_copy_without_pagemap_scan_is_refused_before_anything_stops() {
    let test = "pre_copy_without_pagemap_scan_is_refused_before_anything_stops";
    if !ferry_integration::can_run(test) {
        return;
    }
    let cluster = cluster_without(&["pagemap_scan"]);
    let redis = Redis { port: 7406 };
    let dir = tempfile::tempdir().expect("a dir for redis");
    let rt = runtime();
    rt.block_on(async {
        let (mut node1, pid) = redis_on_node1(&cluster, &redis, dir.path()).await;
        assert_eq!(redis.cli(&cluster, &["SET", "k", "v"]).expect("SET"), "OK");
        for strategy in [
            Strategy::PreCopy,
            Strategy::QueuedPreCopy,
            Strategy::AssistedPostCopy,
        ] {
            let refused = migrate_request(
                &mut node1,
                MigrateRequest {
                    pid,
                    destination_node: "node2".into(),
                    strategy: strategy as i32,
                    ..Default::default()
                },
            )
            .await;
            let status = match refused {
                Err(status) => status,
                Ok((report, status)) => {
                    panic!("{strategy:?}: expected a refusal, got {status:?} {report:#?}")
                }
            };
            assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
            assert!(
                status.message().contains("PAGEMAP_SCAN") && status.message().contains("node1"),
                "{status:?}"
            );
            assert!(matches!(process_state(pid), Some('S' | 'R')));
        }
        let report = migrate_committed(
            &mut node1,
            MigrateRequest {
                pid,
                destination_node: "node2".into(),
                strategy: Strategy::TotalCopy as i32,
                ..Default::default()
            },
        )
        .await;
        assert_eq!(
            report.outcome,
            MigrationOutcome::Committed as i32,
            "{report:#?}"
        );
        wait_until_gone(pid);
        assert_eq!(redis.cli(&cluster, &["GET", "k"]).expect("GET"), "v");
        kill(report.destination_pid);
    });
}

/// Without the userfaultfd events the page filler needs, the destination
/// cannot install held pages after the resume: pre-copy still moves the
/// process, with every page in the dump (none left out), and its data
/// intact.
#[test]
fn pre_copy_without_userfaultfd_events_carries_its_pages_in_the_dump() {
    let test = "pre_copy_without_userfaultfd_events_carries_its_pages_in_the_dump";
    if !ferry_integration::can_run(test) {
        return;
    }
    let cluster = cluster_without(&["uffd_events"]);
    let redis = Redis { port: 7407 };
    let dir = tempfile::tempdir().expect("a dir for redis");
    let rt = runtime();
    rt.block_on(async {
        let (mut node1, pid) = redis_on_node1(&cluster, &redis, dir.path()).await;
        assert_eq!(
            redis
                .cli(&cluster, &["DEBUG", "POPULATE", "20000", "key", "1000"])
                .expect("POPULATE"),
            "OK"
        );
        let digest = redis.cli(&cluster, &["DEBUG", "DIGEST"]).expect("DIGEST");
        let report = migrate_committed(
            &mut node1,
            MigrateRequest {
                pid,
                destination_node: "node2".into(),
                strategy: Strategy::PreCopy as i32,
                ..Default::default()
            },
        )
        .await;
        assert_eq!(
            report.outcome,
            MigrationOutcome::Committed as i32,
            "{report:#?}"
        );
        assert_eq!(fallbacks(&report), ["uffd_events@node2"], "{report:#?}");
        assert_eq!(report.left_out_pages, 0, "{report:#?}");
        assert_eq!(report.filled_pages, 0, "{report:#?}");
        assert!(report.precopied_pages > 0, "{report:#?}");
        wait_until_gone(pid);
        assert_eq!(
            redis.cli(&cluster, &["DEBUG", "DIGEST"]).expect("DIGEST"),
            digest
        );
        kill(report.destination_pid);
    });
}

/// `ferry nodes` (and ListNodes) shows each node's kernel and the features
/// it lacks, its own and its peers' (from their Hello), as each node's
/// `features_off` left them; `--features` lists them all.
#[test]
fn ferry_nodes_shows_each_nodes_kernel_and_what_it_lacks() {
    let test = "ferry_nodes_shows_each_nodes_kernel_and_what_it_lacks";
    if !ferry_integration::can_run(test) {
        return;
    }
    let cluster = cluster_with_one_node_without("node2", &["uffd_events", "bpf_iter_tcp"]);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .expect("this kernel's release")
        .trim()
        .to_owned();
    let lacks = |n: &ferry_proto::v1::Node| -> Vec<String> {
        n.features
            .iter()
            .filter(|f| !f.present)
            .map(|f| f.key.clone())
            .collect()
    };
    let rt = runtime();
    let (here_lacks, node2_lacks) = rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let nodes = node1
            .list_nodes(ListNodesRequest {})
            .await
            .expect("ListNodes")
            .into_inner()
            .nodes;
        let me = nodes.iter().find(|n| n.name == "node1").expect("node1");
        let node2 = nodes.iter().find(|n| n.name == "node2").expect("node2");
        assert_eq!(me.kernel, kernel, "{me:#?}");
        assert_eq!(node2.kernel, kernel, "{node2:#?}");
        assert!(me.features.len() >= 10, "{me:#?}");
        assert_eq!(me.features.len(), node2.features.len());
        (lacks(me), lacks(node2))
    });
    // node2 lacks what node1 lacks (this machine) and the two turned off.
    let mut expected = here_lacks.clone();
    expected.extend(["uffd_events".to_owned(), "bpf_iter_tcp".to_owned()]);
    expected.sort();
    let mut got = node2_lacks.clone();
    got.sort();
    assert_eq!(got, expected);
    assert!(!here_lacks.contains(&"uffd_events".to_owned()));

    let ferry = |args: &[&str]| {
        let out = std::process::Command::new(ferry_integration::bin_path("ferry"))
            .args(args)
            .env("FERRY_SOCKET", cluster.control_socket("node1"))
            .output()
            .expect("running ferry");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let json: serde_json::Value = serde_json::from_str(&ferry(&["--json", "nodes"])).unwrap();
    let node2 = json
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == "node2")
        .expect("node2 in the JSON");
    assert_eq!(node2["kernel"], kernel.as_str());
    let listed: Vec<&str> = node2["lacks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap())
        .collect();
    assert_eq!(listed, node2_lacks, "{node2}");
    let text = ferry(&["nodes", "--features"]);
    let node2_row = text
        .lines()
        .find(|l| l.starts_with("node2 "))
        .unwrap_or_else(|| panic!("no node2 row in\n{text}"));
    assert!(node2_row.contains(&node2_lacks.join(",")), "{text}");
    assert!(
        text.contains("NO   uffd_events") && text.contains("yes  uffd_events"),
        "{text}"
    );
}

/// Post-copy's pages reach the destination's process through a
/// userfaultfd that must see it fork, remap and unmap. A destination
/// without those events is refused before anything stops, naming the
/// feature and the destination, by the source (from the destination's
/// Hello) and, for a source that would not know, by the destination at
/// Prepare (tested in the engine's unit tests). Total copy still moves the
/// process there.
#[test]
fn post_copy_to_a_node_without_userfaultfd_events_is_refused_before_anything_stops() {
    let test = "post_copy_to_a_node_without_userfaultfd_events_is_refused_before_anything_stops";
    if !ferry_integration::can_run(test) {
        return;
    }
    let cluster = cluster_with_one_node_without("node2", &["uffd_events"]);
    let redis = Redis { port: 7408 };
    let dir = tempfile::tempdir().expect("a dir for redis");
    let rt = runtime();
    rt.block_on(async {
        let (mut node1, pid) = redis_on_node1(&cluster, &redis, dir.path()).await;
        assert_eq!(redis.cli(&cluster, &["SET", "k", "v"]).expect("SET"), "OK");
        for strategy in [Strategy::PostCopy, Strategy::AssistedPostCopy] {
            let status = match migrate_request(
                &mut node1,
                MigrateRequest {
                    pid,
                    destination_node: "node2".into(),
                    strategy: strategy as i32,
                    ..Default::default()
                },
            )
            .await
            {
                Err(status) => status,
                Ok((report, status)) => {
                    panic!("{strategy:?}: expected a refusal, got {status:?} {report:#?}")
                }
            };
            assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
            assert!(
                status.message().contains("uffd_events") && status.message().contains("node2"),
                "{status:?}"
            );
            assert!(matches!(process_state(pid), Some('S' | 'R')));
            assert_eq!(redis.cli(&cluster, &["GET", "k"]).expect("GET"), "v");
        }
        let report = migrate_committed(
            &mut node1,
            MigrateRequest {
                pid,
                destination_node: "node2".into(),
                strategy: Strategy::TotalCopy as i32,
                ..Default::default()
            },
        )
        .await;
        assert_eq!(fallbacks(&report), Vec::<String>::new(), "{report:#?}");
        wait_until_gone(pid);
        assert_eq!(redis.cli(&cluster, &["GET", "k"]).expect("GET"), "v");
        kill(report.destination_pid);
    });
}

const ECHO_PORT: u16 = 7000;

/// A source without the TCP state iterator, the mappings' iterator and
/// the cgroup setsockopt hook still moves an echo server with enough
/// connections for the iterator's pass, every byte of each delivered once
/// and in order: the first migration (incremental) reads each connection
/// by its own calls in the freeze and has CRIU read smaps; back from a
/// node without the setsockopt hook, incremental turns collective. Each
/// report names what it did without, and where.
#[test]
fn a_source_without_the_iterators_and_the_sockopt_hook_falls_back_and_says_so() {
    let test = "a_source_without_the_iterators_and_the_sockopt_hook_falls_back_and_says_so";
    if !ferry_integration::can_run(test) {
        return;
    }
    let mut spec = ClusterSpec::new(2, 1);
    spec.node_config = vec![
        (
            "node1".into(),
            features_off(&["bpf_iter_tcp", "bpf_iter_task_vma"]),
        ),
        ("node2".into(), features_off(&["cgroup_sockopt"])),
    ];
    let cluster = Cluster::start(spec).expect("cluster");
    // Enough for the iterator's pass (`sockstate::PER_PROCESS_PASS_FROM`).
    let connections = 64;
    let rt = runtime();
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut node2 = cluster.control("node2").await.expect("control node2");
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
            SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 100), ECHO_PORT),
            connections,
        )
        .expect("clients with traffic flowing");
        wait_for_process(&mut node1, pid, |p| {
            p.tcp_established as usize == connections
        })
        .await;
        let incremental = |pid: i32, to: &str| MigrateRequest {
            pid,
            destination_node: to.into(),
            strategy: Strategy::PreCopy as i32,
            sockets: SocketMigration::Incremental as i32,
            ..Default::default()
        };

        let before = client.verified_per_connection();
        let there = migrate_committed(&mut node1, incremental(pid, "node2")).await;
        assert_eq!(
            there.sockets,
            SocketMigration::Incremental as i32,
            "{there:#?}"
        );
        assert_eq!(
            there.connections_preread as usize, connections,
            "{there:#?}"
        );
        assert_eq!(
            fallbacks(&there),
            ["bpf_iter_tcp@node1", "bpf_iter_task_vma@node1"],
            "{there:#?}"
        );
        wait_until_gone(pid);
        client
            .wait_until_each_passes(&before, 10, Duration::from_secs(20))
            .expect("every connection exchanges messages on node2");

        let before = client.verified_per_connection();
        wait_for_process(&mut node2, there.destination_pid, |p| {
            p.tcp_established as usize == connections
        })
        .await;
        let back = migrate_committed(&mut node2, incremental(there.destination_pid, "node1")).await;
        assert_eq!(
            back.sockets,
            SocketMigration::Collective as i32,
            "{back:#?}"
        );
        assert!(back.sockets_note.contains("setsockopt"), "{back:#?}");
        assert_eq!(fallbacks(&back), ["cgroup_sockopt@node2"], "{back:#?}");
        wait_until_gone(there.destination_pid);
        client
            .wait_until_each_passes(&before, 10, Duration::from_secs(20))
            .expect("every connection exchanges messages back on node1");

        let seq = client.stop();
        seq.assert_clean();
        assert_eq!(seq.connections.len(), connections);
        kill(back.destination_pid);
    });
}

/// A migration that names no strategy takes the node's configured one; a
/// node that lacks what that needs gives way to total copy, and the report
/// says which feature of which node made it: the destination's (no
/// userfaultfd events for post-copy) and the source's (no asynchronous
/// write-protect for pre-copy). Redis's data is intact after both moves.
#[test]
fn a_configured_strategy_a_node_cannot_run_gives_way_to_total_copy() {
    let test = "a_configured_strategy_a_node_cannot_run_gives_way_to_total_copy";
    if !ferry_integration::can_run(test) {
        return;
    }
    let mut spec = ClusterSpec::new(2, 1);
    spec.node_config = vec![
        (
            "node1".into(),
            "[migration]\nstrategy = \"post-copy\"\n".into(),
        ),
        (
            "node2".into(),
            features_off(&["uffd_events", "uffd_wp_async"])
                + "[migration]\nstrategy = \"pre-copy\"\n",
        ),
    ];
    let cluster = Cluster::start(spec).expect("cluster");
    let redis = Redis { port: 7409 };
    let dir = tempfile::tempdir().expect("a dir for redis");
    let rt = runtime();
    rt.block_on(async {
        let (mut node1, pid) = redis_on_node1(&cluster, &redis, dir.path()).await;
        let mut node2 = cluster.control("node2").await.expect("control node2");
        assert_eq!(
            redis
                .cli(&cluster, &["DEBUG", "POPULATE", "5000", "key", "100"])
                .expect("POPULATE"),
            "OK"
        );
        let digest = redis.cli(&cluster, &["DEBUG", "DIGEST"]).expect("DIGEST");
        let unnamed = |pid: i32, to: &str| MigrateRequest {
            pid,
            destination_node: to.into(),
            ..Default::default()
        };
        let there = migrate_committed(&mut node1, unnamed(pid, "node2")).await;
        assert_eq!(there.strategy, Strategy::TotalCopy as i32, "{there:#?}");
        assert_eq!(fallbacks(&there), ["uffd_events@node2"], "{there:#?}");
        assert!(
            there.fallbacks[0].instead.contains("post-copy"),
            "{there:#?}"
        );
        wait_until_gone(pid);
        assert_eq!(
            redis.cli(&cluster, &["DEBUG", "DIGEST"]).expect("DIGEST"),
            digest
        );
        wait_for_process(&mut node2, there.destination_pid, |p| p.tcp_listening >= 1).await;
        let back = migrate_committed(&mut node2, unnamed(there.destination_pid, "node1")).await;
        assert_eq!(back.strategy, Strategy::TotalCopy as i32, "{back:#?}");
        assert_eq!(fallbacks(&back), ["uffd_wp_async@node2"], "{back:#?}");
        assert!(back.fallbacks[0].instead.contains("pre-copy"), "{back:#?}");
        wait_until_gone(there.destination_pid);
        assert_eq!(
            redis.cli(&cluster, &["DEBUG", "DIGEST"]).expect("DIGEST"),
            digest
        );
        kill(back.destination_pid);
    });
}
