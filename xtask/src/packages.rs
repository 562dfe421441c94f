//! Debian packages the project needs.

use std::process::Command;

use anyhow::{Result, bail};

use crate::cmd;

/// Build and test tools, and CRIU's build dependencies for `make criu`
/// (the subset of its source package's Build-Depends that the binary
/// needs; the documentation and Python tooling are left out).
pub const PACKAGES: &[&str] = &[
    // eBPF programs, protobuf code generation, namespaces
    "clang",
    "llvm",
    "libbpf-dev",
    "iproute2",
    "protobuf-compiler",
    "pkgconf",
    "build-essential",
    "util-linux",
    // fetching and checking CRIU's source package
    "dpkg-dev",
    "xz-utils",
    // CRIU's build dependencies
    "libbsd-dev",
    "libcap-dev",
    "libgnutls28-dev",
    "libnet1-dev",
    "libnftables-dev",
    "libnl-3-dev",
    "libprotobuf-c-dev",
    "libprotobuf-dev",
    "protobuf-c-compiler",
    "python3-protobuf",
    "uuid-dev",
    "libaio-dev",
    // 32-bit compel support: CRIU then also checkpoints ia32 processes
    // (CONFIG_COMPAT), as the CRIU verified on these machines does.
    "gcc-multilib",
];

pub fn is_installed(pkg: &str) -> bool {
    cmd::output(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]))
        .map(|o| {
            o.status.success()
                && String::from_utf8_lossy(&o.stdout).contains("install ok installed")
        })
        .unwrap_or(false)
}

pub fn missing() -> Vec<&'static str> {
    PACKAGES
        .iter()
        .copied()
        .filter(|p| !is_installed(p))
        .collect()
}

/// Installs the missing packages; returns (installed, already there).
pub fn ensure() -> Result<(Vec<&'static str>, usize)> {
    let missing = missing();
    let present = PACKAGES.len() - missing.len();
    if missing.is_empty() {
        return Ok((missing, present));
    }
    eprintln!(
        "installing {} Debian package(s): {}",
        missing.len(),
        missing.join(" ")
    );
    cmd::run(Command::new("apt-get").args(["update", "-q"]))?;
    let mut install = Command::new("apt-get");
    install
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive");
    if let Err(e) = cmd::run(&mut install) {
        bail!("could not install {}: {e:#}", missing.join(" "));
    }
    let still = crate::packages::missing();
    if !still.is_empty() {
        bail!(
            "apt-get reported success but these are still missing: {}",
            still.join(" ")
        );
    }
    Ok((missing, present))
}
