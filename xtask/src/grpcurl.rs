//! grpcurl, the generic gRPC client operators point at ferryd's Control
//! API (health, reflection): built by `cargo xtask setup` from its Go
//! module (Debian 12 has no package of it) with the Go toolchain on this
//! machine, at a pinned version, into its own directory.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::cmd;
use crate::setup::Step;

/// The module and the version setup builds.
pub const MODULE: &str = "github.com/fullstorydev/grpcurl";
pub const VERSION: &str = "v1.9.4";

/// Where setup puts it; the integration tests find it there
/// (`FERRY_GRPCURL`, set by [`crate::test::ferry_env`]).
pub fn binary() -> PathBuf {
    PathBuf::from("/opt/ferry/grpcurl/bin/grpcurl")
}

/// The Go command: on PATH, else the toolchain's usual place.
fn go() -> Option<PathBuf> {
    cmd::on_path("go").or_else(|| {
        let usual = Path::new("/usr/local/go/bin/go");
        usual.is_file().then(|| usual.to_owned())
    })
}

/// The version of the module the binary at `bin` was built from, as Go
/// records it in the binary (`go version -m`).
fn built_version(go: &Path, bin: &Path) -> Option<String> {
    let out = cmd::output(Command::new(go).args(["version", "-m"]).arg(bin)).ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        let mut words = l.split_whitespace();
        (words.next() == Some("mod") && words.next() == Some(MODULE))
            .then(|| words.next().map(str::to_owned))
            .flatten()
    })
}

/// Whether setup has something to do.
pub fn missing() -> bool {
    match go() {
        Some(go) => built_version(&go, &binary()).as_deref() != Some(VERSION),
        None => !binary().is_file(),
    }
}

/// Builds grpcurl [`VERSION`] into [`binary`]'s directory unless it is
/// there.
pub fn ensure() -> Result<Step> {
    let bin = binary();
    let Some(go) = go() else {
        bail!("no Go toolchain (`go` on PATH or /usr/local/go/bin/go) to build {MODULE}");
    };
    if built_version(&go, &bin).as_deref() == Some(VERSION) {
        return Ok(Step::Skipped(format!(
            "{MODULE} {VERSION} at {}",
            bin.display()
        )));
    }
    let dir = bin.parent().expect("a file in a directory");
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    cmd::run(
        Command::new(&go)
            .args(["install", &format!("{MODULE}/cmd/grpcurl@{VERSION}")])
            .env("GOBIN", dir),
    )
    .context("building grpcurl")?;
    Ok(Step::Done(format!(
        "{MODULE} {VERSION} built into {}",
        bin.display()
    )))
}
