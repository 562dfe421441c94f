//! The machine's network input backlog. veth pairs deliver through each
//! CPU's input backlog (`net.core.netdev_max_backlog` packets at most):
//! under a burst the test rig itself may drop packets there, machine-wide
//! and outside any namespace's counters. A bench sizes it for its rig
//! ([`BacklogSize`]) and reports the drops apart from what ferry loses
//! (the agent's reading of /proc/net/softnet_stat).

use std::path::Path;

pub use ferry_agent::dataplane::softnet::{SoftnetError, backlog_drops};

const NETDEV_MAX_BACKLOG: &str = "/proc/sys/net/core/netdev_max_backlog";

#[derive(Debug, thiserror::Error)]
pub enum BacklogSizeError {
    #[error("{NETDEV_MAX_BACKLOG}: {0}")]
    Io(#[source] std::io::Error),
    #[error("{NETDEV_MAX_BACKLOG}: not a number: {0:?}")]
    Malformed(String),
}

/// `net.core.netdev_max_backlog` raised for a bench's run and given back
/// its value when dropped. It is not per network namespace: the whole
/// machine sees it while the bench runs.
#[derive(Debug)]
pub struct BacklogSize {
    before: u32,
    now: u32,
}

impl BacklogSize {
    /// The machine's setting.
    pub fn current() -> Result<u32, BacklogSizeError> {
        read(Path::new(NETDEV_MAX_BACKLOG))
    }

    /// Raises the setting to `packets` (left alone when it is already at
    /// least that).
    pub fn at_least(packets: u32) -> Result<Self, BacklogSizeError> {
        let before = Self::current()?;
        if packets > before {
            std::fs::write(NETDEV_MAX_BACKLOG, packets.to_string())
                .map_err(BacklogSizeError::Io)?;
        }
        Ok(Self {
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
        if self.now != self.before
            && let Err(e) = std::fs::write(NETDEV_MAX_BACKLOG, self.before.to_string())
        {
            eprintln!("giving {NETDEV_MAX_BACKLOG} back its {}: {e}", self.before);
        }
    }
}

fn read(path: &Path) -> Result<u32, BacklogSizeError> {
    let text = std::fs::read_to_string(path).map_err(BacklogSizeError::Io)?;
    text.trim()
        .parse()
        .map_err(|_| BacklogSizeError::Malformed(text.trim().to_owned()))
}
