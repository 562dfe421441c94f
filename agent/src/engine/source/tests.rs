//! The source side against a scripted CRIU and a scripted destination,
//! with a real process: `bash` holding a TCP connection to the test and
//! echoing every line on it, started as a managed process is (the init of
//! its own PID namespace). The scripted CRIU does to it what CRIU does
//! (stops the tree; in a per-socket migration, puts its connections in
//! repair mode; on a failed dump, lets it go again); everything else is
//! ferryd's own code: the socket reader, the rollback, the data plane's
//! bookkeeping (on recording fakes).
//!
//! What every abort must leave, phase by phase: the process running and
//! answering on its connection, none of its sockets in repair mode, its
//! port owned again, no capture session open, the destination told.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_proto::v1 as pb;
use futures::StreamExt;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::{MigrationOptions, PhaseName, prepare, run};
use crate::cluster::Unreachable;
use crate::config::{MemoryStrategy, PeerConfig};
use crate::criu::{
    Checkpointer, CriuError, CriuVersion, DumpRequest, Notifications, NotifyHook, TcpConnections,
};
use crate::dataplane::PortState;
use crate::engine::destination::fixture::Fixture;
use crate::engine::link::{Connector, PeerLink, TunnelIn, WantsIn};
use crate::managed::{Lifecycle, ManagedProcess, Origin};
use crate::process::{self, PortKey};
use crate::sockstate::SocketMigration;
use crate::sockstate::sys;

/// The cluster the tests' node ("node2", 198.19.0.2) knows: the
/// destination, and a node of in-cluster peers. The scripted links stand
/// for both: nothing is sent to these addresses.
const PEERS: &[(&str, &str)] = &[("node1", "198.19.0.1"), ("node3", "198.19.0.3")];

// ---- the table ----

/// The table in the module's documentation and [`PhaseName`]'s guards say
/// the same, for every phase.
#[test]
fn phases_and_the_table_agree() {
    let doc = include_str!("mod.rs");
    let rows: Vec<Vec<&str>> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("//! | "))
        .filter(|l| !l.starts_with("phase |") && !l.starts_with("---"))
        .map(|l| l.trim_end_matches(" |").split(" | ").collect())
        .collect();
    assert_eq!(rows.len(), PhaseName::ALL.len(), "one row per phase");
    for row in rows {
        let [name, file, next, may_abort, cancel, report] = row[..] else {
            panic!("a row of six columns: {row:?}");
        };
        let phase = PhaseName::ALL
            .into_iter()
            .find(|p| p.as_str() == name)
            .unwrap_or_else(|| panic!("{name} is no phase"));
        let mut want: Vec<&str> = phase.next().iter().map(|p| p.as_str()).collect();
        let mut said: Vec<&str> = next.split(", ").filter(|n| *n != "-").collect();
        want.sort_unstable();
        said.sort_unstable();
        assert_eq!(said, want, "{name}: next");
        assert_eq!(may_abort != "no", phase.may_abort(), "{name}: may abort");
        let cancel_point = match cancel {
            "checked" => super::CancelPoint::Checked,
            "closed" => super::CancelPoint::Closed,
            "-" => super::CancelPoint::Unchecked,
            other => panic!("{name}: cancel {other:?}"),
        };
        assert_eq!(phase.cancel(), cancel_point, "{name}: cancel");
        assert_eq!(
            phase.report_phase().unwrap_or("-"),
            report,
            "{name}: report phase"
        );
        let file = file.trim_matches('`');
        assert!(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("src/engine/source")
                .join(file)
                .exists(),
            "{name}: {file} is not a file of the module"
        );
    }
    // Every phase but the first is some phase's next, or the abort.
    for p in PhaseName::ALL {
        let reached = PhaseName::ALL.iter().any(|q| q.next().contains(&p))
            || p == PhaseName::Start
            || p == PhaseName::Abort;
        assert!(reached, "{} is never reached", p.as_str());
    }
}

// ---- a scripted CRIU ----

/// Where the scripted CRIU fails a dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DumpFails {
    /// Before it stops the tree (as a CRIU that cannot seize it).
    BeforeFreeze,
    /// With the tree stopped: it says network-unlock and lets it go.
    AfterFreeze,
}

#[derive(Debug, Default)]
struct ScriptedCriu {
    fails: Option<DumpFails>,
}

/// The TCP sockets of `pid` that are connected, as (descriptor number,
/// ferryd's duplicate).
fn tcp_connections_of(pid: i32) -> Vec<(i32, std::os::fd::OwnedFd)> {
    let pidfd = crate::process::pidfd::open(pid).unwrap();
    let mut found = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        let Some(n) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        let Ok(fd) = sys::pidfd_getfd(pidfd.as_fd(), n) else {
            continue;
        };
        let tcp = sys::get_int(fd.as_fd(), libc::SOL_SOCKET, libc::SO_PROTOCOL).ok()
            == Some(libc::IPPROTO_TCP);
        if tcp && sys::tcp_info_head(fd.as_fd()).is_ok_and(|h| h[0] == sys::TCP_ESTABLISHED) {
            found.push((n, fd));
        }
    }
    found
}

fn stop_tree(pid: i32) {
    let tree = process::process_tree(pid);
    for &p in &tree {
        kill(Pid::from_raw(p), Signal::SIGSTOP).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while !tree
        .iter()
        .all(|p| process::inspect(*p).is_ok_and(|i| i.is_stopped()))
    {
        assert!(Instant::now() < deadline, "the tree did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn set_repair(fds: &[(i32, std::os::fd::OwnedFd)], on: i32) {
    for (_, fd) in fds {
        sys::set_int(fd.as_fd(), libc::SOL_TCP, sys::TCP_REPAIR, on).unwrap();
    }
}

fn failed(reason: &str) -> CriuError {
    CriuError::Failed {
        operation: "dump",
        reason: reason.into(),
    }
}

impl Checkpointer for ScriptedCriu {
    fn probe(&self) -> Result<CriuVersion, CriuError> {
        Ok(crate::criu::MIN_CRIU_VERSION)
    }

    /// As ferry's CRIU: it says network-unlock before a failed dump lets
    /// the tree go (so the socket reader runs during the dump).
    fn has_patch(&self, mark: &str) -> bool {
        mark == crate::criu::DUMP_ROLLBACK_MARK
    }

    fn dump(&self, req: &DumpRequest, notify: NotifyHook<'_>) -> Result<Notifications, CriuError> {
        notify("pre-dump").map_err(|e| failed(&e.0))?;
        if self.fails == Some(DumpFails::BeforeFreeze) {
            return Err(failed("scripted: cannot seize the tree"));
        }
        stop_tree(req.pid);
        // --tcp-established: CRIU dumps each connection in repair mode and
        // leaves it there (--leave-stopped).
        let repaired = match req.tcp_connections {
            TcpConnections::Dump => {
                let fds = tcp_connections_of(req.pid);
                set_repair(&fds, sys::REPAIR_ON);
                fds
            }
            TcpConnections::Skip => Vec::new(),
        };
        let frozen = notify("query-ext-files");
        if frozen.is_err() || self.fails == Some(DumpFails::AfterFreeze) {
            let _ = notify("network-unlock");
            set_repair(&repaired, sys::REPAIR_OFF);
            for p in process::process_tree(req.pid) {
                let _ = kill(Pid::from_raw(p), Signal::SIGCONT);
            }
            return Err(failed("scripted: the dump failed with the tree stopped"));
        }
        std::fs::write(req.images_dir.join("core-1.img"), [0u8; 4096]).unwrap();
        Ok(Notifications::default())
    }
}

// ---- a scripted destination ----

/// A Peer call of the scripted destination, by name.
type Step = &'static str;

#[derive(Debug, Default)]
struct ScriptedDestination {
    /// The calls received, in order.
    calls: Mutex<Vec<String>>,
    /// The call that fails (UNAVAILABLE), if any.
    fails: Option<Step>,
    /// The Commit is refused (FAILED_PRECONDITION): the destination cannot
    /// resume the process (its pages could not all be installed).
    refuses_commit: bool,
    /// In-cluster connections the restore reports.
    in_cluster: Vec<pb::InClusterFlow>,
    /// A cancel requested while the named call runs.
    cancel_during: Mutex<Option<(Step, Arc<crate::engine::cancel::Cancel>)>>,
    /// What the cancel requested during a call got.
    cancel_answer: Mutex<Option<Result<(), crate::engine::cancel::CancelRefused>>>,
}

impl ScriptedDestination {
    fn call(&self, step: Step) -> Result<(), Status> {
        self.calls.lock().unwrap().push(step.to_owned());
        if let Some((at, cancel)) = self
            .cancel_during
            .lock()
            .unwrap()
            .take_if(|(at, _)| *at == step)
        {
            let _ = at;
            *self.cancel_answer.lock().unwrap() = Some(cancel.request("the test"));
        }
        if self.fails == Some(step) {
            return Err(Status::unavailable(format!("scripted: {step} fails")));
        }
        Ok(())
    }

    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
}

#[tonic::async_trait]
impl PeerLink for ScriptedDestination {
    async fn hello(&self, _: pb::HelloRequest) -> Result<pb::HelloResponse, Status> {
        self.call("hello")?;
        Ok(pb::HelloResponse {
            node: "node1".into(),
            protocol_version: ferry_proto::PEER_PROTOCOL_VERSION,
            ..Default::default()
        })
    }
    async fn prepare(&self, _: pb::PrepareRequest) -> Result<pb::PrepareResponse, Status> {
        self.call("prepare")?;
        Ok(pb::PrepareResponse::default())
    }
    async fn transfer_pages(
        &self,
        mut batches: ReceiverStream<pb::PageBatch>,
    ) -> Result<pb::TransferPagesResponse, Status> {
        self.call("transfer_pages")?;
        let mut pages = 0;
        while let Some(b) = batches.next().await {
            pages += b.runs.len() as u64;
        }
        Ok(pb::TransferPagesResponse { pages, bytes: 0 })
    }
    async fn arm(&self, _: pb::ArmRequest) -> Result<pb::ArmResponse, Status> {
        self.call("arm")?;
        Ok(pb::ArmResponse {})
    }
    async fn transfer_images(
        &self,
        mut chunks: ReceiverStream<pb::ImageChunk>,
    ) -> Result<pb::TransferImagesResponse, Status> {
        // The whole stream first, as a destination whose write fails at
        // the end: the refusal, not the reader's closed channel, is what
        // the source then reports.
        let mut bytes = 0;
        while let Some(c) = chunks.next().await {
            bytes += c.data.len() as u64;
        }
        self.call("transfer_images")?;
        Ok(pb::TransferImagesResponse { files: 1, bytes })
    }
    async fn transfer_sockets(
        &self,
        req: pb::TransferSocketsRequest,
    ) -> Result<pb::TransferSocketsResponse, Status> {
        self.call("transfer_sockets")?;
        Ok(pb::TransferSocketsResponse {
            connections: req.tcp_connections.len() as u32,
            ..Default::default()
        })
    }
    async fn page_tunnel(&self, _: ReceiverStream<pb::TunnelBytes>) -> Result<TunnelIn, Status> {
        self.call("page_tunnel")?;
        Err(Status::unimplemented("no post-copy here"))
    }
    async fn post_copy_pages(&self, _: ReceiverStream<pb::PageBatch>) -> Result<WantsIn, Status> {
        self.call("post_copy_pages")?;
        Err(Status::unimplemented("no post-copy here"))
    }
    async fn restore(&self, _: pb::RestoreRequest) -> Result<pb::RestoreResponse, Status> {
        self.call("restore")?;
        Ok(pb::RestoreResponse {
            pid: 4242,
            in_cluster: self.in_cluster.clone(),
            ..Default::default()
        })
    }
    async fn commit(&self, _: pb::CommitRequest) -> Result<pb::CommitResponse, Status> {
        self.call("commit")?;
        if self.refuses_commit {
            return Err(Status::failed_precondition(
                "scripted: not resumed: its page filler failed before the resume",
            ));
        }
        Ok(pb::CommitResponse {
            pid: 4242,
            ..Default::default()
        })
    }
    async fn abort(&self, _: pb::AbortRequest) -> Result<pb::AbortResponse, Status> {
        self.call("abort")?;
        Ok(pb::AbortResponse { committed: false })
    }
    async fn post_copy_status(
        &self,
        _: pb::PostCopyStatusRequest,
    ) -> Result<pb::PostCopyStatusResponse, Status> {
        self.call("post_copy_status")?;
        Err(Status::unimplemented("no post-copy here"))
    }
    async fn add_translations(
        &self,
        req: pb::TranslationsRequest,
    ) -> Result<pb::TranslationsResponse, Status> {
        self.call("add_translations")?;
        Ok(pb::TranslationsResponse {
            rules: req.flows.len() as u32,
        })
    }
    async fn remove_translations(
        &self,
        req: pb::TranslationsRequest,
    ) -> Result<pb::TranslationsResponse, Status> {
        self.call("remove_translations")?;
        Ok(pb::TranslationsResponse {
            rules: req.flows.len() as u32,
        })
    }
}

/// Links to the scripted nodes, by name.
#[derive(Debug, Default)]
struct ScriptedCluster(BTreeMap<String, Arc<ScriptedDestination>>);

#[tonic::async_trait]
impl Connector for ScriptedCluster {
    async fn connect(&self, peer: &PeerConfig) -> Result<Arc<dyn PeerLink>, Unreachable> {
        match self.0.get(&peer.name) {
            Some(d) => Ok(d.clone()),
            None => Err(Unreachable {
                node: peer.name.clone(),
                address: peer.address.to_string(),
                reason: "no scripted node".into(),
            }),
        }
    }
}

// ---- the process ----

/// A managed process holding a TCP connection to the test, echoing every
/// line; killed and reaped when dropped.
struct Echo {
    pid: i32,
    conn: BufReader<TcpStream>,
    port: PortKey,
}

impl Echo {
    fn start() -> Echo {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let script = format!(
            "exec 3<>/dev/tcp/127.0.0.1/{port}; while read -r line <&3; do echo \"$line\" >&3; done"
        );
        let pid = crate::managed::spawn(
            &["bash".into(), "-c".into(), script],
            &crate::managed::SpawnOptions::default(),
        )
        .unwrap();
        let (conn, _) = listener.accept().unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let local = tcp_connections_of(pid);
        let fd = &local.first().expect("bash holds the connection").1;
        let addr = nix::sys::socket::getsockname::<nix::sys::socket::SockaddrIn>(
            std::os::fd::AsRawFd::as_raw_fd(fd),
        )
        .unwrap();
        let mut echo = Echo {
            pid,
            conn: BufReader::new(conn),
            port: PortKey {
                transport: process::Transport::Tcp,
                port: addr.port(),
            },
        };
        echo.answers("ready");
        echo
    }

    /// Sends `line` and checks that the process echoes it.
    fn answers(&mut self, line: &str) {
        writeln!(self.conn.get_mut(), "{line}").unwrap();
        let mut back = String::new();
        self.conn.read_line(&mut back).unwrap();
        assert_eq!(back.trim_end(), line, "the process did not echo");
    }

    fn running(&self) -> bool {
        process::inspect(self.pid).is_ok_and(|i| !i.is_stopped() && i.state != 'Z')
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.pid), Signal::SIGKILL);
        let mut status = 0;
        // SAFETY: waitpid on this test's own child, with a local.
        unsafe { libc::waitpid(self.pid, &mut status, 0) };
    }
}

/// A node with `echo` under management, its port owned, and the scripted
/// CRIU and cluster.
fn rig(
    echo: &Echo,
    criu: ScriptedCriu,
    destination: Arc<ScriptedDestination>,
    node3: Arc<ScriptedDestination>,
) -> Fixture {
    let cluster = ScriptedCluster(BTreeMap::from([
        ("node1".to_owned(), destination),
        ("node3".to_owned(), node3),
    ]));
    let f = Fixture::with(PEERS, |_| Some(Arc::new(criu)), Some(Arc::new(cluster)));
    f.engine.processes.adopt(ManagedProcess {
        pid: echo.pid,
        argv: vec!["bash".into()],
        origin: Origin::Run,
        lifecycle: Lifecycle::Running,
        sockets: Default::default(),
    });
    f.engine
        .dataplane
        .table()
        .apply(&BTreeMap::from([(echo.port, PortState::Owned)]))
        .unwrap();
    f
}

/// A process under management with a scripted CRIU that dumps it and a
/// scripted destination that fails at `step`, if one is named.
fn plain_rig(step: Option<Step>) -> (Echo, Arc<ScriptedDestination>, Fixture) {
    rig_to(ScriptedDestination {
        fails: step,
        ..Default::default()
    })
}

/// A process under management with a scripted CRIU that dumps it, and
/// `destination`.
fn rig_to(destination: ScriptedDestination) -> (Echo, Arc<ScriptedDestination>, Fixture) {
    let echo = Echo::start();
    let destination = Arc::new(destination);
    let f = rig(
        &echo,
        ScriptedCriu::default(),
        destination.clone(),
        Arc::default(),
    );
    (echo, destination, f)
}

/// The last state the filter was given for `port`.
fn last_filter_state(f: &Fixture, port: PortKey) -> String {
    let calls = f.filter.0.lock().unwrap();
    calls
        .iter()
        .rev()
        .find(|c| c.contains(&port.to_string()))
        .cloned()
        .unwrap_or_default()
}

async fn migrate(f: &Fixture, pid: i32, options: MigrationOptions) -> pb::MigrationReport {
    let prepared = prepare(&f.engine, pid, "node1", options).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move { while rx.recv().await.is_some() {} });
    run(f.engine.clone(), prepared, tx).await
}

/// What an abort must leave.
fn assert_rolled_back(f: &Fixture, echo: &mut Echo, report: &pb::MigrationReport, why: &str) {
    assert_eq!(
        report.outcome,
        pb::MigrationOutcome::Aborted as i32,
        "{why}: {report:?}"
    );
    assert!(report.resumed_on_source, "{why}: {}", report.error);
    assert!(echo.running(), "{why}: the process is not running");
    for (n, fd) in tcp_connections_of(echo.pid) {
        let repair = sys::get_int(fd.as_fd(), libc::SOL_TCP, sys::TCP_REPAIR).unwrap();
        assert_eq!(repair, 0, "{why}: descriptor {n} still in repair mode");
    }
    echo.answers(&format!("after {why}"));
    let reg = f.engine.processes.registry();
    assert_eq!(
        reg.get(echo.pid).map(|p| p.lifecycle.clone()),
        Some(Lifecycle::Running),
        "{why}"
    );
    drop(reg);
    assert!(
        last_filter_state(f, echo.port).ends_with("Owned"),
        "{why}: the port was left {:?}",
        last_filter_state(f, echo.port)
    );
    assert!(
        !f.engine.dataplane.capture.is_open(&report.migration_id),
        "{why}: a capture session was left open"
    );
    assert_eq!(
        report.phases.last().map(|p| p.phase.as_str()),
        Some("abort"),
        "{why}"
    );
}

/// An in-cluster connection the destination says it restored, to a peer
/// on node3.
fn flow_to_node3() -> pb::InClusterFlow {
    pb::InClusterFlow {
        protocol: pb::Protocol::Tcp as i32,
        old_local: "198.19.0.2:40000".into(),
        new_local: "198.19.0.1:40000".into(),
        remote: "198.19.0.3:5432".into(),
    }
}

// ---- the tests ----

/// Every way a migration can fail before its commit point, in both socket
/// paths: the process runs on here, as if nothing had happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_abort_before_the_commit_leaves_the_process_running() {
    let peer_steps: &[Step] = &[
        "arm",
        "transfer_images",
        "transfer_sockets",
        "restore",
        "add_translations",
    ];
    for sockets in [SocketMigration::Iterative, SocketMigration::Collective] {
        let options = MigrationOptions {
            sockets: Some(sockets),
            ..Default::default()
        };
        for &step in peer_steps {
            if step == "transfer_sockets" && sockets == SocketMigration::Iterative {
                continue;
            }
            let why = format!("{step} fails, {}", sockets.name());
            let mut echo = Echo::start();
            let (destination, node3) = if step == "add_translations" {
                (
                    ScriptedDestination {
                        in_cluster: vec![flow_to_node3()],
                        ..Default::default()
                    },
                    ScriptedDestination {
                        fails: Some(step),
                        ..Default::default()
                    },
                )
            } else {
                (
                    ScriptedDestination {
                        fails: Some(step),
                        ..Default::default()
                    },
                    ScriptedDestination::default(),
                )
            };
            let (destination, node3) = (Arc::new(destination), Arc::new(node3));
            let f = rig(
                &echo,
                ScriptedCriu::default(),
                destination.clone(),
                node3.clone(),
            );
            let report = migrate(&f, echo.pid, options).await;
            assert_rolled_back(&f, &mut echo, &report, &why);
            assert!(
                report.error.contains(&format!("scripted: {step} fails")),
                "{why}: {}",
                report.error
            );
            assert_eq!(
                destination.calls().last().map(String::as_str),
                Some("abort"),
                "{why}"
            );
            if step == "add_translations" {
                assert_eq!(
                    node3.calls(),
                    ["add_translations", "remove_translations"],
                    "{why}: the translations were not undone"
                );
            }
        }
        for fails in [DumpFails::BeforeFreeze, DumpFails::AfterFreeze] {
            let why = format!("the dump fails ({fails:?}), {}", sockets.name());
            let mut echo = Echo::start();
            let destination = Arc::new(ScriptedDestination::default());
            let f = rig(
                &echo,
                ScriptedCriu { fails: Some(fails) },
                destination.clone(),
                Arc::default(),
            );
            let report = migrate(&f, echo.pid, options).await;
            assert_rolled_back(&f, &mut echo, &report, &why);
            assert!(
                report.error.contains("scripted:"),
                "{why}: {}",
                report.error
            );
            assert!(
                !destination.calls().contains(&"transfer_images".to_owned()),
                "{why}"
            );
        }
    }
}

/// A cancel before the restore stops the migration at the next phase that
/// checks it, the process running; once the destination restores, a
/// cancel is refused and the migration commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_stops_the_migration_until_the_restore_begins() {
    for (during, refused) in [
        ("arm", false),
        ("transfer_images", false),
        ("restore", true),
    ] {
        let (mut echo, destination, f) = plain_rig(None);
        let prepared = prepare(&f.engine, echo.pid, "node1", MigrationOptions::default())
            .await
            .unwrap();
        *destination.cancel_during.lock().unwrap() = Some((during, prepared.cancel.clone()));
        let (tx, mut rx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move { while rx.recv().await.is_some() {} });
        let report = run(f.engine.clone(), prepared, tx).await;
        let answer = destination.cancel_answer.lock().unwrap().take();
        assert_eq!(
            answer.map(|a| a.is_err()),
            Some(refused),
            "cancel during {during}"
        );
        if refused {
            assert_eq!(
                report.outcome,
                pb::MigrationOutcome::Committed as i32,
                "{report:?}"
            );
            assert!(!echo.running(), "the source copy outlived the commit");
        } else {
            let why = format!("a cancel during {during}");
            assert_rolled_back(&f, &mut echo, &report, &why);
            assert!(
                report.error.starts_with("cancelled by the test"),
                "{}",
                report.error
            );
        }
    }
}

/// Pre-copy's rounds run on the process itself (write protection injected
/// into it); a round the destination refuses rolls the migration back, and
/// no write protection outlives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_pre_copy_round_ends_the_tracking_and_resumes() {
    let (mut echo, destination, f) = plain_rig(Some("transfer_pages"));
    let options = MigrationOptions {
        strategy: Some(MemoryStrategy::PreCopy),
        ..Default::default()
    };
    let report = migrate(&f, echo.pid, options).await;
    assert_rolled_back(&f, &mut echo, &report, "a pre-copy round fails");
    assert!(
        !std::fs::read_to_string(format!("/proc/{}/maps", echo.pid))
            .unwrap()
            .contains("userfaultfd"),
        "a userfaultfd outlived the migration"
    );
    assert_eq!(
        destination.calls(),
        ["hello", "prepare", "transfer_pages", "abort"]
    );
}

/// The whole way, both socket paths: the destination hears every step in
/// order, the source copy goes, and the report names every phase and cuts
/// the freeze into its parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_commits_and_the_source_copy_goes() {
    for sockets in [SocketMigration::Iterative, SocketMigration::Collective] {
        let (echo, destination, f) = plain_rig(None);
        let options = MigrationOptions {
            sockets: Some(sockets),
            ..Default::default()
        };
        let report = migrate(&f, echo.pid, options).await;
        assert_eq!(
            report.outcome,
            pb::MigrationOutcome::Committed as i32,
            "{report:?}"
        );
        let mut want = vec!["hello", "prepare", "arm", "transfer_images"];
        if sockets == SocketMigration::Collective {
            want.push("transfer_sockets");
        }
        want.extend(["restore", "commit"]);
        let mut calls = destination.calls();
        // The states cross beside the images: either order.
        calls.sort_by_key(|c| want.iter().position(|w| w == c));
        assert_eq!(calls, want, "{}", sockets.name());
        let phases: Vec<&str> = report.phases.iter().map(|p| p.phase.as_str()).collect();
        assert_eq!(
            phases,
            [
                "prepare", "arm", "dump", "transfer", "restore", "release", "commit", "discard"
            ]
        );
        assert!(!echo.running(), "the source copy outlived the commit");
        assert!(f.engine.processes.registry().get(echo.pid).is_none());
        let parts: u64 = report.freeze_parts.iter().map(|p| p.duration_us).sum();
        assert!(report.freeze_time_us > 0 && parts > 0, "{report:?}");
    }
}

/// A destination that refuses to resume the process at the Commit (a
/// pre-copy whose page filler failed first): the source's copy, released
/// but intact, runs again here at the first refusal, and its port, released
/// too, is owned again once the peers (the destination, told of the abort)
/// say nobody owns it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_the_destination_refuses_rolls_back() {
    let (mut echo, destination, f) = rig_to(ScriptedDestination {
        refuses_commit: true,
        ..Default::default()
    });
    let report = migrate(&f, echo.pid, MigrationOptions::default()).await;
    assert_rolled_back(&f, &mut echo, &report, "the commit refused");
    assert!(report.error.contains("not resumed"), "{}", report.error);
    let calls = destination.calls();
    assert_eq!(
        calls.iter().filter(|c| *c == "commit").count(),
        1,
        "{calls:?}"
    );
    assert_eq!(calls.last().map(String::as_str), Some("abort"));
}

/// A destination that refuses in Prepare leaves the process as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_in_prepare_leaves_no_trace() {
    let (mut echo, destination, f) = plain_rig(Some("prepare"));
    let err = prepare(&f.engine, echo.pid, "node1", MigrationOptions::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    assert_eq!(destination.calls(), ["hello", "prepare"]);
    assert_eq!(
        f.engine
            .processes
            .registry()
            .get(echo.pid)
            .map(|p| p.lifecycle.clone()),
        Some(Lifecycle::Running)
    );
    echo.answers("still here");
}
