//! A real in-memory database moves with all of its data: Debian's Redis
//! server runs under ferry with a data set of about 100 MiB and migrates
//! with each memory strategy while a client keeps writing; afterwards its
//! whole data set hashes the same (`DEBUG DIGEST`, every key and value),
//! and it runs on the destination only. Pre-copy leaves the pages the
//! destination holds out of the dump and fills them after the resume.
//! Root only; run by `cargo xtask test` (or `cargo xtask integration`).

use std::time::Duration;

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{
    migrate_committed, process_state, run, runtime, wait_for_process, wait_until_gone,
};
use ferry_integration::memwriter::source_and_destination;
use ferry_integration::redis::{REDIS_SERVER, Redis};
use ferry_proto::v1::control_client::ControlClient;
use ferry_proto::v1::{MigrateRequest, MigrationReport, Strategy};
use tonic::transport::Channel;

const REDIS: Redis = Redis { port: 7400 };

/// One redis-cli command from client1; its output, trimmed.
fn redis(cluster: &Cluster, args: &[&str]) -> String {
    REDIS.cli(cluster, args).expect("redis-cli answers")
}

/// Moves the server `pid` from `controls[on]` to the other node by
/// `strategy`; returns the committed report once the destination's copy
/// runs and the source's is gone.
async fn move_across(
    controls: &mut [ControlClient<Channel>; 2],
    on: usize,
    pid: i32,
    strategy: Strategy,
) -> MigrationReport {
    let report = migrate_committed(
        &mut controls[on],
        MigrateRequest {
            pid,
            destination_node: format!("node{}", 2 - on),
            strategy: strategy as i32,
            ..Default::default()
        },
    )
    .await;
    let (_, destination) = source_and_destination(controls, on);
    let moved = wait_for_process(destination, report.destination_pid, |p| {
        p.state == "running"
    })
    .await;
    assert_eq!(moved.origin, "migrated-in");
    // Dead when the report came (a zombie at most: a large address space
    // takes a moment to go), then reaped.
    assert!(
        matches!(process_state(pid), None | Some('Z')),
        "the source copy still runs"
    );
    wait_until_gone(pid);
    report
}

#[test]
fn a_redis_server_moves_with_its_whole_data_set() {
    if !ferry_integration::can_run("a_redis_server_moves_with_its_whole_data_set") {
        return;
    }
    if !Redis::installed() {
        panic!("{REDIS_SERVER} is missing: `cargo xtask setup` installs Debian's redis-server");
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    rt.block_on(async {
        let mut controls = [
            cluster.control("node1").await.expect("control node1"),
            cluster.control("node2").await.expect("control node2"),
        ];
        let dir = tempfile::tempdir().expect("a working directory for redis");
        let argv = REDIS.argv(dir.path());
        let mut pid = run(&mut controls[0], argv).await;
        wait_for_process(&mut controls[0], pid, |p| p.tcp_listening >= 1).await;
        // 100,000 keys of 1,000 bytes, then a digest of all of it.
        assert_eq!(redis(&cluster, &["DEBUG", "POPULATE", "100000", "key", "1000"]), "OK");
        let mut on = 0;
        for (round, strategy) in [
            Strategy::PreCopy,
            Strategy::PostCopy,
            Strategy::QueuedPreCopy,
            Strategy::TotalCopy,
        ]
        .into_iter()
        .enumerate()
        {
            // A write per migration: the data set the digest covers moves.
            assert_eq!(
                redis(&cluster, &["SET", &format!("round:{round}"), &"x".repeat(4096)]),
                "OK"
            );
            let digest = redis(&cluster, &["DEBUG", "DIGEST"]);
            let report = move_across(&mut controls, on, pid, strategy).await;
            eprintln!(
                "{strategy:?}: freeze {:.1} ms, {} pages dumped, {} left out and {} filled after the resume in {:.1} ms, post-copy window {:.1} ms, destination peak {:.1} MiB",
                report.freeze_time_us as f64 / 1e3,
                report.dumped_pages,
                report.left_out_pages,
                report.filled_pages,
                report.fill_time_us as f64 / 1e3,
                report.post_processing_time_us as f64 / 1e3,
                report.destination_peak_extra_bytes as f64 / f64::from(1 << 20)
            );
            if matches!(strategy, Strategy::PreCopy | Strategy::QueuedPreCopy) {
                // Most of the ~100 MiB was held by the destination and left
                // out of the dump.
                assert!(report.left_out_pages > 20_000, "{report:#?}");
                assert!(report.filled_pages <= report.left_out_pages, "{report:#?}");
            }
            assert_eq!(redis(&cluster, &["DEBUG", "DIGEST"]), digest, "{strategy:?}");
            assert_eq!(redis(&cluster, &["DBSIZE"]), format!("{}", 100_001 + round));
            pid = report.destination_pid;
            on = 1 - on;
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    });
}

/// Pages cross compressed where the agents are told to (`[migration]
/// compression = "lz4"`): Redis's values compress, so the rounds and the
/// freeze's pages images carry far fewer bytes, and the data set is whole
/// after each move, pre-copied or copied in the freeze.
#[test]
fn a_redis_server_moves_with_its_pages_compressed() {
    if !ferry_integration::can_run("a_redis_server_moves_with_its_pages_compressed") {
        return;
    }
    if !Redis::installed() {
        panic!("{REDIS_SERVER} is missing: `cargo xtask setup` installs Debian's redis-server");
    }
    let rt = runtime();
    let mut spec = ClusterSpec::new(2, 1);
    spec.extra_config = "[migration]\ncompression = \"lz4\"\n".into();
    let cluster = Cluster::start(spec).expect("cluster");
    rt.block_on(async {
        let mut controls = [
            cluster.control("node1").await.expect("control node1"),
            cluster.control("node2").await.expect("control node2"),
        ];
        let dir = tempfile::tempdir().expect("a working directory for redis");
        let mut pid = run(&mut controls[0], REDIS.argv(dir.path())).await;
        wait_for_process(&mut controls[0], pid, |p| p.tcp_listening >= 1).await;
        assert_eq!(redis(&cluster, &["DEBUG", "POPULATE", "50000", "key", "1000"]), "OK");
        let mut on = 0;
        for strategy in [Strategy::PreCopy, Strategy::TotalCopy] {
            let digest = redis(&cluster, &["DEBUG", "DIGEST"]);
            let report = move_across(&mut controls, on, pid, strategy).await;
            eprintln!(
                "{strategy:?}: freeze {:.1} ms, {} bytes transferred, {} bytes of pages compressed to {}",
                report.freeze_time_us as f64 / 1e3,
                report.bytes_transferred,
                report.compressed_page_bytes,
                report.compressed_to_bytes
            );
            // ~50 MiB of values: most of them crossed compressed, in a
            // fraction of their size.
            assert!(report.compressed_page_bytes > 40 << 20, "{report:#?}");
            assert!(
                report.compressed_to_bytes < report.compressed_page_bytes / 4,
                "{report:#?}"
            );
            assert!(report.bytes_transferred < 40 << 20, "{report:#?}");
            assert_eq!(redis(&cluster, &["DEBUG", "DIGEST"]), digest, "{strategy:?}");
            pid = report.destination_pid;
            on = 1 - on;
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    });
}
