//! `cargo xtask bench <name> [-- ARGS]`: benchmarks that print tables (and
//! write them under `target/bench/`), never pass/fail timers. Each one is a
//! binary of the bench crate (`bench/`, built on the integration crate's
//! harness), run as root with the built agent and the integration crate's
//! workloads, which all land in the same `target/debug`.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{cmd, test};

/// The benchmarks and the bench crate's binary behind each.
pub const BENCHES: [(&str, &str, &str); 10] = [
    (
        "gap",
        "ferry-bench-gap",
        "client-perceived gap, loss, RSTs, retransmissions: capture/replay vs drop",
    ),
    (
        "freeze",
        "ferry-bench-freeze",
        "freeze time and its parts at 16..4096 connections with a database session, and a UDP-only server: iterative (CRIU), collective and incremental socket migration",
    ),
    (
        "algorithms",
        "ferry-bench-algorithms",
        "total copy vs pre-copy vs queued pre-copy over 10 Mb/s, 100 Mb/s and 1 Gb/s links (Noack (2003), tables 5.1, 5.3, 5.6)",
    ),
    (
        "memory",
        "ferry-bench-memory",
        "the freeze, total time, post-resume window, bytes and the destination's extra memory of processes of 64 MiB to 4 GiB at several write rates, per strategy, on unshaped and 1 Gb/s links",
    ),
    (
        "redis",
        "ferry-bench-redis",
        "Debian's Redis server with a large data set, migrated while a client reads: freeze, the client's longest wait, the post-resume window, the destination's extra memory, the data set's digest checked",
    ),
    (
        "replay",
        "ferry-bench-replay",
        "replaying captured packets: raw IPPROTO_RAW socket vs TUN vs the wire (µs/packet, delivery, hooks passed)",
    ),
    (
        "soak",
        "ferry-bench-soak",
        "a server moved again and again across 3 nodes under load (256 TCP clients, 24 UDP players, a PostgreSQL session): outcomes, losses, freezes, the agents' memory over time, leftovers",
    ),
    (
        "dve",
        "ferry-bench-dve",
        "Gerofi et al. (DVE)'s virtual environment live: 5 nodes with a CPU cgroup each, 100 zone servers, drifting players, balancing off and on (also `cargo xtask dve`)",
    ),
    (
        "handoff",
        "ferry-bench-handoff",
        "the XtreemOS distributed servers' handoff: its phases per uplink speed (their Table 1) and the client-perceived handoff against the donor's wait (their Fig. 2)",
    ),
    (
        "ab",
        "ferry-bench-ab",
        "two builds' freeze in interleaved rounds (--a NAME=DIR[:CRIU] --b NAME=DIR[:CRIU] [--rounds N] [-- freeze bench args]; each DIR a copy of target/release)",
    ),
];

/// Every binary a benchmark starts: the agent, the integration crate's
/// workloads and the bench crate's own (`ferry-bench-ab` runs
/// `ferry-bench-freeze`), so that `target/release` (or `target/debug`) is
/// also what `bench ab` takes as a build's directory.
pub fn build(release: bool) -> Result<()> {
    let mut args = vec!["build", "--workspace", "--bins"];
    if release {
        args.push("--release");
    }
    test::header(&format!("build: cargo {}", args.join(" ")));
    cmd::run(cmd::cargo().args(&args)).context("step `build` failed")
}

pub fn run(criu_prefix: &Path, name: &str, args: &[String], release: bool) -> Result<()> {
    let Some((_, bin, _)) = BENCHES.iter().find(|(n, _, _)| *n == name) else {
        let known: Vec<String> = BENCHES
            .iter()
            .map(|(n, _, what)| format!("{n} ({what})"))
            .collect();
        bail!("no benchmark `{name}`; known: {}", known.join(", "));
    };
    test::ensure_setup(criu_prefix)?;
    build(release)?;
    test::header(&format!("bench {name}"));
    let dir = if release {
        cmd::release_dir()
    } else {
        cmd::debug_dir()
    };
    let path = dir.join(bin);
    if !path.exists() {
        bail!(
            "step `bench {name}` failed: {} was not built (no `{bin}` binary in the {} crate, bench/?)",
            path.display(),
            cmd::BENCH_CRATE
        );
    }
    let mut c = Command::new(&path);
    c.args(args);
    test::ferry_env(&mut c, criu_prefix);
    // The agent and the workloads of the same profile as the benchmark.
    c.env("FERRY_BIN_DIR", &dir);
    cmd::run(&mut c).with_context(|| format!("step `bench {name}` failed"))
}
