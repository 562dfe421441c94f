//! A minimal client of CRIU's `swrk` mode: one CRIU child per request,
//! talking protobuf over a SOCK_SEQPACKET socket pair.
//!
//! Why not the CLI: `rst_sibling` (the restored process becomes a child of
//! ferryd, which can then reap it) exists only in swrk mode, and the RPC
//! lets ferry time CRIU's phases through its notifications.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use nix::sys::socket::{AddressFamily, MsgFlags, SockFlag, SockType, recv, send, socketpair};
use protobuf::{Enum, Message};
use rust_criu::rust_criu_protobuf::rpc::{
    Criu_network_lock_method, Criu_opts, Criu_req, Criu_req_type, Criu_resp, Inherit_fd,
};

use super::CriuError;

/// Descriptor number of the RPC socket in the CRIU child.
const CHILD_SOCKET_FD: RawFd = 3;

/// A dump of a running process tree, leaving it stopped so that it can be
/// resumed if the migration aborts.
#[derive(Debug, Clone)]
pub struct DumpRequest {
    pub criu: PathBuf,
    pub pid: i32,
    /// Where the images go (tmpfs).
    pub images_dir: PathBuf,
    /// Where CRIU's log goes (kept out of the image directory so that it is
    /// not shipped to the destination).
    pub log_dir: PathBuf,
    pub log_level: i32,
    pub tcp_connections: TcpConnections,
    /// Post-copy: leave the private memory out of the images and serve it
    /// from a page server instead (the dump then blocks until the
    /// destination's lazy-pages daemon closes the connection).
    pub lazy: Option<LazyDump>,
    /// Where the CRIU child's PID is published as soon as it runs (0
    /// before), so that a caller can kill a dump that blocks.
    pub criu_pid: Option<Arc<AtomicI32>>,
    /// With [`TcpConnections::Skip`] and ferry's tcp-options-by-caller
    /// patch: established connections are dumped without their socket
    /// options, which the caller reads and carries.
    pub tcp_options_by_caller: bool,
    /// With `tcp_options_by_caller` and ferry's connections-out-of-images
    /// patch: those connections are kept out of the images altogether
    /// (`ferry-conns-<files id>.img` records their descriptors), and the
    /// restore must get every one of them from ferryd's table.
    pub connections_out: bool,
    /// Pre-copy, with ferry's held-pages patch: the pages listed in the
    /// image directory's `ferry-held-<pid>.img` files
    /// ([`super::held::write`]) and not written since are left out of the
    /// dump as parent runs (the destination holds them).
    pub held_pages: bool,
    /// With ferry's vma-flags patch: iterators of the mappings' flags
    /// (`super::vmflags`, listed in the image directory), which CRIU
    /// inherits at these numbers and reads instead of smaps. The caller
    /// keeps them open until the dump ends.
    pub vma_flags_fds: Vec<RawFd>,
}

/// The external key that asks ferry's patched CRIU for that.
const TCP_OPTIONS_BY_CALLER: &str = "ferry:tcp-opts-by-caller";
/// The external key for `connections_out`.
const CONNECTIONS_OUT: &str = "ferry:conns-out";
/// The external key for `held_pages`.
const HELD_PAGES: &str = "ferry:held-pages";
/// The external key for `vma_flags_fds`.
const VMA_FLAGS: &str = "ferry:vma-flags";

/// CRIU's page server for a lazy dump.
///
/// It serves on `ps_socket`, a connection the caller already made (CRIU's
/// `ps-socket`), so that it never listens on the network. CRIU's RPC takes
/// a page-server descriptor only for a restore; a CRIU configuration file
/// with a `ps-socket` line is what gives one to a lazy dump (ferry writes
/// it and names it here). [`dump`] takes the descriptor: CRIU inherits it
/// under the same number, and this process closes its copy once CRIU
/// runs. CRIU corks the socket and counts on its close to flush the last
/// answer (the status of the daemon's close); a copy left open here would
/// hold that answer back for the kernel's 200 ms cork limit.
#[derive(Debug, Clone)]
pub struct LazyDump {
    pub ps_socket: Arc<std::sync::Mutex<Option<OwnedFd>>>,
    /// Written by [`dump`], absolute.
    pub config_file: PathBuf,
}

/// What CRIU does with established TCP connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcpConnections {
    /// Dumps their state (`--tcp-established`), one connection at a time.
    Dump,
    /// Records only their files and socket options (`--tcp-close`): ferryd
    /// moves their state itself (`sockstate`) and hands the rebuilt
    /// sockets to the restore.
    Skip,
}

/// A restore of the images in `images_dir` into the caller's network
/// namespace, as a child of the caller, left stopped until the commit.
#[derive(Debug, Clone)]
pub struct RestoreRequest {
    pub criu: PathBuf,
    pub images_dir: PathBuf,
    pub log_dir: PathBuf,
    pub log_level: i32,
    /// Connections rebuilt by ferryd (images dumped with
    /// [`TcpConnections::Skip`]), as (inherit-fd key, descriptor):
    /// `Some` even when empty, since such images need CRIU's
    /// `--tcp-close` on restore too. Needs ferry's patch to CRIU.
    pub inherited_tcp: Option<Vec<(String, RawFd)>>,
    /// The lazy runs of the private memory come from a lazy-pages daemon
    /// (post-copy) or ferry's page filler ([`crate::fill`]) already
    /// listening on `lazy-pages.socket` in `log_dir` (CRIU's work
    /// directory).
    pub lazy_pages: bool,
    /// Fault injection (tests of a CRIU that dies in the middle of the
    /// restore; None in every deployment): CRIU is SIGKILLed when it
    /// sends this notification ("post-restore": the tasks exist, not yet
    /// resumed). Only then does the restore ask for notifications.
    pub killed_at: Option<String>,
}

#[derive(Debug, Clone)]
pub struct RestoreOutcome {
    /// PID of the restored root task in the caller's PID namespace.
    pub pid: i32,
}

/// Timings CRIU's notifications let us take, in order.
pub type Notifications = Vec<(String, Duration)>;

/// What CRIU says at a phase boundary (its action-script names:
/// "pre-dump", "post-dump", "pre-restore", "post-restore", ...). The hook
/// runs while CRIU waits; an error makes CRIU abort the operation.
pub type NotifyHook<'a> = &'a mut dyn FnMut(&str) -> Result<(), HookRefused>;

/// A notification hook's refusal: CRIU then aborts what it was doing.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct HookRefused(pub String);

/// Dumps `req.pid` with its established TCP connections.
///
/// `--network-lock skip`: ferry's own eBPF filter is the lock, so CRIU
/// must not touch iptables/nftables. The caller locks in `on_notify` at
/// "pre-dump", which CRIU sends after its start-up (tens of milliseconds)
/// and before it stops the process and reads any socket: the process's
/// packets are held only for the part of the dump that needs it.
/// `leave_stopped`: the process stays frozen on the source until the
/// destination confirms; its TCP sockets stay in repair mode, so they send
/// nothing, not even an RST when killed.
pub fn dump(req: &DumpRequest, on_notify: NotifyHook<'_>) -> Result<Notifications, CriuError> {
    let mut opts = Criu_opts::new();
    opts.set_pid(req.pid);
    match req.tcp_connections {
        TcpConnections::Dump => opts.set_tcp_established(true),
        TcpConnections::Skip => opts.set_tcp_close(true),
    }
    if req.tcp_options_by_caller {
        opts.external.push(TCP_OPTIONS_BY_CALLER.to_owned());
        if req.connections_out {
            opts.external.push(CONNECTIONS_OUT.to_owned());
        }
    }
    if req.held_pages {
        opts.external.push(HELD_PAGES.to_owned());
    }
    if !req.vma_flags_fds.is_empty() {
        opts.external.push(VMA_FLAGS.to_owned());
    }
    opts.set_network_lock(Criu_network_lock_method::SKIP);
    opts.set_leave_stopped(true);
    opts.set_log_level(req.log_level);
    opts.set_log_file("dump.log".to_owned());
    let mut handed_over = Vec::new();
    if let Some(lazy) = &req.lazy {
        let ps = crate::sync::lock(&lazy.ps_socket)
            .take()
            .ok_or_else(|| CriuError::Rpc("the page-server connection was already used".into()))?;
        std::fs::write(&lazy.config_file, format!("ps-socket {}\n", ps.as_raw_fd())).map_err(
            |source| CriuError::Io {
                path: lazy.config_file.clone(),
                source,
            },
        )?;
        opts.set_lazy_pages(true);
        opts.set_config_file(lazy.config_file.to_string_lossy().into_owned());
        handed_over.push(ps);
    }
    let (resp, notes) = run(
        &req.criu,
        Criu_req_type::DUMP,
        opts,
        &req.images_dir,
        &req.log_dir,
        Inherited {
            kept: &req.vma_flags_fds,
            handed_over,
        },
        on_notify,
        req.criu_pid.as_deref(),
    )?;
    check(&resp, "dump", &req.log_dir.join("dump.log"))?;
    Ok(notes)
}

/// Restores the images; the restored tree is a child of this process
/// (`rst_sibling`) and is left stopped. On `worker`, a CRIU started ahead
/// for it ([`start_restore_worker`] with the same directories), when it
/// inherited exactly the descriptors the request names; otherwise on a
/// CRIU started now.
pub fn restore(req: &RestoreRequest, worker: Option<Worker>) -> Result<RestoreOutcome, CriuError> {
    let mut opts = Criu_opts::new();
    let mut inherited = Vec::new();
    match &req.inherited_tcp {
        None => opts.set_tcp_established(true),
        Some(fds) => {
            opts.set_tcp_close(true);
            for (key, fd) in fds {
                let mut entry = Inherit_fd::new();
                entry.set_key(key.clone());
                entry.set_fd(*fd);
                opts.inherit_fd.push(entry);
                inherited.push(*fd);
            }
        }
    }
    opts.set_rst_sibling(true);
    opts.set_leave_stopped(true);
    opts.set_log_level(req.log_level);
    opts.set_log_file("restore.log".to_owned());
    if req.lazy_pages {
        opts.set_lazy_pages(true);
    }
    let mut worker = match worker {
        Some(w) if w.inherited == inherited => w,
        _ => Worker::start(
            &req.criu,
            &req.images_dir,
            &req.log_dir,
            Inherited {
                kept: &inherited,
                handed_over: Vec::new(),
            },
        )?,
    };
    // No notifications: nothing waits for the restore's phases, and each
    // is a round trip to this process while the freeze waits (CRIU stops
    // until the answer comes).
    let criu_pid = worker.pid();
    let mut kill_there = |script: &str| {
        if req.killed_at.as_deref() == Some(script) {
            tracing::warn!(
                script,
                pid = criu_pid,
                "fault injected: CRIU killed in the restore"
            );
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(criu_pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        Ok(())
    };
    let hook: Option<NotifyHook<'_>> = match req.killed_at {
        Some(_) => Some(&mut kill_there),
        None => None,
    };
    let (resp, _) = worker.converse(Criu_req_type::RESTORE, opts, hook)?;
    drop(worker);
    check(&resp, "restore", &req.log_dir.join("restore.log"))?;
    let pid = resp.restore.as_ref().map(|r| r.pid()).unwrap_or(0);
    if pid <= 0 {
        return Err(CriuError::Failed {
            operation: "restore",
            reason: "CRIU reported success but no PID".to_owned(),
        });
    }
    Ok(RestoreOutcome { pid })
}

fn check(resp: &Criu_resp, operation: &'static str, log: &Path) -> Result<(), CriuError> {
    if resp.success() {
        return Ok(());
    }
    let mut reason = resp
        .cr_errmsg()
        .lines()
        .filter(|l| !is_harmless(l))
        .map(str::trim)
        .collect::<Vec<_>>()
        .join("; ");
    let errors = log_errors(log);
    if !errors.is_empty() {
        if !reason.is_empty() {
            reason.push_str("; ");
        }
        reason.push_str(&errors);
    }
    if reason.is_empty() {
        reason = format!(
            "errno {} (the CRIU log is kept under work_dir/logs/)",
            resp.cr_errno()
        );
    }
    Err(CriuError::Failed { operation, reason })
}

/// The `Error (...)` lines of a CRIU log, which say what went wrong in
/// CRIU's words, minus the ones that are harmless here.
fn log_errors(log: &Path) -> String {
    let Ok(text) = std::fs::read_to_string(log) else {
        return String::new();
    };
    text.lines()
        .filter(|l| l.contains("Error (") && !is_harmless(l))
        .map(|l| match l.find("Error (") {
            Some(i) => l[i..].trim(),
            None => l.trim(),
        })
        .take(6)
        .collect::<Vec<_>>()
        .join("; ")
}

/// ferryd lacks CAP_SYS_RESOURCE on these machines: CRIU cannot raise its
/// own RLIMIT_NOFILE, which it only wants for huge fd tables, and says so
/// as an error on every run.
fn is_harmless(line: &str) -> bool {
    line.contains("RLIMIT_NOFILE")
}

fn open_dir(path: &Path) -> Result<OwnedFd, CriuError> {
    let f = File::open(path).map_err(|source| CriuError::Io {
        path: path.to_owned(),
        source,
    })?;
    Ok(OwnedFd::from(f))
}

/// Duplicates `fd` above the child's fixed descriptor number, so that the
/// dup2() in the child cannot be a no-op on an inherited CLOEXEC copy.
fn dup_high(fd: &OwnedFd) -> Result<OwnedFd, CriuError> {
    // SAFETY: F_DUPFD_CLOEXEC on a valid descriptor returns a new descriptor
    // we own, or -1.
    let new = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 64) };
    if new < 0 {
        return Err(CriuError::Rpc(format!(
            "fcntl(F_DUPFD_CLOEXEC): {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: `new` is a fresh descriptor returned to us above.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// Descriptors CRIU inherits under their numbers: `kept` stay open here,
/// `handed_over` are closed here once CRIU runs.
struct Inherited<'a> {
    kept: &'a [RawFd],
    handed_over: Vec<OwnedFd>,
}

#[allow(clippy::too_many_arguments)]
fn run(
    criu: &Path,
    kind: Criu_req_type,
    opts: Criu_opts,
    images_dir: &Path,
    log_dir: &Path,
    inherited: Inherited<'_>,
    on_notify: NotifyHook<'_>,
    criu_pid: Option<&AtomicI32>,
) -> Result<(Criu_resp, Notifications), CriuError> {
    let mut worker = Worker::start(criu, images_dir, log_dir, inherited)?;
    if let Some(p) = criu_pid {
        p.store(worker.pid(), Ordering::SeqCst);
    }
    let result = worker.converse(kind, opts, Some(on_notify));
    // Cleared before the wait reaps it: a PID published to a killer must
    // never name a reaped (and maybe reused) process.
    if let Some(p) = criu_pid {
        p.store(0, Ordering::SeqCst);
    }
    drop(worker);
    result
}

/// A CRIU service worker (`criu swrk`) and this process's end of its
/// session. Started ahead of its request ([`start_restore_worker`]), its
/// exec and dynamic loading (a few milliseconds) are not inside the
/// freeze; what the descriptors it inherited hold may come later (the
/// connection table is written just before the restore). Dropped, it
/// ends: its session closes, CRIU exits, and it is reaped off the
/// caller's path.
pub struct Worker {
    child: Option<super::spawn::SpawnedChild>,
    ours: Option<OwnedFd>,
    /// CRIU opens images_dir_fd and work_dir_fd as /proc/<requester>/fd/N,
    /// the requester being the socket's peer: these are OUR descriptor
    /// numbers, and they must stay open until CRIU answers.
    images: OwnedFd,
    work: OwnedFd,
    /// The descriptors it inherited, at the same numbers as here.
    inherited: Vec<RawFd>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("pid", &self.pid())
            .field("inherited", &self.inherited)
            .finish()
    }
}

/// Starts CRIU ahead of a restore from `images_dir` (its log in
/// `log_dir`), inheriting `kept` (at the same numbers), for [`restore`].
pub fn start_restore_worker(
    criu: &Path,
    images_dir: &Path,
    log_dir: &Path,
    kept: &[RawFd],
) -> Result<Worker, CriuError> {
    Worker::start(
        criu,
        images_dir,
        log_dir,
        Inherited {
            kept,
            handed_over: Vec::new(),
        },
    )
}

impl Worker {
    fn start(
        criu: &Path,
        images_dir: &Path,
        log_dir: &Path,
        inherited: Inherited<'_>,
    ) -> Result<Self, CriuError> {
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| CriuError::Rpc(format!("socketpair: {e}")))?;
        // The socketpair's own descriptor for CRIU's end goes at once:
        // kept (shadowed) until the session ends, it would keep CRIU's end
        // open in this process, and a CRIU that dies without answering
        // (killed while it serves lazy pages) would leave `converse`
        // waiting forever.
        let theirs = {
            let high = dup_high(&theirs)?;
            drop(theirs);
            high
        };
        let s = theirs.as_raw_fd();
        let images = open_dir(images_dir)?;
        let work = open_dir(log_dir)?;

        // Inherited descriptors keep their numbers in the child; the RPC
        // socket goes to CHILD_SOCKET_FD (its source is above it: dup_high).
        let Inherited { kept, handed_over } = inherited;
        let all: Vec<RawFd> = kept
            .iter()
            .copied()
            .chain(handed_over.iter().map(|f| f.as_raw_fd()))
            .collect();
        if all.contains(&CHILD_SOCKET_FD) {
            return Err(CriuError::Rpc(format!(
                "an inherited descriptor is {CHILD_SOCKET_FD}, the child's RPC socket"
            )));
        }
        let child = super::spawn::spawn(
            criu,
            &["swrk", &CHILD_SOCKET_FD.to_string()],
            &[(s, CHILD_SOCKET_FD)],
            &all,
        )
        .map_err(|source| CriuError::Spawn {
            path: criu.to_owned(),
            source,
        })?;
        drop(theirs);
        drop(handed_over);
        ahead_of_the_rest(child.id());
        Ok(Self {
            child: Some(child),
            ours: Some(ours),
            images,
            work,
            inherited: kept.to_vec(),
        })
    }

    /// The CRIU process's PID (0 once it ended).
    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// Sends the request and answers CRIU's notifications until its
    /// response. Once per worker.
    /// Sends one request and waits for its answer, passing CRIU's
    /// notifications to `on_notify`; with none, CRIU sends none.
    fn converse(
        &mut self,
        kind: Criu_req_type,
        mut opts: Criu_opts,
        on_notify: Option<NotifyHook<'_>>,
    ) -> Result<(Criu_resp, Notifications), CriuError> {
        let ours = self
            .ours
            .as_ref()
            .ok_or_else(|| CriuError::Rpc("the CRIU worker's session is over".into()))?;
        opts.set_images_dir_fd(self.images.as_raw_fd());
        opts.set_work_dir_fd(self.work.as_raw_fd());
        // Notifications (pre-dump, post-dump, post-restore, ...) give ferry
        // the phase boundaries inside CRIU.
        opts.set_notify_scripts(on_notify.is_some());
        let result = converse(ours, kind, opts, on_notify.unwrap_or(&mut |_| Ok(())));
        // The session broke: CRIU died (killed, crashed) more often than
        // not, and its caller needs to hear that and which operation, not
        // only a broken pipe.
        let result = result.map_err(|e| match e {
            CriuError::Rpc(rpc) => {
                let how = self
                    .child
                    .as_ref()
                    .and_then(|c| c.ended_within(CRIU_END_WAIT));
                CriuError::Failed {
                    operation: operation_name(kind),
                    reason: match how {
                        Some(how) => format!("CRIU {how} ({rpc})"),
                        None => format!("its session broke: {rpc}"),
                    },
                }
            }
            e => e,
        });
        // Answered, CRIU has nothing left to do but exit. That exit tears
        // down its memory and descriptors: ~1 ms of CPU for each of the
        // dump's and the restore's workers at 1024 connections, which ran
        // inside the freeze on cores the freeze keeps busy (perf, 6
        // migrations, commit 805a614). Behind every other thread, it
        // runs when a core is idle (until `exits::settle` hurries it: it
        // holds descriptors of the connections it dumped or was given).
        // Not after an error: CRIU may still be resuming the tasks it
        // stopped.
        if result.is_ok() {
            behind_everything_else(self.pid());
        }
        // One request per session: closing our end ends it.
        self.ours = None;
        result
    }
}

/// How long a broken session waits to learn how CRIU ended: its socket
/// closes as it exits, a little before it is a zombie.
const CRIU_END_WAIT: Duration = Duration::from_millis(50);

/// The name of a request, as errors say it.
fn operation_name(kind: Criu_req_type) -> &'static str {
    match kind {
        Criu_req_type::DUMP => "dump",
        Criu_req_type::PRE_DUMP => "pre-dump",
        Criu_req_type::RESTORE => "restore",
        Criu_req_type::PAGE_SERVER | Criu_req_type::PAGE_SERVER_CHLD => "page server",
        _ => "request",
    }
}

/// CRIU's nice value while it works. The freeze waits on its dump and its
/// restore, which on a busy node share the cores with everything else;
/// the dump's parasite round trips (a wake-up each) waited behind other
/// threads. A/B at 1024 connections, 30 migrations each: freeze median
/// 33.8 -> 33.0 ms, p95 43.4 -> 38.8, the dump 17.8 -> 14.0 (the
/// connections' branch beside it got less CPU: the transfer after it
/// grew 4.1 -> 6.5). The tasks a restore forks inherit it until CRIU's
/// restorer sets the nice value their images hold.
const CRIU_NICE: i32 = -10;

/// Raises `pid` (a CRIU child) above the node's other work.
fn ahead_of_the_rest(pid: i32) {
    if pid <= 0 {
        return;
    }
    // SAFETY: setpriority takes plain integers and changes only the nice
    // value of `pid`, our child.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, pid as libc::id_t, CRIU_NICE) } != 0 {
        tracing::debug!(pid, error = %std::io::Error::last_os_error(), "CRIU left at its nice value");
    }
}

/// Moves `pid` to SCHED_IDLE: it runs only on a core nothing else wants.
fn behind_everything_else(pid: i32) {
    if pid <= 0 {
        return;
    }
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler reads `param`, which lives across the
    // call, and changes only the scheduling of `pid`, our child.
    if unsafe { libc::sched_setscheduler(pid, libc::SCHED_IDLE, &param) } != 0 {
        tracing::debug!(pid, error = %std::io::Error::last_os_error(), "CRIU's exit left at its priority");
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing our end ends the swrk session; CRIU then exits. Its
        // answer is all the caller waits for: its exit (closing what it
        // holds, a thousand inherited connections on a collective restore:
        // 30 perf samples at 5 kHz, ~6 ms of CPU, in one profile) is waited
        // for on a thread of its own, and by `exits::settle` when what it
        // holds must be gone.
        self.ours = None;
        if let Some(child) = self.child.take() {
            super::exits::reap_in_background(child);
        }
    }
}

fn converse(
    sock: &OwnedFd,
    kind: Criu_req_type,
    opts: Criu_opts,
    on_notify: NotifyHook<'_>,
) -> Result<(Criu_resp, Notifications), CriuError> {
    let start = Instant::now();
    let mut req = Criu_req::new();
    req.set_type(kind);
    req.opts = protobuf::MessageField::some(opts);
    send_msg(sock, &req)?;
    let mut notes = Vec::new();
    loop {
        let resp = recv_msg(sock)?;
        if resp.type_.map(|t| t.value()) == Some(Criu_req_type::NOTIFY.value()) {
            let script = resp
                .notify
                .as_ref()
                .map(|n| n.script().to_owned())
                .unwrap_or_default();
            tracing::trace!(script, "CRIU notification");
            notes.push((script.clone(), start.elapsed()));
            let hook = on_notify(&script);
            if let Err(e) = &hook {
                tracing::warn!(script, error = %e, "CRIU notification hook failed; CRIU aborts");
            }
            let mut ack = Criu_req::new();
            ack.set_type(Criu_req_type::NOTIFY);
            ack.set_notify_success(hook.is_ok());
            send_msg(sock, &ack)?;
            continue;
        }
        return Ok((resp, notes));
    }
}

fn send_msg(sock: &OwnedFd, req: &Criu_req) -> Result<(), CriuError> {
    let bytes = req
        .write_to_bytes()
        .map_err(|e| CriuError::Rpc(format!("encoding request: {e}")))?;
    send(sock.as_fd().as_raw_fd(), &bytes, MsgFlags::empty())
        .map_err(|e| CriuError::Rpc(format!("sending request: {e}")))?;
    Ok(())
}

fn recv_msg(sock: &OwnedFd) -> Result<Criu_resp, CriuError> {
    let mut buf = vec![0u8; 1 << 20];
    let n = recv(sock.as_fd().as_raw_fd(), &mut buf, MsgFlags::empty())
        .map_err(|e| CriuError::Rpc(format!("receiving response: {e}")))?;
    if n == 0 {
        return Err(CriuError::Rpc(
            "CRIU closed the RPC socket without answering (it crashed or was killed)".to_owned(),
        ));
    }
    Criu_resp::parse_from_bytes(&buf[..n])
        .map_err(|e| CriuError::Rpc(format!("decoding response: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nice value of `pid` (/proc/PID/stat's 19th field).
    fn nice_of(pid: i32) -> i32 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
        let after_comm = &stat[stat.rfind(')').expect("comm") + 2..];
        // Field 3 (state) is the first after the command's name.
        after_comm
            .split_whitespace()
            .nth(16)
            .expect("nice")
            .parse()
            .expect("a number")
    }

    /// A CRIU worker runs ahead of the node's other work (as root, which
    /// may lower a nice value); a stand-in for CRIU that waits for its
    /// session's end plays it.
    #[test]
    fn a_criu_worker_starts_at_criu_nice() {
        if ferry_testkit::skip(
            "a_criu_worker_starts_at_criu_nice",
            (!nix::unistd::geteuid().is_root())
                .then(|| "needs root (a negative nice value)".into()),
        ) {
            return;
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let criu = dir.path().join("criu");
        // Reads its RPC socket until the session closes.
        std::fs::write(
            &criu,
            format!("#!/bin/sh\ncat <&{CHILD_SOCKET_FD} >/dev/null\n"),
        )
        .expect("write the stand-in");
        std::fs::set_permissions(&criu, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
        let ours = nice_of(std::process::id() as i32);
        let worker = start_restore_worker(&criu, dir.path(), dir.path(), &[]).expect("start");
        assert_eq!(nice_of(worker.pid()), CRIU_NICE);
        assert_eq!(
            nice_of(std::process::id() as i32),
            ours,
            "the caller keeps its own"
        );
        drop(worker);
    }
}
