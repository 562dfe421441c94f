//! Faults other than an agent's death, each at one step of a migration
//! from node1 to node2 (agents killed and restarted: `recovery.rs`): a
//! peer that answers after its timeout, CRIU killed while it dumps, before
//! it restores or in the middle of it, the destination's work dir full as the images
//! come, the cluster link cut at the restore. A ferryd started with
//! `FERRY_FAULT_AT=<side>:<point>:pause-<N>ms` waits at that point: longer
//! than the peer timeout, that is a late answer; shorter, it is the
//! window in which the test injects the fault. After each: the process
//! runs on exactly one node, never zero, never two; its connections carry
//! on with every byte once and in order; exactly that node owns them;
//! nothing of the migration is left. Root only; run by `cargo xtask test`
//! (`FERRY_FAULT_CASE=<part of a point>` runs only the matching rows).
//! The table of faults × steps × outcomes: `docs/faults.md`.

use std::time::Duration;

use ferry_integration::cluster::Cluster;
use ferry_integration::faults::{
    Ends, PEER_TIMEOUT, carries_on_at_node1, carries_on_at_node2, cluster_with_fault, echo_server,
    eventually, request,
};
use ferry_integration::managed::{follow_migration, runtime};
use ferry_proto::v1::{MigrationOutcome, Strategy};

/// What the test does while the agent waits at its point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Nothing: the wait itself, longer than the peer timeout, is the
    /// fault (an answer that comes after the caller gave up).
    LateAnswer,
    /// node2's work dir is capped at what it holds (the next page
    /// written there fails with ENOSPC), lifted once the migration ended.
    Node2WorkDirFull,
    /// The CRIU process the node's agent runs is SIGKILLed.
    CriuKilled(&'static str),
    /// node2 is cut off the cluster network, reconnected once the
    /// migration ended.
    Node2LinkCut,
    /// node2's agent kills the CRIU that restores once the tasks exist
    /// (`kill-criu`): no window, nothing for the test to do.
    CriuKilledInRestore,
}

struct Case {
    /// `FERRY_FAULT_AT`: its side names the node whose agent waits there
    /// (source: node1, destination: node2).
    at: &'static str,
    fault: Fault,
    strategy: Strategy,
    ends: Ends,
    /// Words the report's error must hold (why the migration aborted).
    says: &'static [&'static str],
    /// Refused before anything stopped: the Migrate call itself fails,
    /// with no report.
    refused: bool,
}

/// A pause that outlasts the peer timeout (2 s).
const LATE: &str = "pause-5000ms";
/// A window for the test to inject its fault.
const WINDOW: &str = "pause-3000ms";

/// Every case, in the order a migration reaches its point; a new point or
/// fault is a new row. What each point means:
/// `ferry_agent::engine::fault_point`.
const CASES: &[Case] = &[
    // node2 answers the Prepare late: node1 gave up before anything
    // stopped; node2 drops its reservation when node1's Abort comes in.
    Case {
        at: "destination:Prepared",
        fault: Fault::LateAnswer,
        strategy: Strategy::PreCopy,
        ends: Ends::OnSource,
        says: &["no answer"],
        refused: true,
    },
    // node2 answers the Arm late: node1 gave up before the freeze.
    Case {
        at: "destination:Armed",
        fault: Fault::LateAnswer,
        strategy: Strategy::TotalCopy,
        ends: Ends::OnSource,
        says: &["no answer"],
        refused: false,
    },
    // The link to node2 is cut as node1 arms.
    Case {
        at: "source:Arm",
        fault: Fault::Node2LinkCut,
        strategy: Strategy::TotalCopy,
        ends: Ends::OnSource,
        says: &["node2 unreachable"],
        refused: false,
    },
    // CRIU killed while it holds the tree (its query of the external
    // files, in the middle of the dump).
    Case {
        at: "source:TreeFrozen",
        fault: Fault::CriuKilled("node1"),
        strategy: Strategy::TotalCopy,
        ends: Ends::OnSource,
        says: &["dump"],
        refused: false,
    },
    // The images meet a full work dir on node2.
    Case {
        at: "source:Transfer",
        fault: Fault::Node2WorkDirFull,
        strategy: Strategy::TotalCopy,
        ends: Ends::OnSource,
        says: &["No space left"],
        refused: false,
    },
    // The link to node2 is cut as the images are about to leave, the
    // process stopped.
    Case {
        at: "source:Transfer",
        fault: Fault::Node2LinkCut,
        strategy: Strategy::TotalCopy,
        ends: Ends::OnSource,
        says: &["node2 unreachable"],
        refused: false,
    },
    // node2 answers the images' transfer late, the process stopped.
    Case {
        at: "destination:Received",
        fault: Fault::LateAnswer,
        strategy: Strategy::TotalCopy,
        ends: Ends::OnSource,
        says: &["no answer"],
        refused: false,
    },
    // The CRIU node2 started ahead for the restore is killed before it
    // restores.
    Case {
        at: "source:Restore",
        fault: Fault::CriuKilled("node2"),
        strategy: Strategy::TotalCopy,
        ends: Ends::OnSource,
        says: &["restore"],
        refused: false,
    },
    // node2's CRIU killed in the middle of the restore, the tasks made
    // and not resumed: node2 kills what it left; resumes on node1.
    Case {
        at: "destination:Restoring",
        fault: Fault::CriuKilledInRestore,
        strategy: Strategy::TotalCopy,
        ends: Ends::OnSource,
        says: &["CRIU restore failed", "killed by signal 9"],
        refused: false,
    },
    // The link to node2 is cut just before the Restore: no answer comes.
    Case {
        at: "source:Restore",
        fault: Fault::Node2LinkCut,
        strategy: Strategy::TotalCopy,
        ends: Ends::OnSource,
        says: &["node2 unreachable"],
        refused: false,
    },
    // node2 restored and answers late: node1 gave up; its Abort kills
    // node2's copy, which never ran.
    Case {
        at: "destination:Restored",
        fault: Fault::LateAnswer,
        strategy: Strategy::PreCopy,
        ends: Ends::OnSource,
        says: &["no answer"],
        refused: false,
    },
    // node2 decided (committed) and answers late: node1 keeps its copy
    // stopped, retries the Commit and asks; node2 says it committed.
    Case {
        at: "destination:Committed",
        fault: Fault::LateAnswer,
        strategy: Strategy::TotalCopy,
        ends: Ends::Moved,
        says: &[],
        refused: false,
    },
];

#[test]
fn a_fault_at_each_step_of_a_migration_leaves_the_process_on_one_node_with_every_byte() {
    if !ferry_integration::can_run(
        "a_fault_at_each_step_of_a_migration_leaves_the_process_on_one_node_with_every_byte",
    ) {
        return;
    }
    // `FERRY_FAULT_CASE=<part of a point>` runs only the matching rows.
    let only = std::env::var("FERRY_FAULT_CASE").unwrap_or_default();
    for case in CASES.iter().filter(|c| c.at.contains(only.as_str())) {
        eprintln!(
            "== {:?} at {} ({:?}): expect {:?}",
            case.fault, case.at, case.strategy, case.ends
        );
        fault_at(case);
    }
}

fn fault_at(case: &Case) {
    let (waiting, point) = match case.at.strip_prefix("source:") {
        Some(p) => ("node1", p),
        None => ("node2", case.at.trim_start_matches("destination:")),
    };
    let pause = match case.fault {
        Fault::LateAnswer => LATE,
        Fault::CriuKilledInRestore => "kill-criu",
        _ => WINDOW,
    };
    let cluster = cluster_with_fault(waiting, &format!("{}:{pause}", case.at));
    let rt = runtime();
    let (pid, client, before) = rt.block_on(echo_server(&cluster));
    let migration = {
        let _in_runtime = rt.enter();
        let mut node1 = cluster.control_lazy("node1");
        let req = request(pid, case.strategy);
        rt.spawn(async move { follow_migration(&mut node1, req).await })
    };
    if case.fault != Fault::CriuKilledInRestore {
        rt.block_on(eventually(
            &format!("{waiting}'s agent waits at {point}"),
            Duration::from_secs(60),
            async || {
                cluster
                    .log_text(waiting)
                    .contains("fault point reached: pausing")
            },
        ));
    }
    match case.fault {
        Fault::LateAnswer | Fault::CriuKilledInRestore => {}
        Fault::Node2WorkDirFull => {
            cluster.work_dir_full("node2", true);
        }
        Fault::CriuKilled(node) => kill_criu_of(&cluster, node),
        Fault::Node2LinkCut => cluster.cut_cluster_link("node2", true),
    }
    let ended = match rt.block_on(migration).expect("the migration task") {
        Ok(ended) => ended,
        Err(s) => (None, Some(s)),
    };
    match case.fault {
        Fault::Node2WorkDirFull => {
            cluster.work_dir_full("node2", false);
        }
        Fault::Node2LinkCut => cluster.cut_cluster_link("node2", false),
        Fault::LateAnswer | Fault::CriuKilled(_) | Fault::CriuKilledInRestore => {}
    }
    let (report, status) = ended;
    if case.refused {
        let status = status.expect("an error");
        assert!(report.is_none(), "{}: {report:#?}", case.at);
        eprintln!("   refused: {status:?}");
        for word in case.says {
            assert!(
                status.message().contains(word),
                "{}: the reason ({word:?}) is not said: {status:?}",
                case.at
            );
        }
        rt.block_on(carries_on_at_node1(&cluster, pid, client, &before));
        return;
    }
    let report = report.unwrap_or_else(|| panic!("{}: no report ({status:?})", case.at));
    eprintln!(
        "   {:?}: {}",
        status.as_ref().map(|s| s.code()),
        report.error
    );
    match case.ends {
        Ends::OnSource => {
            assert_eq!(
                report.outcome,
                MigrationOutcome::Aborted as i32,
                "{}: {report:#?}",
                case.at
            );
            assert!(report.resumed_on_source, "{}: {report:#?}", case.at);
            assert!(status.is_some(), "{}: aborted without an error", case.at);
            for word in case.says {
                assert!(
                    report.error.contains(word),
                    "{}: the reason ({word:?}) is not said: {}",
                    case.at,
                    report.error
                );
            }
            rt.block_on(carries_on_at_node1(&cluster, pid, client, &before));
        }
        Ends::Moved => {
            assert_eq!(
                report.outcome,
                MigrationOutcome::Committed as i32,
                "{}: {report:#?}",
                case.at
            );
            assert!(status.is_none(), "{}: {status:?}", case.at);
            rt.block_on(carries_on_at_node2(&cluster, pid, client, &before));
        }
    }
    // The late answer was late: the caller had given up on it.
    if case.fault == Fault::LateAnswer && case.ends == Ends::OnSource {
        assert!(
            report.total_time_us >= PEER_TIMEOUT.as_micros() as u64,
            "{}: over before the peer timeout: {report:#?}",
            case.at
        );
    }
}

/// SIGKILLs the CRIU processes `node`'s agent runs (its children named
/// `criu`); panics if there is none.
fn kill_criu_of(cluster: &Cluster, node: &str) {
    let agent = cluster.agent_pid(node);
    let mut killed = 0;
    for entry in std::fs::read_dir("/proc").expect("/proc") {
        let Ok(pid) = entry
            .expect("/proc entry")
            .file_name()
            .to_string_lossy()
            .parse::<i32>()
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold spaces, not ')'.
        let Some((comm, rest)) = stat.split_once(" (").and_then(|(_, r)| r.rsplit_once(") "))
        else {
            continue;
        };
        let ppid: Option<i32> = rest.split(' ').nth(1).and_then(|p| p.parse().ok());
        if comm == "criu" && ppid == Some(agent) {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            )
            .expect("killing CRIU");
            killed += 1;
        }
    }
    assert!(killed > 0, "{node}'s agent runs no CRIU now");
}
