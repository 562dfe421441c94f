//! Debian's Redis server as a workload ferry migrates (`redis-server`,
//! which `cargo xtask setup` installs; the package's own service is never
//! used): its command line under `ferry run`, and `redis-cli` from a
//! client namespace against the cluster's address.

use std::path::Path;
use std::process::Command;

use crate::cluster::Cluster;
use crate::netns::{self, NetNsError};

/// Where Debian installs the server.
pub const REDIS_SERVER: &str = "/usr/bin/redis-server";

/// Why a redis-cli command gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    #[error("running redis-cli in the client namespace: {0}")]
    NetNs(#[from] NetNsError),
    #[error("redis-cli {args:?}: {stderr}")]
    Failed { args: Vec<String>, stderr: String },
}

/// A Redis server on `port` of the cluster's public address.
#[derive(Debug, Clone, Copy)]
pub struct Redis {
    pub port: u16,
}

impl Redis {
    /// Whether the server is installed.
    pub fn installed() -> bool {
        Path::new(REDIS_SERVER).exists()
    }

    /// Its command line: every address, no persistence (nothing written
    /// to `dir`), 4,096 clients, `DEBUG` allowed (`POPULATE` builds data sets, `DIGEST`
    /// hashes all of one), the log on its standard output.
    pub fn argv(&self, dir: &Path) -> Vec<String> {
        [
            REDIS_SERVER,
            "--port",
            &self.port.to_string(),
            "--bind",
            "0.0.0.0",
            "--protected-mode",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--enable-debug-command",
            "yes",
            // Room for a bench's 1,000 clients (the default's 10,000 is
            // cut to the descriptor limit, which Redis raises if it can).
            "--maxclients",
            "4096",
            "--dir",
            &dir.to_string_lossy(),
            "--logfile",
            "",
        ]
        .map(String::from)
        .to_vec()
    }

    /// One redis-cli command from client1; its output, trimmed.
    pub fn cli(&self, cluster: &Cluster, args: &[&str]) -> Result<String, RedisError> {
        let mut cmd = Command::new("redis-cli");
        cmd.args([
            "-h",
            &cluster.public_addr().to_string(),
            "-p",
            &self.port.to_string(),
        ])
        .args(args);
        let out = netns::output_in(&cluster.netns_path("client1"), cmd)?;
        if !out.status.success() {
            return Err(RedisError::Failed {
                args: args.iter().map(|a| a.to_string()).collect(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }
}
