//! `cargo xtask dist`: ferry as a Debian package, for hosts set up by
//! `docs/deploy.md` without a Rust toolchain or a CRIU build of their own.
//!
//! `ferry_<version>_<arch>.deb` holds `ferryd` and `ferry` (release build;
//! the eBPF programs are inside `ferryd`), the CRIU that `cargo xtask
//! setup` built with ferry's patches (`/opt/ferry/criu`, where ferryd
//! looks by default; its patches and source reference under
//! `/usr/share/doc/ferry` for CRIU's GPL), `ferry-network`, the systemd
//! units with the package's paths, and the docs an operator needs.
//! Dependencies come from `dpkg-shlibdeps` over the three binaries, plus
//! the tools ferryd and ferry-network run (iproute2, util-linux).
//! Nothing is enabled or started: a node needs its configuration first
//! (`ferry init`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{cmd, criu, test};

#[derive(Debug, clap::Args)]
pub struct DistArgs {
    /// Package the debug build (a quick check of the packaging; not a
    /// package to ship).
    #[arg(long)]
    debug: bool,
    /// Where the .deb goes (default: target/dist).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Package the binaries already built instead of building them.
    #[arg(long)]
    no_build: bool,
}

/// Builds the package; prints its path.
pub fn run(criu_prefix: &Path, args: &DistArgs) -> Result<()> {
    let Some(version) = criu::installed_ok(criu_prefix) else {
        bail!(
            "no CRIU with ferry's patches at {} (`cargo xtask setup` builds it)",
            criu_prefix.display()
        );
    };
    if !args.no_build {
        let mut build = vec![
            "build",
            "-p",
            "ferry-agent",
            "--bin",
            "ferryd",
            "--bin",
            "ferry",
        ];
        if !args.debug {
            build.push("--release");
        }
        test::header(&format!("build: cargo {}", build.join(" ")));
        cmd::run(cmd::cargo().args(&build)).context("building ferryd and ferry")?;
    }
    let bins = if args.debug {
        cmd::debug_dir()
    } else {
        cmd::release_dir()
    };
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| cmd::workspace_root().join("target").join("dist"));
    let deb = package(&bins, criu_prefix, &out)?;
    eprintln!(
        "{} ({} profile, CRIU {version})",
        deb.display(),
        if args.debug { "debug" } else { "release" }
    );
    println!("{}", deb.display());
    Ok(())
}

/// Who builds the package: Debian's `DEBFULLNAME` and `DEBEMAIL`, as
/// dch(1) takes them, else a local placeholder.
fn maintainer() -> String {
    match (std::env::var("DEBFULLNAME"), std::env::var("DEBEMAIL")) {
        (Ok(name), Ok(email)) => format!("{name} <{email}>"),
        _ => "ferry packager <root@localhost>".to_owned(),
    }
}

/// The package's version: the workspace's.
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// Stages the package's tree from `bins` and `criu_prefix` and builds the
/// .deb into `out`.
pub fn package(bins: &Path, criu_prefix: &Path, out: &Path) -> Result<PathBuf> {
    let root = cmd::workspace_root();
    let arch = text(Command::new("dpkg").arg("--print-architecture"))?;
    let name = format!("ferry_{}_{arch}", version());
    let stage = out.join(&name);
    if stage.exists() {
        std::fs::remove_dir_all(&stage).with_context(|| format!("removing {}", stage.display()))?;
    }
    let doc = stage.join("usr/share/doc/ferry");
    let put = |from: &Path, to: &str, mode: u32| -> Result<()> {
        let dest = stage.join(to);
        std::fs::create_dir_all(dest.parent().expect("a path inside the stage"))?;
        std::fs::copy(from, &dest)
            .with_context(|| format!("copying {} to {}", from.display(), dest.display()))?;
        set_mode(&dest, mode)
    };
    put(&bins.join("ferryd"), "usr/bin/ferryd", 0o755)?;
    put(&bins.join("ferry"), "usr/bin/ferry", 0o755)?;
    put(&criu::binary(criu_prefix), "opt/ferry/criu/bin/criu", 0o755)?;
    put(
        &root.join("packaging/ferry-network"),
        "usr/sbin/ferry-network",
        0o755,
    )?;
    // The units name the package's paths, not a hand install's.
    for unit in ["ferryd.service", "ferry-network.service"] {
        let text = std::fs::read_to_string(root.join("packaging").join(unit))?
            .replace("/usr/local/bin/", "/usr/bin/")
            .replace("/usr/local/sbin/", "/usr/sbin/");
        write(&stage.join("lib/systemd/system").join(unit), &text, 0o644)?;
    }
    for (from, to) in [
        ("README.md", "README.md"),
        ("docs/deploy.md", "deploy.md"),
        ("docs/api.md", "api.md"),
        ("packaging/ferryd.toml.example", "ferryd.toml.example"),
    ] {
        put(
            &root.join(from),
            &format!("usr/share/doc/ferry/{to}"),
            0o644,
        )?;
    }
    // CRIU is GPL-2.0: what it was built from, and ferry's changes to it.
    put(
        &criu_prefix.join("SOURCE"),
        "usr/share/doc/ferry/criu/SOURCE",
        0o644,
    )?;
    for p in std::fs::read_dir(root.join("xtask/criu"))? {
        let p = p?.path();
        if p.extension().is_some_and(|e| e == "patch") {
            let file = p.file_name().expect("a file").to_string_lossy();
            put(
                &p,
                &format!("usr/share/doc/ferry/criu/patches/{file}"),
                0o644,
            )?;
        }
    }
    // The release profile keeps debug information (for profiling); the
    // package does not ship it (~250 MB of the binaries' ~260).
    for bin in ["usr/bin/ferryd", "usr/bin/ferry", "opt/ferry/criu/bin/criu"] {
        cmd::run(
            Command::new("strip")
                .arg("--strip-debug")
                .arg(stage.join(bin)),
        )?;
    }
    write(&doc.join("copyright"), COPYRIGHT, 0o644)?;
    let depends = depends(&stage)?;
    let size_kib = du_kib(&stage)?;
    write(
        &stage.join("DEBIAN/control"),
        &format!(
            "Package: ferry\n\
             Version: {}\n\
             Architecture: {arch}\n\
             Maintainer: {}\n\
             Installed-Size: {size_kib}\n\
             Depends: {depends}\n\
             Section: admin\n\
             Priority: optional\n\
             Description: live migration of Linux server processes with their connections\n \
             ferryd moves running processes, with every TCP and UDP connection, between\n \
             the nodes of a single-IP cluster with a freeze of tens of milliseconds, and\n \
             balances the cluster's load with it. Includes CRIU built with ferry's patches\n \
             in /opt/ferry/criu. Set a node up with /usr/share/doc/ferry/deploy.md.\n",
            version(),
            maintainer()
        ),
        0o644,
    )?;
    write(&stage.join("DEBIAN/postinst"), POSTINST, 0o755)?;
    write(&stage.join("DEBIAN/postrm"), POSTRM, 0o755)?;
    std::fs::create_dir_all(out)?;
    let deb = out.join(format!("{name}.deb"));
    // Its message to stderr: stdout is the package's path alone.
    let said = text(
        Command::new("dpkg-deb")
            .args(["--root-owner-group", "--build"])
            .arg(&stage)
            .arg(&deb),
    )?;
    eprintln!("{said}");
    std::fs::remove_dir_all(&stage).with_context(|| format!("removing {}", stage.display()))?;
    Ok(deb)
}

const COPYRIGHT: &str = "\
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: ferry

Files: *
License: Apache-2.0
 On Debian systems the full text is in /usr/share/common-licenses/Apache-2.0.

Files: opt/ferry/criu/*
Copyright: CRIU developers
License: GPL-2.0
 CRIU (https://criu.org), built from Debian's source package with the patches in
 /usr/share/doc/ferry/criu/patches (see /usr/share/doc/ferry/criu/SOURCE).
 On Debian systems the full text is in /usr/share/common-licenses/GPL-2.
";

const POSTINST: &str = "#!/bin/sh
set -e
if [ \"$1\" = configure ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload || true
fi
if [ \"$1\" = configure ] && [ ! -e /etc/ferry/ferryd.toml ]; then
    echo 'ferry: write /etc/ferry/ferryd.toml with `ferry init` (/usr/share/doc/ferry/deploy.md), then: systemctl enable --now ferryd'
fi
exit 0
";

const POSTRM: &str = "#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload || true
fi
exit 0
";

/// The packages the staged binaries need (`dpkg-shlibdeps`), and the tools
/// ferryd and ferry-network run.
fn depends(stage: &Path) -> Result<String> {
    // dpkg-shlibdeps wants a source package's debian/control around it.
    let work = stage.with_extension("shlibdeps");
    std::fs::create_dir_all(work.join("debian"))?;
    std::fs::write(
        work.join("debian/control"),
        "Source: ferry\n\nPackage: ferry\nArchitecture: any\n",
    )?;
    let mut c = Command::new("dpkg-shlibdeps");
    c.current_dir(&work).arg("-O");
    for bin in ["usr/bin/ferryd", "usr/bin/ferry", "opt/ferry/criu/bin/criu"] {
        c.arg(format!("-e{}", stage.join(bin).display()));
    }
    let found = text(&mut c);
    std::fs::remove_dir_all(&work)?;
    let found = found?;
    let shlibs = found
        .lines()
        .find_map(|l| l.strip_prefix("shlibs:Depends="))
        .with_context(|| format!("dpkg-shlibdeps said no dependencies: {found}"))?;
    Ok(format!("{shlibs}, iproute2, util-linux"))
}

/// The staged tree's size in KiB, for Installed-Size.
fn du_kib(dir: &Path) -> Result<u64> {
    let out = text(Command::new("du").arg("-sk").arg(dir))?;
    out.split_whitespace()
        .next()
        .and_then(|k| k.parse().ok())
        .with_context(|| format!("du said {out:?}"))
}

/// A command's standard output, trimmed; an error if it failed.
fn text(c: &mut Command) -> Result<String> {
    let what = cmd::describe(c);
    let out = cmd::output(c)?;
    if !out.status.success() {
        bail!(
            "`{what}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn write(path: &Path, text: &str, mode: u32) -> Result<()> {
    std::fs::create_dir_all(path.parent().expect("a file in a directory"))?;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    set_mode(path, mode)
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {}", path.display()))
}
