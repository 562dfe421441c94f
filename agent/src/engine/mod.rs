//! The migration engine (the `migd` of Gerofi et al. (DVE)), peer protocol version 11.
//!
//! # The migration protocol
//!
//! The steps of a migration as both agents see them, in order. The source
//! drives them as a typed state machine ([`source`]: one phase per file,
//! its table of transitions checked by a test); the destination answers
//! each Peer call in a file of its own ([`destination`]).
//!
//! - **Validate**: the PID exists, is managed here, is not the agent, PID 1
//!   or a kernel thread; the destination is a known other node; CRIU is
//!   present and new enough. Nothing has been touched yet.
//! - **Prepare**: `Peer.Hello` picks the protocol version, `Peer.Prepare`
//!   reserves the destination (one incoming migration at a time).
//! - **Pre-copy** (strategies `pre-copy` and `queued-pre-copy`, protocol
//!   5): dirty tracking starts on every process of the tree
//!   ([`crate::memtrack`]: userfaultfd write protection created inside the
//!   process over ptrace, and `PAGEMAP_SCAN`), and rounds stream the
//!   private memory to the destination while the process runs
//!   (`TransferPages`), until the convergence predicate says freeze
//!   ([`precopy`]). After the dump, with the process stopped, a last scan
//!   says which of the pages the destination holds are still current, and
//!   tracking ends; the Transfer then names those pages (`StoredPages`)
//!   instead of carrying them. An abort ends tracking before the process
//!   resumes: no write protection outlives a migration.
//!   **Pages left out** (a destination whose `PrepareResponse` says
//!   `fills_held_pages`, and a source CRIU with ferry's held-pages patch;
//!   new fields, no new version: an older peer leaves them unset): the
//!   source lists the held pages for CRIU, whose dump leaves out those
//!   not written since the last round (holes "in the parent" in the
//!   pagemap), so neither the dump, the transfer nor the restore touches
//!   them inside the freeze, and there is no last scan. The destination
//!   turns those holes into lazy entries, restores with lazy pages and
//!   hands the userfaultfds to its page filler ([`crate::fill`]), which
//!   installs the pages from its page store after the resume, faults
//!   first. With `fills_held_pages_everywhere` (and the
//!   held-pages-everywhere patch) the holes also cover areas a lazy
//!   restore does not fill (private file mappings the process wrote);
//!   the destination writes a parent image of those pages from its store
//!   and the restore reads them from it, a few local pages in the freeze. The process never waits on the source for them. After
//!   Discard the source asks `Peer.PostCopyStatus` how the fill went
//!   (**Fill**): a failed fill means the destination killed the process
//!   (its missing pages would read as zeros) and the report says
//!   `MIGRATION_OUTCOME_LOST`.
//! - **Room**: at Prepare the source sends the tree's resident and dumped
//!   bytes, and a destination that cannot hold them (MemAvailable or its
//!   `[migration] incoming_memory_limit_mib`; its work dir's free space; a
//!   tmpfs work dir counts against memory) refuses with
//!   RESOURCE_EXHAUSTED, before anything stops.
//! - **Pre-read** (incremental socket migration only, no peer call): the
//!   source attaches a setsockopt watch (a `cgroup/setsockopt` eBPF
//!   program, `ferry_ebpf::SockoptWatch`) to the process tree's cgroups,
//!   then reads what does not move of every established connection (its
//!   addresses, SO_REUSEADDR and socket options) while the process runs
//!   ([`crate::sockstate::Preread`]). Inside the freeze only connections
//!   the watch saw a setsockopt call on, and new ones, are read whole. A
//!   watch that cannot attach (no cgroup v2) turns the migration into a
//!   collective one, with the reason in the report. The watch is detached
//!   when the migration ends, whatever its outcome.
//! - **Arm** (skipped with `[dataplane] capture = false`): the source starts
//!   logging what it delivers to the process's ports (`Recording`), then
//!   `Peer.Arm` makes the destination capture every packet to all of them
//!   in one call. From here no packet for the process is lost: the
//!   broadcast cluster brings each one to both nodes. Incremental, from
//!   protocol 7: Arm also names the connections pre-read (inode and ends),
//!   and the destination opens their sockets before it answers (repair
//!   mode, bound; [`crate::sockstate::stage()`]), so that the rebuild in
//!   the freeze starts from them. They close with the incoming slot.
//!   From protocol 9 each comes with what the freeze does not change (its
//!   handshake's options, SO_REUSEADDR, its socket options:
//!   `StagedConnection.fixed`), which the destination keeps by inode.
//! - **Dump**, with the **Freeze** inside it: CRIU (`--tcp-established
//!   --network-lock skip`) starts while the process still serves; at its
//!   `pre-dump` notification, just before it seizes the process, the
//!   process's ports are cut off in the eBPF filter on the source (no TCP
//!   out, so no RST; UDP the process sends before CRIU stops it still leaves; what comes in is captured there too, for a resume on
//!   abort). CRIU leaves the process stopped, its TCP sockets in repair
//!   mode; then the log of what the source delivered since Arm is taken.
//!   A CRIU that never sends `pre-dump` aborts the migration: the ports
//!   would not have been frozen.
//!   Flush before freeze (`MigrateRequest.drain_send_queues_ms`): the
//!   ports stay open at `pre-dump`; at `query-ext-files`, with the tree
//!   stopped, the source waits (bounded) for the send queues of its TCP
//!   connections to empty while packets still flow, and only then cuts the
//!   ports off and reads the sockets. The freeze still starts at
//!   `pre-dump`: the wait is part of it (reported as `drain_time_us`). A
//!   CRIU that never sends `query-ext-files` then aborts the migration.
//!   With collective socket migration (the default from protocol 4, see
//!   [`crate::sockstate`]) CRIU dumps with `--tcp-close` instead: it
//!   records each connection's file and options but not its TCP state.
//! - **Transfer**: the images stream to the destination (`TransferImages`);
//!   from protocol 3 small files are packed into few messages (an
//!   iteratively dumped 1024-connection process has ~1,000 images).
//!   Collective: beside the transfer, the source takes every established
//!   connection of the stopped process into ferryd (`pidfd_getfd`), turns
//!   repair on, reads all their states into one buffer and sends it
//!   (`TransferSockets`; incremental: read by the TCP state iterator
//!   without repair mode, which the connections with bytes queued take
//!   at once and the others while the destination restores; from
//!   protocol 9 those whose fixed part crossed at Arm unchanged go as
//!   packed records of what moves, [`crate::sockstate::packed`]); the
//!   destination rebuilds them all in repair mode
//!   (on its own cluster address for in-cluster ones) while images still
//!   arrive.
//! - **Restore**: the destination restores the process, left stopped, as a
//!   child of its agent (collective: with the rebuilt connections handed to
//!   CRIU as inherited descriptors). Its success is the destination's confirmation.
//!   Before that it rewrites the process's connections to other cluster
//!   nodes to its own cluster address and holds them (nothing in or out);
//!   the response lists them (see [`crate::dataplane::translation`]). It also raises
//!   the receive buffer of the process's UDP sockets in the images, so that
//!   CRIU restores them with room for the replay and the catch-up (their
//!   own size comes back 2 s after the resume).
//! - **Translate** (only with such connections): the source has each
//!   peer's node rewrite those flows (`Peer.AddTranslations`); an abort
//!   from here on undoes it (`RemoveTranslations`) before the process
//!   resumes on the source.
//! - **Release**: the source's stopped copy gives up its ports; it stays
//!   stopped, its sockets in repair mode (nothing leaves them). This is
//!   the commit point.
//! - **Commit**: carries the source's delivered log and the UDP datagrams
//!   the process left unread (whole from protocol 8, see `queued.rs`; as
//!   keys from 4). The destination drops
//!   its holds on in-cluster connections, opens egress, takes collectively
//!   rebuilt connections out of repair mode (only then may they send),
//!   resumes the process, hands it the datagrams the source's sockets
//!   held unread, and then replays the captured packets into its
//!   stack in arrival order while ingress stays captured (each
//!   connection's consecutive segments joined into one, see
//!   `ferry_ebpf::coalesce`; a large batch is cut by connection and
//!   replayed on one thread per CPU, see `capture::lane_of`), skipping
//!   those the log says the source handled (the longest prefix of the
//!   capture matching the log's end); then it lets the ports pass packets
//!   and replays the last few captured meanwhile. The answer carries how
//!   long the process had been running (`running_for_us`), which the
//!   source takes off its freeze.
//!   A Commit whose answer does not come (the link cut, the destination's
//!   agent killed) leaves the source not knowing whether the process
//!   resumed there: it retries the Commit, and then (protocol 11) asks
//!   `Peer.Abort`, whose answer says whether the destination had
//!   committed; until an answer comes the copy here stays stopped, "in
//!   doubt" (`ferry ps`), neither resumed (the process could run twice)
//!   nor killed (it could run nowhere). Committed: Discard; not: the
//!   destination dropped its copy and the source rolls back.
//! - **Journal** ([`journal`], protocol 11): each side records where a
//!   migration stands, so that an agent killed in the middle settles it
//!   when it comes back ([`recover`]): the source from Start (no Commit
//!   sent: resume) and from just before the first Commit (released: ask
//!   the destination); the destination once restored (kill that copy)
//!   and, before the resume, committed (the process is its own; the
//!   record answers the source's question later).
//! - **Discard**: the answer in, the source kills its stopped copy (its
//!   sockets close silently, in repair mode) and forgets it. The Commit
//!   does not wait for that exit (a thousand descriptors closed, their
//!   /proc entries dropped), whose CPU the destination needs inside the
//!   freeze on a small machine.
//! - **Abort**, from any step before Release (or a Commit the destination
//!   did not commit): the destination drops images,
//!   captured packets and any restored copy; the source takes its sockets
//!   out of repair mode (the collectively read ones with their own
//!   SO_REUSEADDR), resumes the process, replays what it captured
//!   while frozen and owns the ports again. Nothing is lost.
//!
//! Version 1 of the protocol (the foundation's) had no Arm: packets that
//! arrived during the freeze were dropped and TCP retransmitted them after
//! at least its 200 ms minimum retransmission timeout. Version 3 differs
//! from 2 only in the packing of images; a source sends packed images only
//! to a destination that chose 3 in `Hello`. Version 4 adds collective
//! socket migration (`TransferSockets`, `Restore.collective_sockets`) and
//! the unread UDP datagrams in `Commit`; a source uses it only with a destination that
//! chose 4, and otherwise moves connections CRIU's way (the report says
//! which way they moved, and why). Version 5 adds pre-copy
//! (`TransferPages`, `StoredPages` in the image stream); a source asks for
//! a pre-copy strategy only from a destination that chose 5, and refuses
//! the migration before touching anything otherwise (`precopy.rs`).
//! Version 7 adds `ArmRequest.connections` and
//! `TransferSocketsResponse.staged`; a source names the connections only
//! to a destination that chose 7 (an older one would ignore them).
//! Version 8 carries the unread UDP datagrams whole in `Commit`
//! (`queued_datagrams`); with a destination that chose 4 to 7 the source
//! sends their keys, and those queued before Arm are lost.
//! Version 9 adds `StagedConnection.fixed` and
//! `TransferSocketsRequest.packed`; a source sends fixed parts only to a
//! destination that chose 9, and packs only connections it described so.
//! Version 10 adds post-copy pages that follow by ferryd (below).
//! Version 11 adds `AbortResponse.committed`: a destination of 11 keeps a
//! journal of what it committed and answers an Abort of a committed
//! migration with it; a source asks that way only a destination that
//! chose 11 (an older one answers every Abort alike), and with an older
//! one keeps the old rule (an unconfirmed Commit counts as committed).
//!
//! # Post-copy (protocol 6)
//!
//! ```text
//! Validate ─> Prepare ─> Arm ─> Dump (lazy) ─> Transfer ─> Restore (lazy) ─> Translate ─> Release ─> Commit ─> Post-copy ─> Discard ─> Committed
//!    │           │        │        │              │            │                │            │         │           │
//!    └─ error    └────────┴────────┴──────────────┴────────────┴────────────────┴────────────┴─> Abort └─ refused  └─ daemon failed ─> Discard ─> Lost
//! ```
//!
//! - **Dump (lazy)**: CRIU dumps with `lazy_pages`: every image but the
//!   private anonymous memory, then (notification `status-ready`) serves
//!   those pages from the stopped process. It listens nowhere: it serves
//!   on a loopback connection the source agent made to itself (CRIU's
//!   `ps-socket`, given through a CRIU config file since the RPC takes a
//!   page-server descriptor only for a restore), and the agent opens
//!   `PageTunnel` to carry that connection to the destination inside the
//!   peer TLS (`pagetunnel.rs`). The dump's CRIU blocks as that page
//!   server until the destination's daemon closes the connection; ferry
//!   keeps it running beside the migration.
//! - **Restore (lazy)**: `Restore.lazy_pages` asks for the daemon; the
//!   destination starts `criu lazy-pages` on its end of the tunnel the
//!   source opened (it must run before the restore: the restorer faults),
//!   and restores with `lazy_pages`. The daemon starts pushing pages at
//!   once, while the process is still stopped.
//! - **Assisted post-copy**: one pre-copy round (the live pass) runs
//!   before Arm; after the lazy dump the last scan says which pages of the
//!   pass are still current, and `Restore.local_pages` names them. The
//!   destination's end of the tunnel (`localpages.rs`) answers the
//!   daemon's requests for those from its pre-copy store and forwards the
//!   rest to the source's page server.
//! - **Release** (instead of Discard): the source's ports go
//!   (`OutStage::PagesOnly`); its stopped copy stays, backing the page
//!   server. The Commit follows at once, without waiting for pages: it
//!   resumes the process on the destination, with its ports, exactly as for
//!   the other strategies (replay included). A destination whose daemon
//!   already failed refuses it (FAILED_PRECONDITION) without resuming: the
//!   source aborts and resumes its intact copy.
//! - **Post-copy**: the source asks `Peer.PostCopyStatus` (long polls)
//!   until the destination reports its daemon's end. Exit 0: every page is
//!   in; the source ends its page server and discards its copy
//!   (Committed). Anything else: the destination has killed the process
//!   (its missing pages would read as zeros; the kernel's userfaultfd is
//!   gone with the daemon), the source discards its copy too, which the
//!   destination's had overtaken (its peers saw what it did since the
//!   resume), and the report says `MIGRATION_OUTCOME_LOST` with the reason;
//!   `Control.Migrate` ends with DATA_LOSS. That window, from the resume
//!   until the daemon's end, is the report's `post_processing_time_us`; a
//!   dead source node, agent, page server or link in it loses the process.
//!   It is kept as short as the link allows: the daemon pushes every page
//!   in the background from the restore on, faults jump the queue. A
//!   destination that cannot be asked: the source keeps its copy while its
//!   page server still has a connection, then `POSTCOPY_UNCONFIRMED`
//!   more (`source/post_copy.rs`), and reports the migration committed with
//!   an error saying it was never confirmed.
//! - **Abort** before the Commit: as for the other strategies, and first
//!   the source's page server goes (the process is sent SIGSTOP, CRIU is
//!   killed: the process stays stopped once CRIU lets go of it); the
//!   destination kills its daemon with its restored copy.
//!
//! Pages after the resume are counted by the destination's daemon (its
//! log's "UFFD transferred pages") and reported as `postcopy_pages`.
//!
//! # Post-copy with pages that follow by ferryd (protocol 10, the default)
//!
//! ```text
//! Validate ─> Prepare ─> Arm ─> Dump (held) ─> Transfer ─> PostCopyPages (asks only) ─> Restore (pages_follow) ─> … ─> Commit ─> PostCopyPages (all) ─> Discard ─> Committed
//! ```
//!
//! CRIU's lazy dump moves every private page into pipes for its page
//! server inside the freeze (at 4 GiB ~130 ms of splicing and ~33 ms of
//! bookkeeping), and its lazy-pages daemon keeps one request in flight
//! from one thread. Instead, with `[migration] post_copy_pages = "ferryd"`,
//! a destination of protocol 10 and ferry's CRIU:
//!
//! - **Dump (held)**: ferryd gives CRIU a held-pages file per process that
//!   holds every page ("FHP2", `xtask/criu/held-pages-written-or-not.patch`):
//!   the dump leaves each page with data of a lazily restorable area in
//!   the stopped copy (a parent run of the pagemap), and reads, copies and
//!   sends none of them.
//! - **PostCopyPages, then Restore (pages_follow)**: the source reads the
//!   left-out runs from its pagemaps and opens `Peer.PostCopyPages` before
//!   the Restore (CRIU's restorer itself faults on some of those pages).
//!   The destination turns the runs lazy and gives them to its page filler
//!   ([`crate::fill`]) with an empty store; until the Commit the source
//!   sends only the pages the filler's faults ask for, so the freeze
//!   shares nothing with background traffic.
//! - **Commit, then Post-copy**: from the Commit the source streams every
//!   page, read from its stopped copy (`pagesender.rs`), asks first; the
//!   destination stores each batch and tells the filler, which installs
//!   them with several threads (`destination/pages_follow.rs`). The rest
//!   is as above: `PostCopyStatus` until the filler is done, the stopped
//!   copy kept until then, and a stream that ends with pages still to
//!   come makes the destination kill the process and report it lost. A
//!   destination that no longer answers once the stream broke off with
//!   pages unsent is lost too (its filler kills the restored tasks, which
//!   it holds by pidfd, even with its ferryd dead).
//!
//! Every committed migration's report cuts the freeze into its parts
//! (`freeze_parts`: CRIU's dump, the transfer, the destination's image
//! scan, CRIU's start-up and restore, translation, release, replay, and
//! what the RPCs around them cost), which add up to the freeze time.
//!
//! The destination's side is in [`destination`]: its slot's states are
//! `Reserved ─> Received ─> Restored`, then empty again (committed or
//! aborted); a post-copy's daemon outlives the slot after the Commit,
//! watched until it ends (`PostCopies`).

pub mod cancel;
pub mod compression;
mod context;
pub mod destination;
pub mod fault_point;
mod images;
pub mod journal;
pub mod link;
pub(crate) mod localpages;
pub mod needs;
mod pagesender;
pub(crate) mod pagestore;
mod pagetunnel;
mod pagewindow;
pub mod precopy;
mod queued;
mod recover;
mod rollback;
mod sockettaker;
pub mod source;
mod throttle;

mod error;

pub use context::{Engine, Services};
pub use error::{EngineError, blocking};
pub use images::{IMAGE_CHUNK_BYTES, valid_image_name};
pub use recover::recover;

/// Whether the CRIU logs of committed migrations are kept too: at log
/// level 4 (debug), whose logs time every step of a dump and a restore.
/// A failed migration's logs are kept at every level.
pub(crate) fn keeps_every_log(config: &crate::config::Config) -> bool {
    config.criu_log_level >= 4
}

/// Moves the CRIU logs of a migration out of its directory (about to be
/// removed) into `<work_dir>/logs/`, so that they stay readable after the
/// images are gone: a failed migration's reason, or (at log level 4) any
/// migration's steps.
pub fn keep_logs(work_dir: &std::path::Path, dir: &std::path::Path, migration_id: &str) {
    let logs = work_dir.join("logs");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".log") {
            continue;
        }
        let _ = std::fs::create_dir_all(&logs);
        let to = logs.join(format!("{migration_id}-{name}"));
        if let Err(err) = std::fs::rename(e.path(), &to) {
            tracing::warn!(from = %e.path().display(), error = %err, "keeping a CRIU log");
        } else {
            tracing::info!(log = %to.display(), "CRIU log kept");
        }
    }
}

/// At ferryd's start: the directories of migrations a previous ferryd left
/// (killed in the middle of one): their logs go to `<work_dir>/logs`, the
/// rest (images, page stores) is removed. A page filler that outlived its
/// ferryd keeps its open stores and its log (renamed, same file). Returns
/// how many were swept. Blocking.
pub fn sweep_left_behind(work_dir: &std::path::Path) -> usize {
    let mut swept = 0;
    for side in ["incoming", "outgoing"] {
        let Ok(entries) = std::fs::read_dir(work_dir.join(side)) else {
            continue;
        };
        for e in entries.flatten() {
            let id = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            if !path.is_dir() {
                continue;
            }
            keep_logs(work_dir, &path, &id);
            match std::fs::remove_dir_all(&path) {
                Ok(()) => {
                    swept += 1;
                    tracing::warn!(migration = %id, side, "removed what an earlier ferryd left of a migration");
                }
                Err(err) => {
                    tracing::warn!(dir = %path.display(), error = %err, "removing a migration's leftovers")
                }
            }
        }
    }
    swept
}

/// The scheduler hooks opened by `open`, or none: without them CRIU's
/// first breakpoint waits for a grace period, as it did before.
pub(crate) async fn held_sched_hooks(
    open: tokio::task::JoinHandle<std::io::Result<crate::criu::SchedHooks>>,
) -> Option<crate::criu::SchedHooks> {
    match open.await {
        Ok(Ok(hooks)) => Some(hooks),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "perf's scheduler hooks not held: CRIU's first breakpoint may wait for a grace period in the freeze");
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "holding perf's scheduler hooks");
            None
        }
    }
}

/// Waits (bounded) until `pid` has exited: gone, or a zombie, whose sockets
/// are already closed.
pub(crate) async fn wait_dead(pid: i32) {
    use std::time::{Duration, Instant};
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        match crate::process::inspect(pid) {
            Ok(i) if i.state != 'Z' && i.state != 'X' => {}
            _ => return,
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    tracing::warn!(pid, "still alive 5 s after SIGKILL");
}

/// Waits until no CRIU worker of this node is still exiting (hurried
/// first: they exit at idle priority). A dump's worker holds the dumped
/// connections until it exits, and a restore's the connections handed to
/// it: before the source reports a commit, nothing of the process's stay
/// may keep an address pair of its connections taken on this node, or the
/// process could not come back here (`crate::criu::settle_exits`).
pub(crate) async fn settle_criu_exits() {
    let started = std::time::Instant::now();
    match tokio::task::spawn_blocking(|| crate::criu::settle_exits(CRIU_EXIT_WAIT)).await {
        Ok(0) => tracing::debug!(
            waited_ms = started.elapsed().as_secs_f64() * 1e3,
            "CRIU's workers have ended"
        ),
        Ok(left) => tracing::warn!(
            left,
            "CRIU workers still running {} s after their answer",
            CRIU_EXIT_WAIT.as_secs()
        ),
        Err(e) => tracing::error!(error = %e, "waiting for CRIU's workers to end"),
    }
}

/// How long [`settle_criu_exits`] waits: an exit takes milliseconds.
const CRIU_EXIT_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// A fresh migration id: 64 random bits in hex.
pub fn new_migration_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// Images and logs hold process memory: root only.
pub(crate) fn set_private(dir: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Err(e) = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)) {
        tracing::warn!(dir = %dir.display(), error = %e, "restricting permissions");
    }
}

#[cfg(test)]
mod sweep_tests {
    #[test]
    fn leftovers_of_migrations_go_and_their_logs_stay() {
        let work = tempfile::tempdir().unwrap();
        let inc = work.path().join("incoming/abc");
        std::fs::create_dir_all(inc.join("images")).unwrap();
        std::fs::write(inc.join("images/pages-1.img"), b"pages").unwrap();
        std::fs::write(inc.join("fill.log"), b"it failed").unwrap();
        std::fs::create_dir_all(work.path().join("outgoing/def")).unwrap();
        assert_eq!(super::sweep_left_behind(work.path()), 2);
        assert!(!inc.exists());
        assert!(!work.path().join("outgoing/def").exists());
        assert_eq!(
            std::fs::read(work.path().join("logs/abc-fill.log")).unwrap(),
            b"it failed"
        );
        assert_eq!(super::sweep_left_behind(work.path()), 0);
    }
}
