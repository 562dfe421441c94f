//! Post-copy end to end, with the pages following by ferryd (the default:
//! the dump leaves them in the stopped copy, ferryd streams them, the
//! destination's page filler installs them) and by CRIU's lazy pages:
//! `ferry-memwriter` resumes on the destination with none of its private
//! memory, its pages follow, and its own check of its memory passes there;
//! a post-copy that fails before the resume leaves it running, intact, on
//! the source, with no CRIU page server or lazy-pages daemon left behind;
//! one whose source loses the pages after the resume, or whose
//! destination agent is killed during the fill, is reported lost and runs
//! nowhere (rather than on zeros where its pages never came). Root only; run by `cargo xtask test` (or `cargo xtask
//! integration`).

use std::time::Duration;

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{
    Faulted, follow_with_fault, list, migrate_request, process_state, runtime, wait_for_process,
};
use ferry_integration::memwriter::{MemWriter, source_and_destination, write_protected};
use ferry_integration::peer::{self, block_on_in};
use ferry_proto::v1::{MigrateRequest, MigrationOutcome, MigrationReport, Strategy};

const PORT: u16 = 7310;

const WRITER: MemWriter = MemWriter { port: PORT };

fn check(cluster: &Cluster) -> u64 {
    WRITER.check(cluster)
}

fn post_copy(pid: i32, to: &str) -> MigrateRequest {
    MigrateRequest {
        pid,
        destination_node: to.into(),
        strategy: Strategy::PostCopy as i32,
        ..Default::default()
    }
}

/// CRIU processes the node's agent started that still run (a dump's page
/// server, a lazy-pages daemon, a restore). Other CRIUs on the machine
/// (other tests, benchmarks) are not ours.
fn criu_children(cluster: &Cluster, node: &str) -> Vec<i32> {
    agent_children(cluster, node, "criu", None)
}

/// The TCP sockets of a process that are not connected over loopback
/// (listening ones included), as "local remote state" lines of its
/// namespace's /proc/net/tcp.
fn tcp_off_loopback(pid: i32) -> Vec<String> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy().into_owned();
                    l.strip_prefix("socket:[")
                        .and_then(|r| r.strip_suffix(']'))
                        .map(str::to_owned)
                })
                .collect()
        })
        .unwrap_or_default();
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
    let mut found = Vec::new();
    for line in table.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        // sl local remote st ... uid timeout inode
        if f.len() < 10 || !inodes.iter().any(|i| i == f[9]) {
            continue;
        }
        let loopback = |a: &str| a.starts_with("0100007F:");
        if !(loopback(f[1]) && loopback(f[2]) && f[3] != "0A") {
            found.push(format!("{} {} {}", f[1], f[2], f[3]));
        }
    }
    found
}

/// Waits (bounded) until the agent has no CRIU child left.
async fn no_criu_left(cluster: &Cluster, node: &str) {
    for _ in 0..100 {
        if criu_children(cluster, node).is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "CRIU processes left behind on {node}: {:?}",
        criu_children(cluster, node)
    );
}

/// Who moves the pages after the resume (`[migration] post_copy_pages`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pages {
    Ferryd,
    Criu,
}

fn cluster_for(pages: Pages) -> Cluster {
    let mut spec = ClusterSpec::new(2, 1);
    if pages == Pages::Criu {
        spec.extra_config = "[migration]\npost_copy_pages = \"criu\"\n".into();
    }
    Cluster::start(spec).expect("cluster")
}

fn summary(r: &MigrationReport) -> String {
    format!(
        "freeze {:.1} ms, post-processing {:.1} ms, total {:.1} ms, {} pages after the resume, {} bytes ({} of images); phases {}",
        r.freeze_time_us as f64 / 1e3,
        r.post_processing_time_us as f64 / 1e3,
        r.total_time_us as f64 / 1e3,
        r.postcopy_pages,
        r.bytes_transferred,
        r.image_bytes,
        r.phases
            .iter()
            .map(|p| format!("{} {:.1}", p.phase, p.duration_us as f64 / 1e3))
            .collect::<Vec<_>>()
            .join(", "),
    )
}

#[test]
fn memory_follows_the_process_after_a_post_copy_migration() {
    if !ferry_integration::can_run("memory_follows_the_process_after_a_post_copy_migration") {
        return;
    }
    memory_follows(Pages::Ferryd);
}

#[test]
fn memory_follows_the_process_after_a_post_copy_migration_by_criu() {
    if !ferry_integration::can_run("memory_follows_the_process_after_a_post_copy_migration_by_criu")
    {
        return;
    }
    memory_follows(Pages::Criu);
}

fn memory_follows(pages: Pages) {
    let rt = runtime();
    let cluster = cluster_for(pages);
    let first_id = rt.block_on(async {
        let mut controls = [
            cluster.control("node1").await.expect("control node1"),
            cluster.control("node2").await.expect("control node2"),
        ];
        let mut pid = WRITER.start(&mut controls[0], 64, 10).await;
        let mut writes = check(&cluster);
        let mut on = 0;
        let mut first_id = None;
        // There and back: each agent is the source once.
        for _ in 0..2 {
            let to = 1 - on;
            let to_name = format!("node{}", to + 1);
            let (report, status) = migrate_request(&mut controls[on], post_copy(pid, &to_name))
                .await
                .expect("migration starts");
            first_id.get_or_insert_with(|| report.migration_id.clone());
            assert!(status.is_none(), "{status:?}\n{report:#?}");
            assert_eq!(
                report.outcome,
                MigrationOutcome::Committed as i32,
                "{report:#?}"
            );
            assert!(report.error.is_empty(), "{report:#?}");
            assert_eq!(report.strategy, Strategy::PostCopy as i32);
            eprintln!("post-copy ({pages:?}) to {to_name}: {}", summary(&report));
            // Most of the 64 MiB followed the process (the freeze carried
            // none of it: the images are small).
            assert!(report.postcopy_pages >= 16384 / 2, "{}", summary(&report));
            assert!(
                report.image_bytes < 8 << 20,
                "private memory in the images: {}",
                summary(&report)
            );
            assert!(report.bytes_transferred >= report.postcopy_pages * 4096);
            assert!(report.freeze_time_us > 0);
            // The writer touches random pages from its first moment on the
            // destination: some were still missing, and it waited for them.
            assert!(report.postcopy_faults > 0, "{report:#?}");
            assert!(report.postcopy_fault_wait_us > 0, "{report:#?}");
            eprintln!(
                "  delay after the resume: {} faults, {:.1} ms waited",
                report.postcopy_faults,
                report.postcopy_fault_wait_us as f64 / 1e3
            );
            for phase in ["release", "commit", "post-copy", "discard"] {
                assert!(
                    report.phases.iter().any(|p| p.phase == phase),
                    "no {phase} phase: {report:#?}"
                );
            }
            // It runs on the destination, gone from the source (the
            // post-processing is over when the report comes), with every
            // page it wrote, and goes on writing.
            let later = {
                let (source, destination) = source_and_destination(&mut controls, on);
                WRITER
                    .moved_intact(
                        &cluster,
                        source,
                        destination,
                        pid,
                        report.destination_pid,
                        writes,
                    )
                    .await
            };
            // No page server, no daemon, no images left, no write
            // protection on the process (ferryd's pages write-protect the
            // source's copy before the freeze).
            no_criu_left(&cluster, "node1").await;
            no_criu_left(&cluster, "node2").await;
            assert!(cluster.incoming_dir_is_empty(&to_name));
            assert!(
                !write_protected(report.destination_pid),
                "write protection on the destination's copy"
            );
            writes = later;
            pid = report.destination_pid;
            on = to;
        }
        first_id.expect("a first migration")
    });
    // Only the node a post-copy came from may ask how its pages are doing:
    // node2's own certificate is refused on node2's peer port, node1's is
    // answered (the first migration went from node1 to node2).
    if let Some(tls) = cluster.tls().cloned() {
        let addr = cluster.peer_addr("node2");
        let ask = |identity: &'static str| {
            let tls = tls.clone();
            let id = first_id.clone();
            block_on_in(&cluster.netns_path("node1"), move || async move {
                let mut p = peer::connect(addr, Some(tls.client("node2", Some(identity))))
                    .await
                    .map_err(|e| format!("connect: {e}"))?;
                p.post_copy_status(ferry_proto::v1::PostCopyStatusRequest {
                    migration_id: id,
                    wait_ms: 0,
                })
                .await
                .map(|r| r.into_inner().state)
                .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
            })
            .expect("node1's namespace")
        };
        let refused = ask("node2").expect_err("node2 asked about node1's migration");
        assert!(refused.starts_with("PermissionDenied"), "{refused}");
        assert_eq!(
            ask("node1").expect("node1 asks about its own migration"),
            ferry_proto::v1::PostCopyState::Done as i32
        );
    }
}

/// Assisted post-copy: one live pass, then post-copy in which the
/// destination answers the pass's pages itself; only pages written since
/// the pass cross after the resume.
#[test]
fn memory_follows_the_process_after_an_assisted_post_copy_migration() {
    if !ferry_integration::can_run(
        "memory_follows_the_process_after_an_assisted_post_copy_migration",
    ) {
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
        for _ in 0..2 {
            let to = 1 - on;
            let to_name = format!("node{}", to + 1);
            let request = MigrateRequest {
                strategy: Strategy::AssistedPostCopy as i32,
                ..post_copy(pid, &to_name)
            };
            let (report, status) = migrate_request(&mut controls[on], request)
                .await
                .expect("migration starts");
            assert!(status.is_none(), "{status:?}\n{report:#?}");
            assert_eq!(
                report.outcome,
                MigrationOutcome::Committed as i32,
                "{report:#?}"
            );
            assert_eq!(report.strategy, Strategy::AssistedPostCopy as i32);
            eprintln!(
                "assisted post-copy to {to_name}: {}; {} of the pages after the resume from the live pass",
                summary(&report),
                report.postcopy_local_pages
            );
            // One full pass while the process ran (most of its 64 MiB),
            // then a scan that only decided the freeze.
            let pass = report.rounds.first().expect("a live pass");
            assert!(pass.sent_pages >= 16384 / 2, "{report:#?}");
            assert!(
                report.rounds.iter().skip(1).all(|r| r.sent_pages == 0),
                "more than one pass: {report:#?}"
            );
            assert_eq!(report.memory_tracking, "uffd-wp-async+pagemap-scan");
            // After the resume the destination answered most pages itself;
            // only the few written since the pass came from the source.
            assert!(report.postcopy_pages >= 16384 / 2, "{}", summary(&report));
            assert!(report.postcopy_local_pages <= report.postcopy_pages);
            let remote = report.postcopy_pages - report.postcopy_local_pages;
            assert!(
                report.postcopy_local_pages > 4 * remote,
                "{} pages from the source, {} from the pass",
                remote,
                report.postcopy_local_pages
            );
            assert!(report.image_bytes < 8 << 20, "{}", summary(&report));
            let later = {
                let (source, destination) = source_and_destination(&mut controls, on);
                WRITER
                    .moved_intact(&cluster, source, destination, pid, report.destination_pid, writes)
                    .await
            };
            // Every page, as the process wrote it, including those written
            // after the pass.
            no_criu_left(&cluster, "node1").await;
            no_criu_left(&cluster, "node2").await;
            assert!(cluster.incoming_dir_is_empty(&to_name));
            assert!(
                !write_protected(report.destination_pid),
                "write protection left on the destination's copy"
            );
            writes = later;
            pid = report.destination_pid;
            on = to;
        }
    });
}

#[test]
fn a_failed_post_copy_migration_leaves_the_process_intact_on_the_source() {
    if !ferry_integration::can_run(
        "a_failed_post_copy_migration_leaves_the_process_intact_on_the_source",
    ) {
        return;
    }
    let rt = runtime();
    let cluster = cluster_for(Pages::Ferryd);
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let pid = WRITER.start(&mut node1, 64, 10).await;
        let before = check(&cluster);

        // The restore fails (node2's port is taken by a process its agent
        // does not manage), with the page filler already started there
        // and the source's copy write-protected (ferryd's post-copy), or
        // (assisted) the lazy-pages daemon started there and CRIU's page
        // server serving on node1.
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
            // Plain, and assisted (after its live pass, with the write
            // protection of the pass's tracking to undo).
            for strategy in [Strategy::PostCopy, Strategy::AssistedPostCopy] {
                let request = MigrateRequest {
                    strategy: strategy as i32,
                    ..post_copy(pid, "node2")
                };
                let (report, status) = migrate_request(&mut node1, request)
                    .await
                    .expect("migration starts");
                assert_eq!(
                    status.as_ref().map(|s| s.code()),
                    Some(tonic::Code::Aborted),
                    "{strategy:?}: {status:?}"
                );
                assert_eq!(
                    report.outcome,
                    MigrationOutcome::Aborted as i32,
                    "{report:#?}"
                );
                assert!(report.resumed_on_source, "{report:#?}");
                eprintln!("{strategy:?} abort: {}", report.error);
                wait_for_process(&mut node1, pid, |p| p.state == "running").await;
                assert!(
                    !write_protected(pid),
                    "{strategy:?}: write protection left on the source's process"
                );
                no_criu_left(&cluster, "node1").await;
                no_criu_left(&cluster, "node2").await;
            }
        }
        assert!(cluster.incoming_dir_is_empty("node2"));
        // Served by node1 again, with the memory it wrote, and writing.
        cluster
            .wait_listening("node1", PORT, Duration::from_secs(10))
            .expect("listening on node1");
        let after = check(&cluster);
        assert!(after > before, "the process stopped writing");

        // And it can still go, post-copy, once the port is free.
        let (report, status) = migrate_request(&mut node1, post_copy(pid, "node2"))
            .await
            .expect("migration starts");
        assert!(status.is_none(), "{status:?}\n{report:#?}");
        assert_eq!(
            report.outcome,
            MigrationOutcome::Committed as i32,
            "{report:#?}"
        );
        check(&cluster);
    });
}

#[test]
fn a_post_copy_whose_page_server_dies_after_the_resume_is_reported_lost() {
    if !ferry_integration::can_run(
        "a_post_copy_whose_page_server_dies_after_the_resume_is_reported_lost",
    ) {
        return;
    }
    source_of_pages_dies(Pages::Criu);
}

#[test]
fn a_post_copy_whose_stopped_copy_dies_after_the_resume_is_reported_lost() {
    if !ferry_integration::can_run(
        "a_post_copy_whose_stopped_copy_dies_after_the_resume_is_reported_lost",
    ) {
        return;
    }
    source_of_pages_dies(Pages::Ferryd);
}

/// After the resume, what the pages come from dies on the source: CRIU's
/// page server, or (ferryd's pages) the stopped copy they are read from.
fn source_of_pages_dies(pages: Pages) {
    let rt = runtime();
    let cluster = cluster_for(pages);
    rt.block_on(async {
        let mut controls = [
            cluster.control("node1").await.expect("control node1"),
            cluster.control("node2").await.expect("control node2"),
        ];
        // Big enough that its pages take a while to follow.
        let pid = WRITER.start(&mut controls[0], 512, 10).await;
        check(&cluster);
        let mut stream = controls[0]
            .migrate(post_copy(pid, "node2"))
            .await
            .expect("migration starts")
            .into_inner();
        let (mut report, mut end, mut killed) = (None, None, Vec::new());
        loop {
            match stream.message().await {
                Ok(Some(ev)) => match ev.event {
                    // The process runs on node2 now; its pages still come
                    // from node1: kill the stopped copy they are read from.
                    Some(ferry_proto::v1::migration_event::Event::Progress(p))
                        if p.phase == "post-copy" && pages == Pages::Ferryd =>
                    {
                        assert!(criu_children(&cluster, "node1").is_empty());
                        nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(pid),
                            nix::sys::signal::Signal::SIGKILL,
                        )
                        .expect("killing the stopped copy");
                        killed.push(pid);
                    }
                    // Or node1's CRIU page server: kill it.
                    Some(ferry_proto::v1::migration_event::Event::Progress(p))
                        if p.phase == "post-copy" =>
                    {
                        // The page server and the lazy-pages daemon talk
                        // only to their agents, over loopback: nothing
                        // listens, nothing crosses the cluster network
                        // outside the agents' TLS.
                        for node in ["node1", "node2"] {
                            for c in criu_children(&cluster, node) {
                                let open = tcp_off_loopback(c);
                                assert!(
                                    open.is_empty(),
                                    "CRIU (PID {c}) on {node} has TCP sockets off loopback: {open:?}"
                                );
                            }
                        }
                        for c in criu_children(&cluster, "node1") {
                            nix::sys::signal::kill(
                                nix::unistd::Pid::from_raw(c),
                                nix::sys::signal::Signal::SIGKILL,
                            )
                            .expect("killing the page server");
                            killed.push(c);
                        }
                    }
                    Some(ferry_proto::v1::migration_event::Event::Report(r)) => report = Some(r),
                    _ => {}
                },
                Ok(None) => break,
                Err(s) => {
                    end = Some(s);
                    break;
                }
            }
        }
        assert!(!killed.is_empty(), "nothing to kill on node1");
        let report = report.expect("a report");
        eprintln!("lost: {}\n{}", report.error, summary(&report));
        assert_eq!(report.outcome, MigrationOutcome::Lost as i32, "{report:#?}");
        assert!(!report.error.is_empty());
        assert_eq!(end.map(|s| s.code()), Some(tonic::Code::DataLoss));
        // It runs nowhere, and nothing of the migration is left.
        assert_eq!(process_state(pid), None, "source copy still exists");
        for _ in 0..50 {
            if process_state(report.destination_pid).is_none_or(|s| s == 'Z') {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            process_state(report.destination_pid).is_none_or(|s| s == 'Z'),
            "the destination's copy still runs without its pages"
        );
        for _ in 0..50 {
            if list(&mut controls[1]).await.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(list(&mut controls[0]).await.is_empty());
        assert!(list(&mut controls[1]).await.is_empty());
        no_criu_left(&cluster, "node1").await;
        no_criu_left(&cluster, "node2").await;
        assert!(cluster.incoming_dir_is_empty("node2"));
    });
}

/// The agent's children named `comm` (with `arg` on their command line,
/// if given), still running.
fn agent_children(cluster: &Cluster, node: &str, comm: &str, arg: Option<&str>) -> Vec<i32> {
    let agent = cluster.agent_pid(node);
    let mut found = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{agent}/task")) else {
        return found;
    };
    for t in tasks.flatten() {
        let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        for c in children
            .split_whitespace()
            .filter_map(|c| c.parse::<i32>().ok())
        {
            let name = std::fs::read_to_string(format!("/proc/{c}/comm")).unwrap_or_default();
            let cmdline = std::fs::read(format!("/proc/{c}/cmdline")).unwrap_or_default();
            let has_arg =
                arg.is_none_or(|arg| cmdline.split(|b| *b == 0).any(|a| a == arg.as_bytes()));
            if name.trim() == comm && has_arg && process_state(c).is_some_and(|s| s != 'Z') {
                found.push(c);
            }
        }
    }
    found
}

async fn ended_within(pid: i32, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if process_state(pid).is_none_or(|s| s == 'Z') {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[test]
fn a_post_copy_whose_destination_agent_dies_during_the_fill_runs_nowhere_rather_than_on_zeros() {
    if !ferry_integration::can_run(
        "a_post_copy_whose_destination_agent_dies_during_the_fill_runs_nowhere_rather_than_on_zeros",
    ) {
        return;
    }
    // The destination's ferryd is SIGKILLed while the pages still follow:
    // the restored process must not wait forever on the pages no one will
    // bring, nor read zeros in their place once no one holds its
    // userfaultfd: the page filler, left alone, kills it. The source
    // reports the migration lost and keeps nothing.
    let rt = runtime();
    let mut spec = ClusterSpec::new(2, 1);
    spec.extra_config = "peer_timeout_secs = 2\n".into();
    let mut cluster = Cluster::start(spec).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut node2 = cluster.control("node2").await.expect("control node2");
        // Big enough that its pages take a while to follow.
        let pid = WRITER.start(&mut node1, 768, 10).await;
        check(&cluster);
        let mut stream = node1
            .migrate(post_copy(pid, "node2"))
            .await
            .expect("migration starts")
            .into_inner();
        let (mut restored, mut filler) = (Vec::new(), Vec::new());
        let Faulted {
            report,
            status: end,
        } = follow_with_fault(
            &mut stream,
            Duration::from_secs(120),
            |p| p.phase == "post-copy",
            async || {
                restored = list(&mut node2).await.iter().map(|p| p.pid).collect();
                filler = agent_children(&cluster, "node2", "ferryd", Some("fill"));
                assert_eq!(restored.len(), 1, "the restored writer on node2");
                assert_eq!(filler.len(), 1, "node2's page filler");
                nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(cluster.agent_pid("node2")),
                    nix::sys::signal::Signal::SIGKILL,
                )
                .expect("killing node2's agent");
            },
        )
        .await;
        eprintln!(
            "outcome: {:?} {}\n{}",
            end.as_ref().map(|s| s.code()),
            report.error,
            summary(&report)
        );
        assert_eq!(report.outcome, MigrationOutcome::Lost as i32, "{report:#?}");
        assert_eq!(end.map(|s| s.code()), Some(tonic::Code::DataLoss));
        // The filler killed the restored process and ended; the source's
        // stopped copy is gone too.
        assert!(
            ended_within(restored[0], Duration::from_secs(10)).await,
            "the restored process still runs (state {:?}) without its pages",
            process_state(restored[0])
        );
        assert!(
            ended_within(filler[0], Duration::from_secs(10)).await,
            "the page filler still runs"
        );
        assert_eq!(process_state(pid), None, "the source's copy still exists");
        assert!(list(&mut node1).await.is_empty());
        no_criu_left(&cluster, "node1").await;
        // node2's agent comes back; nothing of the migration runs there.
        cluster
            .start_agent("node2")
            .expect("node2's agent restarts");
        let mut node2 = cluster.control("node2").await.expect("control node2");
        let left = list(&mut node2).await;
        assert!(left.is_empty(), "{left:?}");
        assert!(cluster.incoming_dir_is_empty("node2"));
    });
}

#[test]
fn a_post_copy_whose_cluster_link_is_cut_during_the_fill_reports_the_loss_on_both_sides() {
    if !ferry_integration::can_run(
        "a_post_copy_whose_cluster_link_is_cut_during_the_fill_reports_the_loss_on_both_sides",
    ) {
        return;
    }
    // The destination is cut off the cluster network while the pages still
    // follow: nothing is refused, reset or answered, packets just vanish.
    // Neither side may wait forever: the destination gives the pages up
    // and kills the process rather than let it wait on them (or read
    // zeros), the source reports the migration lost and keeps nothing;
    // neither copy runs once the link is back.
    let rt = runtime();
    let mut spec = ClusterSpec::new(2, 1);
    spec.extra_config = "peer_timeout_secs = 2\n".into();
    let cluster = Cluster::start(spec).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut node2 = cluster.control("node2").await.expect("control node2");
        // Big enough that its pages take a while to follow.
        let pid = WRITER.start(&mut node1, 768, 10).await;
        check(&cluster);
        let mut stream = node1
            .migrate(post_copy(pid, "node2"))
            .await
            .expect("migration starts")
            .into_inner();
        let mut restored = Vec::new();
        let Faulted {
            report,
            status: end,
        } = follow_with_fault(
            &mut stream,
            Duration::from_secs(120),
            |p| p.phase == "post-copy",
            async || {
                restored = list(&mut node2).await.iter().map(|p| p.pid).collect();
                assert_eq!(restored.len(), 1, "the restored writer on node2");
                cluster.cut_cluster_link("node2", true);
            },
        )
        .await;
        eprintln!(
            "outcome: {:?} {}\n{}",
            end.as_ref().map(|s| s.code()),
            report.error,
            summary(&report)
        );
        assert_eq!(report.outcome, MigrationOutcome::Lost as i32, "{report:#?}");
        assert_eq!(end.map(|s| s.code()), Some(tonic::Code::DataLoss));
        assert_eq!(process_state(pid), None, "the source's copy still exists");
        // node2 gave the pages up on its own, cut off as it is.
        assert!(
            ended_within(restored[0], Duration::from_secs(60)).await,
            "the restored process still runs (state {:?}) without its pages",
            process_state(restored[0])
        );
        cluster.cut_cluster_link("node2", false);
        for _ in 0..50 {
            if list(&mut node2).await.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(list(&mut node1).await.is_empty());
        assert!(list(&mut node2).await.is_empty());
        no_criu_left(&cluster, "node1").await;
        no_criu_left(&cluster, "node2").await;
        assert!(cluster.incoming_dir_is_empty("node2"));
    });
}
