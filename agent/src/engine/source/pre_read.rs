//! PreRead (incremental socket migration, no peer call): the setsockopt
//! watch (a `cgroup/setsockopt` eBPF program, `ferry_ebpf::SockoptWatch`)
//! attaches to the process tree's cgroups, then what does not move of
//! every established connection (its addresses, SO_REUSEADDR, its socket
//! options) is read while the process runs ([`crate::sockstate::Preread`]).
//! Inside the freeze only connections the watch saw a setsockopt call on,
//! and new ones, are read whole. A watch that cannot attach (no cgroup v2)
//! turns the migration into a collective one, with the reason in the
//! report. The watch is detached when the migration ends, whatever its
//! outcome (it goes with [`Incremental`]).

use std::sync::Arc;
use std::time::Instant;

use super::Phase;
use super::carry::Listening;
use super::run::{Run, options_by_ferryd};
use crate::engine::sockettaker::Incremental;
use crate::engine::{EngineError, blocking};
use crate::process;
use crate::sockstate::{self, SocketMigration};

pub(super) async fn pre_read(run: &mut Run) -> Result<Phase, EngineError> {
    let pid = run.p.pid;
    let node = run.engine.node().to_owned();
    if !run.p.host.has("cgroup_sockopt") {
        run.fall_back(
            "cgroup_sockopt",
            &node,
            "collective socket migration: the freeze read every connection whole".into(),
        );
        return Ok(collective_instead(
            run,
            "this node has no cgroup setsockopt hook to watch the connections after their pre-read",
        ));
    }
    let state_iterator = run.p.host.has("bpf_iter_tcp");
    let with_options = options_by_ferryd(
        true,
        run.p.destination_takes_tcp_options,
        run.engine.criu.as_ref(),
    );
    match blocking("reading the connections before the freeze", move || {
        preread(pid, with_options, state_iterator)
    })
    .await?
    {
        Ok(inc) => {
            tracing::info!(
                connections = inc.preread.len(),
                with_options,
                "connections read before the freeze; setsockopt watch attached"
            );
            if !state_iterator && inc.preread.len() >= sockstate::PER_PROCESS_PASS_FROM {
                run.fall_back(
                    "bpf_iter_tcp",
                    &node,
                    format!(
                        "the freeze read each of the {} connections by its own calls, not in one pass",
                        inc.preread.len()
                    ),
                );
            }
            Ok(Phase::Listen(Listening {
                incremental: Some(Arc::new(inc)),
            }))
        }
        Err(why) => Ok(collective_instead(run, &why)),
    }
}

/// The migration goes on in collective socket mode, for `why` (the log and
/// the report say it).
fn collective_instead(run: &mut Run, why: &str) -> Phase {
    tracing::warn!(pid = run.p.pid, reason = %why, "incremental socket migration unavailable; collective instead");
    run.p.socket_migration = SocketMigration::Collective;
    run.p.socket_note = Some(format!("incremental: {why}; collective instead"));
    run.report.sockets = SocketMigration::Collective.to_pb() as i32;
    run.report.sockets_note = run.p.socket_note.clone().unwrap_or_default();
    Phase::Listen(Listening { incremental: None })
}

/// Attaches the setsockopt watch to the cgroups of `pid`'s tree, then
/// reads its connections (in that order: a call racing with the read is
/// seen). Blocking. The error says why incremental mode cannot be used.
/// `state_iterator`: the kernel has the TCP state iterator (else each
/// connection is read by its calls in the freeze).
fn preread(pid: i32, with_options: bool, state_iterator: bool) -> Result<Incremental, String> {
    let started = Instant::now();
    let tree = process::process_tree(pid);
    let cgroups = tree
        .iter()
        .map(|&p| ferry_ebpf::cgroup_v2_dir(p).map_err(|e| format!("process {p}'s cgroup v2: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let mut watch = ferry_ebpf::SockoptWatch::attach(&cgroups)
        .map_err(|e| format!("attaching the setsockopt watch: {e}"))?;
    let watched = started.elapsed();
    let mut preread = sockstate::Preread::of_tree(&tree, with_options)
        .map_err(|e| format!("reading the connections: {e}"))?;
    let read = started.elapsed();
    // Enough connections: the freeze then reads them in one pass of the
    // TCP state iterator; a kernel without it (or without BTF) reads each
    // by its calls.
    if state_iterator && let Err(e) = preread.with_state_reader() {
        tracing::warn!(error = %e, "no TCP state iterator: each connection is read by its calls in the freeze");
    }
    tracing::debug!(
        watch_ms = watched.as_secs_f64() * 1000.0,
        read_ms = (read - watched).as_secs_f64() * 1000.0,
        state_reader_ms = (started.elapsed() - read).as_secs_f64() * 1000.0,
        "pre-read steps"
    );
    // Calls elsewhere on the node cost no map update from here on.
    if let Some(netns) = preread.only_netns() {
        watch
            .only_netns(netns)
            .map_err(|e| format!("narrowing the setsockopt watch: {e}"))?;
    }
    Ok(Incremental {
        preread,
        watch: std::sync::Mutex::new(Some(watch)),
    })
}
