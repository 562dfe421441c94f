//! ferryd, the ferry agent: manages processes, drives their migration
//! (CRIU, image transfer, rollback) and keeps the node's eBPF port
//! ownership in step with them. `ferry` is its CLI.

pub mod agent;
pub mod api;
pub mod capture;
pub mod check;
pub mod conductor;
pub mod config;
pub mod criu;
pub mod drain;
pub mod engine;
pub mod events;
pub mod follow;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod managed;
pub mod membership;
pub mod memtrack;
pub mod metrics;
pub mod ownership;
pub mod process;
mod reaper;
pub mod security;
pub mod sockstate;
pub mod state;
pub mod translation;
pub mod watch;
