//! CRIU's lazy pages, for post-copy: the destination's `criu lazy-pages`
//! daemon, and the host setting both ends of the page transfer need.
//!
//! The daemon exists only as a CLI command (no swrk request starts it). It
//! reads the pstree, mm and pagemap images at start, listens on
//! `lazy-pages.socket` in its working directory (the restore's CRIU, run
//! with the same working directory, connects there and hands it each
//! task's userfaultfd), talks to the source's page server over the
//! connection it is handed (`--ps-socket`: ferry's page tunnel), serves
//! faults, pushes every remaining page in the background, then sends the
//! page server its close and exits 0.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use super::CriuError;

/// The socket the daemon listens on, in its working directory.
pub const SOCKET: &str = "lazy-pages.socket";

/// The daemon's log, in its working directory.
pub const LOG: &str = "lazy-pages.log";

/// CRIU sizes the pipes it moves pages through to 4 MiB (F_SETPIPE_SZ).
/// Without CAP_SYS_RESOURCE that fails silently above `fs.pipe-max-size`
/// and the transfer then breaks half-way ("tee: Operation not
/// permitted", "Broken pipe").
pub const PIPE_MAX_SIZE_NEEDED: u64 = 4 << 20;

const PIPE_MAX_SIZE: &str = "/proc/sys/fs/pipe-max-size";

/// `fs.pipe-max-size` now.
pub fn pipe_max_size() -> Result<u64, CriuError> {
    let io = |source| CriuError::Io {
        path: PIPE_MAX_SIZE.into(),
        source,
    };
    let text = std::fs::read_to_string(PIPE_MAX_SIZE).map_err(io)?;
    text.trim().parse().map_err(|_| CriuError::Io {
        path: PIPE_MAX_SIZE.into(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, text.trim().to_owned()),
    })
}

/// Raises `fs.pipe-max-size` to [`PIPE_MAX_SIZE_NEEDED`] if it is lower;
/// returns the old value if it changed it. Called once at agent start-up.
pub fn raise_pipe_max_size() -> Result<Option<u64>, CriuError> {
    let now = pipe_max_size()?;
    if now >= PIPE_MAX_SIZE_NEEDED {
        return Ok(None);
    }
    std::fs::write(PIPE_MAX_SIZE, PIPE_MAX_SIZE_NEEDED.to_string()).map_err(|source| {
        CriuError::Io {
            path: PIPE_MAX_SIZE.into(),
            source,
        }
    })?;
    Ok(Some(now))
}

/// Refuses post-copy on a host whose `fs.pipe-max-size` would break it.
pub fn check_pipe_max_size() -> Result<(), String> {
    match pipe_max_size() {
        Ok(n) if n >= PIPE_MAX_SIZE_NEEDED => Ok(()),
        Ok(n) => Err(format!(
            "fs.pipe-max-size is {n} here; CRIU's lazy pages need {PIPE_MAX_SIZE_NEEDED} \
             (ferryd raises it at start-up; something lowered it since, or the write was refused)"
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// A running `criu lazy-pages` daemon.
#[derive(Debug)]
pub struct Daemon {
    pub child: tokio::process::Child,
    pub pid: i32,
    /// Its working directory (socket and log).
    pub work_dir: PathBuf,
    /// When it was started: its log's timestamps count from about here.
    pub started: Instant,
}

/// Starts the daemon for the images in `images_dir`, fetching pages over
/// `page_server` (a connection to the source's page server, which the
/// daemon inherits under the same descriptor number and this process
/// gives up), and waits (up to `wait`) until it listens for the restore.
/// On failure nothing is left running.
pub async fn start(
    criu: &Path,
    images_dir: &Path,
    work_dir: &Path,
    page_server: OwnedFd,
    log_level: i32,
    wait: Duration,
) -> Result<Daemon, CriuError> {
    let ps = page_server.as_raw_fd();
    let mut cmd = tokio::process::Command::new(criu);
    cmd.arg("lazy-pages")
        .arg("--images-dir")
        .arg(images_dir)
        .arg("--work-dir")
        .arg(work_dir)
        .arg("--log-file")
        .arg(LOG)
        // The "UFFD transferred pages" summary is a debug line: -v4.
        .arg(format!("-v{}", log_level.max(4)))
        .arg("--page-server")
        .arg("--ps-socket")
        .arg(ps.to_string())
        .current_dir(work_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // A daemon must never outlive the handle that watches it.
        .kill_on_drop(true);
    // SAFETY: the closure runs in the forked child before exec and only
    // calls fcntl(), which is async-signal-safe; clearing FD_CLOEXEC on the
    // page-server connection is how the daemon inherits it.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(ps, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let started = Instant::now();
    let spawned = cmd.spawn();
    // The daemon has its copy; ours would keep the connection open after
    // the daemon's end.
    drop(page_server);
    let mut child = spawned.map_err(|source| CriuError::Spawn {
        path: criu.to_owned(),
        source,
    })?;
    let pid = child.id().map(|p| p as i32).unwrap_or(0);
    let socket = work_dir.join(SOCKET);
    let deadline = Instant::now() + wait;
    loop {
        if socket.exists() {
            return Ok(Daemon {
                child,
                pid,
                work_dir: work_dir.to_owned(),
                started,
            });
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(CriuError::Failed {
                operation: "lazy-pages",
                reason: format!(
                    "the daemon exited ({status}) before it listened: {}",
                    log_tail(&work_dir.join(LOG))
                ),
            });
        }
        if Instant::now() > deadline {
            let _ = child.kill().await;
            return Err(CriuError::Failed {
                operation: "lazy-pages",
                reason: format!(
                    "no {SOCKET} after {} ms: {}",
                    wait.as_millis(),
                    log_tail(&work_dir.join(LOG))
                ),
            });
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Pages the daemon placed and had to place, summed over the tasks, from
/// its log's "UFFD transferred pages: (N/M)" lines.
pub fn transferred_pages(log: &Path) -> (u64, u64) {
    let Ok(text) = std::fs::read_to_string(log) else {
        return (0, 0);
    };
    parse_transferred(&text)
}

fn parse_transferred(text: &str) -> (u64, u64) {
    let (mut done, mut total) = (0, 0);
    for line in text.lines() {
        let Some(i) = line.find("UFFD transferred pages: (") else {
            continue;
        };
        let rest = &line[i + "UFFD transferred pages: (".len()..];
        let Some(end) = rest.find(')') else { continue };
        if let Some((a, b)) = rest[..end].split_once('/')
            && let (Ok(a), Ok(b)) = (a.trim().parse::<u64>(), b.trim().parse::<u64>())
        {
            done += a;
            total += b;
        }
    }
    (done, total)
}

/// The page faults of the restored process that the daemon served, from
/// its log (`-v4`): "#PF at <addr>" when a thread faulted on a page still
/// missing, "uffd_copy: <addr>/<len>" when a range was placed. A fault's
/// wait lasts from the first to the first copy after it that covers the
/// address (the copy may be a background one already under way).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FaultDelay {
    pub faults: u64,
    /// The waits summed: how long the process's threads were held up.
    pub waited_us: u64,
}

/// [`FaultDelay`] of the faults logged at or after `from` (seconds since
/// the daemon's start, as its log counts).
pub fn fault_delay(log: &Path, from: f64) -> FaultDelay {
    let Ok(text) = std::fs::read_to_string(log) else {
        return FaultDelay::default();
    };
    parse_fault_delay(&text, from)
}

fn parse_fault_delay(text: &str, from: f64) -> FaultDelay {
    // (task, address) -> when it faulted.
    let mut waiting: Vec<(String, u64, f64)> = Vec::new();
    let mut delay = FaultDelay::default();
    for line in text.lines() {
        let Some(at) = line
            .strip_prefix('(')
            .and_then(|l| l.split_once(')'))
            .and_then(|(t, _)| t.trim().parse::<f64>().ok())
        else {
            continue;
        };
        let task = || {
            line.split_once("uffd: ")
                .and_then(|(_, r)| r.split_once(':'))
                .map(|(t, _)| t.to_owned())
        };
        let hex = |s: &str| u64::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok();
        if let Some((_, addr)) = line.split_once("#PF at ") {
            if let (Some(task), Some(addr)) = (task(), hex(addr))
                && at >= from
            {
                waiting.push((task, addr, at));
            }
        } else if let Some((_, range)) = line.split_once("uffd_copy: ")
            && let Some((addr, len)) = range.split_once('/')
            && let (Some(task), Some(addr), Ok(len)) =
                (task(), hex(addr), len.trim().parse::<u64>())
        {
            waiting.retain(|(t, a, since)| {
                let served = *t == task && *a >= addr && *a < addr + len;
                if served {
                    delay.faults += 1;
                    delay.waited_us += ((at - since) * 1e6).round() as u64;
                }
                !served
            });
        }
    }
    delay
}

/// The last error lines of a CRIU log, for a report.
pub fn log_tail(log: &Path) -> String {
    let Ok(text) = std::fs::read_to_string(log) else {
        return format!("no log at {}", log.display());
    };
    let errors: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("Error") && !l.contains("RLIMIT_NOFILE"))
        .collect();
    let lines = if errors.is_empty() {
        text.lines().rev().take(3).collect::<Vec<_>>()
    } else {
        errors.into_iter().rev().take(4).collect()
    };
    lines
        .into_iter()
        .rev()
        .map(str::trim)
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_waits_until_a_copy_covers_it() {
        let log = "(00.010000) uffd: 1-8: #PF at 0x1000\n\
                   (00.012000) uffd: 1-8: uffd_copy: 0x1000/4096\n\
                   (00.020000) uffd: 1-8: #PF at 0x5000\n\
                   (00.020500) uffd: 7-9: uffd_copy: 0x5000/4096\n\
                   (00.021000) uffd: 1-8: uffd_copy: 0x3000/4096\n\
                   (00.023000) uffd: 1-8: uffd_copy: 0x4000/16384\n\
                   (00.030000) uffd: 1-8: #PF at 0x9000\n";
        // Two served (2 ms, then 3 ms: another task's copy and a copy
        // that misses do not count); the last one never was.
        let d = parse_fault_delay(log, 0.0);
        assert_eq!(d.faults, 2);
        assert_eq!(d.waited_us, 5000);
        // Faults before `from` (during the restore) are not counted.
        let d = parse_fault_delay(log, 0.015);
        assert_eq!((d.faults, d.waited_us), (1, 3000));
    }

    #[test]
    fn the_summary_lines_of_every_task_add_up() {
        let log = "(00.100) uffd: 1-5: UFFD transferred pages: (16384/16390)\n\
                   (00.101) lazy-pages: something else\n\
                   (00.200) uffd: 7-6: UFFD transferred pages: (10/10)\n";
        assert_eq!(parse_transferred(log), (16394, 16400));
        assert_eq!(parse_transferred("nothing"), (0, 0));
    }
}
