//! What ferry does on a host that lacks a kernel feature it uses, forced
//! through `features_off` (this machine's kernel has them all): a request
//! that needs the feature is refused before anything stops, naming the
//! feature and the node, and a migration that can do without it falls
//! back (its report shows how: no page left out of the dump). Root only;
//! run by `cargo xtask test`.

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{
    migrate_committed, migrate_request, process_state, run, runtime, wait_for_process,
    wait_until_gone,
};
use ferry_integration::redis::Redis;
use ferry_proto::v1::control_client::ControlClient;
use ferry_proto::v1::{MigrateRequest, MigrationOutcome, Strategy};
use tonic::transport::Channel;

/// A cluster whose agents treat `features` as missing.
fn cluster_without(features: &[&str]) -> Cluster {
    let mut spec = ClusterSpec::new(2, 1);
    let keys: Vec<String> = features.iter().map(|f| format!("{f:?}")).collect();
    spec.extra_config = format!("features_off = [{}]\n", keys.join(", "));
    Cluster::start(spec).expect("cluster")
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
