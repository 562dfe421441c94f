//! A CPU cgroup with a quota, made for a test and removed after it (also on
//! failure): how several namespace nodes on one machine each get a CPU
//! capacity (`[balancer] cpu_cgroup`). cgroup v2 when its `cpu` controller
//! is enabled at the root, else v1's `cpu` controller.

use std::path::{Path, PathBuf};

/// A cgroup this test made; dropping it moves what is left in it to the
/// hierarchy's root and removes it.
#[derive(Debug)]
pub struct CpuCgroup {
    path: PathBuf,
    root: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no CPU controller: neither cgroup v2's cpu nor v1's /sys/fs/cgroup/cpu")]
    NoController,
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io {
        path: path.to_owned(),
        source,
    }
}

impl CpuCgroup {
    /// Makes `name` (unique per test run) with a quota of `cores`.
    pub fn create(name: &str, cores: f64) -> Result<Self, CgroupError> {
        let v2 = Path::new("/sys/fs/cgroup");
        let v2_cpu = std::fs::read_to_string(v2.join("cgroup.subtree_control"))
            .is_ok_and(|c| c.split_whitespace().any(|x| x == "cpu"));
        let v1 = Path::new("/sys/fs/cgroup/cpu");
        let (root, is_v2) = if v2_cpu {
            (v2.to_owned(), true)
        } else if v1.join("cpu.cfs_quota_us").exists() {
            (v1.to_owned(), false)
        } else {
            return Err(CgroupError::NoController);
        };
        let path = root.join(name);
        std::fs::create_dir(&path).map_err(io(&path))?;
        let group = CpuCgroup { path, root };
        let period: u64 = 100_000;
        let quota = (cores * period as f64).round() as u64;
        if is_v2 {
            let f = group.path.join("cpu.max");
            std::fs::write(&f, format!("{quota} {period}")).map_err(io(&f))?;
        } else {
            let p = group.path.join("cpu.cfs_period_us");
            std::fs::write(&p, period.to_string()).map_err(io(&p))?;
            let q = group.path.join("cpu.cfs_quota_us");
            std::fs::write(&q, quota.to_string()).map_err(io(&q))?;
        }
        Ok(group)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The processes in it now.
    pub fn pids(&self) -> Vec<i32> {
        std::fs::read_to_string(self.path.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

impl Drop for CpuCgroup {
    fn drop(&mut self) {
        let root_procs = self.root.join("cgroup.procs");
        for _ in 0..50 {
            for pid in self.pids() {
                let _ = std::fs::write(&root_procs, pid.to_string());
            }
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        eprintln!("could not remove the cgroup {}", self.path.display());
    }
}
