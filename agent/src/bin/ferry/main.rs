//! ferry: the command line of a ferry cluster, over the local agent's
//! Control API.

#![warn(clippy::too_many_lines)]
// The report's JSON (output.rs) is one `json!` with more fields than the
// macro's default recursion limit allows.
#![recursion_limit = "256"]

use std::process::ExitCode;

mod args;
mod cert;
mod cluster;
mod connection;
mod drain;
mod events;
mod follow;
mod groups;
mod init;
mod migrations;
mod output;
mod processes;
mod progress;

use anyhow::Result;
use clap::Parser;

use crate::args::{Args, Command};
use ferry_proto::v1::RunProcessRequest;

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ferry: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(main_exec(args)) {
        Ok(()) => ExitCode::SUCCESS,
        // Each cause once: a transport error's source repeats the OS
        // error its own source gives.
        Err(e) => {
            eprintln!(
                "ferry: {}",
                ferry_agent::error_chain::error_chain(e.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

/// Runs the command: `ferry cert` and `ferry init` on their own, every
/// other one against the agent.
async fn main_exec(mut args: Args) -> Result<()> {
    // Taken out so that `args` stays whole for connect().
    let command = std::mem::replace(&mut args.command, Command::Nodes { features: false });
    let command = match command {
        Command::Cert(c) => return cert::run(c, args.json),
        Command::Init(a) => return init::run(a),
        c => c,
    };
    let mut client = connection::connect(&args).await?;
    let client = &mut client;
    let node = args.node.clone().unwrap_or_default();
    let json = args.json;
    match command {
        Command::Cert(_) | Command::Init(_) => unreachable!("handled above"),
        Command::Nodes { features } => cluster::nodes(client, features, json).await,
        Command::Ps { all } => processes::ps(client, node, all, json).await,
        Command::Run {
            argv,
            foreground,
            ipc_namespace,
            user,
        } => {
            let request = RunProcessRequest {
                argv,
                node,
                ipc_namespace,
                user: user.unwrap_or_default(),
            };
            processes::run(client, request, foreground, json).await
        }
        Command::Adopt { pid, foreground } => {
            processes::adopt(client, node, pid, foreground, json).await
        }
        Command::Wait { pid } => processes::wait(client, node, pid).await,
        Command::Signal { pid, signal } => {
            processes::signal(client, node, pid, &signal, json).await
        }
        Command::Migrate(migrate) => migrations::migrate(client, node, migrate, json).await,
        Command::Report { migration_id } => {
            migrations::report(client, node, migration_id, json).await
        }
        Command::Cancel { migration_id } => {
            migrations::cancel(client, node, migration_id, json).await
        }
        Command::Dataplane => cluster::dataplane(client, node, json).await,
        Command::Balancer { action } => cluster::balancer(client, node, action, json).await,
        Command::Cordon { off } => cluster::cordon(client, node, off, json).await,
        Command::Group { action } => groups::run(client, action, json).await,
        Command::Handoff {
            port,
            remote,
            to,
            drain_ms,
        } => groups::handoff(client, node, (port, remote), to, drain_ms, json).await,
        Command::Drain { cancel: true, .. } => cluster::cancel_drain(client, node, json).await,
        Command::Drain {
            strategy, sockets, ..
        } => cluster::drain(client, node, strategy, sockets, json).await,
        Command::Events { this_node_only } => cluster::events(client, this_node_only, json).await,
    }
}
