//! Starting a CRIU child without copying ferryd: `posix_spawn`.
//!
//! ferryd is a large multi-threaded process (a hundred megabytes resident,
//! a thousand descriptors during a collective migration). `fork()` copies
//! its page tables and the `exec` right after throws them away. Measured
//! in the 1024-connection freeze bench, the call that starts CRIU (until
//! its `exec`) took 5.3-7.7 ms with `Command`'s fork and 2.9-5.7 ms with
//! `posix_spawn` for a restore (inside the freeze; the child's 1,024
//! `dup2`s of the inherited connections are most of what is left), and
//! 5.3-7.1 ms against 0.26 ms for a dump. std's `Command` has to fork once a `pre_exec` hook is set,
//! and CRIU needs one: its RPC socket at a fixed number, and the inherited
//! descriptors without FD_CLOEXEC. `posix_spawn`'s file actions do both (a
//! `dup2` of a descriptor onto itself clears FD_CLOEXEC, as POSIX.1-2024
//! says and glibc does, checked on this machine's 2.36), and glibc's
//! `posix_spawn` runs the child in ferryd's memory until the `exec`
//! (CLONE_VM | CLONE_VFORK): nothing is copied. Like `Command`, the child
//! starts with no signal blocked and SIGPIPE at its default, and exec
//! failures (a missing binary) come back as the call's error.

use std::ffi::{CString, OsStr};
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::sys::wait::waitpid;
use nix::unistd::Pid;

/// A child started by [`spawn`]; [`SpawnedChild::wait`] reaps it.
#[derive(Debug)]
pub(crate) struct SpawnedChild {
    pid: i32,
}

impl SpawnedChild {
    pub(crate) fn id(&self) -> i32 {
        self.pid
    }

    /// `waitid(WEXITED | WNOWAIT | extra)` on the child, which it leaves
    /// a zombie for [`Self::wait`]: its end, `None` while it runs (with
    /// `WNOHANG` in `extra`).
    fn peek_end(&self, extra: libc::c_int) -> std::io::Result<Option<libc::siginfo_t>> {
        // SAFETY: siginfo_t is plain data; waitid writes only into it.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own child, into `info`; WNOWAIT leaves it
        // a zombie for `wait`.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                self.pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT | extra,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: waitid filled a SIGCHLD siginfo, or left it zeroed
        // (si_pid 0: still running, with WNOHANG).
        Ok((unsafe { info.si_pid() } != 0).then_some(info))
    }

    /// How the child ended, if it did within `within` (left to be reaped
    /// by [`Self::wait`]): "killed by signal 9", "exited with 1".
    pub(super) fn ended_within(&self, within: std::time::Duration) -> Option<String> {
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Some(info) = self.peek_end(libc::WNOHANG).ok()? {
                // SAFETY: a SIGCHLD siginfo filled by waitid.
                let status = unsafe { info.si_status() };
                return Some(match info.si_code {
                    libc::CLD_EXITED => format!("exited with {status}"),
                    _ => format!("killed by signal {status}"),
                });
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }

    /// Waits until the child has ended, leaving it a zombie for
    /// [`Self::wait`] (its PID stays its own until then).
    pub(super) fn wait_ended(&self) -> std::io::Result<()> {
        loop {
            match self.peek_end(0) {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits for the child's exit.
    pub(super) fn wait(self) -> nix::Result<nix::sys::wait::WaitStatus> {
        waitpid(Pid::from_raw(self.pid), None)
    }
}

/// Starts `program` with `args` and this process's environment; stdin,
/// stdout and stderr are /dev/null. Each `(from, to)` of `dup_onto` is
/// `dup2`ed in the child, in order; each descriptor of `keep` is
/// inherited under its own number (the rest stay close-on-exec).
pub(crate) fn spawn(
    program: &Path,
    args: &[&str],
    dup_onto: &[(RawFd, RawFd)],
    keep: &[RawFd],
) -> std::io::Result<SpawnedChild> {
    let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
    let c =
        |s: &OsStr| CString::new(s.as_bytes()).map_err(|_| invalid("a NUL byte in an argument"));
    let path = c(program.as_os_str())?;
    let mut argv = vec![path.clone()];
    for a in args {
        argv.push(c(OsStr::new(a))?);
    }
    let envp: Vec<CString> = std::env::vars_os()
        .filter_map(|(k, v)| {
            let mut kv = k.as_bytes().to_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            CString::new(kv).ok()
        })
        .collect();
    let mut argv_ptrs: Vec<*mut libc::c_char> =
        argv.iter().map(|a| a.as_ptr().cast_mut()).collect();
    argv_ptrs.push(std::ptr::null_mut());
    let mut envp_ptrs: Vec<*mut libc::c_char> =
        envp.iter().map(|e| e.as_ptr().cast_mut()).collect();
    envp_ptrs.push(std::ptr::null_mut());

    let mut actions = FileActions::new()?;
    let null = c"/dev/null";
    actions.open(0, null, libc::O_RDONLY)?;
    actions.open(1, null, libc::O_WRONLY)?;
    actions.open(2, null, libc::O_WRONLY)?;
    for &(from, to) in dup_onto {
        actions.dup2(from, to)?;
    }
    for &fd in keep {
        actions.dup2(fd, fd)?;
    }
    let attrs = Attributes::new()?;

    let mut pid: libc::pid_t = 0;
    // SAFETY: every pointer is valid for the call: `path`, the argument and
    // environment strings and their NULL-terminated pointer arrays live
    // until the function returns, and `actions` and `attrs` were
    // initialised by their constructors. posix_spawn copies what it needs.
    let rc = unsafe {
        libc::posix_spawn(
            &mut pid,
            path.as_ptr(),
            &actions.0,
            &attrs.0,
            argv_ptrs.as_ptr(),
            envp_ptrs.as_ptr(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    Ok(SpawnedChild { pid })
}

/// An initialised `posix_spawn_file_actions_t`, destroyed on drop.
struct FileActions(libc::posix_spawn_file_actions_t);

impl FileActions {
    fn new() -> std::io::Result<Self> {
        // SAFETY: an all-zero posix_spawn_file_actions_t is a valid place
        // for posix_spawn_file_actions_init to initialise.
        let mut a = Self(unsafe { std::mem::zeroed() });
        // SAFETY: `a.0` is writable storage of the right type.
        check(unsafe { libc::posix_spawn_file_actions_init(&mut a.0) })?;
        Ok(a)
    }

    fn open(&mut self, fd: RawFd, path: &std::ffi::CStr, flags: i32) -> std::io::Result<()> {
        // SAFETY: `self.0` is initialised; `path` is NUL-terminated and
        // copied by the call.
        check(unsafe {
            libc::posix_spawn_file_actions_addopen(&mut self.0, fd, path.as_ptr(), flags, 0)
        })
    }

    fn dup2(&mut self, from: RawFd, to: RawFd) -> std::io::Result<()> {
        // SAFETY: `self.0` is initialised.
        check(unsafe { libc::posix_spawn_file_actions_adddup2(&mut self.0, from, to) })
    }
}

impl Drop for FileActions {
    fn drop(&mut self) {
        // SAFETY: `self.0` was initialised by posix_spawn_file_actions_init.
        unsafe { libc::posix_spawn_file_actions_destroy(&mut self.0) };
    }
}

/// An initialised `posix_spawnattr_t` that clears the signal mask and
/// gives SIGPIPE its default action, destroyed on drop.
struct Attributes(libc::posix_spawnattr_t);

impl Attributes {
    fn new() -> std::io::Result<Self> {
        // SAFETY: an all-zero posix_spawnattr_t is a valid place for
        // posix_spawnattr_init to initialise.
        let mut a = Self(unsafe { std::mem::zeroed() });
        // SAFETY: `a.0` is writable storage of the right type; the signal
        // sets are initialised by sigemptyset before they are read.
        unsafe {
            check(libc::posix_spawnattr_init(&mut a.0))?;
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            let mut default: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut default);
            libc::sigaddset(&mut default, libc::SIGPIPE);
            check(libc::posix_spawnattr_setsigmask(&mut a.0, &none))?;
            check(libc::posix_spawnattr_setsigdefault(&mut a.0, &default))?;
            check(libc::posix_spawnattr_setflags(
                &mut a.0,
                (libc::POSIX_SPAWN_SETSIGMASK | libc::POSIX_SPAWN_SETSIGDEF) as libc::c_short,
            ))?;
        }
        Ok(a)
    }
}

impl Drop for Attributes {
    fn drop(&mut self) {
        // SAFETY: `self.0` was initialised by posix_spawnattr_init.
        unsafe { libc::posix_spawnattr_destroy(&mut self.0) };
    }
}

fn check(rc: libc::c_int) -> std::io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::from_raw_os_error(rc))
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use super::*;

    /// The child sees the descriptor dup'ed onto a fixed number and the
    /// kept one under its own number, and no other close-on-exec one.
    #[test]
    fn the_child_inherits_exactly_what_it_is_given() {
        let pipe = |flags| {
            let mut fds = [0; 2];
            // SAFETY: `fds` has room for the two descriptors pipe2 writes.
            assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), flags) }, 0);
            // SAFETY: pipe2 returned two new descriptors, owned from here on.
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
        };
        let (out_r, out_w) = pipe(libc::O_CLOEXEC);
        let (kept, _kept_w) = pipe(libc::O_CLOEXEC);
        let (hidden, _hidden_w) = pipe(libc::O_CLOEXEC);
        let script = format!(
            "for fd in 5 {} {}; do if [ -e /proc/self/fd/$fd ]; then echo -n \"$fd \" >&5; fi; done",
            kept.as_raw_fd(),
            hidden.as_raw_fd()
        );
        let child = spawn(
            Path::new("/bin/sh"),
            &["-c", &script],
            &[(out_w.as_raw_fd(), 5)],
            &[kept.as_raw_fd()],
        )
        .expect("spawn");
        drop(out_w);
        let status = child.wait().expect("wait");
        assert!(
            matches!(status, nix::sys::wait::WaitStatus::Exited(_, 0)),
            "{status:?}"
        );
        let mut seen = String::new();
        std::io::Read::read_to_string(&mut std::fs::File::from(out_r), &mut seen).unwrap();
        assert_eq!(seen, format!("5 {} ", kept.as_raw_fd()));
    }

    #[test]
    fn a_missing_program_is_the_calls_error() {
        let e = spawn(Path::new("/nonexistent/criu"), &["swrk", "3"], &[], &[]).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{e}");
    }
}
