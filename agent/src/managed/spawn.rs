//! Starting a program under management (`ferry run`): as the init of its
//! own PID namespace (and, if asked, its own IPC namespace) and a session
//! leader, as ferryd's user or another one, with nothing of ferryd's but
//! /dev/null.

use crate::process;

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("argv is empty: give the program to run")]
    EmptyArgv,
    #[error("argv: {what} contains a NUL byte")]
    NulByte { what: String },
    #[error("cannot start {program:?}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("user: no user {user:?} on this node")]
    NoSuchUser { user: String },
    #[error("user: reading {user:?}'s groups: {source}")]
    Groups { user: String, source: nix::Error },
}

/// How to start it.
#[derive(Debug, Clone, Default)]
pub struct SpawnOptions {
    /// An IPC namespace of its own.
    pub own_ipc: bool,
    /// Another user than ferryd's: the process gives up root before it
    /// runs a line of its program.
    pub user: Option<RunAs>,
    /// Variables set in the process's environment beside ferryd's own
    /// (`FERRY_HANDOFF_SOCKET`).
    pub env: Vec<(String, String)>,
}

/// A user to run as: its ids and groups, looked up before the clone (the
/// child may make only async-signal-safe calls).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunAs {
    pub name: String,
    pub uid: libc::uid_t,
    pub gid: libc::gid_t,
    /// Its supplementary groups (its primary one included), as
    /// initgroups(3) would set them.
    pub groups: Vec<libc::gid_t>,
}

impl RunAs {
    /// The user named `user` (or a numeric uid) in this node's user
    /// database. Blocking (NSS).
    pub fn lookup(user: &str) -> Result<Self, SpawnError> {
        let missing = || SpawnError::NoSuchUser {
            user: user.to_owned(),
        };
        let found = match user.parse::<libc::uid_t>() {
            Ok(uid) => nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)),
            Err(_) => nix::unistd::User::from_name(user),
        }
        .map_err(|_| missing())?
        .ok_or_else(missing)?;
        let name = std::ffi::CString::new(found.name.as_bytes()).map_err(|_| missing())?;
        let groups = nix::unistd::getgrouplist(&name, found.gid)
            .map_err(|source| SpawnError::Groups {
                user: user.to_owned(),
                source,
            })?
            .into_iter()
            .map(nix::unistd::Gid::as_raw)
            .collect();
        Ok(Self {
            name: found.name,
            uid: found.uid.as_raw(),
            gid: found.gid.as_raw(),
            groups,
        })
    }
}

/// `program` as execve wants it: itself when it names a path, else the
/// first executable file of that name in `PATH` (looked up here, before
/// the clone: the child may only make async-signal-safe calls).
fn resolve(program: &str) -> Result<std::path::PathBuf, std::io::Error> {
    use std::os::unix::fs::PermissionsExt;
    if program.contains('/') {
        return Ok(program.into());
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no executable {program:?} in PATH"),
            )
        })
}

/// Starts `argv` as ferryd's child in a new PID namespace (and, with
/// `own_ipc`, a new IPC namespace), as a session leader, with stdio on
/// /dev/null (CRIU cannot move pipes to ferryd), and returns its PID. An
/// IPC namespace of its own is what lets a server's System V shared
/// memory, semaphores and message queues move with it (PostgreSQL keeps
/// one segment for its postmaster and children): CRIU dumps and restores
/// them only as a whole namespace, and refuses a process attached to a
/// segment of the node's. Not by default: dumping the namespace costs
/// every freeze ~2 ms (a fork and its sysctls, measured in release). The program is the namespace's init and ferryd's
/// own child (like a process CRIU restores here), so that ferryd reads
/// its exit status; the caller watches it ([`crate::reaper::wait_exit`]).
/// No parent-death signal: CRIU would restore it, and the process would
/// die on the destination as soon as CRIU exits. Its environment is
/// ferryd's with `options.env` added. Blocking only for an
/// exec's length.
pub fn spawn(argv: &[String], options: &SpawnOptions) -> Result<i32, SpawnError> {
    use std::ffi::CString;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;

    let program = argv.first().ok_or(SpawnError::EmptyArgv)?.clone();
    if program.is_empty() {
        return Err(SpawnError::EmptyArgv);
    }
    let failed = |source| SpawnError::Spawn {
        program: program.clone(),
        source,
    };
    let nul = |what: &str| SpawnError::NulByte { what: what.into() };
    let args: Vec<CString> = argv
        .iter()
        .map(|a| CString::new(a.as_bytes()).map_err(|_| nul(&format!("{a:?}"))))
        .collect::<Result<_, _>>()?;
    let path = resolve(&program).map_err(failed)?;
    let path = CString::new(path.as_os_str().as_bytes()).map_err(|_| nul("the program's path"))?;
    let mut arg_ptrs: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    arg_ptrs.push(std::ptr::null());
    // ferryd's environment with the options' variables in place of any of
    // the same name, built before the clone.
    let mut vars: Vec<CString> = std::env::vars_os()
        .filter(|(k, _)| {
            !options
                .env
                .iter()
                .any(|(name, _)| k.as_bytes() == name.as_bytes())
        })
        .filter_map(|(k, v)| {
            let mut kv = k.as_bytes().to_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            CString::new(kv).ok()
        })
        .collect();
    for (k, v) in &options.env {
        vars.push(CString::new(format!("{k}={v}")).map_err(|_| nul(&format!("{k:?}")))?);
    }
    let mut env_ptrs: Vec<*const libc::c_char> = vars.iter().map(|a| a.as_ptr()).collect();
    env_ptrs.push(std::ptr::null());
    let dev_null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(failed)?;
    // The exec-error pipe: close-on-exec, so that it reads as empty once
    // the exec succeeded, and holds the errno when it did not.
    let mut pipe = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two descriptors into a two-element array.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } == -1 {
        return Err(failed(std::io::Error::last_os_error()));
    }
    // SAFETY: both descriptors were just returned by pipe2 and are owned
    // here only.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };

    // struct clone_args (include/uapi/linux/sched.h), the fields up to
    // set_tid_size; the kernel takes the size it is given.
    #[repr(C)]
    #[derive(Default)]
    struct CloneArgs {
        flags: u64,
        pidfd: u64,
        child_tid: u64,
        parent_tid: u64,
        exit_signal: u64,
        stack: u64,
        stack_size: u64,
        tls: u64,
    }
    let args_for_clone = CloneArgs {
        flags: if options.own_ipc {
            (libc::CLONE_NEWPID | libc::CLONE_NEWIPC) as u64
        } else {
            libc::CLONE_NEWPID as u64
        },
        exit_signal: libc::SIGCHLD as u64,
        ..Default::default()
    };
    let null_fd = dev_null.as_raw_fd();
    let err_fd = write_end.as_raw_fd();
    let user = options.user.as_ref();
    // SAFETY: clone3 without CLONE_VM and without a stack is fork: the
    // child gets a copy of this address space with only this thread. The
    // child branch below makes only async-signal-safe system calls on
    // memory prepared before the clone (no allocation, no lock), and ends
    // in execv or _exit.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args_for_clone as *const CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if pid == 0 {
        // The child: PID 1 of the new namespace.
        // SAFETY: see above; every pointer was made before the clone and
        // stays valid in the child's copy of the memory.
        unsafe {
            let fail = |err_fd: libc::c_int| -> ! {
                let errno = *libc::__errno_location();
                let bytes = errno.to_ne_bytes();
                libc::write(err_fd, bytes.as_ptr().cast(), bytes.len());
                libc::_exit(127)
            };
            if libc::setsid() == -1 {
                fail(err_fd);
            }
            for target in 0..3 {
                if libc::dup2(null_fd, target) == -1 {
                    fail(err_fd);
                }
            }
            // Groups, then the group, then the user: each step needs the
            // privileges the next one gives up. The system calls
            // themselves, not glibc's wrappers: those change every thread
            // of the process through glibc's thread list, which the clone
            // copied from this multi-threaded parent with its lock as it
            // was then (held by a thread starting or ending, the child
            // waited on it for ever: seen once in the unit tests). This
            // child has one thread, so the calls change the whole process.
            if let Some(u) = user
                && (libc::syscall(libc::SYS_setgroups, u.groups.len(), u.groups.as_ptr()) == -1
                    || libc::syscall(libc::SYS_setgid, u.gid) == -1
                    || libc::syscall(libc::SYS_setuid, u.uid) == -1)
            {
                fail(err_fd);
            }
            if process::close_inherited_on_exec().is_err() {
                fail(err_fd);
            }
            libc::execve(path.as_ptr(), arg_ptrs.as_ptr(), env_ptrs.as_ptr());
            fail(err_fd)
        }
    }
    if pid < 0 {
        return Err(failed(std::io::Error::last_os_error()));
    }
    let pid = pid as i32;
    drop(write_end);
    drop(dev_null);
    // Empty: the exec happened (the pipe closed with it). Four bytes: the
    // errno of what failed, and the child is gone (reaped here).
    let mut errno = [0u8; 4];
    let mut got = 0;
    while got < errno.len() {
        // SAFETY: reads into the unfilled rest of a local array.
        let n = unsafe {
            libc::read(
                read_end.as_raw_fd(),
                errno[got..].as_mut_ptr().cast(),
                errno.len() - got,
            )
        };
        if n > 0 {
            got += n as usize;
        } else if n == 0
            || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
        {
            break;
        }
    }
    if got == errno.len() {
        let mut status = 0;
        // SAFETY: waitpid on our own child with a pointer to a local.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        return Err(failed(std::io::Error::from_raw_os_error(
            i32::from_ne_bytes(errno),
        )));
    }
    Ok(pid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::managed::exit_from_wait_status;
    use std::os::fd::AsRawFd;
    use std::time::{Duration, Instant};

    /// The unit tests run as root (`cargo xtask test`): a new PID
    /// namespace needs it.
    /// Users by name or uid; an unknown one is named.
    #[test]
    fn a_user_is_found_by_name_or_uid() {
        let root = RunAs::lookup("root").unwrap();
        assert_eq!((root.uid, root.gid), (0, 0));
        assert!(root.groups.contains(&0), "{root:?}");
        assert_eq!(RunAs::lookup("0").unwrap().name, "root");
        let err = RunAs::lookup("ferry-no-such-user").unwrap_err().to_string();
        assert!(
            err.contains("user") && err.contains("ferry-no-such-user"),
            "{err}"
        );
    }

    /// `--user`: the program runs as the user with its groups, not as
    /// ferryd's root (the unit tests run as root).
    #[tokio::test]
    async fn a_process_started_as_another_user_runs_as_it() {
        let nobody = RunAs::lookup("nobody").unwrap();
        let options = SpawnOptions {
            user: Some(nobody.clone()),
            ..Default::default()
        };
        let pid = spawn(&["sleep".into(), "30".into()], &options).unwrap();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let field = |name: &str| -> Vec<u32> {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .unwrap()
                .split_whitespace()
                .map(|v| v.parse().unwrap())
                .collect()
        };
        assert_eq!(field("Uid:"), [nobody.uid; 4], "{status}");
        assert_eq!(field("Gid:"), [nobody.gid; 4], "{status}");
        let mut groups = field("Groups:");
        groups.sort_unstable();
        let mut expected = nobody.groups.clone();
        expected.sort_unstable();
        assert_eq!(groups, expected, "{status}");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        crate::reaper::wait_exit(pid).await.unwrap();
    }

    #[tokio::test]
    async fn a_spawned_process_is_a_namespace_init_whose_end_ferryd_reads() {
        let pid = spawn(
            &["sh".into(), "-c".into(), "exit 4".into()],
            &SpawnOptions::default(),
        )
        .unwrap();
        let status = crate::reaper::wait_exit(pid).await.unwrap();
        let exit = exit_from_wait_status(status.expect("our child"));
        assert_eq!((exit.code, exit.signal), (4, 0), "{exit:?}");

        let pid = spawn(&["sleep".into(), "30".into()], &SpawnOptions::default()).unwrap();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let nspid = status.lines().find(|l| l.starts_with("NSpid:")).unwrap();
        assert!(nspid.trim_end().ends_with("\t1"), "{nspid:?}");
        let info = crate::process::inspect(pid).unwrap();
        assert_eq!((info.session, info.pgrp, info.tty_nr), (pid, pid, 0));
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        let exit = exit_from_wait_status(crate::reaper::wait_exit(pid).await.unwrap().unwrap());
        assert_eq!(exit.signal, libc::SIGKILL, "{exit:?}");

        let e = spawn(&["ferry-no-such-program".into()], &SpawnOptions::default()).unwrap_err();
        assert!(
            matches!(&e, SpawnError::Spawn { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
            "{e}"
        );
        // Found but not executable: the exec's own error comes back.
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("not-a-program");
        std::fs::write(&plain, "data").unwrap();
        let e = spawn(
            &[plain.to_string_lossy().into_owned()],
            &SpawnOptions::default(),
        )
        .unwrap_err();
        assert!(
            matches!(&e, SpawnError::Spawn { source, .. } if source.raw_os_error() == Some(libc::EACCES)),
            "{e}"
        );
        assert!(matches!(
            spawn(&["a\0b".into()], &SpawnOptions::default()),
            Err(SpawnError::NulByte { .. })
        ));
    }

    /// Asked for, the process gets an IPC namespace of its own; by
    /// default it shares the node's (ferryd's).
    #[tokio::test]
    async fn an_ipc_namespace_of_its_own_only_when_asked() {
        let node = std::fs::read_link("/proc/self/ns/ipc").unwrap();
        for own in [false, true] {
            let pid = spawn(
                &["sleep".into(), "30".into()],
                &SpawnOptions {
                    own_ipc: own,
                    ..Default::default()
                },
            )
            .unwrap();
            let its = std::fs::read_link(format!("/proc/{pid}/ns/ipc")).unwrap();
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            crate::reaper::wait_exit(pid).await.unwrap();
            assert_eq!(its != node, own, "{its:?} vs the node's {node:?}");
        }
    }

    #[tokio::test]
    async fn descriptors_ferryd_inherited_do_not_follow_a_managed_process() {
        let file = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: dup of a descriptor this test owns; the copy has no
        // close-on-exec flag, like one ferryd inherited from its starter.
        let inherited = unsafe { libc::dup(file.as_raw_fd()) };
        assert!(inherited > 2);
        let pid = spawn(&["sleep".into(), "30".into()], &SpawnOptions::default()).unwrap();
        // Read the descriptors once sleep sleeps: its command line shows
        // right after the exec, while the dynamic loader still holds the
        // libraries it opens (as descriptor 3) for a moment.
        let sleeping = |syscall: String| {
            syscall
                .split_whitespace()
                .next()
                .and_then(|n| n.parse().ok())
                == Some(libc::SYS_clock_nanosleep)
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while !std::fs::read_to_string(format!("/proc/{pid}/syscall")).is_ok_and(sleeping) {
            assert!(Instant::now() < deadline, "sleep never slept");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let fds: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        crate::reaper::wait_exit(pid).await.unwrap();
        // SAFETY: closes the duplicate made above, owned by this test.
        unsafe { libc::close(inherited) };
        assert_eq!(fds, [0, 1, 2], "the managed process holds more than stdio");
    }
}
