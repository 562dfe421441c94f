//! What only ferry's benchmarks need, beside the harness they share with the
//! end-to-end tests (`ferry_integration`: the namespace cluster, the agents,
//! the workloads and their clients).
//!
//! The benchmarks are this crate's binaries, run as root by `cargo xtask
//! bench NAME`: `ferry-bench-gap`, `ferry-bench-freeze`,
//! `ferry-bench-algorithms`, `ferry-bench-memory`, `ferry-bench-redis`,
//! `ferry-bench-replay` and
//! `ferry-bench-ab`.
//! They print tables and write them under `target/bench/`; timings are
//! measured, never pass/fail.

pub mod run;
pub mod softnet;
pub mod stats;
