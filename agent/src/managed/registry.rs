//! The registry of managed processes: who they are, where each stands in
//! a migration, what sockets they hold, and so which ports this node must
//! own for them.

use std::collections::BTreeMap;

use ferry_proto::v1::ProcessExit;

use super::{Lifecycle, ManagedProcess, OutStage};
use crate::dataplane::PortState;
use crate::process::{self, PortKey};

#[derive(Debug, Default)]
pub struct Registry {
    procs: BTreeMap<i32, ManagedProcess>,
    /// Processes that died while a migration held them stopped (or
    /// resuming), with how: the migration decides what that means, and
    /// [`Self::refresh`] forgets them once it let go.
    died_in_migration: BTreeMap<i32, ProcessExit>,
}

impl Registry {
    pub fn insert(&mut self, p: ManagedProcess) {
        self.died_in_migration.remove(&p.pid);
        self.procs.insert(p.pid, p);
    }

    /// Process `pid` ended (its exit watcher saw it go). A process that
    /// was running, or running while a migration prepared, ended by itself:
    /// it is forgotten and returned, for the exit to be announced. One a
    /// migration holds stopped (or killed: the commit) is the migration's
    /// business; a process already forgotten (moved away) is nothing.
    pub fn ended(&mut self, pid: i32, exit: &ProcessExit) -> Option<ManagedProcess> {
        let by_itself = match &self.procs.get(&pid)?.lifecycle {
            Lifecycle::Running => true,
            Lifecycle::MigratingOut { stage, .. } => {
                matches!(
                    stage,
                    OutStage::Live | OutStage::Recording | OutStage::Armed
                )
            }
        };
        if by_itself {
            self.procs.remove(&pid)
        } else {
            self.died_in_migration.insert(pid, exit.clone());
            None
        }
    }

    pub fn remove(&mut self, pid: i32) -> Option<ManagedProcess> {
        self.procs.remove(&pid)
    }

    pub fn get(&self, pid: i32) -> Option<&ManagedProcess> {
        self.procs.get(&pid)
    }

    pub fn get_mut(&mut self, pid: i32) -> Option<&mut ManagedProcess> {
        self.procs.get_mut(&pid)
    }

    pub fn iter(&self) -> impl Iterator<Item = &ManagedProcess> {
        self.procs.values()
    }

    pub fn len(&self) -> usize {
        self.procs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.procs.is_empty()
    }

    /// The running processes, whose sockets a refresh re-reads
    /// ([`read_sockets`], without the registry's lock).
    pub fn running(&self) -> Vec<i32> {
        self.procs
            .values()
            .filter(|p| p.lifecycle == Lifecycle::Running)
            .map(|p| p.pid)
            .collect()
    }

    /// Takes the sockets [`read_sockets`] read of the processes that are
    /// still running. Processes in a migration keep the ports they had
    /// when it started: those are what the migration moves, and a read
    /// made before it started is dropped. Returns the processes that died
    /// in a migration which has let go of them since (rolled back), now
    /// forgotten, with how they ended. A process that exits otherwise is
    /// forgotten by its exit watcher, which knows how it ended
    /// ([`Self::ended`]); a gone process only loses its sockets here.
    pub fn refresh(&mut self, read: Vec<SocketsRead>) -> Vec<(ManagedProcess, ProcessExit)> {
        for SocketsRead { pid, sockets } in read {
            let Some(p) = self.procs.get_mut(&pid) else {
                continue;
            };
            if p.lifecycle != Lifecycle::Running {
                continue;
            }
            match sockets {
                Ok(s) => p.sockets = s,
                Err(process::ProcessError::NotFound { .. }) => p.sockets = Default::default(),
                Err(e) => tracing::warn!(pid = p.pid, error = %e, "reading sockets"),
            }
        }
        let released: Vec<i32> = self
            .died_in_migration
            .keys()
            .copied()
            .filter(|pid| {
                self.procs
                    .get(pid)
                    .is_none_or(|p| p.lifecycle == Lifecycle::Running)
            })
            .collect();
        let mut gone = Vec::new();
        for pid in released {
            let exit = self.died_in_migration.remove(&pid);
            if let (Some(p), Some(exit)) = (self.procs.remove(&pid), exit) {
                tracing::info!(
                    pid,
                    "managed process died during a migration that rolled back"
                );
                gone.push((p, exit));
            }
        }
        gone
    }

    /// The port ownership the processes call for.
    pub fn desired_ports(&self) -> BTreeMap<PortKey, PortState> {
        let mut out = BTreeMap::new();
        for p in self.procs.values() {
            let state = match p.lifecycle {
                Lifecycle::Running => PortState::Owned,
                Lifecycle::MigratingOut { stage, .. } => match stage {
                    OutStage::Live => PortState::Owned,
                    OutStage::Recording => PortState::Recording,
                    OutStage::Armed => PortState::Armed,
                    OutStage::Frozen { capture: true } => PortState::Capturing,
                    OutStage::Frozen { capture: false } => PortState::Frozen,
                    OutStage::Resuming => PortState::Releasing,
                    OutStage::PagesOnly | OutStage::Released | OutStage::InDoubt => continue,
                },
            };
            for port in &p.sockets.ports {
                out.insert(*port, state);
            }
        }
        out
    }
}

/// One running process's sockets, read for [`Registry::refresh`].
pub struct SocketsRead {
    pub pid: i32,
    pub sockets: Result<process::SocketSummary, process::ProcessError>,
}

/// Reads the sockets of `pids`' process trees, with one read of the
/// socket tables per network namespace (they list every socket there, the
/// other services' too). Not under the registry's lock: a migration's
/// freeze takes that lock to cut its ports off, and these reads take
/// milliseconds per thousand sockets.
pub fn read_sockets(pids: Vec<i32>) -> Vec<SocketsRead> {
    let trees: Vec<Vec<i32>> = pids.iter().map(|&pid| process::process_tree(pid)).collect();
    pids.into_iter()
        .zip(process::sockets_of_trees(&trees))
        .map(|(pid, sockets)| SocketsRead { pid, sockets })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::managed::{Origin, exit_from_wait_status};

    fn process(pid: i32, lifecycle: Lifecycle) -> ManagedProcess {
        ManagedProcess {
            pid,
            argv: vec!["server".into()],
            origin: Origin::Run,
            lifecycle,
            sockets: Default::default(),
        }
    }

    #[test]
    fn a_copy_that_gave_up_its_ports_holds_none_until_it_goes() {
        let port = |port| PortKey {
            transport: process::Transport::Tcp,
            port,
        };
        let mut reg = Registry::default();
        for (pid, lifecycle) in [
            (10, Lifecycle::Running),
            (11, migrating(OutStage::Frozen { capture: true })),
            (12, migrating(OutStage::Released)),
            (13, migrating(OutStage::PagesOnly)),
        ] {
            let mut p = process(pid, lifecycle);
            p.sockets.ports.insert(port(pid as u16));
            reg.insert(p);
        }
        let ports = reg.desired_ports();
        assert_eq!(
            ports.into_iter().collect::<Vec<_>>(),
            vec![
                (port(10), PortState::Owned),
                (port(11), PortState::Capturing)
            ]
        );
        // Stopped by its migration: not forgotten when it dies by itself.
        let exit = exit_from_wait_status(libc::SIGKILL);
        assert!(reg.ended(12, &exit).is_none());
        assert_eq!(reg.len(), 4);
    }

    fn migrating(stage: OutStage) -> Lifecycle {
        Lifecycle::MigratingOut {
            migration_id: "m1".into(),
            stage,
        }
    }

    /// The sockets are read without the registry's lock: a process whose
    /// migration began meanwhile keeps the ports it had when it began.
    #[test]
    fn a_read_of_sockets_lands_only_on_processes_still_running() {
        let mut reg = Registry::default();
        reg.insert(process(10, Lifecycle::Running));
        reg.insert(process(11, Lifecycle::Running));
        reg.insert(process(12, migrating(OutStage::Live)));
        assert_eq!(reg.running(), vec![10, 11]);
        let read = |pid, port| SocketsRead {
            pid,
            sockets: Ok(process::SocketSummary {
                tcp_listening: 1,
                ports: [PortKey {
                    transport: process::Transport::Tcp,
                    port,
                }]
                .into_iter()
                .collect(),
                ..Default::default()
            }),
        };
        // 11's migration began after the read.
        reg.get_mut(11).unwrap().lifecycle = migrating(OutStage::Live);
        let gone = reg.refresh(vec![
            read(10, 7000),
            read(11, 7001),
            SocketsRead {
                pid: 13,
                sockets: Err(process::ProcessError::NotFound { pid: 13 }),
            },
        ]);
        assert!(gone.is_empty());
        assert_eq!(reg.get(10).unwrap().sockets.tcp_listening, 1);
        assert_eq!(reg.get(11).unwrap().sockets, Default::default());
        assert!(reg.get(13).is_none());
        // A process gone since the last read loses its sockets.
        reg.refresh(vec![SocketsRead {
            pid: 10,
            sockets: Err(process::ProcessError::NotFound { pid: 10 }),
        }]);
        assert_eq!(reg.get(10).unwrap().sockets, Default::default());
    }

    #[test]
    fn a_process_that_ends_by_itself_is_forgotten_one_a_migration_stopped_is_not() {
        let exit = exit_from_wait_status(3 << 8);
        let mut reg = Registry::default();
        reg.insert(process(10, Lifecycle::Running));
        reg.insert(process(11, migrating(OutStage::Live)));
        reg.insert(process(12, migrating(OutStage::Frozen { capture: true })));
        reg.insert(process(13, migrating(OutStage::PagesOnly)));
        assert_eq!(reg.ended(10, &exit).map(|p| p.pid), Some(10));
        // Died while its migration prepared: its own end.
        assert_eq!(reg.ended(11, &exit).map(|p| p.pid), Some(11));
        // Stopped by a migration: the migration's business, kept.
        assert!(reg.ended(12, &exit).is_none());
        assert!(reg.ended(13, &exit).is_none());
        assert!(reg.ended(99, &exit).is_none());
        assert_eq!(reg.len(), 2);
        // Still held by the migration: nothing to report yet.
        assert!(reg.refresh(Vec::new()).is_empty());
        // The migration rolled back: the dead process goes, with its end.
        reg.get_mut(12).unwrap().lifecycle = Lifecycle::Running;
        let gone = reg.refresh(Vec::new());
        assert_eq!(gone.len(), 1);
        assert_eq!((gone[0].0.pid, gone[0].1.code), (12, 3));
        assert!(reg.get(12).is_none());
        // A new process under a reused PID is not taken for the dead one.
        assert!(reg.ended(13, &exit).is_none());
        reg.remove(13);
        reg.insert(process(13, Lifecycle::Running));
        assert!(reg.refresh(Vec::new()).is_empty());
        assert!(reg.get(13).is_some());
    }
}
