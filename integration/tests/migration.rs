//! End-to-end migrations in the namespace cluster, through the Control API,
//! with real CRIU and the real eBPF filter. Root only; run by
//! `cargo xtask test` (or `cargo xtask integration`).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{
    list, migrate, migrate_committed, migrate_with, nice_of, process_state, run, runtime,
    wait_for_process,
};
use ferry_integration::topology::Family;
use ferry_integration::workload::SeqClient;
use ferry_proto::v1::control_client::ControlClient;
use ferry_proto::v1::{
    MigrateRequest, MigrationOutcome, MigrationReport, SocketMigration, Strategy, migration_event,
};
use tonic::transport::Channel;

const SHARED_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
const ECHO_PORT: u16 = 7000;

fn echo_server_bin() -> String {
    env!("CARGO_BIN_EXE_ferry-echo-server").to_owned()
}

/// Starts the echo server under management on `node` and waits (bounded)
/// until the agent lists its listening port, which means the node's filter
/// owns it.
async fn start_echo_server(control: &mut ControlClient<Channel>, port: u16) -> i32 {
    start_echo_server_on(control, "0.0.0.0", port).await
}

/// [`start_echo_server`] bound to `bind` (`::`: IPv6 and IPv4 clients).
async fn start_echo_server_on(control: &mut ControlClient<Channel>, bind: &str, port: u16) -> i32 {
    let pid = run(
        control,
        vec![
            echo_server_bin(),
            "--bind".into(),
            bind.into(),
            "--port".into(),
            port.to_string(),
        ],
    )
    .await;
    wait_for_process(control, pid, |p| p.tcp_listening == 1).await;
    pid
}

/// Two agents, the echo server managed by node1, and `connections`
/// clients from client1 exchanging 256-byte messages every 50 ms.
struct EchoSetup {
    node1: ControlClient<Channel>,
    node2: ControlClient<Channel>,
    pid: i32,
    target: SocketAddr,
    client: SeqClient,
}

async fn echo_setup(cluster: &Cluster, connections: usize) -> EchoSetup {
    echo_setup_in(cluster, connections, Family::V4).await
}

/// [`echo_setup`] with clients of `family` (the server then listens on
/// `::` for IPv6).
async fn echo_setup_in(cluster: &Cluster, connections: usize, family: Family) -> EchoSetup {
    let mut node1 = cluster.control("node1").await.expect("control node1");
    let node2 = cluster.control("node2").await.expect("control node2");
    let bind = match family {
        Family::V4 => "0.0.0.0",
        Family::V6 => "::",
    };
    let pid = start_echo_server_on(&mut node1, bind, ECHO_PORT).await;
    let target = SocketAddr::new(family.public_addr(), ECHO_PORT);
    let client = SeqClient::dve(cluster.netns_path("client1"), target, connections)
        .expect("clients with traffic flowing");
    EchoSetup {
        node1,
        node2,
        pid,
        target,
        client,
    }
}

#[test]
fn echo_server_with_its_connections_migrates_to_another_node() {
    if !ferry_integration::can_run("echo_server_with_its_connections_migrates_to_another_node") {
        return;
    }
    echo_server_with_its_connections_migrates_in(Family::V4);
}

#[test]
fn echo_server_with_its_ipv6_connections_migrates_to_another_node() {
    if !ferry_integration::can_run("echo_server_with_its_ipv6_connections_migrates_to_another_node")
    {
        return;
    }
    echo_server_with_its_connections_migrates_in(Family::V6);
}

/// IPv6 end to end: clients over IPv6, and the agents' Peer API (mutual
/// TLS), the transfer and the images over an IPv6 cluster network.
#[test]
fn echo_server_migrates_over_an_ipv6_cluster_network() {
    if !ferry_integration::can_run("echo_server_migrates_over_an_ipv6_cluster_network") {
        return;
    }
    let mut spec = ClusterSpec::new(2, 1);
    spec.cluster_family = Family::V6;
    echo_server_with_its_connections_migrates_on(spec, Family::V6);
}

fn echo_server_with_its_connections_migrates_in(family: Family) {
    echo_server_with_its_connections_migrates_on(ClusterSpec::new(2, 1), family);
}

fn echo_server_with_its_connections_migrates_on(spec: ClusterSpec, family: Family) {
    let rt = runtime();
    let cluster = Cluster::start(spec).expect("cluster");
    rt.block_on(async {
        let EchoSetup {
            mut node1,
            mut node2,
            pid,
            target,
            client,
        } = echo_setup_in(&cluster, 16, family).await;
        assert!(
            client
                .local_addrs()
                .iter()
                .all(|a| a.is_ipv4() == (family == Family::V4)),
            "{:?}",
            client.local_addrs()
        );
        let before = wait_for_process(&mut node1, pid, |p| p.tcp_established == 16).await;
        assert_eq!(before.state, "running");
        let verified_before = client.verified_per_connection();
        // A nice value of its own, which CRIU (itself at another) restores.
        // SAFETY: setpriority takes plain integers; `pid` is the test's
        // echo server.
        let reniced = unsafe { libc::setpriority(libc::PRIO_PROCESS, pid as libc::id_t, 5) };
        assert_eq!(reniced, 0, "{}", std::io::Error::last_os_error());

        let (report, status) = migrate(&mut node1, pid, "node2")
            .await
            .expect("migration starts");
        assert!(
            status.is_none(),
            "migration failed: {status:?}\n{report:#?}"
        );
        assert_eq!(
            report.outcome,
            MigrationOutcome::Committed as i32,
            "{report:#?}"
        );
        assert_eq!(report.tcp_established, 16, "{report:#?}");
        assert_eq!(report.tcp_listening, 1, "{report:#?}");
        assert!(
            report.bytes_transferred > 0 && report.freeze_time_us > 0,
            "{report:#?}"
        );
        eprintln!(
            "freeze {:.1} ms, total {:.1} ms, {} bytes; phases {:?}; replay {:?}",
            report.freeze_time_us as f64 / 1e3,
            report.total_time_us as f64 / 1e3,
            report.bytes_transferred,
            report
                .phases
                .iter()
                .map(|p| format!("{} {:.1}", p.phase, p.duration_us as f64 / 1e3))
                .collect::<Vec<_>>(),
            report.replay
        );
        // What arrived while the process was frozen was kept and handed to
        // it on node2 (the clients send all the time, so something did).
        let replay = report.replay.expect("replay stats of the commit");
        assert!(report.capture && replay.captured > 0, "{replay:?}");
        assert_eq!(replay.failed, 0, "{replay:?}");
        assert_eq!(
            replay.replayed + replay.skipped_delivered,
            replay.captured,
            "{replay:?}"
        );

        // The process runs on node2, with all 16 connections, and is gone
        // from node1.
        let moved = wait_for_process(&mut node2, report.destination_pid, |p| {
            p.tcp_established == 16 && p.state == "running"
        })
        .await;
        assert_eq!(moved.origin, "migrated-in");
        assert_eq!(nice_of(report.destination_pid), Some(5));
        assert!(
            list(&mut node1).await.is_empty(),
            "node1 still manages a process"
        );
        assert_eq!(
            process_state(pid),
            None,
            "source copy (PID {pid}) still exists"
        );
        assert!(!cluster.pids_in("node1").contains(&pid));
        assert!(cluster.pids_in("node2").contains(&report.destination_pid));
        assert_eq!(cluster.established_tcp("node1", ECHO_PORT).len(), 0);
        assert_eq!(cluster.established_tcp("node2", ECHO_PORT).len(), 16);

        // Every connection keeps flowing after the migration...
        client
            .wait_until_each_passes(&verified_before, 20, Duration::from_secs(20))
            .expect("every connection exchanges messages after the migration");

        // ...and a new connection is served by node2.
        let probe = ferry_integration::workload::ProbeConnection::open(
            &cluster.netns_path("client1"),
            target,
        )
        .expect("new connection after migration");
        let served = cluster.established_tcp("node2", ECHO_PORT);
        assert!(
            served.contains(&probe.local_addr()),
            "new connection {} not on node2 ({served:?})",
            probe.local_addr()
        );
        assert!(
            !cluster
                .established_tcp("node1", ECHO_PORT)
                .contains(&probe.local_addr())
        );
        drop(probe);

        // Every byte each client sent came back once and in order.
        let seq = client.stop();
        eprintln!("{seq}");
        seq.assert_clean();
        assert_eq!(seq.connections.len(), 16);
    });
}

/// A destination whose agent does not carry the cluster's IPv6 public
/// address could not take the process's IPv6 clients: refused before
/// anything stops, naming the node and the address; the process serves
/// on at node1, every byte once and in order.
#[test]
fn a_destination_without_the_ipv6_public_address_is_refused_before_anything_stops() {
    let test = "a_destination_without_the_ipv6_public_address_is_refused_before_anything_stops";
    if !ferry_integration::can_run(test) {
        return;
    }
    let rt = runtime();
    let mut spec = ClusterSpec::new(2, 1);
    spec.ipv4_only = vec!["node2".into()];
    let cluster = Cluster::start(spec).expect("cluster");
    rt.block_on(async {
        let EchoSetup {
            mut node1,
            node2: _,
            pid,
            target: _,
            client,
        } = echo_setup_in(&cluster, 4, Family::V6).await;
        wait_for_process(&mut node1, pid, |p| p.tcp_established == 4).await;
        // ListNodes shows each node's public addresses as it carries them.
        let nodes = node1
            .list_nodes(ferry_proto::v1::ListNodesRequest {})
            .await
            .expect("ListNodes")
            .into_inner()
            .nodes;
        let public = |name: &str| {
            nodes
                .iter()
                .find(|n| n.name == name)
                .map(|n| n.public_addresses.clone())
                .unwrap_or_default()
        };
        assert_eq!(public("node1"), ["198.18.0.100", "2001:2::100"]);
        assert_eq!(public("node2"), ["198.18.0.100"]);
        let before = client.verified_per_connection();
        let status = match migrate(&mut node1, pid, "node2").await {
            Err(status) => status,
            Ok((report, status)) => panic!("expected a refusal, got {status:?} {report:#?}"),
        };
        assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
        assert!(
            status.message().contains("node2") && status.message().contains("2001:2::100"),
            "{status:?}"
        );
        let p = wait_for_process(&mut node1, pid, |p| p.tcp_established == 4).await;
        assert_eq!(p.state, "running");
        assert_eq!(cluster.established_tcp("node2", ECHO_PORT).len(), 0);
        client
            .wait_until_each_passes(&before, 10, Duration::from_secs(20))
            .expect("every connection goes on at node1");
        let seq = client.stop();
        seq.assert_clean();
    });
}

/// A process's CLOCK_MONOTONIC and CLOCK_BOOTTIME offsets (seconds) from
/// /proc/PID/timens_offsets: those of its time namespace.
fn clock_offsets(pid: i32) -> (f64, f64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/timens_offsets"))
        .unwrap_or_else(|e| panic!("reading /proc/{pid}/timens_offsets: {e}"));
    let offset = |clock: &str| {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(clock))
            .unwrap_or_else(|| panic!("no {clock} in {text:?}"));
        let f: Vec<f64> = line
            .split_whitespace()
            .skip(1)
            .map(|v| v.parse().expect("a number"))
            .collect();
        f[0] + f[1] / 1e9
    };
    (offset("monotonic"), offset("boottime"))
}

/// A process started in a time namespace of its own, a day ahead on
/// CLOCK_MONOTONIC and two on CLOCK_BOOTTIME, keeps its clocks through two
/// migrations: each restore sets its namespace's offsets so that its
/// clocks go on from what they read at the dump (they stand still for the
/// freeze, as CRIU does it), neither back to the host's nor forward. The
/// source's CRIU reads the clocks from the namespace's offsets, without a
/// process forked into it (ferry's CRIU patch `timens-from-offsets`): a
/// clock read without the offsets would put the process a day back.
#[test]
fn a_process_in_a_time_namespace_keeps_its_clocks_across_migrations() {
    if !ferry_integration::can_run(
        "a_process_in_a_time_namespace_keeps_its_clocks_across_migrations",
    ) {
        return;
    }
    const DAY: f64 = 86_400.0;
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut node2 = cluster.control("node2").await.expect("control node2");
        // unshare enters the namespace and execs the server in it.
        let pid = run(
            &mut node1,
            vec![
                "unshare".into(),
                "--time".into(),
                "--monotonic".into(),
                DAY.to_string(),
                "--boottime".into(),
                (2.0 * DAY).to_string(),
                echo_server_bin(),
                "--port".into(),
                ECHO_PORT.to_string(),
            ],
        )
        .await;
        wait_for_process(&mut node1, pid, |p| p.tcp_listening == 1).await;
        assert_eq!(clock_offsets(pid), (DAY, 2.0 * DAY));
        let target = SocketAddrV4::new(SHARED_IP, ECHO_PORT);
        let client = SeqClient::dve(cluster.netns_path("client1"), target, 4)
            .expect("clients with traffic flowing");
        wait_for_process(&mut node1, pid, |p| p.tcp_established == 4).await;

        let (mut monotonic, mut boottime) = (DAY, 2.0 * DAY);
        let mut at = pid;
        for (from, to) in [(&mut node1, "node2"), (&mut node2, "node1")] {
            let verified = client.verified_per_connection();
            let report = migrate_committed(
                from,
                MigrateRequest {
                    pid: at,
                    destination_node: to.into(),
                    ..Default::default()
                },
            )
            .await;
            at = report.destination_pid;
            // The clocks stood still for at most the whole migration.
            let took = report.total_time_us as f64 / 1e6;
            let (m, b) = clock_offsets(at);
            eprintln!(
                "to {to}: offsets monotonic {m:.6} s, boottime {b:.6} s; migration {took:.3} s, freeze {:.1} ms",
                report.freeze_time_us as f64 / 1e3
            );
            assert!(
                m <= monotonic && m >= monotonic - took,
                "CLOCK_MONOTONIC offset {m} after the migration to {to}, was {monotonic} ({took} s migration)"
            );
            assert!(
                b <= boottime && b >= boottime - took,
                "CLOCK_BOOTTIME offset {b} after the migration to {to}, was {boottime} ({took} s migration)"
            );
            (monotonic, boottime) = (m, b);
            client
                .wait_until_each_passes(&verified, 5, Duration::from_secs(20))
                .expect("every connection exchanges messages after the migration");
        }
        let seq = client.stop();
        seq.assert_clean();
    });
}

/// The children of `pid` and their state letters (`/proc/PID/stat`).
fn children_of(pid: i32) -> Vec<(i32, char)> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|c| c.parse().ok())
        .filter_map(|c| process_state(c).map(|s| (c, s)))
        .collect()
}

/// An echo server started by `sh -c SCRIPT` (which ends by exec'ing it),
/// managed by node1, listening.
async fn echo_server_by_shell(control: &mut ControlClient<Channel>, script: &str) -> i32 {
    let script = format!("{script}\nexec {} --port {ECHO_PORT}", echo_server_bin());
    let pid = run(control, vec!["sh".into(), "-c".into(), script]).await;
    wait_for_process(control, pid, |p| p.tcp_listening == 1).await;
    pid
}

/// Migrates `pid` from node1 to node2 and returns its PID there, once it
/// runs there and its copy on node1 is gone.
async fn moved_to_node2(
    node1: &mut ControlClient<Channel>,
    node2: &mut ControlClient<Channel>,
    pid: i32,
) -> i32 {
    let report = migrate_committed(
        node1,
        MigrateRequest {
            pid,
            destination_node: "node2".into(),
            ..Default::default()
        },
    )
    .await;
    let moved = report.destination_pid;
    wait_for_process(node2, moved, |p| p.state == "running").await;
    assert_eq!(process_state(pid), None, "the source copy is gone");
    moved
}

/// A process with a zombie child migrates with it: the zombie is dumped
/// through the pid namespace's procfs, which the dump then fetches (ferry's
/// CRIU skips that fetch for a tree without zombies).
#[test]
fn a_process_with_a_zombie_child_migrates_with_it() {
    if !ferry_integration::can_run("a_process_with_a_zombie_child_migrates_with_it") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut node2 = cluster.control("node2").await.expect("control node2");
        // The shell's child ends at once; the server it becomes never
        // reaps it.
        let pid = echo_server_by_shell(&mut node1, "true &").await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !children_of(pid).iter().any(|(_, s)| *s == 'Z') {
            assert!(
                Instant::now() < deadline,
                "no zombie child: {:?}",
                children_of(pid)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let moved = moved_to_node2(&mut node1, &mut node2, pid).await;
        let children = children_of(moved);
        assert_eq!(
            children.iter().map(|(_, s)| *s).collect::<Vec<_>>(),
            vec!['Z'],
            "the zombie child on node2: {children:?}"
        );
        // And the server serves there.
        let probe = ferry_integration::workload::ProbeConnection::open(
            &cluster.netns_path("client1"),
            SocketAddrV4::new(SHARED_IP, ECHO_PORT),
        )
        .expect("a new connection after the migration");
        assert!(
            cluster
                .established_tcp("node2", ECHO_PORT)
                .contains(&probe.local_addr())
        );
    });
}

/// The echo server on node1, started with `extra` arguments, and `conns`
/// clients from client1 talking to it, once node1 counts them all.
async fn echo_server_with_clients(
    cluster: &Cluster,
    node1: &mut ControlClient<Channel>,
    extra: &[&str],
    conns: usize,
) -> (i32, SeqClient) {
    let mut argv = vec![echo_server_bin(), "--port".into(), ECHO_PORT.to_string()];
    argv.extend(extra.iter().map(|a| (*a).to_owned()));
    let pid = run(node1, argv).await;
    wait_for_process(node1, pid, |p| p.tcp_listening == 1).await;
    let client = SeqClient::dve(
        cluster.netns_path("client1"),
        SocketAddrV4::new(SHARED_IP, ECHO_PORT),
        conns,
    )
    .expect("clients with traffic flowing");
    wait_for_process(node1, pid, |p| p.tcp_established == conns as u32).await;
    (pid, client)
}

/// Every connection of `client` carries bytes again after `before`, and
/// every byte came back once and in order.
fn every_connection_flows(client: SeqClient, before: &[u64]) {
    client
        .wait_until_each_passes(before, 20, Duration::from_secs(20))
        .expect("every connection flows after the migration");
    client.stop().assert_clean();
}

/// Connections at high descriptor numbers, far above anything else the
/// process holds and without close-on-exec, come back at the same numbers
/// and flags (ferry's CRIU places a connection kept out of the images with
/// pidfd_getfd alone when the numbers below it are few to fill, and with
/// dup3 otherwise), and keep carrying every byte.
#[test]
fn connections_at_high_descriptor_numbers_come_back_at_them() {
    if !ferry_integration::can_run("connections_at_high_descriptor_numbers_come_back_at_them") {
        return;
    }
    const FROM: i32 = 300;
    const CONNS: usize = 6;
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut node2 = cluster.control("node2").await.expect("control node2");
        let from = FROM.to_string();
        let (pid, client) = echo_server_with_clients(
            &cluster,
            &mut node1,
            &["--connection-fds-from", &from],
            CONNS,
        )
        .await;
        // (target of each descriptor from FROM on, close-on-exec)
        let high_fds = |pid: i32| -> Vec<(String, bool)> {
            (FROM..FROM + CONNS as i32)
                .map(|fd| {
                    let link = std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))
                        .map(|l| l.display().to_string())
                        .unwrap_or_else(|e| format!("{e}"));
                    let flags = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}"))
                        .unwrap_or_default()
                        .lines()
                        .find_map(|l| l.strip_prefix("flags:"))
                        .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
                        .unwrap_or(0);
                    (link, flags & libc::O_CLOEXEC as u32 != 0)
                })
                .collect()
        };
        let before = high_fds(pid);
        assert!(
            before
                .iter()
                .all(|(link, cloexec)| link.starts_with("socket:[") && !cloexec),
            "the server's connections: {before:?}"
        );
        let verified_before = client.verified_per_connection();
        let moved = moved_to_node2(&mut node1, &mut node2, pid).await;
        let after = high_fds(moved);
        assert!(
            after
                .iter()
                .all(|(link, cloexec)| link.starts_with("socket:[") && !cloexec),
            "the connections on node2: {after:?}"
        );
        let p = wait_for_process(&mut node2, moved, |p| p.tcp_established == CONNS as u32).await;
        assert_eq!(p.state, "running");
        every_connection_flows(client, &verified_before);
    });
}

/// A connection at descriptor 0, as an inetd-style server has it (stdin
/// closed, the first connection accepted takes its number), comes back
/// there: the restore must not hold that number itself while it installs
/// the connections.
#[test]
fn a_connection_at_descriptor_zero_comes_back_there() {
    if !ferry_integration::can_run("a_connection_at_descriptor_zero_comes_back_there") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut node2 = cluster.control("node2").await.expect("control node2");
        let (pid, client) =
            echo_server_with_clients(&cluster, &mut node1, &["--close-stdin"], 2).await;
        let fd0 = |pid: i32| {
            std::fs::read_link(format!("/proc/{pid}/fd/0"))
                .map(|l| l.display().to_string())
                .unwrap_or_else(|e| format!("{e}"))
        };
        assert!(
            fd0(pid).starts_with("socket:["),
            "descriptor 0: {}",
            fd0(pid)
        );
        let verified_before = client.verified_per_connection();
        let moved = moved_to_node2(&mut node1, &mut node2, pid).await;
        assert!(
            fd0(moved).starts_with("socket:["),
            "descriptor 0 on node2: {}",
            fd0(moved)
        );
        wait_for_process(&mut node2, moved, |p| p.tcp_established == 2).await;
        every_connection_flows(client, &verified_before);
    });
}

/// A read-only bind mount of a new directory, undone when dropped.
struct ReadOnlyDir {
    dir: tempfile::TempDir,
    mounted: bool,
}

impl ReadOnlyDir {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("a directory");
        let mut ro = Self {
            dir,
            mounted: false,
        };
        let path = ro.dir.path().to_str().expect("a UTF-8 path").to_owned();
        let mount = |args: &[&str]| {
            let ok = std::process::Command::new("mount")
                .args(args)
                .status()
                .expect("mount")
                .success();
            assert!(ok, "mount {args:?}");
        };
        mount(&["--bind", &path, &path]);
        ro.mounted = true;
        mount(&["-o", "remount,bind,ro", &path]);
        ro
    }

    fn path(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Drop for ReadOnlyDir {
    fn drop(&mut self) {
        if self.mounted {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(self.dir.path())
                .status();
        }
    }
}

/// A process whose working directory is read-only migrates: the dump
/// makes no directory there (upstream CRIU's parasite mounts a procfs in
/// a directory it makes in the task's working directory, for a tree in a
/// pid namespace of its own; ferry's CRIU needs that procfs only for
/// zombies), and the process runs on the destination in that directory.
#[test]
fn a_process_whose_working_directory_is_read_only_migrates() {
    if !ferry_integration::can_run("a_process_whose_working_directory_is_read_only_migrates") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    let dir = ReadOnlyDir::new();
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut node2 = cluster.control("node2").await.expect("control node2");
        let pid = echo_server_by_shell(&mut node1, &format!("cd {}", dir.path().display())).await;
        assert!(
            std::fs::create_dir(dir.path().join("probe")).is_err(),
            "the directory is writable"
        );
        let moved = moved_to_node2(&mut node1, &mut node2, pid).await;
        assert_eq!(
            std::fs::read_link(format!("/proc/{moved}/cwd")).expect("its working directory"),
            dir.path()
        );
    });
}

/// At CRIU log level 4 the agents keep CRIU's logs of a migration that
/// committed, not only of one that failed: the source its dump's, the
/// destination its restore's, each step with its time, in
/// `<work_dir>/logs`.
#[test]
fn criu_logs_of_a_committed_migration_are_kept_at_log_level_4() {
    if !ferry_integration::can_run("criu_logs_of_a_committed_migration_are_kept_at_log_level_4") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec {
        extra_config: "criu_log_level = 4\n".into(),
        ..ClusterSpec::new(2, 1)
    })
    .expect("cluster");
    rt.block_on(async {
        let EchoSetup { mut node1, pid, .. } = echo_setup(&cluster, 2).await;
        let (report, status) = migrate(&mut node1, pid, "node2")
            .await
            .expect("migration starts");
        assert!(status.is_none(), "{status:?}\n{report:#?}");
        assert_eq!(
            report.outcome,
            MigrationOutcome::Committed as i32,
            "{report:#?}"
        );
        let id = &report.migration_id;
        for (node, log, last_step) in [
            ("node1", "dump", "Dumping finished successfully"),
            ("node2", "restore", "Restore finished successfully"),
        ] {
            let path = cluster
                .work_dir(node)
                .join("logs")
                .join(format!("{id}-{log}.log"));
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{node} kept no {log} log at {}: {e}", path.display()));
            assert!(
                text.contains(last_step),
                "{}: no {last_step:?}",
                path.display()
            );
        }
    });
}

/// A CRIU for a test's cluster: ferry's own, run through a shell wrapper
/// with `env` (`VAR=value`, or empty) in front. A patched CRIU is known by
/// the marks its patches leave in the binary (`criu::has_patch`): the
/// wrapper carries `marks`, which says which of ferry's patches the CRIU
/// behind it is to be taken for having.
fn criu_wrapper(dir: &std::path::Path, marks: &[&str], env: &str) -> std::path::PathBuf {
    let wrapper = dir.join("criu");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\n# {}\n{env} exec {} \"$@\"\n",
            marks.join(" "),
            ferry_integration::criu_path().display()
        ),
    )
    .expect("writing the CRIU wrapper");
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    wrapper
}

/// A two-node cluster whose agents run CRIU through [`criu_wrapper`]; the
/// directory holding the wrapper lives as long as the returned guard.
fn cluster_with_criu(marks: &[&str], env: &str) -> (tempfile::TempDir, Cluster) {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut spec = ClusterSpec::new(2, 1);
    spec.criu_path = Some(criu_wrapper(dir.path(), marks, env));
    let cluster = Cluster::start(spec).expect("cluster");
    (dir, cluster)
}

/// An echo server on node1 that stayed there: a collective migration of
/// it ended before the commit.
struct Stayed {
    node1: ControlClient<Channel>,
    pid: i32,
    client: SeqClient,
    /// What each connection had verified before the migration.
    before: Vec<u64>,
    connections: usize,
}

/// An echo server on node1 with `connections` talking clients, and a
/// collective migration of it to node2 that must end ABORTED with the
/// process resumed on node1. Returns the migration's report.
async fn collective_migration_aborts(
    cluster: &Cluster,
    connections: usize,
) -> (MigrationReport, Stayed) {
    migration_aborts(
        cluster,
        connections,
        ferry_proto::v1::SocketMigration::Collective,
    )
    .await
}

/// [`collective_migration_aborts`], with the connections moved as
/// `sockets` says.
async fn migration_aborts(
    cluster: &Cluster,
    connections: usize,
    sockets: ferry_proto::v1::SocketMigration,
) -> (MigrationReport, Stayed) {
    let EchoSetup {
        mut node1,
        node2: _,
        pid,
        target: _,
        client,
    } = echo_setup(cluster, connections).await;
    wait_for_process(&mut node1, pid, |p| {
        p.tcp_established as usize == connections
    })
    .await;
    let before = client.verified_per_connection();
    let (report, status) = migrate_with(&mut node1, pid, "node2", sockets)
        .await
        .expect("migration starts");
    let status = status.expect("an aborted migration ends the stream with an error status");
    assert_eq!(status.code(), tonic::Code::Aborted, "{status:?}");
    assert_eq!(
        report.outcome,
        MigrationOutcome::Aborted as i32,
        "{report:#?}"
    );
    assert!(report.resumed_on_source, "{report:#?}");
    let stayed = Stayed {
        node1,
        pid,
        client,
        before,
        connections,
    };
    (report, stayed)
}

/// The process still runs on node1 with all its connections, none is on
/// node2, and every connection carries on, every byte once and in order.
async fn carries_on_at_node1(cluster: &Cluster, stayed: Stayed) {
    let Stayed {
        mut node1,
        pid,
        client,
        before,
        connections,
    } = stayed;
    let p = wait_for_process(&mut node1, pid, |p| p.state == "running").await;
    assert_eq!(p.tcp_established as usize, connections);
    assert!(cluster.established_tcp("node2", ECHO_PORT).is_empty());
    client
        .wait_until_each_passes(&before, 20, Duration::from_secs(20))
        .expect("connections flow again after the abort");
    client.stop().assert_clean();
}

#[test]
fn a_destination_whose_criu_cannot_take_the_connections_refuses_them() {
    if !ferry_integration::can_run(
        "a_destination_whose_criu_cannot_take_the_connections_refuses_them",
    ) {
        return;
    }
    let rt = runtime();
    // Taken for a CRIU without ferry's inherit patch, which would restore
    // the connections ferryd rebuilt closed.
    let (_dir, cluster) = cluster_with_criu(&[ferry_agent::criu::DUMP_ROLLBACK_MARK], "");
    rt.block_on(async {
        let (report, stayed) = collective_migration_aborts(&cluster, 8).await;
        assert!(
            report
                .error
                .contains("lacks ferry's patch for inherited TCP connections")
                && report.error.contains("cargo xtask setup"),
            "{}",
            report.error
        );
        // Named at the agent's start too.
        assert!(
            cluster
                .log_text("node2")
                .contains("CRIU lacks ferry's patches"),
            "{}",
            cluster.log_tail("node2", 30)
        );
        carries_on_at_node1(&cluster, stayed).await;
    });
}

/// CRIU's own fault injection (CRIU_FAULT=3, FI_DUMP_PAGES) fails every
/// dump after the descriptors: the tree has been frozen for the whole of
/// it, and ferryd has read every connection beside it, some or all of them
/// in repair mode. A migration moving `connections` as `sockets` says must
/// abort, and every connection must leave repair mode before CRIU lets the
/// process run again (it would get EPERM from its next recv and EINVAL
/// from its next send otherwise). `read_by`: the log line that says how
/// the connections were read.
fn a_failed_dump_gives_the_connections_back(
    sockets: ferry_proto::v1::SocketMigration,
    connections: usize,
    read_by: &str,
) {
    let rt = runtime();
    let (_dir, cluster) = cluster_with_criu(
        &[
            ferry_agent::criu::DUMP_ROLLBACK_MARK,
            ferry_agent::criu::INHERITED_TCP_MARK,
        ],
        "CRIU_FAULT=3",
    );
    rt.block_on(async {
        let (report, stayed) = migration_aborts(&cluster, connections, sockets).await;
        assert_eq!(report.sockets, sockets as i32, "{report:#?}");
        assert!(report.error.contains("dump"), "{}", report.error);
        let log = cluster.log_text("node1");
        assert!(
            log.contains(read_by)
                && log.contains("its connections left repair mode before CRIU resumes the process")
                && log.contains(&format!("connections={connections}")),
            "{}",
            cluster.log_tail("node1", 40)
        );
        carries_on_at_node1(&cluster, stayed).await;
    });
}

#[test]
fn a_dump_that_fails_while_the_connections_are_read_gives_them_back() {
    if !ferry_integration::can_run(
        "a_dump_that_fails_while_the_connections_are_read_gives_them_back",
    ) {
        return;
    }
    a_failed_dump_gives_the_connections_back(
        ferry_proto::v1::SocketMigration::Collective,
        32,
        "TCP connections read in one batch",
    );
}

/// The same in an incremental migration: the iterator's pass reads the
/// connections without repair mode (only those with bytes queued enter
/// it, to be peeked at); those leave it again before CRIU lets the
/// process run.
#[test]
fn an_incremental_dump_that_fails_while_the_connections_are_read_gives_them_back() {
    if !ferry_integration::can_run(
        "an_incremental_dump_that_fails_while_the_connections_are_read_gives_them_back",
    ) {
        return;
    }
    // Enough for the pass (`sockstate::PER_PROCESS_PASS_FROM`).
    a_failed_dump_gives_the_connections_back(
        ferry_proto::v1::SocketMigration::Incremental,
        64,
        "connections read in one pass of the TCP state iterator",
    );
}

#[test]
fn failed_restore_leaves_the_process_running_on_the_source() {
    if !ferry_integration::can_run("failed_restore_leaves_the_process_running_on_the_source") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    rt.block_on(async {
        let EchoSetup {
            mut node1,
            mut node2,
            pid,
            target: _,
            client,
        } = echo_setup(&cluster, 4).await;

        // A process node2's agent does not manage holds the port there:
        // CRIU's restore of the listening socket fails on bind().
        let _squatter = cluster
            .spawn_in_node(
                "node2",
                &echo_server_bin(),
                &["--port", &ECHO_PORT.to_string()],
            )
            .expect("port squatter on node2");
        cluster
            .wait_listening("node2", ECHO_PORT, Duration::from_secs(10))
            .expect("squatter listening");

        let verified_before = client.verified_per_connection();
        let (report, status) = migrate(&mut node1, pid, "node2")
            .await
            .expect("migration starts");
        let status = status.expect("a failed migration ends the stream with an error status");
        assert_eq!(status.code(), tonic::Code::Aborted, "{status:?}");
        assert_eq!(
            report.outcome,
            MigrationOutcome::Aborted as i32,
            "{report:#?}"
        );
        assert!(
            report.error.contains("restore"),
            "reason should name the restore: {}",
            report.error
        );
        assert!(report.resumed_on_source, "{report:#?}");
        assert!(
            report.freeze_time_us > 0,
            "the process was frozen, then resumed: {report:#?}"
        );
        eprintln!("abort reason: {}", report.error);

        // Still on node1, running, all connections alive and flowing.
        let p = wait_for_process(&mut node1, pid, |p| p.state == "running").await;
        assert_eq!(p.tcp_established, 4);
        assert!(
            matches!(process_state(pid), Some('S' | 'R')),
            "state {:?}",
            process_state(pid)
        );
        assert!(list(&mut node2).await.is_empty(), "node2 kept a process");
        // The connections node2 rebuilt were closed in repair mode, so
        // silently, also those already out of it (`leave_repair_early`): a
        // connection closed out of repair mode would linger in FIN_WAIT1,
        // its FIN held at the unowned port, until the process came back to
        // node2 and its rebuild collided with it.
        assert_eq!(
            cluster.tcp_connections_in_any_state("node2", ECHO_PORT),
            Vec::new(),
            "node2 kept a connection of the aborted migration"
        );
        client
            .wait_until_each_passes(&verified_before, 20, Duration::from_secs(20))
            .expect("connections flow again after the abort");
        let seq = client.stop();
        seq.assert_clean();
        assert!(
            cluster.incoming_dir_is_empty("node2"),
            "node2 kept images of the aborted migration"
        );
    });
}

#[test]
fn bad_requests_get_precise_errors_and_leave_the_process_alone() {
    if !ferry_integration::can_run("bad_requests_get_precise_errors_and_leave_the_process_alone") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 0)).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let pid = start_echo_server(&mut node1, ECHO_PORT).await;
        let code = |r: Result<(MigrationReport, Option<tonic::Status>), tonic::Status>| match r {
            Err(s) => (s.code(), s.message().to_owned()),
            Ok((rep, st)) => panic!("expected a refusal, got {rep:?} {st:?}"),
        };
        let (c, m) = code(migrate(&mut node1, pid, "node9").await);
        assert_eq!(c, tonic::Code::NotFound, "{m}");
        assert!(m.contains("node9") && m.contains("node2"), "{m}");
        let (c, m) = code(migrate(&mut node1, pid, "node1").await);
        assert_eq!(c, tonic::Code::InvalidArgument, "{m}");
        let (c, m) = code(migrate(&mut node1, 999_999_999, "node2").await);
        assert_eq!(c, tonic::Code::NotFound, "{m}");
        let (c, m) = code(migrate(&mut node1, 0, "node2").await);
        assert_eq!(c, tonic::Code::InvalidArgument, "{m}");
        for (req, field) in [
            (
                MigrateRequest {
                    strategy: 99,
                    ..Default::default()
                },
                "strategy",
            ),
            (
                MigrateRequest {
                    downtime_budget_ms: 3_600_000,
                    ..Default::default()
                },
                "downtime_budget_ms",
            ),
            (
                MigrateRequest {
                    max_rounds: 5000,
                    ..Default::default()
                },
                "max_rounds",
            ),
            (
                MigrateRequest {
                    drain_send_queues_ms: 60_000,
                    ..Default::default()
                },
                "drain_send_queues_ms",
            ),
        ] {
            let req = MigrateRequest {
                pid,
                destination_node: "node2".into(),
                ..req
            };
            let (c, m) = code(ferry_integration::managed::migrate_request(&mut node1, req).await);
            assert_eq!(c, tonic::Code::InvalidArgument, "{m}");
            assert!(m.starts_with(field), "{m}");
        }
        let (c, m) = code(migrate(&mut node1, 1, "node2").await);
        assert_eq!(c, tonic::Code::FailedPrecondition, "{m}");
        assert!(m.contains("init"), "{m}");
        let (c, m) = code(migrate(&mut node1, 2, "node2").await);
        assert_eq!(c, tonic::Code::FailedPrecondition, "{m}");
        assert!(m.contains("kernel thread"), "{m}");
        let agent_pid = cluster.agent_pid("node1");
        let (c, m) = code(migrate(&mut node1, agent_pid, "node2").await);
        assert_eq!(c, tonic::Code::FailedPrecondition, "{m}");
        assert!(m.contains("agent"), "{m}");
        let me = std::process::id() as i32;
        let (c, m) = code(migrate(&mut node1, me, "node2").await);
        assert_eq!(c, tonic::Code::FailedPrecondition, "{m}");
        assert!(m.contains("not managed"), "{m}");

        // The destination is busy with another incoming migration.
        let reservation = cluster
            .reserve_destination("node1", "node2", "feedfacefeedface")
            .expect("reserving node2 through its Peer API");
        let (c, m) = code(migrate(&mut node1, pid, "node2").await);
        assert_eq!(c, tonic::Code::ResourceExhausted, "{m}");
        assert!(m.contains("feedfacefeedface"), "{m}");
        drop(reservation);

        // A socket of a family CRIU cannot dump (vsock) is found before
        // the freeze: the migration is refused and the process never stops.
        let holder = ferry_integration::managed::run(
            &mut node1,
            vec![
                "/usr/bin/python3".into(),
                "-c".into(),
                "import socket, time\ns = socket.socket(40, socket.SOCK_STREAM)\ntime.sleep(600)"
                    .into(),
            ],
        )
        .await;
        // Migrated before Python opened the socket, the process would just
        // move: the request goes once the socket is there.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while ferry_integration::inspect::sockets_of(holder)
            .expect("the holder's sockets")
            .is_empty()
        {
            assert!(
                Instant::now() < deadline,
                "python never opened its vsock socket"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let refused = match migrate(&mut node1, holder, "node2").await {
            Err(s) if s.message().contains("family") => s,
            other => panic!("a vsock socket was not refused: {other:?}"),
        };
        assert_eq!(
            refused.code(),
            tonic::Code::FailedPrecondition,
            "{refused:?}"
        );
        assert!(refused.message().contains("socket:["), "{refused:?}");
        assert!(matches!(process_state(holder), Some('S' | 'R')));

        // CRIU would refuse these only once the process is stopped: a file
        // lock, and a Unix connection to a process outside the tree (here,
        // to this test). Found before, and the process never stops.
        let lock_file = cluster.dir().join("held.lock");
        let socket_path = cluster.dir().join("outside.sock");
        let outside = std::os::unix::net::UnixListener::bind(&socket_path).expect("listener");
        outside.set_nonblocking(true).expect("non-blocking listener");
        let mut accepted = Vec::new();
        let locker = ferry_integration::managed::run(
            &mut node1,
            vec![
                "flock".into(),
                lock_file.to_string_lossy().into_owned(),
                "sleep".into(),
                "600".into(),
            ],
        )
        .await;
        let connector = ferry_integration::managed::run(
            &mut node1,
            vec![
                "/usr/bin/python3".into(),
                "-c".into(),
                "import socket, sys, time\ns = socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\ntime.sleep(600)".into(),
                socket_path.to_string_lossy().into_owned(),
            ],
        )
        .await;
        // Each holds what it should before it is asked to move.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let locked = || {
            std::fs::read_to_string("/proc/locks")
                .unwrap_or_default()
                .lines()
                .any(|l| l.split_whitespace().nth(4) == Some(locker.to_string().as_str()))
        };
        while !locked() || accepted.is_empty() {
            if let Ok((conn, _)) = outside.accept() {
                accepted.push(conn);
            }
            assert!(std::time::Instant::now() < deadline, "no lock or no connection");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        for (holder, sign) in [
            (locker, "holds a file lock"),
            (connector, "connected to a process outside"),
        ] {
            let refused = migrate(&mut node1, holder, "node2")
                .await
                .expect_err("migrated despite what CRIU refuses");
            assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
            assert!(refused.message().contains(sign), "{refused:?}");
            assert!(matches!(process_state(holder), Some('S' | 'R')), "{sign}");
        }
        drop(accepted);

        // A socket that a process outside the tree holds too (this test,
        // by pidfd, as a supervisor handing out a listening socket would):
        // CRIU would move it and leave the outside copy behind. Refused
        // while the copy is held; the same process moves once it is not.
        let listener = ferry_integration::managed::run(
            &mut node1,
            vec![
                "/usr/bin/python3".into(),
                "-c".into(),
                "import socket, time\ns = socket.socket()\ns.bind(('0.0.0.0', 7391))\ns.listen()\ntime.sleep(600)".into(),
            ],
        )
        .await;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let copies = loop {
            let copies = ferry_integration::inspect::sockets_of(listener).expect("its sockets");
            if !copies.is_empty() {
                break copies;
            }
            assert!(Instant::now() < deadline, "python never opened its socket");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        };
        let refused = migrate(&mut node1, listener, "node2")
            .await
            .expect_err("migrated a socket shared with a process outside the tree");
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
        assert!(
            refused
                .message()
                .contains(&format!("shared with PID {}", std::process::id())),
            "{refused:?}"
        );
        assert!(matches!(process_state(listener), Some('S' | 'R')));
        drop(copies);
        let (report, status) = migrate(&mut node1, listener, "node2")
            .await
            .expect("the listener moves once nothing outside holds its socket");
        assert!(status.is_none(), "{status:?}");
        assert_eq!(report.outcome, MigrationOutcome::Committed as i32, "{report:?}");
        ferry_integration::managed::wait_until_gone(listener);
        assert!(matches!(
            process_state(report.destination_pid),
            Some('S' | 'R')
        ));

        // An oversized request (5 MiB, above the Control API's 4 MiB limit)
        // is refused by size, and the agent goes on answering.
        let huge = node1
            .run_process(ferry_proto::v1::RunProcessRequest {
                argv: vec!["x".repeat(5 << 20)],
                ..Default::default()
            })
            .await
            .expect_err("a 5 MiB request was accepted");
        assert_eq!(huge.code(), tonic::Code::OutOfRange, "{huge:?}");
        assert!(huge.message().contains("too large"), "{huge:?}");

        // None of this touched the process.
        let p = wait_for_process(&mut node1, pid, |p| p.state == "running").await;
        assert_eq!(p.tcp_listening, 1);
        assert!(matches!(process_state(pid), Some('S' | 'R')));
    });
}

#[test]
fn missing_criu_is_refused_before_the_process_is_touched() {
    if !ferry_integration::can_run("missing_criu_is_refused_before_the_process_is_touched") {
        return;
    }
    let rt = runtime();
    let mut spec = ClusterSpec::new(2, 0);
    spec.criu_path = Some("/nonexistent/criu".into());
    let cluster = Cluster::start(spec).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let pid = start_echo_server(&mut node1, ECHO_PORT).await;
        let err = migrate(&mut node1, pid, "node2")
            .await
            .expect_err("must be refused");
        assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
        assert!(
            err.message().contains("CRIU not found"),
            "{}",
            err.message()
        );
        assert!(matches!(process_state(pid), Some('S' | 'R')));
    });
}

/// The `ferry` CLI, as a script would use it: `--json` output, exit codes.
#[test]
fn cli_runs_lists_and_migrates_with_json_output() {
    if !ferry_integration::can_run("cli_runs_lists_and_migrates_with_json_output") {
        return;
    }
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    let ferry = |node: &str, args: &[&str]| {
        let out = std::process::Command::new(ferry_integration::bin_path("ferry"))
            .args(args)
            .env("FERRY_SOCKET", cluster.control_socket(node))
            .output()
            .expect("running ferry");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let json = |s: &str| -> serde_json::Value { serde_json::from_str(s).expect(s) };

    let (ok, out, err) = ferry("node1", &["--json", "nodes"]);
    assert!(ok, "{err}");
    let nodes = json(&out);
    assert_eq!(nodes[0]["name"], "node1");
    assert_eq!(nodes[1]["name"], "node2");
    assert_eq!(nodes[1]["reachable"], true, "{out}");

    let (ok, out, err) = ferry(
        "node1",
        &["--json", "run", "--", &echo_server_bin(), "--port", "7000"],
    );
    assert!(ok, "{err}");
    let pid = json(&out)["pid"].as_i64().unwrap();
    cluster
        .wait_listening("node1", ECHO_PORT, Duration::from_secs(10))
        .expect("listening");
    let mut probe = ferry_integration::workload::ProbeConnection::open(
        &cluster.netns_path("client1"),
        SocketAddrV4::new(SHARED_IP, ECHO_PORT),
    )
    .expect("a connection to migrate with the process");
    let (ok, out, err) = ferry("node1", &["--json", "ps"]);
    assert!(ok, "{err}");
    let ps = json(&out);
    assert_eq!(ps["processes"][0]["pid"].as_i64(), Some(pid), "{out}");
    assert_eq!(ps["processes"][0]["ports"][0], "7000/tcp", "{out}");
    assert_eq!(ps["processes"][0]["tcp_established"], 1, "{out}");

    let (ok, out, err) = ferry(
        "node1",
        &["--json", "migrate", &pid.to_string(), "--to", "node2"],
    );
    assert!(ok, "{err}");
    let report = json(&out);
    assert_eq!(report["outcome"], "committed", "{out}");
    assert_eq!(report["tcp_established"], 1, "{out}");
    assert!(report["freeze_time_ms"].as_f64().unwrap() > 0.0, "{out}");
    let id = report["migration_id"].as_str().unwrap().to_owned();
    let (ok, out, _) = ferry("node1", &["--json", "report", &id]);
    assert!(ok);
    assert_eq!(json(&out)["destination_pid"], report["destination_pid"]);
    probe
        .round_trip()
        .expect("the connection works after the migration");

    // Refusals exit non-zero and say why.
    let (ok, _, err) = ferry("node1", &["migrate", "999999999", "--to", "node2"]);
    assert!(!ok);
    assert!(
        err.contains("NotFound") && err.contains("999999999"),
        "{err}"
    );
    let (ok, _, err) = ferry("node1", &["report", "nope"]);
    assert!(!ok);
    assert!(err.contains("NotFound"), "{err}");
}

/// The destination's agent stops answering in the middle of a migration:
/// the source gives up after `peer_timeout_secs`, resumes the process, and
/// every connection carries on.
#[test]
fn a_destination_that_stops_answering_is_given_up_and_the_process_resumes() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    if !ferry_integration::can_run(
        "a_destination_that_stops_answering_is_given_up_and_the_process_resumes",
    ) {
        return;
    }
    let rt = runtime();
    let mut spec = ClusterSpec::new(2, 1);
    spec.extra_config = "peer_timeout_secs = 2\n".into();
    let cluster = Cluster::start(spec).expect("cluster");
    rt.block_on(async {
        let EchoSetup {
            mut node1,
            mut node2,
            pid,
            target: _,
            client,
        } = echo_setup(&cluster, 4).await;
        let before = client.verified_per_connection();
        let node2_agent = Pid::from_raw(cluster.agent_pid("node2"));
        let mut stream = node1
            .migrate(MigrateRequest {
                pid,
                destination_node: "node2".into(),
                strategy: Strategy::TotalCopy as i32,
                ..Default::default()
            })
            .await
            .expect("migration starts")
            .into_inner();
        let (mut stopped_at, mut report, mut status) = (None, None, None);
        loop {
            match stream.message().await {
                Ok(Some(ev)) => match ev.event {
                    // The process is frozen and its images are about to
                    // leave: now the destination goes silent.
                    Some(migration_event::Event::Progress(p)) if p.phase == "transfer" => {
                        kill(node2_agent, Signal::SIGSTOP).expect("SIGSTOP node2's agent");
                        stopped_at = Some(Instant::now());
                    }
                    Some(migration_event::Event::Report(r)) => report = Some(r),
                    _ => {}
                },
                Ok(None) => break,
                Err(s) => {
                    status = Some(s);
                    break;
                }
            }
        }
        kill(node2_agent, Signal::SIGCONT).expect("SIGCONT node2's agent");
        let stopped_at = stopped_at.expect("the migration reached the transfer");
        let report = report.expect("a report");
        assert_eq!(
            status.expect("an error status").code(),
            tonic::Code::Aborted
        );
        assert_eq!(
            report.outcome,
            MigrationOutcome::Aborted as i32,
            "{report:#?}"
        );
        assert!(report.error.contains("no answer"), "{}", report.error);
        assert!(report.resumed_on_source, "{report:#?}");
        assert!(
            stopped_at.elapsed() >= Duration::from_secs(2),
            "gave up before the 2 s deadline"
        );

        // The process runs on node1 and every connection carries on.
        let p = wait_for_process(&mut node1, pid, |p| p.state == "running").await;
        assert_eq!(p.tcp_established, 4);
        client
            .wait_until_each_passes(&before, 20, Duration::from_secs(20))
            .expect("connections flow again after the abort");
        client.stop().assert_clean();

        // Awake again, node2 drops whatever it had of the migration.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(cluster.incoming_dir_is_empty("node2") && list(&mut node2).await.is_empty()) {
            assert!(
                Instant::now() < deadline,
                "node2 kept traces of the aborted migration"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}

/// The established TCP connections of process `pid`, taken into this
/// process (pidfd_getfd), by (local, remote) address.
fn connections_of(
    pid: i32,
) -> std::collections::BTreeMap<(std::net::SocketAddr, std::net::SocketAddr), std::os::fd::OwnedFd>
{
    use std::os::fd::AsRawFd;
    let mut conns = std::collections::BTreeMap::new();
    for fd in ferry_integration::inspect::sockets_of(pid).expect("the process's sockets") {
        let local =
            nix::sys::socket::getsockname::<nix::sys::socket::SockaddrStorage>(fd.as_raw_fd());
        let remote =
            nix::sys::socket::getpeername::<nix::sys::socket::SockaddrStorage>(fd.as_raw_fd());
        if let (Ok(l), Ok(r)) = (local, remote)
            && let (Some(l), Some(r)) = (l.as_sockaddr_in(), r.as_sockaddr_in())
        {
            conns.insert(
                (
                    std::net::SocketAddr::V4(SocketAddrV4::from(*l)),
                    std::net::SocketAddr::V4(SocketAddrV4::from(*r)),
                ),
                fd,
            );
        }
    }
    conns
}

/// Sets options on a socket another process holds (the same socket).
fn set_opt<T: Copy>(fd: &std::os::fd::OwnedFd, level: i32, opt: i32, v: T) {
    use std::os::fd::AsRawFd;
    // SAFETY: `v` lives for the call and its size is passed.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            (&v as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    assert_eq!(
        r,
        0,
        "setsockopt {level}/{opt}: {}",
        std::io::Error::last_os_error()
    );
}

/// Gives the socket `fd` (a duplicate: the owner is the open file's) the
/// SIGIO owner `pid`.
fn set_owner(fd: &std::os::fd::OwnedFd, pid: i32) {
    use std::os::fd::AsRawFd;
    // SAFETY: F_SETOWN on a descriptor this process owns.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETOWN, pid) };
    assert_eq!(r, 0, "F_SETOWN: {}", std::io::Error::last_os_error());
}

/// The socket's SIGIO owner (0: none).
fn owner(fd: &std::os::fd::OwnedFd) -> i32 {
    use std::os::fd::AsRawFd;
    // SAFETY: F_GETOWN on a descriptor this process owns.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETOWN) }
}

/// The options a process gave its connections (here set through
/// pidfd_getfd, each connection its own values) are the ones its
/// connections have after a migration. With a CRIU carrying ferry's
/// tcp-options-by-caller patch on both nodes, CRIU's images hold none of
/// them: ferryd reads them beside the dump and sets them on the rebuilt
/// sockets; without that, the connections would come back with a new
/// socket's defaults and this fails.
///
/// One connection also has an owner for SIGIO (F_SETOWN, the server
/// itself): ferry's CRIU keeps such a connection in its images (the
/// owner is CRIU's to restore) while the others stay out of them, and it
/// comes back owned by the restored server, the others by nobody.
#[test]
fn connection_options_survive_the_migration() {
    if !ferry_integration::can_run("connection_options_survive_the_migration") {
        return;
    }
    options_survive(SocketMigration::Collective);
}

/// The same through an incremental migration: the options are read before
/// the freeze, with the setsockopt watch attached, and the freeze takes
/// every connection from that read (none was touched since).
#[test]
fn connection_options_survive_an_incremental_migration() {
    if !ferry_integration::can_run("connection_options_survive_an_incremental_migration") {
        return;
    }
    options_survive(SocketMigration::Incremental);
}

/// The source's copy closes its connections silently after an incremental
/// migration. The iterator's pass reads them without repair mode, and
/// each must be put into it before the source's copy goes: a connection
/// closed out of it sends a FIN and lingers in FIN_WAIT1 (the FIN is a
/// valid one for an idle peer, which would take it as the server's
/// close).
#[test]
fn the_source_copy_closes_an_incremental_migrations_connections_silently() {
    if !ferry_integration::can_run(
        "the_source_copy_closes_an_incremental_migrations_connections_silently",
    ) {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    rt.block_on(async {
        // Enough for the pass (`sockstate::PER_PROCESS_PASS_FROM`).
        let connections = 64;
        let EchoSetup {
            mut node1,
            node2: _,
            pid,
            target: _,
            client,
        } = echo_setup(&cluster, connections).await;
        wait_for_process(&mut node1, pid, |p| {
            p.tcp_established as usize == connections
        })
        .await;
        let before = client.verified_per_connection();
        let report = migrate_committed(
            &mut node1,
            MigrateRequest {
                pid,
                destination_node: "node2".into(),
                strategy: Strategy::TotalCopy as i32,
                sockets: SocketMigration::Incremental as i32,
                ..Default::default()
            },
        )
        .await;
        assert_eq!(
            report.sockets,
            SocketMigration::Incremental as i32,
            "{report:#?}"
        );
        assert_eq!(
            report.connections_preread as usize, connections,
            "{report:#?}"
        );
        // The stopped copy is gone, and with it (ferryd drops its own
        // duplicates as the migration ends) every socket it held.
        ferry_integration::managed::wait_until_gone(pid);
        let deadline = Instant::now() + Duration::from_secs(5);
        let left = loop {
            let left = cluster.tcp_connections_in_any_state("node1", ECHO_PORT);
            let established = left.iter().any(|(_, state)| *state == 1);
            if !established || Instant::now() > deadline {
                break left;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert_eq!(
            left,
            Vec::new(),
            "node1 kept connections of the moved process"
        );
        client
            .wait_until_each_passes(&before, 20, Duration::from_secs(20))
            .expect("every connection flows on node2");
        client.stop().assert_clean();
    });
}

fn options_survive(sockets: SocketMigration) {
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    rt.block_on(async {
        let EchoSetup {
            mut node1,
            mut node2,
            pid,
            client,
            ..
        } = echo_setup(&cluster, 8).await;
        wait_for_process(&mut node1, pid, |p| p.tcp_established == 8).await;
        let conns = connections_of(pid);
        assert_eq!(conns.len(), 8, "{:?}", conns.keys());
        for (i, fd) in conns.values().enumerate() {
            let i = i as i32;
            set_opt(fd, libc::SOL_TCP, libc::TCP_NODELAY, i % 2);
            set_opt(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1i32);
            set_opt(fd, libc::SOL_TCP, libc::TCP_KEEPIDLE, 100 + i);
            set_opt(fd, libc::SOL_TCP, libc::TCP_KEEPINTVL, 10 + i);
            set_opt(fd, libc::SOL_TCP, libc::TCP_KEEPCNT, 3 + i);
            set_opt(fd, libc::SOL_SOCKET, libc::SO_PRIORITY, i % 7);
            set_opt(fd, libc::SOL_IP, libc::IP_TOS, 0x10 * (i % 4));
            set_opt(fd, libc::SOL_IP, libc::IP_TTL, 40 + i);
            set_opt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                libc::timeval {
                    tv_sec: 1,
                    tv_usec: 250_000 * i64::from(i % 4),
                },
            );
            set_opt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                libc::linger {
                    l_onoff: i % 2,
                    l_linger: 5 + i,
                },
            );
            // A size set by the process: locked, so it cannot drift.
            set_opt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, 65536 + 4096 * i);
        }
        let owned = *conns.keys().next().expect("a connection");
        set_owner(&conns[&owned], pid);
        let read = |conns: &std::collections::BTreeMap<_, std::os::fd::OwnedFd>| {
            conns
                .iter()
                .map(|(k, fd)| {
                    use std::os::fd::AsFd;
                    let o = ferry_agent::sockstate::options::read(fd.as_fd(), false)
                        .expect("reading the options");
                    (*k, o)
                })
                .collect::<std::collections::BTreeMap<_, _>>()
        };
        let before = read(&conns);
        drop(conns);
        let verified_before = client.verified_per_connection();
        let table_before = ferry_integration::inspect::descriptor_table(pid).expect("fd table");

        let report = migrate_committed(
            &mut node1,
            MigrateRequest {
                pid,
                destination_node: "node2".into(),
                sockets: sockets as i32,
                ..Default::default()
            },
        )
        .await;
        assert_eq!(
            report.outcome,
            MigrationOutcome::Committed as i32,
            "{report:#?}"
        );
        assert_eq!(report.sockets, sockets as i32, "{report:#?}");
        assert!(
            cluster
                .log_text("node1")
                .contains("socket options move with their state"),
            "the options did not take ferryd's path"
        );
        if sockets == SocketMigration::Incremental {
            assert_eq!(
                (
                    report.connections_preread,
                    report.connections_read_in_freeze,
                    report.connections_staged
                ),
                (8, 0, 8),
                "every connection taken from the read before the freeze, \
                 and rebuilt on the socket node2 opened for it at Arm"
            );
        }
        wait_for_process(&mut node2, report.destination_pid, |p| {
            p.tcp_established == 8 && p.state == "running"
        })
        .await;
        // Nothing CRIU or ferryd used on the way is left in the process
        // (the pidfd CRIU's restore took the connections by was once).
        assert_eq!(
            ferry_integration::inspect::descriptor_table(report.destination_pid).expect("fd table"),
            table_before,
            "the descriptor table after the migration"
        );
        let moved = connections_of(report.destination_pid);
        for (k, fd) in &moved {
            let want = if *k == owned {
                report.destination_pid
            } else {
                0
            };
            assert_eq!(owner(fd), want, "the SIGIO owner of {k:?}");
        }
        let after = read(&moved);
        assert_eq!(after.len(), 8, "{:?}", after.keys());
        for (k, b) in &before {
            let a = after
                .get(k)
                .unwrap_or_else(|| panic!("connection {k:?} not on node2"));
            assert_eq!(a, b, "options of {k:?}");
            assert_ne!(b.buf_lock & 2, 0, "SO_RCVBUF set, so locked: {b:?}");
        }
        client
            .wait_until_each_passes(&verified_before, 20, Duration::from_secs(20))
            .expect("every connection exchanges messages after the migration");
        client.stop().assert_clean();
    });
}

/// One connection's state as a source would send it (never a real one).
fn some_connection(
    inode: u64,
    port: u16,
    options: Option<ferry_proto::v1::TcpSocketOptions>,
) -> ferry_proto::v1::TcpConnectionState {
    ferry_proto::v1::TcpConnectionState {
        inode,
        local: "198.18.0.100:7000".into(),
        remote: format!("198.18.0.11:{port}"),
        mss_clamp: 1460,
        window: Some(Default::default()),
        socket_options: options,
        ..Default::default()
    }
}

/// The destination rebuilds the connections while the images still
/// stream in: TransferImages holds the incoming migration for its whole
/// stream, and TransferSockets, which the source sends beside it inside the
/// freeze, must not wait for it (the check of its caller did, which put the
/// image transfer's ~10 ms at 1024 connections before every rebuild). As
/// node1's agent: an image stream opened and kept open, its first file
/// written on node2, then a TransferSockets that node2 answers before the
/// stream ends.
#[test]
fn the_connections_are_rebuilt_while_the_images_still_stream_in() {
    use ferry_proto::v1::{AbortRequest, ImageChunk, TransferSocketsRequest};
    if !ferry_integration::can_run("the_connections_are_rebuilt_while_the_images_still_stream_in") {
        return;
    }
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    let first_file = cluster
        .work_dir("node2")
        .join("incoming/beside/images/inventory.img");
    let addr = cluster.peer_addr("node2");
    let tls = cluster.tls().map(|t| t.client("node2", Some("node1")));
    ferry_integration::peer::block_on_in(&cluster.netns_path("node1"), || async {
        let mut peer = ferry_integration::peer::connect(addr, tls)
            .await
            .expect("peer service of node2");
        prepared_as_node1(&mut peer, "beside").await;

        let (chunks, stream) = tokio::sync::mpsc::channel(4);
        chunks
            .send(ImageChunk {
                migration_id: "beside".into(),
                file_name: "inventory.img".into(),
                offset: 0,
                data: vec![0; 64],
                ..Default::default()
            })
            .await
            .expect("the stream's first chunk");
        let mut images_peer = peer.clone();
        let images = tokio::spawn(async move {
            images_peer
                .transfer_images(tokio_stream::wrappers::ReceiverStream::new(stream))
                .await
        });
        // Once node2 wrote the first file, its TransferImages holds the
        // incoming migration, and holds it until the stream ends.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !first_file.exists() {
            assert!(
                Instant::now() < deadline,
                "node2 never wrote the stream's first file"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let sockets = tokio::time::timeout(
            Duration::from_secs(20),
            peer.transfer_sockets(TransferSocketsRequest {
                migration_id: "beside".into(),
                source_node: "node1".into(),
                ..Default::default()
            }),
        )
        .await
        .expect("TransferSockets answered while the image stream is open")
        .expect("TransferSockets accepted");
        assert_eq!(sockets.into_inner().connections, 0);
        assert!(!images.is_finished(), "the image stream ended early");

        drop(chunks);
        images
            .await
            .expect("the image stream's task")
            .expect("the images accepted once the stream ends");
        peer.abort(AbortRequest {
            migration_id: "beside".into(),
            ..Default::default()
        })
        .await
        .expect("abort");
    })
    .expect("in node1's namespace");
    assert!(cluster.incoming_dir_is_empty("node2"));
}

/// Hello and Prepare of migration `id` to `peer` as node1's agent would
/// send them.
async fn prepared_as_node1(
    peer: &mut ferry_proto::v1::peer_client::PeerClient<tonic::transport::Channel>,
    id: &str,
) -> ferry_proto::v1::PrepareResponse {
    use ferry_proto::v1::{HelloRequest, PrepareRequest};
    let hello = peer
        .hello(HelloRequest {
            node: "node1".into(),
            protocol_versions: ferry_proto::PEER_PROTOCOL_VERSIONS.to_vec(),
        })
        .await
        .expect("hello")
        .into_inner();
    peer.prepare(PrepareRequest {
        protocol_version: hello.protocol_version,
        migration_id: id.into(),
        source_node: "node1".into(),
        ..Default::default()
    })
    .await
    .expect("prepare")
    .into_inner()
}

/// Hello, Prepare and TransferSockets(`batch`) to node2 as node1's agent
/// would send them, then Abort. Returns Prepare's `takes_tcp_options` and
/// the transfer's refusal (panics if it was accepted).
fn transfer_refused(
    cluster: &Cluster,
    batch: Vec<ferry_proto::v1::TcpConnectionState>,
) -> (bool, tonic::Status) {
    use ferry_proto::v1::{AbortRequest, TransferSocketsRequest};
    let addr = cluster.peer_addr("node2");
    let tls = cluster.tls().map(|t| t.client("node2", Some("node1")));
    ferry_integration::peer::block_on_in(&cluster.netns_path("node1"), || async {
        let mut peer = ferry_integration::peer::connect(addr, tls)
            .await
            .expect("peer service of node2");
        let prepared = prepared_as_node1(&mut peer, "batch").await;
        let refused = peer
            .transfer_sockets(TransferSocketsRequest {
                migration_id: "batch".into(),
                source_node: "node1".into(),
                tcp_connections: batch,
                ..Default::default()
            })
            .await
            .expect_err("the batch is refused");
        peer.abort(AbortRequest {
            migration_id: "batch".into(),
            ..Default::default()
        })
        .await
        .expect("abort");
        (prepared.takes_tcp_options, refused)
    })
    .expect("in node1's namespace")
}

/// A destination whose CRIU has ferry's tcp-options-by-caller patch says
/// so in Prepare, and refuses a TransferSockets in which some connections
/// carry their options and some do not (the source's CRIU dumps all its
/// established connections one way): INVALID_ARGUMENT naming the field.
#[test]
fn a_socket_batch_with_options_for_only_some_connections_is_refused() {
    if !ferry_integration::can_run(
        "a_socket_batch_with_options_for_only_some_connections_is_refused",
    ) {
        return;
    }
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    let (takes, refused) = transfer_refused(
        &cluster,
        vec![
            some_connection(11, 40001, Some(Default::default())),
            some_connection(12, 40002, None),
        ],
    );
    assert!(
        takes,
        "node2's CRIU (cargo xtask setup's) has the options patch"
    );
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(
        refused.message().contains("tcp_connections.socket_options")
            && refused.message().contains("1 of 2"),
        "{refused:?}"
    );
    assert!(cluster.incoming_dir_is_empty("node2"));
}

/// A destination whose CRIU lacks the tcp-options-by-caller patch says so
/// in Prepare, and refuses connections that carry their options anyway
/// (its CRIU would restore the options the images lack): FAILED_PRECONDITION
/// naming the patch and how to get it, before any restore.
#[test]
fn options_for_a_criu_without_the_options_patch_are_refused() {
    if !ferry_integration::can_run("options_for_a_criu_without_the_options_patch_are_refused") {
        return;
    }
    let every_other_patch: Vec<&str> = ferry_agent::criu::FERRY_PATCHES
        .iter()
        .map(|(mark, _)| *mark)
        .filter(|mark| *mark != ferry_agent::criu::OPTS_BY_CALLER_MARK)
        .collect();
    let (_dir, cluster) = cluster_with_criu(&every_other_patch, "");
    let (takes, refused) = transfer_refused(
        &cluster,
        vec![
            some_connection(11, 40001, Some(Default::default())),
            some_connection(12, 40002, Some(Default::default())),
        ],
    );
    assert!(
        !takes,
        "node2's CRIU is taken for one without the options patch"
    );
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    assert!(
        refused
            .message()
            .contains("connection options carried by ferryd")
            && refused.message().contains("cargo xtask setup"),
        "{refused:?}"
    );
    assert!(cluster.incoming_dir_is_empty("node2"));
}

/// A listening socket with a connection waiting in its accept queue (the
/// handshake done by the kernel) that the process never accepts: CRIU
/// cannot move it, so the migration stops before the freeze, with the
/// reason, and nothing is lost: the process runs on node1, and the waiting
/// connection, once accepted there, carries its bytes both ways.
#[test]
fn a_connection_the_process_never_accepts_stops_the_migration_before_the_freeze() {
    if !ferry_integration::can_run(
        "a_connection_the_process_never_accepts_stops_the_migration_before_the_freeze",
    ) {
        return;
    }
    use std::io::{Read, Write};
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    let go = cluster.dir().join("accept-now");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let server = run(
            &mut node1,
            vec![
                "/usr/bin/python3".into(),
                "-c".into(),
                "import os, socket, sys, time\n\
                 s = socket.socket()\n\
                 s.bind(('0.0.0.0', 7393))\n\
                 s.listen(8)\n\
                 while not os.path.exists(sys.argv[1]):\n    time.sleep(0.02)\n\
                 c, _ = s.accept()\n\
                 c.sendall(c.recv(64))\n\
                 time.sleep(600)"
                    .into(),
                go.to_string_lossy().into_owned(),
            ],
        )
        .await;
        wait_for_process(&mut node1, server, |p| p.tcp_listening == 1).await;
        let mut client = ferry_integration::netns::run_in(&cluster.netns_path("client1"), || {
            let c = std::net::TcpStream::connect_timeout(
                &SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 100), 7393).into(),
                Duration::from_secs(5),
            )
            .expect("the handshake completes without an accept()");
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            c
        })
        .expect("client namespace");
        client.write_all(b"queued").unwrap();

        let (report, status) = migrate(&mut node1, server, "node2")
            .await
            .expect("the migration starts");
        let status = status.expect("a stopped migration ends with an error status");
        assert_eq!(status.code(), tonic::Code::Aborted, "{status:?}");
        assert!(
            status
                .message()
                .contains("port 7393: 1 connection(s) in the accept queue"),
            "{status:?}"
        );
        assert_eq!(
            report.outcome,
            MigrationOutcome::Aborted as i32,
            "{report:#?}"
        );
        assert_eq!(
            report.freeze_time_us, 0,
            "the process was stopped: {report:#?}"
        );
        assert!(
            matches!(process_state(server), Some('S' | 'R')),
            "the server left node1"
        );

        std::fs::write(&go, b"").unwrap();
        let mut echo = [0u8; 6];
        client
            .read_exact(&mut echo)
            .expect("the echo of the waiting connection");
        assert_eq!(&echo, b"queued");
    });
}

/// Clients connect every 10 ms while their server migrates, and the server
/// accepts only every 100 ms, so its accept queue is seldom empty: from
/// Arm the source starts no handshake (the destination replays the SYNs to
/// the restored listener), the process accepts what was queued, and every
/// connection, made before, during or after the migration, is served once,
/// the last ones on node2.
#[test]
fn connections_made_while_the_server_migrates_are_all_served() {
    if !ferry_integration::can_run("connections_made_while_the_server_migrates_are_all_served") {
        return;
    }
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicBool, Ordering};
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let server = run(
            &mut node1,
            vec![
                "/usr/bin/python3".into(),
                "-c".into(),
                "import socket, threading, time\n\
                 def echo(c):\n    c.sendall(c.recv(64))\n    c.close()\n\
                 s = socket.socket()\n\
                 s.bind(('0.0.0.0', 7394))\n\
                 s.listen(64)\n\
                 s.setblocking(False)\n\
                 while True:\n\
                 \x20   time.sleep(0.1)\n\
                 \x20   while True:\n\
                 \x20       try:\n\
                 \x20           c, _ = s.accept()\n\
                 \x20       except BlockingIOError:\n\
                 \x20           break\n\
                 \x20       c.setblocking(True)\n\
                 \x20       threading.Thread(target=echo, args=(c,), daemon=True).start()"
                    .into(),
            ],
        )
        .await;
        wait_for_process(&mut node1, server, |p| p.tcp_listening == 1).await;
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let netns = cluster.netns_path("client1");
        let clients = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                ferry_integration::netns::run_in(&netns, move || {
                    let target = SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 100), 7394);
                    let mut conns = Vec::new();
                    let mut results = Vec::new();
                    let mut n = 0u32;
                    while !stop.load(Ordering::SeqCst) {
                        let c = std::net::TcpStream::connect_timeout(
                            &target.into(),
                            Duration::from_secs(5),
                        )
                        .and_then(|mut c| {
                            c.set_read_timeout(Some(Duration::from_secs(10)))?;
                            c.write_all(format!("{n:08}").as_bytes())?;
                            Ok(c)
                        });
                        conns.push((n, c));
                        n += 1;
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    for (n, c) in conns {
                        let got = c.and_then(|mut c| {
                            let mut b = [0u8; 8];
                            c.read_exact(&mut b)?;
                            Ok(b)
                        });
                        results.push((n, got.map(|b| b == *format!("{n:08}").as_bytes())));
                    }
                    results
                })
                .expect("client namespace")
            })
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        let report = migrate_committed(
            &mut node1,
            MigrateRequest {
                pid: server,
                destination_node: "node2".into(),
                ..Default::default()
            },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, Ordering::SeqCst);
        let results = clients.join().expect("the clients' thread");
        let failed: Vec<_> = results
            .iter()
            .filter(|(_, r)| !matches!(r, Ok(true)))
            .collect();
        assert!(results.len() > 50, "only {} connections", results.len());
        assert!(failed.is_empty(), "of {}: {failed:?}", results.len());
        ferry_integration::managed::wait_until_gone(server);
        assert!(matches!(
            process_state(report.destination_pid),
            Some('S' | 'R')
        ));
    });
}
