//! Validate and Prepare: everything that can be checked before touching
//! the process, then the destination's reservation (`Peer.Hello`,
//! `Peer.Prepare`). An error here leaves no trace anywhere.

use crate::engine::compression::Compressor;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use ferry_proto::v1::{AbortRequest, Fallback, HelloRequest, HelloResponse, PrepareRequest};

use crate::config::PeerConfig;
use crate::engine::link::{PeerLink, peer_error, silent};
use crate::engine::needs::{self, Role};
use crate::engine::precopy::{Convergence, MemoryStrategy};
use crate::engine::{Engine, EngineError, blocking, new_migration_id};
use crate::host_features::HostFeatures;
use crate::managed::{Lifecycle, OutStage};
use crate::process::{self, PortKey, SocketSummary};
use crate::sockstate::{self, SocketMigration};

/// What a migration request may choose; `None`: the agent's `[migration]`
/// setting.
#[derive(Debug, Clone, Copy, Default)]
pub struct MigrationOptions {
    /// How the TCP connections move.
    pub sockets: Option<SocketMigration>,
    /// How the memory moves.
    pub strategy: Option<MemoryStrategy>,
    /// Pre-copy: the freeze's budget for the pages left.
    pub downtime_budget: Option<Duration>,
    /// Pre-copy: the most rounds.
    pub max_rounds: Option<u32>,
    /// Pre-copy: slow down a process that writes faster than its pages
    /// cross.
    pub throttle: Option<bool>,
    /// Flush before freeze (the API's `drain_send_queues_ms`): wait at most
    /// this long, with the process
    /// stopped and its packets still flowing, for its send queues to empty.
    pub flush_send_queues: Option<Duration>,
}

/// A migration that passed validation and holds the destination's
/// reservation.
pub struct Prepared {
    pub migration_id: String,
    pub pid: i32,
    pub destination: PeerConfig,
    pub(super) link: Arc<dyn PeerLink>,
    /// The peer protocol version `Hello` settled on.
    pub(super) protocol_version: u32,
    pub(super) sockets: SocketSummary,
    /// How the TCP connections move, decided before the freeze, and why
    /// not as asked, if so.
    pub(super) socket_migration: SocketMigration,
    pub(super) socket_note: Option<String>,
    /// The destination sets the connections' socket options itself
    /// (`PrepareResponse.takes_tcp_options`).
    pub(super) destination_takes_tcp_options: bool,
    /// The destination's CRIU installs connections kept out of the images
    /// (`PrepareResponse.takes_connections_out`).
    pub(super) destination_takes_connections_out: bool,
    /// The destination restores pages left out of a pre-copy's dump from
    /// its page store (`PrepareResponse.fills_held_pages`).
    pub(super) destination_fills_held_pages: bool,
    /// ... also those of areas a lazy restore cannot fill, written into
    /// the pages image (`PrepareResponse.fills_held_pages_everywhere`).
    pub(super) destination_fills_held_pages_everywhere: bool,
    /// Post-copy: the pages follow by ferryd (the dump leaves them in the
    /// stopped copy, `Peer.PostCopyPages` carries them after the resume),
    /// not by CRIU's page server.
    pub(super) pages_follow: bool,
    /// Whether pages cross compressed (`[migration] compression`, where
    /// the destination takes them, `PrepareResponse.takes_lz4`); after
    /// pre-copy's rounds, where they left it.
    pub(super) compression: Compressor,
    /// Flush before freeze, and its bound.
    pub(super) flush_send_queues: Option<Duration>,
    /// How the memory moves, and when pre-copy rounds stop.
    pub(super) strategy: MemoryStrategy,
    pub(super) convergence: Convergence,
    pub(super) started: Instant,
    pub(super) started_wall: SystemTime,
    /// What the migration does without a feature a node lacks, known at
    /// Prepare (more are added as the work meets them): the report's
    /// `fallbacks`.
    pub(super) fallbacks: Vec<Fallback>,
    /// This node's kernel features (`features_off` applied), as Prepare
    /// found them: the later phases' fallbacks read them here.
    pub(super) host: HostFeatures,
    /// `Control.CancelMigration`'s switch, and the migration's end.
    pub cancel: Arc<crate::engine::cancel::Cancel>,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("migration_id", &self.migration_id)
            .field("pid", &self.pid)
            .finish()
    }
}

/// When the pre-copy rounds of a migration asked with `options` stop.
fn convergence(
    engine: &Engine,
    strategy: MemoryStrategy,
    options: MigrationOptions,
) -> Convergence {
    let cfg = &engine.config.migration;
    Convergence {
        downtime_budget: options
            .downtime_budget
            .unwrap_or(Duration::from_millis(u64::from(cfg.downtime_budget_ms))),
        // Assisted post-copy: one full pass (the second round only scans,
        // and its written pages are left to the post-copy).
        max_rounds: if strategy == MemoryStrategy::AssistedPostCopy {
            1
        } else {
            options.max_rounds.unwrap_or(cfg.max_rounds)
        },
        throttle: options.throttle.unwrap_or(cfg.throttle),
    }
}

/// The destination named `destination`, if this node knows it and it is
/// not this node.
fn destination_of(engine: &Engine, destination: &str) -> Result<PeerConfig, EngineError> {
    let node = engine.node().to_owned();
    if destination == node {
        return Err(EngineError::DestinationIsSelf { node });
    }
    engine.cluster.peer(destination).ok_or_else(|| {
        let mut known: Vec<String> = vec![engine.node().to_owned()];
        known.extend(engine.cluster.known_peers().into_iter().map(|p| p.name));
        EngineError::UnknownNode {
            name: destination.to_owned(),
            known: known.join(", "),
        }
    })
}

/// Checks everything that can be checked before touching the process, and
/// reserves the destination. Errors here leave no trace here; the
/// destination is told to drop what a failed Prepare may have reserved.
pub async fn prepare(
    engine: &Arc<Engine>,
    pid: i32,
    destination: &str,
    options: MigrationOptions,
) -> Result<Prepared, EngineError> {
    let wanted_sockets = options.sockets.unwrap_or(engine.config.migration.sockets);
    let defaulted = options.strategy.is_none();
    let started = Instant::now();
    let started_wall = SystemTime::now();
    let peer = destination_of(engine, destination)?;
    check_migratable(engine, pid)?;
    let mut fallbacks = Vec::new();
    let host = needs::this_host(engine).await?;
    let strategy = needs::settle(
        Role::Source,
        options.strategy.unwrap_or(engine.config.migration.strategy),
        defaulted,
        &host.to_pb(),
        engine.node(),
        &host.kernel,
        &mut fallbacks,
    )?;
    let criu = engine.criu.clone();
    blocking("probing CRIU", move || criu.probe()).await??;
    let migration_id = new_migration_id();
    let (argv, sockets) = claim(engine, pid, &migration_id)?;
    let asked = Asked {
        strategy,
        defaulted,
    };
    let reserved = reserve(engine, pid, &migration_id, &peer, asked, argv, sockets).await;
    let (link, hello, strategy, sockets, answer) = match reserved {
        Ok(r) => r,
        Err(e) => {
            engine.processes.set_lifecycle(pid, Lifecycle::Running);
            return Err(e);
        }
    };
    let protocol_version = hello.response.protocol_version;
    let convergence = convergence(engine, strategy, options);
    fallbacks.extend(hello.fallbacks);
    fallbacks.extend(fallbacks_known_at_prepare(strategy, &hello.response));
    let (socket_migration, socket_note) =
        sockstate::choose(wanted_sockets, sockets.tcp_other, protocol_version);
    if let Some(why) = &socket_note {
        tracing::info!(pid, reason = %why, "TCP connections move one by one (CRIU)");
    }
    Ok(Prepared {
        migration_id,
        pid,
        destination: peer,
        link,
        protocol_version,
        sockets,
        socket_migration,
        socket_note,
        destination_takes_tcp_options: answer.takes_tcp_options,
        destination_takes_connections_out: answer.takes_connections_out,
        destination_fills_held_pages: answer.fills_held_pages,
        destination_fills_held_pages_everywhere: answer.fills_held_pages
            && answer.fills_held_pages_everywhere,
        pages_follow: pages_follow(engine, strategy, protocol_version, answer.fills_held_pages),
        compression: Compressor::new(engine.config.migration.compression, answer.takes_lz4),
        flush_send_queues: options.flush_send_queues,
        strategy,
        convergence,
        started,
        started_wall,
        fallbacks,
        host,
        cancel: Default::default(),
    })
}

/// The fallbacks the destination's Hello already decides: a pre-copy to a
/// node whose userfaultfd lacks the filler's events carries the pages it
/// holds in the freeze's dump.
fn fallbacks_known_at_prepare(strategy: MemoryStrategy, hello: &HelloResponse) -> Vec<Fallback> {
    let mut fallbacks = Vec::new();
    if strategy.is_precopy()
        && !strategy.is_postcopy()
        && needs::lacks(&hello.features, "uffd_events")
    {
        fallbacks.push(Fallback {
            feature: "uffd_events".into(),
            node: hello.node.clone(),
            instead: format!(
                "the freeze's dump carried every page, also those {} held from the rounds \
                 (no fill after the resume)",
                hello.node
            ),
        });
    }
    fallbacks
}

/// The strategy asked for, and whether the request left it to this node's
/// configuration (`needs::settle`).
#[derive(Debug, Clone, Copy)]
struct Asked {
    strategy: MemoryStrategy,
    defaulted: bool,
}

/// The destination's Hello, and the fallbacks it decided.
struct Greeted {
    response: HelloResponse,
    fallbacks: Vec<Fallback>,
}

/// Whether a post-copy's pages follow by ferryd: asked for (the default),
/// and both ends can (a destination of protocol 10 whose page filler runs,
/// a CRIU here that leaves held pages out of the dump). Otherwise CRIU's
/// lazy pages, as before.
fn pages_follow(
    engine: &Engine,
    strategy: MemoryStrategy,
    protocol_version: u32,
    destination_fills: bool,
) -> bool {
    if strategy != MemoryStrategy::PostCopy
        || engine.config.migration.post_copy_pages != crate::config::PostCopyPages::Ferryd
    {
        return false;
    }
    let why_not = if protocol_version < ferry_proto::PEER_PROTOCOL_PAGES_FOLLOW {
        Some("the destination speaks an older peer protocol")
    } else if !destination_fills {
        Some("the destination's page filler cannot run")
    } else if !crate::criu::has_patch(&engine.config.criu_path, crate::criu::HELD_ALL_MARK) {
        Some("this node's CRIU lacks ferry's patch that leaves the pages in the stopped task")
    } else {
        None
    };
    if let Some(why) = why_not {
        tracing::info!(
            reason = why,
            "post-copy's pages follow by CRIU's lazy pages"
        );
    }
    why_not.is_none()
}

/// Claims the process, so that no second migration of it can start;
/// returns its command line and the sockets last read.
fn claim(
    engine: &Engine,
    pid: i32,
    migration_id: &str,
) -> Result<(Vec<String>, SocketSummary), EngineError> {
    let mut reg = engine.processes.registry();
    let p = reg
        .get_mut(pid)
        .ok_or_else(|| not_managed(pid, engine.node()))?;
    if let Lifecycle::MigratingOut { migration_id, .. } = &p.lifecycle {
        return Err(EngineError::AlreadyMigrating {
            pid,
            migration_id: migration_id.clone(),
        });
    }
    p.lifecycle = Lifecycle::MigratingOut {
        migration_id: migration_id.to_owned(),
        stage: OutStage::Live,
    };
    Ok((p.argv.clone(), p.sockets.clone()))
}

/// With the process claimed: its sockets read again, its tree vetted, and
/// the destination asked (`Hello`, `Prepare`). Returns the link, the
/// protocol version, the sockets and the destination's answer.
async fn reserve(
    engine: &Arc<Engine>,
    pid: i32,
    migration_id: &str,
    peer: &PeerConfig,
    asked: Asked,
    argv: Vec<String>,
    sockets: SocketSummary,
) -> Result<
    (
        Arc<dyn PeerLink>,
        Greeted,
        MemoryStrategy,
        SocketSummary,
        ferry_proto::v1::PrepareResponse,
    ),
    EngineError,
> {
    // Fresh socket list: ports opened since the last refresh move too.
    let tree = process::process_tree(pid);
    let sockets = process::sockets_of_tree(&tree).unwrap_or(sockets);
    vet(pid, tree.clone(), engine.criu.clone()).await?;
    // A connection to a process on the destination node would have to
    // become a connection within one host: no rewrite of one end does
    // that. Refused now, before anything is touched.
    if let Some(dest_ip) = engine.cluster.cluster_address_of(&peer.name)
        && sockets.tcp_peers.contains(&dest_ip)
    {
        return Err(EngineError::NotMigratable {
            pid,
            reason: format!(
                "it has a TCP connection to {dest_ip}, {} itself: ferry cannot turn it into a connection within one node",
                peer.name
            ),
        });
    }
    // A connection to a peer on this very node over its cluster address
    // never crosses the cluster interface, where the peer's translator
    // works: once the process left, the peer's packets would still be
    // delivered here, to nobody, and the connection would hang. Refused
    // now too.
    let here = engine.config.cluster.address;
    if sockets.tcp_peers.contains(&here) {
        return Err(EngineError::NotMigratable {
            pid,
            reason: format!(
                "it has a TCP connection to {here}, {} itself: ferry translates connections \
                 between nodes, and this one never leaves the node",
                engine.node()
            ),
        });
    }
    let memory = blocking("reading the process tree's memory", {
        let tree = tree.clone();
        move || process::memory::tree_memory(&tree)
    })
    .await??;
    let link = engine.links.connect(peer).await?;
    let deadline = Duration::from_secs(engine.config.peer_timeout_secs);
    let (hello, strategy) =
        tokio::time::timeout(deadline, hello(engine, link.as_ref(), peer, pid, asked))
            .await
            .map_err(|_| silent(peer, "Hello", deadline))??;
    let version = hello.response.protocol_version;
    limits_fit(pid, tree.clone(), &hello.response, &peer.name).await?;
    public_addresses_fit(
        engine.config.public.addresses(),
        &hello.response.public_addresses,
        &peer.name,
    )?;
    let prepare = link.prepare(PrepareRequest {
        protocol_version: version,
        migration_id: migration_id.to_owned(),
        source_node: engine.node().to_owned(),
        source_pid: pid,
        argv,
        ports: sockets.ports.iter().map(PortKey::to_pb).collect(),
        resident_bytes: memory.resident,
        dumped_bytes: memory.dumped,
        strategy: strategy.to_pb() as i32,
    });
    let answer = match tokio::time::timeout(deadline, prepare).await {
        Ok(Ok(answer)) => answer,
        failed => {
            let e = match failed {
                Ok(Err(s)) => peer_error(&peer.name, s),
                _ => silent(peer, "Prepare", deadline),
            };
            // A Prepare without its answer may have reserved the
            // destination, or still may (late, or held on a cut link):
            // told that the source gave it up, the destination drops it
            // or refuses it when it comes.
            super::abort::keep_telling(
                link.clone(),
                AbortRequest {
                    migration_id: migration_id.to_owned(),
                    reason: e.to_string(),
                },
                deadline,
                Duration::ZERO,
            );
            return Err(e);
        }
    };
    if let Some(p) = engine.processes.registry().get_mut(pid) {
        p.sockets = sockets.clone();
    }
    Ok((link, hello, strategy, sockets, answer))
}

/// What CRIU would refuse to dump (a socket of a family it cannot dump, a
/// Unix socket connected outside the tree, a file lock, System V shared
/// memory of the node's, a task of another user whose limits `criu`
/// cannot read: ferry's reads them from procfs), or
/// dump into a broken copy (a pipe or terminal shared with the outside):
/// refused now, with the process running. Found after the freeze, it
/// would cost the freeze and a rollback.
async fn vet(
    pid: i32,
    tree: Vec<i32>,
    criu: Arc<dyn crate::criu::Checkpointer>,
) -> Result<(), EngineError> {
    let processes = tree.len();
    let vet_started = Instant::now();
    let obstacles = blocking("vetting the process tree", move || {
        // Known by the binary's mark (a file read, once per binary).
        let criu_reads_limits = criu.has_patch(crate::criu::RLIMITS_PROCFS_MARK);
        let mut found = crate::managed::tree_obstacles(&tree)?;
        found.extend(process::privileges::limits_obstacles(
            &tree,
            criu_reads_limits,
        ));
        Ok::<_, String>(found)
    })
    .await?
    .map_err(EngineError::Internal)?;
    tracing::info!(
        processes,
        obstacles = obstacles.len(),
        vet_ms = vet_started.elapsed().as_secs_f64() * 1000.0,
        "process tree vetted"
    );
    refuse_if_any(pid, &obstacles)
}

/// Every obstacle found at once, as the refusal of the migration; none:
/// on it goes.
fn refuse_if_any(pid: i32, obstacles: &[process::Obstacle]) -> Result<(), EngineError> {
    if obstacles.is_empty() {
        return Ok(());
    }
    Err(EngineError::NotMigratable {
        pid,
        reason: obstacles
            .iter()
            .map(|o| o.to_string())
            .collect::<Vec<_>>()
            .join("; "),
    })
}

/// The tree's hard resource limits against those a restore on the
/// destination can give back: refused before anything stops where the
/// destination's agent lacks CAP_SYS_RESOURCE and a limit is above its
/// own (CRIU's restore ignores the refusal to raise it).
async fn limits_fit(
    pid: i32,
    tree: Vec<i32>,
    hello: &HelloResponse,
    node: &str,
) -> Result<(), EngineError> {
    if hello.hard_limits.is_empty() || !needs::lacks(&hello.features, "cap_sys_resource") {
        return Ok(());
    }
    let theirs: Vec<(String, u64)> = hello
        .hard_limits
        .iter()
        .map(|l| (l.name.clone(), l.hard))
        .collect();
    let node = node.to_owned();
    let obstacles = blocking("reading the tree's resource limits", move || {
        process::privileges::limits_above(&tree, &theirs, &node)
    })
    .await?;
    refuse_if_any(pid, &obstacles)
}

/// The destination carries every public address this node does: a
/// process's clients reach it by those (a listener on `::` takes both
/// families' clients). An older destination does not say: not checked.
fn public_addresses_fit(
    ours: crate::config::PublicAddresses,
    theirs: &[String],
    node: &str,
) -> Result<(), EngineError> {
    if theirs.is_empty() {
        return Ok(());
    }
    let parsed: Vec<std::net::IpAddr> = theirs.iter().filter_map(|a| a.parse().ok()).collect();
    match ours.iter().find(|a| !parsed.contains(a)) {
        None => Ok(()),
        Some(missing) => Err(EngineError::PublicAddressMissing {
            node: node.to_owned(),
            missing: missing.to_string(),
            theirs: theirs.join(" and "),
        }),
    }
}

/// `Peer.Hello`: the protocol version both speak, the strategy the
/// destination's features allow (`needs::settle`), and whether the
/// protocol carries it; post-copy also needs this host's pipes large
/// enough.
async fn hello(
    engine: &Engine,
    link: &dyn PeerLink,
    peer: &PeerConfig,
    pid: i32,
    asked: Asked,
) -> Result<(Greeted, MemoryStrategy), EngineError> {
    let hello = link
        .hello(HelloRequest {
            node: engine.node().to_owned(),
            protocol_versions: ferry_proto::PEER_PROTOCOL_VERSIONS.to_vec(),
        })
        .await
        .map_err(|s| peer_error(&peer.name, s))?;
    if !ferry_proto::PEER_PROTOCOL_VERSIONS.contains(&hello.protocol_version) {
        return Err(EngineError::NoCommonVersion {
            node: peer.name.clone(),
            theirs: vec![hello.protocol_version],
            ours: ferry_proto::PEER_PROTOCOL_VERSIONS.to_vec(),
        });
    }
    // What the destination lacks for the strategy, refused here already
    // (it refuses at Prepare too, but a source that knows asks nothing of
    // it), or, for a configured strategy, total copy instead.
    let mut fallbacks = Vec::new();
    let strategy = needs::settle(
        Role::Destination,
        asked.strategy,
        asked.defaulted,
        &hello.features,
        &peer.name,
        &hello.kernel,
        &mut fallbacks,
    )?;
    let needed = if strategy.is_postcopy() {
        ferry_proto::PEER_PROTOCOL_POSTCOPY
    } else if strategy.is_precopy() {
        ferry_proto::PEER_PROTOCOL_PRECOPY
    } else {
        0
    };
    if hello.protocol_version < needed {
        return Err(EngineError::NotMigratable {
            pid,
            reason: format!(
                "{} speaks peer protocol {}; {} needs {needed}",
                peer.name,
                hello.protocol_version,
                strategy.name(),
            ),
        });
    }
    if strategy.is_postcopy() {
        crate::criu::lazy::check_pipe_max_size().map_err(|e| {
            EngineError::HostSetting(format!("post-copy on {}: {e}", engine.node()))
        })?;
    }
    Ok((
        Greeted {
            response: hello,
            fallbacks,
        },
        strategy,
    ))
}

fn not_managed(pid: i32, node: &str) -> EngineError {
    EngineError::NotMigratable {
        pid,
        reason: format!(
            "it is not managed by ferry on {node} (start it with `ferry run -- CMD`; `ferry ps` lists managed processes)"
        ),
    }
}

fn check_migratable(engine: &Engine, pid: i32) -> Result<(), EngineError> {
    let node = engine.node();
    if pid == std::process::id() as i32 {
        return Err(EngineError::NotMigratable {
            pid,
            reason: format!("it is the ferry agent of {node} itself"),
        });
    }
    if pid == 1 {
        return Err(EngineError::NotMigratable {
            pid,
            reason: "PID 1 is the node's init".into(),
        });
    }
    let info = match process::inspect(pid) {
        Ok(i) => i,
        Err(process::ProcessError::NotFound { .. }) => {
            return Err(EngineError::NoSuchProcess {
                pid,
                node: node.to_owned(),
            });
        }
        Err(e) => return Err(e.into()),
    };
    if info.kernel_thread {
        return Err(EngineError::NotMigratable {
            pid,
            reason: "it is a kernel thread".into(),
        });
    }
    if info.state == 'Z' {
        return Err(EngineError::NotMigratable {
            pid,
            reason: "it has exited (zombie)".into(),
        });
    }
    if engine.processes.registry().get(pid).is_none() {
        return Err(not_managed(pid, node));
    }
    if let Some(reason) = engine.processes.pinned(pid) {
        return Err(EngineError::NotMigratable { pid, reason });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PublicAddresses;

    #[test]
    fn a_destination_lacking_a_public_address_of_ours_is_refused_naming_it() {
        let ours = PublicAddresses {
            v4: Some("198.18.0.100".parse().unwrap()),
            v6: Some("2001:2::100".parse().unwrap()),
        };
        let both = ["198.18.0.100".to_owned(), "2001:2::100".to_owned()];
        assert!(public_addresses_fit(ours, &both, "node2").is_ok());
        // An older node says nothing: not checked.
        assert!(public_addresses_fit(ours, &[], "node2").is_ok());
        // A destination with more than ours is fine.
        let v4_only = PublicAddresses { v6: None, ..ours };
        assert!(public_addresses_fit(v4_only, &both, "node2").is_ok());
        let e = public_addresses_fit(ours, &both[..1], "node2").unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        let text = e.to_string();
        assert!(
            text.contains("node2") && text.contains("2001:2::100") && text.contains("198.18.0.100"),
            "{text}"
        );
    }
}
