//! Servers that drop root move like any other: a process tree whose
//! workers switched to another user (Debian's nginx: a root master and
//! `www-data` workers) migrates with its keep-alive connections, each
//! answered afterwards by the same worker, running as the same users with
//! the same resource limits, on the destination only. The agents here run
//! as root without CAP_SYS_RESOURCE (this machine's root lacks it, like a
//! container's), so CRIU cannot read another user's limits by prlimit();
//! ferry's CRIU reads them from procfs (xtask/criu/rlimits-from-procfs.patch).
//! Root only; run by `cargo xtask test` (or `cargo xtask integration`).

use std::collections::BTreeMap;
use std::net::{SocketAddrV4, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{
    migrate_committed, migrate_request, process_state, run, run_as, runtime, wait_for_process,
    wait_until_gone,
};
use ferry_integration::netns;
use ferry_integration::nginx::{self, Nginx, WORKER_USER};
use ferry_integration::pg_session::wait_for_queries;
use ferry_integration::postgres::{PG_USER, PostgresServer};
use ferry_integration::redis::Redis;
use ferry_proto::v1::control_client::ControlClient;
use ferry_proto::v1::{MigrateRequest, MigrationOutcome, Strategy};
use tonic::transport::Channel;

/// The children of `pid`.
fn children(pid: i32) -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect()
}

/// A line of /proc/PID/status, after its name (`None`: the task is gone).
fn try_status_field(pid: i32, name: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .map(|v| v.trim().to_owned())
}

/// A line of /proc/PID/status of a task that must be there.
fn status_field(pid: i32, name: &str) -> String {
    try_status_field(pid, name).unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
}

/// What a task of the tree is, as the test compares it before and after a
/// move: its real, effective, saved and file-system user IDs and groups,
/// and its resource limits.
#[derive(Debug, PartialEq, Eq)]
struct Identity {
    uid: String,
    gid: String,
    groups: String,
    limits: String,
}

/// `None`: the task ended while being read.
fn identity(pid: i32) -> Option<Identity> {
    Some(Identity {
        uid: try_status_field(pid, "Uid:")?,
        gid: try_status_field(pid, "Gid:")?,
        groups: try_status_field(pid, "Groups:")?,
        limits: std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?,
    })
}

/// The tree under `master`, keyed by each task's PID inside its PID
/// namespace (what CRIU keeps across the move); children that end while
/// it is read are left out.
fn tree(master: i32) -> BTreeMap<i32, Identity> {
    let mut all = vec![master];
    all.extend(children(master));
    all.into_iter()
        .filter_map(|pid| {
            let nspid = try_status_field(pid, "NSpid:")?
                .split_whitespace()
                .last()?
                .parse()
                .ok()?;
            Some((nspid, identity(pid)?))
        })
        .collect()
}

fn uid_of(user: &str) -> u32 {
    nix::unistd::User::from_name(user)
        .expect("passwd")
        .unwrap_or_else(|| panic!("no user {user}"))
        .uid
        .as_raw()
}

/// Moves `pid` from node`on+1` to the other node with `strategy` and
/// checks that it committed, runs on the destination and no longer on
/// the source; its PID there.
async fn move_committed(
    cluster: &Cluster,
    controls: &mut [ControlClient<Channel>; 2],
    on: usize,
    pid: i32,
    strategy: Strategy,
) -> i32 {
    let to = 1 - on;
    let destination = format!("node{}", to + 1);
    let report = migrate_committed(
        &mut controls[on],
        MigrateRequest {
            pid,
            destination_node: destination.clone(),
            strategy: strategy as i32,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(
        report.outcome,
        MigrationOutcome::Committed as i32,
        "{report:#?}"
    );
    eprintln!(
        "{strategy:?} to {destination}: freeze {:.1} ms",
        report.freeze_time_us as f64 / 1e3
    );
    let moved = report.destination_pid;
    wait_for_process(&mut controls[to], moved, |p| p.state == "running").await;
    assert_eq!(
        cluster.node_of_pid(moved).expect("netns").as_deref(),
        Some(destination.as_str())
    );
    assert!(
        matches!(process_state(pid), None | Some('Z')),
        "the source copy still runs"
    );
    wait_until_gone(pid);
    moved
}

#[test]
fn a_server_whose_workers_dropped_root_moves_with_its_connections() {
    let test = "a_server_whose_workers_dropped_root_moves_with_its_connections";
    if !ferry_integration::can_run(test) {
        return;
    }
    if !Nginx::installed() {
        panic!(
            "{} is missing: `cargo xtask setup` installs Debian's nginx",
            nginx::NGINX
        );
    }
    const WORKERS: usize = 2;
    const CONNECTIONS: usize = 8;
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    let server = Nginx::new(7402, WORKERS as u32).expect("nginx configuration");
    rt.block_on(async {
        let mut controls = [
            cluster.control("node1").await.expect("control node1"),
            cluster.control("node2").await.expect("control node2"),
        ];
        let mut master = run(&mut controls[0], server.argv()).await;
        wait_for_process(&mut controls[0], master, |p| p.tcp_listening >= 1).await;
        // The workers are up once they run as www-data.
        let www = uid_of(WORKER_USER).to_string();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while children(master)
            .iter()
            .filter(|&&w| status_field(w, "Uid:").starts_with(&www))
            .count()
            < WORKERS
        {
            assert!(
                std::time::Instant::now() < deadline,
                "nginx's workers did not start as {WORKER_USER}: {}",
                server.log_tail(20)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let before = tree(master);
        assert_eq!(before.len(), WORKERS + 1, "{before:#?}");
        assert!(
            before.values().any(|t| t.uid.starts_with("0\t")),
            "{before:#?}"
        );

        let addr = SocketAddrV4::new(cluster.public_addr(), server.port());
        let mut conns: Vec<TcpStream> = netns::run_in(&cluster.netns_path("client1"), || {
            (0..CONNECTIONS)
                .map(|_| {
                    let c = TcpStream::connect_timeout(&addr.into(), Duration::from_secs(5))
                        .expect("connect to nginx");
                    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                    c
                })
                .collect()
        })
        .expect("client namespace");
        let workers: Vec<i32> = conns
            .iter_mut()
            .map(|c| nginx::get_pid(c).expect("an answer"))
            .collect();

        let mut on = 0;
        for strategy in [Strategy::PreCopy, Strategy::TotalCopy] {
            let moved = move_committed(&cluster, &mut controls, on, master, strategy).await;
            // The same tasks, as the same users, with the same limits.
            assert_eq!(tree(moved), before, "{strategy:?}");
            // Each connection is still open and answered by its worker.
            for (c, worker) in conns.iter_mut().zip(&workers) {
                assert_eq!(
                    nginx::get_pid(c).expect("an answer after the move"),
                    *worker
                );
            }
            master = moved;
            on = 1 - on;
        }
        // And it takes new connections where it is now.
        let mut fresh = netns::run_in(&cluster.netns_path("client1"), || {
            TcpStream::connect_timeout(&addr.into(), Duration::from_secs(5)).expect("connect")
        })
        .expect("client namespace");
        fresh
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let answered = nginx::get_pid(&mut fresh).expect("an answer");
        assert!(
            before.contains_key(&answered) && answered != 1,
            "answered by {answered}, not one of the workers {:?}",
            before.keys()
        );
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(master),
            nix::sys::signal::Signal::SIGKILL,
        );
        wait_until_gone(master);
    });
}

/// `$FERRY_BIN_DIR/ferry-pg-session` when set, else the one cargo built
/// for this test.
fn session_bin() -> PathBuf {
    match std::env::var_os("FERRY_BIN_DIR") {
        Some(d) if !d.is_empty() => ferry_integration::bin_path("ferry-pg-session"),
        _ => PathBuf::from(env!("CARGO_BIN_EXE_ferry-pg-session")),
    }
}

/// A server that refuses to run as root: Debian's PostgreSQL runs under
/// ferry as the `postgres` user (postmaster, checkpointer, background
/// writer, WAL writer, autovacuum launcher, logger, and a backend per
/// session, with shared memory among them, System V included) while an
/// unmodified client on client1 (`ferry-pg-session`) holds one session and
/// queries every 50 ms. It moves to node2 and back: the session is the
/// same backend afterwards, no query failed, the data written before each
/// move reads back after it, and the tasks run as the same users with the
/// same limits on the destination only.
#[test]
fn a_database_server_that_refuses_root_moves_with_its_sessions() {
    let test = "a_database_server_that_refuses_root_moves_with_its_sessions";
    if !ferry_integration::can_run(test) {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    let client = cluster.netns_path("client1");
    let pg_addr = SocketAddrV4::new(cluster.public_addr(), 7403);
    let mut pg = PostgresServer::prepare_managed(&client, pg_addr).expect("initdb");
    rt.block_on(async {
        let mut controls = [
            cluster.control("node1").await.expect("control node1"),
            cluster.control("node2").await.expect("control node2"),
        ];
        // In the node's IPC namespace its System V segment cannot move:
        // refused before anything stops, naming it, and it runs on.
        let in_node_ns = run_as(&mut controls[0], pg.managed_argv(), PG_USER, false).await;
        pg.wait_ready().expect("postgres accepts connections");
        let refused = migrate_request(
            &mut controls[0],
            MigrateRequest {
                pid: in_node_ns,
                destination_node: "node2".into(),
                ..Default::default()
            },
        )
        .await;
        let status = match refused {
            Err(status) => status,
            Ok((report, status)) => panic!("expected a refusal, got {status:?} {report:#?}"),
        };
        assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
        assert!(
            status.message().contains("System V shared memory")
                && status.message().contains("--ipc-namespace"),
            "{status:?}"
        );
        assert!(matches!(process_state(in_node_ns), Some('S' | 'R')));
        pg.query("SELECT 1").expect("it still answers");
        // A fast shutdown, which removes its segment from the node's
        // namespace (a SIGKILL would leave it there).
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(in_node_ns),
            nix::sys::signal::Signal::SIGINT,
        )
        .expect("SIGINT");
        wait_until_gone(in_node_ns);

        // Its System V segment moves inside an IPC namespace of its own
        // (`ferry run --ipc-namespace`).
        let mut postmaster = run_as(&mut controls[0], pg.managed_argv(), PG_USER, true).await;
        pg.wait_ready().expect("postgres accepts connections");
        let postgres = uid_of(PG_USER).to_string();
        assert!(
            status_field(postmaster, "Uid:").starts_with(&postgres),
            "the postmaster does not run as {PG_USER}"
        );
        pg.query("CREATE TABLE moves (round int, note text)")
            .expect("CREATE TABLE");

        let status_addr = SocketAddrV4::new(cluster.client_addr("client1"), 7404);
        let mut session = Command::new(session_bin());
        session
            .args(ferry_integration::pg_session::args(pg_addr, status_addr))
            .stdin(Stdio::null());
        let _session = netns::spawn_in(&client, session).expect("ferry-pg-session");
        let started = wait_for_queries(&client, status_addr, 0, 5, Duration::from_secs(20))
            .expect("the session queries");

        let mut on = 0;
        let mut seen = started.queries_ok;
        for (round, strategy) in [Strategy::PreCopy, Strategy::TotalCopy]
            .into_iter()
            .enumerate()
        {
            pg.query(&format!(
                "INSERT INTO moves VALUES ({round}, 'before move {round}')"
            ))
            .expect("INSERT");
            let before = tree(postmaster);
            let moved = move_committed(&cluster, &mut controls, on, postmaster, strategy).await;
            // The postmaster and the session's backend, as the same users
            // with the same limits. PostgreSQL starts and ends children of
            // its own (autovacuum workers) at any time: the others are
            // compared by what they run as, not by their number.
            let after = tree(moved);
            let backend = i32::try_from(started.backend_pid).expect("a PID");
            for task in [1, backend] {
                assert_eq!(
                    after.get(&task),
                    before.get(&task),
                    "task {task}, {strategy:?}"
                );
            }
            assert!(
                after.values().all(|t| t == &before[&1]),
                "{strategy:?}: {after:#?}"
            );
            // The same session goes on querying, and nothing failed.
            let now = wait_for_queries(&client, status_addr, seen, 5, Duration::from_secs(20))
                .expect("the session queries after the move");
            assert_eq!(now.backend_pid, started.backend_pid, "a new session");
            assert_eq!(now.queries_failed, 0, "{now:?}");
            seen = now.queries_ok;
            let rows = pg
                .query("SELECT string_agg(note, ',' ORDER BY round) FROM moves")
                .expect("SELECT");
            let expected: Vec<String> = (0..=round).map(|r| format!("before move {r}")).collect();
            assert_eq!(rows, expected.join(","));
            postmaster = moved;
            on = 1 - on;
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(postmaster),
            nix::sys::signal::Signal::SIGKILL,
        );
        wait_until_gone(postmaster);
    });
}

/// With a CRIU that cannot read another user's limits (one without
/// ferry's procfs patch, known by its mark) and an agent without
/// CAP_SYS_RESOURCE (this machine's root lacks it), a server running as
/// `redis` is refused before anything stops, naming the task and its
/// user, and runs on. Where the agent holds that capability, it moves.
#[test]
fn a_criu_that_cannot_read_another_users_limits_is_refused_before_the_freeze() {
    let test = "a_criu_that_cannot_read_another_users_limits_is_refused_before_the_freeze";
    if !ferry_integration::can_run(test) {
        return;
    }
    // ferry's CRIU with its procfs patch's mark renamed: to the agent, a
    // CRIU without that patch.
    let dir = tempfile::tempdir().expect("a dir for the CRIU copy");
    let criu = dir.path().join("criu");
    let mut binary = std::fs::read(ferry_integration::criu_path()).expect("CRIU");
    let (mark, other) = (b"ferry-rlimits-procfs", b"ferry-rlimits-absent");
    let mut renamed = 0;
    while let Some(at) = binary.windows(mark.len()).position(|w| w == mark) {
        binary[at..at + mark.len()].copy_from_slice(other);
        renamed += 1;
    }
    assert!(renamed > 0, "ferry's CRIU has no procfs patch mark");
    std::fs::write(&criu, binary).expect("the CRIU copy");
    std::fs::set_permissions(&criu, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let own_status = std::fs::read_to_string("/proc/self/status").expect("status");
    let caps = own_status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
        .expect("CapEff");
    let has_cap_sys_resource = caps & (1 << 24) != 0;

    let mut spec = ClusterSpec::new(2, 1);
    spec.criu_path = Some(criu);
    let cluster = Cluster::start(spec).expect("cluster");
    let redis = Redis { port: 7405 };
    let data = tempfile::tempdir().expect("a dir for redis");
    let user = nix::unistd::User::from_name("redis")
        .expect("passwd")
        .expect("Debian's redis-server makes the redis user");
    std::os::unix::fs::chown(
        data.path(),
        Some(user.uid.as_raw()),
        Some(user.gid.as_raw()),
    )
    .expect("chown");
    let argv = redis.argv(data.path());
    let rt = runtime();
    rt.block_on(async {
        let mut controls = [
            cluster.control("node1").await.expect("control node1"),
            cluster.control("node2").await.expect("control node2"),
        ];
        // A user the node does not have: refused, naming the field.
        let unknown = controls[0]
            .run_process(ferry_proto::v1::RunProcessRequest {
                argv: argv.clone(),
                user: "ferry-no-such-user".into(),
                ..Default::default()
            })
            .await
            .expect_err("an unknown user");
        assert_eq!(unknown.code(), tonic::Code::InvalidArgument, "{unknown:?}");
        assert!(
            unknown.message().contains("user") && unknown.message().contains("ferry-no-such-user"),
            "{unknown:?}"
        );
        let pid = run_as(&mut controls[0], argv, "redis", false).await;
        wait_for_process(&mut controls[0], pid, |p| p.tcp_listening >= 1).await;
        assert_eq!(redis.cli(&cluster, &["SET", "k", "v"]).expect("SET"), "OK");
        if has_cap_sys_resource {
            let moved = move_committed(&cluster, &mut controls, 0, pid, Strategy::TotalCopy).await;
            assert_eq!(redis.cli(&cluster, &["GET", "k"]).expect("GET"), "v");
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(moved),
                nix::sys::signal::Signal::SIGKILL,
            );
            wait_until_gone(moved);
            return;
        }
        let refused = migrate_request(
            &mut controls[0],
            MigrateRequest {
                pid,
                destination_node: "node2".into(),
                ..Default::default()
            },
        )
        .await;
        let status = match refused {
            Err(status) => status,
            Ok((report, status)) => panic!("expected a refusal, got {status:?} {report:#?}"),
        };
        assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
        let named = format!("PID {pid} runs as user {}", user.uid);
        assert!(
            status.message().contains(&named) && status.message().contains("CAP_SYS_RESOURCE"),
            "{status:?}"
        );
        assert!(matches!(process_state(pid), Some('S' | 'R')));
        assert_eq!(redis.cli(&cluster, &["GET", "k"]).expect("GET"), "v");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        wait_until_gone(pid);
    });
}

/// "Max open files" of `pid`: (soft, hard), as /proc/PID/limits says.
fn open_files_limit(pid: i32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = text
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files");
    let v: Vec<u64> = line[25..]
        .split_whitespace()
        .take(2)
        .map(|w| w.parse().expect("a number"))
        .collect();
    (v[0], v[1])
}

/// `prlimit --pid PID --nofile=SOFT:HARD`: lowering needs no privilege.
fn set_open_files_limit(pid: i32, soft: u64, hard: u64) {
    let status = Command::new("prlimit")
        .args([
            "--pid",
            &pid.to_string(),
            &format!("--nofile={soft}:{hard}"),
        ])
        .status()
        .expect("prlimit");
    assert!(status.success(), "prlimit {pid}");
}

/// A destination whose agent lacks CAP_SYS_RESOURCE cannot give a
/// restored process a hard limit above its own (CRIU's restore ignores
/// the refusal: the process would run with the destination agent's
/// limits). Such a process is refused before anything stops, naming the
/// limit, both values and the node; once its hard limit fits, it moves
/// with its limits exactly as they were.
#[test]
fn a_hard_limit_the_destination_cannot_restore_is_refused_before_the_freeze() {
    let test = "a_hard_limit_the_destination_cannot_restore_is_refused_before_the_freeze";
    if !ferry_integration::can_run(test) {
        return;
    }
    let mut spec = ClusterSpec::new(2, 1);
    spec.node_config = vec![(
        "node2".into(),
        "features_off = [\"cap_sys_resource\"]\n".into(),
    )];
    let cluster = Cluster::start(spec).expect("cluster");
    let destination_hard = 4096;
    set_open_files_limit(cluster.agent_pid("node2"), 1024, destination_hard);
    let rt = runtime();
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let port = 7031;
        let pid = run(
            &mut node1,
            vec![
                env!("CARGO_BIN_EXE_ferry-echo-server").to_owned(),
                "--port".into(),
                port.to_string(),
            ],
        )
        .await;
        wait_for_process(&mut node1, pid, |p| p.tcp_listening == 1).await;
        let (_, hard) = open_files_limit(pid);
        assert!(
            hard > destination_hard,
            "the process's hard limit {hard} must start above node2's {destination_hard}"
        );
        let total_copy = MigrateRequest {
            pid,
            destination_node: "node2".into(),
            strategy: Strategy::TotalCopy as i32,
            ..Default::default()
        };
        let status = match migrate_request(&mut node1, total_copy.clone()).await {
            Err(status) => status,
            Ok((report, status)) => panic!("expected a refusal, got {status:?} {report:#?}"),
        };
        assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
        let message = status.message();
        assert!(
            message.contains("Max open files")
                && message.contains(&hard.to_string())
                && message.contains(&destination_hard.to_string())
                && message.contains("node2")
                && message.contains("CAP_SYS_RESOURCE"),
            "{message}"
        );
        assert!(matches!(process_state(pid), Some('S' | 'R')));

        set_open_files_limit(pid, 1000, destination_hard);
        let report = migrate_committed(&mut node1, total_copy).await;
        assert_eq!(
            report.outcome,
            MigrationOutcome::Committed as i32,
            "{report:#?}"
        );
        wait_until_gone(pid);
        assert_eq!(
            open_files_limit(report.destination_pid),
            (1000, destination_hard)
        );
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(report.destination_pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        wait_until_gone(report.destination_pid);
    });
}
