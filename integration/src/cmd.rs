//! Running the system tools the harness builds networks with (`ip`), with
//! errors that say which command failed and what it printed.

use std::io::Write;
use std::process::{Command, Output, Stdio};

#[derive(Debug, thiserror::Error)]
pub enum CmdError {
    #[error("starting `{command}`: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
}

/// Renders a command line for error messages.
pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

/// Runs `cmd` to completion and returns its output; a non-zero exit is an
/// error carrying stderr.
pub fn run(cmd: &mut Command) -> Result<Output, CmdError> {
    run_with_stdin(cmd, None)
}

/// Like [`run`], feeding `stdin` to the command (for `ip -batch -`).
pub fn run_with_stdin(cmd: &mut Command, stdin: Option<&str>) -> Result<Output, CmdError> {
    let command = describe(cmd);
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|source| CmdError::Spawn {
        command: command.clone(),
        source,
    })?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // The batches are a few KiB at most, far below the pipe buffer, so
        // writing before reading the output cannot deadlock.
        pipe.write_all(text.as_bytes())
            .map_err(|source| CmdError::Spawn {
                command: command.clone(),
                source,
            })?;
    }
    let output = child.wait_with_output().map_err(|source| CmdError::Spawn {
        command: command.clone(),
        source,
    })?;
    if !output.status.success() {
        return Err(CmdError::Failed {
            command,
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        });
    }
    Ok(output)
}

/// `ip ARGS...`, returning stdout.
pub fn ip<I, S>(args: I) -> Result<String, CmdError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let out = run(Command::new("ip").args(args))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `lines` as one `ip -batch` script, inside namespace `netns` if
/// given. One process per namespace instead of one per command keeps the
/// set-up of large clusters fast; on failure the whole script is in the error.
pub fn ip_batch(netns: Option<&str>, lines: &[String]) -> Result<(), CmdError> {
    let mut cmd = Command::new("ip");
    if let Some(ns) = netns {
        cmd.args(["-n", ns]);
    }
    cmd.args(["-batch", "-"]);
    let script = lines.join("\n") + "\n";
    run_with_stdin(&mut cmd, Some(&script)).map_err(|e| match e {
        CmdError::Failed {
            command,
            status,
            stderr,
        } => CmdError::Failed {
            command: format!("{command} <<EOF\n{script}EOF"),
            status,
            stderr,
        },
        other => other,
    })?;
    Ok(())
}
