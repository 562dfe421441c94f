//! Where the binaries under test are.

use std::path::PathBuf;

/// Where `cargo xtask setup` installs CRIU.
pub const DEFAULT_CRIU_PATH: &str = "/opt/ferry/criu/bin/criu";

/// The workspace root (this crate's parent directory).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the integration crate lives inside the workspace")
        .to_owned()
}

/// `$FERRY_BIN_DIR`, else the workspace's `target/debug`.
pub fn bin_dir() -> PathBuf {
    match std::env::var_os("FERRY_BIN_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => workspace_root().join("target").join("debug"),
    }
}

/// A binary of the workspace (`ferryd`, `ferry`, `ferry-echo-server`). Tests
/// of this crate can also use `env!("CARGO_BIN_EXE_ferry-echo-server")`.
pub fn bin_path(name: &str) -> PathBuf {
    bin_dir().join(name)
}

/// `$FERRY_CRIU`, else [`DEFAULT_CRIU_PATH`].
pub fn criu_path() -> PathBuf {
    match std::env::var_os("FERRY_CRIU") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(DEFAULT_CRIU_PATH),
    }
}
