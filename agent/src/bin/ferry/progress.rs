//! A progress line on stderr for long operations: redrawn in place on a
//! terminal (phase, elapsed time, bytes sent, a bar for pre-copy rounds),
//! one line per step otherwise, nothing with --json.

use std::io::{IsTerminal, Write};

use ferry_proto::v1::MigrationProgress;

#[derive(Debug)]
pub struct Line {
    enabled: bool,
    terminal: bool,
    /// Whether the last thing written is an unfinished line.
    open: bool,
    /// A label in front of each line ("[2/5] PID 4242 -> node2").
    prefix: String,
}

impl Line {
    pub fn new(enabled: bool) -> Self {
        Line {
            enabled,
            terminal: std::io::stderr().is_terminal(),
            open: false,
            prefix: String::new(),
        }
    }

    pub fn set_prefix(&mut self, prefix: String) {
        self.prefix = prefix;
    }

    /// A line that stays.
    pub fn note(&mut self, text: &str) {
        if !self.enabled {
            return;
        }
        self.done();
        eprintln!("{text}");
    }

    pub fn phase(&mut self, p: &MigrationProgress) {
        if !self.enabled {
            return;
        }
        let ms = p.elapsed_us as f64 / 1000.0;
        let text = format!(
            "{}{:<22} {:>9.1} ms {:>10} sent{}",
            self.prefix,
            p.phase,
            ms,
            human_bytes(p.bytes_transferred),
            rounds_bar(&p.phase)
        );
        if self.terminal {
            // \r and clear to the end of the line: the line is redrawn.
            eprint!("\r\x1b[2K{text}");
            let _ = std::io::stderr().flush();
            self.open = true;
        } else {
            eprintln!("{text}");
        }
    }

    /// Ends the line being redrawn, if any.
    pub fn done(&mut self) {
        if self.open {
            eprintln!();
            self.open = false;
        }
    }
}

/// "pre-copy round 3" gets a bar of its rounds so far, so a long pre-copy
/// shows it is moving.
fn rounds_bar(phase: &str) -> String {
    match phase
        .strip_prefix("pre-copy round ")
        .and_then(|n| n.parse::<usize>().ok())
    {
        Some(n) => format!("  [{}]", "#".repeat(n.min(40))),
        None => String::new(),
    }
}

pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KB", "MB", "GB"];
    let mut v = b as f64;
    let mut unit = 0;
    while v >= 1000.0 && unit < UNITS.len() - 1 {
        v /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// `[####......] 2/5`: a bar for counted work such as a drain's processes.
pub fn count_bar(done: usize, total: usize) -> String {
    const WIDTH: usize = 20;
    let filled = (done * WIDTH).checked_div(total).unwrap_or(WIDTH);
    format!(
        "[{}{}] {done}/{total}",
        "#".repeat(filled),
        ".".repeat(WIDTH - filled)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_and_sizes_read_right() {
        assert_eq!(count_bar(0, 4), "[....................] 0/4");
        assert_eq!(count_bar(2, 4), "[##########..........] 2/4");
        assert_eq!(count_bar(0, 0), "[####################] 0/0");
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(12_345_678), "12.3 MB");
        assert_eq!(rounds_bar("pre-copy round 3"), "  [###]");
        assert_eq!(rounds_bar("dump"), "");
    }
}
