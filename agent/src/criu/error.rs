use std::path::PathBuf;

/// What can go wrong when ferry runs CRIU.
#[derive(Debug, thiserror::Error)]
pub enum CriuError {
    #[error("CRIU not found at {path} (run `cargo xtask setup`, or set criu_path in the config)")]
    NotFound { path: PathBuf },
    #[error(
        "CRIU at {path} is version {found}, ferry needs >= {required} (run `cargo xtask setup`)"
    )]
    TooOld {
        path: PathBuf,
        found: String,
        required: String,
    },
    #[error(
        "CRIU at {path} lacks ferry's patch for {what} (run `cargo xtask setup`, which builds \
         CRIU with ferry's patches)"
    )]
    Unpatched { path: PathBuf, what: &'static str },
    #[error("cannot tell the version of CRIU at {path}: {reason}")]
    UnknownVersion { path: PathBuf, reason: String },
    #[error("cannot start CRIU at {path}: {source}")]
    Spawn {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("CRIU RPC failed: {0}")]
    Rpc(String),
    #[error("CRIU {operation} failed: {reason}")]
    Failed {
        operation: &'static str,
        /// CRIU's own message, or the error lines of its log.
        reason: String,
    },
    #[error("CRIU's cache directory {path}: {reason}")]
    CacheDir { path: PathBuf, reason: String },
    #[error("I/O on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}
