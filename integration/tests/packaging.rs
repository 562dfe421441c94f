//! `cargo xtask dist`'s Debian package, the short version run with the
//! tests (the debug build, packaged as the release one is): what it holds,
//! what it depends on, and that what it installs runs: ferryd checks this
//! host and a config `ferry init` wrote, and the packaged CRIU (stripped
//! of its debug information) still carries every patch ferryd looks for.
//! Extracted into a directory, not installed: the test changes nothing on
//! the host. Root only (ferryd --check's privileges); run by `cargo xtask
//! test`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn run(c: &mut Command) -> Output {
    let out = c.output().expect("starting a command");
    assert!(
        out.status.success(),
        "{c:?}: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

/// `cargo xtask dist --debug --no-build --out DIR`: the package's path.
fn build_package(out: &Path) -> PathBuf {
    let root = ferry_integration::paths::workspace_root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = run(Command::new(cargo)
        .current_dir(&root)
        .args([
            "run",
            "-q",
            "-p",
            "xtask",
            "--",
            "dist",
            "--debug",
            "--no-build",
            "--out",
        ])
        .arg(out)
        .env("FERRY_CRIU_PREFIX", criu_prefix()));
    PathBuf::from(text(&built.stdout).trim())
}

/// The CRIU the harness uses, as its install prefix.
fn criu_prefix() -> PathBuf {
    ferry_integration::paths::criu_path()
        .parent()
        .and_then(Path::parent)
        .expect("CRIU at <prefix>/bin/criu")
        .to_owned()
}

#[test]
fn the_package_holds_ferry_and_its_criu_and_they_run() {
    let test = "the_package_holds_ferry_and_its_criu_and_they_run";
    if !ferry_integration::can_run(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let deb = build_package(&dir.path().join("dist"));
    assert!(
        deb.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("ferry_"),
        "{}",
        deb.display()
    );

    let field = |name: &str| {
        text(&run(Command::new("dpkg-deb").arg("-f").arg(&deb).arg(name)).stdout)
            .trim()
            .to_owned()
    };
    assert_eq!(field("Package"), "ferry");
    let depends = field("Depends");
    for needed in ["libprotobuf-c1", "libnl-3-200", "libc6", "iproute2"] {
        assert!(depends.contains(needed), "{depends}");
    }
    // Every dependency is a package this distribution has (installed here,
    // as CRIU's build needed them).
    for dep in depends.split(',') {
        let name = dep.split_whitespace().next().unwrap();
        let status = Command::new("dpkg-query")
            .args(["-W", "-f=${Status}", name])
            .output()
            .unwrap();
        assert!(
            text(&status.stdout).contains("install ok installed"),
            "{name}: {}",
            text(&status.stderr)
        );
    }

    let root = dir.path().join("root");
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root));
    for file in [
        "usr/bin/ferryd",
        "usr/bin/ferry",
        "usr/sbin/ferry-network",
        "opt/ferry/criu/bin/criu",
        "lib/systemd/system/ferryd.service",
        "lib/systemd/system/ferry-network.service",
        "usr/share/doc/ferry/deploy.md",
        "usr/share/doc/ferry/ferryd.toml.example",
        "usr/share/doc/ferry/copyright",
        "usr/share/doc/ferry/criu/SOURCE",
        "usr/share/doc/ferry/criu/patches/held-pages-left-out.patch",
    ] {
        assert!(root.join(file).is_file(), "{file} not in the package");
    }
    // The units start what the package installs.
    for unit in ["ferryd.service", "ferry-network.service"] {
        let text = std::fs::read_to_string(root.join("lib/systemd/system").join(unit)).unwrap();
        assert!(!text.contains("/usr/local/"), "{unit}:\n{text}");
        for exec in text.lines().filter(|l| l.starts_with("Exec")) {
            for program in exec
                .split(|c: char| c.is_whitespace() || c == '=' || c == '\'')
                .filter(|w| w.starts_with("/usr/"))
            {
                assert!(root.join(&program[1..]).is_file(), "{unit}: {exec}");
            }
        }
        if unit == "ferry-network.service" {
            assert!(text.contains("exec /usr/sbin/ferry-network"), "{text}");
        }
    }

    let criu = root.join("opt/ferry/criu/bin/criu");
    let missing: Vec<&str> = ferry_agent::criu::FERRY_PATCHES
        .iter()
        .filter(|(mark, _)| !ferry_agent::criu::has_patch(&criu, mark))
        .map(|(_, what)| *what)
        .collect();
    assert!(missing.is_empty(), "the packaged CRIU lacks: {missing:?}");

    let ferryd = root.join("usr/bin/ferryd");
    run(Command::new(&ferryd).arg("--check"));
    let config = root.join("etc/ferry/ferryd.toml");
    run(Command::new(root.join("usr/bin/ferry"))
        .args([
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
            "--no-tls",
            "--criu",
        ])
        .arg(&criu)
        .arg("--out")
        .arg(&config));
    let checked = run(Command::new(&ferryd)
        .arg("--check-config")
        .arg(&config)
        .env("RUST_LOG", "off"));
    assert!(
        text(&checked.stdout).contains("CRIU version"),
        "{}",
        text(&checked.stdout)
    );
}
