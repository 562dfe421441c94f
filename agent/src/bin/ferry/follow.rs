//! `ferry run --foreground`, `ferry adopt --foreground` and `ferry wait`:
//! stays with a managed process wherever migrations move it until it
//! ends, passes on the signals ferry receives (foreground), and ends as
//! the process ended. What a systemd unit's `ExecStart=` needs: the unit
//! lives as long as the process, `systemctl stop` reaches it on whichever
//! node it runs, and its exit status is the process's.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use ferry_proto::v1::{
    ProcessExit, ProcessUpdate, SignalProcessRequest, WaitProcessRequest, process_update::Update,
};
use tokio::signal::unix::{SignalKind, signal};
use tokio_stream::StreamExt;

use crate::connection::{Client, status_error};

/// How long a lost agent is waited for (a restart under systemd takes a
/// couple of seconds) before ferry gives up following.
const AGENT_GONE_FOR: Duration = Duration::from_secs(60);

/// The signals passed on to the process, as systemd and terminals send
/// them. Each ends a process by default (see [`send_pending`]).
const FORWARDED: &[(i32, &str)] = &[
    (libc::SIGTERM, "SIGTERM"),
    (libc::SIGINT, "SIGINT"),
    (libc::SIGHUP, "SIGHUP"),
    (libc::SIGQUIT, "SIGQUIT"),
    (libc::SIGUSR1, "SIGUSR1"),
    (libc::SIGUSR2, "SIGUSR2"),
];

/// Where the process is now.
#[derive(Debug, Clone)]
struct Whereabouts {
    node: String,
    pid: i32,
}

/// The signals ferry passes on, caught from the moment this is made: made
/// before the process is started or adopted, so that a stop that comes
/// while it starts is held and passed on, not ferry's own end.
pub struct Signals(Vec<(i32, tokio::signal::unix::Signal)>);

impl Signals {
    pub fn catch() -> Result<Self> {
        let mut caught = Vec::new();
        for &(number, _) in FORWARDED {
            caught.push((number, signal(SignalKind::from_raw(number))?));
        }
        Ok(Signals(caught))
    }

    /// None caught: `ferry wait` leaves signals alone.
    pub fn none() -> Self {
        Signals(Vec::new())
    }
}

/// Follows `pid` (on `node`, empty: the agent's) until it ends, passing
/// on `signals`; returns how it ended.
pub async fn follow(
    client: &mut Client,
    node: String,
    pid: i32,
    signals: Signals,
) -> Result<ProcessExit> {
    let mut at = Whereabouts { node, pid };
    let mut signals = signals.0;
    // Signals the process could not take yet (a migration held it).
    let mut pending: Vec<i32> = Vec::new();
    let mut retry = tokio::time::interval(Duration::from_millis(200));
    let mut lost_since: Option<Instant> = None;
    let mut seen_running = false;
    loop {
        let call = client
            .wait_process(WaitProcessRequest {
                pid: at.pid,
                node: at.node.clone(),
            })
            .await;
        let mut stream = match call {
            Ok(s) => {
                lost_since = None;
                s.into_inner()
            }
            Err(s) if s.code() == tonic::Code::NotFound && seen_running => {
                // It ended or moved while the agent was away (a restart):
                // how, nobody can say any more.
                return Ok(ProcessExit {
                    status_known: false,
                    description: format!(
                        "PID {} on {} was lost from sight while its agent was away: {}",
                        at.pid,
                        at.node,
                        s.message()
                    ),
                    ..Default::default()
                });
            }
            Err(s) if s.code() == tonic::Code::Unavailable || s.code() == tonic::Code::Unknown => {
                wait_for_agent(&mut lost_since, &s).await?;
                continue;
            }
            Err(s) => return Err(status_error(s)),
        };
        loop {
            let next = tokio::select! {
                u = stream.next() => u,
                Some(number) = next_signal(&mut signals) => {
                    pending.push(number);
                    send_pending(client, &at, &mut pending).await?;
                    continue;
                }
                _ = retry.tick(), if !pending.is_empty() => {
                    send_pending(client, &at, &mut pending).await?;
                    continue;
                }
            };
            match next {
                Some(Ok(ProcessUpdate {
                    node,
                    pid,
                    update: Some(u),
                })) => {
                    at = Whereabouts { node, pid };
                    match u {
                        Update::Running(r) => {
                            seen_running = true;
                            eprintln!(
                                "ferry: PID {} runs on {}: {}",
                                at.pid,
                                at.node,
                                r.argv.join(" ")
                            );
                        }
                        Update::Moved(m) => {
                            eprintln!(
                                "ferry: moved from {} to {} (migration {}), now PID {}",
                                m.from_node, at.node, m.migration_id, at.pid
                            );
                            // A signal held back during the migration goes
                            // to where the process is now.
                            send_pending(client, &at, &mut pending).await?;
                        }
                        Update::Exited(exit) => {
                            eprintln!("ferry: PID {} on {} {}", at.pid, at.node, exit.description);
                            return Ok(exit);
                        }
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(s)) => {
                    if s.code() != tonic::Code::Unavailable && s.code() != tonic::Code::Unknown {
                        return Err(status_error(s));
                    }
                    wait_for_agent(&mut lost_since, &s).await?;
                    break;
                }
                None => {
                    // The agent closed the stream without an end: it
                    // stopped. Ask again where the process is.
                    let s = tonic::Status::unavailable("the agent ended the stream");
                    wait_for_agent(&mut lost_since, &s).await?;
                    break;
                }
            }
        }
    }
}

/// The next signal ferry received among `signals`; never, without any.
async fn next_signal(signals: &mut [(i32, tokio::signal::unix::Signal)]) -> Option<i32> {
    if signals.is_empty() {
        return std::future::pending().await;
    }
    let waits = signals.iter_mut().map(|(number, s)| {
        let number = *number;
        Box::pin(async move { s.recv().await.map(|()| number) })
    });
    futures::future::select_all(waits).await.0
}

/// Sends the pending signals to where the process is; a signal the
/// process cannot take now (a migration holds it) stays pending.
async fn send_pending(client: &mut Client, at: &Whereabouts, pending: &mut Vec<i32>) -> Result<()> {
    while let Some(&number) = pending.first() {
        let name = FORWARDED
            .iter()
            .find(|(n, _)| *n == number)
            .map(|(_, s)| *s)
            .unwrap_or("signal");
        match client
            .signal_process(SignalProcessRequest {
                pid: at.pid,
                signal: number,
                node: at.node.clone(),
            })
            .await
        {
            Ok(_) => {
                eprintln!("ferry: {name} passed on to PID {} on {}", at.pid, at.node);
                pending.remove(0);
            }
            // Migrating (or the agent away): sent again once the move is
            // over.
            Err(s) if s.code() == tonic::Code::Unavailable => return Ok(()),
            // The process does not handle it, and as the init of its PID
            // namespace would never see it. Every forwarded signal would
            // end any other process: it ends this one with SIGKILL, what a
            // stop of the unit asks for.
            Err(s) if s.code() == tonic::Code::FailedPrecondition && number != libc::SIGKILL => {
                eprintln!(
                    "ferry: {}; {name} would end a process that is no namespace init: ending it with SIGKILL",
                    s.message()
                );
                pending[0] = libc::SIGKILL;
            }
            // Not there: it moved (the update is on its way, and the
            // signal follows it) or ended (then ferry ends with it).
            Err(s) if s.code() == tonic::Code::NotFound => return Ok(()),
            Err(s) => return Err(status_error(s)),
        }
    }
    Ok(())
}

/// Waits a second for a lost agent, giving up after [`AGENT_GONE_FOR`].
async fn wait_for_agent(lost_since: &mut Option<Instant>, s: &tonic::Status) -> Result<()> {
    let since = *lost_since.get_or_insert_with(Instant::now);
    if since.elapsed() > AGENT_GONE_FOR {
        bail!(
            "the agent has not answered for {} s: {}",
            AGENT_GONE_FOR.as_secs(),
            s.message()
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    Ok(())
}

/// Ends ferry as the process ended: with its exit code, or killed by its
/// signal (what a service manager then reports for the unit); 1 when how
/// it ended is unknown.
pub fn end_like(exit: &ProcessExit) -> ! {
    if exit.status_known && exit.signal > 0 {
        if let Ok(sig) = nix::sys::signal::Signal::try_from(exit.signal) {
            // SAFETY: restores the default action of one signal, which
            // involves no handler code; ferry is about to end anyway.
            unsafe {
                let _ = nix::sys::signal::signal(sig, nix::sys::signal::SigHandler::SigDfl);
            }
            let _ = nix::sys::signal::raise(sig);
        }
        // A signal whose default is to be ignored leaves us here.
        std::process::exit(128 + exit.signal);
    }
    if exit.status_known {
        std::process::exit(exit.code);
    }
    std::process::exit(1)
}
