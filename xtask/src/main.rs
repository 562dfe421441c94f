//! `cargo xtask`: the project's automation.
//!
//! - `setup`: install what the project needs on a Debian 12 machine (idempotent)
//! - `test`: set up if needed, build, run unit and integration tests
//! - `integration [-- ARGS]`: only the root-only integration tests
//! - `demo`: set up if needed, run the 3-node migration demo

mod cmd;
mod criu;
mod packages;
mod setup;
mod test;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "cargo xtask")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Install the Debian packages ferry needs and build CRIU into /opt/ferry/criu.
    Setup,
    /// Set up if needed, then build everything and run unit and integration tests.
    Test,
    /// Build, then run only the integration tests (root, namespaces, CRIU); extra
    /// arguments go to the test binary (`cargo xtask integration -- migrate`).
    Integration {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Set up if needed, build, and run the demo: a 3-node cluster, a live migration.
    Demo {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let result = match args.command {
        Command::Setup => setup::run().map(|_| ()),
        Command::Test => test::run_all(),
        Command::Integration { args } => test::build().and_then(|_| test::integration(&args)),
        Command::Demo { args } => test::demo(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
