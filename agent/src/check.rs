//! `ferryd --check-config FILE`: parses and validates a configuration and
//! says what ferryd would run with, defaults filled in, without starting
//! anything. A problem is named by its field (`peers[1].name: ...`).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::config::{Config, ConfigError};

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{path}: criu_path: {reason}")]
    Criu { path: PathBuf, reason: String },
    #[error("{path}: {source}")]
    Tls {
        path: PathBuf,
        source: crate::security::SecurityError,
    },
    #[error("writing the effective configuration as TOML: {0}")]
    Render(#[from] toml::ser::Error),
}

/// What [`check`] found.
#[derive(Debug)]
pub struct Checked {
    pub config: Config,
    /// What the agent would run with, for people.
    pub summary: String,
    /// The whole configuration, every default filled in, as TOML that
    /// ferryd accepts.
    pub effective: String,
}

/// Loads and validates `path` (no CRIU, no network, no BPF).
pub fn check(path: &Path) -> Result<Checked, CheckError> {
    let config = Config::load(path)?;
    // The files [tls] names must exist and go together (the CA signed the
    // certificate, the key is its key, it names this node).
    if let Some(tls) = &config.tls {
        crate::security::TlsMaterial::load(tls, &config.node).map_err(|source| {
            CheckError::Tls {
                path: path.to_owned(),
                source,
            }
        })?;
    }
    let effective = toml::to_string(&config)?;
    Ok(Checked {
        summary: summary(&config),
        effective,
        config,
    })
}

/// Runs `criu --version` at the configured path: a configuration whose CRIU
/// cannot run would start an agent that refuses every migration.
pub fn probe_criu(path: &Path, config: &Config) -> Result<String, CheckError> {
    crate::criu::probe_version(&config.criu_path)
        .map(|v| v.to_string())
        .map_err(|e| CheckError::Criu {
            path: path.to_owned(),
            reason: format!(
                "{}: {}",
                config.criu_path.display(),
                crate::error_chain::error_chain(&e)
            ),
        })
}

fn on_off(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

/// One line per thing the agent would do.
pub fn summary(c: &Config) -> String {
    let mut s = String::new();
    // Writing to a String cannot fail.
    let mut line = |what: &str, text: String| {
        let _ = writeln!(s, "{what:<13} {text}");
    };
    line("node", c.node.clone());
    line(
        "public",
        format!(
            "{} on {} (ownership filter)",
            c.public.addresses(),
            c.public.interface
        ),
    );
    line(
        "cluster",
        format!(
            "{} on {}, peer service on {}",
            c.cluster.address, c.cluster.interface, c.cluster.peer_listen
        ),
    );
    line(
        "control",
        match c.control_listen {
            Some(a) => format!("{} (root only) and TCP {a}", c.control_socket.display()),
            None => format!("{} (root only)", c.control_socket.display()),
        },
    );
    line(
        "security",
        match &c.tls {
            Some(t) => format!(
                "TLS: mutual on the peer port, control on TCP by certificate{}; membership {}",
                if t.tokens.is_empty() {
                    String::new()
                } else {
                    format!(" or {} token(s)", t.tokens.len())
                },
                if t.membership_key.is_some() {
                    "authenticated"
                } else {
                    "unauthenticated"
                }
            ),
            None => "none: peer port, control on TCP and membership are plaintext".into(),
        },
    );
    line(
        "metrics",
        match c.metrics.listen {
            Some(a) => format!("http://{a}/metrics"),
            None => "off".into(),
        },
    );
    line(
        "peers",
        if c.peers.is_empty() {
            "none configured".into()
        } else {
            c.peers
                .iter()
                .map(|p| format!("{} {}", p.name, p.address))
                .collect::<Vec<_>>()
                .join(", ")
        },
    );
    line(
        "membership",
        if c.membership.enabled {
            format!(
                "on, UDP port {}, discovery {}",
                c.membership.port,
                on_off(c.membership.discovery)
            )
        } else {
            "off (the configured peers are the cluster)".into()
        },
    );
    line(
        "balancer",
        if c.balancer.enabled && !c.membership.enabled {
            "off: it needs [membership] enabled".into()
        } else if c.balancer.enabled {
            format!(
                "on, every {} ms, {:?} transfer policy",
                c.balancer.period_ms, c.policy.transfer.mode
            )
        } else {
            "off".into()
        },
    );
    line(
        "migration",
        format!("TCP connections moved {}", c.migration.sockets.name()),
    );
    line(
        "data plane",
        format!(
            "capture {}, pins in {}",
            on_off(c.dataplane.capture),
            c.pin_dir().display()
        ),
    );
    line(
        "work_dir",
        format!(
            "{} (CRIU cache {}, log level {})",
            c.work_dir.display(),
            c.criu_cache_dir.display(),
            c.criu_log_level
        ),
    );
    line("CRIU", c.criu_path.display().to_string());
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
node = "node1"
work_dir = "/run/ferry/work"
control_listen = "198.19.0.1:7200"
[public]
interface = "pub0"
address = "198.18.0.100"
[cluster]
interface = "clu0"
address = "198.19.0.1"
peer_listen = "198.19.0.1:7100"
[[peers]]
name = "node2"
address = "198.19.0.2:7100"
[metrics]
listen = "198.19.0.1:9464"
"#;

    fn write(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ferryd.toml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn a_valid_config_is_described_with_its_defaults() {
        let (_dir, path) = write(GOOD);
        let checked = check(&path).unwrap();
        let s = &checked.summary;
        for part in [
            "node1",
            "peer service on 198.19.0.1:7100",
            "TCP 198.19.0.1:7200",
            "http://198.19.0.1:9464/metrics",
            "node2 198.19.0.2:7100",
            "membership    off",
            "moved incremental",
            "pins in /sys/fs/bpf/ferry/node1",
            crate::config::DEFAULT_CRIU_PATH,
        ] {
            assert!(s.contains(part), "{part:?} not in:\n{s}");
        }
        // The effective configuration is complete and ferryd takes it back
        // unchanged.
        let e = &checked.effective;
        for default in [
            "criu_log_level = 2",
            "peer_timeout_secs = 60",
            "[membership]",
            "probe_period_ms = 500",
            "[policy.transfer]",
        ] {
            assert!(e.contains(default), "{default:?} not in:\n{e}");
        }
        let (_dir2, again) = write(e);
        assert_eq!(&check(&again).unwrap().effective, e);
    }

    #[test]
    fn an_invalid_config_names_the_field() {
        for (bad, field) in [
            (
                GOOD.replace("name = \"node2\"", "name = \"node1\""),
                "peers[0].name",
            ),
            (
                GOOD.replace("listen = \"198.19.0.1:9464\"", "listen = \"nowhere\""),
                "listen",
            ),
            (
                format!("{GOOD}\n[balancer]\nperiod_ms = 0\n"),
                "balancer.period_ms",
            ),
            (GOOD.replace("node = \"node1\"\n", ""), "node"),
        ] {
            let (_dir, path) = write(&bad);
            let err = check(&path).unwrap_err().to_string();
            assert!(err.contains(field), "{field:?} not in {err:?}");
            assert!(err.contains("ferryd.toml"), "the file is named: {err}");
        }
        let err = check(Path::new("/nonexistent/ferryd.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/ferryd.toml"), "{err}");
    }

    #[test]
    fn a_criu_that_does_not_run_is_named() {
        let (_dir, path) = write(&format!(
            "criu_path = \"/nonexistent/criu\"\n{}",
            GOOD.trim_start()
        ));
        let checked = check(&path).unwrap();
        let err = probe_criu(&path, &checked.config).unwrap_err().to_string();
        assert!(
            err.contains("criu_path") && err.contains("/nonexistent/criu"),
            "{err}"
        );
    }
}
