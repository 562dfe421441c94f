//! Running a system call inside another process, over ptrace (x86_64).
//!
//! A userfaultfd is bound to the memory of the process that creates it, so
//! the one ferry needs must be created by the target itself. One thread of
//! the target is interrupted, made to execute a `syscall` instruction that
//! already exists in its vDSO with the registers set for the call, stepped
//! over it, and put back exactly as it was: registers, pending system call
//! restart and any signal that arrived meanwhile. The target's memory is
//! never written, so nothing of the injection ends up in a later dump.

use std::io;

use nix::errno::Errno;
use nix::sys::ptrace;
use nix::sys::signal::Signal;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

/// The two bytes of the x86_64 `syscall` instruction.
const SYSCALL_INSN: [u8; 2] = [0x0f, 0x05];

/// A thread of another process, interrupted under ptrace until dropped.
pub struct Seized {
    tid: Pid,
    saved: libc::user_regs_struct,
    /// Where a `syscall` instruction is in the target's vDSO.
    syscall_at: u64,
    /// Signals that arrived while the thread was ours, to deliver again.
    pending: Vec<Signal>,
    detached: bool,
}

impl std::fmt::Debug for Seized {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seized").field("tid", &self.tid).finish()
    }
}

fn errno(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

impl Seized {
    /// Seizes and interrupts thread `tid` (the main thread: `tid == pid`).
    pub fn new(tid: i32) -> io::Result<Self> {
        let syscall_at = find_syscall_insn(tid)?;
        let tid = Pid::from_raw(tid);
        ptrace::seize(tid, ptrace::Options::empty()).map_err(errno)?;
        let mut me = Seized {
            tid,
            // SAFETY: user_regs_struct is plain integers; all-zero is a
            // valid value, replaced below before any use.
            saved: unsafe { std::mem::zeroed() },
            syscall_at,
            pending: Vec::new(),
            detached: false,
        };
        ptrace::interrupt(tid).map_err(errno)?;
        loop {
            match waitpid(tid, Some(WaitPidFlag::__WALL)).map_err(errno)? {
                // The interrupt (or a group stop): nothing to deliver.
                WaitStatus::PtraceEvent(_, _, _) => break,
                // A signal got there first: the thread stopped to deliver
                // it. Keep it for later and use this stop.
                WaitStatus::Stopped(_, sig) => {
                    me.pending.push(sig);
                    break;
                }
                WaitStatus::Exited(..) | WaitStatus::Signaled(..) => {
                    me.detached = true;
                    return Err(io::Error::new(
                        io::ErrorKind::NotFound,
                        format!("thread {tid} exited while being seized"),
                    ));
                }
                _ => continue,
            }
        }
        me.saved = ptrace::getregs(tid).map_err(errno)?;
        Ok(me)
    }

    /// Executes system call `nr` with `args` in the thread; returns its raw
    /// result (a negative errno on failure).
    pub fn syscall(&mut self, nr: i64, args: &[u64]) -> io::Result<i64> {
        let mut regs = self.saved;
        regs.rax = nr as u64;
        // -1: no system call in progress, so that resuming does not apply
        // the restart logic of the call the thread was interrupted in.
        regs.orig_rax = u64::MAX;
        let slots = [
            &mut regs.rdi,
            &mut regs.rsi,
            &mut regs.rdx,
            &mut regs.r10,
            &mut regs.r8,
            &mut regs.r9,
        ];
        for (slot, a) in slots.into_iter().zip(args) {
            *slot = *a;
        }
        regs.rip = self.syscall_at;
        ptrace::setregs(self.tid, regs).map_err(errno)?;
        let done_at = self.syscall_at + SYSCALL_INSN.len() as u64;
        ptrace::step(self.tid, None).map_err(errno)?;
        loop {
            match waitpid(self.tid, Some(WaitPidFlag::__WALL)).map_err(errno)? {
                WaitStatus::Stopped(_, sig) => {
                    let now = ptrace::getregs(self.tid).map_err(errno)?;
                    if sig != Signal::SIGTRAP {
                        self.pending.push(sig);
                    }
                    if now.rip == done_at {
                        return Ok(now.rax as i64);
                    }
                    if now.rip != self.syscall_at {
                        return Err(io::Error::other(format!(
                            "injected system call {nr}: thread {} stopped at {:#x}, neither before nor after the instruction",
                            self.tid, now.rip
                        )));
                    }
                    // Stopped for a signal before the instruction ran.
                    ptrace::step(self.tid, None).map_err(errno)?;
                }
                WaitStatus::Exited(..) | WaitStatus::Signaled(..) => {
                    self.detached = true;
                    return Err(io::Error::new(
                        io::ErrorKind::NotFound,
                        format!("thread {} exited during an injected system call", self.tid),
                    ));
                }
                _ => ptrace::step(self.tid, None).map_err(errno)?,
            }
        }
    }

    /// Puts the registers back and lets the thread go, delivering the
    /// signals that arrived meanwhile.
    pub fn release(mut self) -> io::Result<()> {
        self.restore()
    }

    fn restore(&mut self) -> io::Result<()> {
        if self.detached {
            return Ok(());
        }
        self.detached = true;
        ptrace::setregs(self.tid, self.saved).map_err(errno)?;
        let mut pending = std::mem::take(&mut self.pending).into_iter();
        ptrace::detach(self.tid, pending.next()).map_err(errno)?;
        for sig in pending {
            // SAFETY: tgkill takes integers only.
            unsafe {
                libc::syscall(
                    libc::SYS_tgkill,
                    self.tid.as_raw(),
                    self.tid.as_raw(),
                    sig as i32,
                )
            };
        }
        Ok(())
    }
}

impl Drop for Seized {
    fn drop(&mut self) {
        if let Err(e) = self.restore() {
            tracing::error!(tid = %self.tid, error = %e, "releasing a seized thread");
        }
    }
}

/// The address of a `syscall` instruction in the vDSO of `pid` (its
/// system-call fallbacks have them).
fn find_syscall_insn(pid: i32) -> io::Result<u64> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let line = maps
        .lines()
        .find(|l| l.ends_with("[vdso]"))
        .ok_or_else(|| io::Error::other(format!("process {pid} has no vDSO")))?;
    let range = line.split_whitespace().next().unwrap_or_default();
    let (start, end) = range
        .split_once('-')
        .and_then(|(a, b)| {
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            ))
        })
        .ok_or_else(|| io::Error::other(format!("unreadable vDSO line {line:?}")))?;
    let mut code = vec![0u8; (end - start) as usize];
    let n = super::read_remote(pid, start, &mut code)?;
    code.truncate(n);
    code.windows(2)
        .position(|w| w == SYSCALL_INSN)
        .map(|i| start + i as u64)
        .ok_or_else(|| io::Error::other(format!("no syscall instruction in the vDSO of {pid}")))
}
