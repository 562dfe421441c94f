//! One migration under a fault, and the invariant after it: the tests of
//! agents killed at a step (`tests/recovery.rs`) and of the other faults
//! at a step (`tests/faults.rs`) share the setting (an echo server on
//! node1 with a few checked clients, moved to node2, an agent started with
//! a fault point) and the checks (the process runs on exactly one node,
//! every connection carries on with every byte once and in order, exactly
//! that node owns the connections, nothing of the migration is left).
//! What each fault point means: `ferry_agent::engine::fault_point` and
//! `docs/faults.md`.

use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use ferry_proto::v1::{MigrateRequest, Strategy};

use crate::cluster::{Cluster, ClusterSpec};
use crate::managed::{list, process_state, run, wait_for_process};
use crate::workload::SeqClient;

/// The echo server's port.
pub const ECHO_PORT: u16 = 7000;
/// Its clients' connections.
pub const CONNECTIONS: usize = 4;
/// The peer timeout of the clusters here: short, so that a late answer
/// is late within a test's time.
pub const PEER_TIMEOUT: Duration = Duration::from_secs(2);

/// A two-node cluster (peer timeout [`PEER_TIMEOUT`]) whose `node`'s agent
/// runs with the fault point `at` (`FERRY_FAULT_AT`).
pub fn cluster_with_fault(node: &str, at: &str) -> Cluster {
    let mut spec = ClusterSpec::new(2, 1);
    spec.extra_config = format!("peer_timeout_secs = {}\n", PEER_TIMEOUT.as_secs());
    let mut cluster = Cluster::start(spec).expect("cluster");
    cluster
        .start_agent_with_env(node, &[("FERRY_FAULT_AT", at)])
        .expect("the agent with its fault point");
    cluster
}

/// The echo server on node1 with [`CONNECTIONS`] clients from client1,
/// once node1 counts them all, and what each client had verified then.
pub async fn echo_server(cluster: &Cluster) -> (i32, SeqClient, Vec<u64>) {
    let mut node1 = cluster.control("node1").await.expect("control node1");
    let pid = run(
        &mut node1,
        vec![
            crate::bin_path("ferry-echo-server")
                .to_string_lossy()
                .into_owned(),
            "--port".into(),
            ECHO_PORT.to_string(),
        ],
    )
    .await;
    wait_for_process(&mut node1, pid, |p| p.tcp_listening == 1).await;
    let client = SeqClient::dve(
        cluster.netns_path("client1"),
        SocketAddrV4::new(cluster.public_addr(), ECHO_PORT),
        CONNECTIONS,
    )
    .expect("clients with traffic flowing");
    wait_for_process(&mut node1, pid, |p| {
        p.tcp_established as usize == CONNECTIONS
    })
    .await;
    let before = client.verified_per_connection();
    (pid, client, before)
}

/// A migration of `pid` from node1 to node2.
pub fn request(pid: i32, strategy: Strategy) -> MigrateRequest {
    MigrateRequest {
        pid,
        destination_node: "node2".into(),
        strategy: strategy as i32,
        ..Default::default()
    }
}

/// The node's agent died by its crash point (SIGKILL).
pub fn crashed(cluster: &mut Cluster, node: &str) {
    use std::os::unix::process::ExitStatusExt as _;
    let status = cluster
        .wait_agent_exit(node, Duration::from_secs(60))
        .unwrap_or_else(|| panic!("{node}'s agent did not reach its crash point"));
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "{node}'s agent ended otherwise: {status:?}\n{}",
        cluster.log_tail(node, 30)
    );
}

/// Waits (bounded) until `cond` holds, polling every 50 ms.
pub async fn eventually(what: &str, within: Duration, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond().await {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The process runs on node1 (the source) again and not on node2, every
/// connection carries on, and nothing of the migration is left.
pub async fn carries_on_at_node1(cluster: &Cluster, pid: i32, client: SeqClient, before: &[u64]) {
    let mut node1 = cluster.control("node1").await.expect("control node1");
    let mut node2 = cluster.control("node2").await.expect("control node2");
    let p = wait_for_process(&mut node1, pid, |p| p.state == "running").await;
    assert!(p.note.is_empty(), "{p:?}");
    assert_ne!(process_state(pid), Some('T'), "still stopped");
    client
        .wait_until_each_passes(before, 20, Duration::from_secs(30))
        .expect("every connection flows on node1");
    assert_eq!(
        cluster.established_tcp("node1", ECHO_PORT).len(),
        CONNECTIONS
    );
    client.stop().assert_clean();
    // A node2 cut off, or busy when node1 gave up, drops its copy (the
    // rebuilt connections, held silent in repair mode, among it) when
    // node1's Abort reaches it: then it runs nothing but its agent.
    eventually(
        "node2 drops its copy",
        Duration::from_secs(20),
        async || {
            list(&mut node2).await.is_empty()
                && cluster.incoming_dir_is_empty("node2")
                && cluster.established_tcp("node2", ECHO_PORT).is_empty()
                && cluster.pids_in("node2") == [cluster.agent_pid("node2")]
        },
    )
    .await;
    assert_eq!(cluster.journal_records("node1"), vec![]);
    assert_eq!(cluster.journal_records("node2"), vec![]);
}

/// The process runs on node2 (the destination) and not on node1, every
/// connection carries on there; node2 keeps only its record of the
/// commit.
pub async fn carries_on_at_node2(cluster: &Cluster, pid: i32, client: SeqClient, before: &[u64]) {
    let mut node1 = cluster.control("node1").await.expect("control node1");
    let mut node2 = cluster.control("node2").await.expect("control node2");
    eventually("node1's copy goes", Duration::from_secs(30), async || {
        process_state(pid).is_none_or(|s| s == 'Z') && list(&mut node1).await.is_empty()
    })
    .await;
    let moved = list(&mut node2).await;
    assert_eq!(moved.len(), 1, "{moved:?}");
    let p = wait_for_process(&mut node2, moved[0].pid, |p| {
        p.state == "running" && p.tcp_established as usize == CONNECTIONS
    })
    .await;
    assert_eq!(p.origin, "migrated-in");
    client
        .wait_until_each_passes(before, 20, Duration::from_secs(30))
        .expect("every connection flows on node2");
    assert!(cluster.established_tcp("node1", ECHO_PORT).is_empty());
    assert_eq!(
        cluster.established_tcp("node2", ECHO_PORT).len(),
        CONNECTIONS
    );
    client.stop().assert_clean();
    assert_eq!(cluster.journal_records("node1"), vec![]);
    let kept = cluster.journal_records("node2");
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert!(kept[0].1.contains("\"committed\""), "{kept:?}");
}

/// Where the process runs once the fault has passed (a killed agent
/// back, a link back, a late answer in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ends {
    /// On node1, the source: the migration rolled back.
    OnSource,
    /// On node2, the destination: the migration committed.
    Moved,
}

/// The `pid` of a journal record.
pub fn pid_of(record: &str) -> i32 {
    field_of(record, "pid")
        .parse()
        .unwrap_or_else(|e| panic!("no pid in {record}: {e}"))
}

/// A field of a journal record (JSON), as text.
pub fn field_of(record: &str, field: &str) -> String {
    let v: serde_json::Value =
        serde_json::from_str(record).unwrap_or_else(|e| panic!("{record}: {e}"));
    match &v[field] {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => panic!("no {field} in {record}"),
        other => other.to_string(),
    }
}
