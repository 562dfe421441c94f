//! `ferry-pg-session --pg 198.18.0.12:5432 --user postgres --database
//! postgres --serve 0.0.0.0:7300 --interval-ms 100`: a client that holds ONE
//! PostgreSQL session for its whole life, as a test workload for migrating
//! a process with a database connection.
//!
//! It speaks the frontend/backend protocol (v3) itself over one TCP
//! connection: startup with `application_name=ferry-pg-session`, trust
//! authentication only, then every interval the simple query
//! `SELECT pg_backend_pid(), inet_client_addr()::text, inet_client_port(), N`
//! with N counting up from 1. A session that breaks (socket error, server
//! gone, protocol violation, a backend PID different from the one of the
//! startup) is never replaced: the error is recorded, the status stays
//! readable for `--linger-ms`, then the program exits with status 1. So a
//! test that sees the same `backend_pid` and a growing `last_counter` knows
//! the very same session survived.
//!
//! Status: each TCP connection to `--serve` gets one line of JSON and is
//! closed (send nothing):
//!
//! ```text
//! {"backend_pid":4242,"client_addr":"198.18.0.100","client_port":40312,
//!  "queries_ok":17,"queries_failed":0,"last_counter":17,"last_error":null}
//! ```
//!
//! `backend_pid` is the one of BackendKeyData until the first query answers;
//! `client_addr` (without the `/32` that `inet::text` appends),
//! `client_port` and `last_counter` are null until then. `last_error` keeps
//! the latest error (a failed query or the end of the session) and is never
//! cleared.
//!
//! One thread and `poll(2)` (no epoll, no runtime) so that CRIU can dump
//! and restore it at any point: EINTR is retried, and the query timer
//! tolerates CLOCK_MONOTONIC jumping when restored on another node. Only
//! stderr is written (the startup line, why the session ended), ignoring
//! errors: after a restore it may be /dev/null or a closed pipe.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "ferry-pg-session",
    about = "Holds one PostgreSQL session, queries it periodically and serves its status as JSON"
)]
struct Args {
    /// PostgreSQL server, HOST:PORT.
    #[arg(long)]
    pg: String,
    /// Database user (trust authentication only).
    #[arg(long, default_value = "postgres")]
    user: String,
    #[arg(long, default_value = "postgres")]
    database: String,
    /// Where to serve the status (IP:PORT).
    #[arg(long)]
    serve: SocketAddr,
    /// Time between the start of two queries.
    #[arg(long, default_value_t = 200)]
    interval_ms: u64,
    /// How long the status stays readable after the session broke.
    #[arg(long, default_value_t = 10_000)]
    linger_ms: u64,
}

const APPLICATION_NAME: &str = "ferry-pg-session";
/// Protocol 3.0.
const PROTOCOL_VERSION: i32 = 3 << 16;
/// Larger messages are taken for a corrupted stream.
const MAX_MESSAGE: usize = 1 << 20;
const STARTUP_TIMEOUT: Duration = Duration::from_secs(10);
const STATUS_WRITE_TIMEOUT: Duration = Duration::from_millis(500);
const READ_CHUNK: usize = 16 * 1024;

#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        source: std::io::Error,
    },
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("server: {0}")]
    Server(ServerMessage),
    #[error("the server asks for {0} authentication; only trust is supported")]
    Auth(&'static str),
    #[error("the server closed the connection")]
    Closed,
    #[error("the server closed the connection after: {0}")]
    ClosedAfter(ServerMessage),
    #[error("backend PID changed from {old} to {new}: not the same session")]
    PidChanged { old: i32, new: i32 },
}

fn io_err(op: &'static str) -> impl FnOnce(std::io::Error) -> SessionError {
    move |source| SessionError::Io { op, source }
}

fn protocol(msg: impl Into<String>) -> SessionError {
    SessionError::Protocol(msg.into())
}

// ---- The wire format -------------------------------------------------

/// One backend message: its type byte and its body (without the length).
#[derive(Debug)]
struct Message {
    tag: u8,
    body: Vec<u8>,
}

/// Length-prefixed frontend message (`tag` 0: the untyped StartupMessage).
fn frontend_message(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(body.len() + 5);
    if tag != 0 {
        m.push(tag);
    }
    m.extend_from_slice(&((body.len() + 4) as i32).to_be_bytes());
    m.extend_from_slice(body);
    m
}

fn startup_message(user: &str, database: &str) -> Vec<u8> {
    let mut body = PROTOCOL_VERSION.to_be_bytes().to_vec();
    for (k, v) in [
        ("user", user),
        ("database", database),
        ("application_name", APPLICATION_NAME),
    ] {
        for s in [k, v] {
            body.extend_from_slice(s.as_bytes());
            body.push(0);
        }
    }
    body.push(0);
    frontend_message(0, &body)
}

fn query_message(sql: &str) -> Vec<u8> {
    let mut body = sql.as_bytes().to_vec();
    body.push(0);
    frontend_message(b'Q', &body)
}

fn query_sql(counter: u64) -> String {
    format!("SELECT pg_backend_pid(), inet_client_addr()::text, inet_client_port(), {counter}")
}

/// Takes one complete message off the front of `buf`, if there is one.
fn take_message(buf: &mut Vec<u8>) -> Result<Option<Message>, SessionError> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let len = i32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
    let len = usize::try_from(len)
        .ok()
        .filter(|l| (4..=MAX_MESSAGE).contains(l))
        .ok_or_else(|| {
            protocol(format!(
                "message '{}' of length {len}",
                buf[0].escape_ascii()
            ))
        })?;
    if buf.len() < 1 + len {
        return Ok(None);
    }
    let body = buf[5..1 + len].to_vec();
    let tag = buf[0];
    buf.drain(..1 + len);
    Ok(Some(Message { tag, body }))
}

/// Reads the fields of a message body in order.
struct Fields<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> Fields<'a> {
    fn new(b: &'a [u8], what: &'static str) -> Self {
        Self { b, what }
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8], SessionError> {
        if self.b.len() < n {
            return Err(protocol(format!("truncated {}", self.what)));
        }
        let (head, tail) = self.b.split_at(n);
        self.b = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, SessionError> {
        Ok(self.bytes(1)?[0])
    }

    fn i16(&mut self) -> Result<i16, SessionError> {
        let b = self.bytes(2)?;
        Ok(i16::from_be_bytes([b[0], b[1]]))
    }

    fn i32(&mut self) -> Result<i32, SessionError> {
        let b = self.bytes(4)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn cstr(&mut self) -> Result<String, SessionError> {
        let end = self
            .b
            .iter()
            .position(|&c| c == 0)
            .ok_or_else(|| protocol(format!("unterminated string in {}", self.what)))?;
        let s = String::from_utf8_lossy(&self.b[..end]).into_owned();
        self.b = &self.b[end + 1..];
        Ok(s)
    }
}

/// An ErrorResponse or NoticeResponse: its fields by type code.
#[derive(Debug, Clone)]
struct ServerMessage {
    fields: Vec<(u8, String)>,
}

impl ServerMessage {
    fn parse(body: &[u8]) -> Result<Self, SessionError> {
        let mut f = Fields::new(body, "error/notice fields");
        let mut fields = Vec::new();
        loop {
            let code = f.u8()?;
            if code == 0 {
                return Ok(Self { fields });
            }
            fields.push((code, f.cstr()?));
        }
    }

    fn field(&self, code: u8) -> Option<&str> {
        self.fields
            .iter()
            .find(|(c, _)| *c == code)
            .map(|(_, v)| v.as_str())
    }

    /// `V` (never localized) or else `S`.
    fn severity(&self) -> &str {
        self.field(b'V').or(self.field(b'S')).unwrap_or("?")
    }

    /// The session cannot go on after this one.
    fn is_fatal(&self) -> bool {
        matches!(self.severity(), "FATAL" | "PANIC")
    }
}

impl std::fmt::Display for ServerMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.severity(),
            self.field(b'C').unwrap_or("?"),
            self.field(b'M').unwrap_or("")
        )?;
        for (code, label) in [(b'D', "detail"), (b'H', "hint")] {
            if let Some(v) = self.field(code) {
                write!(f, " ({label}: {v})")?;
            }
        }
        Ok(())
    }
}

fn auth_name(code: i32) -> &'static str {
    match code {
        2 => "Kerberos V5",
        3 => "cleartext password",
        5 => "MD5 password",
        7 => "GSSAPI",
        9 => "SSPI",
        10 => "SASL (SCRAM)",
        _ => "an unknown kind of",
    }
}

/// One answer to the periodic query.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    backend_pid: i32,
    client_addr: Option<String>,
    client_port: Option<i32>,
    counter: u64,
}

fn parse_row(body: &[u8]) -> Result<Row, SessionError> {
    let mut f = Fields::new(body, "DataRow");
    let n = f.i16()?;
    if n != 4 {
        return Err(protocol(format!("DataRow with {n} columns, expected 4")));
    }
    let mut cols: Vec<Option<String>> = Vec::with_capacity(4);
    for _ in 0..4 {
        let len = f.i32()?;
        cols.push(match usize::try_from(len) {
            Ok(len) => Some(String::from_utf8_lossy(f.bytes(len)?).into_owned()),
            Err(_) => None,
        });
    }
    let number = |i: usize, name: &str| -> Result<Option<i64>, SessionError> {
        cols[i]
            .as_deref()
            .map(|s| s.parse::<i64>())
            .transpose()
            .map_err(|_| protocol(format!("{name} is not a number: {:?}", cols[i])))
    };
    let backend_pid = number(0, "pg_backend_pid()")?
        .and_then(|p| i32::try_from(p).ok())
        .ok_or_else(|| protocol("pg_backend_pid() is null or out of range"))?;
    let client_port = number(2, "inet_client_port()")?.and_then(|p| i32::try_from(p).ok());
    let counter = number(3, "counter")?
        .and_then(|c| u64::try_from(c).ok())
        .ok_or_else(|| protocol("the counter is null or negative"))?;
    // inet::text is "a.b.c.d/32" for a host address.
    let client_addr = cols[1].as_deref().map(|a| {
        a.strip_suffix("/32")
            .or_else(|| a.strip_suffix("/128"))
            .unwrap_or(a)
            .to_owned()
    });
    Ok(Row {
        backend_pid,
        client_addr,
        client_port,
        counter,
    })
}

fn stderr_line(args: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr(), "ferry-pg-session: {args}");
}

// ---- Startup -----------------------------------------------------------

/// Connects and runs the startup phase (blocking, bounded) up to the first
/// ReadyForQuery; returns the socket and the backend PID.
fn connect(pg: &str, user: &str, database: &str) -> Result<(TcpStream, i32), SessionError> {
    let addr = pg
        .to_socket_addrs()
        .map_err(io_err("resolving --pg"))?
        .next()
        .ok_or_else(|| protocol(format!("{pg} resolves to no address")))?;
    let mut stream =
        TcpStream::connect_timeout(&addr, STARTUP_TIMEOUT).map_err(io_err("connecting"))?;
    stream.set_nodelay(true).map_err(io_err("TCP_NODELAY"))?;
    stream
        .set_read_timeout(Some(STARTUP_TIMEOUT))
        .map_err(io_err("setting a read timeout"))?;
    stream
        .write_all(&startup_message(user, database))
        .map_err(io_err("sending StartupMessage"))?;

    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let mut backend_pid = None;
    loop {
        let msg = loop {
            if let Some(m) = take_message(&mut buf)? {
                break m;
            }
            match stream.read(&mut chunk) {
                Ok(0) => return Err(SessionError::Closed),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err("reading the startup answer")(e)),
            }
        };
        let mut f = Fields::new(&msg.body, "startup message");
        match msg.tag {
            b'R' => match f.i32()? {
                0 => {}
                code => return Err(SessionError::Auth(auth_name(code))),
            },
            b'S' | b'N' => {}
            b'K' => backend_pid = Some(f.i32()?),
            b'E' => return Err(SessionError::Server(ServerMessage::parse(&msg.body)?)),
            b'Z' => {
                let pid = backend_pid.ok_or_else(|| protocol("no BackendKeyData"))?;
                if !buf.is_empty() {
                    return Err(protocol("data after ReadyForQuery"));
                }
                stream
                    .set_nonblocking(true)
                    .map_err(io_err("setting O_NONBLOCK"))?;
                return Ok((stream, pid));
            }
            other => {
                return Err(protocol(format!(
                    "unexpected message '{}' during startup",
                    other.escape_ascii()
                )));
            }
        }
    }
}

// ---- The running session -----------------------------------------------

/// What the status line shows, in this order.
#[derive(Debug, Default, serde::Serialize)]
struct Status {
    backend_pid: Option<i32>,
    client_addr: Option<String>,
    client_port: Option<i32>,
    queries_ok: u64,
    queries_failed: u64,
    last_counter: Option<u64>,
    last_error: Option<String>,
}

impl Status {
    fn json_line(&self) -> String {
        let mut line = serde_json::to_string(self).expect("plain fields serialize");
        line.push('\n');
        line
    }
}

/// The query waiting for its ReadyForQuery.
#[derive(Debug)]
struct InFlight {
    counter: u64,
    rows: Vec<Row>,
    error: Option<ServerMessage>,
}

struct Session {
    stream: TcpStream,
    backend_pid: i32,
    inbuf: Vec<u8>,
    outbuf: Vec<u8>,
    query: Option<InFlight>,
    next_counter: u64,
    /// A FATAL error the server sent before closing.
    fatal: Option<ServerMessage>,
}

impl Session {
    fn new(stream: TcpStream, backend_pid: i32) -> Self {
        Self {
            stream,
            backend_pid,
            inbuf: Vec::new(),
            outbuf: Vec::new(),
            query: None,
            next_counter: 1,
            fatal: None,
        }
    }

    fn start_query(&mut self) -> Result<(), SessionError> {
        let counter = self.next_counter;
        self.next_counter += 1;
        self.outbuf
            .extend_from_slice(&query_message(&query_sql(counter)));
        self.query = Some(InFlight {
            counter,
            rows: Vec::new(),
            error: None,
        });
        self.flush()
    }

    fn flush(&mut self) -> Result<(), SessionError> {
        while !self.outbuf.is_empty() {
            match self.stream.write(&self.outbuf) {
                Ok(0) => return Err(SessionError::Closed),
                Ok(n) => {
                    self.outbuf.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => return Err(io_err("sending a query")(e)),
            }
        }
        Ok(())
    }

    /// Reads what is there and handles every complete message.
    fn receive(&mut self, status: &mut Status, chunk: &mut [u8]) -> Result<(), SessionError> {
        let mut eof = false;
        let mut failure = None;
        loop {
            match self.stream.read(chunk) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => self.inbuf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => {
                    failure = Some(io_err("reading from the server")(e));
                    break;
                }
            }
        }
        // What arrived before the end first: the FATAL message that
        // explains it usually comes in the same read.
        while let Some(msg) = take_message(&mut self.inbuf)? {
            self.handle(msg, status)?;
        }
        if let Some(e) = failure {
            return Err(e);
        }
        if eof {
            return Err(match self.fatal.take() {
                Some(m) => SessionError::ClosedAfter(m),
                None => SessionError::Closed,
            });
        }
        Ok(())
    }

    fn handle(&mut self, msg: Message, status: &mut Status) -> Result<(), SessionError> {
        match (msg.tag, self.query.as_mut()) {
            // Asynchronous: NoticeResponse, ParameterStatus, NotificationResponse.
            (b'N' | b'S' | b'A', _) => {}
            (b'E', q) => {
                let m = ServerMessage::parse(&msg.body)?;
                if m.is_fatal() {
                    // The server closes the connection next.
                    self.fatal = Some(m.clone());
                }
                match q {
                    Some(q) => q.error = Some(m),
                    None if m.is_fatal() => status.last_error = Some(m.to_string()),
                    None => return Err(SessionError::Server(m)),
                }
            }
            (b'T', Some(_)) => {
                let n = Fields::new(&msg.body, "RowDescription").i16()?;
                if n != 4 {
                    return Err(protocol(format!("RowDescription of {n} columns")));
                }
            }
            (b'D', Some(q)) => q.rows.push(parse_row(&msg.body)?),
            (b'C', Some(_)) => {}
            (b'Z', Some(_)) => {
                let q = self.query.take().expect("matched Some");
                self.finish(q, status)?;
            }
            (tag, q) => {
                return Err(protocol(format!(
                    "unexpected message '{}' {}",
                    tag.escape_ascii(),
                    if q.is_some() {
                        "during a query"
                    } else {
                        "while idle"
                    }
                )));
            }
        }
        Ok(())
    }

    fn finish(&mut self, q: InFlight, status: &mut Status) -> Result<(), SessionError> {
        if let Some(e) = q.error {
            status.queries_failed += 1;
            status.last_error = Some(format!("query {}: {e}", q.counter));
            return Ok(());
        }
        let [row] = q.rows.as_slice() else {
            status.queries_failed += 1;
            status.last_error = Some(format!("query {}: {} rows", q.counter, q.rows.len()));
            return Ok(());
        };
        if row.backend_pid != self.backend_pid {
            return Err(SessionError::PidChanged {
                old: self.backend_pid,
                new: row.backend_pid,
            });
        }
        if row.counter != q.counter {
            return Err(protocol(format!(
                "answer to query {} carries counter {}",
                q.counter, row.counter
            )));
        }
        status.queries_ok += 1;
        status.backend_pid = Some(row.backend_pid);
        status.client_addr = row.client_addr.clone();
        status.client_port = row.client_port;
        status.last_counter = Some(row.counter);
        Ok(())
    }
}

fn serve_status(listener: &TcpListener, status: &Status) {
    loop {
        match listener.accept() {
            Ok((mut stream, _)) => {
                // Accepted sockets do not inherit O_NONBLOCK; the line is far
                // smaller than any send buffer, the timeout only bounds a
                // pathological peer.
                let _ = stream.set_nonblocking(false);
                let _ = stream.set_write_timeout(Some(STATUS_WRITE_TIMEOUT));
                let _ = stream.write_all(status.json_line().as_bytes());
                let _ = stream.shutdown(Shutdown::Write);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            // WouldBlock: all taken; anything else: try at the next poll.
            Err(_) => return,
        }
    }
}

/// Milliseconds until `t` for poll(2), rounded up.
fn poll_timeout(now: Instant, t: Instant) -> libc::c_int {
    let d = t.saturating_duration_since(now);
    let ms = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
}

fn run(args: &Args, listener: &TcpListener, session: Session) -> ExitCode {
    let interval = Duration::from_millis(args.interval_ms.max(1));
    let linger = Duration::from_millis(args.linger_ms);
    let mut status = Status {
        backend_pid: Some(session.backend_pid),
        ..Status::default()
    };
    let mut session = Some(session);
    let mut next_due = Instant::now();
    let mut exit_at: Option<Instant> = None;
    let mut chunk = vec![0u8; READ_CHUNK];
    loop {
        let mut now = Instant::now();
        // A restored process reads another node's CLOCK_MONOTONIC: a jump
        // forward only makes the next query early, one backwards must not
        // postpone it for long.
        if next_due > now + interval {
            next_due = now + interval;
        }
        let mut result = Ok(());
        if let Some(s) = session.as_mut()
            && s.query.is_none()
            && now >= next_due
        {
            next_due = now + interval;
            result = s.start_query();
        }
        if let Err(e) = result {
            end_session(&mut session, &mut status, e);
            exit_at = Some(Instant::now() + linger);
        }
        now = Instant::now();

        let mut fds = vec![libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        let timeout = match (&session, exit_at) {
            (Some(s), _) => {
                let mut events = libc::POLLIN;
                if !s.outbuf.is_empty() {
                    events |= libc::POLLOUT;
                }
                fds.push(libc::pollfd {
                    fd: s.stream.as_raw_fd(),
                    events,
                    revents: 0,
                });
                if s.query.is_some() {
                    -1
                } else {
                    poll_timeout(now, next_due)
                }
            }
            (None, Some(at)) if now >= at => return ExitCode::FAILURE,
            (None, Some(at)) => poll_timeout(now, at),
            (None, None) => return ExitCode::FAILURE,
        };
        // SAFETY: fds is a valid array of fds.len() pollfd structs that the
        // kernel may write revents into for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            // EINTR (a restore, a signal): poll again.
            continue;
        }
        if fds.len() > 1 && fds[1].revents != 0 {
            let s = session.as_mut().expect("polled");
            let r = s.flush().and_then(|()| s.receive(&mut status, &mut chunk));
            if let Err(e) = r {
                end_session(&mut session, &mut status, e);
                exit_at = Some(Instant::now() + linger);
            }
        }
        // After the session's news, so a status read never lags behind an
        // answer that had already arrived.
        if fds[0].revents != 0 {
            serve_status(listener, &status);
        }
    }
}

/// Records why the session ended and closes it; never reconnects.
fn end_session(session: &mut Option<Session>, status: &mut Status, e: SessionError) {
    if let Some(s) = session.take()
        && let Some(q) = s.query
    {
        status.queries_failed += 1;
        stderr_line(format_args!("query {} lost", q.counter));
    }
    stderr_line(format_args!("session ended: {e}"));
    status.last_error = Some(format!("session ended: {e}"));
}

fn main() -> ExitCode {
    let args = Args::parse();
    let listener = match TcpListener::bind(args.serve).and_then(|l| {
        l.set_nonblocking(true)?;
        Ok(l)
    }) {
        Ok(l) => l,
        Err(e) => {
            stderr_line(format_args!("serving status on {}: {e}", args.serve));
            return ExitCode::from(2);
        }
    };
    let (stream, backend_pid) = match connect(&args.pg, &args.user, &args.database) {
        Ok(c) => c,
        Err(e) => {
            stderr_line(format_args!("starting a session with {}: {e}", args.pg));
            return ExitCode::from(2);
        }
    };
    stderr_line(format_args!(
        "session with {} as backend {backend_pid}; status on {}",
        args.pg, args.serve
    ));
    run(&args, &listener, Session::new(stream, backend_pid))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(tag: u8, body: &[u8]) -> Vec<u8> {
        frontend_message(tag, body)
    }

    fn data_row(cols: &[Option<&str>]) -> Vec<u8> {
        let mut b = (cols.len() as i16).to_be_bytes().to_vec();
        for c in cols {
            match c {
                Some(s) => {
                    b.extend_from_slice(&(s.len() as i32).to_be_bytes());
                    b.extend_from_slice(s.as_bytes());
                }
                None => b.extend_from_slice(&(-1i32).to_be_bytes()),
            }
        }
        b
    }

    #[test]
    fn startup_message_layout() {
        let m = startup_message("u", "d");
        let len = i32::from_be_bytes(m[0..4].try_into().unwrap()) as usize;
        assert_eq!(len, m.len());
        assert_eq!(&m[4..8], &PROTOCOL_VERSION.to_be_bytes());
        assert_eq!(
            &m[8..],
            b"user\0u\0database\0d\0application_name\0ferry-pg-session\0\0"
        );
    }

    #[test]
    fn messages_are_taken_only_when_complete() {
        let mut stream = backend(b'Z', b"I");
        stream.extend_from_slice(&backend(b'C', b"SELECT 1\0"));
        let mut buf = stream[..4].to_vec();
        assert!(take_message(&mut buf).unwrap().is_none());
        buf.extend_from_slice(&stream[4..]);
        let m = take_message(&mut buf).unwrap().unwrap();
        assert_eq!((m.tag, m.body.as_slice()), (b'Z', &b"I"[..]));
        let m = take_message(&mut buf).unwrap().unwrap();
        assert_eq!(m.tag, b'C');
        assert!(buf.is_empty());
        let mut bad = vec![b'D', 0xff, 0xff, 0xff, 0xff];
        assert!(take_message(&mut bad).is_err());
    }

    #[test]
    fn error_fields_are_rendered() {
        let m = ServerMessage::parse(
            b"SFATAL\0VFATAL\0C57P01\0Mterminating connection due to administrator command\0\0",
        )
        .unwrap();
        assert!(m.is_fatal());
        assert_eq!(
            m.to_string(),
            "FATAL 57P01: terminating connection due to administrator command"
        );
        assert!(ServerMessage::parse(b"SERROR\0").is_err());
    }

    #[test]
    fn rows_are_parsed() {
        let row = parse_row(&data_row(&[
            Some("4242"),
            Some("198.18.0.100/32"),
            Some("40312"),
            Some("7"),
        ]))
        .unwrap();
        assert_eq!(
            row,
            Row {
                backend_pid: 4242,
                client_addr: Some("198.18.0.100".into()),
                client_port: Some(40312),
                counter: 7,
            }
        );
        let unix = parse_row(&data_row(&[Some("1"), None, None, Some("1")])).unwrap();
        assert_eq!((unix.client_addr, unix.client_port), (None, None));
        assert!(parse_row(&data_row(&[Some("x"), None, None, Some("1")])).is_err());
        assert!(parse_row(&data_row(&[Some("1"), None, None])).is_err());
    }

    #[test]
    fn status_line_has_the_documented_keys() {
        let s = Status {
            backend_pid: Some(1),
            queries_ok: 2,
            ..Status::default()
        };
        let line = s.json_line();
        assert!(line.ends_with('\n'));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["backend_pid"], 1);
        assert_eq!(v["queries_ok"], 2);
        assert!(v["last_error"].is_null() && v["client_addr"].is_null());
        assert_eq!(v.as_object().unwrap().len(), 7);
    }

    #[test]
    fn poll_timeout_rounds_up() {
        let now = Instant::now();
        assert_eq!(poll_timeout(now, now), 0);
        assert_eq!(poll_timeout(now, now + Duration::from_micros(1500)), 2);
        assert_eq!(poll_timeout(now + Duration::from_secs(1), now), 0);
    }
}
