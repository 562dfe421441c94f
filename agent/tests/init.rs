//! `ferry cert` then `ferry init`, as docs/deploy.md has an operator set a
//! node up: the file `ferry init` writes passes `ferryd --check-config`,
//! and what it cannot write (missing certificates, an existing file, a bad
//! peer) is refused, naming why. Needs no root: nothing starts.

use std::path::Path;
use std::process::{Command, Output};

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");
const FERRYD: &str = env!("CARGO_BIN_EXE_ferryd");

fn ferry(args: &[&str]) -> Output {
    Command::new(FERRY).args(args).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(out: &Output) {
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// `ferry init`'s arguments for node1 of a two-node cluster, writing to
/// `out`.
fn init_args<'a>(tls: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "init",
        "--node",
        "node1",
        "--public-interface",
        "eth0",
        "--public-address",
        "198.18.0.100",
        "--cluster-interface",
        "eth1",
        "--cluster-address",
        "198.19.0.1",
        "--peer",
        "node2=198.19.0.2",
        "--tls-dir",
        tls,
        "--out",
        out,
    ]
}

#[test]
fn init_writes_a_config_ferryd_accepts() {
    let no_criu = (!Path::new(ferry_agent::config::DEFAULT_CRIU_PATH).exists()).then(|| {
        "no CRIU at the default path (`cargo xtask setup`), which --check-config runs".to_owned()
    });
    if ferry_testkit::skip("init_writes_a_config_ferryd_accepts", no_criu) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    let tls = dir.path().join("tls");
    let (ca_s, tls_s) = (ca.to_str().unwrap(), tls.to_str().unwrap());
    let out = dir.path().join("etc/ferryd.toml");
    let out_s = out.to_str().unwrap();

    // Before the certificates: refused, naming the missing file.
    let refused = ferry(&init_args(tls_s, out_s));
    assert!(!refused.status.success());
    let err = text(&refused.stderr);
    assert!(
        err.contains("ca.crt") && err.contains("ferry cert ca"),
        "{err}"
    );
    assert!(!out.exists());

    ok(&ferry(&["cert", "ca", "--out", ca_s]));
    ok(&ferry(&[
        "cert",
        "node",
        "--name",
        "node1",
        "--ip",
        "198.19.0.1",
        "--ca",
        ca_s,
        "--out",
        tls_s,
    ]));
    for f in ["ca.crt", "membership.key"] {
        std::fs::copy(ca.join(f), tls.join(f)).unwrap();
    }
    ok(&ferry(&init_args(tls_s, out_s)));
    let written = std::fs::read_to_string(&out).unwrap();
    assert!(
        written.contains("node1.crt") && written.contains("node2"),
        "{written}"
    );

    let check = Command::new(FERRYD)
        .arg("--check-config")
        .arg(&out)
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}{}",
        text(&check.stdout),
        text(&check.stderr)
    );

    // An existing file stays unless --force.
    let again = ferry(&init_args(tls_s, out_s));
    assert!(!again.status.success());
    assert!(
        text(&again.stderr).contains("--force"),
        "{}",
        text(&again.stderr)
    );
    let mut forced = init_args(tls_s, out_s);
    forced.push("--force");
    ok(&ferry(&forced));

    // A dual-stack public side: the IPv6 address as address6, and what
    // ferryd reads back.
    let mut dual = init_args(tls_s, out_s);
    dual.extend(["--force", "--public-address6", "2001:db8:1::10"]);
    ok(&ferry(&dual));
    let written = std::fs::read_to_string(&out).unwrap();
    assert!(
        written.contains("address6 = \"2001:db8:1::10\""),
        "{written}"
    );
    let check = Command::new(FERRYD)
        .arg("--check-config")
        .arg(&out)
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", text(&check.stderr));
    assert!(
        text(&check.stdout).contains("2001:db8:1::10"),
        "{}",
        text(&check.stdout)
    );
}

#[test]
fn init_refuses_a_bad_peer_naming_it() {
    for (peer, says) in [
        ("node2", "NAME=ADDRESS"),
        ("node2=nowhere", "nowhere"),
        ("node1=198.19.0.1", "this node"),
    ] {
        let mut args = init_args("/nonexistent", "-");
        let i = args.iter().position(|a| *a == "--peer").unwrap();
        args[i + 1] = peer;
        let i = args.iter().position(|a| *a == "--tls-dir").unwrap();
        args.splice(i..i + 2, ["--no-tls"]);
        let out = ferry(&args);
        assert!(!out.status.success(), "{peer}");
        let err = text(&out.stderr);
        assert!(
            err.contains("--peer") && err.contains(says),
            "{peer}: {err}"
        );
    }
}
