//! ferryd's side of a page filler: starting `ferryd fill`, relaying the
//! restore's userfaultfds to it, and hearing how it ended.

use std::io::IoSliceMut;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};

use super::control::{self, FromFiller, ToFiller};
use super::{CONTROL_FD, FillError, FillStats, Plan};

/// The socket CRIU's restore connects to, in its working directory
/// (`criu/uffd.c`, `LAZY_PAGES_SOCK_NAME`).
pub const SOCKET: &str = "lazy-pages.socket";
/// What the restore sends last, before the tasks run
/// (`LAZY_PAGES_RESTORE_FINISHED`, "RSTF").
const RESTORE_FINISHED: i32 = 0x5253_5446;
/// The plan's file and the filler's log, in the restore's working
/// directory.
pub const PLAN: &str = "fill-plan.json";
pub const LOG: &str = "fill.log";

/// A running filler.
pub struct Filler {
    pid: i32,
    /// ferryd's end of the control socket.
    ctl: OwnedFd,
    relay: Option<std::thread::JoinHandle<Result<(), FillError>>>,
    stop: Arc<AtomicBool>,
    /// ferryd's copies of the restored tasks' userfaultfds: while one is
    /// open, a missing page makes the process wait, never read zeros.
    kept: Arc<Mutex<Vec<OwnedFd>>>,
    dir: PathBuf,
    /// Its report, once its words thread read it: `None` inside if it
    /// ended without one.
    report: Arc<std::sync::OnceLock<Option<FromFiller>>>,
    /// Reads what the filler says from the start: asks for pages (a plan
    /// whose pages follow) go on at once, the report is kept.
    words: Option<std::thread::JoinHandle<()>>,
    /// Reaped: nothing left to do on drop.
    reaped: bool,
}

impl std::fmt::Debug for Filler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Filler")
            .field("pid", &self.pid)
            .field("dir", &self.dir)
            .finish()
    }
}

/// A filler process started ahead of the plan (at Arm, before the
/// freeze: its fork and exec then cost the freeze nothing), waiting for
/// its stores and plan on the control socket. Dropped unused, it is
/// killed and reaped.
pub struct Spawned {
    pid: i32,
    ctl: Option<OwnedFd>,
    dir: PathBuf,
}

impl std::fmt::Debug for Spawned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spawned").field("pid", &self.pid).finish()
    }
}

impl Spawned {
    /// Starts `exe fill` (ferryd's own binary), logging to [`LOG`] in
    /// `dir` (the restore's working directory). Blocking: a fork and an
    /// exec.
    pub fn spawn(exe: &Path, dir: &Path) -> Result<Spawned, FillError> {
        let (ours, theirs) = control::pair()?;
        // The control socket goes to its number in the child by a dup2
        // from a copy above it, so that the dup2 cannot land on it.
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) on a valid descriptor returns a
        // new one at or above 1024, or -1; no memory is passed.
        let r = unsafe { libc::fcntl(theirs.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 1024) };
        if r < 0 {
            return Err(FillError::io("duplicating the filler's control socket")(
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: the kernel just returned this descriptor to us.
        let high = unsafe { OwnedFd::from_raw_fd(r) };
        drop(theirs);
        let log = dir.join(LOG);
        let log_arg = log.to_string_lossy();
        let pid = crate::criu::spawn::spawn(
            exe,
            &["fill", "--log", &log_arg],
            &[(high.as_raw_fd(), CONTROL_FD)],
            &[],
        )
        .map_err(FillError::io(format!("starting {} fill", exe.display())))?
        .id();
        Ok(Spawned {
            pid,
            ctl: Some(ours),
            dir: dir.to_owned(),
        })
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Hands the filler its `plan` and the `stores` it names, and listens
    /// on [`SOCKET`] in its directory for the restore. Returns once the
    /// filler mapped its stores. A plan whose pages follow: the pages its
    /// faults wait on go to `wants` (from the restore on: the restore
    /// itself may fault). Blocking.
    pub fn start(
        mut self,
        plan: &Plan,
        stores: &[BorrowedFd<'_>],
        ready_within: Duration,
        wants: Option<tokio::sync::mpsc::UnboundedSender<Want>>,
    ) -> Result<Filler, FillError> {
        let ctl = self.ctl.take().expect("taken only here");
        let mut filler = Filler {
            pid: self.pid,
            ctl,
            relay: None,
            stop: Arc::new(AtomicBool::new(false)),
            kept: Arc::new(Mutex::new(Vec::new())),
            dir: self.dir.clone(),
            report: Arc::default(),
            words: None,
            reaped: false,
        };
        let plan_path = self.dir.join(PLAN);
        let json = serde_json::to_vec(plan).expect("a plan serializes");
        std::fs::write(&plan_path, json)
            .map_err(FillError::io(format!("writing {}", plan_path.display())))?;
        let socket = self.dir.join(SOCKET);
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket)
            .map_err(FillError::io(format!("listening on {}", socket.display())))?;
        listener
            .set_nonblocking(true)
            .map_err(FillError::io("a non-blocking listener"))?;
        for (index, store) in stores.iter().enumerate() {
            let store = store
                .try_clone_to_owned()
                .map_err(FillError::io("duplicating a store for the filler"))?;
            control::send_to_filler(
                filler.ctl.as_fd(),
                &ToFiller::Store {
                    index: index as u32,
                    store,
                },
            )?;
        }
        control::send_to_filler(
            filler.ctl.as_fd(),
            &ToFiller::Plan {
                path: plan_path.to_string_lossy().into_owned(),
            },
        )?;
        // Ready, or why not.
        set_timeout(filler.ctl.as_fd(), Some(ready_within))?;
        let first = control::recv_from_filler(filler.ctl.as_fd());
        set_timeout(filler.ctl.as_fd(), None)?;
        match first {
            Ok(Some(FromFiller::Ready)) => {}
            other => {
                let why = match other {
                    Ok(Some(FromFiller::Failed(why))) => why,
                    Ok(m) => format!("{m:?} instead of ready"),
                    Err(e) => e.to_string(),
                };
                filler.kill();
                return Err(FillError::Failed(format!("at its start: {why}")));
            }
        }
        let ctl = filler
            .ctl
            .try_clone()
            .map_err(FillError::io("duplicating the control socket"))?;
        let (stop, kept) = (filler.stop.clone(), filler.kept.clone());
        filler.relay = Some(
            std::thread::Builder::new()
                .name("fill-relay".into())
                .spawn(move || relay(listener, ctl, &stop, &kept))
                .map_err(FillError::io("starting the relay thread"))?,
        );
        let ctl = filler
            .ctl
            .try_clone()
            .map_err(FillError::io("duplicating the control socket"))?;
        let report = filler.report.clone();
        filler.words = Some(
            std::thread::Builder::new()
                .name("fill-words".into())
                .spawn(move || {
                    let last = Filler::next_report(ctl.as_fd(), wants.as_ref());
                    let _ = report.set(last.unwrap_or(None));
                })
                .map_err(FillError::io("starting the filler's reader"))?,
        );
        Ok(filler)
    }
}

impl Drop for Spawned {
    /// Unused (no fill after all, or an abort): killed and reaped off this
    /// thread.
    fn drop(&mut self) {
        if self.ctl.is_none() {
            // Became a Filler, which owns the process now.
            return;
        }
        let pid = nix::unistd::Pid::from_raw(self.pid);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        std::thread::spawn(move || {
            let _ = nix::sys::wait::waitpid(pid, None);
        });
    }
}

impl Filler {
    /// [`Spawned::spawn`] then [`Spawned::start`].
    pub fn start(
        exe: &Path,
        dir: &Path,
        plan: &Plan,
        stores: &[BorrowedFd<'_>],
        ready_within: Duration,
        wants: Option<tokio::sync::mpsc::UnboundedSender<Want>>,
    ) -> Result<Filler, FillError> {
        Spawned::spawn(exe, dir)?.start(plan, stores, ready_within, wants)
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// A plan whose pages follow: what tells the filler which pages
    /// arrived in its stores.
    pub fn arrivals(&self) -> Result<Arrivals, FillError> {
        let ctl = self
            .ctl
            .try_clone()
            .map_err(FillError::io("duplicating the control socket"))?;
        Ok(Arrivals { ctl })
    }

    /// Hands the filler the restored tree's tasks (host PIDs), which it
    /// kills should it fail: ferryd does too, but ferryd may be gone by
    /// then. A task already gone is left out. Blocking (briefly).
    pub fn guard(&self, pids: &[i32]) -> Result<(), FillError> {
        for &pid in pids {
            let pidfd = match crate::process::pidfd::open(pid) {
                Ok(fd) => fd,
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => continue,
                Err(e) => return Err(FillError::io(format!("pidfd_open({pid})"))(e)),
            };
            control::send_to_filler(self.ctl.as_fd(), &ToFiller::Guard { pid, pidfd })?;
        }
        Ok(())
    }

    /// Tells the filler the process resumed: its background installs
    /// start ([`ToFiller::Resumed`]).
    pub fn resumed(&self) -> Result<(), FillError> {
        control::send_to_filler(self.ctl.as_fd(), &ToFiller::Resumed)
    }

    /// The filler's next word other than an ask for pages, which goes on
    /// to [`Filler::follow`]'s receiver. Blocking.
    fn next_report(
        ctl: BorrowedFd<'_>,
        wants: Option<&tokio::sync::mpsc::UnboundedSender<Want>>,
    ) -> Result<Option<FromFiller>, FillError> {
        loop {
            match control::recv_from_filler(ctl)? {
                Some(FromFiller::Want { vpid, start, end }) => {
                    if let Some(w) = wants {
                        let _ = w.send(Want { vpid, start, end });
                    }
                }
                other => return Ok(other),
            }
        }
    }

    /// Sends the filler SIGKILL (an abort: the process it filled is killed
    /// too, or never ran); dropping the handle reaps it.
    pub fn signal_kill(&self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Err(e) = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid),
            nix::sys::signal::Signal::SIGKILL,
        ) && e != nix::errno::Errno::ESRCH
        {
            tracing::warn!(pid = self.pid, error = %e, "killing the page filler");
        }
    }

    /// Kills the filler and reaps it. Blocking (the relay thread's next
    /// look, a tenth of a second at most).
    pub fn kill(mut self) {
        self.signal_kill();
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(self.pid), None);
        self.reaped = true;
        if let Some(r) = self.relay.take() {
            let _ = r.join();
        }
        if let Some(w) = self.words.take() {
            let _ = w.join();
        }
    }

    /// If the filler already ended (before the resume: a small fill, or a
    /// failure), how: `Ok` if every page is in. Never blocks.
    pub fn early_end(&mut self) -> Option<Result<FillStats, String>> {
        Some(match self.report.get()? {
            Some(FromFiller::Done(stats)) => Ok(*stats),
            Some(FromFiller::Failed(why)) => Err(why.clone()),
            other => Err(format!("it ended without a report ({other:?})")),
        })
    }

    /// Waits for the filler's report and its exit. Its copies of the
    /// userfaultfds close after that.
    pub async fn finish(mut self) -> Result<FillStats, FillError> {
        if let Some(w) = self.words.take() {
            tokio::task::spawn_blocking(move || w.join())
                .await
                .map_err(|e| FillError::Failed(format!("waiting for the filler: {e}")))?
                .map_err(|_| FillError::Failed("the filler's reader panicked".into()))?;
        }
        let report: Result<Option<FromFiller>, FillError> =
            Ok(self.report.get().cloned().unwrap_or(None));
        let status = crate::reaper::wait_exit(self.pid).await;
        self.reaped = true;
        self.stop.store(true, Ordering::Relaxed);
        if let Some(r) = self.relay.take() {
            let _ = tokio::task::spawn_blocking(move || r.join()).await;
        }
        let tail = || log_tail(&self.dir.join(LOG));
        match report {
            Ok(Some(FromFiller::Done(stats))) => Ok(stats),
            Ok(Some(FromFiller::Failed(why))) => Err(FillError::Failed(why)),
            Ok(m) => Err(FillError::Failed(format!(
                "it ended ({status:?}) without a report ({m:?}): {}",
                tail()
            ))),
            Err(e) => Err(FillError::Failed(format!("{e}: {}", tail()))),
        }
    }
}

impl Drop for Filler {
    /// A filler dropped without [`Filler::finish`] or [`Filler::kill`] (a
    /// slot discarded): killed and reaped off this thread.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if self.reaped {
            return;
        }
        self.signal_kill();
        let (pid, relay, words) = (self.pid, self.relay.take(), self.words.take());
        std::thread::spawn(move || {
            let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
            if let Some(r) = relay {
                let _ = r.join();
            }
            if let Some(w) = words {
                let _ = w.join();
            }
        });
    }
}

/// Pages a fault of the filled process waits on: store offsets of task
/// `vpid`'s store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Want {
    pub vpid: u32,
    pub start: u64,
    pub end: u64,
}

/// Tells a filler whose pages follow what arrived in its stores.
#[derive(Debug)]
pub struct Arrivals {
    ctl: OwnedFd,
}

impl Arrivals {
    /// On a filler's control socket (ferryd's end), for tests and tools
    /// that run a filler without this handle.
    pub fn on(ctl: OwnedFd) -> Arrivals {
        Arrivals { ctl }
    }

    /// Store offsets `ranges` of task `vpid`'s store hold their pages now.
    /// Blocking (briefly: the filler reads its control socket at once).
    pub fn arrived(&self, vpid: u32, ranges: &[(u64, u64)]) -> Result<(), FillError> {
        for part in ranges.chunks(control::MAX_ARRIVED) {
            control::send_to_filler(
                self.ctl.as_fd(),
                &ToFiller::Arrived {
                    vpid,
                    ranges: part.to_vec(),
                },
            )?;
        }
        Ok(())
    }

    /// No more pages will come; a filler still waiting for some fails.
    pub fn lost(&self, why: &str) -> Result<(), FillError> {
        control::send_to_filler(self.ctl.as_fd(), &ToFiller::Lost { why: why.into() })
    }
}

fn set_timeout(sock: BorrowedFd<'_>, t: Option<Duration>) -> Result<(), FillError> {
    let tv = t.map_or(nix::sys::time::TimeVal::new(0, 0), |t| {
        nix::sys::time::TimeVal::new(t.as_secs() as i64, t.subsec_micros() as i64)
    });
    nix::sys::socket::setsockopt(&sock, nix::sys::socket::sockopt::ReceiveTimeout, &tv)
        .map_err(|e| FillError::io("setting a receive timeout")(e.into()))
}

/// The last lines of the filler's log.
pub fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

/// The relay: waits for the restore's connection, then passes each task's
/// userfaultfd to the filler (keeping a copy) and says when the restore
/// finished.
fn relay(
    listener: UnixListener,
    ctl: OwnedFd,
    stop: &AtomicBool,
    kept: &Mutex<Vec<OwnedFd>>,
) -> Result<(), FillError> {
    let conn = loop {
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        match listener.accept() {
            Ok((c, _)) => break c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let mut p = [libc::pollfd {
                    fd: listener.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                }];
                // SAFETY: one valid pollfd for the call.
                unsafe { libc::poll(p.as_mut_ptr(), 1, 50) };
            }
            Err(e) => return Err(FillError::io("accepting the restore")(e)),
        }
    };
    conn.set_nonblocking(false)
        .map_err(FillError::io("a blocking connection"))?;
    conn.set_read_timeout(Some(Duration::from_millis(100)))
        .map_err(FillError::io("a read timeout"))?;
    let mut finished = false;
    loop {
        let Some((word, _)) = read_exact(&conn, 4, stop)? else {
            return if finished {
                Ok(())
            } else {
                Err(FillError::Protocol(
                    "the restore closed its connection before it finished".into(),
                ))
            };
        };
        let value = i32::from_ne_bytes(word[..4].try_into().expect("4 bytes"));
        if value == RESTORE_FINISHED {
            finished = true;
            control::send_to_filler(ctl.as_fd(), &ToFiller::RestoreFinished)?;
            continue;
        }
        if value < 0 {
            // A zombie: no userfaultfd follows.
            continue;
        }
        let Some((_, Some(uffd))) = read_exact(&conn, 1, stop)? else {
            return Err(FillError::Protocol(format!(
                "task {value}: no userfaultfd came with it"
            )));
        };
        let copy = uffd
            .try_clone()
            .map_err(FillError::io("duplicating a userfaultfd"))?;
        crate::sync::lock(kept).push(copy);
        control::send_to_filler(ctl.as_fd(), &ToFiller::Uffd { vpid: value, uffd })?;
    }
}

/// Reads exactly `n` bytes (and a descriptor sent with them, if any);
/// `None` at the end of the connection.
fn read_exact(
    conn: &UnixStream,
    n: usize,
    stop: &AtomicBool,
) -> Result<Option<control::Received>, FillError> {
    let mut got = Vec::with_capacity(n);
    let mut fd = None;
    while got.len() < n {
        let mut buf = vec![0u8; n - got.len()];
        let mut cmsg = nix::cmsg_space!([RawFd; 1]);
        let received = {
            let mut iov = [IoSliceMut::new(&mut buf)];
            match recvmsg::<()>(
                conn.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Ok(msg) => {
                    let mut fds = Vec::new();
                    for c in msg
                        .cmsgs()
                        .map_err(|e| FillError::Protocol(format!("control message: {e}")))?
                    {
                        if let ControlMessageOwned::ScmRights(f) = c {
                            fds.extend(f);
                        }
                    }
                    Ok((msg.bytes, fds))
                }
                Err(e) => Err(e),
            }
        };
        let (k, fds) = match received {
            Ok(r) => r,
            Err(nix::Error::EINTR) => continue,
            Err(nix::Error::EAGAIN) => {
                if stop.load(Ordering::Relaxed) {
                    return Ok(None);
                }
                continue;
            }
            Err(e) => return Err(FillError::io("reading the restore's connection")(e.into())),
        };
        for f in fds {
            // SAFETY: SCM_RIGHTS installed these descriptors in our table
            // for this message; nothing else owns them.
            let owned = unsafe { OwnedFd::from_raw_fd(f) };
            fd.get_or_insert(owned);
        }
        if k == 0 {
            return Ok(None);
        }
        got.extend_from_slice(&buf[..k]);
    }
    Ok(Some((got, fd)))
}

/// How long a filler may take to map its stores and say it is ready.
pub const READY_WITHIN: Duration = Duration::from_secs(10);
