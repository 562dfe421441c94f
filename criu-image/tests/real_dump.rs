//! Root-only tests on real dumps by the CRIU that `cargo xtask setup`
//! builds.
//!
//! `dumped_connection_is_restored_from_the_new_local_address` dumps a real
//! established TCP connection, moves its local address in the images, and
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
//!
//! `pagemap_locates_the_pages_a_process_wrote` dumps a process that wrote
//! known bytes to known pages, and finds those bytes in the pages file
//! where the pagemap says they are.

use std::fs::{self, File};
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use ferry_criu_image::pagemap::read_pagemap;
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

/// Why a test that only dumps a python process cannot run here, if it
/// cannot.
fn dump_skip_reason() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("needs root (CRIU)".into());
    }
    if !Path::new(CRIU).exists() {
        return Some(format!("{CRIU} is not built (cargo xtask setup)"));
    }
    if python().is_none() {
        return Some("needs python3".into());
    }
    None
}

/// Why the connection test cannot run here, if it cannot.
fn skip_reason() -> Option<String> {
    if let Some(reason) = dump_skip_reason() {
        return Some(reason);
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
    criu_command(Command::new("nsenter").args(&all), args, log);
}

/// Runs `cmd`, a CRIU command with arguments `args`, logging to `log`; on
/// failure, panics with the log's tail.
fn criu_command(cmd: &mut Command, args: &[&str], log: &Path) {
    let out = cmd
        .args(["-v4", "-o"])
        .arg(log)
        .output()
        .expect("running criu");
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
    if ferry_testkit::skip("real_dump", skip_reason()) {
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
                local: old.into(),
                remote: Some(PEER.into()),
            },
            new_local: NEW_LOCAL.into(),
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

/// Maps four private anonymous pages, writes a pattern to pages 0, 1 and 3
/// (byte by byte, so that no other copy of it is left in the heap), leaves
/// page 2 untouched, and reports the address and page size. Huge pages are
/// refused for the mapping where Python can, so page 2 stays unpopulated.
const WRITER: &str = r#"
import ctypes, mmap, os, time
os.setsid()
ps = mmap.PAGESIZE
m = mmap.mmap(-1, 4 * ps, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
nohuge = 0
if hasattr(mmap, "MADV_NOHUGEPAGE"):
    m.madvise(mmap.MADV_NOHUGEPAGE)
    nohuge = 1
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
for i in (0, 1, 3):
    for j in range(ps):
        m[i * ps + j] = (i * 89 + j * 31 + (j >> 8) * 7 + 1) & 0xff
print("mapped", addr, ps, nohuge, flush=True)
time.sleep(3600)
"#;

/// The byte WRITER put at offset `j` of page `i`: different at every
/// distance under the page size and across pages, so data read at a
/// shifted offset does not match.
fn pattern(page: u64, page_size: u64) -> Vec<u8> {
    (0..page_size)
        .map(|j| ((page * 89 + j * 31 + (j >> 8) * 7 + 1) & 0xff) as u8)
        .collect()
}

#[test]
fn pagemap_locates_the_pages_a_process_wrote() {
    use std::io::{Read, Seek, SeekFrom};

    if ferry_testkit::skip("real_dump pagemap", dump_skip_reason()) {
        return;
    }
    let python = python().expect("checked by dump_skip_reason");
    let mut guard = Guard {
        children: Vec::new(),
        pids: Vec::new(),
        netns: Vec::new(),
        dir: tempfile::tempdir().expect("creating a temporary directory"),
    };
    let dir: PathBuf = guard.dir.path().to_owned();
    let images = dir.join("images");
    fs::create_dir(&images).unwrap();

    // Started directly, so that its pid here is its pid in its own PID
    // namespace, the one CRIU names the pagemap by.
    let log_path = dir.join("writer.log");
    let log = File::create(&log_path).unwrap();
    let writer = Command::new(python)
        .arg("-c")
        .arg(WRITER)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("spawning the writer");
    let pid = writer.id();
    guard.children.push(writer);
    let (addr, page_size, nohuge): (u64, u64, bool) = wait_for(
        "the writer to map its pages",
        Duration::from_secs(15),
        || {
            let log = fs::read_to_string(&log_path).ok()?;
            let line = log.lines().find_map(|l| l.strip_prefix("mapped "))?;
            let mut words = line.split_whitespace().map(|w| w.parse::<u64>().ok());
            Some((words.next()??, words.next()??, words.next()?? == 1))
        },
    );

    let pid_s = pid.to_string();
    let args = [
        "dump",
        "-t",
        &pid_s,
        "-D",
        images.to_str().unwrap(),
        "--network-lock",
        "skip",
    ];
    criu_command(Command::new(CRIU).args(args), &args, &dir.join("dump.log"));
    let writer = guard.children.last_mut().unwrap();
    let status = wait_exit(writer, Duration::from_secs(10)).expect("the dumped writer to exit");
    assert!(!status.success(), "the writer exited on its own: {status}");

    // CRIU 4.2 leaves field 2 of every entry at 0: reading succeeds only if
    // the page counts come from field 5.
    let pm = read_pagemap(&images, pid).expect("reading the pagemap");
    assert_eq!(pm.page_size, page_size, "CRIU's and Python's page size");
    let present: Vec<_> = pm.runs.iter().filter(|r| r.is_present()).collect();
    assert!(!present.is_empty(), "no present runs: {pm:#?}");
    eprintln!(
        "pagemap: {} runs, {} present, pages file {}",
        pm.runs.len(),
        present.len(),
        pm.pages_file
    );

    // The pages file is exactly the present runs' pages.
    let pages_path = images.join(&pm.pages_file);
    let file_len = fs::metadata(&pages_path).unwrap().len();
    let summed: u64 = present.iter().map(|r| r.nr_pages * page_size).sum();
    assert_eq!(summed, file_len);
    assert_eq!(pm.check_pages_file(&images).unwrap(), file_len);

    // Each written page's bytes are where the pagemap puts them.
    let mut pages = File::open(&pages_path).unwrap();
    for page in [0u64, 1, 3] {
        let vaddr = addr + page * page_size;
        let run = pm
            .run_containing(vaddr)
            .unwrap_or_else(|| panic!("page {page} at {vaddr:#x} is in no run: {pm:#?}"));
        assert!(run.is_present(), "page {page}: {run:?}");
        let offset = run.pages_file_offset.unwrap() + (vaddr - run.vaddr);
        assert_eq!(pm.pages_file_offset_of(vaddr), Some(offset));
        let mut buf = vec![0u8; page_size as usize];
        pages.seek(SeekFrom::Start(offset)).unwrap();
        pages.read_exact(&mut buf).unwrap();
        assert!(
            buf == pattern(page, page_size),
            "page {page} at {vaddr:#x}: the bytes at offset {offset} of {} are not its pattern",
            pm.pages_file
        );
    }
    // The untouched page was never populated, so nothing of it was dumped:
    // page 3's bytes are in another run, or right after page 1's all the
    // same, which the pattern check above tells apart.
    if nohuge {
        let hole = addr + 2 * page_size;
        assert!(
            pm.run_containing(hole).is_none_or(|r| !r.is_present()),
            "the untouched page at {hole:#x} was dumped: {:?}",
            pm.run_containing(hole)
        );
    }
}
