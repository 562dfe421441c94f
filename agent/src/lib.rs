//! ferryd, the ferry agent: manages processes, drives their migration
//! (CRIU, image transfer, rollback) and keeps the node's eBPF port
//! ownership in step with them. `ferry` is its CLI.
//!
//! The roles of the original design (Gerofi et al. (DVE)), and where each
//! is here:
//!
//! | role | module |
//! |---|---|
//! | `migd`, the migration daemon | [`engine`] ([`engine::source`], [`engine::destination`]) |
//! | `cap_trans_mod` and `transd`: capture, replay, address translation | [`dataplane`] |
//! | `cond`, the load balancer's conductor | [`conductor`], with the policies in `ferry-policy` |
//! | membership and load dissemination | [`membership`], [`cluster`] |
//! | the processes a node serves, and which ports it owns | [`managed`], [`supervisor`], [`ports`] |
//! | distributed servers and their per-connection handoff (XtreemOS distributed servers) | [`groups`] |
//!
//! [`node::Node`] builds every service once; [`api`] serves it.

#![warn(clippy::too_many_lines)]

pub mod api;
pub mod check;
pub mod cluster;
pub mod conductor;
pub mod config;
pub mod cordon;
pub mod criu;
pub mod dataplane;
pub mod drain;
pub mod engine;
pub mod error_chain;
pub mod events;
pub mod fill;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod groups;
pub mod host_features;
pub mod inet;
pub mod managed;
pub mod membership;
pub mod memtrack;
pub mod metrics;
pub mod node;
pub mod peer_io;
pub mod ports;
pub mod process;
pub(crate) mod reaper;
pub mod reports;
pub mod security;
pub mod sockstate;
pub mod supervisor;
pub mod sync;
pub mod uffd;
