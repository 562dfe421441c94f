//! Debian's nginx (the `nginx` package `cargo xtask setup` installs), run
//! under ferry the way it runs on a server: a master process as root and
//! worker processes that switch to `www-data` (the `user` directive),
//! for the test that migrates a process tree whose children dropped root
//! (integration/tests/privileges.rs). Everything it writes (its pid file,
//! error log, temp dirs) is in a temp dir; the package's own service and
//! files are never used.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};

use crate::reap::TEMPDIR_PREFIX;

/// The binary.
pub const NGINX: &str = "/usr/sbin/nginx";
/// The user its workers switch to.
pub const WORKER_USER: &str = "www-data";

#[derive(Debug, thiserror::Error)]
pub enum NginxError {
    #[error("writing {path}: {source}")]
    Prepare {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("HTTP exchange: {0}")]
    Io(#[from] std::io::Error),
    #[error("unexpected answer: {0:?}")]
    Answer(String),
}

/// An nginx configuration in a directory of its own.
#[derive(Debug)]
pub struct Nginx {
    dir: tempfile::TempDir,
    port: u16,
}

impl Nginx {
    /// Whether the server is installed.
    pub fn installed() -> bool {
        Path::new(NGINX).exists()
    }

    /// Writes a configuration for `workers` worker processes serving
    /// `port` on every address: each answer is `pong <worker PID>`, so a
    /// client sees which worker holds its connection; keep-alive
    /// connections stay open for 10 minutes.
    pub fn new(port: u16, workers: u32) -> Result<Self, NginxError> {
        let dir = tempfile::Builder::new()
            // Named like the clusters' temp dirs, so `reap::reap_stale`
            // removes it after a test that died without dropping it.
            .prefix(&format!("{TEMPDIR_PREFIX}{}-nginx-", std::process::id()))
            .tempdir()
            .map_err(|source| NginxError::Prepare {
                path: std::env::temp_dir(),
                source,
            })?;
        let d = dir.path().display();
        let conf = format!(
            "# ferry-integration: written by integration/src/nginx.rs\n\
             daemon off;\n\
             master_process on;\n\
             worker_processes {workers};\n\
             user {WORKER_USER};\n\
             pid {d}/nginx.pid;\n\
             error_log {d}/error.log info;\n\
             events {{ worker_connections 1024; }}\n\
             http {{\n\
             \x20 access_log off;\n\
             \x20 client_body_temp_path {d}/body;\n\
             \x20 proxy_temp_path {d}/proxy;\n\
             \x20 fastcgi_temp_path {d}/fastcgi;\n\
             \x20 uwsgi_temp_path {d}/uwsgi;\n\
             \x20 scgi_temp_path {d}/scgi;\n\
             \x20 keepalive_timeout 600s;\n\
             \x20 keepalive_requests 1000000;\n\
             \x20 server {{\n\
             \x20   listen {port};\n\
             \x20   location / {{ default_type text/plain; return 200 \"pong $pid\\n\"; }}\n\
             \x20 }}\n\
             }}\n"
        );
        let path = dir.path().join("nginx.conf");
        std::fs::write(&path, conf).map_err(|source| NginxError::Prepare { path, source })?;
        Ok(Self { dir, port })
    }

    /// Its command line: the master in the foreground, the configuration
    /// and error log in the temp dir (`-e`: not the package's log, which
    /// nginx opens before reading its configuration).
    pub fn argv(&self) -> Vec<String> {
        let d = self.dir.path();
        vec![
            NGINX.into(),
            "-p".into(),
            d.display().to_string(),
            "-c".into(),
            d.join("nginx.conf").display().to_string(),
            "-e".into(),
            d.join("error.log").display().to_string(),
        ]
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The last `lines` lines of its error log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

/// One `GET /` on a keep-alive connection: the PID of the worker that
/// answered.
pub fn get_pid(conn: &mut TcpStream) -> Result<i32, NginxError> {
    conn.write_all(b"GET / HTTP/1.1\r\nHost: ferry\r\n\r\n")?;
    let mut reader = BufReader::new(conn);
    let mut status = String::new();
    reader.read_line(&mut status)?;
    if !status.starts_with("HTTP/1.1 200") {
        return Err(NginxError::Answer(status));
    }
    let mut length = None;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse::<usize>().ok();
        }
    }
    let length = length.ok_or_else(|| NginxError::Answer("no Content-Length".into()))?;
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    let body = String::from_utf8_lossy(&body);
    body.trim()
        .strip_prefix("pong ")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| NginxError::Answer(body.into_owned()))
}
