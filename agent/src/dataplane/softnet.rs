//! The machine's network input backlog, from /proc/net/softnet_stat.
//!
//! Packets that arrive through `netif_rx()` (a veth pair, `lo`, and so the
//! replay's raw socket) wait in the receiving CPU's input backlog, at most
//! `net.core.netdev_max_backlog` of them; the rest are dropped there,
//! machine-wide, outside any namespace's counters. The file is the same in
//! every network namespace.

const SOFTNET_STAT: &str = "/proc/net/softnet_stat";

#[derive(Debug, thiserror::Error)]
pub enum SoftnetError {
    #[error("reading {SOFTNET_STAT}: {0}")]
    Read(#[source] std::io::Error),
    #[error("{SOFTNET_STAT}: malformed: {0}")]
    Malformed(String),
}

/// Packets the kernel dropped because a CPU's input backlog was full,
/// summed over CPUs, since boot.
pub fn backlog_drops() -> Result<u64, SoftnetError> {
    let text = std::fs::read_to_string(SOFTNET_STAT).map_err(SoftnetError::Read)?;
    sum_dropped(&text)
}

/// One line per CPU of hexadecimal columns; the second is `dropped`.
fn sum_dropped(text: &str) -> Result<u64, SoftnetError> {
    text.lines()
        .map(|line| {
            line.split_whitespace()
                .nth(1)
                .and_then(|w| u64::from_str_radix(w, 16).ok())
                .ok_or_else(|| SoftnetError::Malformed(line.to_owned()))
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_the_second_column_of_every_cpu() {
        let text = "0000a1b2 0000000a 00000000 00000000\n0000c3d4 00000010 00000001 00000000\n";
        assert_eq!(sum_dropped(text).unwrap(), 0x0a + 0x10);
        assert_eq!(sum_dropped("").unwrap(), 0);
        assert!(matches!(
            sum_dropped("0000a1b2\n"),
            Err(SoftnetError::Malformed(line)) if line == "0000a1b2"
        ));
    }

    #[test]
    fn reads_this_machines_counters() {
        backlog_drops().unwrap();
    }
}
