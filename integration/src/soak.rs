//! The soak: one server moved again and again across three nodes under
//! load, every byte and datagram checked, the agents watched for leaks,
//! and the cluster checked at the end for anything a migration left.
//!
//! The server is `ferry-dve-server` (TCP and UDP echo on one port) with a
//! `ferry-pg-session` child that queries a PostgreSQL server (Debian's) on
//! a fourth node, which never hosts the server: its session is an
//! in-cluster connection that every migration must keep (same backend, no
//! failed query). `tcp` clients send 256 bytes every 50 ms and check each
//! echoed byte; `udp` players send 96-byte datagrams at 20 Hz and count
//! the echoes. Each migration goes to one of the two other nodes, with a
//! memory strategy and a socket mode drawn from a seeded generator (the
//! seed is printed: a run is repeated by giving it again).
//!
//! Per migration: its outcome and freeze. Every `sample_every`
//! migrations: each agent's resident memory, descriptors and threads. At
//! the end: the clients' verdict (lost bytes and datagrams), and on every
//! node no migration's images or journal record but the destination's
//! record of a commit, no port held by a node that does not run the
//! server or in any state but owned, no hold rule, and no
//! userfaultfd-registered area left in the server's tree. Used by the
//! `soak` benchmark (`cargo xtask soak`) and, short, by the tests.

use std::net::SocketAddrV4;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferry_proto::v1::{
    GetDataPlaneRequest, MigrateRequest, MigrationOutcome, SocketMigration, Strategy,
};

use crate::cluster::{Cluster, ClusterSpec};
use crate::managed::{migrate_request, run, wait_for_process};
use crate::pg_session::{SessionStatus, wait_for_queries};
use crate::postgres::{PG_PORT, PostgresServer};
use crate::workload::{SeqClient, UdpClients};

const PORT: u16 = 7000;
const SESSION_PORT: u16 = 7300;
const INTERVAL: Duration = Duration::from_millis(50);
/// The nodes the server moves across; the database is on a fourth.
const NODES: [&str; 3] = ["node1", "node2", "node3"];
const DB_NODE: &str = "node4";

pub const STRATEGIES: [Strategy; 4] = [
    Strategy::TotalCopy,
    Strategy::PreCopy,
    Strategy::QueuedPreCopy,
    Strategy::PostCopy,
];
pub const SOCKET_MODES: [SocketMigration; 3] = [
    SocketMigration::Iterative,
    SocketMigration::Collective,
    SocketMigration::Incremental,
];

#[derive(Debug, thiserror::Error)]
pub enum SoakError {
    #[error("{0}")]
    Step(String),
}

fn step(what: impl std::fmt::Display) -> SoakError {
    SoakError::Step(what.to_string())
}

/// What a soak runs.
#[derive(Debug, Clone)]
pub struct SoakSpec {
    /// Migrations at most.
    pub migrations: usize,
    /// Time at most; the migration under way then finishes.
    pub time_limit: Duration,
    pub seed: u64,
    pub tcp: usize,
    pub udp: usize,
    /// How often (in migrations) the agents are sampled.
    pub sample_every: usize,
}

/// One migration of the soak.
#[derive(Debug, Clone)]
pub struct SoakMigration {
    pub n: usize,
    pub from: String,
    pub to: String,
    pub strategy: Strategy,
    pub sockets: SocketMigration,
    pub outcome: MigrationOutcome,
    pub freeze_ms: f64,
    /// The report's error, or how the checks after it failed.
    pub error: String,
}

/// One agent, sampled after `after` migrations.
#[derive(Debug, Clone)]
pub struct AgentSample {
    pub after: usize,
    pub node: String,
    pub rss_kib: u64,
    pub descriptors: u64,
    pub threads: u64,
}

/// What a soak found.
#[derive(Debug, Clone, Default)]
pub struct SoakReport {
    pub seed: u64,
    pub elapsed: Duration,
    pub migrations: Vec<SoakMigration>,
    pub samples: Vec<AgentSample>,
    pub tcp_sent_bytes: u64,
    pub tcp_verified_bytes: u64,
    /// Connections that saw an error or lost bytes, as the client says.
    pub tcp_failures: Vec<String>,
    pub udp_sent: u64,
    pub udp_lost: u64,
    pub udp_corrupt: u64,
    /// The database session's queries answered (one session throughout:
    /// a break fails the migration after which it was seen).
    pub db_queries_ok: u64,
    /// What a migration left behind, one line each (must be empty).
    pub leftovers: Vec<String>,
}

impl SoakReport {
    /// Whether nothing was lost or left: every migration committed, every
    /// byte and datagram came back, the session held, nothing left over.
    pub fn is_clean(&self) -> bool {
        self.migrations
            .iter()
            .all(|m| m.outcome == MigrationOutcome::Committed && m.error.is_empty())
            && self.tcp_failures.is_empty()
            && self.tcp_sent_bytes == self.tcp_verified_bytes
            && self.udp_lost == 0
            && self.udp_corrupt == 0
            && self.leftovers.is_empty()
    }

    /// Each node's resident-memory slope, KiB per 100 migrations (least
    /// squares over its samples), over the whole run and over its second
    /// half: the first migrations warm the allocator and the caches up; a
    /// leak shows as a second half's slope that does not flatten.
    pub fn rss_slopes(&self) -> Vec<(String, f64, f64)> {
        let half = self.migrations.len() / 2;
        let mut nodes: Vec<String> = self.samples.iter().map(|s| s.node.clone()).collect();
        nodes.sort();
        nodes.dedup();
        nodes
            .into_iter()
            .map(|node| {
                let pts: Vec<(f64, f64)> = self
                    .samples
                    .iter()
                    .filter(|s| s.node == node)
                    .map(|s| (s.after as f64, s.rss_kib as f64))
                    .collect();
                let late: Vec<(f64, f64)> =
                    pts.iter().copied().filter(|p| p.0 >= half as f64).collect();
                (node, slope(&pts) * 100.0, slope(&late) * 100.0)
            })
            .collect()
    }
}

/// The least-squares slope of `pts` (0 with fewer than two x values).
pub fn slope(pts: &[(f64, f64)]) -> f64 {
    let n = pts.len() as f64;
    if pts.len() < 2 {
        return 0.0;
    }
    let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
    let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx == 0.0 {
        return 0.0;
    }
    pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum::<f64>() / sxx
}

/// SplitMix64: the soak's draws, repeatable from the seed alone.
#[derive(Debug, Clone)]
pub struct Draws(u64);

impl Draws {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// One of `n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// The cluster a soak runs on: the server's three nodes and the
/// database's, two client namespaces.
pub fn cluster() -> Result<Cluster, SoakError> {
    Cluster::start(ClusterSpec::new(4, 2)).map_err(|e| step(format!("cluster: {e}")))
}

/// Runs a soak on `cluster` (from [`cluster`]); `on_migration` hears of
/// each migration as it ends (to print it).
pub async fn run_soak(
    cluster: &Cluster,
    spec: &SoakSpec,
    mut on_migration: impl FnMut(&SoakMigration),
) -> Result<SoakReport, SoakError> {
    let started = Instant::now();
    let db_addr = SocketAddrV4::new(cluster.node_cluster_addr(DB_NODE), PG_PORT);
    let db = PostgresServer::start(&cluster.netns_path(DB_NODE), db_addr)
        .map_err(|e| step(format!("PostgreSQL: {e}")))?;
    let session_target = SocketAddrV4::new(cluster.public_addr(), SESSION_PORT);
    let server = vec![
        crate::bin_path("ferry-dve-server").display().to_string(),
        "--port".into(),
        PORT.to_string(),
        "--".into(),
        crate::bin_path("ferry-pg-session").display().to_string(),
        "--pg".into(),
        db.addr().to_string(),
        "--serve".into(),
        session_target.to_string(),
        "--interval-ms".into(),
        "50".into(),
    ];
    let mut here = 0;
    let mut control = control_client(cluster, NODES[here]).await?;
    let mut pid = run(&mut control, server).await;
    wait_for_process(&mut control, pid, |p| {
        p.tcp_listening == 2 && p.udp_sockets >= 1
    })
    .await;
    let target = SocketAddrV4::new(cluster.public_addr(), PORT);
    let clients = [cluster.netns_path("client1"), cluster.netns_path("client2")];
    let first_session = wait_for_queries(&clients[0], session_target, 0, 5, secs(30))
        .map_err(|e| step(format!("the database session: {e}")))?;
    let tcp = SeqClient::start(clients[0].clone(), target, spec.tcp, INTERVAL, 256)
        .map_err(|e| step(format!("TCP clients: {e}")))?;
    let udp = UdpClients::start(clients[1].clone(), target, spec.udp, INTERVAL, 96)
        .map_err(|e| step(format!("UDP players: {e}")))?;
    tcp.wait_until_flowing(secs(30))
        .map_err(|e| step(format!("TCP clients: {e}")))?;
    udp.wait_for_echoes(spec.udp as u64 * 10, secs(30))
        .map_err(|e| step(format!("UDP players: {e}")))?;
    let mut report = SoakReport {
        seed: spec.seed,
        ..Default::default()
    };
    let mut draws = Draws::new(spec.seed);
    sample(cluster, 0, &mut report.samples);
    let mut session = first_session.clone();
    for n in 1..=spec.migrations {
        if started.elapsed() >= spec.time_limit {
            break;
        }
        let to = (here + 1 + draws.below(2)) % NODES.len();
        let strategy = STRATEGIES[draws.below(STRATEGIES.len())];
        let sockets = SOCKET_MODES[draws.below(SOCKET_MODES.len())];
        let before = tcp.verified_per_connection();
        let (r, status) = migrate_request(
            &mut control,
            MigrateRequest {
                pid,
                destination_node: NODES[to].into(),
                strategy: strategy as i32,
                sockets: sockets as i32,
                ..Default::default()
            },
        )
        .await
        .map_err(|s| step(format!("migration {n}: {s}")))?;
        let outcome =
            MigrationOutcome::try_from(r.outcome).unwrap_or(MigrationOutcome::Unspecified);
        let mut m = SoakMigration {
            n,
            from: NODES[here].into(),
            to: NODES[to].into(),
            strategy,
            sockets,
            outcome,
            freeze_ms: r.freeze_time_us as f64 / 1e3,
            error: match &status {
                Some(s) => format!("{}: {}", s.code(), r.error),
                None => r.error.clone(),
            },
        };
        if outcome != MigrationOutcome::Committed {
            // What the destination still held of the server's connections
            // (a socket lingering from an earlier stay refuses the
            // rebuild of the same address pair).
            m.error.push_str(&held_by(cluster, NODES[to]));
        }
        if outcome == MigrationOutcome::Committed {
            here = to;
            pid = r.destination_pid;
            control = control_client(cluster, NODES[here]).await?;
        }
        // The server runs and serves every client again, and its session
        // is the same one, still answering.
        let checked = async {
            wait_for_process(&mut control, pid, |p| p.state == "running").await;
            tcp.wait_until_each_passes(&before, 5, secs(30))
                .map_err(|e| format!("TCP: {e}"))?;
            let s = wait_for_queries(&clients[0], session_target, session.queries_ok, 2, secs(30))?;
            if s.backend_pid != first_session.backend_pid
                || s.queries_failed != 0
                || s.last_error.is_some()
            {
                return Err(format!("the database session broke: {s:?}"));
            }
            Ok::<SessionStatus, String>(s)
        }
        .await;
        match checked {
            Ok(s) => session = s,
            Err(e) => {
                m.error = if m.error.is_empty() {
                    e
                } else {
                    format!("{}; {e}", m.error)
                };
            }
        }
        on_migration(&m);
        let failed = !m.error.is_empty() || outcome != MigrationOutcome::Committed;
        report.migrations.push(m);
        if n.is_multiple_of(spec.sample_every.max(1)) {
            sample(cluster, n, &mut report.samples);
        }
        if failed {
            break;
        }
    }
    let done = report.migrations.len();
    if !done.is_multiple_of(spec.sample_every.max(1)) {
        sample(cluster, done, &mut report.samples);
    }
    // The last echoes in before the clients stop: what is still in flight
    // then is not lost.
    let seen = udp.echoed();
    let _ = udp.wait_for_echoes(seen + spec.udp as u64 * 5, secs(10));
    let tcp_report = tcp.stop();
    report.tcp_sent_bytes = tcp_report.sent_bytes();
    report.tcp_verified_bytes = tcp_report.verified_bytes();
    report.tcp_failures = tcp_report
        .failures()
        .iter()
        .map(|c| format!("{c:?}"))
        .collect();
    let udp_report = udp.stop().map_err(|e| step(format!("UDP players: {e}")))?;
    report.udp_sent = udp_report.sent();
    report.udp_lost = udp_report.lost();
    report.udp_corrupt = udp_report.corrupt();
    report.db_queries_ok = session.queries_ok;
    report.leftovers = leftovers(cluster, NODES[here], pid).await;
    report.elapsed = started.elapsed();
    drop(db);
    Ok(report)
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

async fn control_client(
    cluster: &Cluster,
    node: &str,
) -> Result<ferry_proto::v1::control_client::ControlClient<tonic::transport::Channel>, SoakError> {
    cluster
        .control(node)
        .await
        .map_err(|e| step(format!("control {node}: {e}")))
}

/// Each server node's agent: resident memory, descriptors, threads.
/// The TCP sockets `node` holds that are not listening, by state (as
/// `/proc/net/tcp` numbers them: 1 established, 4 FIN_WAIT1, 6
/// TIME_WAIT, 7 CLOSE, ...), and the first few other than the clients'
/// connections to the server's port (the database session among them),
/// for an abort's message.
fn held_by(cluster: &Cluster, node: &str) -> String {
    let sockets = crate::inspect::tcp_sockets(&cluster.netns_path(node)).unwrap_or_default();
    let mut states = std::collections::BTreeMap::<u8, usize>::new();
    let held: Vec<_> = sockets
        .iter()
        .filter(|e| e.state != crate::inspect::TCP_LISTEN)
        .collect();
    for e in &held {
        *states.entry(e.state).or_default() += 1;
    }
    // After an abort the process runs on the source again: whatever the
    // destination still holds is left over, and its holder says from what.
    let inodes = held.iter().map(|e| e.inode).filter(|&i| i != 0).collect();
    let holders = crate::inspect::socket_holders(&inodes);
    let named: Vec<String> = held
        .iter()
        .take(8)
        .map(|e| {
            format!(
                "{} -> {} state {} inode {} held by {:?}",
                e.local,
                e.remote,
                e.state,
                e.inode,
                holders.get(&e.inode).cloned().unwrap_or_default()
            )
        })
        .collect();
    format!(" [{node} holds TCP sockets by state: {states:?}; the first: {named:?}]")
}

fn sample(cluster: &Cluster, after: usize, out: &mut Vec<AgentSample>) {
    for node in NODES {
        let pid = cluster.agent_pid(node);
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        let descriptors = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count() as u64)
            .unwrap_or(0);
        out.push(AgentSample {
            after,
            node: node.to_owned(),
            rss_kib: field("VmRSS:"),
            descriptors,
            threads: field("Threads:"),
        });
    }
}

/// What the migrations left on the nodes, one line each: see the module's
/// doc.
async fn leftovers(cluster: &Cluster, server_node: &str, pid: i32) -> Vec<String> {
    let mut left = Vec::new();
    for node in NODES {
        let work = cluster.work_dir(node);
        for dir in ["incoming", "outgoing"] {
            let entries: Vec<PathBuf> = std::fs::read_dir(work.join(dir))
                .map(|d| d.flatten().map(|e| e.path()).collect())
                .unwrap_or_default();
            for e in entries {
                left.push(format!("{node}: images {}", e.display()));
            }
        }
        let records = cluster.journal_records(node);
        for (name, body) in records {
            if !(name.starts_with("in-") && body.contains("\"committed\"")) {
                left.push(format!("{node}: journal record {name}: {body}"));
            }
        }
        let plane = match control_client(cluster, node).await {
            Ok(mut c) => c
                .get_data_plane(GetDataPlaneRequest::default())
                .await
                .map(|r| r.into_inner())
                .map_err(|s| s.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match plane {
            Ok(p) => {
                for port in &p.ports {
                    if node != server_node || port.state != "owned" {
                        left.push(format!("{node}: port {:?} {}", port.port, port.state));
                    }
                }
                for rule in &p.translations {
                    if rule.contains("(held)") {
                        left.push(format!("{node}: translation rule {rule}"));
                    }
                }
            }
            Err(e) => left.push(format!("{node}: the data plane unread: {e}")),
        }
    }
    for task in process_tree(pid) {
        let smaps = std::fs::read_to_string(format!("/proc/{task}/smaps")).unwrap_or_default();
        let registered = smaps
            .lines()
            .filter_map(|l| l.strip_prefix("VmFlags:"))
            .filter(|f| {
                f.split_whitespace()
                    .any(|x| matches!(x, "uw" | "um" | "ui"))
            })
            .count();
        if registered > 0 {
            left.push(format!(
                "{server_node}: PID {task} has {registered} userfaultfd-registered areas"
            ));
        }
    }
    left
}

/// `pid` and its descendants (procfs' children lists).
fn process_tree(pid: i32) -> Vec<i32> {
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let p = tree[i];
        let tasks: Vec<PathBuf> = std::fs::read_dir(format!("/proc/{p}/task"))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        for t in tasks {
            let children = std::fs::read_to_string(t.join("children")).unwrap_or_default();
            tree.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<i32>().ok()),
            );
        }
        i += 1;
    }
    tree
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slope_is_the_least_squares_one() {
        assert_eq!(slope(&[]), 0.0);
        assert_eq!(slope(&[(1.0, 5.0)]), 0.0);
        assert_eq!(slope(&[(3.0, 1.0), (3.0, 9.0)]), 0.0, "one x only");
        let flat = slope(&[(0.0, 100.0), (10.0, 100.0), (20.0, 100.0)]);
        assert_eq!(flat, 0.0);
        let leak = slope(&[(0.0, 100.0), (10.0, 120.0), (20.0, 140.0), (30.0, 160.0)]);
        assert!((leak - 2.0).abs() < 1e-9, "{leak}");
    }

    #[test]
    fn draws_repeat_from_their_seed_and_cover_every_choice() {
        let a: Vec<u64> = (0..8)
            .map({
                let mut d = Draws::new(7);
                move |_| d.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..8)
            .map({
                let mut d = Draws::new(7);
                move |_| d.next_u64()
            })
            .collect();
        assert_eq!(a, b);
        assert_ne!(
            a,
            (0..8)
                .map({
                    let mut d = Draws::new(8);
                    move |_| d.next_u64()
                })
                .collect::<Vec<_>>()
        );
        let mut d = Draws::new(1);
        let mut seen = [0usize; 4];
        for _ in 0..400 {
            seen[d.below(4)] += 1;
        }
        assert!(seen.iter().all(|&n| n > 50), "{seen:?}");
    }
}
