//! What in a process tree's users and System V IPC would make CRIU refuse
//! its dump as ferryd runs CRIU: read from procfs with the process
//! running, so that a migration is refused before the freeze rather than
//! rolled back after it.
//!
//! Servers drop root: nginx's workers run as `www-data`, PostgreSQL runs as
//! `postgres` and refuses root. CRIU reads every task's resource limits
//! with `prlimit()`, which the kernel allows on a task of another user
//! only with CAP_SYS_RESOURCE (`check_prlimit_permission`), and root in a
//! container, or an agent run without that capability, lacks it. ferry's
//! CRIU then reads them from `/proc/<pid>/limits`
//! (`xtask/criu/rlimits-from-procfs.patch`); another CRIU cannot.
//!
//! System V shared memory moves only inside an IPC namespace of the
//! process's own (CRIU dumps and restores a whole namespace), which
//! `ferry run --ipc-namespace` gives a process it starts.

use std::collections::HashSet;

use super::Obstacle;

/// CAP_SYS_RESOURCE's bit in the capability sets (linux/capability.h).
pub const CAP_SYS_RESOURCE: u32 = 24;

/// A task's real, effective, saved and file-system IDs, as the `Uid:` and
/// `Gid:` lines of /proc/PID/status give them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskIds {
    pub uids: [u32; 4],
    pub gids: [u32; 4],
}

impl TaskIds {
    /// From the text of a /proc/PID/status file.
    pub fn parse(status: &str) -> Option<Self> {
        let ids = |name: &str| -> Option<[u32; 4]> {
            let line = status.lines().find_map(|l| l.strip_prefix(name))?;
            let v: Vec<u32> = line
                .split_whitespace()
                .map(|p| p.parse().ok())
                .collect::<Option<_>>()?;
            v.try_into().ok()
        };
        Some(Self {
            uids: ids("Uid:")?,
            gids: ids("Gid:")?,
        })
    }

    /// Whether a caller with real user `uid` and real group `gid` may read
    /// this task's limits by `prlimit()` without CAP_SYS_RESOURCE: the
    /// task's real, effective and saved IDs are all the caller's
    /// (`check_prlimit_permission` in kernel/sys.c).
    pub fn limits_readable_by(&self, uid: u32, gid: u32) -> bool {
        self.uids[..3].iter().all(|&u| u == uid) && self.gids[..3].iter().all(|&g| g == gid)
    }
}

/// Whether the effective capability set in the text of a /proc/PID/status
/// file holds CAP_SYS_RESOURCE (`None`: no `CapEff:` line).
pub fn has_cap_sys_resource(status: &str) -> Option<bool> {
    Some(effective_caps(status)? & (1 << CAP_SYS_RESOURCE) != 0)
}

/// The effective capability set in the text of a /proc/PID/status file.
pub fn effective_caps(status: &str) -> Option<u64> {
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
}

/// Tasks of `tree` whose resource limits the configured CRIU could not
/// read: none when it reads them from procfs (`criu_reads_procfs`, ferry's
/// patch) or when ferryd holds CAP_SYS_RESOURCE; otherwise every task
/// that runs as another user than ferryd.
pub fn limits_obstacles(tree: &[i32], criu_reads_procfs: bool) -> Vec<Obstacle> {
    if criu_reads_procfs {
        return Vec::new();
    }
    let own = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    if has_cap_sys_resource(&own) != Some(false) {
        return Vec::new();
    }
    // SAFETY: getuid and getgid take no arguments and cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    tree.iter()
        .filter_map(|&pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let ids = TaskIds::parse(&status)?;
            (!ids.limits_readable_by(uid, gid)).then_some(Obstacle::OtherUsersLimits {
                pid,
                uid: ids.uids[1],
            })
        })
        .collect()
}

/// The hard limits in a /proc/PID/limits text, by their names there
/// ("Max open files"), u64::MAX for "unlimited". The columns are fixed
/// (fs/proc/base.c: the name in 25, soft and hard in 20 each, after a
/// space).
pub fn hard_limits(limits: &str) -> Vec<(String, u64)> {
    limits
        .lines()
        .skip(1)
        .filter_map(|line| {
            let name = line.get(..25)?.trim_end();
            let hard = line.get(26..)?.split_whitespace().nth(1)?;
            let hard = if hard == "unlimited" {
                u64::MAX
            } else {
                hard.parse().ok()?
            };
            Some((name.to_owned(), hard))
        })
        .collect()
}

/// Tasks of `tree` with a hard limit above `theirs` (the destination
/// agent's, `node`'s, whose agent lacks CAP_SYS_RESOURCE): CRIU's restore
/// there could not give them their limits back.
pub fn limits_above(tree: &[i32], theirs: &[(String, u64)], node: &str) -> Vec<Obstacle> {
    let mut found = Vec::new();
    for &pid in tree {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/limits")) else {
            continue;
        };
        for (limit, hard) in hard_limits(&text) {
            if let Some((_, max)) = theirs.iter().find(|(n, _)| *n == limit)
                && hard > *max
            {
                found.push(Obstacle::LimitAboveDestination {
                    pid,
                    limit,
                    hard,
                    theirs: *max,
                    node: node.to_owned(),
                });
            }
        }
    }
    found
}

/// The key of the System V shared memory segment a line of
/// /proc/PID/maps maps, if it maps one (`/SYSV<key in hex> (deleted)`).
pub fn sysv_shm_key(maps_line: &str) -> Option<u32> {
    let path = maps_line.split_whitespace().nth(5)?;
    let hex = path.strip_prefix("/SYSV")?;
    u32::from_str_radix(hex, 16).ok()
}

/// What in `tree`'s System V IPC CRIU would refuse: a segment of the
/// node's IPC namespace (ferryd's) attached by a task of the tree, and an
/// IPC namespace of the tree's own that a process outside the tree is in
/// too (the dump would take the namespace from under it).
pub fn ipc_obstacles(tree: &[i32]) -> Vec<Obstacle> {
    let node_ns = std::fs::read_link("/proc/self/ns/ipc").ok();
    let mut found = Vec::new();
    let mut own_namespaces = HashSet::new();
    for &pid in tree {
        let Ok(ns) = std::fs::read_link(format!("/proc/{pid}/ns/ipc")) else {
            continue;
        };
        if Some(&ns) != node_ns.as_ref() {
            own_namespaces.insert(ns);
            continue;
        }
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
        if let Some(key) = maps.lines().find_map(sysv_shm_key) {
            found.push(Obstacle::NodeSysvShm { pid, key });
        }
    }
    if own_namespaces.is_empty() {
        return found;
    }
    let members: HashSet<i32> = tree.iter().copied().collect();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return found;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if members.contains(&pid) {
            continue;
        }
        if let Ok(ns) = std::fs::read_link(p.path().join("ns/ipc"))
            && own_namespaces.remove(&ns)
        {
            found.push(Obstacle::IpcNamespaceShared { holder: pid });
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: &str = "\
Limit                     Soft Limit           Hard Limit           Units     
Max cpu time              unlimited            unlimited            seconds   
Max open files            1024                 524288               files     
Max locked memory         8388608              8388608              bytes     
";

    #[test]
    fn reads_hard_limits_by_name() {
        assert_eq!(
            hard_limits(LIMITS),
            [
                ("Max cpu time".to_owned(), u64::MAX),
                ("Max open files".to_owned(), 524288),
                ("Max locked memory".to_owned(), 8388608),
            ]
        );
        // This process's, as the kernel writes them.
        let own = hard_limits(&std::fs::read_to_string("/proc/self/limits").unwrap());
        assert!(own.len() >= 16, "{own:?}");
        assert!(own.iter().any(|(n, _)| n == "Max open files"), "{own:?}");
    }

    #[test]
    fn a_limit_above_the_destination_s_is_an_obstacle() {
        let me = std::process::id() as i32;
        let own = hard_limits(&std::fs::read_to_string("/proc/self/limits").unwrap());
        assert!(limits_above(&[me], &own, "node2").is_empty());
        let (name, hard) = own
            .iter()
            .find(|(n, _)| n == "Max open files")
            .cloned()
            .unwrap();
        let lower = vec![(name.clone(), hard - 1)];
        let found = limits_above(&[me], &lower, "node2");
        assert_eq!(found.len(), 1, "{found:?}");
        let text = found[0].to_string();
        assert!(
            text.contains("Max open files")
                && text.contains("node2")
                && text.contains("CAP_SYS_RESOURCE"),
            "{text}"
        );
    }

    const STATUS: &str = "Name:\tnginx\nUid:\t33\t33\t33\t33\nGid:\t33\t33\t33\t33\n\
                          CapEff:\t000001fffeffffff\n";

    #[test]
    fn reads_a_tasks_ids_and_who_may_read_its_limits() {
        let ids = TaskIds::parse(STATUS).unwrap();
        assert_eq!(ids.uids, [33; 4]);
        assert!(ids.limits_readable_by(33, 33));
        assert!(!ids.limits_readable_by(0, 0));
        // A set-user-ID program: its saved ID differs from the real one.
        let setuid = TaskIds::parse("Uid:\t1000\t0\t0\t0\nGid:\t1000\t1000\t1000\t1000\n").unwrap();
        assert!(!setuid.limits_readable_by(1000, 1000));
        assert!(!setuid.limits_readable_by(0, 1000));
        assert_eq!(TaskIds::parse("Uid:\t1\t2\n"), None);
    }

    #[test]
    fn finds_cap_sys_resource_in_the_effective_set() {
        // This machine's root: every capability but CAP_SYS_RESOURCE.
        assert_eq!(has_cap_sys_resource(STATUS), Some(false));
        assert_eq!(
            has_cap_sys_resource("CapEff:\t000001ffffffffff\n"),
            Some(true)
        );
        assert_eq!(has_cap_sys_resource("Name:\tx\n"), None);
    }

    #[test]
    fn finds_system_v_segments_in_maps() {
        assert_eq!(
            sysv_shm_key(
                "7f50ae81e000-7f50ae81f000 rw-s 00000000 00:01 4   /SYSV00984194 (deleted)"
            ),
            Some(0x0098_4194)
        );
        assert_eq!(
            sysv_shm_key("7f50ae81e000-7f50ae81f000 rw-s 00000000 00:01 4   /dev/shm/PostgreSQL.1"),
            None
        );
        assert_eq!(
            sysv_shm_key("7f50ae81e000-7f50ae81f000 rw-p 00000000 00:00 0"),
            None
        );
    }

    /// This test's own tree is in the node's IPC namespace and maps no
    /// System V segment; a child in an IPC namespace of its own is fine
    /// alone and refused once another process joins that namespace.
    /// A child killed and reaped when dropped, also when an assertion
    /// fails.
    struct Killed(std::process::Child);

    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn refuses_an_ipc_namespace_shared_with_the_outside() {
        let me = std::process::id() as i32;
        assert_eq!(ipc_obstacles(&[me]), Vec::new());
        let alone = Killed(
            std::process::Command::new("unshare")
                .args(["--ipc", "sleep", "30"])
                .spawn()
                .unwrap(),
        );
        let pid = alone.0.id() as i32;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::fs::read_link(format!("/proc/{pid}/ns/ipc")).ok()
            == std::fs::read_link("/proc/self/ns/ipc").ok()
        {
            assert!(std::time::Instant::now() < deadline, "unshare did not run");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(ipc_obstacles(&[pid]), Vec::new());
        let joined = Killed(
            std::process::Command::new("nsenter")
                .args(["--ipc", "-t", &pid.to_string(), "sleep", "30"])
                .spawn()
                .unwrap(),
        );
        let joiner = joined.0.id() as i32;
        while std::fs::read_link(format!("/proc/{joiner}/ns/ipc")).ok()
            != std::fs::read_link(format!("/proc/{pid}/ns/ipc")).ok()
        {
            assert!(std::time::Instant::now() < deadline, "nsenter did not run");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(
            ipc_obstacles(&[pid]),
            vec![Obstacle::IpcNamespaceShared { holder: joiner }]
        );
    }
}
