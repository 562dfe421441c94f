//! The nodes' agents, one by one: started with or without extra
//! environment (a fault point), stopped, waited for after a crash, and
//! their migration journals read.

use std::process::ExitStatus;
use std::time::Duration;

use super::{Cluster, ClusterError};
use crate::agent::{AgentLaunch, AgentProcess};
use crate::{netns, topology};

impl Cluster {
    pub(super) fn spawn_agent(&mut self, i: usize) -> Result<(), ClusterError> {
        self.spawn_agent_with(i, Vec::new())
    }

    fn spawn_agent_with(
        &mut self,
        i: usize,
        env: Vec<(String, String)>,
    ) -> Result<(), ClusterError> {
        let node = &mut self.nodes[i];
        let launch = AgentLaunch {
            node: node.name.clone(),
            binary: self.ferryd.clone(),
            config: node.config.clone(),
            netns: node.netns.path(),
            log: node.log.clone(),
            control_socket: node.control_socket.clone(),
            cwd: node.dir.clone(),
            env,
        };
        node.agent = Some(AgentProcess::spawn(launch)?);
        Ok(())
    }

    /// Stops the node's agent (SIGTERM, 5 s, SIGKILL).
    pub fn stop_agent(&mut self, node: &str) -> Result<Option<ExitStatus>, ClusterError> {
        let i = self.node_index(node);
        match self.nodes[i].agent.take() {
            Some(mut agent) => Ok(agent.stop(Duration::from_secs(5))?),
            None => Ok(None),
        }
    }

    /// (Re)starts the node's agent and waits until it answers.
    pub fn start_agent(&mut self, node: &str) -> Result<(), ClusterError> {
        self.start_agent_with_env(node, &[])
    }

    /// [`Self::start_agent`], with environment variables beside the usual
    /// ones (e.g. `FERRY_FAULT_AT`).
    pub fn start_agent_with_env(
        &mut self,
        node: &str,
        env: &[(&str, &str)],
    ) -> Result<(), ClusterError> {
        self.stop_agent(node)?;
        let i = self.node_index(node);
        let env = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        self.spawn_agent_with(i, env)?;
        let timeout = self.spec.ready_timeout;
        if let Some(agent) = self.nodes[i].agent.as_mut() {
            agent.wait_ready(timeout)?;
        }
        Ok(())
    }
    /// Waits (bounded) until the node's agent has exited by itself (a
    /// crash point, say) and reaps it; its exit status, or None if it
    /// still runs at the timeout.
    pub fn wait_agent_exit(&mut self, node: &str, timeout: Duration) -> Option<ExitStatus> {
        let i = self.node_index(node);
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let agent = self.nodes[i].agent.as_mut()?;
            if let Ok(Some(status)) = agent.try_wait() {
                self.nodes[i].agent = None;
                return Some(status);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The migration journal records on `node` (file name, contents),
    /// sorted by name: what its agent would settle after a restart.
    pub fn journal_records(&self, node: &str) -> Vec<(String, String)> {
        let dir = self.work_dir(node).join("journal");
        let mut out: Vec<(String, String)> = std::fs::read_dir(&dir)
            .map(|d| {
                d.flatten()
                    .map(|e| {
                        (
                            e.file_name().to_string_lossy().into_owned(),
                            std::fs::read_to_string(e.path()).unwrap_or_default(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.sort();
        out
    }
}

impl Cluster {
    /// The node goes as a machine would: its agent and every process in
    /// its namespace killed (SIGKILL: nothing is cleaned up), its public and
    /// cluster links down, so that its filter's pinned programs take no
    /// packet either. Teardown removes what is left.
    pub fn fail_node(&self, node: &str) -> Result<(), ClusterError> {
        use nix::sys::signal::{Signal, kill};
        use nix::unistd::Pid;
        let _ = kill(Pid::from_raw(self.agent_pid(node)), Signal::SIGKILL);
        for pid in self.pids_in(node) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        for dev in [topology::PUBLIC_IFACE, topology::CLUSTER_IFACE] {
            let mut ip = std::process::Command::new("ip");
            ip.args(["link", "set", dev, "down"]);
            let out = netns::output_in(&self.netns_path(node), ip)?;
            if !out.status.success() {
                return Err(ClusterError::Spec(format!(
                    "ip link set {dev} down in {node}: {}",
                    String::from_utf8_lossy(&out.stderr)
                )));
            }
        }
        Ok(())
    }
}

/// An agent stopped by SIGSTOP (a stall: a long pause of its machine, a
/// debugger) until this guard drops or [`StalledAgent::resume`] runs; its
/// node's kernel and processes go on.
pub struct StalledAgent {
    pid: i32,
    resumed: bool,
}

impl StalledAgent {
    pub fn resume(mut self) {
        self.cont();
    }

    fn cont(&mut self) {
        if !self.resumed {
            use nix::sys::signal::{Signal, kill};
            let _ = kill(nix::unistd::Pid::from_raw(self.pid), Signal::SIGCONT);
            self.resumed = true;
        }
    }
}

impl Drop for StalledAgent {
    fn drop(&mut self) {
        self.cont();
    }
}

impl Cluster {
    /// Stops `node`'s agent, and only it, until the guard drops.
    pub fn stall_agent(&self, node: &str) -> Result<StalledAgent, ClusterError> {
        use nix::sys::signal::{Signal, kill};
        let pid = self.agent_pid(node);
        kill(nix::unistd::Pid::from_raw(pid), Signal::SIGSTOP)
            .map_err(|e| ClusterError::Spec(format!("stopping {node}'s agent: {e}")))?;
        Ok(StalledAgent {
            pid,
            resumed: false,
        })
    }
}
