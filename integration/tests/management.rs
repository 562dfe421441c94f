//! Which processes ferry manages: a process that runs already, adopted
//! (and what keeps one from being adopted), and the systemd form, `ferry
//! run --foreground`, which stays with its process wherever migrations
//! move it, passes signals on and ends as the process ended. Root only;
//! run by `cargo xtask test` (or `cargo xtask integration`).

use std::net::SocketAddrV4;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{list, runtime, wait_for_process, wait_until_gone};
use ferry_integration::workload::SeqClient;
use ferry_proto::v1::{
    self as pb, MigrateRequest, MigrationOutcome, Strategy, process_update::Update,
};

const CONNECTIONS: usize = 8;

fn echo_server() -> &'static str {
    env!("CARGO_BIN_EXE_ferry-echo-server")
}

/// `program args` started the way an operator would start a process for
/// ferry to adopt: `unshare --pid --fork setsid`, stdio as given, no other
/// descriptor of the test.
fn detached(program: &str, args: &[&str], stdout: Stdio) -> Command {
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "setsid", program])
        .args(args)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::null());
    // Whatever the test binary inherited (a jobserver pipe, a lock) must
    // not reach the process: it would be a pipe shared with the outside,
    // which adoption rightly refuses.
    // SAFETY: the closure makes one async-signal-safe system call between
    // fork and exec.
    unsafe { cmd.pre_exec(ferry_agent::process::close_inherited_on_exec) };
    cmd
}

/// The init of the namespace `unshare` (PID `wrapper`) made: its child.
fn namespace_init(wrapper: u32) -> i32 {
    let children = format!("/proc/{wrapper}/task/{wrapper}/children");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(pid) = std::fs::read_to_string(&children)
            .ok()
            .and_then(|l| l.split_whitespace().find_map(|c| c.parse().ok()))
        {
            return pid;
        }
        assert!(Instant::now() < deadline, "unshare {wrapper} made no child");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The next update of a WaitProcess stream, within 20 s.
async fn next_update(stream: &mut tonic::Streaming<pb::ProcessUpdate>) -> pb::ProcessUpdate {
    tokio::time::timeout(Duration::from_secs(20), stream.message())
        .await
        .expect("an update within 20 s")
        .expect("the stream goes on")
        .expect("an update, not the end")
}

#[test]
fn a_running_process_is_adopted_and_moves_with_its_connections() {
    if !ferry_integration::can_run("a_running_process_is_adopted_and_moves_with_its_connections") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    // Started outside ferry, as an operator would.
    let wrapper = cluster
        .spawn_in(
            "node1",
            detached(echo_server(), &["--port", "7040"], Stdio::null()),
        )
        .expect("echo server");
    let pid = namespace_init(wrapper.id());
    cluster
        .wait_listening("node1", 7040, Duration::from_secs(10))
        .expect("the server listens");
    // Shaped right but for its stdout, a pipe to the test.
    let piped = cluster
        .spawn_in("node1", detached("sleep", &["600"], Stdio::piped()))
        .expect("sleep");
    let piped_pid = namespace_init(piped.id());

    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut node2 = cluster.control("node2").await.expect("control node2");
        let adopt = |pid: i32| pb::AdoptProcessRequest {
            pid,
            node: String::new(),
        };

        // What cannot be adopted is refused, every reason said at once,
        // and left running.
        let e = node1
            .adopt_process(adopt(wrapper.id() as i32))
            .await
            .expect_err("unshare itself is in the node's PID namespace");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert!(e.message().starts_with("pid: "), "{e:?}");
        assert!(
            e.message()
                .contains("not the init of its own PID namespace"),
            "{e:?}"
        );
        assert!(e.message().contains("session leader"), "{e:?}");
        let e = node1
            .adopt_process(adopt(piped_pid))
            .await
            .expect_err("a process with a pipe to the outside");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("descriptor 1 is a pipe"), "{e:?}");
        assert!(!e.message().contains("PID namespace"), "{e:?}");
        let e = node1.adopt_process(adopt(0)).await.expect_err("PID 0");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        let e = node1
            .adopt_process(adopt(i32::MAX))
            .await
            .expect_err("no such process");
        assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
        assert!(e.message().starts_with("pid: "), "{e:?}");
        assert!(list(&mut node1).await.is_empty());
        assert!(ferry_integration::managed::process_state(piped_pid).is_some());

        // Adopted: managed, its port owned by node1.
        let adopted = node1
            .adopt_process(adopt(pid))
            .await
            .expect("AdoptProcess")
            .into_inner();
        assert_eq!(
            (adopted.pid, adopted.origin.as_str(), adopted.node.as_str()),
            (pid, "adopted", "node1")
        );
        assert_eq!(
            adopted.argv.first().map(String::as_str),
            Some(echo_server())
        );
        let e = node1
            .adopt_process(adopt(pid))
            .await
            .expect_err("adopted twice");
        assert_eq!(e.code(), tonic::Code::AlreadyExists, "{e:?}");
        wait_for_process(&mut node1, pid, |p| p.tcp_listening == 1).await;
        // The state listed is the kernel's: a process stopped behind the
        // agent's back is "stopped", not "running", until it continues.
        let state = |ps: Vec<pb::ManagedProcess>| {
            ps.into_iter()
                .find(|p| p.pid == pid)
                .map(|p| p.state)
                .expect("listed")
        };
        assert_eq!(state(list(&mut node1).await), "running");
        let target = nix::unistd::Pid::from_raw(pid);
        nix::sys::signal::kill(target, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
        wait_for_process(&mut node1, pid, |p| p.state == "stopped").await;
        nix::sys::signal::kill(target, nix::sys::signal::Signal::SIGCONT).expect("SIGCONT");
        wait_for_process(&mut node1, pid, |p| p.state == "running").await;
        let dp = ferry_integration::managed::data_plane(&mut node1).await;
        assert!(
            dp.ports
                .iter()
                .any(|p| p.port.as_ref().is_some_and(|k| k.port == 7040) && p.state == "owned"),
            "{dp:?}"
        );

        let client = SeqClient::dve(
            cluster.netns_path("client1"),
            SocketAddrV4::new(cluster.public_addr(), 7040),
            CONNECTIONS,
        )
        .expect("clients with traffic flowing");
        wait_for_process(&mut node1, pid, |p| p.tcp_established == CONNECTIONS as u32).await;
        let mark = client.verified_per_connection();

        // A scheduler follows it through node1's agent.
        let mut waiting = node1
            .wait_process(pb::WaitProcessRequest {
                pid,
                node: String::new(),
            })
            .await
            .expect("WaitProcess")
            .into_inner();
        let first = next_update(&mut waiting).await;
        assert_eq!((first.node.as_str(), first.pid), ("node1", pid));
        assert!(
            matches!(first.update, Some(Update::Running(_))),
            "{first:?}"
        );
        // And through node2's agent, which asks node1 and follows on.
        let mut waiting_via_node2 = node2
            .wait_process(pb::WaitProcessRequest {
                pid,
                node: "node1".into(),
            })
            .await
            .expect("WaitProcess forwarded")
            .into_inner();
        assert_eq!(next_update(&mut waiting_via_node2).await, first);

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
        assert_eq!(report.outcome, MigrationOutcome::Committed as i32);
        wait_until_gone(pid);
        let moved = next_update(&mut waiting).await;
        assert_eq!(
            (moved.node.as_str(), moved.pid),
            ("node2", report.destination_pid)
        );
        match &moved.update {
            Some(Update::Moved(m)) => {
                assert_eq!((m.from_node.as_str(), m.from_pid), ("node1", pid));
                assert_eq!(m.migration_id, report.migration_id);
            }
            other => panic!("expected moved, got {other:?}"),
        }
        assert_eq!(next_update(&mut waiting_via_node2).await, moved);
        let on_node2 =
            wait_for_process(&mut node2, report.destination_pid, |p| p.state == "running").await;
        assert_eq!(on_node2.origin, "migrated-in");
        assert!(list(&mut node1).await.is_empty());
        client
            .wait_until_each_passes(&mark, 20, Duration::from_secs(20))
            .expect("every connection exchanges messages after the move");
        let traffic = client.stop();
        for c in &traffic.connections {
            assert!(c.is_clean(), "a connection lost bytes or failed: {c:?}");
        }

        // Signals, through node1 to where it runs now. It has no SIGTERM
        // handler, and as a namespace init would never see one: refused,
        // not lost. SIGKILL ends it; the follower hears how.
        let signal = |signal: i32| pb::SignalProcessRequest {
            pid: report.destination_pid,
            signal,
            node: "node2".into(),
        };
        let e = node1
            .signal_process(signal(libc::SIGTERM))
            .await
            .expect_err("SIGTERM to an init without a handler");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("no handler for SIGTERM"), "{e:?}");
        let e = node1
            .signal_process(signal(libc::SIGSTOP))
            .await
            .expect_err("SIGSTOP");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("signal: "), "{e:?}");
        node1
            .signal_process(signal(libc::SIGKILL))
            .await
            .expect("SIGKILL");
        let exited = next_update(&mut waiting).await;
        assert_eq!(
            (exited.node.as_str(), exited.pid),
            ("node2", report.destination_pid)
        );
        match &exited.update {
            Some(Update::Exited(x)) => {
                // Restored by CRIU as node2's agent's child: it knows how.
                assert!(x.status_known, "{x:?}");
                assert_eq!(x.signal, libc::SIGKILL, "{x:?}");
            }
            other => panic!("expected exited, got {other:?}"),
        }
        assert!(waiting.message().await.expect("a clean end").is_none());
        assert_eq!(next_update(&mut waiting_via_node2).await, exited);
        assert!(
            waiting_via_node2
                .message()
                .await
                .expect("a clean end")
                .is_none()
        );
        wait_until_gone(report.destination_pid);
        assert!(list(&mut node2).await.is_empty());
        let e = node1
            .wait_process(pb::WaitProcessRequest {
                pid: i32::MAX,
                node: String::new(),
            })
            .await
            .expect_err("waiting for a process nobody manages");
        assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
        let e = node2
            .wait_process(pb::WaitProcessRequest {
                pid: i32::MAX,
                node: "node1".into(),
            })
            .await
            .expect_err("waiting for a process node1 does not manage");
        assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
        assert!(e.message().starts_with("node1: pid: "), "{e:?}");
    });
    drop(piped);
    drop(wrapper);
}

/// `ferry --socket S run --foreground -- CMD...` as a child of the test.
fn foreground(cluster: &Cluster, node: &str, argv: &[&str]) -> std::process::Child {
    Command::new(ferry_integration::bin_path("ferry"))
        .arg("--socket")
        .arg(cluster.control_socket(node))
        .args(["run", "--foreground", "--"])
        .args(argv)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running ferry")
}

/// Waits for `child` (bounded) and returns its status and stderr.
fn finish(child: std::process::Child, within: Duration) -> (std::process::ExitStatus, String) {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = rx
        .recv_timeout(within)
        .unwrap_or_else(|_| {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            panic!("ferry run --foreground did not end within {within:?}")
        })
        .expect("waiting for ferry");
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_foreground_run_follows_its_process_and_ends_as_it_did() {
    if !ferry_integration::can_run("a_foreground_run_follows_its_process_and_ends_as_it_did") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");

    // A process that ends by itself: ferry exits with its code.
    let quick = foreground(&cluster, "node1", &["sh", "-c", "exit 3"]);
    let (status, stderr) = finish(quick, Duration::from_secs(30));
    assert_eq!(status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("exited with 3"), "{stderr}");

    // A server that handles SIGTERM, moved to node2 while ferry follows.
    let server = foreground(
        &cluster,
        "node1",
        &[echo_server(), "--port", "7041", "--exit-on-term", "7"],
    );
    let ferry_pid = server.id();
    // Guard: the CLI is killed if an assertion fails before it ends.
    struct Kill(u32);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.0 as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    let guard = Kill(ferry_pid);
    let (pid, new_pid) = rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let deadline = Instant::now() + Duration::from_secs(10);
        let pid = loop {
            if let Some(p) = list(&mut node1)
                .await
                .into_iter()
                .find(|p| p.argv.iter().any(|a| a == "7041") && p.tcp_listening == 1)
            {
                break p.pid;
            }
            assert!(Instant::now() < deadline, "the server never listened");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let report = ferry_integration::managed::migrate_committed(
            &mut node1,
            MigrateRequest {
                pid,
                destination_node: "node2".into(),
                strategy: Strategy::TotalCopy as i32,
                ..Default::default()
            },
        )
        .await;
        (pid, report.destination_pid)
    });
    wait_until_gone(pid);
    // `systemctl stop`: SIGTERM to ferry, which passes it to node2.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(ferry_pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM to ferry");
    let (status, stderr) = finish(server, Duration::from_secs(30));
    drop(guard);
    assert_eq!(status.code(), Some(7), "{status:?}\n{stderr}");
    assert!(stderr.contains("moved from node1 to node2"), "{stderr}");
    assert!(stderr.contains("SIGTERM passed on"), "{stderr}");
    wait_until_gone(new_pid);
    rt.block_on(async {
        let mut node2 = cluster.control("node2").await.expect("control node2");
        assert!(list(&mut node2).await.is_empty());
    });

    // A server without a handler: SIGTERM ends it all the same (SIGKILL,
    // as the kernel would have ended it were it not a namespace init);
    // ferry ends killed, as its process.
    let plain = foreground(&cluster, "node1", &[echo_server(), "--port", "7042"]);
    let ferry_pid = plain.id();
    let guard = Kill(ferry_pid);
    cluster
        .wait_listening("node1", 7042, Duration::from_secs(10))
        .expect("the server listens");
    rt.block_on(async {
        // Listening is not yet followed: wait for the CLI's first update
        // by asking the agent for the process (the CLI asked first).
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !list(&mut node1)
            .await
            .iter()
            .any(|p| p.argv.iter().any(|a| a == "7042"))
        {
            assert!(Instant::now() < deadline, "not managed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(ferry_pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM to ferry");
    let (status, stderr) = finish(plain, Duration::from_secs(30));
    drop(guard);
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}\n{stderr}");
    assert!(stderr.contains("no handler for SIGTERM"), "{stderr}");
    assert!(!cluster.is_listening("node1", 7042).expect("ss"));
}
