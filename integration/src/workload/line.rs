//! One-line requests to a workload's command port (`ferry-memwriter`'s
//! `check`), from inside a client namespace.

use std::io::{self, BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use crate::netns::NetNsGuard;

/// Connects from network namespace `netns` to `target`, sends `command`
/// and a newline, and returns the answer's first line, trimmed. Runs on a
/// thread of its own (entering a namespace is per thread); waits up to
/// `timeout` for the answer.
pub fn request_line(
    netns: &Path,
    target: impl Into<SocketAddr>,
    command: &str,
    timeout: Duration,
) -> io::Result<String> {
    let target: SocketAddr = target.into();
    let netns = netns.to_owned();
    let command = command.to_owned();
    std::thread::spawn(move || -> io::Result<String> {
        let _in = NetNsGuard::enter(&netns).map_err(io::Error::other)?;
        let mut stream = TcpStream::connect_timeout(&target, Duration::from_secs(10))?;
        stream.set_read_timeout(Some(timeout))?;
        writeln!(stream, "{command}")?;
        let mut line = String::new();
        BufReader::new(&stream).read_line(&mut line)?;
        Ok(line.trim().to_owned())
    })
    .join()
    .map_err(|_| io::Error::other("the requesting thread panicked"))?
}
