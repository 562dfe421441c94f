//! Why a migration could not start or did not commit, and the gRPC status
//! each reason maps to.

use crate::criu::CriuError;
use crate::dataplane::{DataPlaneError, FlowError};
use crate::process::ProcessError;

/// Why a migration could not start or did not commit.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("no node named {name:?} (known: {known})")]
    UnknownNode { name: String, known: String },
    #[error("{node:?} is this node: name another node as the destination")]
    DestinationIsSelf { node: String },
    #[error("no process with PID {pid} on {node}")]
    NoSuchProcess { pid: i32, node: String },
    #[error(
        "{what} needs {feature}, which {node} lacks (kernel {kernel}; `ferryd --check` there lists what it has)"
    )]
    FeatureMissing {
        what: String,
        feature: String,
        node: String,
        kernel: String,
    },
    #[error("PID {pid} cannot be migrated: {reason}")]
    NotMigratable { pid: i32, reason: String },
    #[error(
        "{node} lacks the cluster's public address {missing}, which this node carries ({node} has {theirs}); every node needs the same [public] addresses"
    )]
    PublicAddressMissing {
        node: String,
        missing: String,
        theirs: String,
    },
    #[error("PID {pid} is already being migrated (migration {migration_id})")]
    AlreadyMigrating { pid: i32, migration_id: String },
    #[error("{node} is already receiving migration {migration_id} from {from}; one at a time")]
    DestinationBusy {
        node: String,
        migration_id: String,
        from: String,
    },
    #[error("{node} cannot hold the process: {detail}")]
    NoRoom { node: String, detail: String },
    /// A Prepare that comes after its source gave the migration up (its
    /// Abort overtook it).
    #[error("migration {migration_id} was given up by its source before {node} prepared it")]
    GivenUp { node: String, migration_id: String },
    #[error("port {port} is already owned on {node} by PID {pid}")]
    PortTaken {
        port: String,
        node: String,
        pid: i32,
    },
    #[error(
        "{node} speaks peer protocol versions {theirs:?}, this agent {ours:?}: no common version"
    )]
    NoCommonVersion {
        node: String,
        theirs: Vec<u32>,
        ours: Vec<u32>,
    },
    #[error("no migration {migration_id:?} here")]
    UnknownMigration { migration_id: String },
    #[error("migration {migration_id} is {state}, not ready for {step}")]
    WrongState {
        migration_id: String,
        state: &'static str,
        step: &'static str,
    },
    #[error("bad image stream: {0}")]
    BadImage(String),
    #[error("migration_id: {migration_id} comes from {from:?}, not {caller:?}")]
    NotItsSource {
        migration_id: String,
        from: String,
        caller: String,
    },
    #[error("{field}: {reason}")]
    InvalidField { field: &'static str, reason: String },
    #[error("{node} unreachable{}: {reason}", at_address(.address))]
    PeerUnavailable {
        node: String,
        address: String,
        reason: String,
    },
    #[error("{node}: {message}")]
    Peer {
        node: String,
        code: tonic::Code,
        message: String,
    },
    #[error(transparent)]
    Criu(#[from] CriuError),
    #[error(transparent)]
    Process(#[from] ProcessError),
    #[error(transparent)]
    DataPlane(#[from] DataPlaneError),
    #[error("in-cluster connections: {0}")]
    InCluster(FlowError),
    #[error("TCP connections: {0}")]
    Sockets(#[from] crate::sockstate::SockStateError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    /// A host setting the migration needs is missing (post-copy's
    /// `fs.pipe-max-size`, say).
    #[error("{0}")]
    HostSetting(String),
    /// Post-copy: the pages could not follow (the lazy-pages daemon
    /// failed) before the process resumed; it was not resumed.
    #[error("post-copy: {0}")]
    PostCopy(String),
    /// The Commit found the restored copy without its memory (its page
    /// filler failed before the resume): it was not resumed.
    #[error("not resumed: {0}")]
    NotResumed(String),
    /// Stopped by `Control.CancelMigration` before the restore.
    #[error("cancelled by {by}")]
    Cancelled { by: String },
    /// A cordoned node takes no incoming migration or new process.
    #[error("{node} is cordoned: it takes no new processes (`ferry cordon --off {node}` lifts it)")]
    Cordoned { node: String },
    /// CRIU's lazy-pages protocol on a post-copy's page tunnel broke.
    #[error("lazy pages: {0}")]
    LazyPages(String),
    /// A post-copy's page tunnel between the agents broke.
    #[error("{0}")]
    PageTunnel(String),
    /// The pages pre-copied to this node are not what a step needs.
    #[error("{0}")]
    PageStore(String),
    /// The page filler (pages left out of a pre-copy's dump) could not
    /// start or failed.
    #[error(transparent)]
    Fill(#[from] crate::fill::FillError),
    /// The dump's images could not be read as they must be.
    #[error("{what}: {source}")]
    Image {
        what: &'static str,
        #[source]
        source: ferry_criu_image::ImageError,
    },
    /// The dump's images are not what ferryd wrote or expects.
    #[error("{0}")]
    Images(String),
    /// Dirty-page tracking failed.
    #[error("{what}: {source}")]
    Tracking {
        what: &'static str,
        #[source]
        source: crate::memtrack::TrackError,
    },
    /// The receiving end of a stream of images or pages went away.
    #[error("{0} stream closed by the sender")]
    StreamClosed(&'static str),
    /// A process the rollback resumes did not run again.
    #[error("{0}")]
    Resume(String),
    /// A task of the migration (a blocking step on tokio's pool, or a
    /// step spawned so that it finishes even if its caller goes) panicked
    /// or was cancelled before it answered.
    #[error("{what}: the task ended without an answer: {source}")]
    Task {
        what: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
    /// This node cannot record where a migration stands (its journal):
    /// it goes no further, since a restart could not settle it.
    #[error("the migration journal: {0}")]
    Journal(#[from] super::journal::JournalError),
    /// The destination did not say whether it committed; the copy here
    /// stays stopped until it does.
    #[error("{0}")]
    InDoubt(String),
    #[error("{0}")]
    Internal(String),
}

impl From<crate::cluster::Unreachable> for EngineError {
    fn from(e: crate::cluster::Unreachable) -> Self {
        EngineError::PeerUnavailable {
            node: e.node,
            address: e.address,
            reason: e.reason,
        }
    }
}

impl From<crate::cordon::Cordoned> for EngineError {
    fn from(e: crate::cordon::Cordoned) -> Self {
        EngineError::Cordoned { node: e.node }
    }
}

impl From<crate::ports::PortTaken> for EngineError {
    fn from(e: crate::ports::PortTaken) -> Self {
        EngineError::PortTaken {
            port: e.port,
            node: e.node,
            pid: e.pid,
        }
    }
}

impl From<crate::ports::PortsError> for EngineError {
    fn from(e: crate::ports::PortsError) -> Self {
        match e {
            crate::ports::PortsError::DataPlane(e) => EngineError::DataPlane(e),
            crate::ports::PortsError::Task { what, source } => EngineError::Task { what, source },
        }
    }
}

impl From<FlowError> for EngineError {
    /// A request's bad field and a map update that failed say so as
    /// themselves; the rest is about the in-cluster connections.
    fn from(e: FlowError) -> Self {
        match e {
            FlowError::InvalidField { field, reason } => {
                EngineError::InvalidField { field, reason }
            }
            FlowError::DataPlane(e) => EngineError::DataPlane(e),
            e => EngineError::InCluster(e),
        }
    }
}

impl From<crate::process::BadPort> for EngineError {
    fn from(e: crate::process::BadPort) -> Self {
        EngineError::InvalidField {
            field: "ports",
            reason: e.to_string(),
        }
    }
}

impl EngineError {
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| EngineError::Io { what, source }
    }

    /// The gRPC status code a caller should see.
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            EngineError::UnknownNode { .. }
            | EngineError::NoSuchProcess { .. }
            | EngineError::UnknownMigration { .. } => Code::NotFound,
            EngineError::DestinationIsSelf { .. }
            | EngineError::BadImage(_)
            | EngineError::InvalidField { .. } => Code::InvalidArgument,
            EngineError::NotMigratable { .. }
            | EngineError::AlreadyMigrating { .. }
            | EngineError::PortTaken { .. }
            | EngineError::NoCommonVersion { .. }
            | EngineError::WrongState { .. }
            | EngineError::HostSetting(_)
            | EngineError::PostCopy(_)
            | EngineError::NotResumed(_)
            | EngineError::Journal(_) => Code::FailedPrecondition,
            EngineError::InDoubt(_) => Code::Unavailable,
            EngineError::DestinationBusy { .. } | EngineError::NoRoom { .. } => {
                Code::ResourceExhausted
            }
            EngineError::Cancelled { .. } => Code::Cancelled,
            EngineError::GivenUp { .. } => Code::Aborted,
            EngineError::Cordoned { .. }
            | EngineError::FeatureMissing { .. }
            | EngineError::PublicAddressMissing { .. } => Code::FailedPrecondition,
            EngineError::NotItsSource { .. } => Code::PermissionDenied,
            EngineError::InCluster(FlowError::BadFlow { .. }) => Code::InvalidArgument,
            EngineError::InCluster(
                FlowError::PeerOnDestination { .. } | FlowError::PeerOnSource { .. },
            ) => Code::FailedPrecondition,
            EngineError::InCluster(FlowError::Images(_) | FlowError::DataPlane(_)) => {
                Code::Internal
            }
            EngineError::InCluster(FlowError::InvalidField { .. }) => Code::InvalidArgument,
            EngineError::Sockets(
                crate::sockstate::SockStateError::Invalid { .. }
                | crate::sockstate::SockStateError::InvalidPacked { .. },
            ) => Code::InvalidArgument,
            EngineError::Sockets(crate::sockstate::SockStateError::NotEstablished { .. }) => {
                Code::Aborted
            }
            EngineError::Sockets(_) => Code::Internal,
            EngineError::PeerUnavailable { .. } => Code::Unavailable,
            EngineError::Peer { code, .. } => *code,
            EngineError::Criu(
                CriuError::NotFound { .. } | CriuError::TooOld { .. } | CriuError::Unpatched { .. },
            ) => Code::FailedPrecondition,
            EngineError::Criu(CriuError::Failed { .. }) => Code::Aborted,
            EngineError::Process(ProcessError::NotFound { .. }) => Code::NotFound,
            EngineError::Criu(_)
            | EngineError::Process(_)
            | EngineError::DataPlane(_)
            | EngineError::Io { .. }
            | EngineError::Task { .. }
            | EngineError::LazyPages(_)
            | EngineError::PageTunnel(_)
            | EngineError::PageStore(_)
            | EngineError::Fill(_)
            | EngineError::Image { .. }
            | EngineError::Images(_)
            | EngineError::Tracking { .. }
            | EngineError::StreamClosed(_)
            | EngineError::Resume(_)
            | EngineError::Internal(_) => Code::Internal,
        }
    }
}

impl From<EngineError> for tonic::Status {
    fn from(e: EngineError) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

/// Runs blocking work (CRIU, procfs, netlink, BPF maps) on tokio's blocking
/// pool; `what` names it if the task dies instead of answering.
pub async fn blocking<T: Send + 'static>(
    what: &'static str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, EngineError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|source| EngineError::Task { what, source })
}

/// " at ADDRESS", or nothing when the address is not known (a call on an
/// open connection that broke).
fn at_address(address: &str) -> String {
    if address.is_empty() {
        String::new()
    } else {
        format!(" at {address}")
    }
}
