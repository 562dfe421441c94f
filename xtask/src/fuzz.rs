//! `cargo xtask fuzz [TARGET] [--seconds N]`: runs the cargo-fuzz targets in
//! `fuzz/` (their bodies are in `agent/src/fuzzing/`), each for N seconds
//! from its kept corpus, and fails on the first finding (a panic, a failed
//! invariant, a hang or a sanitizer report; libFuzzer leaves the input in
//! `fuzz/artifacts/TARGET/`).
//!
//! libFuzzer needs a nightly compiler; cargo-fuzz is installed from
//! crates.io when it is missing (README, "Fuzzing"). The corpus grows in
//! place: `--minimize` runs `cargo fuzz cmin` afterwards, to keep what is
//! committed small. Replaying the kept corpus alone needs neither: the
//! agent's unit test `fuzz_corpus_replays_without_a_finding` does it on
//! stable in every `cargo test`.

use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::cmd;

/// The targets, with the longest input worth trying: the ones that carry
/// memory pages (4 KiB each) need room for a few.
const TARGETS: &[(&str, u32)] = &[
    ("control_request", 4096),
    ("peer_protocol", 32768),
    ("local_pages", 32768),
    ("membership", 4096),
    ("criu_image", 16384),
    ("config", 4096),
];

/// The cargo-fuzz release the project was fuzzed with.
const CARGO_FUZZ_VERSION: &str = "0.13.2";

#[derive(Debug, clap::Args)]
pub struct FuzzArgs {
    /// One target (default: all, one after the other).
    pub target: Option<String>,
    /// How long each target runs.
    #[arg(long, default_value_t = 30)]
    pub seconds: u64,
    /// Run each target once over its kept corpus instead of fuzzing.
    #[arg(long)]
    pub replay: bool,
    /// Minimise each corpus afterwards (`cargo fuzz cmin`).
    #[arg(long)]
    pub minimize: bool,
    /// libFuzzer's sanitizer: address (default) or none (faster).
    #[arg(long, default_value = "address")]
    pub sanitizer: String,
    /// Parallel fuzzing jobs per target (libFuzzer's -fork).
    #[arg(long, default_value_t = 1)]
    pub jobs: u32,
}

/// `cargo +nightly ...` through rustup's proxy, not the stable cargo that
/// runs xtask (which `CARGO` names and which ignores `+nightly`), with
/// nothing of the outer build's toolchain choice leaking in.
fn nightly_cargo() -> Command {
    let mut c = Command::new("cargo");
    c.arg("+nightly")
        .current_dir(cmd::workspace_root())
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("RUSTDOC")
        .env_remove("CARGO")
        // fuzz/target, apart from the stable build's.
        .env_remove("CARGO_TARGET_DIR");
    c
}

/// A nightly toolchain (rustup's `nightly`) and cargo-fuzz, installed if
/// missing.
pub fn ensure_tools() -> Result<()> {
    let nightly = cmd::output(Command::new("rustc").args(["+nightly", "--version"]))
        .context("asking rustup for a nightly rustc")?;
    if !nightly.status.success() {
        bail!(
            "libFuzzer needs a nightly Rust: `rustup toolchain install nightly` (README, \"Fuzzing\")"
        );
    }
    let has_fuzz = cmd::output(Command::new("cargo").args(["fuzz", "--version"]))
        .is_ok_and(|o| o.status.success());
    if !has_fuzz {
        crate::test::header("installing cargo-fuzz");
        cmd::run(Command::new("cargo").args([
            "install",
            "cargo-fuzz",
            "--locked",
            "--version",
            CARGO_FUZZ_VERSION,
        ]))
        .context("installing cargo-fuzz")?;
    }
    Ok(())
}

fn selected(target: Option<&str>) -> Result<Vec<(&'static str, u32)>> {
    match target {
        None => Ok(TARGETS.to_vec()),
        Some(t) => TARGETS
            .iter()
            .find(|(name, _)| *name == t)
            .map(|t| vec![*t])
            .with_context(|| {
                let names: Vec<_> = TARGETS.iter().map(|(n, _)| *n).collect();
                format!("no fuzz target {t:?}; there are {}", names.join(", "))
            }),
    }
}

/// `cargo xtask fuzz`.
pub fn run(args: &FuzzArgs) -> Result<()> {
    let targets = selected(args.target.as_deref())?;
    ensure_tools()?;
    let root = cmd::workspace_root();
    for (target, max_len) in targets {
        let corpus = root.join("fuzz/corpus").join(target);
        std::fs::create_dir_all(&corpus)
            .with_context(|| format!("creating {}", corpus.display()))?;
        let what = if args.replay {
            "replaying the corpus".to_owned()
        } else {
            format!("{} s", args.seconds)
        };
        crate::test::header(&format!("fuzz {target}: {what}"));
        let mut c = nightly_cargo();
        c.args(["fuzz", "run", "--sanitizer", &args.sanitizer, target])
            .arg(&corpus)
            .arg("--")
            .arg(format!("-max_len={max_len}"))
            // A step that takes this long is a hang.
            .arg("-timeout=20")
            .arg("-rss_limit_mb=4096");
        if args.replay {
            c.arg("-runs=0");
        } else {
            c.arg(format!("-max_total_time={}", args.seconds));
            if args.jobs > 1 {
                c.arg(format!("-fork={}", args.jobs));
            }
        }
        cmd::run(&mut c).with_context(|| {
            format!(
                "fuzz target {target} found a problem: the input is in fuzz/artifacts/{target}/"
            )
        })?;
        if args.minimize && !args.replay {
            crate::test::header(&format!("fuzz {target}: minimising the corpus"));
            cmd::run(
                nightly_cargo()
                    .args(["fuzz", "cmin", "--sanitizer", &args.sanitizer, target])
                    .arg(&corpus)
                    .arg("--")
                    .arg(format!("-max_len={max_len}")),
            )
            .with_context(|| format!("minimising the corpus of {target}"))?;
        }
    }
    crate::test::header("fuzzing found nothing");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_target_has_a_harness_and_a_corpus_directory_name() {
        let manifest = std::fs::read_to_string(cmd::workspace_root().join("fuzz/Cargo.toml"))
            .expect("fuzz/Cargo.toml");
        for (t, _) in TARGETS {
            assert!(manifest.contains(&format!("name = \"{t}\"")), "{t}");
        }
        assert!(selected(Some("nope")).is_err());
        assert_eq!(selected(None).unwrap().len(), TARGETS.len());
    }
}
