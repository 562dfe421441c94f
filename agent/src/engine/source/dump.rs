//! Dump, with the freeze inside it: CRIU (`--tcp-established` or, for a
//! collective migration, `--tcp-close`; `--network-lock skip`) starts while
//! the process still serves; at its `pre-dump` notification, just before it
//! seizes the process, the process's ports are cut off in the eBPF filter
//! here (no TCP out, so no RST; what comes in is captured, for a resume on
//! abort). CRIU leaves the process stopped, its TCP sockets in repair mode.
//! A CRIU that never sends `pre-dump` aborts the migration: the ports would
//! not have been frozen.
//!
//! Flush before freeze (the API's `MigrateRequest.drain_send_queues_ms`,
//! "drain" there for compatibility): the ports
//! stay open at `pre-dump`; at `query-ext-files`, with the tree stopped, the
//! send queues of its TCP connections get a bounded time to empty while
//! packets still flow, and only then are the ports cut off. The freeze
//! still starts at `pre-dump`: the wait is part of it.
//!
//! Collective: from `query-ext-files` on, the stopped tree's connections
//! are read on a thread of their own (`crate::engine::sockettaker`) and
//! their states leave for the destination as soon as they are read
//! (`transfer.rs`'s `send_sockets`, spawned here).
//!
//! Post-copy: CRIU dumps with `lazy_pages` and says `status-ready` once the
//! images are written and it serves the stopped process's pages, on a
//! loopback connection that the page tunnel carries to the destination
//! inside the peer connection (`crate::engine::pagetunnel`). The dump's
//! CRIU runs on as that page server (`post_copy.rs` ends it).
//!
//! Pre-copy: once the dump is done, with the process stopped, a last scan
//! says which of the pages the destination holds are still current, and
//! tracking ends.

use std::collections::HashMap;
use std::sync::atomic::AtomicI32;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::Phase;
use super::carry::{Dumped, Dumping, PageServer, Transferring};
use super::run::{Run, options_by_ferryd, out_stage};
use super::sockets::send_sockets;
use crate::criu::{self, Checkpointer, CriuError, HookRefused};
use crate::engine::link::{peer_error, silent};
use crate::engine::precopy::MemoryStrategy;
use crate::engine::sockettaker::{Incremental, ReadPlan, SocketTaker, Taken};
use crate::engine::{Engine, EngineError, blocking, pagetunnel};
use crate::managed::OutStage;
use crate::memtrack::RangeSet;
use crate::sockstate;
use crate::sync::lock;

/// Assisted post-copy: the most ranges `RestoreRequest.local_pages` names
/// (about 20 bytes each, well inside the peer's 16 MiB messages).
const MAX_LOCAL_RANGES: usize = 200_000;

/// What the dump's notification hook records for the migration.
#[derive(Default)]
struct Marks {
    /// When CRIU was about to stop the process (`pre-dump`).
    frozen_at: Mutex<Option<Instant>>,
    /// Flush before freeze: how the send queues emptied.
    flushed: Mutex<Option<sockstate::Flushed>>,
}

pub(super) async fn dump(run: &mut Run, d: Dumping) -> Result<Phase, EngineError> {
    if let Some(opening) = run.sched_hooks.take() {
        run.held_sched_hooks = crate::engine::held_sched_hooks(opening).await;
    }
    // Post-copy: the page server's connection, made before the freeze.
    // CRIU gets one end (this process closes its copy once CRIU runs), the
    // page tunnel the other.
    let (lazy, tunnel_end) = if run.p.strategy.is_postcopy() && !run.p.pages_follow {
        let pair = pagetunnel::loopback_pair().await?;
        (
            Some(criu::LazyDump {
                ps_socket: Arc::new(Mutex::new(Some(pair.criu))),
                config_file: run.dir.join("lazy-dump.conf"),
            }),
            Some(pair.ours),
        )
    } else {
        (None, None)
    };
    let held_pages = leave_held_pages_out(run).await?;
    // The mappings' flags by ferryd's iterator, where CRIU takes them and
    // the kernel has the iterator; otherwise CRIU reads smaps.
    let vma_flags_by_iterator =
        run.engine.criu.has_patch(criu::VMA_FLAGS_MARK) && vma_flags_iterator_here(run);
    let criu_pid = Arc::new(AtomicI32::new(0));
    let collective = run.p.socket_migration.is_collective();
    let marks = Arc::new(Marks::default());
    // Post-copy: CRIU says "status-ready" once the images are written and
    // its page server listens; the dump itself ends only when the
    // destination has every page.
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<Taken>();
    // Collective: the connections' states go to the destination as soon as
    // they are read, which is during the dump (`sockettaker.rs`).
    let (states_to, states_from) = tokio::sync::oneshot::channel();
    let task = DumpTask {
        engine: run.engine.clone(),
        id: run.p.migration_id.clone(),
        req: criu::DumpRequest {
            criu: run.engine.config.criu_path.clone(),
            pid: run.p.pid,
            images_dir: run.images(),
            log_dir: run.dir.clone(),
            log_level: run.engine.config.criu_log_level,
            tcp_connections: if collective {
                criu::TcpConnections::Skip
            } else {
                criu::TcpConnections::Dump
            },
            lazy: lazy.clone(),
            criu_pid: Some(criu_pid.clone()),
            tcp_options_by_caller: false,
            connections_out: false,
            held_pages,
            vma_flags_fds: Vec::new(),
        },
        capture: run.capture,
        collective,
        incremental: d.incremental,
        flush: run.p.flush_send_queues,
        takes_tcp_options: run.p.destination_takes_tcp_options,
        takes_connections_out: run.p.destination_takes_connections_out,
        marks: marks.clone(),
        ready_tx: Some(ready_tx),
        states_to,
        // Pre-copy's throttle, if the rounds converged with it: on until
        // CRIU is about to freeze the process.
        throttle: run.undo.precopy.as_mut().and_then(|p| p.throttle.take()),
        vma_flags_by_iterator,
    };
    let dump_task = tokio::task::spawn_blocking(move || task.run());
    // Spawned, not polled beside the dump: it runs while the dump does,
    // and a rollback waits for it before the destination hears the abort
    // (a socket transfer still in flight would leave the rebuilt copies
    // behind there).
    run.undo.sockets_sending = collective.then(|| {
        tokio::spawn(send_sockets(
            run.p.link.clone(),
            run.p.migration_id.clone(),
            run.engine.node().to_owned(),
            run.p.destination.clone(),
            run.deadline,
            states_from,
            d.armed_fixed.clone(),
        ))
    });
    let dumped = match tunnel_end {
        None => dump_task.await,
        Some(ours) => wait_for_page_server(run, dump_task, ready_rx, criu_pid, ours).await?,
    };
    run.freeze_start = *lock(&marks.frozen_at);
    remove_notes_to_criu(&run.images());
    if let Some(f) = *lock(&marks.flushed) {
        run.report.drain_time_us = f.waited.as_micros() as u64;
        run.report.drain_bytes_at_start = f.bytes_at_start;
        run.report.drain_bytes_left = f.bytes_left;
    }
    let dump_end = Instant::now();
    let (notes, taken) = dumped.map_err(|source| EngineError::Task {
        what: "the dump",
        source,
    })??;
    tracing::debug!(?notes, unread_datagrams = taken.unread.len(), "dump done");
    // Held from here: an abort turns repair off again.
    if taken.held.is_some() {
        run.undo.held = taken.held;
    }
    let Some(freeze_start) = run.freeze_start else {
        return Err(EngineError::Internal(
            "CRIU dumped without its pre-dump notification: the ports were never frozen".into(),
        ));
    };
    let held_pages = if held_pages {
        // CRIU left out the held pages not written since the last round
        // and dumped the rest: nothing is left to scan in the freeze (on
        // a 1 GiB process the last scan and the end of tracking took
        // ~145 ms). The tracker stays with the stopped process until the
        // commit (`discard`, which kills it) or an abort (which ends the
        // tracking before the process runs again) ends it.
        // Each pages image is still planned (nothing in it held: what
        // CRIU dumped was written), for the counts of what it left out.
        run.undo
            .precopy
            .as_ref()
            .map(|pre| {
                pre.held()
                    .into_iter()
                    .map(|(vpid, _)| (vpid, RangeSet::new()))
                    .collect()
            })
            .unwrap_or_default()
    } else {
        // Pre-copy: with the process stopped, the last scan says which of
        // the pages the destination holds are still current; tracking
        // ends.
        match run.undo.precopy.take() {
            Some(pre) => blocking("the last dirty-page scan", move || pre.finish()).await??,
            None => HashMap::new(),
        }
    };
    let local_pages = local_pages(run.p.strategy, &held_pages);
    Ok(Phase::Transfer(Transferring {
        freeze_start,
        dump_end,
        held_pages,
        local_pages,
        unread: taken.unread,
    }))
}

/// Pre-copy to a destination that fills held pages itself, with ferry's
/// held-pages patch here: lists the pages the destination holds for CRIU
/// (`ferry-held-<pid>.img`), which leaves them out of the dump unless the
/// process wrote them since the last round. Whether it does.
async fn leave_held_pages_out(run: &mut Run) -> Result<bool, EngineError> {
    if run.p.pages_follow {
        return leave_every_page_in_place(run).await.map(|()| true);
    }
    let Some(pre) = run.undo.precopy.as_ref() else {
        return Ok(false);
    };
    // Each way of dumping every page says why: a pre-copy whose freeze
    // carried every page once could not be told apart from one whose
    // held pages were all written again.
    let why_not = if run.p.strategy.is_postcopy() && !run.p.pages_follow {
        Some("CRIU's lazy pages take the pages")
    } else if !run.p.destination_fills_held_pages {
        Some("the destination does not fill held pages")
    } else if !criu::has_patch(&run.engine.config.criu_path, criu::HELD_PAGES_MARK) {
        Some("this CRIU lacks ferry's held-pages patch")
    } else {
        None
    };
    if let Some(why) = why_not {
        tracing::info!(why, "the dump writes every page");
        return Ok(false);
    }
    let held = pre.held();
    tracing::info!(
        processes = held.len(),
        pages = held.iter().map(|(_, s)| s.len()).sum::<u64>() / crate::memtrack::page_size(),
        "held pages left out of the dump unless written since"
    );
    let images = run.images();
    // Held pages of private file mappings and other areas a lazy restore
    // does not fill are left out too, when the destination gives the
    // restore a parent image of them and this CRIU can.
    let everywhere = run.p.destination_fills_held_pages_everywhere
        && criu::has_patch(&run.engine.config.criu_path, criu::HELD_EVERYWHERE_MARK);
    blocking("listing the held pages for CRIU", move || {
        for (vpid, set) in &held {
            if everywhere {
                criu::held::write_everywhere(&images, *vpid, set)?;
            } else {
                criu::held::write(&images, *vpid, set)?;
            }
        }
        Ok::<_, CriuError>(())
    })
    .await??;
    Ok(true)
}

/// Post-copy whose pages follow by ferryd: every process of the tree
/// holds all its pages with data for the dump (held-pages files "FHP2"),
/// which leaves them in the stopped copy; the processes are kept for the
/// sender.
async fn leave_every_page_in_place(run: &mut Run) -> Result<(), EngineError> {
    let (pid, images) = (run.p.pid, run.images());
    run.pages_follow_from = blocking("listing the held pages for CRIU", move || {
        let mut found = Vec::new();
        for p in crate::process::process_tree(pid) {
            let vpid = crate::memtrack::ns_pid(p)
                .map_err(EngineError::io(format!("reading the namespace PID of {p}")))?;
            criu::held::write_all(&images, vpid)?;
            found.push((vpid, p));
        }
        Ok::<_, EngineError>(found)
    })
    .await??;
    Ok(())
}

/// The held-page lists and the mappings' iterators, once CRIU has read
/// them: notes to this node's CRIU that the destination does not need.
fn remove_notes_to_criu(images: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(images) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name()
            .to_str()
            .is_some_and(|n| criu::held::is_held_file(n) || criu::vmflags::is_vmflags_file(n))
        {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Whether this node has the iterator over mappings CRIU's flags come
/// from; if not, the report says CRIU read smaps.
fn vma_flags_iterator_here(run: &mut Run) -> bool {
    if run.p.host.has("bpf_iter_task_vma") {
        return true;
    }
    let node = run.engine.node().to_owned();
    run.fall_back(
        "bpf_iter_task_vma",
        &node,
        "CRIU read the mappings' flags from smaps (a walk of every resident page in the freeze)"
            .into(),
    );
    false
}

/// Opens the iterators of the mappings' flags for each process of the
/// tree (`criu::vmflags`); `None`: CRIU reads smaps. Blocking.
fn hand_vma_flags(req: &criu::DumpRequest) -> Option<criu::vmflags::ForCriu> {
    let pids = crate::process::process_tree(req.pid);
    match criu::vmflags::prepare(&req.images_dir, &pids) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(error = %e, "the mappings' flags not handed to CRIU: it reads smaps");
            None
        }
    }
}

/// Post-copy: waits for CRIU's `status-ready` (images written, page server
/// listening) or the dump's end; with the page server up, opens the page
/// tunnel. Returns what the dump left as a finished dump would.
async fn wait_for_page_server(
    run: &mut Run,
    mut dump_task: tokio::task::JoinHandle<Result<Dumped, CriuError>>,
    ready_rx: tokio::sync::oneshot::Receiver<Taken>,
    criu_pid: Arc<AtomicI32>,
    ours: tokio::net::TcpStream,
) -> Result<Result<Result<Dumped, CriuError>, tokio::task::JoinError>, EngineError> {
    let no_server = || CriuError::Failed {
        operation: "dump",
        reason: "the lazy dump ended without its page server (no status-ready notification)".into(),
    };
    // Ready, or the dump's end (the hook is then gone too).
    enum Early {
        Ready(Taken),
        HookGone,
        Ended(Result<Result<Dumped, CriuError>, tokio::task::JoinError>),
    }
    let early = tokio::select! {
        r = ready_rx => match r { Ok(taken) => Early::Ready(taken), Err(_) => Early::HookGone },
        r = &mut dump_task => Early::Ended(r),
    };
    let ended = match early {
        Early::Ready(taken) => taken,
        Early::HookGone => {
            return Ok(match (&mut dump_task).await {
                Ok(Ok(_)) => Ok(Err(no_server())),
                other => other,
            });
        }
        Early::Ended(Ok(Ok(_))) => return Ok(Ok(Err(no_server()))),
        Early::Ended(other) => return Ok(other),
    };
    tracing::info!("images written; CRIU serves the pages");
    // The rollback needs the connections from here on.
    run.undo.held = ended.held.clone();
    run.undo.page_server = Some(PageServer {
        task: dump_task,
        criu_pid,
        tunnel: None,
    });
    let tunnel = open_page_tunnel(run, ours).await?;
    if let Some(s) = run.undo.page_server.as_mut() {
        s.tunnel = Some(tunnel);
    }
    Ok(Ok(Ok((Vec::new(), ended))))
}

/// Opens the page tunnel to the destination for a post-copy's page
/// server, whose connection's other end is `ours`, and starts its pump.
async fn open_page_tunnel(
    run: &Run,
    ours: tokio::net::TcpStream,
) -> Result<tokio::task::JoinHandle<Result<pagetunnel::Moved, EngineError>>, EngineError> {
    use tokio_stream::wrappers::ReceiverStream;
    let (tx, rx) = tokio::sync::mpsc::channel(pagetunnel::DEPTH);
    // The first message names the migration; the channel has room for it.
    let _ = tx
        .send(ferry_proto::v1::TunnelBytes {
            migration_id: run.p.migration_id.clone(),
            data: Vec::new(),
        })
        .await;
    let opened = tokio::time::timeout(
        run.deadline,
        run.p.link.page_tunnel(ReceiverStream::new(rx)),
    )
    .await;
    let inbound = match opened {
        Ok(Ok(r)) => r,
        Ok(Err(s)) => return Err(peer_error(&run.p.destination.name, s)),
        Err(_) => return Err(silent(&run.p.destination, "PageTunnel", run.deadline)),
    };
    Ok(tokio::spawn(pagetunnel::pump(ours, inbound, tx)))
}

/// Assisted post-copy: the pages of the live pass still current, which the
/// destination serves itself after the resume (the lazy dump left them
/// with CRIU's page server, where only the pages written since the live
/// pass are now fetched).
fn local_pages(
    strategy: MemoryStrategy,
    held_pages: &HashMap<u32, RangeSet>,
) -> Vec<ferry_proto::v1::StoredPages> {
    if strategy != MemoryStrategy::AssistedPostCopy {
        return Vec::new();
    }
    let mut ranges: Vec<_> = held_pages
        .iter()
        .flat_map(|(vpid, set)| {
            set.iter().map(|(s, e)| ferry_proto::v1::StoredPages {
                pid: *vpid,
                vaddr: s,
                length: e - s,
            })
        })
        .collect();
    if ranges.len() > MAX_LOCAL_RANGES {
        // The largest ones fit in the Restore message; the pages of the
        // others come from the source, correct but slower.
        tracing::warn!(
            ranges = ranges.len(),
            kept = MAX_LOCAL_RANGES,
            "the pass's pages are in too many pieces to name them all"
        );
        ranges.sort_unstable_by_key(|r| std::cmp::Reverse(r.length));
        ranges.truncate(MAX_LOCAL_RANGES);
    }
    ranges
}

/// The dump's blocking task: CRIU, and what its notifications set off.
struct DumpTask {
    engine: Arc<Engine>,
    id: String,
    req: criu::DumpRequest,
    capture: bool,
    collective: bool,
    incremental: Option<Arc<Incremental>>,
    flush: Option<std::time::Duration>,
    takes_tcp_options: bool,
    takes_connections_out: bool,
    marks: Arc<Marks>,
    ready_tx: Option<tokio::sync::oneshot::Sender<Taken>>,
    states_to: crate::engine::sockettaker::StatesTo,
    throttle: Option<crate::engine::throttle::Throttle>,
    /// CRIU takes the mappings' flags from ferryd's iterators.
    vma_flags_by_iterator: bool,
}

impl DumpTask {
    fn run(self) -> Result<Dumped, CriuError> {
        let criu: &dyn Checkpointer = self.engine.criu.as_ref();
        // Read once per CRIU binary, before CRIU starts.
        let during_dump = criu.has_patch(criu::DUMP_ROLLBACK_MARK);
        let mut req = self.req;
        // The mappings' flags for CRIU without smaps' page walk in the
        // freeze: iterators opened now, read by CRIU once the tree is
        // stopped; open until the dump ends.
        let vma_flags = self
            .vma_flags_by_iterator
            .then(|| hand_vma_flags(&req))
            .flatten();
        if let Some(v) = &vma_flags {
            req.vma_flags_fds = v.fds();
        }
        // Collective, and both ends' CRIU can leave the connections'
        // options to ferryd: CRIU's dump records the connections without
        // them and ferryd reads them with their state.
        req.tcp_options_by_caller =
            options_by_ferryd(self.collective, self.takes_tcp_options, criu);
        if req.tcp_options_by_caller {
            tracing::info!(
                "the connections' socket options move with their state, not in CRIU's images"
            );
            // And both ends' CRIU can leave the connections out of the
            // images altogether: the dump never passes them out of the
            // process, the restore installs ferryd's at their numbers.
            req.connections_out =
                self.takes_connections_out && criu.has_patch(criu::CONNS_OUT_MARK);
            if req.connections_out {
                tracing::info!("the connections are kept out of CRIU's images");
            }
        }
        let plan = ReadPlan {
            pid: req.pid,
            capture: self.capture,
            collective: self.collective,
            with_options: req.tcp_options_by_caller,
            incremental: self.incremental,
        };
        // Flush before freeze: the ports are cut off only once CRIU has
        // stopped the tree and its send queues emptied (or the bound
        // passed). Only with ferry's CRIU, which says query-ext-files as it
        // freezes the tree and network-unlock before it lets a failed
        // dump's tree run again.
        let flush = self.flush.filter(|_| {
            if !during_dump {
                tracing::warn!(
                    "flushing the send queues before the freeze needs ferry's patched CRIU (dump rollback notified): not flushed"
                );
            }
            during_dump
        });
        let mut hook = Notified {
            engine: &self.engine,
            id: &self.id,
            pid: req.pid,
            capture: self.capture,
            flush,
            marks: &self.marks,
            taker: Some(SocketTaker::new(
                plan,
                during_dump,
                self.collective.then_some(self.states_to),
            )),
            ready_tx: self.ready_tx,
            throttle: self.throttle,
            ports_frozen: false,
        };
        let dumped = criu.dump(&req, &mut |script| hook.on(script));
        if dumped.is_ok() && !hook.ports_frozen {
            // A flush waited for query-ext-files, which never came.
            return Err(CriuError::Failed {
                operation: "dump",
                reason: "CRIU froze the tree without its query-ext-files notification: \
                         the ports were never cut off for the flush before the freeze"
                    .into(),
            });
        }
        let dumped = match dumped {
            Ok(d) => d,
            Err(e) => {
                // CRIU said network-unlock first if it could; if it died
                // instead, this is the soonest.
                if let Some(mut t) = hook.taker.take() {
                    t.tree_thawing();
                }
                return Err(e);
            }
        };
        if req.lazy.is_some() {
            // Handed over at "status-ready", while this dump serves pages.
            return Ok((dumped, Taken::default()));
        }
        let taken = hook
            .taker
            .take()
            .map(|t| t.finish(true))
            .unwrap_or_default();
        Ok((dumped, taken))
    }
}

/// What CRIU's notifications set off during a dump.
struct Notified<'a> {
    engine: &'a Engine,
    id: &'a str,
    pid: i32,
    capture: bool,
    /// Flush before freeze, and its bound.
    flush: Option<std::time::Duration>,
    marks: &'a Marks,
    taker: Option<SocketTaker>,
    ready_tx: Option<tokio::sync::oneshot::Sender<Taken>>,
    throttle: Option<crate::engine::throttle::Throttle>,
    ports_frozen: bool,
}

impl Notified<'_> {
    fn on(&mut self, script: &str) -> Result<(), HookRefused> {
        match script {
            // CRIU is about to stop the tree.
            "pre-dump" => self.pre_dump(),
            // Sent right after CRIU froze the tree.
            "query-ext-files" => self.tree_frozen(),
            // A failed dump, about to let the tree run again.
            "network-unlock" => {
                if let Some(t) = self.taker.as_mut() {
                    t.tree_thawing();
                }
                Ok(())
            }
            "status-ready" => {
                if let Some(tx) = self.ready_tx.take() {
                    let taken = self
                        .taker
                        .take()
                        .map(|t| t.finish(false))
                        .unwrap_or_default();
                    let _ = tx.send(taken);
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn pre_dump(&mut self) -> Result<(), HookRefused> {
        // SIGCONT wakes the process at once: CRIU never finds it stopped
        // by the throttle (it would restore it stopped).
        drop(self.throttle.take());
        // Set before the filter changes: if that fails half-way, the abort
        // still reports the time the process was cut off. The process
        // stops here, also when its ports are cut off later (a flush).
        *lock(&self.marks.frozen_at) = Some(Instant::now());
        if self.flush.is_some() {
            return Ok(());
        }
        self.freeze_ports()
    }

    fn tree_frozen(&mut self) -> Result<(), HookRefused> {
        crate::engine::fault_point::reached_blocking(
            crate::engine::fault_point::Side::Source,
            "TreeFrozen",
        );
        let Some(bound) = self.flush.filter(|_| !self.ports_frozen) else {
            if let Some(t) = self.taker.as_mut() {
                t.tree_frozen();
            }
            return Ok(());
        };
        // The tree is stopped, its packets still flow: what it wrote
        // leaves, the peers' ACKs come back.
        let take_started = Instant::now();
        let taken = self.taker.as_ref().map(SocketTaker::take_now);
        tracing::debug!(
            ms = take_started.elapsed().as_secs_f64() * 1000.0,
            "the tree's sockets taken for the flush"
        );
        match &taken {
            Some(Ok(sockets)) => {
                let flushed = sockstate::flush_send_queues(sockets.tcp_descriptors(), bound);
                tracing::info!(
                    bytes_at_start = flushed.bytes_at_start,
                    bytes_left = flushed.bytes_left,
                    waited_ms = flushed.waited.as_secs_f64() * 1000.0,
                    "send queues flushed before the freeze"
                );
                *lock(&self.marks.flushed) = Some(flushed);
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, "taking the connections to flush them: not flushed")
            }
            None => {}
        }
        self.freeze_ports()?;
        if let Some(t) = self.taker.as_mut() {
            t.tree_frozen_taken(taken.and_then(Result::ok));
        }
        Ok(())
    }

    /// Cuts the process's ports off (captured, or dropped without capture).
    fn freeze_ports(&mut self) -> Result<(), HookRefused> {
        let capture = self.capture;
        self.engine
            .processes
            .set_lifecycle(self.pid, out_stage(self.id, OutStage::Frozen { capture }));
        self.ports_frozen = true;
        self.engine
            .ports
            .apply_now()
            .map_err(|e| HookRefused(e.to_string()))?;
        tracing::info!("ports frozen");
        Ok(())
    }
}
