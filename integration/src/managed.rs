//! Driving an agent's managed processes through its Control API, as tests
//! do: start a command, wait until the agent lists it in some state,
//! migrate it and collect the report.

use std::time::{Duration, Instant};

use ferry_proto::v1::control_client::ControlClient;
use ferry_proto::v1::{
    ListProcessesRequest, ManagedProcess, MigrateRequest, MigrationEvent, MigrationOutcome,
    MigrationProgress, MigrationReport, RunProcessRequest, Strategy, migration_event,
};
use tonic::transport::Channel;

/// How long [`wait_for_process`] waits.
pub const PROCESS_WAIT: Duration = Duration::from_secs(10);

/// `RunProcess`: starts `argv` under the agent's management.
pub async fn run(control: &mut ControlClient<Channel>, argv: Vec<String>) -> i32 {
    control
        .run_process(RunProcessRequest {
            argv,
            ..Default::default()
        })
        .await
        .expect("RunProcess")
        .into_inner()
        .pid
}

/// `RunProcess` as `user` (`ferry run --user`), with an IPC namespace of
/// its own if `ipc_namespace` (`--ipc-namespace`: what a server with
/// System V shared memory needs).
pub async fn run_as(
    control: &mut ControlClient<Channel>,
    argv: Vec<String>,
    user: &str,
    ipc_namespace: bool,
) -> i32 {
    control
        .run_process(RunProcessRequest {
            argv,
            user: user.to_owned(),
            ipc_namespace,
            ..Default::default()
        })
        .await
        .expect("RunProcess")
        .into_inner()
        .pid
}

/// The agent's managed processes.
pub async fn list(control: &mut ControlClient<Channel>) -> Vec<ManagedProcess> {
    control
        .list_processes(ListProcessesRequest::default())
        .await
        .expect("ListProcesses")
        .into_inner()
        .processes
}

/// Waits (up to [`PROCESS_WAIT`]) until the agent lists `pid` in a state
/// `ok` accepts, and returns that listing; panics with what it saw
/// otherwise.
pub async fn wait_for_process(
    control: &mut ControlClient<Channel>,
    pid: i32,
    ok: impl Fn(&ManagedProcess) -> bool,
) -> ManagedProcess {
    wait_for_process_within(control, pid, PROCESS_WAIT, ok).await
}

/// [`wait_for_process`], up to `within`.
pub async fn wait_for_process_within(
    control: &mut ControlClient<Channel>,
    pid: i32,
    within: Duration,
    ok: impl Fn(&ManagedProcess) -> bool,
) -> ManagedProcess {
    let deadline = Instant::now() + within;
    loop {
        let procs = list(control).await;
        if let Some(p) = procs.iter().find(|p| p.pid == pid && ok(p)) {
            return p.clone();
        }
        assert!(
            Instant::now() < deadline,
            "PID {pid} never reached the expected state: {procs:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs a migration to its end: (final report, the stream's final error
/// status if the migration did not commit).
pub async fn migrate(
    control: &mut ControlClient<Channel>,
    pid: i32,
    to: &str,
) -> Result<(MigrationReport, Option<tonic::Status>), tonic::Status> {
    migrate_with(
        control,
        pid,
        to,
        ferry_proto::v1::SocketMigration::Unspecified,
    )
    .await
}

/// [`migrate`], moving the TCP connections the way `sockets` says
/// (Unspecified: the agent's default).
pub async fn migrate_with(
    control: &mut ControlClient<Channel>,
    pid: i32,
    to: &str,
    sockets: ferry_proto::v1::SocketMigration,
) -> Result<(MigrationReport, Option<tonic::Status>), tonic::Status> {
    migrate_request(
        control,
        MigrateRequest {
            pid,
            destination_node: to.into(),
            strategy: Strategy::TotalCopy as i32,
            sockets: sockets as i32,
            ..Default::default()
        },
    )
    .await
}

/// [`migrate`] with a whole request (strategy, pre-copy bounds...).
pub async fn migrate_request(
    control: &mut ControlClient<Channel>,
    request: MigrateRequest,
) -> Result<(MigrationReport, Option<tonic::Status>), tonic::Status> {
    let (report, status) = follow_migration(control, request).await?;
    let why = if status.is_some() { "failed" } else { "ended" };
    let report = report.unwrap_or_else(|| panic!("stream {why} without a report"));
    Ok((report, status))
}

/// A migration's stream to its end, whatever it brings: its report if one
/// came (none if the agent died, say), and the error status it ended
/// with, if any.
pub async fn follow_migration(
    control: &mut ControlClient<Channel>,
    request: MigrateRequest,
) -> Result<(Option<MigrationReport>, Option<tonic::Status>), tonic::Status> {
    let mut stream = control.migrate(request).await?.into_inner();
    let mut report = None;
    loop {
        match stream.message().await {
            Ok(Some(ev)) => {
                if let Some(migration_event::Event::Report(r)) = ev.event {
                    report = Some(r);
                }
            }
            Ok(None) => return Ok((report, None)),
            Err(s) => return Ok((report, Some(s))),
        }
    }
}

/// [`migrate_request`] that must commit: its report; panics with the
/// report and the stream's status if it did not (outcome included).
pub async fn migrate_committed(
    control: &mut ControlClient<Channel>,
    request: MigrateRequest,
) -> MigrationReport {
    let (report, status) = migrate_request(control, request)
        .await
        .expect("the migration starts");
    assert!(status.is_none(), "did not commit: {status:?} {report:#?}");
    assert_eq!(
        report.outcome,
        MigrationOutcome::Committed as i32,
        "{report:#?}"
    );
    report
}

/// What a migration with a fault injected came to.
pub struct Faulted {
    pub report: MigrationReport,
    /// The status the migration's stream ended with (`None`: cleanly).
    pub status: Option<tonic::Status>,
}

/// Follows a migration's events to its end and runs `fault` once, at the
/// first progress event `at` accepts (a phase, a round). Panics if the
/// migration outlives `within`, ends before the fault or without a report.
pub async fn follow_with_fault(
    stream: &mut tonic::Streaming<MigrationEvent>,
    within: Duration,
    at: impl Fn(&MigrationProgress) -> bool,
    fault: impl AsyncFnOnce(),
) -> Faulted {
    let (mut report, mut status, mut fault) = (None, None, Some(fault));
    let followed = tokio::time::timeout(within, async {
        loop {
            match stream.message().await {
                Ok(Some(ev)) => match ev.event {
                    Some(migration_event::Event::Progress(p)) if fault.is_some() && at(&p) => {
                        (fault.take().expect("checked"))().await;
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
    })
    .await;
    assert!(
        followed.is_ok(),
        "the migration still runs after {within:?}"
    );
    assert!(fault.is_none(), "the migration ended before the fault");
    Faulted {
        report: report.expect("a report"),
        status,
    }
}

/// Reads a server stream to its end; returns the status it ended with,
/// None for a clean end.
pub async fn stream_end<T>(stream: &mut tonic::Streaming<T>) -> Option<tonic::Status> {
    loop {
        match stream.message().await {
            Ok(Some(_)) => {}
            Ok(None) => return None,
            Err(s) => return Some(s),
        }
    }
}

/// `/proc/PID/stat`'s state letter, None if there is no such process.
pub fn process_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .next()?
        .chars()
        .next()
}

/// The nice value of `pid` (/proc/PID/stat's 19th field), None if there is
/// no such process.
pub fn nice_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 3 (the state) is the first after the command's name.
    stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .nth(16)?
        .parse()
        .ok()
}

/// Waits until `pid` no longer exists (killed and reaped by its parent,
/// which may take a moment after the kill); panics after 5 s.
pub fn wait_until_gone(pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while let Some(state) = process_state(pid) {
        assert!(
            Instant::now() < deadline,
            "PID {pid} still exists (state {state}) 5 s on"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The runtime the tests drive agents with: two workers, like the machine.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// The node's data plane: counters, port states, in-cluster rules.
pub async fn data_plane(control: &mut ControlClient<Channel>) -> ferry_proto::v1::DataPlane {
    control
        .get_data_plane(ferry_proto::v1::GetDataPlaneRequest::default())
        .await
        .expect("GetDataPlane")
        .into_inner()
}
