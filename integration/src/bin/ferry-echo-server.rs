//! `ferry-echo-server --port 7000`: echoes every byte of every TCP
//! connection back, exactly, one thread per connection.
//!
//! Built to be checkpointed and restored by CRIU mid-stream: plain blocking
//! std I/O (nothing CRIU cannot restore), EINTR retried everywhere (a
//! restored thread's interrupted syscall may come back with it), a failing
//! connection only ends its own thread, and nothing is written to stdout or
//! stderr after start (they are /dev/null under the agent, and may be gone).

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "ferry-echo-server",
    about = "TCP echo server for ferry's tests"
)]
struct Args {
    /// TCP port to listen on.
    #[arg(long, default_value_t = 7000)]
    port: u16,
    /// Address to bind (`::` takes IPv6 and IPv4 clients alike).
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::UNSPECIFIED))]
    bind: IpAddr,
    /// Exit with this code on SIGTERM (a handler, as real servers have;
    /// without one, SIGTERM from outside the PID namespace whose init this
    /// server is never reaches it).
    #[arg(long, value_name = "CODE")]
    exit_on_term: Option<u8>,
    /// Move each accepted connection to the lowest free descriptor at or
    /// above this number, without close-on-exec (where a migration must
    /// put it back, whatever lies below).
    #[arg(long, value_name = "FD")]
    connection_fds_from: Option<i32>,
    /// Close standard input once listening, as an inetd-style server has
    /// it: the first connection accepted then takes descriptor 0 (Rust's
    /// runtime opens /dev/null on a descriptor closed before it starts).
    #[arg(long)]
    close_stdin: bool,
}

/// The code `--exit-on-term` exits with.
static EXIT_ON_TERM: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn exit_on_term(_: libc::c_int) {
    // SAFETY: _exit and an atomic load are async-signal-safe.
    unsafe { libc::_exit(EXIT_ON_TERM.load(std::sync::atomic::Ordering::Relaxed)) }
}

/// Small stacks: the process's memory is what a migration copies.
const THREAD_STACK: usize = 128 * 1024;
const BUFFER: usize = 16 * 1024;

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(code) = args.exit_on_term {
        EXIT_ON_TERM.store(i32::from(code), std::sync::atomic::Ordering::Relaxed);
        let action = nix::sys::signal::SigAction::new(
            nix::sys::signal::SigHandler::Handler(exit_on_term),
            nix::sys::signal::SaFlags::SA_RESTART,
            nix::sys::signal::SigSet::empty(),
        );
        // SAFETY: the handler only calls async-signal-safe functions.
        let installed =
            unsafe { nix::sys::signal::sigaction(nix::sys::signal::Signal::SIGTERM, &action) };
        if let Err(e) = installed {
            eprintln!("ferry-echo-server: SIGTERM handler: {e}");
            return ExitCode::FAILURE;
        }
    }
    // std's bind sets SO_REUSEADDR, so a restart right after a crash works.
    let addr = SocketAddr::new(args.bind, args.port);
    let listener = match TcpListener::bind(addr) {
        Ok(l) => l,
        Err(e) => {
            // The only message this program ever prints: before serving.
            eprintln!("ferry-echo-server: binding {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.close_stdin {
        // SAFETY: close() takes a number; nothing of this program uses
        // standard input.
        unsafe { libc::close(0) };
    }
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                let stream = match args.connection_fds_from {
                    Some(from) => match moved_up(stream, from) {
                        Some(s) => s,
                        None => continue,
                    },
                    None => stream,
                };
                // If no thread can be made, dropping the stream closes it;
                // the server goes on.
                let _ = std::thread::Builder::new()
                    .stack_size(THREAD_STACK)
                    .spawn(move || echo(stream));
            }
            Err(e) => match e.kind() {
                // Retried at once: an interrupted or aborted handshake.
                ErrorKind::Interrupted | ErrorKind::ConnectionAborted => {}
                // Out of fds or memory: back off instead of spinning.
                _ => std::thread::sleep(Duration::from_millis(10)),
            },
        }
    }
}

/// `stream` at the lowest free descriptor at or above `from`, without
/// close-on-exec; `None` (the connection closed) if there is none.
fn moved_up(stream: TcpStream, from: i32) -> Option<TcpStream> {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: F_DUPFD takes an int and returns a new descriptor or -1;
    // `stream` stays valid until dropped below.
    let fd = unsafe { libc::fcntl(stream.as_raw_fd(), libc::F_DUPFD, from) };
    if fd < 0 {
        return None;
    }
    drop(stream);
    // SAFETY: `fd` was just returned by fcntl and is owned by nothing else.
    Some(unsafe { TcpStream::from_raw_fd(fd) })
}

/// Echoes until EOF or an error on this connection.
fn echo(mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let mut buf = vec![0u8; BUFFER];
    loop {
        let n = match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        // write_all retries EINTR itself.
        if stream.write_all(&buf[..n]).is_err() {
            return;
        }
    }
    // The peer closed its sending side: finish ours, so it sees EOF after
    // the last echo.
    let _ = stream.shutdown(std::net::Shutdown::Write);
}
