//! Memory strategies end to end: a process that keeps writing its memory
//! in a pattern it can check (`ferry-memwriter`) migrates with total copy,
//! pre-copy and queued pre-copy, and its memory on the destination is what
//! it wrote; failures before the commit leave it running on the source,
//! intact and without write protection; a destination without room for
//! the process refuses it before anything stops, also one that grows past
//! it during the rounds; guard pages made in pre-copied memory stay
//! guards; memory of every kind
//! (huge pages, shared anonymous, memfd, advised and locked regions) moves intact with every
//! strategy; a committed process is filled from the destination's own store with the source's
//! agent killed at the commit. Root only; run by `cargo xtask test` (or `cargo xtask
//! integration`).

use std::time::Duration;

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{
    Faulted, follow_with_fault, migrate_committed, migrate_request, process_state, runtime,
    wait_for_process,
};
use ferry_integration::memwriter::{MemWriter, source_and_destination, write_protected};
use ferry_proto::v1::control_client::ControlClient;
use ferry_proto::v1::{
    MigrateRequest, MigrationOutcome, MigrationReport, PrecopyThrottle, Strategy,
};
use tonic::transport::Channel;

const PORT: u16 = 7300;

const WRITER: MemWriter = MemWriter { port: PORT };

fn check(cluster: &Cluster) -> u64 {
    WRITER.check(cluster)
}

/// [`MemWriter::moved_intact`] for the writer that `report` moved from the
/// node at `on`.
async fn moved_intact(
    cluster: &Cluster,
    controls: &mut [ControlClient<Channel>; 2],
    on: usize,
    pid: i32,
    report: &MigrationReport,
    writes: u64,
) -> u64 {
    let (source, destination) = source_and_destination(controls, on);
    WRITER
        .moved_intact(
            cluster,
            source,
            destination,
            pid,
            report.destination_pid,
            writes,
        )
        .await
}

fn request(pid: i32, to: &str, strategy: Strategy) -> MigrateRequest {
    MigrateRequest {
        pid,
        destination_node: to.into(),
        strategy: strategy as i32,
        ..Default::default()
    }
}

/// After an abort: the report says so and that the process resumed on
/// the source, where it runs with no write protection left.
async fn kept_on_the_source(
    node1: &mut ControlClient<Channel>,
    pid: i32,
    report: &MigrationReport,
) {
    assert_eq!(
        report.outcome,
        MigrationOutcome::Aborted as i32,
        "{report:#?}"
    );
    assert!(report.resumed_on_source, "{report:#?}");
    assert!(!write_protected(pid), "write protection left behind");
    wait_for_process(node1, pid, |p| p.state == "running").await;
}

/// The process moves to node2 after all (pre-copy): committed, the
/// source's copy gone, every page it wrote there.
async fn moves_after_all(cluster: &Cluster, node1: &mut ControlClient<Channel>, pid: i32) {
    let report = migrate_committed(node1, request(pid, "node2", Strategy::PreCopy)).await;
    assert_eq!(
        report.outcome,
        MigrationOutcome::Committed as i32,
        "{report:#?}"
    );
    assert_eq!(process_state(pid), None, "source copy still exists");
    check(cluster);
}

/// Migrates `pid` to node2 with `strategy`, rounds going on (budget 1 ms,
/// up to 1000 rounds), with `fault` at the first progress event `at`
/// accepts ([`follow_with_fault`]).
async fn migrate_with_fault(
    node1: &mut ControlClient<Channel>,
    pid: i32,
    strategy: Strategy,
    within: Duration,
    at: impl Fn(&ferry_proto::v1::MigrationProgress) -> bool,
    fault: impl FnOnce(),
) -> Faulted {
    let mut stream = node1
        .migrate(MigrateRequest {
            max_rounds: 1000,
            downtime_budget_ms: 1,
            ..request(pid, "node2", strategy)
        })
        .await
        .expect("migration starts")
        .into_inner();
    follow_with_fault(&mut stream, within, at, async || fault()).await
}

/// The round events of a pre-copy (the first one, or later ones).
fn a_round(p: &ferry_proto::v1::MigrationProgress) -> bool {
    p.phase.starts_with("pre-copy round")
}

fn summary(r: &MigrationReport) -> String {
    format!(
        "strategy {} freeze {:.1} ms ({}), preparation {:.1} ms, total {:.1} ms, {} bytes, rounds {:?} ({}), pages in freeze {} of {} ({} pre-copied, {} left out of the dump), {} restored from the store in the freeze, {} filled after the resume in {:.1} ms ({} faults), destination peak {:.1} MiB",
        r.strategy,
        r.freeze_time_us as f64 / 1e3,
        r.freeze_parts
            .iter()
            .map(|p| format!("{} {:.1}", p.phase, p.duration_us as f64 / 1e3))
            .collect::<Vec<_>>()
            .join(", "),
        r.preparation_time_us as f64 / 1e3,
        r.total_time_us as f64 / 1e3,
        r.bytes_transferred,
        r.rounds
            .iter()
            .map(|x| (x.written_pages, x.sent_pages, x.delayed_pages))
            .collect::<Vec<_>>(),
        r.convergence,
        r.freeze_pages,
        r.dumped_pages,
        r.precopied_pages,
        r.left_out_pages,
        r.restored_from_store_pages,
        r.filled_pages,
        r.fill_time_us as f64 / 1e3,
        r.fill_faults,
        r.destination_peak_extra_bytes as f64 / f64::from(1 << 20)
    )
}

#[test]
fn memory_is_intact_after_migration_with_each_strategy() {
    if !ferry_integration::can_run("memory_is_intact_after_migration_with_each_strategy") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    rt.block_on(async {
        let mut controls = [
            cluster.control("node1").await.expect("control node1"),
            cluster.control("node2").await.expect("control node2"),
        ];
        let mut pid = WRITER.start(&mut controls[0], 64, 10).await;
        let mut writes = check(&cluster);
        let mut on = 0;
        for strategy in [
            Strategy::PreCopy,
            Strategy::QueuedPreCopy,
            Strategy::TotalCopy,
            Strategy::PreCopy,
        ] {
            let to = 1 - on;
            let to_name = format!("node{}", to + 1);
            let (report, status) =
                migrate_request(&mut controls[on], request(pid, &to_name, strategy))
                    .await
                    .expect("migration starts");
            assert!(status.is_none(), "{status:?}\n{report:#?}");
            assert_eq!(
                report.outcome,
                MigrationOutcome::Committed as i32,
                "{report:#?}"
            );
            assert_eq!(report.strategy, strategy as i32);
            eprintln!("{}", summary(&report));
            if strategy == Strategy::TotalCopy {
                assert!(report.rounds.is_empty() && report.memory_tracking.is_empty());
            } else {
                assert_eq!(report.memory_tracking, "uffd-wp-async+pagemap-scan");
                assert!(!report.rounds.is_empty(), "{report:#?}");
                assert!(!report.convergence.is_empty(), "{report:#?}");
                // Most of the 64 MiB crossed before the freeze.
                assert!(
                    report.precopied_pages > report.dumped_pages / 2,
                    "{}",
                    summary(&report)
                );
                assert_eq!(
                    report.freeze_pages + report.precopied_pages,
                    report.dumped_pages
                );
                assert!(report.preparation_time_us > 0);
                // The dump left out the pre-copied pages (CRIU built by
                // `cargo xtask setup` carries the held-pages patch; only
                // those of the stack go through the freeze), and the
                // destination installed each of them from its store after
                // the resume: the freeze read, sent and restored only the
                // pages written since the last round.
                assert!(
                    report.left_out_pages > report.precopied_pages * 9 / 10,
                    "{}",
                    summary(&report)
                );
                // All of them, the filler's and those the restore read
                // from the store in the freeze (pages of the binary's and
                // libraries' file mappings it wrote), but, at most, those
                // of the writer's side region (16 pages, unmapped and
                // mapped anew every 200 ms), if it went before the filler
                // reached it.
                let installed = report.filled_pages + report.restored_from_store_pages;
                assert!(report.restored_from_store_pages > 0, "{}", summary(&report));
                assert!(
                    installed <= report.left_out_pages && installed + 16 >= report.left_out_pages,
                    "{}",
                    summary(&report)
                );
                // The destination held one copy of the pages at most: its
                // store drains as the process fills.
                let process_bytes = report.dumped_pages * 4096;
                assert!(
                    report.destination_peak_extra_bytes > process_bytes / 2
                        && report.destination_peak_extra_bytes < process_bytes * 3 / 2,
                    "destination peak {} B for {process_bytes} B of pages",
                    report.destination_peak_extra_bytes
                );
            }
            // It runs on the destination, gone from the source, with every
            // page it wrote, and goes on writing.
            let later = moved_intact(&cluster, &mut controls, on, pid, &report, writes).await;
            assert!(!write_protected(report.destination_pid));
            writes = later;
            pid = report.destination_pid;
            on = to;
        }
    });
}

#[test]
fn a_failed_precopy_migration_leaves_the_process_intact_on_the_source() {
    if !ferry_integration::can_run(
        "a_failed_precopy_migration_leaves_the_process_intact_on_the_source",
    ) {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let pid = WRITER.start(&mut node1, 64, 10).await;

        // 1. The restore fails (node2's port is taken by a process its
        //    agent does not manage), after all the pre-copy rounds.
        {
            let _squatter = cluster
                .spawn_in_node(
                    "node2",
                    &MemWriter::binary(),
                    &["--port", &PORT.to_string(), "--mib", "1"],
                )
                .expect("port squatter on node2");
            cluster
                .wait_listening("node2", PORT, Duration::from_secs(10))
                .expect("squatter listening");
            for strategy in [Strategy::PreCopy, Strategy::QueuedPreCopy] {
                let (report, status) = migrate_request(&mut node1, request(pid, "node2", strategy))
                    .await
                    .expect("migration starts");
                assert_eq!(status.map(|s| s.code()), Some(tonic::Code::Aborted));
                kept_on_the_source(&mut node1, pid, &report).await;
                assert!(!report.rounds.is_empty(), "{report:#?}");
                eprintln!("abort after pre-copy: {}", report.error);
            }
        }
        assert!(cluster.incoming_dir_is_empty("node2"));
        // Served by node1 again, with the memory it wrote.
        cluster
            .wait_listening("node1", PORT, Duration::from_secs(10))
            .expect("listening on node1");
        let before = check(&cluster);

        // 2. The destination's agent dies during the pre-copy rounds.
        let agent2 = cluster.agent_pid("node2");
        let Faulted { report, .. } = migrate_with_fault(
            &mut node1,
            pid,
            Strategy::PreCopy,
            Duration::from_secs(120),
            a_round,
            || {
                nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(agent2),
                    nix::sys::signal::Signal::SIGKILL,
                )
                .expect("killing node2's agent")
            },
        )
        .await;
        eprintln!("abort with the destination gone: {}", report.error);
        kept_on_the_source(&mut node1, pid, &report).await;
        let after = check(&cluster);
        assert!(after > before, "the process stopped writing");
    });
}

/// The destination's work dir fills up after a pre-copy round (its tmpfs
/// capped at what it holds then: the pages already sent stay, any new
/// page of the store or the images fails with ENOSPC): the migration aborts
/// with the reason, and the process keeps running on the source, with every
/// page it wrote, no write protection and nothing left on the destination.
/// With room again, it moves.
#[test]
fn a_destination_work_dir_filling_up_during_the_rounds_leaves_the_process_on_the_source() {
    if !ferry_integration::can_run(
        "a_destination_work_dir_filling_up_during_the_rounds_leaves_the_process_on_the_source",
    ) {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let pid = WRITER.start(&mut node1, 64, 10).await;
        let before = check(&cluster);
        for strategy in [Strategy::PreCopy, Strategy::QueuedPreCopy] {
            let mut held = None;
            // After the round that sent most of the memory (a queued
            // pre-copy's first only watches).
            let Faulted { report, status } = migrate_with_fault(
                &mut node1,
                pid,
                strategy,
                Duration::from_secs(120),
                |p| a_round(p) && p.bytes_transferred >= 32 << 20,
                || held = Some(cluster.work_dir_full("node2", true)),
            )
            .await;
            let held = held.expect("the work dir was filled");
            assert!(
                held >= 32 << 20,
                "{strategy:?}: node2 held {held} bytes after the first round"
            );
            kept_on_the_source(&mut node1, pid, &report).await;
            assert!(
                report.error.contains("full") || report.error.contains("No space left"),
                "{strategy:?}: the reason is not said: {}",
                report.error
            );
            assert!(
                status.is_some(),
                "{strategy:?}: the migration ended without an error"
            );
            eprintln!("{strategy:?}, node2's work dir full: {}", report.error);
            assert!(cluster.incoming_dir_is_empty("node2"));
            cluster.work_dir_full("node2", false);
        }
        // Served by node1 again, with all it wrote, and writing on.
        cluster
            .wait_listening("node1", PORT, Duration::from_secs(10))
            .expect("listening on node1");
        assert!(check(&cluster) > before, "the process stopped writing");

        // With room again, it moves.
        moves_after_all(&cluster, &mut node1, pid).await;
    });
}

/// The destination is cut off the cluster network during the pre-copy
/// rounds (its port leaves the cluster's switch: no reset, no ICMP, the
/// packets vanish): within the peer timeout the source gives up, and the
/// process runs on there, with every page it wrote and no write
/// protection. Once the link is back, the destination hears of the abort
/// and keeps nothing, and the process can move.
#[test]
fn a_cluster_link_cut_during_the_rounds_leaves_the_process_on_the_source() {
    if !ferry_integration::can_run(
        "a_cluster_link_cut_during_the_rounds_leaves_the_process_on_the_source",
    ) {
        return;
    }
    let rt = runtime();
    let mut spec = ClusterSpec::new(2, 1);
    spec.extra_config = "peer_timeout_secs = 2\n".into();
    let cluster = Cluster::start(spec).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let pid = WRITER.start(&mut node1, 64, 10).await;
        let before = check(&cluster);
        let Faulted { report, status } = migrate_with_fault(
            &mut node1,
            pid,
            Strategy::PreCopy,
            Duration::from_secs(60),
            a_round,
            || cluster.cut_cluster_link("node2", true),
        )
        .await;
        eprintln!(
            "cut during the rounds: {:?} {}",
            status.as_ref().map(|s| s.code()),
            report.error
        );
        kept_on_the_source(&mut node1, pid, &report).await;
        assert!(status.is_some(), "the migration ended without an error");
        cluster
            .wait_listening("node1", PORT, Duration::from_secs(10))
            .expect("listening on node1");
        assert!(check(&cluster) > before, "the process stopped writing");

        // The link is back: node2 hears of the abort and keeps nothing.
        cluster.cut_cluster_link("node2", false);
        let mut empty = false;
        for _ in 0..100 {
            if cluster.incoming_dir_is_empty("node2") {
                empty = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(empty, "node2 keeps the aborted migration's pages");
        moves_after_all(&cluster, &mut node1, pid).await;
    });
}

/// A process that rewrites its memory faster than the link carries it (4
/// MiB, 16 random page writes per ms of its running time, 5 times what a
/// 100 Mb/s cluster link carries) never converges: every round finds
/// everything written again, and the freeze carries nearly all of it. With
/// the throttle it is slowed down until what is left fits the budget, and
/// the freeze carries a small part; it runs normally on the destination,
/// with every page it wrote. (What this does to Noack (2003)'s RMA process
/// over 1 Gb/s is measured by `cargo xtask bench algorithms -- --throttle
/// auto`: docs/results.md, "Pre-copy with a throttle".)
#[test]
fn a_writer_faster_than_the_link_converges_when_throttled() {
    if !ferry_integration::can_run("a_writer_faster_than_the_link_converges_when_throttled") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    cluster.shape_cluster_links(Some(("100mbit", 131072, "100ms")));
    rt.block_on(async {
        let mut controls = [
            cluster.control("node1").await.expect("control node1"),
            cluster.control("node2").await.expect("control node2"),
        ];
        let mut pid = WRITER
            .start_with(
                &mut controls[0],
                &[
                    "--kib",
                    "4096",
                    "--writes-per-ms",
                    "16",
                    "--hot-percent",
                    "100",
                ],
            )
            .await;
        let mut writes = check(&cluster);
        let mut on = 0;
        for throttle in [PrecopyThrottle::Off, PrecopyThrottle::Auto] {
            let to = 1 - on;
            let request = MigrateRequest {
                downtime_budget_ms: 10,
                max_rounds: 40,
                throttle: throttle as i32,
                ..request(pid, &format!("node{}", to + 1), Strategy::PreCopy)
            };
            let (report, status) = migrate_request(&mut controls[on], request)
                .await
                .expect("migration starts");
            assert!(status.is_none(), "{throttle:?}: {status:?}\n{report:#?}");
            eprintln!(
                "{throttle:?}: {}; throttled to {} %",
                summary(&report),
                report.throttled_to_percent
            );
            assert!(report.dumped_pages >= 1024, "{}", summary(&report));
            match throttle {
                PrecopyThrottle::Off => {
                    assert_eq!(report.throttled_to_percent, 100);
                    assert_eq!(report.convergence, "dirty set not shrinking");
                    assert!(
                        report.freeze_pages * 2 > report.dumped_pages,
                        "unthrottled, most pages should be left for the freeze: {}",
                        summary(&report)
                    );
                }
                _ => {
                    assert!(report.throttled_to_percent < 100, "{}", summary(&report));
                    assert!(
                        report.convergence.contains("throttled to"),
                        "{}",
                        summary(&report)
                    );
                    assert!(
                        report.freeze_pages * 4 < report.dumped_pages,
                        "throttled, the freeze should carry a small part: {}",
                        summary(&report)
                    );
                }
            }
            // On the destination: running (not left stopped by the
            // throttle), writing, with all it wrote.
            let later = moved_intact(&cluster, &mut controls, on, pid, &report, writes).await;
            assert_ne!(
                process_state(report.destination_pid),
                Some('T'),
                "stopped on the destination"
            );
            assert!(!write_protected(report.destination_pid));
            writes = later;
            pid = report.destination_pid;
            on = to;
        }
    });
}

#[test]
fn a_destination_without_room_for_the_process_refuses_it_before_anything_stops() {
    if !ferry_integration::can_run(
        "a_destination_without_room_for_the_process_refuses_it_before_anything_stops",
    ) {
        return;
    }
    let rt = runtime();
    // 40 MiB for incoming migrations on each node. The test's work dirs
    // are tmpfs, so a process's page store and images count as well as
    // its resident set.
    let mut spec = ClusterSpec::new(2, 1);
    spec.extra_config = "[migration]\nincoming_memory_limit_mib = 40\n".into();
    let cluster = Cluster::start(spec).expect("cluster");
    rt.block_on(async {
        let mut controls = [
            cluster.control("node1").await.expect("control node1"),
            cluster.control("node2").await.expect("control node2"),
        ];
        let pid = WRITER.start(&mut controls[0], 64, 10).await;
        let before = check(&cluster);
        for strategy in [Strategy::TotalCopy, Strategy::PreCopy, Strategy::PostCopy] {
            let status =
                match migrate_request(&mut controls[0], request(pid, "node2", strategy)).await {
                    Ok((report, status)) => {
                        assert_ne!(
                            report.outcome,
                            MigrationOutcome::Committed as i32,
                            "{report:#?}"
                        );
                        assert_eq!(report.freeze_time_us, 0, "it stopped: {report:#?}");
                        status.expect("a refusal")
                    }
                    Err(status) => status,
                };
            assert_eq!(
                status.code(),
                tonic::Code::ResourceExhausted,
                "{strategy:?}: {status:?}"
            );
            let message = status.message();
            for part in [
                "node2 cannot hold the process",
                "MiB for the process (its resident set)",
                "MiB for its page store and images",
                "has 40.0 MiB (the limit [migration] incoming_memory_limit_mib)",
            ] {
                assert!(message.contains(part), "{part:?} not in {message:?}");
            }
            wait_for_process(&mut controls[0], pid, |p| p.state == "running").await;
            assert!(!write_protected(pid), "write protection left behind");
        }
        assert!(cluster.incoming_dir_is_empty("node2"));
        // Still served from node1, with all it wrote.
        assert!(check(&cluster) >= before);

        // A process that fits the same limit moves.
        let small_writer = MemWriter { port: PORT + 1 };
        let small = small_writer
            .start_with(&mut controls[0], &["--kib", "2048"])
            .await;
        let report =
            migrate_committed(&mut controls[0], request(small, "node2", Strategy::PreCopy)).await;
        assert_eq!(
            report.outcome,
            MigrationOutcome::Committed as i32,
            "{report:#?}"
        );
        let moved = wait_for_process(&mut controls[1], report.destination_pid, |p| {
            p.state == "running"
        })
        .await;
        assert_eq!(moved.origin, "migrated-in");
        assert_eq!(process_state(small), None, "source copy still exists");
        small_writer.check(&cluster);
        // And the large one never left node1.
        assert!(check(&cluster) >= before);
    });
}

/// A process that grows after Prepare, past what the destination can
/// hold, is refused while its pre-copied pages arrive, before anything
/// stops: 32 MiB fit node2's 160 MiB (its resident set and its page store,
/// the work dir being a tmpfs), 32 + 300 do not. The refusal names what it
/// grew to and the limit; the process runs on on the source with all it
/// wrote, the grown memory too, and node2 keeps nothing.
#[test]
fn a_process_growing_past_the_destinations_room_during_the_rounds_is_refused_before_the_freeze() {
    if !ferry_integration::can_run(
        "a_process_growing_past_the_destinations_room_during_the_rounds_is_refused_before_the_freeze",
    ) {
        return;
    }
    let rt = runtime();
    let mut spec = ClusterSpec::new(2, 1);
    spec.extra_config = "[migration]\nincoming_memory_limit_mib = 160\n".into();
    let cluster = Cluster::start(spec).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let pid = WRITER.start(&mut node1, 32, 10).await;
        let before = check(&cluster);
        let mut grown = String::new();
        // Prepare passed: the pre-copy starts, and the process grows.
        let Faulted { report, status } = migrate_with_fault(
            &mut node1,
            pid,
            Strategy::PreCopy,
            Duration::from_secs(120),
            |p| p.phase == "pre-copy",
            || grown = WRITER.ask(&cluster, "grow 300"),
        )
        .await;
        assert_eq!(grown, format!("grown {}", (300 << 20) / 4096));
        kept_on_the_source(&mut node1, pid, &report).await;
        assert_eq!(report.freeze_time_us, 0, "it stopped: {}", summary(&report));
        let status = status.expect("a refusal");
        assert_eq!(
            status.code(),
            tonic::Code::ResourceExhausted,
            "{status:?}\n{}",
            summary(&report)
        );
        let message = status.message();
        for part in [
            "node2 cannot hold the process: it grew after Prepare",
            "MiB announced",
            "MiB for its page store (the work dir is in memory)",
            "has 160.0 MiB (the limit [migration] incoming_memory_limit_mib)",
        ] {
            assert!(message.contains(part), "{part:?} not in {message:?}");
        }
        eprintln!("refused: {message}");
        assert!(cluster.incoming_dir_is_empty("node2"));
        // Served by node1 still, every page intact (the grown ones too:
        // the check's page count has them), and writing on.
        let (writes, pages) = WRITER.check_pages(&cluster);
        assert!(pages >= (332 << 20) / 4096, "{pages} pages checked");
        assert!(writes > before, "the process stopped writing");
    });
}

/// Guard pages (MADV_GUARD_INSTALL) made after the first round, in memory
/// the destination already holds, are still guards after a pre-copy
/// migration and the rest of their region holds its content: the dump
/// finds them in its scan of the held pages (CRIU's walk of the whole
/// address space for guards leaves those ranges to it).
#[test]
fn guard_pages_made_in_pre_copied_memory_stay_guards() {
    if !ferry_integration::can_run("guard_pages_made_in_pre_copied_memory_stay_guards") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let pid = WRITER
            .start_with(
                &mut node1,
                &["--mib", "16", "--writes-per-ms", "2", "--guard-region"],
            )
            .await;
        let mut guarded = String::new();
        let Faulted { report, status } = migrate_with_fault(
            &mut node1,
            pid,
            Strategy::PreCopy,
            Duration::from_secs(60),
            a_round,
            || guarded = WRITER.ask(&cluster, "guard"),
        )
        .await;
        assert_eq!(guarded, "guarded");
        assert!(status.is_none(), "{status:?}\n{}", summary(&report));
        assert_eq!(
            report.outcome,
            MigrationOutcome::Committed as i32,
            "{report:#?}"
        );
        // The held pages' path: pages were left out of the dump.
        assert!(report.left_out_pages > 0, "{}", summary(&report));
        assert_eq!(process_state(pid), None, "source copy still exists");
        // The check reads every page: the guarded ones must fault.
        check(&cluster);
    });
}

#[test]
fn every_kind_of_memory_is_intact_after_each_strategy() {
    if !ferry_integration::can_run("every_kind_of_memory_is_intact_after_each_strategy") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    rt.block_on(async {
        let mut controls = [
            cluster.control("node1").await.expect("control node1"),
            cluster.control("node2").await.expect("control node2"),
        ];
        // 16 MiB written as usual, plus 8 MiB of transparent huge pages,
        // 1 MiB shared anonymous, 1 MiB of a memfd and 1 MiB of a file
        // mapped private (in the cluster's dir, seen by both nodes), all
        // rewritten while it runs and checked after each migration; and a
        // child that must still share a page of shared anonymous memory
        // and one of a memfd with it.
        let private_file = cluster.dir().join("private-file");
        let mut pid = WRITER
            .start_with(
                &mut controls[0],
                &[
                    "--mib",
                    "16",
                    "--writes-per-ms",
                    "5",
                    "--shapes",
                    "--private-file",
                    private_file.to_str().expect("a UTF-8 path"),
                    "--child",
                ],
            )
            .await;
        let mut writes = check(&cluster);
        let mut on = 0;
        for strategy in [
            Strategy::PreCopy,
            Strategy::PostCopy,
            Strategy::QueuedPreCopy,
            Strategy::AssistedPostCopy,
            Strategy::TotalCopy,
            Strategy::PreCopy,
        ] {
            let to = 1 - on;
            let report = migrate_committed(
                &mut controls[on],
                request(pid, &format!("node{}", to + 1), strategy),
            )
            .await;
            assert_eq!(
                report.outcome,
                MigrationOutcome::Committed as i32,
                "{report:#?}"
            );
            eprintln!("{}", summary(&report));
            if matches!(strategy, Strategy::PreCopy | Strategy::QueuedPreCopy) {
                // The huge pages are private and anonymous: left out and
                // filled like the rest (the shared ones go through CRIU's
                // shared-memory images, never left out).
                assert!(report.left_out_pages > 2048, "{}", summary(&report));
            }
            let later = moved_intact(&cluster, &mut controls, on, pid, &report, writes).await;
            writes = later;
            pid = report.destination_pid;
            on = to;
        }
    });
}

/// After a pre-copy migration commits, the process never waits on the
/// source: its agent killed (SIGKILL) the moment the commit ends the
/// stopped copy there, the destination still installs every page it holds
/// from its own store, and all of the process's memory is intact.
#[test]
fn a_committed_process_is_filled_with_the_source_gone() {
    if !ferry_integration::can_run("a_committed_process_is_filled_with_the_source_gone") {
        return;
    }
    let rt = runtime();
    let mut cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    let (killed_log_len, migration) = rt.block_on(async {
        let mut source = cluster.control("node1").await.expect("control node1");
        // 512 MiB: the destination's fill from its store after the resume
        // (~0.2 s at 2.4 GB/s) outlasts the moments between the commit and
        // the kill.
        let pid = WRITER
            .start_with(&mut source, &["--mib", "512", "--writes-per-ms", "5"])
            .await;
        let before = check(&cluster);
        let migration = tokio::spawn(async move {
            migrate_request(&mut source, request(pid, "node2", Strategy::PreCopy)).await
        });
        // The commit ends the stopped copy on the source (discard).
        let deadline = std::time::Instant::now() + Duration::from_secs(180);
        while cluster.pids_in("node1").contains(&pid) {
            assert!(
                !migration.is_finished() && std::time::Instant::now() < deadline,
                "the process stayed on node1: {:?}",
                if migration.is_finished() {
                    Some(migration.await)
                } else {
                    None
                }
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let agent = nix::unistd::Pid::from_raw(cluster.agent_pid("node1"));
        nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGKILL).expect("SIGKILL");
        let killed_log_len = cluster.log_text("node2").len();
        // On node2, with nothing left on node1 to ask.
        let after = check(&cluster);
        assert!(after >= before, "writes went back from {before} to {after}");
        (killed_log_len, migration)
    });
    let _ = cluster.stop_agent("node1");
    // The migration's call ends with its agent: an error, or the report
    // if it was sent before the kill.
    let _ = rt.block_on(migration);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let filled = loop {
        let log = cluster.log_text("node2");
        let after_kill = &log[killed_log_len.min(log.len())..];
        assert!(
            !log.contains("fill failed after the resume"),
            "{}",
            cluster.log_tail("node2", 40)
        );
        if after_kill.contains("every held page is in") {
            break true;
        }
        if log[..killed_log_len].contains("every held page is in") {
            break false;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "node2's fill did not end: {}",
            cluster.log_tail("node2", 40)
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        filled,
        "the fill ended before the source's agent was killed: nothing shown"
    );
    // Still running, all of its memory intact.
    let first = check(&cluster);
    std::thread::sleep(Duration::from_millis(100));
    assert!(check(&cluster) > first, "the process does not run on node2");
}
