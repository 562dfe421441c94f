//! Cleaning up after test processes that died without running their drop
//! guards (SIGKILL by a CI timeout, Ctrl-C): their namespaces, processes,
//! tmpfs mounts and temp dirs carry the dead process's PID in their names.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::netns;
use crate::tmpfs;

/// Prefix of every namespace name: `fy<pid>-<cluster>-<role>`.
pub const NETNS_PREFIX: &str = "fy";
/// Prefix of every cluster's temp dir: `ferry-it-<pid>-XXXXXX`.
pub const TEMPDIR_PREFIX: &str = "ferry-it-";

/// The PID embedded in one of our names after `prefix`, if it is ours.
fn owner_pid(name: &str, prefix: &str) -> Option<i32> {
    let rest = name.strip_prefix(prefix)?;
    let (pid, _) = rest.split_once('-')?;
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

fn is_dead(pid: i32) -> bool {
    pid != std::process::id() as i32 && !Path::new(&format!("/proc/{pid}")).exists()
}

/// SIGKILLs every process in the named namespaces (never this process) until
/// none is left or `timeout` passes; returns the PIDs still there.
pub fn kill_all_in(names: &[&str], timeout: Duration) -> Vec<i32> {
    let me = std::process::id() as i32;
    let deadline = Instant::now() + timeout;
    loop {
        let mut left = Vec::new();
        for name in names {
            match netns::pids_in(name) {
                Ok(pids) => left.extend(pids.into_iter().filter(|&p| p != me && p > 1)),
                Err(e) => eprintln!("ferry-integration: listing processes in {name}: {e}"),
            }
        }
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        for &pid in &left {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Removes what dead test processes of this crate left behind. Best effort:
/// problems are printed, never fatal.
pub fn reap_stale() {
    let names = match netns::list() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("ferry-integration: listing namespaces: {e}");
            return;
        }
    };
    let stale: Vec<&str> = names
        .iter()
        .map(String::as_str)
        .filter(|n| owner_pid(n, NETNS_PREFIX).is_some_and(is_dead))
        .collect();
    if !stale.is_empty() {
        eprintln!("ferry-integration: removing stale namespaces {stale:?}");
        let left = kill_all_in(&stale, Duration::from_secs(5));
        if !left.is_empty() {
            eprintln!("ferry-integration: processes {left:?} survived SIGKILL");
        }
        for name in &stale {
            if let Err(e) = crate::cmd::ip(["netns", "del", name]) {
                eprintln!("ferry-integration: {e}");
            }
        }
    }

    let tmp = std::env::temp_dir();
    let Ok(entries) = std::fs::read_dir(&tmp) else {
        return;
    };
    let dirs: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| owner_pid(n, TEMPDIR_PREFIX))
                .is_some_and(is_dead)
        })
        .collect();
    for dir in dirs {
        eprintln!("ferry-integration: removing stale {}", dir.display());
        match tmpfs::mounts_under(&dir) {
            // Deepest first, lazily: nothing of a dead test should be busy.
            Ok(mut mounts) => {
                mounts.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
                for m in mounts {
                    if let Err(e) = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH) {
                        eprintln!("ferry-integration: unmounting {}: {e}", m.display());
                    }
                }
            }
            Err(e) => eprintln!("ferry-integration: {e}"),
        }
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            eprintln!("ferry-integration: removing {}: {e}", dir.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_only_our_names() {
        assert_eq!(owner_pid("fy1234-0-n1", NETNS_PREFIX), Some(1234));
        assert_eq!(owner_pid("fy1234-r", NETNS_PREFIX), Some(1234));
        assert_eq!(owner_pid("fyx-0-n1", NETNS_PREFIX), None);
        assert_eq!(owner_pid("fy-0-n1", NETNS_PREFIX), None);
        assert_eq!(owner_pid("fancy", NETNS_PREFIX), None);
        assert_eq!(owner_pid("ferry-it-77-abc", TEMPDIR_PREFIX), Some(77));
        assert!(!is_dead(std::process::id() as i32));
    }
}
