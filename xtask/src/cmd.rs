//! Running commands with a readable trace and errors that name the command.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use anyhow::{Context, Result, bail};

pub fn describe(cmd: &Command) -> String {
    let mut s = String::new();
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            s.push_str(&format!("{}={} ", k.to_string_lossy(), v.to_string_lossy()));
        }
    }
    s.push_str(&cmd.get_program().to_string_lossy());
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs with inherited stdout/stderr; fails on a non-zero exit. Stdin is
/// closed: CI runs us without one, and nothing we start may wait on a prompt.
pub fn run(cmd: &mut Command) -> Result<()> {
    let what = describe(cmd);
    eprintln!("+ {what}");
    let status = cmd
        .stdin(Stdio::null())
        .status()
        .with_context(|| format!("starting `{what}`"))?;
    if !status.success() {
        bail!("`{what}` failed ({status})");
    }
    Ok(())
}

/// Runs capturing output, whatever the exit status.
pub fn output(cmd: &mut Command) -> Result<Output> {
    let what = describe(cmd);
    cmd.stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting `{what}`"))
}

/// The workspace root (xtask lives one level below it).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask has a parent directory")
        .to_owned()
}

/// Where cargo puts debug binaries: honours CARGO_TARGET_DIR, which the
/// nested cargo invocations inherit.
pub fn debug_dir() -> PathBuf {
    target_dir().join("debug")
}

/// Where cargo puts release binaries (the build users deploy).
pub fn release_dir() -> PathBuf {
    target_dir().join("release")
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|p| {
            if p.is_absolute() {
                p
            } else {
                workspace_root().join(p)
            }
        })
        .unwrap_or_else(|| workspace_root().join("target"))
}

pub fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(workspace_root());
    c
}

/// Effective uid 0, read from /proc so xtask needs no libc binding.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// Whether an executable called `name` is on PATH.
pub fn on_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The benchmarks' crate: root only and not a default member, like the
/// integration crate whose harness it uses.
pub const BENCH_CRATE: &str = "ferry-bench";
