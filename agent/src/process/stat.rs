use super::{ProcessError, read_proc};

/// Flag in /proc/PID/stat marking a kernel thread (include/linux/sched.h).
const PF_KTHREAD: u64 = 0x0020_0000;

/// The facts about a process that decide whether ferry may move it.
#[derive(Debug, Clone)]
pub struct ProcessInfo {
    pub pid: i32,
    pub ppid: i32,
    /// Process group and session, as PIDs in ferryd's PID namespace (0
    /// when the leader is in no namespace ferryd sees).
    pub pgrp: i32,
    pub session: i32,
    /// The controlling terminal's device number; 0 for none.
    pub tty_nr: i32,
    /// Single-letter state from /proc/PID/stat ('R', 'S', 'T', 'Z', ...).
    pub state: char,
    pub kernel_thread: bool,
    pub argv: Vec<String>,
    /// Start time in clock ticks since boot: with the PID, what names a
    /// process across PID reuse.
    pub start_ticks: u64,
}

impl ProcessInfo {
    /// Stopped by a signal (what a migration's freeze leaves behind).
    pub fn is_stopped(&self) -> bool {
        self.state == 'T'
    }
}

/// Reads /proc/PID/stat and /proc/PID/cmdline.
pub fn inspect(pid: i32) -> Result<ProcessInfo, ProcessError> {
    if pid <= 0 {
        return Err(ProcessError::NotFound { pid });
    }
    let path = format!("/proc/{pid}/stat");
    let stat = read_proc(&path, pid)?;
    let fields = parse_stat(&stat).ok_or_else(|| ProcessError::Parse {
        path: path.clone(),
        reason: format!("unexpected content {stat:?}"),
    })?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let argv = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    Ok(ProcessInfo {
        pid,
        ppid: fields.ppid,
        pgrp: fields.pgrp,
        session: fields.session,
        tty_nr: fields.tty_nr,
        state: fields.state,
        kernel_thread: fields.flags & PF_KTHREAD != 0,
        argv,
        start_ticks: fields.start_ticks,
    })
}

/// The single-letter state of process `pid` ('R', 'S', 'T', ...), from
/// one read of /proc/PID/stat; None if it is gone or unreadable.
pub fn state_of(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&stat).map(|f| f.state)
}

/// The fields of /proc/PID/stat ferryd uses.
#[derive(Debug, PartialEq, Eq)]
struct StatFields {
    state: char,
    ppid: i32,
    pgrp: i32,
    session: i32,
    tty_nr: i32,
    flags: u64,
    start_ticks: u64,
}

/// Parses a /proc/PID/stat line. The command name is in parentheses and
/// may itself contain spaces and parentheses, so fields are counted from
/// the last ')'.
fn parse_stat(stat: &str) -> Option<StatFields> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest: state(3) ppid(4) pgrp(5) session(6) tty_nr(7) tpgid(8) flags(9)
    // ... starttime(22).
    Some(StatFields {
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        pgrp: fields.get(2)?.parse().ok()?,
        session: fields.get(3)?.parse().ok()?,
        tty_nr: fields.get(4)?.parse().ok()?,
        flags: fields.get(6)?.parse().ok()?,
        start_ticks: fields.get(19)?.parse().ok()?,
    })
}

/// Waits until every thread of process `pid`, a child of this process, has
/// stopped (the group stop is complete), for at most `bound`; returns how
/// long that took, or None for a process that is not our child (then
/// nothing can be told this cheaply: one waitid is one system call, where
/// reading each thread's state would cost a procfs read per thread). The
/// stop stays to be reported (WNOWAIT): this only looks.
pub fn wait_group_stopped(
    pid: i32,
    bound: std::time::Duration,
) -> std::io::Result<Option<std::time::Duration>> {
    let started = std::time::Instant::now();
    loop {
        // SAFETY: siginfo_t is plain data; all-zero is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid writes only into `info`, which outlives the call.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WSTOPPED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        if r == -1 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ECHILD) => return Ok(None),
                Some(libc::EINTR) => continue,
                _ => return Err(e),
            }
        }
        // SAFETY: waitid filled `info` (si_pid stays 0 when nothing is
        // to report).
        let reported = unsafe { info.si_pid() } == pid;
        if reported && info.si_code == libc::CLD_STOPPED {
            return Ok(Some(started.elapsed()));
        }
        if started.elapsed() >= bound {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("PID {pid} not stopped {bound:?} on"),
            ));
        }
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}

/// `pid` and all its descendants (threads are not processes and are not
/// listed), in breadth-first order.
pub fn process_tree(pid: i32) -> Vec<i32> {
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for task in tasks.flatten() {
                let children = task.path().join("children");
                if let Ok(list) = std::fs::read_to_string(children) {
                    out.extend(
                        list.split_whitespace()
                            .filter_map(|c| c.parse::<i32>().ok()),
                    );
                }
            }
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_command_names() {
        let line = "1234 (we(ird) name) S 1 1234 1234 0 -1 4194560 100 0 0 0 \
                    1 2 3 4 20 0 1 0 987654 1000 10";
        assert_eq!(
            parse_stat(line),
            Some(StatFields {
                state: 'S',
                ppid: 1,
                pgrp: 1234,
                session: 1234,
                tty_nr: 0,
                flags: 4194560,
                start_ticks: 987654,
            })
        );
        let kthread = "2 (kthreadd) S 0 0 0 34816 -1 2129984 0 0 0 0 0 0 0 0 0 0 1 0 5 0 0";
        let k = parse_stat(kthread).unwrap();
        assert_eq!((k.start_ticks, k.tty_nr), (5, 34816));
        assert!(k.flags & PF_KTHREAD != 0);
    }

    #[test]
    fn a_childs_group_stop_is_seen_and_left_to_be_reported() {
        use std::time::Duration;
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        // Running: not stopped within the bound.
        assert!(wait_group_stopped(pid, Duration::from_millis(20)).is_err());
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGSTOP,
        )
        .unwrap();
        let waited = wait_group_stopped(pid, Duration::from_secs(5)).unwrap();
        assert!(waited.is_some());
        // Seen again: looking did not consume the report.
        assert!(
            wait_group_stopped(pid, Duration::from_secs(5))
                .unwrap()
                .is_some()
        );
        // Not our child: nothing to tell.
        assert_eq!(
            wait_group_stopped(1, Duration::from_millis(1)).unwrap(),
            None
        );
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn inspects_this_process_and_finds_kernel_threads() {
        let me = inspect(std::process::id() as i32).unwrap();
        assert!(!me.kernel_thread);
        assert!(!me.argv.is_empty());
        // PID 2 is kthreadd on Linux in the initial PID namespace.
        if let Ok(k) = inspect(2) {
            assert!(k.kernel_thread, "{k:?}");
        }
        assert!(matches!(inspect(-5), Err(ProcessError::NotFound { .. })));
    }
}
