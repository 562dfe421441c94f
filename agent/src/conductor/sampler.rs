//! The conductor's real collaborators: procfs sampling, the migration
//! engine, the `Balance` RPC and the clock.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ferry_proto::v1 as pb;
use ferry_proto::v1::balance_client::BalanceClient;

use super::capacity::{self, Capacity};
use super::{
    Clock, Migrated, MigrationFailed, MigrationStarter, NegotiationFailed, PeerNegotiator,
    ProcSample, Sample,
};
use crate::cluster::Cluster;
use crate::engine::{Engine, source};
use crate::error_chain::error_chain;
use crate::managed::{Lifecycle, Processes};

/// Samples the CPU demand of the processes the agent manages, and keeps
/// them in the node's CPU cgroup when there is one (see [`super::capacity`]).
#[derive(Debug)]
pub struct ProcfsSampler {
    processes: Arc<Processes>,
    cpu_cgroup: Option<PathBuf>,
}

impl ProcfsSampler {
    pub fn new(processes: Arc<Processes>, cpu_cgroup: Option<PathBuf>) -> Self {
        Self {
            processes,
            cpu_cgroup,
        }
    }

    /// Moves every process of the managed trees into the cgroup, then
    /// reads its quota.
    fn capacity(&self, roots: &[i32], cpus: u32) -> Capacity {
        let Some(cgroup) = &self.cpu_cgroup else {
            return Capacity::Machine;
        };
        let capacity = capacity::read(cgroup, cpus);
        if capacity.unknown().is_some() {
            return capacity;
        }
        let tree: Vec<i32> = roots
            .iter()
            .flat_map(|&pid| crate::process::process_tree(pid))
            .collect();
        match capacity::place(cgroup, &tree) {
            Ok(0) => {}
            Ok(moved) => {
                tracing::debug!(moved, cgroup = %cgroup.display(), "processes placed in the CPU cgroup")
            }
            Err(e) => {
                return Capacity::Unknown(format!(
                    "{}: cannot place the managed processes: {e}",
                    cgroup.display()
                ));
            }
        }
        capacity
    }
}

/// Nanoseconds on the CPU, plus waiting for one with `with_wait`, of one
/// task (`/proc/PID/task/TID/schedstat`: run, wait, timeslices).
fn schedstat(path: &str, with_wait: bool) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut f = text.split_whitespace();
    let run: u64 = f.next()?.parse().ok()?;
    let wait: u64 = f.next()?.parse().ok()?;
    Some(if with_wait {
        run.saturating_add(wait)
    } else {
        run
    })
}

/// utime + stime of a whole process (all threads), in clock ticks.
fn cpu_ticks(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state(3) ... utime(14) stime(15): indexes 11, 12.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// Cumulative CPU demand of `pid`'s process tree: run + wait time of every
/// thread from schedstat, or utime + stime where schedstat is missing.
pub fn tree_demand(pid: i32) -> Duration {
    tree_cpu(pid, true)
}

/// Cumulative CPU time of `pid`'s process tree, run time only: what a node
/// with its own CPU share measures (see [`super::capacity`]): waiting for a
/// CPU there is waiting for the machine, which other work shares.
pub fn tree_usage(pid: i32) -> Duration {
    tree_cpu(pid, false)
}

fn tree_cpu(pid: i32, with_wait: bool) -> Duration {
    let mut total = Duration::ZERO;
    for p in crate::process::process_tree(pid) {
        let mut from_schedstat = Duration::ZERO;
        let mut ok = false;
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for t in tasks.flatten() {
                if let Some(ns) = schedstat(&format!("{}/schedstat", t.path().display()), with_wait)
                {
                    from_schedstat += Duration::from_nanos(ns);
                    ok = true;
                }
            }
        }
        if ok {
            total += from_schedstat;
        } else if let Some(ticks) = cpu_ticks(p) {
            // SAFETY: sysconf has no memory-safety preconditions.
            let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
            total += Duration::from_millis(ticks * 1000 / hz);
        }
    }
    total
}

impl super::LoadSampler for ProcfsSampler {
    fn sample(&self) -> Sample {
        let procs: Vec<(i32, Vec<String>, bool)> = self
            .processes
            .registry()
            .iter()
            .map(|p| (p.pid, p.argv.clone(), p.lifecycle == Lifecycle::Running))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|(pid, argv, running)| {
                (pid, argv, running && self.processes.pinned(pid).is_none())
            })
            .collect();
        let cpus = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        let roots: Vec<i32> = procs.iter().map(|(pid, ..)| *pid).collect();
        Sample {
            cpus,
            capacity: self.capacity(&roots, cpus),
            processes: procs
                .into_iter()
                .map(|(pid, argv, running)| ProcSample {
                    pid,
                    cpu: if self.cpu_cgroup.is_some() {
                        tree_usage(pid)
                    } else {
                        tree_demand(pid)
                    },
                    migratable: running,
                    argv,
                })
                .collect(),
        }
    }
}

/// Migrates through the engine, exactly as `Control.Migrate` does.
#[derive(Debug)]
pub struct EngineStarter {
    engine: Arc<Engine>,
}

impl EngineStarter {
    pub fn new(engine: Arc<Engine>) -> Self {
        Self { engine }
    }
}

#[tonic::async_trait]
impl MigrationStarter for EngineStarter {
    /// The engine finds destinations among the configured `[[peers]]` and
    /// the members membership found.
    fn can_reach(&self, node: &str) -> bool {
        self.engine.cluster.peer(node).is_some()
    }

    async fn migrate(&self, pid: i32, to: &str) -> Result<Migrated, MigrationFailed> {
        let prepared = source::prepare(&self.engine, pid, to, source::MigrationOptions::default())
            .await
            .map_err(|e| MigrationFailed::NotStarted(error_chain(&e)))?;
        let (tx, mut rx) = tokio::sync::mpsc::channel(32);
        // Progress events: nobody listens, keep the channel drained.
        tokio::spawn(async move { while rx.recv().await.is_some() {} });
        let report = source::run(self.engine.clone(), prepared, tx).await;
        if report.outcome == pb::MigrationOutcome::Committed as i32 {
            Ok(Migrated {
                migration_id: report.migration_id,
                destination_pid: report.destination_pid,
            })
        } else {
            Err(MigrationFailed::NotCommitted(report.error))
        }
    }
}

/// The `Balance` RPC over the Peer port of the other agent.
#[derive(Debug)]
pub struct GrpcNegotiator {
    cluster: Arc<Cluster>,
}

impl GrpcNegotiator {
    pub fn new(cluster: Arc<Cluster>) -> Self {
        Self { cluster }
    }

    /// Membership's address first, then the configured one (the reverse
    /// of [`Cluster::peer`]: a node that moved is reached where it is now).
    fn address(&self, node: &str) -> Option<SocketAddr> {
        self.cluster
            .membership()
            .and_then(|m| m.peer_address(node))
            .or_else(|| {
                self.cluster
                    .configured_peers()
                    .iter()
                    .find(|p| p.name == node)
                    .map(|p| p.address)
            })
    }

    async fn client(
        &self,
        node: &str,
    ) -> Result<BalanceClient<tonic::transport::Channel>, NegotiationFailed> {
        let addr = self.address(node).ok_or_else(|| {
            NegotiationFailed::Unreachable(format!("no address known for {node}"))
        })?;
        let channel = self
            .cluster
            .peer_endpoint(node, addr)
            .map_err(|e| NegotiationFailed::Unreachable(e.to_string()))?
            .connect_timeout(Duration::from_secs(1))
            .connect()
            .await
            .map_err(|e| NegotiationFailed::Unreachable(error_chain(&e)))?;
        Ok(BalanceClient::new(channel))
    }
}

#[tonic::async_trait]
impl PeerNegotiator for GrpcNegotiator {
    async fn offer(
        &self,
        to: &str,
        req: pb::OfferRequest,
    ) -> Result<pb::OfferResponse, NegotiationFailed> {
        let mut c = self.client(to).await?;
        c.offer(req)
            .await
            .map(|r| r.into_inner())
            .map_err(NegotiationFailed::Refused)
    }

    async fn finish(&self, to: &str, req: pb::FinishRequest) -> Result<(), NegotiationFailed> {
        let mut c = self.client(to).await?;
        c.finish(req)
            .await
            .map(|_| ())
            .map_err(NegotiationFailed::Refused)
    }

    async fn pull(
        &self,
        to: &str,
        req: pb::PullRequest,
    ) -> Result<pb::PullResponse, NegotiationFailed> {
        let mut c = self.client(to).await?;
        c.pull(req)
            .await
            .map(|r| r.into_inner())
            .map_err(NegotiationFailed::Refused)
    }
}

/// Wall-clock milliseconds since the Unix epoch, never going backwards.
///
/// The wall clock rather than a monotonic one because load messages carry
/// their origin's timestamp and the information policy compares it, within
/// `information.max_clock_skew_ms`, with ours (to flag future-dated
/// entries): that needs clocks that roughly agree across nodes. A step
/// back of the system clock is absorbed by holding the last value.
#[derive(Debug, Default)]
pub struct WallClock {
    last: std::sync::atomic::AtomicU64,
}

impl Clock for WallClock {
    fn now(&self) -> ferry_policy::Instant {
        use std::sync::atomic::Ordering;
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let prev = self.last.fetch_max(wall, Ordering::Relaxed);
        ferry_policy::Instant::from_millis(prev.max(wall))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demand_of_this_process_grows() {
        let me = std::process::id() as i32;
        let a = tree_demand(me);
        let t = std::time::Instant::now();
        while t.elapsed() < Duration::from_millis(30) {
            std::hint::black_box(0u64);
        }
        assert!(tree_demand(me) > a);
        assert!(cpu_ticks(me).is_some());
    }

    #[test]
    fn wall_clock_never_goes_back() {
        let c = WallClock::default();
        let a = c.now();
        assert!(c.now() >= a);
    }
}
