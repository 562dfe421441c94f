//! Starting, adopting and watching managed processes: each one's end is
//! seen (through a pidfd, and its exit status when it is ferryd's child),
//! announced, and its ports released.

use std::sync::Arc;

use crate::dataplane::DataPlane;
use crate::managed::{AdoptError, Lifecycle, ManagedProcess, Origin, Processes, SpawnError};
use crate::ports::Ports;

#[derive(Debug)]
pub struct Supervisor {
    node: String,
    processes: Arc<Processes>,
    ports: Arc<Ports>,
    dataplane: Arc<DataPlane>,
}

impl Supervisor {
    pub fn new(
        node: &str,
        processes: Arc<Processes>,
        ports: Arc<Ports>,
        dataplane: Arc<DataPlane>,
    ) -> Self {
        Self {
            node: node.to_owned(),
            processes,
            ports,
            dataplane,
        }
    }

    /// Starts `argv` under management (`ferry run`), as `options` say.
    pub async fn run(
        self: &Arc<Self>,
        argv: Vec<String>,
        options: crate::managed::SpawnOptions,
    ) -> Result<i32, SpawnError> {
        let to_spawn = argv.clone();
        // A clone and the wait for its exec: off the runtime.
        let pid = tokio::task::spawn_blocking(move || crate::managed::spawn(&to_spawn, &options))
            .await
            .map_err(|e| SpawnError::Spawn {
                program: argv.first().cloned().unwrap_or_default(),
                source: std::io::Error::other(e.to_string()),
            })??;
        self.processes.adopt(ManagedProcess {
            pid,
            argv,
            origin: Origin::Run,
            lifecycle: Lifecycle::Running,
            sockets: Default::default(),
        });
        self.processes.persist_async().await;
        // Our child: its exit status is read when it ends.
        self.watch_exit(pid, "managed");
        Ok(pid)
    }

    /// Puts the running process `pid` under management (`ferry adopt`),
    /// once [`crate::process::shape_obstacles`] and
    /// [`crate::managed::tree_obstacles`] find nothing against it. It is
    /// not this agent's child: its end is seen through a pidfd, its exit
    /// status is not.
    pub async fn adopt(self: &Arc<Self>, pid: i32) -> Result<ManagedProcess, AdoptError> {
        if pid == std::process::id() as i32 {
            return Err(AdoptError::Agent { pid });
        }
        if self.processes.registry().get(pid).is_some() {
            return Err(AdoptError::AlreadyManaged { pid });
        }
        let node = self.node.clone();
        let (info, obstacles) = tokio::task::spawn_blocking(move || {
            let (info, mut obstacles) =
                crate::process::shape_obstacles(pid).map_err(|e| match e {
                    crate::process::ProcessError::NotFound { .. } => {
                        AdoptError::NotFound { pid, node }
                    }
                    source => AdoptError::Process { pid, source },
                })?;
            let tree = crate::process::process_tree(pid);
            obstacles.extend(
                crate::managed::tree_obstacles(&tree)
                    .map_err(|reason| AdoptError::Sockets { pid, reason })?,
            );
            Ok((info, obstacles))
        })
        .await
        .map_err(|e| AdoptError::Sockets {
            pid,
            reason: format!("the check's task failed: {e}"),
        })??;
        if !obstacles.is_empty() {
            return Err(AdoptError::Obstacles { pid, obstacles });
        }
        let p = ManagedProcess {
            pid,
            argv: info.argv,
            origin: Origin::Adopted,
            lifecycle: Lifecycle::Running,
            sockets: Default::default(),
        };
        // Two adoptions of one PID race: the second finds it managed.
        if !self.processes.adopt_if_new(p.clone()) {
            return Err(AdoptError::AlreadyManaged { pid });
        }
        self.watch_exit(pid, "adopted");
        self.processes.persist_async().await;
        if let Err(e) = self.ports.refresh().await {
            tracing::warn!(pid, error = %e, "claiming the ports of an adopted process");
        }
        Ok(self.processes.registry().get(pid).cloned().unwrap_or(p))
    }

    /// At start-up: adopts again the processes an earlier agent managed
    /// that still run (same PID, same start time), watches them exit, and
    /// drops holds no migration will release (none survives a restart).
    /// Their ports stay owned throughout when the data-plane maps are
    /// pinned: the filter already holds them
    /// ([`crate::dataplane::PortTable::new`]). Blocking.
    pub fn readopt(self: &Arc<Self>) -> usize {
        let mut adopted = 0;
        for r in self.processes.remembered() {
            match crate::process::inspect(r.pid) {
                Ok(info) if info.start_ticks == r.start_ticks && info.state != 'Z' => {
                    self.processes.registry().insert(ManagedProcess {
                        pid: r.pid,
                        argv: r.argv.clone(),
                        origin: r.origin(),
                        lifecycle: Lifecycle::Running,
                        sockets: Default::default(),
                    });
                    tracing::info!(pid = r.pid, argv = ?r.argv, "managed process adopted again");
                    // Not our child any more: watched through a pidfd.
                    self.watch_exit(r.pid, "adopted");
                    adopted += 1;
                }
                _ => tracing::info!(pid = r.pid, "a process of the earlier agent is gone"),
            }
        }
        self.processes.persist();
        let mut flows = self.dataplane.flows();
        match flows.rules() {
            Ok(rules) => {
                for r in rules
                    .into_iter()
                    .filter(|r| r.action == ferry_ebpf::RuleAction::Hold)
                {
                    if let Err(e) = flows.remove(&r) {
                        tracing::warn!(rule = %r, error = %e, "removing a stale hold");
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "reading translation rules"),
        }
        adopted
    }

    /// Waits (pidfd) for `pid` to exit, reaping it if it is our child (then
    /// its exit status is known: a process CRIU restored here is, by
    /// `rst_sibling`), and handles its end. Needs the tokio runtime.
    pub fn watch_exit(self: &Arc<Self>, pid: i32, what: &'static str) {
        let me = self.clone();
        tokio::spawn(async move {
            let exit = match crate::reaper::wait_exit(pid).await {
                Ok(Some(status)) => crate::managed::exit_from_wait_status(status),
                Ok(None) => crate::managed::exit_unknown(
                    "not this agent's child (adopted, or managed since an agent restart)",
                ),
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                    crate::managed::exit_unknown("gone before it could be watched")
                }
                Err(e) => {
                    tracing::warn!(pid, error = %e, "watching the {what} process");
                    return;
                }
            };
            tracing::info!(pid, "{what} process ended");
            me.ended(pid, exit).await;
        });
    }

    /// A managed process ended (its exit watcher saw it): forgotten, its
    /// ports released and its end announced, unless a migration stopped
    /// or moved it (see [`crate::managed::Registry::ended`]).
    async fn ended(self: &Arc<Self>, pid: i32, exit: ferry_proto::v1::ProcessExit) {
        let how = exit.description.clone();
        if self.processes.ended(pid, exit).is_none() {
            return;
        }
        tracing::info!(pid, how = %how, "managed process ended");
        self.processes.persist_soon();
        if let Err(e) = self.ports.refresh().await {
            tracing::warn!(error = %e, "releasing ports of an exited process");
        }
    }
}
