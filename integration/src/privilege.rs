//! Deciding whether the privileged tests can run here.

use std::path::Path;
use std::process::{Command, Stdio};

/// Whether this process runs as root.
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Why this process cannot build namespace clusters, if it cannot.
pub fn skip_reason() -> Option<String> {
    if !is_root() {
        return Some("needs root (network namespaces, tmpfs mounts, eBPF)".into());
    }
    let ip_works = Command::new("ip")
        .arg("-V")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ip_works {
        return Some("needs iproute2's `ip` on PATH".into());
    }
    if !Path::new("/proc/thread-self/ns/net").exists() {
        return Some("needs network namespaces (/proc/thread-self/ns/net)".into());
    }
    let criu = crate::paths::criu_path();
    if !criu.is_file() {
        return Some(format!(
            "needs CRIU at {} (cargo xtask setup builds it)",
            criu.display()
        ));
    }
    None
}

/// For the first line of a privileged test: false when it cannot run
/// here, after saying why; under `cargo xtask test` it fails instead
/// (`ferry_testkit::skip`).
///
/// ```no_run
/// if !ferry_integration::can_run("harness::flooding") { return; }
/// ```
pub fn can_run(test: &str) -> bool {
    !ferry_testkit::skip(test, skip_reason())
}
