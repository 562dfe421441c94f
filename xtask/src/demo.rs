//! `cargo xtask demo`: set up if needed, build, run the integration crate's
//! `ferry-demo` (a 3-node namespace cluster and live migrations).

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{cmd, test};

pub fn run(criu_prefix: &Path, args: &[String]) -> Result<()> {
    test::ensure_setup(criu_prefix)?;
    test::build()?;
    test::header("demo");
    let bin = cmd::debug_dir().join("ferry-demo");
    if !bin.exists() {
        bail!(
            "step `demo` failed: {} was not built (no `ferry-demo` binary in the integration crate?)",
            bin.display()
        );
    }
    let mut c = Command::new(&bin);
    c.args(args);
    test::ferry_env(&mut c, criu_prefix);
    cmd::run(&mut c).context("step `demo` failed")
}
