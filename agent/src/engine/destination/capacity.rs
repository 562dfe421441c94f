//! Whether this node can hold an incoming process, checked at Prepare,
//! before anything stops: its resident set must fit in the memory this
//! node offers, and its page store and images (a copy of each page it
//! dumps, never more: `PageStore`) in the work dir, which takes memory too
//! when it is a tmpfs. A process that grows after Prepare is checked
//! again as its pre-copied pages arrive ([`Announced`]), still before
//! anything stops.

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
    /// MemAvailable.
    pub available: u64,
    /// The configured limit, `[migration] incoming_memory_limit_mib`.
    pub limit: Option<u64>,
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
            available,
            limit,
            work_dir_free: work_dir_free(
                in_memory,
                fs.blocks(),
                fs.blocks_available(),
                fs.block_size() as u64,
            ),
            work_dir_in_memory: in_memory,
        })
    }

    /// Bytes of memory a migration may take: MemAvailable, or the
    /// configured limit if lower.
    fn memory(&self) -> u64 {
        self.limit.map_or(self.available, |l| l.min(self.available))
    }

    /// Whether [`Room::memory`] is the configured limit.
    fn limited(&self) -> bool {
        self.limit.is_some_and(|l| l < self.available)
    }

    /// Refuses a process that does not fit, naming what it needs and what
    /// there is. A request without figures (an older source) passes.
    pub(super) fn check(&self, node: &str, req: &PrepareRequest) -> Result<(), EngineError> {
        let (resident, dumped) = (req.resident_bytes, req.dumped_bytes);
        if resident == 0 && dumped == 0 {
            return Ok(());
        }
        let memory_source = if self.limited() {
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
            if need > self.memory() {
                return Err(EngineError::NoRoom {
                    node: node.to_owned(),
                    detail: format!(
                        "it needs {} for the process (its resident set) and {} for its page store and images (the work dir is in memory), {} in all, and has {} ({memory_source})",
                        mib(resident),
                        mib(dumped),
                        mib(need),
                        mib(self.memory())
                    ),
                });
            }
        } else if resident > self.memory() {
            return Err(EngineError::NoRoom {
                node: node.to_owned(),
                detail: format!(
                    "it needs {} for the process (its resident set) and has {} ({memory_source})",
                    mib(resident),
                    mib(self.memory())
                ),
            });
        }
        Ok(())
    }

    /// Checks again, read now, for a process whose pre-copied pages came
    /// to more than Prepare was told ([`Announced::grown_past`]): its
    /// resident set counts as grown by as much, and its page store holds
    /// `stored` bytes, already taken from MemAvailable when the work dir
    /// is in memory (not from the configured limit, which bounds all that
    /// the migration takes).
    pub(super) fn recheck(
        &self,
        node: &str,
        announced: &Announced,
        stored: u64,
    ) -> Result<(), EngineError> {
        let grown = stored.saturating_sub(announced.dumped);
        let process = announced.resident.saturating_add(grown);
        let store_in_memory = if self.work_dir_in_memory { stored } else { 0 };
        let total = process.saturating_add(store_in_memory);
        let (needs, has, source) = match self.limit {
            Some(limit) if total > limit => (
                total,
                limit,
                "the limit [migration] incoming_memory_limit_mib",
            ),
            _ if process > self.available => (process, self.available, "MemAvailable"),
            _ => return Ok(()),
        };
        let store = if self.work_dir_in_memory && needs == total {
            format!(
                " and {} for its page store (the work dir is in memory), {} in all",
                mib(stored),
                mib(total)
            )
        } else {
            String::new()
        };
        Err(EngineError::NoRoom {
            node: node.to_owned(),
            detail: format!(
                "it grew after Prepare: its pre-copied pages came to {}, {} more than the {} announced; with its resident set grown as much it needs {} for the process{store}, and has {} ({source})",
                mib(stored),
                mib(grown),
                mib(announced.dumped),
                mib(process),
                mib(has)
            ),
        })
    }
}

/// What Prepare was told of an incoming process, kept for the re-checks
/// while its pre-copied pages arrive: a process that grows after Prepare
/// (a cache filling up during the rounds) would otherwise only meet the
/// limit as a full work dir or the OOM killer, in the freeze or after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Announced {
    /// Its resident set, bytes.
    pub resident: u64,
    /// What its dump would hold, bytes.
    pub dumped: u64,
}

/// Growth between two re-checks: the files read for one are cheap, but
/// not worth reading for every batch.
const RECHECK_EVERY: u64 = 8 << 20;

impl Announced {
    pub(crate) fn of(req: &PrepareRequest) -> Announced {
        Announced {
            resident: req.resident_bytes,
            dumped: req.dumped_bytes,
        }
    }

    /// Whether `stored` bytes of pages held are past what was announced
    /// and past `*next` (a re-check is due; `*next` moves on). An older
    /// source that announced nothing is never checked, as at Prepare.
    pub(crate) fn grown_past(&self, stored: u64, next: &mut u64) -> bool {
        if (self.resident == 0 && self.dumped == 0) || stored <= self.dumped.max(*next) {
            return false;
        }
        *next = stored.saturating_add(RECHECK_EVERY);
        true
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
        available: 1 << 40,
        limit: Some(100 << 20),
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
            available: 100 << 20,
            limit: None,
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
            available: 100 << 20,
            limit: None,
            work_dir_free: work_dir_free(true, 0, 0, 4096),
            work_dir_in_memory: true,
        };
        room.check("node2", &req(40, 40)).unwrap();
        let e = room.check("node2", &req(60, 60)).unwrap_err();
        assert!(e.to_string().contains("MemAvailable"), "{e}");
    }

    #[test]
    fn a_process_grown_past_its_figures_is_checked_again_as_its_pages_arrive() {
        let announced = Announced {
            resident: 30 << 20,
            dumped: 30 << 20,
        };
        let mut next = 0;
        // Within what was announced: nothing to check.
        assert!(!announced.grown_past(30 << 20, &mut next));
        assert!(announced.grown_past(31 << 20, &mut next));
        // Not again before another 8 MiB.
        assert!(!announced.grown_past(38 << 20, &mut next));
        assert!(announced.grown_past(40 << 20, &mut next));
        // An older source's request without figures: never.
        let none = Announced {
            resident: 0,
            dumped: 0,
        };
        assert!(!none.grown_past(1 << 40, &mut 0));

        // Limit 100 MiB, work dir in memory: 30 + 10 grown for the process
        // and 40 stored fit; 30 + 40 and 60 stored (130) do not.
        IN_MEMORY.recheck("node2", &announced, 40 << 20).unwrap();
        let err = IN_MEMORY
            .recheck("node2", &announced, 60 << 20)
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        let msg = err.to_string();
        for part in [
            "node2 cannot hold the process: it grew after Prepare",
            "came to 60.0 MiB, 30.0 MiB more than the 30.0 MiB announced",
            "60.0 MiB for the process and 60.0 MiB for its page store",
            "120.0 MiB in all",
            "has 100.0 MiB (the limit [migration] incoming_memory_limit_mib)",
        ] {
            assert!(msg.contains(part), "{part:?} not in {msg:?}");
        }
        // Without a limit, the store already came out of MemAvailable: the
        // grown process alone must fit what is left.
        let unlimited = Room {
            available: 50 << 20,
            limit: None,
            ..IN_MEMORY
        };
        unlimited.recheck("n", &announced, 50 << 20).unwrap();
        let err = unlimited.recheck("n", &announced, 51 << 20).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("51.0 MiB for the process, and has 50.0 MiB (MemAvailable)"),
            "{msg}"
        );
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
        assert_eq!(room.memory(), 1 << 20);
        assert!(room.limited());
        let room = Room::read(Path::new("/"), None).unwrap();
        assert!(room.memory() > 1 << 20 && !room.limited(), "{room:?}");
    }
}
