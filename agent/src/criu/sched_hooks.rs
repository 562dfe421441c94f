//! perf's scheduler hooks, turned on before the freeze.
//!
//! CRIU stops each task at the end of its parasite's sigreturn (dump) and
//! of its restorer's (restore) with an x86 debug register set through
//! ptrace (compel's `ptrace_set_breakpoint`). The kernel keeps that
//! breakpoint as a perf event bound to the task. The first task-bound perf
//! event on a machine turns perf's scheduler hooks on (a static key) and
//! then waits for an RCU grace period, so that every CPU runs them before
//! the event is installed (`account_event` in `kernel/events/core.c`). That
//! wait was 4.7-9.4 ms in CRIU's dumps here, with the process stopped; a
//! bare `perf_event_open` of the first such event takes 5-15 ms on this
//! machine even when it is idle. The hooks go off again about a second
//! after the last such event is freed.
//!
//! A process that CRIU restored (or dumped and left running) keeps its
//! disabled breakpoint event as long as it lives, so a node that hosts one
//! never waits. A node that hosts none waits once in every dump and every
//! restore. [`SchedHooks::hold`] opens one event of its own before the
//! freeze, so that the wait falls there: a disabled software dummy event,
//! bound to ferryd's main thread, that never counts anything. While it is
//! open every context switch on the machine runs perf's hooks, which find
//! no event to switch for most tasks; it is held only during a migration.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

/// `struct perf_event_attr` up to `PERF_ATTR_SIZE_VER0` (64 bytes), the
/// part every kernel with perf events takes (<linux/perf_event.h>).
#[repr(C)]
#[derive(Default)]
struct PerfEventAttrVer0 {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    /// The bitfield word: bit 0 `disabled`, bit 5 `exclude_kernel`, bit 6
    /// `exclude_hv`.
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
}

const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_DUMMY: u64 = 9;
const ATTR_DISABLED: u64 = 1 << 0;
const ATTR_EXCLUDE_KERNEL: u64 = 1 << 5;
const ATTR_EXCLUDE_HV: u64 = 1 << 6;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;

/// A task-bound perf event held open: perf's scheduler hooks stay on while
/// it lives. Dropping it closes the event.
#[derive(Debug)]
pub struct SchedHooks {
    _event: OwnedFd,
}

impl SchedHooks {
    /// Opens the event. Blocks for an RCU grace period when no other
    /// task-bound perf event exists on the machine (run it off the async
    /// runtime); returns at once otherwise.
    pub fn hold() -> io::Result<Self> {
        let attr = PerfEventAttrVer0 {
            kind: PERF_TYPE_SOFTWARE,
            size: std::mem::size_of::<PerfEventAttrVer0>() as u32,
            config: PERF_COUNT_SW_DUMMY,
            // Disabled and user-space only: it never counts, and a kernel
            // that restricts perf (perf_event_paranoid 2) still allows it.
            flags: ATTR_DISABLED | ATTR_EXCLUDE_KERNEL | ATTR_EXCLUDE_HV,
            ..Default::default()
        };
        // Bound to the main thread, which lives as long as ferryd; the
        // calling thread may be a pool thread that exits sooner.
        let pid = std::process::id() as libc::pid_t;
        // SAFETY: `attr` is a live, initialised perf_event_attr whose
        // `size` field is its own size; the kernel reads at most that many
        // bytes from it and writes nothing back on success. The other
        // arguments are integers.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_perf_event_open,
                &attr as *const PerfEventAttrVer0,
                pid,
                -1 as libc::c_int,
                -1 as libc::c_int,
                PERF_FLAG_FD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: perf_event_open returned a new descriptor that nothing
        // else owns.
        let event = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(Self { _event: event })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn the_attr_is_the_kernels_first_layout() {
        assert_eq!(std::mem::size_of::<PerfEventAttrVer0>(), 64);
    }

    // Only that the event opens: its descriptor is an OwnedFd, closed by
    // the drop, and other tests (the destination's Prepare) open events
    // too, so a closed number could be reused at once.
    #[test]
    fn holding_opens_a_perf_event() {
        let hooks = SchedHooks::hold().expect("perf_event_open (as root)");
        let fd = hooks._event.as_raw_fd();
        let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).expect("the event's fd");
        assert_eq!(link.to_string_lossy(), "anon_inode:[perf_event]");
    }
}
