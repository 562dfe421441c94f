//! How a managed process ended, and the signals `SignalProcess` may send
//! it.

use ferry_proto::v1::ProcessExit;

/// How a child ended, from its wait status.
pub fn exit_from_wait_status(status: i32) -> ProcessExit {
    if libc::WIFSIGNALED(status) {
        let signal = libc::WTERMSIG(status);
        ProcessExit {
            status_known: true,
            code: 0,
            signal,
            description: format!("killed by {}", signal_name(signal)),
        }
    } else {
        let code = libc::WEXITSTATUS(status);
        ProcessExit {
            status_known: true,
            code,
            signal: 0,
            description: format!("exited with {code}"),
        }
    }
}

/// An end whose status this agent cannot read, saying why.
pub fn exit_unknown(why: &str) -> ProcessExit {
    ProcessExit {
        status_known: false,
        code: 0,
        signal: 0,
        description: format!("ended, status unknown: {why}"),
    }
}

/// The signal a `SignalProcess` may send, or why not (naming the field).
pub fn signal_to_send(signal: i32) -> Result<nix::sys::signal::Signal, String> {
    use nix::sys::signal::Signal;
    let s = Signal::try_from(signal)
        .map_err(|_| format!("signal: {signal} is not a standard signal (1 to 31)"))?;
    if matches!(
        s,
        Signal::SIGSTOP | Signal::SIGTSTP | Signal::SIGTTIN | Signal::SIGTTOU | Signal::SIGCONT
    ) {
        return Err(format!(
            "signal: {} stops or continues the process, which ferry's migrations do themselves",
            s.as_str()
        ));
    }
    Ok(s)
}

/// Whether `signal` would reach managed process `pid`, which is the init
/// of its own PID namespace: the kernel delivers a signal from outside the
/// namespace to its init only if the init handles it (SIGKILL excepted),
/// and drops any other silently (pid_namespaces(7)). Err says why not.
pub fn signal_reaches(pid: i32, signal: nix::sys::signal::Signal) -> Result<(), String> {
    if signal == nix::sys::signal::Signal::SIGKILL {
        return Ok(());
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("pid: reading /proc/{pid}/status: {e}"))?;
    let caught = status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .ok_or_else(|| format!("pid: no SigCgt line in /proc/{pid}/status"))?;
    if caught & (1u64 << (signal as i32 - 1)) != 0 {
        return Ok(());
    }
    Err(format!(
        "signal: PID {pid} is the init of its own PID namespace and has no handler for {}, so the kernel would drop it; SIGKILL (9) ends it",
        signal.as_str()
    ))
}

/// "SIGTERM", or "signal 40" for one without a name.
pub fn signal_name(signal: i32) -> String {
    nix::sys::signal::Signal::try_from(signal)
        .map(|s| s.as_str().to_owned())
        .unwrap_or_else(|_| format!("signal {signal}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses_say_code_or_signal() {
        let e = exit_from_wait_status(7 << 8);
        assert!(e.status_known);
        assert_eq!(
            (e.code, e.signal, e.description.as_str()),
            (7, 0, "exited with 7")
        );
        let e = exit_from_wait_status(libc::SIGTERM);
        assert_eq!((e.code, e.signal), (0, libc::SIGTERM));
        assert_eq!(e.description, "killed by SIGTERM");
        assert!(!exit_unknown("adopted").status_known);
    }

    #[test]
    fn a_signal_reaches_a_namespace_init_only_if_it_handles_it() {
        use nix::sys::signal::Signal;
        // This test process handles none of these by default; the
        // runtime may catch others (SIGPIPE is ignored, not caught).
        let me = std::process::id() as i32;
        let e = signal_reaches(me, Signal::SIGUSR2).unwrap_err();
        assert!(e.contains("no handler for SIGUSR2"), "{e}");
        assert!(signal_reaches(me, Signal::SIGKILL).is_ok());
        extern "C" fn noop(_: libc::c_int) {}
        let action = nix::sys::signal::SigAction::new(
            nix::sys::signal::SigHandler::Handler(noop),
            nix::sys::signal::SaFlags::empty(),
            nix::sys::signal::SigSet::empty(),
        );
        // SAFETY: installs a handler that does nothing (async-signal-safe)
        // for a signal nothing else in the test binary uses.
        unsafe { nix::sys::signal::sigaction(Signal::SIGUSR2, &action) }.unwrap();
        assert!(signal_reaches(me, Signal::SIGUSR2).is_ok());
    }

    #[test]
    fn only_standard_signals_that_neither_stop_nor_continue_are_sent() {
        assert_eq!(
            signal_to_send(15).unwrap(),
            nix::sys::signal::Signal::SIGTERM
        );
        assert_eq!(
            signal_to_send(9).unwrap(),
            nix::sys::signal::Signal::SIGKILL
        );
        for refused in [0, -1, 32, 64, 1000, 19, 20, 21, 22, 18] {
            let e = signal_to_send(refused).unwrap_err();
            assert!(e.starts_with("signal: "), "{refused}: {e}");
        }
    }
}
