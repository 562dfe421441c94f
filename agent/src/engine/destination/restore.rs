//! `Peer.Restore`: CRIU restores the process, left stopped; before that
//! its in-cluster connections move to this node's cluster address and are
//! held, and its UDP sockets get room for the replay.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_proto::v1::{RestoreRequest, RestoreResponse};

use super::{
    Incoming, RebuiltSockets, Step, UDP_CATCH_UP_BUFFER, expect, hold_in_cluster,
    in_cluster_addresses, record,
};
use crate::criu;
use crate::dataplane::translation::{self, InClusterFlow};
use crate::engine::fault_point::{self, Side};
use crate::engine::journal::IncomingStage;
use crate::engine::localpages::LocalPages;
use crate::engine::{Engine, EngineError, blocking};
use crate::memtrack::RangeSet;
use crate::process::Transport;
use crate::sockstate::Handover;

/// How long a lazy-pages daemon may take to listen for the restore.
pub(super) const LAZY_DAEMON_START: Duration = Duration::from_secs(10);

/// The connection a post-copy Restore's lazy-pages daemon gets: the end of
/// the page tunnel the source opened for this migration.
pub(super) fn lazy_tunnel_end(engine: &Engine, inc: &mut Incoming) -> Result<OwnedFd, EngineError> {
    if inc.protocol_version < ferry_proto::PEER_PROTOCOL_POSTCOPY {
        return Err(EngineError::WrongState {
            migration_id: inc.migration_id.clone(),
            state: "prepared with a protocol without post-copy",
            step: "post-copy restore",
        });
    }
    criu::lazy::check_pipe_max_size()
        .map_err(|e| EngineError::HostSetting(format!("post-copy on {}: {e}", engine.node())))?;
    inc.tunnel
        .as_mut()
        .and_then(|t| t.daemon_end.take())
        .ok_or_else(|| EngineError::WrongState {
            migration_id: inc.migration_id.clone(),
            state: "without an open page tunnel",
            step: "post-copy restore",
        })
}

/// Post-copy with pages that follow: a protocol that has it, no CRIU
/// lazy pages beside it, and a kernel whose userfaultfd the filler can use.
fn check_pages_follow(
    engine: &Engine,
    inc: &Incoming,
    req: &RestoreRequest,
) -> Result<(), EngineError> {
    if inc.protocol_version < ferry_proto::PEER_PROTOCOL_PAGES_FOLLOW {
        return Err(EngineError::WrongState {
            migration_id: inc.migration_id.clone(),
            state: "prepared with a protocol without pages that follow",
            step: "post-copy restore",
        });
    }
    if req.lazy_pages || !req.local_pages.is_empty() {
        return Err(EngineError::InvalidField {
            field: "pages_follow",
            reason: "pages that follow come from ferryd, not from CRIU's lazy pages (lazy_pages, local_pages)".into(),
        });
    }
    if !crate::fill::available(&engine.config.features_off) {
        return Err(EngineError::HostSetting(format!(
            "post-copy with pages that follow on {}: this kernel's userfaultfd lacks the events the page filler needs",
            engine.node()
        )));
    }
    Ok(())
}

/// Assisted post-copy: the pages Restore says this node holds current,
/// answered from the store from now on. Each must be in the store.
pub(super) fn set_local_pages(inc: &mut Incoming, req: &RestoreRequest) -> Result<(), EngineError> {
    let bad = |reason: String| EngineError::InvalidField {
        field: "local_pages",
        reason,
    };
    if !req.lazy_pages {
        return Err(bad(
            "only a lazy (post-copy) restore answers pages itself".into()
        ));
    }
    let Some(tunnel) = inc.tunnel.as_ref() else {
        return Err(EngineError::WrongState {
            migration_id: inc.migration_id.clone(),
            state: "without an open page tunnel",
            step: "post-copy restore",
        });
    };
    let mut held: HashMap<u32, RangeSet> = HashMap::new();
    {
        let store = crate::sync::lock(&inc.pages);
        for (i, p) in req.local_pages.iter().enumerate() {
            if p.length == 0 {
                return Err(bad(format!("[{i}]: an empty range")));
            }
            if let Some(addr) = store.first_missing(p) {
                return Err(bad(format!(
                    "[{i}]: page {addr:#x} of pid {} was never pre-copied here",
                    p.pid
                )));
            }
            held.entry(p.pid)
                .or_default()
                .insert(p.vaddr, p.vaddr + p.length);
        }
    }
    let pages: u64 = held.values().map(RangeSet::len).sum::<u64>() / crate::memtrack::page_size();
    tunnel
        .local
        .set(LocalPages {
            held,
            store: inc.pages.clone(),
        })
        .map_err(|_| bad("already set for this migration".into()))?;
    tracing::info!(migration = %inc.migration_id, pages, "pages of the live pass answered here");
    Ok(())
}

/// The page filler for the pages the dump left out (parent runs of the
/// pagemaps), started; none if the dump left none out. Pre-copy: this node
/// holds them, and each must be in the store (a dump that left out a page
/// this node lacks is refused here, before the restore). `follows`: a
/// post-copy whose pages come after the Commit (`pages_follow.rs`); the
/// filler installs them as they arrive. With it, how many pages the
/// restore reads from the parent image written from the store.
async fn start_filler(
    inc: &mut Incoming,
    follows: bool,
) -> Result<(Option<StartedFiller>, u64), EngineError> {
    let (images, store, dir) = (inc.images(), inc.pages.clone(), inc.dir.clone());
    let id = inc.migration_id.clone();
    let ahead = inc.filler_ahead.take();
    blocking("starting the page filler", move || {
        let PlannedFill {
            filler: planned,
            in_parent_pages: in_parent,
        } = plan_fill(&images, &store, &id, follows)?;
        let Some((plan, stores)) = planned else {
            // Nothing left out: the filler started ahead goes (dropped).
            return Ok((None, in_parent));
        };
        let fds: Vec<_> = stores.iter().map(AsFd::as_fd).collect();
        let within = crate::fill::handle::READY_WITHIN;
        let (wants_tx, wants) = if follows {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let filler = match ahead {
            Some(spawned) => spawned.start(&plan, &fds, within, wants_tx)?,
            None => {
                let exe = std::env::current_exe().map_err(EngineError::io(
                    "finding ferryd's own binary for the page filler",
                ))?;
                crate::fill::handle::Filler::start(&exe, &dir, &plan, &fds, within, wants_tx)?
            }
        };
        tracing::info!(
            pid = filler.pid(),
            tasks = plan.tasks.len(),
            mib = plan.bytes() >> 20,
            follows,
            "page filler ready for the pages left out of the dump"
        );
        Ok((
            Some(StartedFiller {
                filler,
                plan,
                wants,
            }),
            in_parent,
        ))
    })
    .await?
}

/// A page filler started for the restore, with its plan and (pages that
/// follow) its asks.
struct StartedFiller {
    filler: crate::fill::handle::Filler,
    plan: crate::fill::Plan,
    wants: Option<tokio::sync::mpsc::UnboundedReceiver<crate::fill::handle::Want>>,
}

/// Post-copy with pages that follow: the filler's plan and its asks, for
/// the source's page stream after the Commit.
fn following(
    inc: &Incoming,
    filler: &crate::fill::handle::Filler,
    plan: &crate::fill::Plan,
    wants: tokio::sync::mpsc::UnboundedReceiver<crate::fill::handle::Want>,
) -> Result<super::pages_follow::Following, EngineError> {
    let arrivals = filler.arrivals()?;
    let expected = plan
        .tasks
        .iter()
        .map(|t| {
            let mut set = RangeSet::new();
            for &(s, e) in &t.runs {
                set.insert(s, e);
            }
            (t.vpid, set)
        })
        .collect();
    Ok(super::pages_follow::Following::new(
        &inc.migration_id,
        &inc.from,
        inc.pages.clone(),
        arrivals,
        wants,
        expected,
    ))
}

/// Every page of `runs`, which the dump left out of process `pid` as held
/// here, is in the store: a dump that left out a page this node lacks is
/// refused before the restore.
fn all_held_here(
    store: &crate::engine::pagestore::PageStore,
    pid: u32,
    runs: &[ferry_criu_image::pagemap::PageRun],
    page: u64,
) -> Result<(), EngineError> {
    for r in runs {
        if let Some(addr) = store.first_missing(&ferry_proto::v1::StoredPages {
            pid,
            vaddr: r.vaddr,
            length: r.nr_pages * page,
        }) {
            return Err(EngineError::BadImage(format!(
                "the dump left out page {addr:#x} of pid {pid} as held here, but it was never pre-copied here"
            )));
        }
    }
    Ok(())
}

/// [`plan_fill`]'s answer.
struct PlannedFill {
    /// The filler's plan and the stores it reads; none if nothing is left
    /// to install lazily.
    filler: Option<(crate::fill::Plan, Vec<std::fs::File>)>,
    /// Pages the restore reads from the parent image written from the
    /// store.
    in_parent_pages: u64,
}

/// What the filler installs: per task with parent runs in its pagemap
/// (turned lazy here), those runs cut at its memory areas, and its store;
/// and how many pages left out of areas a lazy restore does not fill the
/// restore reads from the parent image written here from the store.
fn plan_fill(
    images: &std::path::Path,
    store: &std::sync::Mutex<crate::engine::pagestore::PageStore>,
    migration_id: &str,
    follows: bool,
) -> Result<PlannedFill, EngineError> {
    use ferry_criu_image::{mm, pagemap};
    let image_err = |what: &'static str| move |source| EngineError::Image { what, source };
    let mut pids: Vec<u32> = std::fs::read_dir(images)
        .map_err(EngineError::io(format!("listing {}", images.display())))?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            name.strip_prefix("pagemap-")?
                .strip_suffix(".img")?
                .parse()
                .ok()
        })
        .collect();
    pids.sort_unstable();
    let mut plan = crate::fill::Plan {
        migration_id: migration_id.to_owned(),
        workers: std::thread::available_parallelism().map_or(2, |n| n.get().min(4)),
        follows,
        tasks: Vec::new(),
    };
    let mut stores = Vec::new();
    let mut in_parent_pages = 0u64;
    let mut store = crate::sync::lock(store);
    for pid in pids {
        let vmas = mm::read_vmas(images, pid).map_err(image_err("reading the memory areas"))?;
        let left = pagemap::prepare_left_out(images, pid, &vmas)
            .map_err(image_err("turning the pages left out into lazy runs"))?;
        let page = crate::memtrack::page_size();
        // Pages left out of areas a lazy restore does not fill (ferry's
        // held-pages-everywhere patch: private file mappings the process
        // wrote): the restore reads them from a parent image written here
        // from the store, a local copy of a few pages.
        if !left.in_parent.is_empty() {
            if follows {
                return Err(EngineError::BadImage(format!(
                    "pid {pid}: the dump left out pages outside the areas a lazy restore fills, \
                     but they follow from the source"
                )));
            }
            all_held_here(&store, pid, &left.in_parent, page)?;
            let file = store
                .file(pid)
                .ok_or_else(|| EngineError::BadImage(format!("pid {pid}: no page store here")))?;
            let bytes = pagemap::write_parent(images, pid, &left.in_parent, |vaddr, buf| {
                use std::os::unix::fs::FileExt;
                file.read_exact_at(buf, vaddr)
            })
            .map_err(image_err("writing the held pages the restore reads"))?;
            in_parent_pages += bytes / page;
            tracing::debug!(
                pid,
                bytes,
                runs = left.in_parent.len(),
                "held pages of areas not filled lazily, in the parent image"
            );
        }
        let lazy = left.lazy;
        if lazy.is_empty() {
            continue;
        }
        if !follows {
            all_held_here(&store, pid, &lazy, page)?;
        }
        let mut task = crate::fill::TaskPlan {
            vpid: pid,
            store: stores.len(),
            windows: Vec::new(),
            runs: Vec::new(),
        };
        for r in &lazy {
            let (mut at, end) = (r.vaddr, r.vaddr + r.nr_pages * page);
            while at < end {
                let Some(v) = vmas.iter().find(|v| v.start <= at && at < v.end) else {
                    return Err(EngineError::BadImage(format!(
                        "pid {pid}: lazy page {at:#x} is in no memory area of its mm image"
                    )));
                };
                let cut = end.min(v.end);
                task.runs.push((at, cut));
                if task.windows.last() != Some(&(v.start, v.end)) {
                    task.windows.push((v.start, v.end));
                }
                at = cut;
            }
        }
        let file = if follows {
            store.open(pid)?
        } else {
            store
                .file(pid)
                .ok_or_else(|| EngineError::BadImage(format!("pid {pid}: no page store here")))?
        }
        .try_clone()
        .map_err(EngineError::io("duplicating a page store"))?;
        stores.push(file);
        plan.tasks.push(task);
    }
    Ok(PlannedFill {
        filler: (!plan.tasks.is_empty()).then_some((plan, stores)),
        in_parent_pages,
    })
}

/// Finds the process's connections to other cluster nodes in its images,
/// gives them this node's cluster address and holds them (blocking). All
/// holds or none.
pub(super) fn take_in_cluster(
    engine: &Engine,
    images: &std::path::Path,
    from: &str,
) -> Result<Vec<InClusterFlow>, EngineError> {
    let here = engine.config.cluster.address;
    let (source, nodes) = in_cluster_addresses(engine, from)?;
    let flows = translation::rewrite_in_cluster(images, source, here, &nodes)?;
    hold_in_cluster(engine, flows)
}

/// Whether the images keep connections out (ferry's connections-out
/// patch: `ferry-conns-<files id>.img` lists their descriptors).
pub(super) fn images_keep_connections_out(images: &std::path::Path) -> Result<bool, EngineError> {
    let entries = std::fs::read_dir(images)
        .map_err(EngineError::io(format!("listing {}", images.display())))?;
    Ok(entries.flatten().any(|e| {
        e.file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(criu::CONNS_OUT_IMAGE_PREFIX))
    }))
}

pub async fn restore(
    engine: &Arc<Engine>,
    req: RestoreRequest,
) -> Result<RestoreResponse, EngineError> {
    let mut slot = engine.incoming.lock().await;
    let inc = expect(&mut slot, &req.migration_id, Step::Restore)?;
    if req.pages_follow {
        check_pages_follow(engine, inc, &req)?;
    }
    if !req.local_pages.is_empty() {
        set_local_pages(inc, &req)?;
    }
    let lazy_from = if req.lazy_pages {
        Some(lazy_tunnel_end(engine, inc)?)
    } else {
        None
    };
    let image_scan = prepare_images(engine, inc).await?;
    // Pre-copy: pages the dump left out, filled from the store after the
    // resume; post-copy with pages that follow: as they arrive. Listening
    // before the restore starts, like a daemon.
    // Pages that follow: the source's stream may open from now on (the
    // restore itself faults on some of them).
    let (started, held_pages_restored) = if lazy_from.is_none() {
        start_filler(inc, req.pages_follow).await?
    } else {
        (None, 0)
    };
    if let Some(started) = started {
        inc.peak.watch(started.filler.pid());
        if let Some(wants) = started.wants {
            let f = Arc::new(following(inc, &started.filler, &started.plan, wants)?);
            engine.incoming.follows.insert(f.clone());
            inc.following = Some(f);
        }
        inc.filler = Some(started.filler);
    }
    let handed = if req.collective_sockets {
        hand_over_connections(engine, inc, lazy_from.is_some())?
    } else {
        HandedOver::default()
    };
    let creq = criu::RestoreRequest {
        criu: engine.config.criu_path.clone(),
        images_dir: inc.images(),
        log_dir: inc.dir.clone(),
        log_level: engine.config.criu_log_level,
        inherited_tcp: handed.inherited_tcp,
        lazy_pages: lazy_from.is_some() || inc.filler.is_some(),
        killed_at: fault_point::kills_criu(Side::Destination, "Restoring")
            .then(|| "post-restore".to_owned()),
    };
    let started = Instant::now();
    // Post-copy: the daemon must listen (and reach the page server) before
    // the restore starts: the restorer itself faults on lazy pages.
    if let Some(tunnel_end) = lazy_from {
        let daemon = criu::lazy::start(
            &engine.config.criu_path,
            &inc.images(),
            &inc.dir,
            tunnel_end,
            engine.config.criu_log_level,
            LAZY_DAEMON_START,
        )
        .await?;
        tracing::info!(
            pid = daemon.pid,
            "lazy-pages daemon listening, on the page tunnel"
        );
        inc.peak.watch(daemon.pid);
        inc.lazy = Some(daemon);
    }
    let (worker, rebuilt) = (handed.worker, handed.rebuilt);
    let (restored, options_set, rebuilt) = blocking("the restore", move || {
        let (restored, options_set) = restore_beside_options(&creq, worker, rebuilt.as_ref());
        (restored, options_set, rebuilt)
    })
    .await?;
    // CRIU restored the tree and its record is not written: what an agent
    // killed inside CRIU's restore leaves (CRIU finishes by itself).
    fault_point::reached(Side::Destination, "RestoredUnrecorded").await;
    drop(handed.connection_table);
    let outcome = match restored {
        Ok(r) => r,
        Err(e) => {
            // Closed in repair mode: nothing reaches the peers.
            drop(rebuilt);
            if let Some(mut d) = inc.lazy.take() {
                let _ = d.child.kill().await;
                tracing::warn!(log = %criu::lazy::log_tail(&d.work_dir.join(criu::lazy::LOG)), "restore failed; lazy-pages daemon killed");
            }
            if let Some(f) = inc.filler.take() {
                let _ = tokio::task::spawn_blocking(move || f.kill()).await;
                tracing::warn!("restore failed; page filler killed");
            }
            // A CRIU that failed kills what it restored; one that died
            // (killed, crashed) cannot, and its tasks are nobody's.
            super::kill_unrecorded_copies(engine, &inc.migration_id, inc.prepared_ticks, &inc.argv)
                .await;
            return Err(e.into());
        }
    };
    // Out of repair mode before the commit, while the source translates
    // and commits: not beside the restore, whose binds (a listening socket
    // on the connections' port) need them in it (repair mode forces the
    // port's reuse; taking it out and giving SO_REUSEADDR back leaves a
    // moment without).
    inc.leaving = rebuilt.map(|r| {
        std::thread::spawn(move || {
            let started = Instant::now();
            let left = r.leave_repair_early();
            tracing::debug!(
                connections = left,
                of = r.len(),
                ms = started.elapsed().as_secs_f64() * 1000.0,
                "out of repair mode before the commit"
            );
            r
        })
    });
    let restore_time = started.elapsed();
    tracing::info!(
        pid = outcome.pid,
        ms = restore_time.as_secs_f64() * 1000.0,
        "restored (stopped)"
    );
    // The filler kills the tree should it fail, even with ferryd gone by
    // then (killed during the fill): a page it did not install would read
    // as zeros once no one holds the userfaultfds.
    if let Some(filler) = &inc.filler {
        let tree = crate::process::process_tree(outcome.pid);
        if let Err(e) = filler.guard(&tree) {
            tracing::warn!(error = %e, "handing the restored tasks to the page filler");
        }
    }
    // CRIU made it our child (rst_sibling): reap it whenever it ends.
    engine.supervisor.watch_exit(outcome.pid, "restored");
    inc.peak.watch(outcome.pid);
    inc.advance(Step::Restore, outcome.pid);
    // Restored, so the source's Abort kills this copy, and so does a
    // restart of this agent (the journal).
    record(engine, inc, outcome.pid, IncomingStage::Restored)?;
    fault_point::reached(Side::Destination, "Restored").await;
    options_set?;
    Ok(RestoreResponse {
        pid: outcome.pid,
        restore_time_us: restore_time.as_micros() as u64,
        in_cluster: inc.in_cluster.iter().map(|f| f.to_pb()).collect(),
        // CRIU restores without notifications ([`criu::restore`]): its
        // start-up is not timed apart.
        criu_startup_us: 0,
        image_scan_us: image_scan.as_micros() as u64,
        held_pages_restored,
    })
}

/// CRIU's restore, with the socket options ferryd carries set on the
/// rebuilt connections beside it, on the core the restore leaves idle
/// ([`crate::sockstate::Rebuilt::apply_options`]); both end before the
/// answer. Blocking.
fn restore_beside_options(
    creq: &criu::RestoreRequest,
    worker: Option<criu::Worker>,
    rebuilt: Option<&crate::sockstate::Rebuilt>,
) -> (
    Result<criu::RestoreOutcome, criu::CriuError>,
    Result<(), crate::sockstate::SockStateError>,
) {
    std::thread::scope(|s| {
        let options = rebuilt
            .filter(|r| r.has_options())
            .map(|r| s.spawn(move || r.apply_options()));
        let restored = criu::restore(creq, worker);
        let options_set = options.map_or(Ok(()), |h| {
            h.join().unwrap_or_else(|_| {
                Err(crate::sockstate::SockStateError::Sys {
                    op: "setting socket options",
                    conn: "?".into(),
                    source: std::io::Error::other("the thread panicked"),
                })
            })
        });
        (restored, options_set)
    })
}

/// The images made ready for this node before CRIU reads them: the
/// process's connections to other cluster nodes moved to this node's
/// cluster address and held, its UDP sockets given room for the replay and
/// the catch-up (see `sockstate::give_back_udp_buffers`). Returns how long
/// that took.
async fn prepare_images(
    engine: &Arc<Engine>,
    inc: &mut Incoming,
) -> Result<std::time::Duration, EngineError> {
    let scan_started = Instant::now();
    if inc.in_cluster.is_empty() {
        let (a, images, from) = (engine.clone(), inc.images(), inc.from.clone());
        inc.in_cluster = blocking("rewriting the in-cluster connections", move || {
            take_in_cluster(&a, &images, &from)
        })
        .await??;
    }
    // After the in-cluster rewrite: the addresses recorded are the ones
    // the UDP sockets are restored on.
    let has_udp = inc.ports.iter().any(|p| p.transport == Transport::Udp);
    if has_udp && inc.udp_buffers.is_none() {
        let images = inc.images();
        let raised = blocking("raising the UDP receive buffers", move || {
            ferry_criu_image::raise_receive_buffers(
                &images,
                ferry_criu_image::IPPROTO_UDP,
                UDP_CATCH_UP_BUFFER as u32,
            )
        })
        .await?
        .map_err(|e| EngineError::BadImage(format!("raising the UDP receive buffers: {e}")))?;
        inc.udp_buffers = Some(
            raised
                .into_iter()
                .map(|r| (r.socket.local, r.before as i32))
                .collect(),
        );
    }
    Ok(scan_started.elapsed())
}

/// What a collective restore hands CRIU, and what must live until CRIU
/// has read it.
#[derive(Default)]
struct HandedOver {
    /// The descriptors CRIU inherits, by key (`None`: CRIU's own path).
    inherited_tcp: Option<Vec<(String, i32)>>,
    /// The table of the connections (a CRIU with ferry's connections-table
    /// patch): open until CRIU has read it.
    connection_table: Option<OwnedFd>,
    /// The CRIU started at Prepare, when the restore can use it.
    worker: Option<criu::Worker>,
    /// The connections TransferSockets rebuilt, in repair mode.
    rebuilt: Option<crate::sockstate::Rebuilt>,
}

/// Collective sockets: the connections TransferSockets rebuilt (on this
/// node's cluster address where they were in-cluster ones, which must be
/// the ones the images name), handed to CRIU. `lazy`: a post-copy, whose
/// restore waits for its lazy-pages daemon first and so does not use the
/// CRIU started at Prepare.
fn hand_over_connections(
    engine: &Engine,
    inc: &mut Incoming,
    lazy: bool,
) -> Result<HandedOver, EngineError> {
    let sockets = match engine.incoming.take_sockets() {
        Some(s) if s.migration_id == inc.migration_id && s.from == inc.from => s,
        Some(s) => {
            return Err(EngineError::InvalidField {
                field: "collective_sockets",
                reason: format!(
                    "the connections rebuilt here are migration {}'s, not this one's",
                    s.migration_id
                ),
            });
        }
        // A process without connections sends none (and no
        // TransferSockets): nothing to inherit.
        None => RebuiltSockets::none(&inc.migration_id, &inc.from),
    };
    for f in &inc.in_cluster {
        let moved = sockets
            .relocated
            .iter()
            .any(|(local, remote)| *local == f.new_local && *remote == f.remote);
        if !moved {
            return Err(EngineError::Internal(format!(
                "in-cluster connection {} -> {} is in the images but was not rebuilt on {}",
                f.old_local, f.remote, f.new_local
            )));
        }
    }
    // Connections kept out of the images: this node's CRIU installs them
    // from the table, and the in-cluster ones among them are known from the
    // rebuild alone.
    if images_keep_connections_out(&inc.images())? {
        if sockets.handover != Handover::Table
            || !criu::has_patch(&engine.config.criu_path, criu::CONNS_OUT_MARK)
        {
            return Err(criu::CriuError::Unpatched {
                path: engine.config.criu_path.clone(),
                what: "connections kept out of the images",
            }
            .into());
        }
        let fresh: Vec<_> = sockets
            .in_cluster
            .iter()
            .filter(|f| !inc.in_cluster.contains(f))
            .cloned()
            .collect();
        let held = hold_in_cluster(engine, fresh)?;
        inc.in_cluster.extend(held);
    }
    let mut handed = HandedOver::default();
    let fds = match (&sockets.rebuilt, sockets.handover) {
        (None, _) => Vec::new(),
        (Some(r), Handover::Table) => {
            // Into the table the CRIU started at Prepare inherited, if
            // there is one.
            let table = match inc.restore_worker.take().filter(|_| !lazy) {
                Some(w) => {
                    r.write_connection_table(w.table.as_fd())?;
                    handed.worker = Some(w.worker);
                    w.table
                }
                None => r.connection_table()?,
            };
            let fds = vec![(
                crate::sockstate::CONNECTION_TABLE_KEY.to_owned(),
                table.as_raw_fd(),
            )];
            handed.connection_table = Some(table);
            fds
        }
        (Some(r), h) => r.inherit_fds(h == Handover::ByPidfd),
    };
    handed.rebuilt = sockets.rebuilt;
    handed.inherited_tcp = Some(fds);
    Ok(handed)
}
