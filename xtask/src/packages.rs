//! Debian packages the project needs.

use std::process::Command;

use anyhow::{Result, bail};

use crate::cmd;

/// Build and test tools, and CRIU's build dependencies for `make criu`
/// (the subset of its source package's Build-Depends that the binary
/// needs; the documentation tools are left out).
pub const PACKAGES: &[&str] = &[
    // eBPF programs (C, clang + libbpf headers), protobuf code generation
    "clang",
    "llvm",
    "libbpf-dev",
    "protobuf-compiler",
    "pkgconf",
    "build-essential",
    // namespaces and links for the test cluster (ip, unshare, nsenter)
    "iproute2",
    "util-linux",
    // fetching and checking CRIU's source package
    "dpkg-dev",
    "xz-utils",
    // applying ferry's patch to CRIU (xtask/criu/)
    "patch",
    // watching the demo's nodes side by side
    "tmux",
    // the PostgreSQL server and psql for the test that migrates a process
    // holding a database session (integration/src/postgres.rs,
    // integration/tests/postgres_session.rs). The tests start their own
    // server in a namespace; the package's own cluster is not needed.
    "postgresql",
    "postgresql-client",
    // the Prometheus server that scrapes the agents' /metrics in the
    // observability test (integration/src/prometheus.rs); the test starts
    // its own in a namespace, the package's service is not needed.
    "prometheus",
    // Redis, the in-memory database whose data set moves with it in the
    // memory strategies' test (integration/tests/redis.rs); the test runs
    // its own server under ferry, the package's service is not needed.
    "redis-server",
    "redis-tools",
    // nginx, the server whose workers drop root (master as root, workers
    // as www-data) in the test that moves such a tree
    // (integration/tests/privileges.rs); the test runs its own under
    // ferry, the package's service is not needed.
    "nginx",
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

/// Splits `pkgs` into (installed, missing) with a single dpkg-query call, so
/// the "is setup needed?" check before every test run stays fast.
pub fn status<'a>(pkgs: &[&'a str]) -> (Vec<&'a str>, Vec<&'a str>) {
    // dpkg-query exits non-zero when some name is unknown but still prints
    // the known ones, so its exit status is not looked at.
    let out = cmd::output(
        Command::new("dpkg-query")
            .args(["-W", "-f=${Package} ${Status}\n"])
            .args(pkgs),
    );
    let text = out
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    pkgs.iter().partition(|p| installed_in(&text, p))
}

/// Whether a `${Package} ${Status}` listing shows `pkg` installed (a
/// multi-arch package may have several lines; any installed one counts).
fn installed_in(listing: &str, pkg: &str) -> bool {
    listing.lines().any(|l| {
        l.split_once(' ')
            .is_some_and(|(name, status)| name == pkg && status.trim() == "install ok installed")
    })
}

pub fn missing() -> Vec<&'static str> {
    status(PACKAGES).1
}

/// What `ensure` did.
#[derive(Debug)]
pub struct Outcome {
    pub installed: Vec<&'static str>,
    pub present: Vec<&'static str>,
}

/// Installs the missing packages; `apt-get update` runs only when something
/// is missing, so a set-up machine needs no network here.
pub fn ensure() -> Result<Outcome> {
    let (present, missing) = status(PACKAGES);
    eprintln!(
        "Debian packages already installed ({}): {}",
        present.len(),
        present.join(" ")
    );
    if missing.is_empty() {
        return Ok(Outcome {
            installed: missing,
            present,
        });
    }
    eprintln!(
        "Debian packages to install ({}): {}",
        missing.len(),
        missing.join(" ")
    );
    if let Err(e) = cmd::run(Command::new("apt-get").args(["update", "-q"])) {
        bail!(
            "apt-get update failed, so could not install {}: {e:#}",
            missing.join(" ")
        );
    }
    let mut install = Command::new("apt-get");
    install
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-q"])
        .args(&missing);
    let result = cmd::run(&mut install);
    // Name exactly what is still absent, whatever apt-get said.
    let still = status(&missing).1;
    match result {
        Err(e) => bail!("could not install {}: {e:#}", still.join(" ")),
        Ok(()) if !still.is_empty() => bail!(
            "apt-get reported success but these are still not installed: {}",
            still.join(" ")
        ),
        Ok(()) => Ok(Outcome {
            installed: missing,
            present,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_dpkg_query_listing() {
        let listing = "clang install ok installed\n\
                       libbsd-dev deinstall ok config-files\n\
                       libaio-dev install ok installed\n\
                       libaio-dev install ok installed\n";
        assert!(installed_in(listing, "clang"));
        assert!(!installed_in(listing, "libbsd-dev"));
        assert!(installed_in(listing, "libaio-dev"));
        assert!(!installed_in(listing, "tmux"));
        assert!(!installed_in(listing, "clan"));
    }
}
