//! `cargo xtask setup`: idempotent setup of a Debian 12 machine.
//!
//! Every step runs even if an earlier one failed (unless it depends on it),
//! so one run reports everything that is wrong; the summary says done,
//! skipped or failed per step and the exit status is non-zero on a failure.

use std::path::Path;
use std::time::Instant;

use anyhow::{Result, bail};

use crate::{cmd, criu, grpcurl, packages};

/// What a step did, when it did not fail.
#[derive(Debug)]
pub enum Step {
    Done(String),
    Skipped(String),
}

/// Whether a full setup is needed: one dpkg-query and one `criu --version`,
/// cheap enough to run before every `cargo xtask test`.
pub fn needed(criu_prefix: &Path) -> bool {
    !packages::missing().is_empty()
        || criu::installed_ok(criu_prefix).is_none()
        || grpcurl::missing()
}

fn preflight() -> Result<()> {
    if !cmd::is_root() {
        bail!(
            "setup installs Debian packages and builds CRIU into /opt: run it as root (e.g. `sudo -E cargo xtask setup`)"
        );
    }
    let os = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    let field = |k: &str| {
        os.lines()
            .find_map(|l| l.strip_prefix(k)?.strip_prefix('='))
            .map(|v| v.trim_matches('"').to_owned())
    };
    if field("ID").as_deref() != Some("debian") {
        bail!(
            "setup knows Debian's packages only; this is {} (/etc/os-release)",
            field("PRETTY_NAME").unwrap_or_else(|| "not Debian".into())
        );
    }
    if field("VERSION_ID").as_deref() != Some("12") {
        eprintln!(
            "warning: setup was written for Debian 12 (bookworm); this is {}",
            field("PRETTY_NAME").unwrap_or_default()
        );
    }
    Ok(())
}

pub fn run(criu_prefix: &Path) -> Result<()> {
    preflight()?;
    let started = Instant::now();
    let mut summary: Vec<(&str, &str, String)> = Vec::new();
    let mut failed = Vec::new();

    eprintln!("\n-- setup: Debian packages");
    let packages_ok = match packages::ensure() {
        Ok(o) if o.installed.is_empty() => {
            summary.push((
                "packages",
                "skipped",
                format!("all {} already installed", o.present.len()),
            ));
            true
        }
        Ok(o) => {
            summary.push((
                "packages",
                "done",
                format!(
                    "installed {}; {} already there",
                    o.installed.join(" "),
                    o.present.len()
                ),
            ));
            true
        }
        Err(e) => {
            summary.push(("packages", "FAILED", format!("{e:#}")));
            failed.push("packages");
            false
        }
    };

    eprintln!(
        "\n-- setup: CRIU >= 4.2 at {}",
        criu::binary(criu_prefix).display()
    );
    // Building CRIU needs its -dev packages; without them only an already
    // good CRIU counts.
    let criu_step = if packages_ok {
        criu::ensure(criu_prefix)
    } else {
        match criu::installed_ok(criu_prefix) {
            Some(v) => Ok(Step::Skipped(format!(
                "CRIU {v} already at {}",
                criu::binary(criu_prefix).display()
            ))),
            None => Err(anyhow::anyhow!(
                "not built: its build dependencies are missing (see packages)"
            )),
        }
    };
    match criu_step {
        Ok(Step::Done(s)) => summary.push(("criu", "done", s)),
        Ok(Step::Skipped(s)) => summary.push(("criu", "skipped", s)),
        Err(e) => {
            summary.push(("criu", "FAILED", format!("{e:#}")));
            failed.push("criu");
        }
    }

    eprintln!(
        "\n-- setup: grpcurl {} at {}",
        grpcurl::VERSION,
        grpcurl::binary().display()
    );
    match grpcurl::ensure() {
        Ok(Step::Done(s)) => summary.push(("grpcurl", "done", s)),
        Ok(Step::Skipped(s)) => summary.push(("grpcurl", "skipped", s)),
        Err(e) => {
            summary.push(("grpcurl", "FAILED", format!("{e:#}")));
            failed.push("grpcurl");
        }
    }

    // The kernel and util-linux pieces the tests rely on: warnings only, since
    // setup cannot fix them and the build does not need them.
    eprintln!("\n-- setup: kernel and tools (warnings only)");
    let btf = "/sys/kernel/btf/vmlinux";
    if Path::new(btf).exists() {
        summary.push(("btf", "ok", btf.to_owned()));
    } else {
        summary.push((
            "btf",
            "WARNING",
            format!(
                "{btf} missing: the kernel lacks CONFIG_DEBUG_INFO_BTF, eBPF programs may not load"
            ),
        ));
    }
    for tool in ["unshare", "nsenter"] {
        match cmd::on_path(tool) {
            Some(p) => summary.push((tool, "ok", p.display().to_string())),
            None => summary.push((
                tool,
                "WARNING",
                "not on PATH (util-linux): the test cluster needs it".to_owned(),
            )),
        }
    }

    eprintln!(
        "\nsetup summary ({:.1} s):",
        started.elapsed().as_secs_f64()
    );
    for (step, status, detail) in &summary {
        // Multi-line failures (build log tails) are indented under the step.
        let detail = detail.replace('\n', "\n                      ");
        eprintln!("  {step:<9} {status:<8}  {detail}");
    }
    if !failed.is_empty() {
        bail!("setup failed: {}", failed.join(", "));
    }
    Ok(())
}
