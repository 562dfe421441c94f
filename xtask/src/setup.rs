//! `cargo xtask setup`: idempotent setup of a Debian 12 machine.

use std::path::Path;

use anyhow::{Result, bail};

use crate::{cmd, criu, packages};

/// Whether a full setup is needed (cheap: dpkg-query and criu --version).
pub fn needed() -> bool {
    !packages::missing().is_empty() || criu::installed_ok().is_none()
}

pub fn run() -> Result<()> {
    if !cmd::is_root() {
        bail!("setup installs packages and builds CRIU into /opt: run it as root");
    }
    if !Path::new("/etc/debian_version").exists() {
        bail!("setup knows Debian's packages only (no /etc/debian_version here)");
    }
    let mut summary = Vec::new();
    let (installed, present) = packages::ensure()?;
    summary.push(if installed.is_empty() {
        format!("packages: skipped, all {present} already installed")
    } else {
        format!(
            "packages: installed {} ({}); {present} already there",
            installed.len(),
            installed.join(" ")
        )
    });
    summary.push(format!("criu: {}", criu::ensure()?));
    for (what, path) in [
        ("BTF", "/sys/kernel/btf/vmlinux"),
        ("unshare", "/usr/bin/unshare"),
        ("nsenter", "/usr/bin/nsenter"),
    ] {
        if Path::new(path).exists() {
            summary.push(format!("{what}: ok ({path})"));
        } else {
            summary.push(format!("{what}: WARNING, {path} missing"));
        }
    }
    eprintln!("\nsetup summary:");
    for line in summary {
        eprintln!("  {line}");
    }
    Ok(())
}
