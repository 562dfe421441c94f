//! How much memory a process tree holds, from `/proc/<pid>/smaps_rollup`:
//! what a destination must find room for before it takes the tree.

use super::{ProcessError, read_proc};

/// A process tree's memory, summed over its tasks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeMemory {
    /// Resident bytes (`Rss`): what the restored tree will occupy. Pages
    /// shared between the tree's tasks count once per task, so this is an
    /// upper bound.
    pub resident: u64,
    /// Anonymous and shared-memory bytes (`Anonymous` + `Pss_Shmem`): the
    /// pages CRIU dumps, so what the destination's page store and images
    /// hold of the tree.
    pub dumped: u64,
}

/// Sums `smaps_rollup` over `pids`; a task that went away counts nothing.
pub fn tree_memory(pids: &[i32]) -> Result<TreeMemory, ProcessError> {
    let mut sum = TreeMemory::default();
    for &pid in pids {
        let text = match read_proc(&format!("/proc/{pid}/smaps_rollup"), pid) {
            Ok(t) => t,
            Err(ProcessError::NotFound { .. }) => continue,
            Err(e) => return Err(e),
        };
        let m = parse_rollup(&text);
        sum.resident += m.resident;
        sum.dumped += m.dumped;
    }
    Ok(sum)
}

/// `Rss:`, and `Anonymous:` + `Pss_Shmem:` (shared memory counted in
/// proportion to its sharers), in kB.
fn parse_rollup(text: &str) -> TreeMemory {
    let field = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    let resident = field("Rss:");
    let anonymous = field("Anonymous:");
    let shmem = field("Pss_Shmem:");
    TreeMemory {
        resident,
        dumped: anonymous + shmem,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_rollup() {
        let text = "\
55e0c0a8e000-7ffd5a1f3000 ---p 00000000 00:00 0                          [rollup]
Rss:               70656 kB
Pss:               67000 kB
Pss_Dirty:         65536 kB
Pss_Anon:          65600 kB
Pss_File:           1400 kB
Pss_Shmem:            64 kB
Shared_Clean:       3000 kB
Anonymous:         65600 kB
Swap:                  0 kB
";
        let m = parse_rollup(text);
        assert_eq!(m.resident, 70656 * 1024);
        assert_eq!(m.dumped, (65600 + 64) * 1024);
    }

    #[test]
    fn counts_this_process() {
        let m = tree_memory(&[std::process::id() as i32]).unwrap();
        assert!(
            m.resident > 0 && m.dumped > 0 && m.dumped <= m.resident,
            "{m:?}"
        );
        // A PID that is gone counts nothing.
        assert_eq!(tree_memory(&[i32::MAX]).unwrap(), TreeMemory::default());
    }
}
