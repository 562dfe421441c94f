//! Restored copies no agent recorded: a destination's ferryd killed while
//! CRIU restored (CRIU finishes, its answer goes nowhere) leaves a tree
//! that never ran, stopped, which no journal record names by PID. The
//! restarted agent knows when the migration was prepared and its command
//! line (the journal's `prepared` record), and finds such copies by what
//! only they are together ([`unrecorded_copies`]). A CRIU killed in the
//! middle of a restore leaves its tasks running instead, as the agent's
//! children: the agent that saw the restore fail finds them the same way.

use std::path::Path;

/// Clock ticks since boot now: the clock of `/proc/PID/stat`'s start
/// time (`ProcessInfo::start_ticks`).
pub fn ticks_now() -> u64 {
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    // SAFETY: clock_gettime writes only into `ts`, which outlives the call.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: as above; CLOCK_BOOTTIME always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    ts.tv_sec as u64 * hz + ts.tv_nsec as u64 * hz / 1_000_000_000
}

/// Which copies [`unrecorded_copies`] looks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyState {
    /// Stopped, as CRIU leaves a restore it finished (`leave_stopped`):
    /// what an agent killed inside the restore leaves.
    Stopped,
    /// In any state: a CRIU killed in the middle of the restore lets the
    /// tasks it made run on.
    Any,
}

/// The processes that can only be a restored copy of `argv` made since
/// `since` (ticks since boot) that no agent took: each the init of a PID
/// namespace below this one (a managed process's shape), in this
/// process's network namespace (the node's), started at or after `since`,
/// with exactly that command line, not in `managed`, and in `state`.
/// Blocking (procfs).
pub fn unrecorded_copies(
    since: u64,
    argv: &[String],
    managed: &[i32],
    state: CopyState,
) -> Vec<i32> {
    let Ok(our_net) = std::fs::read_link("/proc/self/ns/net") else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| !managed.contains(pid))
        .filter(|&pid| {
            super::inspect(pid).is_ok_and(|i| {
                (state == CopyState::Any || i.is_stopped())
                    && !matches!(i.state, 'Z' | 'X')
                    && i.start_ticks >= since
                    && i.argv.as_slice() == argv
            })
        })
        .filter(|&pid| pid_namespace_init(pid))
        .filter(|&pid| {
            std::fs::read_link(Path::new(&format!("/proc/{pid}/ns/net")))
                .is_ok_and(|net| net == our_net)
        })
        .collect()
}

/// Whether `pid` is PID 1 of a PID namespace below ours (`NSpid` lists
/// it in two namespaces or more, the last as 1).
fn pid_namespace_init(pid: i32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .is_some_and(|ids| {
            let ids: Vec<&str> = ids.split_whitespace().collect();
            ids.len() >= 2 && ids.last() == Some(&"1")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tick_clock_is_the_start_times_clock() {
        let me = super::super::inspect(std::process::id() as i32).unwrap();
        let now = ticks_now();
        assert!(me.start_ticks <= now, "{} > {now}", me.start_ticks);
    }

    #[test]
    fn a_process_outside_a_pid_namespace_is_no_unrecorded_copy() {
        let me = super::super::inspect(std::process::id() as i32).unwrap();
        assert!(unrecorded_copies(0, &me.argv, &[], CopyState::Any).is_empty());
    }
}
