//! A node's CPU capacity: the cores its managed processes may use.
//!
//! Without `[balancer] cpu_cgroup` a node's capacity is the machine's CPUs.
//! With it, the managed processes are kept in that cgroup (each turn moves
//! any process of a managed tree that is not in it yet: one started, adopted
//! or restored since) and the capacity is the cgroup's CPU quota: `cpu.max`
//! on cgroup v2, `cpu.cfs_quota_us` / `cpu.cfs_period_us` on v1's `cpu`
//! controller, at most the machine's CPUs. This is how several nodes share
//! one machine in the namespace cluster (the live DVE experiment gives each
//! node a fraction of the 2 cores), and how an operator gives ferry a slice
//! of a host.
//!
//! With a cgroup the load is the managed processes' run time against the
//! quota, without their wait for a CPU: the machine is shared (with other
//! nodes' shares in the namespace cluster, other work on a host), so its
//! run queue says nothing about this node, and a process the quota
//! throttles does not run. A saturated node reads about 1.0: its
//! utilisation of its share, the unit of Gerofi et al. (DVE)'s thresholds.
//!
//! A node whose configured cgroup cannot be read does not know its capacity:
//! its load means nothing to the others, so it says so in its load message
//! and the others leave it out of their location candidates (`ferry nodes`
//! says why).

use std::collections::HashSet;
use std::path::Path;

/// The CPU the node's managed processes may use.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Capacity {
    /// No cgroup configured: the machine's CPUs.
    #[default]
    Machine,
    /// The cgroup's quota, in cores (the machine's CPUs when it has none).
    Cgroup(f64),
    /// A cgroup is configured but its capacity could not be read: why.
    Unknown(String),
}

impl Capacity {
    /// Cores to divide the demand by.
    pub fn cores(&self, machine_cpus: u32) -> f64 {
        match self {
            Capacity::Cgroup(cores) if *cores > 0.0 => *cores,
            _ => f64::from(machine_cpus.max(1)),
        }
    }

    /// Why the capacity is unknown, if it is.
    pub fn unknown(&self) -> Option<&str> {
        match self {
            Capacity::Unknown(why) => Some(why),
            _ => None,
        }
    }
}

/// Reads the cgroup's CPU quota (v2 `cpu.max`, else v1's CFS files).
pub fn read(cgroup: &Path, machine_cpus: u32) -> Capacity {
    let machine = f64::from(machine_cpus.max(1));
    let quota = match std::fs::read_to_string(cgroup.join("cpu.max")) {
        Ok(text) => parse_cpu_max(&text),
        Err(_) => {
            let quota = std::fs::read_to_string(cgroup.join("cpu.cfs_quota_us"));
            let period = std::fs::read_to_string(cgroup.join("cpu.cfs_period_us"));
            match (quota, period) {
                (Ok(q), Ok(p)) => parse_cfs(&q, &p),
                (Err(e), _) | (_, Err(e)) => Err(format!(
                    "{}: neither cpu.max nor cpu.cfs_quota_us/cpu.cfs_period_us readable ({e})",
                    cgroup.display()
                )),
            }
        }
    };
    match quota {
        Ok(Some(cores)) => Capacity::Cgroup(cores.min(machine)),
        Ok(None) => Capacity::Cgroup(machine),
        Err(why) => Capacity::Unknown(why),
    }
}

/// `cpu.max`: "QUOTA PERIOD" or "max PERIOD" (no limit: `None`).
fn parse_cpu_max(text: &str) -> Result<Option<f64>, String> {
    let mut f = text.split_whitespace();
    let (Some(quota), Some(period)) = (f.next(), f.next()) else {
        return Err(format!("cpu.max reads {text:?}"));
    };
    if quota == "max" {
        return Ok(None);
    }
    cores(quota.parse().ok(), period.parse().ok())
        .map(Some)
        .ok_or_else(|| format!("cpu.max reads {text:?}"))
}

/// v1: a quota of -1 is no limit.
fn parse_cfs(quota: &str, period: &str) -> Result<Option<f64>, String> {
    match quota.trim().parse::<i64>() {
        Ok(q) if q < 0 => Ok(None),
        Ok(q) => cores(Some(q as f64), period.trim().parse().ok())
            .map(Some)
            .ok_or_else(|| format!("cpu.cfs_quota_us {q}, cpu.cfs_period_us {period:?}")),
        Err(_) => Err(format!("cpu.cfs_quota_us reads {quota:?}")),
    }
}

fn cores(quota: Option<f64>, period: Option<f64>) -> Option<f64> {
    match (quota, period) {
        (Some(q), Some(p)) if q > 0.0 && p > 0.0 => Some(q / p),
        _ => None,
    }
}

/// Moves each of `pids` that is not in the cgroup into it; returns how
/// many moved. A process that ended meanwhile is not an error.
pub fn place(cgroup: &Path, pids: &[i32]) -> std::io::Result<usize> {
    let procs = cgroup.join("cgroup.procs");
    let inside: HashSet<i32> = std::fs::read_to_string(&procs)?
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    let mut moved = 0;
    for &pid in pids.iter().filter(|p| !inside.contains(p)) {
        match std::fs::write(&procs, pid.to_string()) {
            Ok(()) => moved += 1,
            // ESRCH: it ended between the listing and now.
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotas_read_as_cores() {
        assert_eq!(parse_cpu_max("40000 100000\n"), Ok(Some(0.4)));
        assert_eq!(parse_cpu_max("max 100000\n"), Ok(None));
        assert!(parse_cpu_max("garbage").is_err());
        assert!(parse_cpu_max("0 100000").is_err());
        assert_eq!(parse_cfs("50000\n", "100000\n"), Ok(Some(0.5)));
        assert_eq!(parse_cfs("-1\n", "100000\n"), Ok(None));
        assert!(parse_cfs("x", "100000").is_err());
    }

    #[test]
    fn a_cgroup_gives_its_quota_at_most_the_machine() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("cpu.max"), "150000 100000\n").unwrap();
        assert_eq!(read(dir.path(), 2), Capacity::Cgroup(1.5));
        assert_eq!(read(dir.path(), 1), Capacity::Cgroup(1.0));
        std::fs::write(dir.path().join("cpu.max"), "max 100000\n").unwrap();
        assert_eq!(read(dir.path(), 2), Capacity::Cgroup(2.0));
        let v1 = tempfile::tempdir().unwrap();
        std::fs::write(v1.path().join("cpu.cfs_quota_us"), "40000\n").unwrap();
        std::fs::write(v1.path().join("cpu.cfs_period_us"), "100000\n").unwrap();
        assert_eq!(read(v1.path(), 2), Capacity::Cgroup(0.4));
        let missing = read(Path::new("/nonexistent/ferry-cgroup"), 2);
        let why = missing.unknown().expect("unknown").to_owned();
        assert!(why.contains("/nonexistent/ferry-cgroup"), "{why}");
        assert_eq!(missing.cores(2), 2.0);
        assert_eq!(Capacity::Cgroup(0.4).cores(2), 0.4);
    }
}
