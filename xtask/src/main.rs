//! `cargo xtask`: the project's automation.
//!
//! - `setup`: install what the project needs on a Debian 12 machine (idempotent)
//! - `test`: set up if needed, build, run unit and integration tests
//! - `integration [-- ARGS]`: build, then only the root-only integration tests
//! - `demo [-- ARGS]`: set up if needed, build, run the 3-node migration demo
//! - `bench <name> [-- ARGS]`: set up if needed, build, run a benchmark of
//!   the bench crate (`gap`, `freeze`, `algorithms`, `replay`, `ab`)
//! - `soak [-- ARGS]`: set up if needed, build (release), and run the soak
//!   (`bench soak`: 1,000 migrations under load by default)
//! - `sim <openmosix|dve|all> [--runs N] [--seed S] [--out DIR]`: run the
//!   load-balancing simulator (no root, no setup)
//! - `fuzz [TARGET] [--seconds N]`: run the cargo-fuzz targets in `fuzz/`
//!   (nightly; installs cargo-fuzz if missing), fail on a finding
//! - `dist [--debug] [--out DIR]`: the Debian package (`dist.rs`)

mod bench;
mod cmd;
mod criu;
mod demo;
mod dist;
mod fuzz;
mod grpcurl;
mod packages;
mod setup;
mod sim;
mod test;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "ferry's project automation"
)]
struct Args {
    /// Where CRIU is (or gets) installed: <DIR>/bin/criu. Another directory
    /// than the agent's default lets the CRIU build be exercised without
    /// touching /opt/ferry.
    #[arg(
        long,
        global = true,
        env = "FERRY_CRIU_PREFIX",
        default_value = criu::DEFAULT_PREFIX,
        value_name = "DIR"
    )]
    criu_prefix: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Install the Debian packages ferry needs and build CRIU >= 4.2 (idempotent; root).
    Setup,
    /// Set up if needed, build all binaries, run unit then integration tests.
    /// A test that cannot run here (not root, no CRIU, a tool missing)
    /// fails the run unless `--allow-skip`.
    Test {
        /// Let tests that cannot run here skip instead of failing.
        #[arg(long)]
        allow_skip: bool,
    },
    /// Set up if needed, build, then run only the integration tests (root,
    /// namespaces, CRIU); extra arguments go to the test harness
    /// (`cargo xtask integration -- migrate`).
    Integration {
        /// Let tests that cannot run here skip instead of failing.
        #[arg(long)]
        allow_skip: bool,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Set up if needed, build, and run the demo (a 3-node cluster, live
    /// migrations); extra arguments go to `ferry-demo`.
    Demo {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Set up if needed, build, and run a benchmark (root; the bench crate's
    /// binaries): `gap` (capture and replay against drop and retransmit),
    /// `freeze` (socket modes at scale), `algorithms` (memory strategies
    /// over shaped links), `memory` (the freeze against the process's
    /// memory), `replay`, `ab` (two builds' freeze); extra arguments go to
    /// it (`cargo xtask bench gap -- --runs 20`). Built and run in the
    /// release profile, the build users deploy; `--debug` for the debug
    /// profile (`cargo xtask bench --debug gap`).
    Bench {
        /// The debug profile instead of release (figures not to publish).
        #[arg(long)]
        debug: bool,
        name: String,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Set up if needed, build, and soak: one server migrated again and
    /// again across three nodes under load, 1,000 times or for two hours
    /// by default (`bench soak`; `cargo xtask soak -- --migrations 200
    /// --seed 7`).
    Soak {
        /// The debug profile instead of release.
        #[arg(long)]
        debug: bool,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Set up if needed, build (release) and run Gerofi et al. (DVE)'s
    /// virtual-environment experiment live on the namespace cluster
    /// (`bench dve`; `cargo xtask dve -- --duration-s 120 --players 300`).
    Dve {
        /// The debug profile instead of release.
        #[arg(long)]
        debug: bool,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Run the load-balancing simulator (no root, no setup): `openmosix`
    /// (Meehan & Wynne (openMosix)'s spike experiment), `dve` (Gerofi et al. (DVE)'s scenario) or
    /// `all`; writes tables, CSV and SVG plots to target/sim/<name>/.
    Sim(sim::SimArgs),
    /// Build ferry's Debian package (target/dist/ferry_VERSION_ARCH.deb):
    /// ferryd and ferry (release), the CRIU `setup` built, ferry-network,
    /// the systemd units and docs (`docs/deploy.md`).
    Dist(dist::DistArgs),
    /// Fuzz the agent's request decoding, peer protocol and parsers
    /// (cargo-fuzz, nightly; no root): each target for `--seconds` from its
    /// corpus in fuzz/corpus/, failing on a finding (fuzz/artifacts/).
    Fuzz(fuzz::FuzzArgs),
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    // Absolute, since it is handed to tests and the demo as FERRY_CRIU and
    // they run from other directories.
    let prefix = &std::path::absolute(&args.criu_prefix).unwrap_or(args.criu_prefix.clone());
    let result = match args.command {
        Command::Setup => setup::run(prefix),
        Command::Test { allow_skip } => test::run_all(prefix, allow_skip),
        Command::Integration { allow_skip, args } => {
            test::run_integration(prefix, allow_skip, &args)
        }
        Command::Demo { args } => demo::run(prefix, &args),
        Command::Bench { debug, name, args } => bench::run(prefix, &name, &args, !debug),
        Command::Soak { debug, args } => bench::run(prefix, "soak", &args, !debug),
        Command::Dve { debug, args } => bench::run(prefix, "dve", &args, !debug),
        Command::Sim(args) => sim::run(&args),
        Command::Fuzz(args) => fuzz::run(&args),
        Command::Dist(args) => dist::run(prefix, &args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(argv: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("xtask").chain(argv.iter().copied())).unwrap()
    }

    #[test]
    fn passes_extra_args_through() {
        // `cargo xtask integration -- migrate --nocapture`: the `--` is
        // clap's, everything after it goes to the test harness untouched.
        let a = parse(&["integration", "--", "migrate", "--nocapture"]);
        assert!(
            matches!(a.command, Command::Integration { allow_skip: false, ref args } if args == &["migrate", "--nocapture"])
        );
        // Skipping is asked for, never the default.
        assert!(matches!(
            parse(&["test"]).command,
            Command::Test { allow_skip: false }
        ));
        assert!(matches!(
            parse(&["test", "--allow-skip"]).command,
            Command::Test { allow_skip: true }
        ));
        let a = parse(&["integration", "--allow-skip", "--", "migrate"]);
        assert!(
            matches!(a.command, Command::Integration { allow_skip: true, ref args } if args == &["migrate"])
        );
        let a = parse(&["soak", "--", "--migrations", "200", "--seed", "7"]);
        assert!(
            matches!(a.command, Command::Soak { debug: false, ref args } if args == &["--migrations", "200", "--seed", "7"])
        );
        let a = parse(&["demo", "--", "--keep"]);
        assert!(matches!(a.command, Command::Demo { ref args } if args == &["--keep"]));
        let a = parse(&["--criu-prefix", "/tmp/x", "setup"]);
        assert_eq!(a.criu_prefix, PathBuf::from("/tmp/x"));
        assert!(matches!(a.command, Command::Setup));
        let a = parse(&["fuzz", "peer_protocol", "--seconds", "600"]);
        assert!(matches!(
            a.command,
            Command::Fuzz(fuzz::FuzzArgs { ref target, seconds: 600, replay: false, .. })
                if target.as_deref() == Some("peer_protocol")
        ));
        let a = parse(&[
            "sim",
            "openmosix",
            "--runs",
            "2",
            "--seed",
            "7",
            "--out",
            "/tmp/r",
        ]);
        assert!(matches!(
            a.command,
            Command::Sim(sim::SimArgs { name: sim::SimName::Openmosix, runs: Some(2), seed: Some(7), ref out })
                if out.as_deref() == Some(std::path::Path::new("/tmp/r"))
        ));
    }
}
