//! `ferryd --check-config FILE`, run as an operator runs it: the binary,
//! its exit status and what it prints. Needs no root: nothing starts.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const FERRYD: &str = env!("CARGO_BIN_EXE_ferryd");

const GOOD: &str = r#"
node = "node1"
work_dir = "/run/ferry/work"
[public]
interface = "pub0"
address = "198.18.0.100"
[cluster]
interface = "clu0"
address = "198.19.0.1"
peer_listen = "198.19.0.1:7100"
[[peers]]
name = "node2"
address = "198.19.0.2:7100"
[metrics]
listen = "198.19.0.1:9464"
"#;

fn check(text: &str) -> (tempfile::TempDir, PathBuf, Output) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ferryd.toml");
    std::fs::write(&path, text).unwrap();
    let out = Command::new(FERRYD)
        .arg("--check-config")
        .arg(&path)
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    (dir, path, out)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn an_invalid_field_fails_and_is_named() {
    let bad = GOOD.replace(
        "listen = \"198.19.0.1:9464\"",
        "listen = \"198.19.0.1:7100\"",
    );
    let (_dir, path, out) = check(&bad);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("metrics.listen") && err.contains(&path.display().to_string()),
        "{err}"
    );
    assert!(
        !text(&out.stdout).contains("valid"),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn a_criu_that_does_not_run_fails_and_is_named() {
    let (_dir, _path, out) = check(&format!(
        "criu_path = \"/nonexistent/criu\"\n{}",
        GOOD.trim_start()
    ));
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("criu_path") && err.contains("/nonexistent/criu"),
        "{err}"
    );
}

#[test]
fn a_valid_config_passes_and_shows_what_would_run() {
    let criu = Path::new(ferry_agent::config::DEFAULT_CRIU_PATH);
    if ferry_testkit::skip(
        "a_valid_config_passes_and_shows_what_would_run",
        (!criu.is_file()).then(|| {
            format!(
                "no CRIU at {} (cargo xtask setup builds it)",
                criu.display()
            )
        }),
    ) {
        return;
    }
    let (_dir, path, out) = check(GOOD);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        stdout.starts_with(&format!("{}: valid", path.display())),
        "{stdout}"
    );
    for part in [
        "http://198.19.0.1:9464/metrics",
        "CRIU version  4.",
        "peer_timeout_secs = 60",
    ] {
        assert!(stdout.contains(part), "{part:?} not in:\n{stdout}");
    }
}

/// A file missing a section: the TOML error is printed once (not again
/// as its own source, not again as a log line), with the log at its
/// default level as an operator runs it.
#[test]
fn a_missing_section_is_said_once() {
    let bad = GOOD.replace(
        "[cluster]\ninterface = \"clu0\"\naddress = \"198.19.0.1\"\npeer_listen = \"198.19.0.1:7100\"\n",
        "",
    );
    assert_ne!(bad, GOOD);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ferryd.toml");
    std::fs::write(&path, bad).unwrap();
    let out = Command::new(FERRYD)
        .arg("--check-config")
        .arg(&path)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.matches("missing field `cluster`").count(), 1, "{err}");
    assert!(err.contains(&path.display().to_string()), "{err}");
}

/// `ferry` with no agent at its socket: the OS error once.
#[test]
fn no_agent_is_said_once() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("control.sock");
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .arg("--socket")
        .arg(&socket)
        .arg("nodes")
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    assert!(err.contains(&socket.display().to_string()), "{err}");
}

/// `ferryd --check`: the host's table, every probe on a line of its own
/// with its verdict, and exit 0 where ferryd can run (it does here).
#[test]
fn the_host_check_lists_every_probe() {
    let out = Command::new(FERRYD).arg("--check").output().unwrap();
    let table = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{table}{}", text(&out.stderr));
    assert!(table.starts_with("kernel  "), "{table}");
    for probe in [
        "userfaultfd asynchronous write-protect",
        "PAGEMAP_SCAN",
        "soft-dirty bits",
        "BPF iterator over TCP sockets",
        "CAP_SYS_RESOURCE",
    ] {
        assert!(
            table
                .lines()
                .any(|l| (l.starts_with("yes  ") || l.starts_with("NO   ")) && l.contains(probe)),
            "{probe}: {table}"
        );
    }
}

/// `features_off` takes the keys `ferryd --check` prints; another is
/// refused, naming the entry and the keys there are.
#[test]
fn an_unknown_feature_to_turn_off_is_named() {
    let bad = GOOD.replace(
        "work_dir = \"/run/ferry/work\"",
        "work_dir = \"/run/ferry/work\"\nfeatures_off = [\"pagemap_scan\", \"warp_drive\"]",
    );
    let (_dir, _path, out) = check(&bad);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("features_off[1]")
            && err.contains("warp_drive")
            && err.contains("uffd_wp_async"),
        "{err}"
    );
}

/// `ferryd --config` on GOOD with its work dir and control socket in a
/// temporary dir and `extra` top-level lines: its exit code and stderr,
/// and whether it made the socket or the work dir.
fn start_with(extra: &str) -> (Option<i32>, String, bool) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("control.sock");
    let work = dir.path().join("work");
    let config = GOOD.replace(
        "work_dir = \"/run/ferry/work\"",
        &format!(
            "work_dir = {:?}\ncontrol_socket = {:?}\n{extra}",
            work.display().to_string(),
            socket.display().to_string()
        ),
    );
    let path = dir.path().join("ferryd.toml");
    std::fs::write(&path, config).unwrap();
    let out = Command::new(FERRYD)
        .arg("--config")
        .arg(&path)
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    (
        out.status.code(),
        text(&out.stderr),
        socket.exists() || work.exists(),
    )
}

/// A host without what ferryd cannot do without (here BTF, turned off by
/// `features_off`) is refused at start, naming it, before anything is
/// touched: no control socket, no work dir.
#[test]
fn ferryd_refuses_to_start_without_a_required_feature() {
    let (code, err, touched) = start_with("features_off = [\"btf\"]");
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("[btf]") && err.contains("ferryd --check"),
        "{err}"
    );
    assert!(!touched, "ferryd touched the node");
}

/// The configured addresses must be on their interfaces: refused at
/// start, naming the section, the address and the interface, with what
/// the interface has (here: the test's host has no pub0).
#[test]
fn ferryd_refuses_to_start_without_its_addresses() {
    let (code, err, touched) = start_with("");
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("[public]") && err.contains("198.18.0.100") && err.contains("pub0"),
        "{err}"
    );
    assert!(!touched, "ferryd touched the node");
}

/// A network namespace, deleted on drop (also when the test fails).
struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(out.status.success(), "ip {args:?}: {}", text(&out.stderr));
}

/// An IPv6 public address the host does not carry is refused at start as
/// the IPv4 one is: in a namespace whose pub0 has the IPv4 shared address
/// and clu0 the cluster one, but no IPv6 address, `[public] address6` is
/// named with the interface and what it has. (That one on lo passes:
/// ferryd's own unit test, as ferryd would then start.)
#[test]
fn ferryd_refuses_to_start_without_its_ipv6_public_address() {
    let test = "ferryd_refuses_to_start_without_its_ipv6_public_address";
    let root = nix::unistd::geteuid().is_root();
    if ferry_testkit::skip(
        test,
        (!root).then(|| "needs root (a network namespace)".to_owned()),
    ) {
        return;
    }
    let ns = Netns(format!("fcc-{}", std::process::id()));
    ip(&["netns", "add", &ns.0]);
    for (dev, peer, addr) in [
        ("pub0", "pub1", "198.18.0.100/24"),
        ("clu0", "clu1", "198.19.0.1/24"),
    ] {
        ip(&[
            "-n", &ns.0, "link", "add", dev, "type", "veth", "peer", "name", peer,
        ]);
        ip(&["-n", &ns.0, "addr", "add", addr, "dev", dev]);
        ip(&["-n", &ns.0, "link", "set", dev, "up"]);
    }
    ip(&["-n", &ns.0, "link", "set", "lo", "up"]);
    let dir = tempfile::tempdir().unwrap();
    let config = GOOD
        .replace(
            "work_dir = \"/run/ferry/work\"",
            &format!(
                "work_dir = {:?}\ncontrol_socket = {:?}",
                dir.path().join("work").display().to_string(),
                dir.path().join("control.sock").display().to_string()
            ),
        )
        .replace(
            "address = \"198.18.0.100\"",
            "address = \"198.18.0.100\"\naddress6 = \"2001:2::100\"",
        );
    let path = dir.path().join("ferryd.toml");
    std::fs::write(&path, config).unwrap();
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.0, FERRYD, "--config"])
        .arg(&path)
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("[public] address6 2001:2::100 is not on interface pub0")
            && err.contains("198.18.0.100"),
        "{err}"
    );
}

/// `ferryd --check --config FILE` counts the file's `features_off` as
/// missing, as the agent does, and says where they come from.
#[test]
fn the_host_check_applies_the_configs_features_off() {
    let config = GOOD.replace(
        "work_dir = \"/run/ferry/work\"",
        "work_dir = \"/run/ferry/work\"\nfeatures_off = [\"bpf_iter_tcp\"]",
    );
    let (_dir, path, _) = check(&config);
    let out = Command::new(FERRYD)
        .arg("--check")
        .arg("--config")
        .arg(&path)
        .output()
        .unwrap();
    let table = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{table}{}", text(&out.stderr));
    assert!(
        table.contains("features_off in") && table.contains("bpf_iter_tcp"),
        "{table}"
    );
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("NO   ") && l.contains("[bpf_iter_tcp]")),
        "{table}"
    );
}
