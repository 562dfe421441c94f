//! The machine's network input backlog. veth pairs deliver through each
//! CPU's input backlog (`net.core.netdev_max_backlog` packets at most):
//! under a burst the test rig itself may drop packets there, machine-wide
//! and outside any namespace's counters. A bench sizes it for its rig
//! ([`BacklogSize`]) and reports the drops apart from what ferry loses
//! (the agent's reading of /proc/net/softnet_stat).

use std::path::{Path, PathBuf};

pub use ferry_agent::dataplane::softnet::{SoftnetError, backlog_drops};

const NETDEV_MAX_BACKLOG: &str = "/proc/sys/net/core/netdev_max_backlog";
/// Where a bench that raised the setting keeps the value to give back,
/// in a file named by its PID: a bench killed by a signal runs no drop
/// guard, and the next bench gives the value back from here.
const RECORDS: &str = "/run/ferry-bench";
const RECORD_PREFIX: &str = "netdev_max_backlog.";

#[derive(Debug, thiserror::Error)]
pub enum BacklogSizeError {
    #[error("{0}: {1}")]
    Io(String, #[source] std::io::Error),
    #[error("{0}: not a number: {1:?}")]
    Malformed(String, String),
}

/// `net.core.netdev_max_backlog` raised for a bench's run and given back
/// its value when dropped, or by the next bench if this one was killed
/// (its record under `/run/ferry-bench`). It is not per network
/// namespace: the whole machine sees it while the bench runs.
#[derive(Debug)]
pub struct BacklogSize {
    setting: PathBuf,
    /// The value to give back, kept in this file while raised.
    record: Option<PathBuf>,
    before: u32,
    now: u32,
}

impl BacklogSize {
    /// The machine's setting.
    pub fn current() -> Result<u32, BacklogSizeError> {
        read(Path::new(NETDEV_MAX_BACKLOG))
    }

    /// Raises the setting to `packets` (left alone when it is already at
    /// least that), after giving back the value a killed bench left raised.
    pub fn at_least(packets: u32) -> Result<Self, BacklogSizeError> {
        Self::at_least_in(Path::new(NETDEV_MAX_BACKLOG), Path::new(RECORDS), packets)
    }

    fn at_least_in(setting: &Path, records: &Path, packets: u32) -> Result<Self, BacklogSizeError> {
        give_back_for_the_dead(setting, records)?;
        let before = read(setting)?;
        let mut record = None;
        if packets > before {
            std::fs::create_dir_all(records).map_err(io(records))?;
            let path = records.join(format!("{RECORD_PREFIX}{}", std::process::id()));
            std::fs::write(&path, before.to_string()).map_err(io(&path))?;
            record = Some(path);
            std::fs::write(setting, packets.to_string()).map_err(io(setting))?;
        }
        Ok(Self {
            setting: setting.to_owned(),
            record,
            before,
            now: packets.max(before),
        })
    }

    /// The setting while this guard lives.
    pub fn packets(&self) -> u32 {
        self.now
    }
}

impl Drop for BacklogSize {
    fn drop(&mut self) {
        let Some(record) = self.record.take() else {
            return;
        };
        match std::fs::write(&self.setting, self.before.to_string()) {
            Ok(()) => {
                let _ = std::fs::remove_file(record);
            }
            Err(e) => eprintln!(
                "giving {} back its {}: {e}",
                self.setting.display(),
                self.before
            ),
        }
    }
}

/// Gives the setting back the value recorded by a bench that died with it
/// raised (its PID gone), and removes the record.
fn give_back_for_the_dead(setting: &Path, records: &Path) -> Result<(), BacklogSizeError> {
    let entries = match std::fs::read_dir(records) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(records)(e)),
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(RECORD_PREFIX))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let value = read(&entry.path())?;
        std::fs::write(setting, value.to_string()).map_err(io(setting))?;
        eprintln!(
            "{} given back its {value}, left raised by bench process {pid}, which died",
            setting.display()
        );
        std::fs::remove_file(entry.path()).map_err(io(&entry.path()))?;
    }
    Ok(())
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> BacklogSizeError + '_ {
    move |e| BacklogSizeError::Io(path.display().to_string(), e)
}

fn read(path: &Path) -> Result<u32, BacklogSizeError> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    text.trim().parse().map_err(|_| {
        BacklogSizeError::Malformed(path.display().to_string(), text.trim().to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(p: &Path) -> u32 {
        read(p).unwrap()
    }

    #[test]
    fn raised_for_the_run_and_given_back_at_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let (setting, records) = (dir.path().join("setting"), dir.path().join("records"));
        std::fs::write(&setting, "1000\n").unwrap();
        {
            let g = BacklogSize::at_least_in(&setting, &records, 32768).unwrap();
            assert_eq!(g.packets(), 32768);
            assert_eq!(value(&setting), 32768);
            let mine = records.join(format!("{RECORD_PREFIX}{}", std::process::id()));
            assert_eq!(value(&mine), 1000);
        }
        assert_eq!(value(&setting), 1000);
        assert_eq!(std::fs::read_dir(&records).unwrap().count(), 0);
        // Already higher: left alone, nothing recorded.
        std::fs::write(&setting, "65536").unwrap();
        let g = BacklogSize::at_least_in(&setting, &records, 32768).unwrap();
        assert_eq!(g.packets(), 65536);
        drop(g);
        assert_eq!(value(&setting), 65536);
    }

    #[test]
    fn a_killed_benchs_raise_is_given_back_by_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let (setting, records) = (dir.path().join("setting"), dir.path().join("records"));
        std::fs::create_dir_all(&records).unwrap();
        // A bench (no such PID) raised it to 32768 from 1000 and died.
        std::fs::write(&setting, "32768").unwrap();
        let dead = records.join(format!("{RECORD_PREFIX}{}", i32::MAX));
        std::fs::write(&dead, "1000").unwrap();
        std::fs::write(records.join("unrelated"), "x").unwrap();
        let g = BacklogSize::at_least_in(&setting, &records, 2000).unwrap();
        assert!(!dead.exists());
        assert_eq!(g.packets(), 2000);
        drop(g);
        assert_eq!(value(&setting), 1000);
        assert!(records.join("unrelated").exists());
    }
}
