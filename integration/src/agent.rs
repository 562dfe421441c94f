//! One node's `ferryd` process: started in the node's network namespace,
//! probed until its control socket answers, stopped with SIGTERM then
//! SIGKILL.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::control;
use crate::netns::{self, NetNsError};

/// Lines of an agent's log quoted in errors and failure reports.
pub const LOG_TAIL_LINES: usize = 40;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(
        "ferryd binary {0} not found: build it (cargo build -p ferry-agent) or set FERRY_BIN_DIR"
    )]
    NoBinary(PathBuf),
    #[error("creating the log {path}: {source}")]
    Log {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Spawn(#[from] NetNsError),
    #[error("ferryd on {node} exited ({status}) before answering; log tail:\n{log_tail}")]
    Exited {
        node: String,
        status: ExitStatus,
        log_tail: String,
    },
    #[error(
        "ferryd on {node} did not answer ListNodes within {timeout:?} ({last_error}); log tail:\n{log_tail}"
    )]
    NotReady {
        node: String,
        timeout: Duration,
        last_error: String,
        log_tail: String,
    },
    #[error("waiting for ferryd on {node}: {source}")]
    Wait {
        node: String,
        source: std::io::Error,
    },
}

/// How to start one agent.
#[derive(Debug, Clone)]
pub struct AgentLaunch {
    pub node: String,
    pub binary: PathBuf,
    pub config: PathBuf,
    pub netns: PathBuf,
    pub log: PathBuf,
    pub control_socket: PathBuf,
    /// Working directory of the process (the node's directory).
    pub cwd: PathBuf,
    /// Environment variables beside the usual ones (a crash point, say).
    pub env: Vec<(String, String)>,
}

#[derive(Debug)]
pub struct AgentProcess {
    launch: AgentLaunch,
    child: Option<Child>,
}

impl AgentProcess {
    /// Starts `ferryd --config CONFIG` with stdout and stderr appended to
    /// the log. `RUST_LOG` defaults to `info,ferry=debug`; `FERRY_RUST_LOG`
    /// overrides it for the agents only.
    pub fn spawn(launch: AgentLaunch) -> Result<Self, AgentError> {
        if !launch.binary.is_file() {
            return Err(AgentError::NoBinary(launch.binary.clone()));
        }
        let log = File::options()
            .create(true)
            .append(true)
            .open(&launch.log)
            .map_err(|source| AgentError::Log {
                path: launch.log.clone(),
                source,
            })?;
        let log2 = log.try_clone().map_err(|source| AgentError::Log {
            path: launch.log.clone(),
            source,
        })?;
        let rust_log =
            std::env::var("FERRY_RUST_LOG").unwrap_or_else(|_| "info,ferry=debug".to_owned());
        let mut cmd = Command::new(&launch.binary);
        cmd.arg("--config")
            .arg(&launch.config)
            .current_dir(&launch.cwd)
            .env("RUST_LOG", rust_log)
            .envs(launch.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        let child = netns::spawn_in(&launch.netns, cmd)?.into_inner();
        tracing::debug!(node = %launch.node, pid = child.id(), "ferryd started");
        Ok(Self {
            launch,
            child: Some(child),
        })
    }

    pub fn node(&self) -> &str {
        &self.launch.node
    }

    pub fn launch(&self) -> &AgentLaunch {
        &self.launch
    }

    /// The host PID, while the process has not been reaped.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.launch.log, lines)
    }

    /// Polls `ListNodes` on the control socket until it answers, the process
    /// exits, or `timeout` passes. Runs its own runtime on a helper thread,
    /// so it works from plain and from `#[tokio::test]` tests alike.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<(), AgentError> {
        let node = self.launch.node.clone();
        let socket = self.launch.control_socket.clone();
        let Some(child) = self.child.as_mut() else {
            return Err(AgentError::NotReady {
                node,
                timeout,
                last_error: "the agent was stopped".into(),
                log_tail: self.log_tail(LOG_TAIL_LINES),
            });
        };
        let outcome = std::thread::scope(|s| {
            s.spawn(|| poll_ready(child, &socket, timeout))
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))
        });
        let log_tail = || log_tail(&self.launch.log, LOG_TAIL_LINES);
        match outcome {
            Ready::Yes => Ok(()),
            Ready::Exited(status) => Err(AgentError::Exited {
                node,
                status,
                log_tail: log_tail(),
            }),
            Ready::WaitFailed(source) => Err(AgentError::Wait { node, source }),
            Ready::TimedOut(last_error) => Err(AgentError::NotReady {
                node,
                timeout,
                last_error,
                log_tail: log_tail(),
            }),
        }
    }

    /// SIGTERM, up to `grace` for a clean exit, then SIGKILL; reaps the
    /// process. Idempotent; returns the exit status if there was a process.
    /// The exit status if the agent has exited (reaped then), None while
    /// it runs.
    pub fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        match self.child.as_mut() {
            Some(child) => child.try_wait(),
            None => Ok(None),
        }
    }

    pub fn stop(&mut self, grace: Duration) -> Result<Option<ExitStatus>, AgentError> {
        self.terminate();
        self.reap(Instant::now() + grace)
    }

    /// Sends SIGTERM (if the process still runs). With [`AgentProcess::reap`]
    /// this lets a cluster stop all its agents in parallel.
    pub fn terminate(&mut self) {
        if let Some(child) = self.child.as_mut()
            && let Ok(None) = child.try_wait()
        {
            // Not reaped yet, so the PID cannot have been reused.
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
        }
    }

    /// Waits until `deadline` for the process to exit, then SIGKILLs it, and
    /// reaps it. Idempotent.
    pub fn reap(&mut self, deadline: Instant) -> Result<Option<ExitStatus>, AgentError> {
        let Some(mut child) = self.child.take() else {
            return Ok(None);
        };
        let node = self.launch.node.clone();
        let wait_err = |source| AgentError::Wait {
            node: node.clone(),
            source,
        };
        loop {
            if let Some(status) = child.try_wait().map_err(wait_err)? {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("ferry-integration: ferryd on {node} did not exit after SIGTERM; killing it");
        let _ = child.kill();
        child.wait().map(Some).map_err(wait_err)
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if let Err(e) = self.stop(Duration::from_secs(5)) {
            eprintln!("ferry-integration: {e}");
        }
    }
}

enum Ready {
    Yes,
    Exited(ExitStatus),
    WaitFailed(std::io::Error),
    TimedOut(String),
}

fn poll_ready(child: &mut Child, socket: &Path, timeout: Duration) -> Ready {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return Ready::TimedOut(format!("building a runtime: {e}")),
    };
    runtime.block_on(async {
        let deadline = Instant::now() + timeout;
        let mut last_error = "control socket not created yet".to_owned();
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return Ready::Exited(status),
                Ok(None) => {}
                Err(e) => return Ready::WaitFailed(e),
            }
            if socket.exists() {
                match control::list_nodes(socket, Duration::from_secs(2)).await {
                    Ok(_) => return Ready::Yes,
                    Err(e) => last_error = e.to_string(),
                }
            }
            if Instant::now() >= deadline {
                return Ready::TimedOut(last_error);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// The last `lines` lines of a log file, or a note saying why there are none.
pub fn log_tail(path: &Path, lines: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().collect();
            let start = all.len().saturating_sub(lines);
            if all.is_empty() {
                format!("({} is empty)", path.display())
            } else {
                all[start..].join("\n")
            }
        }
        Err(e) => format!("({}: {e})", path.display()),
    }
}
