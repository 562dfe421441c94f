//! `cargo xtask test` and `cargo xtask integration`, and the setup-if-needed
//! and build steps `demo` shares.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use crate::{cmd, criu, grpcurl, setup};

pub fn header(s: &str) {
    eprintln!("\n==== {s} ====");
}

/// Full setup only when the fast check finds something missing.
pub fn ensure_setup(criu_prefix: &Path) -> Result<()> {
    if setup::needed(criu_prefix) {
        header("setup (something is missing)");
        setup::run(criu_prefix).context("step `setup` failed")?;
    }
    Ok(())
}

/// Builds every binary the tests and the demo start: the agent's and the
/// root-only integration crate's workloads (it is not a default member,
/// hence --workspace). Not the benchmarks, which nothing here runs: their
/// crate is compiled and its unit tests run by [`unit`], and `cargo xtask
/// bench` builds its binaries (`crate::bench::build`).
pub fn build() -> Result<()> {
    let args = [
        "build",
        "--workspace",
        "--exclude",
        cmd::BENCH_CRATE,
        "--bins",
    ];
    header(&format!("build: cargo {}", args.join(" ")));
    cmd::run(cmd::cargo().args(args)).context("step `build` failed")?;
    // The handoff library's C ABI (libferry_handoff.a/.so): a library
    // built only as another crate's dependency is built as an rlib.
    let lib = ["build", "-p", "ferry-handoff"];
    header(&format!("build: cargo {}", lib.join(" ")));
    cmd::run(cmd::cargo().args(lib)).context("step `build` (the handoff library) failed")
}

/// Where the integration tests and the demo find ferry's binaries and CRIU.
pub fn ferry_env(c: &mut Command, criu_prefix: &Path) {
    c.env("FERRY_BIN_DIR", cmd::debug_dir())
        .env("FERRY_CRIU", criu::binary(criu_prefix))
        .env("FERRY_GRPCURL", grpcurl::binary());
}

/// A test that cannot run here (not root, no CRIU, a tool missing) fails
/// unless `allow_skip` (`ferry_testkit::skip`): a run on a machine that
/// cannot run the privileged tests must not pass by skipping them.
fn must_run(c: &mut Command, allow_skip: bool) {
    if !allow_skip {
        c.env(ferry_testkit::MUST_RUN, "1");
    }
}

/// Stops before anything is built when the privileged tests cannot run
/// at all here, unless skipping is allowed.
fn check_can_run(allow_skip: bool) -> Result<()> {
    if !allow_skip && !cmd::is_root() {
        anyhow::bail!(
            "the tests need root (network namespaces, CRIU, eBPF); `--allow-skip` runs what can run and skips the rest"
        );
    }
    Ok(())
}

/// The default members' tests and the bench crate's (its CSV reading and
/// statistics: no root needed, and this keeps the benchmarks compiling in
/// CI); the integration crate's are run apart, by [`integration`].
pub fn unit(allow_skip: bool) -> Result<()> {
    let args = ["test", "--workspace", "--exclude", "ferry-integration"];
    header(&format!("unit tests: cargo {}", args.join(" ")));
    let mut c = cmd::cargo();
    c.args(args);
    must_run(&mut c, allow_skip);
    cmd::run(&mut c).context("step `unit tests` failed")
}

/// The integration tests need root, network namespaces and CRIU, and share
/// host-wide state (namespace names, /run), so they run one at a time.
pub fn integration(criu_prefix: &Path, allow_skip: bool, args: &[String]) -> Result<()> {
    header("integration tests: cargo test -p ferry-integration (one at a time)");
    let mut c = cmd::cargo();
    c.args(["test", "-p", "ferry-integration", "--"])
        .arg("--test-threads=1")
        .args(args);
    ferry_env(&mut c, criu_prefix);
    must_run(&mut c, allow_skip);
    cmd::run(&mut c).context("step `integration tests` failed")
}

/// `cargo xtask test`.
pub fn run_all(criu_prefix: &Path, allow_skip: bool) -> Result<()> {
    check_can_run(allow_skip)?;
    ensure_setup(criu_prefix)?;
    build()?;
    unit(allow_skip)?;
    integration(criu_prefix, allow_skip, &[])?;
    header("all tests passed");
    Ok(())
}

/// `cargo xtask integration [-- ARGS]`.
pub fn run_integration(criu_prefix: &Path, allow_skip: bool, args: &[String]) -> Result<()> {
    check_can_run(allow_skip)?;
    ensure_setup(criu_prefix)?;
    build()?;
    integration(criu_prefix, allow_skip, args)
}
