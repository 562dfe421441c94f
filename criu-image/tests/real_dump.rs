//! Root-only: dumps a real established TCP connection with the CRIU that
//! `cargo xtask setup` builds, moves its local address in the images, and
//! restores it with the new address.
//!
//! Topology: namespace `ferry-img-<pid>` (the client, 198.18.200.1/24 and
//! 198.18.200.2/24 on a veth) and `ferry-img-<pid>-peer` (the listener,
//! 198.18.200.9/24). After the dump the listener's address goes away, so
//! nothing answers the restored socket's window probe with an RST and it
//! stays ESTABLISHED long enough for `ss` to show it.
//!
//! CRIU runs with the network namespace entered (`nsenter --net`) and no
//! other: `ip netns exec` also unshares the mount namespace, which makes
//! CRIU refuse to dump. Options mirror the agent's swrk requests
//! (`tcp_established`, `network_lock = SKIP`); the client calls `setsid()`
//! and has no terminal, so `--shell-job` is not needed.

use std::fs::{self, File};
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use ferry_criu_image::{
    Family, IPPROTO_TCP, LocalAddressRewrite, SocketMatch, TCP_ESTABLISHED, inet_sockets,
    rewrite_local_addresses,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const CRIU: &str = "/opt/ferry/criu/bin/criu";
const OLD_LOCAL: Ipv4Addr = Ipv4Addr::new(198, 18, 200, 1);
const NEW_LOCAL: Ipv4Addr = Ipv4Addr::new(198, 18, 200, 2);
const PEER: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(198, 18, 200, 9), 5432);

const LISTENER: &str = r#"
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
c, _ = s.accept()
time.sleep(3600)
"#;

const CLIENT: &str = r#"
import os, socket, sys, time
os.setsid()
deadline = time.time() + 10
while True:
    s = socket.socket()
    s.bind((sys.argv[1], 0))
    try:
        s.connect((sys.argv[2], int(sys.argv[3])))
        break
    except OSError:
        s.close()
        if time.time() > deadline:
            raise
        time.sleep(0.05)
print("connected", s.getsockname()[1], flush=True)
time.sleep(3600)
"#;

/// Why this test cannot run here, if it cannot.
fn skip_reason() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("needs root (network namespaces, CRIU)".into());
    }
    if !Path::new(CRIU).exists() {
        return Some(format!("{CRIU} is not built (cargo xtask setup)"));
    }
    for tool in ["ip", "nsenter", "ss"] {
        let works = Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !works {
            return Some(format!("needs `{tool}` on PATH"));
        }
    }
    if python().is_none() {
        return Some("needs python3".into());
    }
    None
}

fn python() -> Option<&'static str> {
    ["/usr/bin/python3", "python3"].into_iter().find(|p| {
        Command::new(p)
            .arg("-c")
            .arg("pass")
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// Everything the test creates, undone on drop, even after a failure:
/// processes (children and the restored one), namespaces, the directory.
struct Guard {
    children: Vec<Child>,
    pids: Vec<i32>,
    netns: Vec<String>,
    dir: tempfile::TempDir,
}

impl Guard {
    fn netns_add(&mut self, name: &str) {
        // A leftover of an earlier run with the same PID.
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        run("ip", &["netns", "add", name]);
        self.netns.push(name.to_owned());
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        for &pid in &self.pids {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        for ns in &self.netns {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

fn netns_path(name: &str) -> String {
    format!("--net=/run/netns/{name}")
}

fn output(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {program} {args:?}: {e}"))
}

fn run(program: &str, args: &[&str]) -> String {
    let out = output(program, args);
    assert!(
        out.status.success(),
        "{program} {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs CRIU in network namespace `ns`; on failure, panics with its log.
fn criu(ns: &str, args: &[&str], log: &Path) {
    let mut all = vec![netns_path(ns), CRIU.to_owned()];
    all.extend(args.iter().map(|a| (*a).to_owned()));
    all.extend(["-v4".to_owned(), "-o".to_owned(), log.display().to_string()]);
    let out = Command::new("nsenter")
        .args(&all)
        .output()
        .expect("running nsenter criu");
    if !out.status.success() {
        let log = fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<_> = log.lines().rev().take(40).collect();
        panic!(
            "criu {args:?}: {}\n{}\n--- log tail ---\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
}

fn spawn_python(ns: &str, python: &str, script: &str, args: &[String], out: &Path) -> Child {
    let log = File::create(out).expect("creating a process log");
    let err = log.try_clone().expect("cloning a file");
    Command::new("nsenter")
        .arg(netns_path(ns))
        .arg(python)
        .arg("-c")
        .arg(script)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .spawn()
        .expect("spawning python in a namespace")
}

fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        sleep(Duration::from_millis(50));
    }
}

fn wait_exit(child: &mut Child, timeout: Duration) -> io::Result<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() > deadline {
            return Err(io::Error::other("still running"));
        }
        sleep(Duration::from_millis(20));
    }
}

#[test]
fn dumped_connection_is_restored_from_the_new_local_address() {
    if let Some(reason) = skip_reason() {
        eprintln!("skipping real_dump: {reason}");
        return;
    }
    let python = python().expect("checked by skip_reason");
    let pid = std::process::id();
    let ns = format!("ferry-img-{pid}");
    let peer_ns = format!("ferry-img-{pid}-peer");
    let mut guard = Guard {
        children: Vec::new(),
        pids: Vec::new(),
        netns: Vec::new(),
        dir: tempfile::tempdir().expect("creating a temporary directory"),
    };
    let dir: PathBuf = guard.dir.path().to_owned();
    let images = dir.join("images");
    fs::create_dir(&images).unwrap();

    guard.netns_add(&ns);
    guard.netns_add(&peer_ns);
    for cmd in [
        format!("link add fimg0 type veth peer name fimg1 netns {peer_ns}"),
        "link set lo up".into(),
        "link set fimg0 up".into(),
        format!("addr add {OLD_LOCAL}/24 dev fimg0"),
        format!("addr add {NEW_LOCAL}/24 dev fimg0"),
    ] {
        let args: Vec<&str> = ["-n", ns.as_str()]
            .into_iter()
            .chain(cmd.split(' '))
            .collect();
        run("ip", &args);
    }
    for cmd in [
        "link set lo up".to_owned(),
        "link set fimg1 up".into(),
        format!("addr add {}/24 dev fimg1", PEER.ip()),
    ] {
        let args: Vec<&str> = ["-n", peer_ns.as_str()]
            .into_iter()
            .chain(cmd.split(' '))
            .collect();
        run("ip", &args);
    }

    let listener = spawn_python(
        &peer_ns,
        python,
        LISTENER,
        &[PEER.ip().to_string(), PEER.port().to_string()],
        &dir.join("listener.log"),
    );
    guard.children.push(listener);
    let client_log = dir.join("client.log");
    let client = spawn_python(
        &ns,
        python,
        CLIENT,
        &[
            OLD_LOCAL.to_string(),
            PEER.ip().to_string(),
            PEER.port().to_string(),
        ],
        &client_log,
    );
    let client_pid = client.id();
    guard.children.push(client);
    let port: u16 = wait_for("the client to connect", Duration::from_secs(15), || {
        let log = fs::read_to_string(&client_log).ok()?;
        log.lines()
            .find_map(|l| l.strip_prefix("connected "))
            .and_then(|p| p.trim().parse().ok())
    });
    let old = SocketAddrV4::new(OLD_LOCAL, port);
    let new = SocketAddrV4::new(NEW_LOCAL, port);

    // Dump: CRIU kills the client afterwards; reap it so its PID is free
    // for the restore.
    let client_pid_s = client_pid.to_string();
    criu(
        &ns,
        &[
            "dump",
            "-t",
            &client_pid_s,
            "-D",
            images.to_str().unwrap(),
            "--tcp-established",
            "--network-lock",
            "skip",
        ],
        &dir.join("dump.log"),
    );
    let client = guard.children.last_mut().unwrap();
    let status = wait_exit(client, Duration::from_secs(10)).expect("the dumped client to exit");
    assert!(!status.success(), "the client exited on its own: {status}");

    // The images list the connection.
    let before = inet_sockets(&images).expect("listing the dumped sockets");
    let conn = before
        .iter()
        .find(|s| s.local_v4() == Some(old))
        .unwrap_or_else(|| panic!("no socket from {old} in {before:#?}"));
    assert_eq!(conn.family, Family::Inet);
    assert_eq!(conn.proto, u32::from(IPPROTO_TCP));
    assert_eq!(conn.state, TCP_ESTABLISHED);
    assert_eq!(conn.remote, Some(SocketAddr::V4(PEER)));
    assert!(
        images
            .join(format!("tcp-stream-{:x}.img", conn.ino))
            .exists(),
        "no tcp-stream image for ino {:#x}",
        conn.ino
    );

    // Rewrite, and read back.
    let files_img = images.join("files.img");
    let raw_before = fs::read(&files_img).unwrap();
    let summary = rewrite_local_addresses(
        &images,
        &[LocalAddressRewrite {
            matches: SocketMatch {
                proto: IPPROTO_TCP,
                local: old,
                remote: Some(PEER),
            },
            new_local: NEW_LOCAL,
        }],
    )
    .expect("rewriting the local address");
    assert_eq!(summary.rewritten.len(), 1, "{summary:#?}");
    assert!(summary.unmatched.is_empty());
    assert_eq!(summary.files_written, std::slice::from_ref(&files_img));
    // 198.18.200.1 and .2 are four-byte varints differing in one byte (the
    // one holding bits 21..27, i.e. the last octet's low nibble): exactly one
    // byte of the file changes.
    let raw_after = fs::read(&files_img).unwrap();
    assert_eq!(raw_after.len(), raw_before.len());
    let changed = raw_before
        .iter()
        .zip(&raw_after)
        .filter(|(b, a)| b != a)
        .count();
    assert_eq!(changed, 1);
    let after = inet_sockets(&images).expect("listing the rewritten sockets");
    assert_eq!(after.len(), before.len());
    for (b, a) in before.iter().zip(&after) {
        if b.id == conn.id {
            let mut expected = b.clone();
            expected.local = SocketAddr::V4(new);
            assert_eq!(a, &expected);
        } else {
            assert_eq!(a, b);
        }
    }

    // Make the peer vanish, so the restored socket gets no RST, then
    // restore inside the client's namespace.
    for child in guard.children.iter_mut() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let peer_addr = format!("{}/24", PEER.ip());
    run(
        "ip",
        &["-n", &peer_ns, "addr", "del", &peer_addr, "dev", "fimg1"],
    );
    let pidfile = dir.join("restored.pid");
    criu(
        &ns,
        &[
            "restore",
            "-D",
            images.to_str().unwrap(),
            "--tcp-established",
            "--network-lock",
            "skip",
            "-d",
            "--pidfile",
            pidfile.to_str().unwrap(),
        ],
        &dir.join("restore.log"),
    );
    let restored: i32 = fs::read_to_string(&pidfile)
        .expect("reading CRIU's pidfile")
        .trim()
        .parse()
        .expect("a PID in CRIU's pidfile");
    guard.pids.push(restored);

    let ss = run("nsenter", &[&netns_path(&ns), "ss", "-tnH", "state", "all"]);
    let line = ss
        .lines()
        .find(|l| l.contains(&PEER.to_string()))
        .unwrap_or_else(|| panic!("no connection to {PEER} after the restore:\n{ss}"));
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert!(
        fields.contains(&new.to_string().as_str()),
        "restored socket is not on {new}: {line}"
    );
    assert!(
        !ss.contains(&old.to_string()),
        "{old} is still in use after the restore:\n{ss}"
    );
    eprintln!("restored: {line}");
}
