//! Whether this node can hold an incoming process, checked at Prepare,
//! before anything stops: its resident set must fit in the memory this
//! node offers, and its page store and images (a copy of each page it
//! dumps, never more: `PageStore`) in the work dir, which takes memory too
//! when it is a tmpfs.

use std::path::Path;

use ferry_proto::v1::PrepareRequest;

use crate::engine::EngineError;

/// `statfs` type of a tmpfs (linux/magic.h).
const TMPFS_MAGIC: i64 = 0x0102_1994;
/// `statfs` type of a ramfs (linux/magic.h).
const RAMFS_MAGIC: i64 = 0x8584_58f6;

/// What the node offers, read when the request comes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Room {
    /// Bytes of memory a migration may take: MemAvailable, or the
    /// configured limit if lower.
    pub memory: u64,
    /// Whether `memory` is the configured limit.
    pub limited: bool,
    /// Free bytes in the work dir's file system.
    pub work_dir_free: u64,
    /// The work dir is in memory (tmpfs, ramfs): the store takes memory.
    pub work_dir_in_memory: bool,
}

impl Room {
    /// Reads MemAvailable and the work dir's file system.
    pub(super) fn read(work_dir: &Path, limit_mib: Option<u64>) -> Result<Room, EngineError> {
        let meminfo = std::fs::read_to_string("/proc/meminfo")
            .map_err(EngineError::io("reading /proc/meminfo"))?;
        let available = mem_available(&meminfo).ok_or_else(|| {
            EngineError::Internal("/proc/meminfo has no MemAvailable line".into())
        })?;
        // The work dir, or the nearest existing folder above it (where it
        // will be made).
        let existing = work_dir
            .ancestors()
            .find(|p| p.exists())
            .unwrap_or(work_dir);
        let fs = nix::sys::statfs::statfs(existing)
            .map_err(|e| EngineError::io(format!("statfs of {}", existing.display()))(e.into()))?;
        let kind = fs.filesystem_type().0;
        let limit = limit_mib.map(|m| m.saturating_mul(1 << 20));
        let in_memory = kind == TMPFS_MAGIC || kind == RAMFS_MAGIC;
        Ok(Room {
            memory: limit.map_or(available, |l| l.min(available)),
            limited: limit.is_some_and(|l| l < available),
            work_dir_free: work_dir_free(
                in_memory,
                fs.blocks(),
                fs.blocks_available(),
                fs.block_size() as u64,
            ),
            work_dir_in_memory: in_memory,
        })
    }

    /// Refuses a process that does not fit, naming what it needs and what
    /// there is. A request without figures (an older source) passes.
    pub(super) fn check(&self, node: &str, req: &PrepareRequest) -> Result<(), EngineError> {
        let (resident, dumped) = (req.resident_bytes, req.dumped_bytes);
        if resident == 0 && dumped == 0 {
            return Ok(());
        }
        let memory_source = if self.limited {
            "the limit [migration] incoming_memory_limit_mib"
        } else {
            "MemAvailable"
        };
        if dumped > self.work_dir_free {
            return Err(EngineError::NoRoom {
                node: node.to_owned(),
                detail: format!(
                    "it needs {} in the work dir for the process's page store and images and has {} free there",
                    mib(dumped),
                    mib(self.work_dir_free)
                ),
            });
        }
        if self.work_dir_in_memory {
            let need = resident.saturating_add(dumped);
            if need > self.memory {
                return Err(EngineError::NoRoom {
                    node: node.to_owned(),
                    detail: format!(
                        "it needs {} for the process (its resident set) and {} for its page store and images (the work dir is in memory), {} in all, and has {} ({memory_source})",
                        mib(resident),
                        mib(dumped),
                        mib(need),
                        mib(self.memory)
                    ),
                });
            }
        } else if resident > self.memory {
            return Err(EngineError::NoRoom {
                node: node.to_owned(),
                detail: format!(
                    "it needs {} for the process (its resident set) and has {} ({memory_source})",
                    mib(resident),
                    mib(self.memory)
                ),
            });
        }
        Ok(())
    }
}

/// Free bytes in the work dir's file system, from its `statfs`. A tmpfs
/// mounted without a size limit (`size=0`) and a ramfs report no blocks at
/// all: only memory bounds them, which [`Room::check`] counts.
fn work_dir_free(in_memory: bool, blocks: u64, available: u64, block_size: u64) -> u64 {
    if in_memory && blocks == 0 {
        u64::MAX
    } else {
        available.saturating_mul(block_size)
    }
}

fn mem_available(meminfo: &str) -> Option<u64> {
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(resident_mib: u64, dumped_mib: u64) -> PrepareRequest {
        PrepareRequest {
            resident_bytes: resident_mib << 20,
            dumped_bytes: dumped_mib << 20,
            ..Default::default()
        }
    }

    const IN_MEMORY: Room = Room {
        memory: 100 << 20,
        limited: true,
        work_dir_free: 1 << 40,
        work_dir_in_memory: true,
    };

    #[test]
    fn a_work_dir_in_memory_counts_the_store_against_memory() {
        assert!(IN_MEMORY.check("node2", &req(50, 50)).is_ok());
        let err = IN_MEMORY.check("node2", &req(60, 50)).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        let msg = err.to_string();
        for part in [
            "node2 cannot hold the process",
            "60.0 MiB for the process",
            "50.0 MiB for its page store",
            "110.0 MiB in all",
            "has 100.0 MiB",
            "incoming_memory_limit_mib",
        ] {
            assert!(msg.contains(part), "{part:?} not in {msg:?}");
        }
    }

    #[test]
    fn a_work_dir_on_disk_needs_memory_for_the_process_and_room_for_the_store() {
        let on_disk = Room {
            memory: 100 << 20,
            limited: false,
            work_dir_free: 40 << 20,
            work_dir_in_memory: false,
        };
        assert!(on_disk.check("n", &req(90, 40)).is_ok());
        let err = on_disk.check("n", &req(101, 10)).unwrap_err();
        assert!(err.to_string().contains("MemAvailable"), "{err}");
        let err = on_disk.check("n", &req(10, 41)).unwrap_err();
        assert!(
            err.to_string().contains("41.0 MiB in the work dir")
                && err.to_string().contains("40.0 MiB free"),
            "{err}"
        );
    }

    #[test]
    fn a_full_work_dir_in_memory_is_refused_too() {
        let full = Room {
            work_dir_free: 10 << 20,
            ..IN_MEMORY
        };
        let err = full.check("n", &req(20, 20)).unwrap_err();
        assert!(err.to_string().contains("10.0 MiB free"), "{err}");
    }

    #[test]
    fn a_tmpfs_without_a_size_limit_is_bounded_by_memory_alone() {
        // statfs of `mount -t tmpfs -o size=0` (and of a ramfs): no blocks.
        assert_eq!(work_dir_free(true, 0, 0, 4096), u64::MAX);
        // A full tmpfs with a limit, and a disk, report what they have.
        assert_eq!(work_dir_free(true, 256, 0, 4096), 0);
        assert_eq!(work_dir_free(false, 0, 0, 4096), 0);
        assert_eq!(work_dir_free(false, 1000, 10, 4096), 40960);
        let room = Room {
            memory: 100 << 20,
            limited: false,
            work_dir_free: work_dir_free(true, 0, 0, 4096),
            work_dir_in_memory: true,
        };
        room.check("node2", &req(40, 40)).unwrap();
        let e = room.check("node2", &req(60, 60)).unwrap_err();
        assert!(e.to_string().contains("MemAvailable"), "{e}");
    }

    #[test]
    fn an_older_source_without_figures_passes() {
        assert!(IN_MEMORY.check("n", &req(0, 0)).is_ok());
    }

    #[test]
    fn reads_this_node() {
        let meminfo = "MemTotal:       24684012 kB\nMemAvailable:   23650000 kB\n";
        assert_eq!(mem_available(meminfo), Some(23_650_000 * 1024));
        let room = Room::read(Path::new("/"), Some(1)).unwrap();
        assert_eq!(room.memory, 1 << 20);
        assert!(room.limited);
        let room = Room::read(Path::new("/"), None).unwrap();
        assert!(room.memory > 1 << 20 && !room.limited, "{room:?}");
    }
}
