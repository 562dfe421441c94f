//! The ferry test harness: an emulated single-IP cluster built from network
//! namespaces (router, nodes, clients) with one `ferryd` per node, the test
//! workloads, and helpers to see where connections live.
//!
//! The end-to-end tests (`tests/`) and the benchmarks (the `ferry-bench`
//! crate, `bench/`) both build on it; what only the benchmarks need (summary
//! statistics, the machine's input-backlog drops) lives in `bench/`.
//!
//! Everything here needs root; tests call [`can_run`] first and skip with a
//! printed reason otherwise.
//!
//! ```no_run
//! use ferry_integration::{Cluster, ClusterSpec, SeqClient};
//! # fn main() -> anyhow::Result<()> {
//! let cluster = Cluster::start(ClusterSpec::new(2, 1))?;
//! let target = std::net::SocketAddrV4::new(cluster.public_addr(), 7000);
//! // ... start ferry-echo-server on node1 through the agent ...
//! let client = SeqClient::start(cluster.netns_path("client1"), target, 8,
//!     std::time::Duration::from_millis(10), 256)?;
//! // ... migrate ...
//! client.stop().assert_clean();
//! # Ok(()) }
//! ```

pub mod agent;
pub mod agent_config;
pub mod answer_watch;
pub mod cluster;
pub mod cmd;
pub mod control;
pub mod cpu_cgroup;
pub mod dve;
pub mod faults;
pub mod group;
pub mod inspect;
pub mod managed;
pub mod memwriter;
pub mod netns;
pub mod nginx;
pub mod nstat;
pub mod paths;
pub mod peer;
pub mod pg_session;
pub mod postgres;
pub mod privilege;
pub mod prometheus;
pub mod reap;
pub mod redis;
pub mod reflection;
pub mod soak;
pub mod tls;
pub mod tmpfs;
pub mod topology;
pub mod workload;

pub use cluster::{Cluster, ClusterError, ClusterSpec};
pub use netns::{ChildGuard, NetNs, NetNsGuard, spawn_in};
pub use paths::{bin_dir, bin_path, criu_path};
pub use privilege::{can_run, is_root, skip_reason};
pub use workload::{ProbeConnection, SeqClient, SeqReport};
