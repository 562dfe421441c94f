//! A throw-away Prometheus server (Debian's `prometheus` package, which
//! `cargo xtask setup` installs) in a network namespace, scraping agents'
//! `/metrics`, and its HTTP query API.
//!
//! Its storage is a temp dir removed on drop; the server is killed on drop.
//! It listens on the namespace's loopback only.
//!
//! ```no_run
//! use std::net::SocketAddrV4;
//! use std::time::Duration;
//! use ferry_integration::prometheus::PrometheusServer;
//! # fn f(cluster: &ferry_integration::Cluster) -> Result<(), Box<dyn std::error::Error>> {
//! let target: SocketAddrV4 = "198.19.0.1:9464".parse()?;
//! let prom = PrometheusServer::start(&cluster.netns_path("node2"), &[target], Duration::from_secs(1))?;
//! let samples = prom.query("ferry_managed_processes")?;
//! # Ok(()) }
//! ```

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::netns::{self, ChildGuard, NetNsError};
use crate::reap::TEMPDIR_PREFIX;

/// Where Debian installs the server.
pub const PROMETHEUS_BIN: &str = "/usr/bin/prometheus";
/// The web (query API) address inside the server's namespace.
pub const WEB_ADDR: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9090);

const START_TIMEOUT: Duration = Duration::from_secs(30);
const LOG_TAIL_LINES: usize = 30;

#[derive(Debug, thiserror::Error)]
pub enum PrometheusError {
    #[error(
        "no Prometheus server at {PROMETHEUS_BIN}: install the `prometheus` package (cargo xtask setup)"
    )]
    NotInstalled,
    #[error("preparing {path}: {source}")]
    Prepare {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Spawn(#[from] NetNsError),
    #[error("prometheus exited before it was ready; log tail:\n{log_tail}")]
    Exited { log_tail: String },
    #[error("prometheus not ready within {timeout:?} ({last_error}); log tail:\n{log_tail}")]
    NotReady {
        timeout: Duration,
        last_error: String,
        log_tail: String,
    },
    #[error("GET {path}: {source}")]
    Http {
        path: String,
        source: std::io::Error,
    },
    #[error("GET {path}: {status}: {body}")]
    Status {
        path: String,
        status: String,
        body: String,
    },
    #[error("query {query:?}: {reason}")]
    Query { query: String, reason: String },
}

/// One series of an instant-vector result: its labels and value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub labels: serde_json::Map<String, serde_json::Value>,
    /// Prometheus' value as it wrote it ("1", "0.0123", "NaN", "+Inf").
    pub value: String,
}

impl Sample {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.get(name).and_then(|v| v.as_str())
    }

    /// The value as a number (NaN and infinities included).
    pub fn number(&self) -> f64 {
        self.value.parse().unwrap_or(f64::NAN)
    }
}

#[derive(Debug)]
pub struct PrometheusServer {
    netns: PathBuf,
    child: Option<ChildGuard>,
    dir: Option<tempfile::TempDir>,
}

impl PrometheusServer {
    /// Starts Prometheus in the namespace at `netns`, scraping
    /// `http://<target>/metrics` of every target every `interval`, and
    /// waits until its API answers.
    pub fn start(
        netns: &Path,
        targets: &[SocketAddrV4],
        interval: Duration,
    ) -> Result<Self, PrometheusError> {
        if !Path::new(PROMETHEUS_BIN).is_file() {
            return Err(PrometheusError::NotInstalled);
        }
        let dir = tempfile::Builder::new()
            .prefix(&format!("{TEMPDIR_PREFIX}{}-prom-", std::process::id()))
            .tempdir()
            .map_err(|source| PrometheusError::Prepare {
                path: std::env::temp_dir(),
                source,
            })?;
        let config = dir.path().join("prometheus.yml");
        std::fs::write(&config, config_yaml(targets, interval)).map_err(|source| {
            PrometheusError::Prepare {
                path: config.clone(),
                source,
            }
        })?;
        let log = dir.path().join("prometheus.log");
        let open_log = || {
            std::fs::File::create(&log).map_err(|source| PrometheusError::Prepare {
                path: log.clone(),
                source,
            })
        };
        let (out, err) = (open_log()?, open_log()?);
        let mut cmd = Command::new(PROMETHEUS_BIN);
        cmd.arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={WEB_ADDR}"))
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let child = netns::spawn_in(netns, cmd)?;
        let mut server = Self {
            netns: netns.to_owned(),
            child: Some(child),
            dir: Some(dir),
        };
        server.wait_ready()?;
        Ok(server)
    }

    fn dir(&self) -> &Path {
        self.dir.as_ref().expect("the dir lives until drop").path()
    }

    pub fn log_tail(&self, lines: usize) -> String {
        crate::agent::log_tail(&self.dir().join("prometheus.log"), lines)
    }

    fn wait_ready(&mut self) -> Result<(), PrometheusError> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(_)) = child.try_wait()
            {
                return Err(PrometheusError::Exited {
                    log_tail: self.log_tail(LOG_TAIL_LINES),
                });
            }
            let last_error = match self.get("/-/ready") {
                Ok(_) => return Ok(()),
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                return Err(PrometheusError::NotReady {
                    timeout: START_TIMEOUT,
                    last_error,
                    log_tail: self.log_tail(LOG_TAIL_LINES),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// An HTTP/1.0 GET on the server's web address, from inside its
    /// namespace: the body of a 200 answer.
    fn get(&self, path: &str) -> Result<String, PrometheusError> {
        let http = |source| PrometheusError::Http {
            path: path.to_owned(),
            source,
        };
        let raw = netns::run_in(&self.netns, || {
            let mut s = TcpStream::connect_timeout(&WEB_ADDR.into(), Duration::from_secs(2))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            // HTTP/1.0: the answer is neither chunked nor kept alive.
            write!(s, "GET {path} HTTP/1.0\r\nHost: {WEB_ADDR}\r\n\r\n")?;
            let mut raw = Vec::new();
            s.read_to_end(&mut raw)?;
            Ok(raw)
        })?
        .map_err(http)?;
        let text = String::from_utf8_lossy(&raw);
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head.lines().next().unwrap_or_default();
        if status.split_whitespace().nth(1) != Some("200") {
            return Err(PrometheusError::Status {
                path: path.to_owned(),
                status: status.to_owned(),
                body: body.chars().take(500).collect(),
            });
        }
        Ok(body.to_owned())
    }

    /// An instant query (`/api/v1/query`): the series of its vector result,
    /// or the one value of a scalar result.
    pub fn query(&self, promql: &str) -> Result<Vec<Sample>, PrometheusError> {
        let failed = |reason: String| PrometheusError::Query {
            query: promql.to_owned(),
            reason,
        };
        let body = self.get(&format!("/api/v1/query?query={}", percent_encode(promql)))?;
        let answer: serde_json::Value =
            serde_json::from_str(&body).map_err(|e| failed(format!("{e}: {body}")))?;
        if answer["status"] != "success" {
            return Err(failed(body));
        }
        let data = &answer["data"];
        let value_of = |v: &serde_json::Value| v[1].as_str().unwrap_or_default().to_owned();
        match data["resultType"].as_str() {
            Some("vector") => Ok(data["result"]
                .as_array()
                .map(|series| {
                    series
                        .iter()
                        .map(|s| Sample {
                            labels: s["metric"].as_object().cloned().unwrap_or_default(),
                            value: value_of(&s["value"]),
                        })
                        .collect()
                })
                .unwrap_or_default()),
            Some("scalar") => Ok(vec![Sample {
                labels: Default::default(),
                value: value_of(&data["result"]),
            }]),
            other => Err(failed(format!("result type {other:?}: {body}"))),
        }
    }

    /// Polls `promql` until `done` accepts its result; panics with the last
    /// result (or error) and the server's log after `timeout`.
    pub fn wait_for(
        &self,
        promql: &str,
        timeout: Duration,
        done: impl Fn(&[Sample]) -> bool,
    ) -> Vec<Sample> {
        let deadline = Instant::now() + timeout;
        loop {
            let last = self.query(promql);
            if let Ok(samples) = &last
                && done(samples)
            {
                return samples.clone();
            }
            assert!(
                Instant::now() < deadline,
                "{promql:?} never gave the expected answer within {timeout:?}; last: {last:?}\n\
                 targets: {:?}\nprometheus log tail:\n{}",
                self.get("/api/v1/targets"),
                self.log_tail(LOG_TAIL_LINES)
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Kills the server and removes its storage. Idempotent.
    pub fn stop(&mut self) {
        // ChildGuard's drop kills and reaps it.
        self.child.take();
        if let Some(dir) = self.dir.take()
            && let Err(e) = dir.close()
        {
            eprintln!("ferry-integration: removing prometheus' temp dir: {e}");
        }
    }
}

impl Drop for PrometheusServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn config_yaml(targets: &[SocketAddrV4], interval: Duration) -> String {
    let secs = interval.as_millis().max(100);
    let mut y = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(y, "global:");
    let _ = writeln!(y, "  scrape_interval: {secs}ms");
    let _ = writeln!(y, "  scrape_timeout: {secs}ms");
    let _ = writeln!(y, "  evaluation_interval: {secs}ms");
    let _ = writeln!(y, "scrape_configs:");
    let _ = writeln!(y, "  - job_name: ferry");
    let _ = writeln!(y, "    static_configs:");
    let _ = writeln!(y, "      - targets:");
    for t in targets {
        let _ = writeln!(y, "          - \"{t}\"");
    }
    y
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_promql() {
        assert_eq!(
            percent_encode(r#"sum by (le) (x{a="b"}[1m])"#),
            "sum%20by%20%28le%29%20%28x%7Ba%3D%22b%22%7D%5B1m%5D%29"
        );
    }

    #[test]
    fn writes_a_scrape_config() {
        let y = config_yaml(
            &["198.19.0.1:9464".parse().unwrap()],
            Duration::from_millis(500),
        );
        assert!(y.contains("scrape_interval: 500ms"), "{y}");
        assert!(y.contains("- \"198.19.0.1:9464\""), "{y}");
    }
}
