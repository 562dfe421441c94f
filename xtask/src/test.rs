//! `cargo xtask test`, `integration` and `demo`.

use anyhow::{Context, Result};

use crate::{cmd, criu, setup};

fn header(s: &str) {
    eprintln!("\n==== {s} ====");
}

fn ensure_setup() -> Result<()> {
    if setup::needed() {
        header("setup (something is missing)");
        setup::run().context("setup")?;
    }
    Ok(())
}

pub fn build() -> Result<()> {
    ensure_setup()?;
    header("build (all binaries, including the integration crate's)");
    cmd::run(cmd::cargo().args(["build", "--workspace", "--bins"])).context("build")
}

fn integration_env(c: &mut std::process::Command) {
    c.env("FERRY_BIN_DIR", cmd::workspace_root().join("target/debug"))
        .env("FERRY_CRIU", criu::binary());
}

pub fn integration(args: &[String]) -> Result<()> {
    header("integration tests (root, network namespaces, CRIU, eBPF; one at a time)");
    let mut c = cmd::cargo();
    c.args(["test", "-p", "ferry-integration", "--"])
        .arg("--test-threads=1")
        .args(args);
    integration_env(&mut c);
    cmd::run(&mut c).context("integration tests")
}

pub fn run_all() -> Result<()> {
    build()?;
    header("unit tests");
    cmd::run(cmd::cargo().arg("test")).context("unit tests")?;
    integration(&[])
}

pub fn demo(args: &[String]) -> Result<()> {
    build()?;
    header("demo");
    let mut c = std::process::Command::new(cmd::workspace_root().join("target/debug/ferry-demo"));
    c.args(args);
    integration_env(&mut c);
    cmd::run(&mut c).context("demo")
}
