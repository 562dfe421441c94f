//! `cargo xtask dist`'s Debian package, the short version run with the
//! tests (the debug build, packaged as the release one is): what it holds
//! and depends on; then installed with dpkg on this host (CI runs as
//! root, on a fresh machine), a two-node cluster runs the installed ferryd
//! with the installed CRIU, started by the unit's own commands, and the
//! installed `ferry` starts a server and migrates it with its connections;
//! then the package is purged, and the CRIU `cargo xtask setup` put where
//! the package installs its own is put back (also on failure). Root only;
//! run by `cargo xtask test`.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::workload::SeqClient;

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

/// What the package holds and depends on, and that what it holds runs,
/// extracted into a directory.
fn the_package_holds_ferry_and_its_criu_and_they_run(deb: &Path) {
    let dir = tempfile::tempdir().unwrap();
    assert!(
        deb.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("ferry_"),
        "{}",
        deb.display()
    );

    let field = |name: &str| {
        text(&run(Command::new("dpkg-deb").arg("-f").arg(deb).arg(name)).stdout)
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
    run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(&root));
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

/// Where the package puts its CRIU (ferryd's default).
const PACKAGED_CRIU: &str = "/opt/ferry/criu/bin/criu";

/// The package installed on this host until dropped: then purged, and the
/// CRIU it replaced put back.
struct Installed {
    /// A copy of the CRIU at [`PACKAGED_CRIU`] before the install, if
    /// there was one (the one `cargo xtask setup` built).
    criu_before: Option<(tempfile::TempDir, PathBuf)>,
}

impl Installed {
    fn install(deb: &Path) -> Self {
        let criu_before = Path::new(PACKAGED_CRIU).is_file().then(|| {
            let dir = tempfile::tempdir().expect("a dir for the CRIU copy");
            let copy = dir.path().join("criu");
            std::fs::copy(PACKAGED_CRIU, &copy).expect("copying CRIU aside");
            (dir, copy)
        });
        let installed = Self { criu_before };
        run(Command::new("dpkg").arg("-i").arg(deb));
        installed
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        let purged = Command::new("dpkg").args(["--purge", "ferry"]).output();
        if let Ok(out) = &purged
            && !out.status.success()
        {
            eprintln!("dpkg --purge ferry: {}", text(&out.stderr));
        }
        if let Some((_dir, copy)) = &self.criu_before {
            let _ = std::fs::create_dir_all(Path::new(PACKAGED_CRIU).parent().unwrap());
            if let Err(e) = std::fs::copy(copy, PACKAGED_CRIU) {
                eprintln!("putting CRIU back at {PACKAGED_CRIU}: {e}");
            }
        }
    }
}

/// The installed unit's `KEY=` command line, words split.
fn unit_command(unit: &str, key: &str) -> Vec<String> {
    let text = std::fs::read_to_string(format!("/lib/systemd/system/{unit}")).expect("the unit");
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in {unit}"));
    line.split_whitespace().map(str::to_owned).collect()
}

/// The package built once, checked, then installed.
#[test]
fn the_package_runs_extracted_and_installed_and_purges_cleanly() {
    let test = "the_package_runs_extracted_and_installed_and_purges_cleanly";
    if !ferry_integration::can_run(test) {
        return;
    }
    let status = Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", "ferry"])
        .output()
        .unwrap();
    let already = text(&status.stdout).contains("installed");
    if ferry_testkit::skip(
        test,
        already.then(|| {
            "a ferry package is installed on this host, which the test would replace and purge"
                .to_owned()
        }),
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let deb = build_package(&dir.path().join("dist"));
    the_package_holds_ferry_and_its_criu_and_they_run(&deb);
    let installed = Installed::install(&deb);
    let listed = text(&run(Command::new("dpkg").args(["-L", "ferry"])).stdout);
    for file in [
        "/usr/bin/ferryd",
        "/usr/bin/ferry",
        "/usr/sbin/ferry-network",
        PACKAGED_CRIU,
        "/lib/systemd/system/ferryd.service",
        "/usr/share/doc/ferry/ferryd.toml.example",
    ] {
        assert!(
            listed.lines().any(|l| l == file),
            "{file} not installed:\n{listed}"
        );
    }
    run(Command::new("/usr/bin/ferryd").arg("--check"));

    // The unit's commands, its config path swapped for each node's.
    let pre = unit_command("ferryd.service", "ExecStartPre");
    let start = unit_command("ferryd.service", "ExecStart");
    assert_eq!(
        start,
        ["/usr/bin/ferryd", "--config", "/etc/ferry/ferryd.toml"],
        "the harness starts `FERRYD --config FILE`"
    );
    let mut spec = ClusterSpec::new(2, 1).without_agents();
    spec.ferryd = Some(PathBuf::from(&start[0]));
    spec.criu_path = Some(PathBuf::from(PACKAGED_CRIU));
    let mut cluster = Cluster::start(spec).expect("cluster");
    for node in ["node1", "node2"] {
        let config = cluster.config_path(node).display().to_string();
        let args: Vec<String> = pre[1..]
            .iter()
            .map(|a| a.replace("/etc/ferry/ferryd.toml", &config))
            .collect();
        run(Command::new(&pre[0]).args(&args).env("RUST_LOG", "off"));
        cluster.start_agent(node).expect("the installed ferryd");
    }

    let installed_ferry = |node: &str, args: &[&str]| -> serde_json::Value {
        let out = run(Command::new("/usr/bin/ferry")
            .arg("--json")
            .args(args)
            .env("FERRY_SOCKET", cluster.control_socket(node)));
        serde_json::from_slice(&out.stdout).expect("JSON")
    };
    let port = 7051;
    let started = installed_ferry(
        "node1",
        &[
            "run",
            "--",
            env!("CARGO_BIN_EXE_ferry-echo-server"),
            "--port",
            &port.to_string(),
        ],
    );
    let pid = started["pid"].as_i64().expect("a pid");
    cluster
        .wait_listening("node1", port, Duration::from_secs(10))
        .expect("the server listens");
    let connections = 8;
    let client = SeqClient::dve(
        cluster.netns_path("client1"),
        SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 100), port),
        connections,
    )
    .expect("clients");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while cluster.established_tcp("node1", port).len() < connections {
        assert!(
            std::time::Instant::now() < deadline,
            "clients not connected"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = client.verified_per_connection();
    let report = installed_ferry("node1", &["migrate", &pid.to_string(), "--to", "node2"]);
    assert_eq!(report["outcome"], "committed", "{report}");
    let moved = report["destination_pid"].as_i64().expect("the new pid") as i32;
    assert!(cluster.pids_in("node2").contains(&moved));
    assert_eq!(cluster.established_tcp("node2", port).len(), connections);
    client
        .wait_until_each_passes(&before, 10, Duration::from_secs(20))
        .expect("every connection exchanges messages on node2");
    let seq = client.stop();
    seq.assert_clean();
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(moved),
        nix::sys::signal::Signal::SIGKILL,
    );
    drop(cluster);

    drop(installed);
    let status = Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", "ferry"])
        .output()
        .unwrap();
    assert!(
        !text(&status.stdout).contains("ok installed"),
        "{}",
        text(&status.stdout)
    );
    for gone in [
        "/usr/bin/ferryd",
        "/usr/bin/ferry",
        "/lib/systemd/system/ferryd.service",
    ] {
        assert!(!Path::new(gone).exists(), "{gone} left after the purge");
    }
}
