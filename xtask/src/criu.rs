//! CRIU >= 4.2 at /opt/ferry/criu/bin/criu, built from Debian's source
//! package.
//!
//! Why: Debian 12's criu 3.17 fails on current kernels (vDSO layout), and
//! 4.1 fails to dump TCP sockets (SO_PASSCRED on a TCP socket now returns
//! EOPNOTSUPP). sid carries 4.2.x. `apt-get source --download-only` fetches
//! the .dsc and the upstream tarball and then fails on the Debian patch
//! tarball (404 on the mirror); neither the patches nor the packaging are
//! needed to build the binary.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::cmd;

pub const PREFIX: &str = "/opt/ferry/criu";
const SOURCES_FILE: &str = "/etc/apt/sources.list.d/ferry-criu-src.sources";
const MIN: (u32, u32) = (4, 2);

pub fn binary() -> PathBuf {
    Path::new(PREFIX).join("bin/criu")
}

/// The installed CRIU's version, if it is there and new enough.
pub fn installed_ok() -> Option<String> {
    let out = cmd::output(Command::new(binary()).arg("--version")).ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Version:"))?
        .trim()
        .to_owned();
    (parse_version(&v)? >= MIN).then_some(v)
}

fn parse_version(v: &str) -> Option<(u32, u32)> {
    let mut it = v.split(['.', '-']);
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// Returns what it did, for the summary.
pub fn ensure() -> Result<String> {
    if let Some(v) = installed_ok() {
        return Ok(format!(
            "skipped: CRIU {v} already at {}",
            binary().display()
        ));
    }
    build_and_install()?;
    let v = installed_ok().context("the CRIU just installed does not report a version >= 4.2")?;
    let check = cmd::output(Command::new(binary()).arg("check"))?;
    let verdict = String::from_utf8_lossy(&check.stdout).trim().to_owned()
        + String::from_utf8_lossy(&check.stderr)
            .lines()
            .last()
            .unwrap_or("");
    if !check.status.success() {
        bail!("`criu check` failed: {verdict}");
    }
    Ok(format!(
        "built CRIU {v} into {} (criu check: {})",
        binary().display(),
        verdict.trim()
    ))
}

fn build_and_install() -> Result<()> {
    if !Path::new(SOURCES_FILE).exists() {
        std::fs::write(
            SOURCES_FILE,
            "# Added by ferry's `cargo xtask setup`: CRIU >= 4.2 is built from sid's source package.\n\
             Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: sid\nComponents: main\n\
             Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n",
        )
        .with_context(|| format!("writing {SOURCES_FILE}"))?;
    }
    cmd::run(Command::new("apt-get").args(["update", "-q"]))?;
    let tmp = TempDir::new("/tmp/ferry-criu-build")?;
    // Exits non-zero on the 404 for the .debian.tar.xz; judged by the files.
    let fetch = cmd::output(
        Command::new("apt-get")
            .args(["source", "--download-only", "criu"])
            .current_dir(&tmp.0),
    )?;
    let dsc = find(&tmp.0, |n| n.starts_with("criu_") && n.ends_with(".dsc"));
    let orig = find(&tmp.0, |n| {
        n.starts_with("criu_") && n.ends_with(".orig.tar.xz")
    });
    let (Some(dsc), Some(orig)) = (dsc, orig) else {
        bail!(
            "apt-get source criu did not fetch the .dsc and .orig.tar.xz:\n{}{}",
            String::from_utf8_lossy(&fetch.stdout),
            String::from_utf8_lossy(&fetch.stderr)
        );
    };
    let dsc_text = std::fs::read_to_string(&dsc)?;
    let version = dsc_text
        .lines()
        .find_map(|l| l.strip_prefix("Version:"))
        .map(|v| v.trim().to_owned())
        .context("the .dsc has no Version field")?;
    if parse_version(&version).is_none_or(|v| v < MIN) {
        bail!("Debian's source package has CRIU {version}; ferry needs >= 4.2");
    }
    let orig_name = orig.file_name().unwrap().to_string_lossy().into_owned();
    let expected = sha256_in_dsc(&dsc_text, &orig_name)
        .with_context(|| format!("{orig_name} is not listed in the .dsc's Checksums-Sha256"))?;
    let out = cmd::output(Command::new("sha256sum").arg(&orig))?;
    let actual = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_owned();
    if actual != expected {
        bail!("{orig_name}: SHA-256 {actual} does not match the .dsc's {expected}");
    }
    eprintln!("CRIU {version}: {orig_name} matches the .dsc (sha256 {actual})");
    cmd::run(Command::new("tar").arg("xf").arg(&orig).current_dir(&tmp.0))?;
    let src = std::fs::read_dir(&tmp.0)?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.is_dir()
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("criu-"))
        })
        .context("the tarball did not unpack into criu-*")?;
    let jobs = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    let log = tmp.0.join("build.log");
    let log_file = std::fs::File::create(&log)?;
    eprintln!(
        "+ make -j{jobs} criu   (in {}, log in {})",
        src.display(),
        log.display()
    );
    let status = Command::new("make")
        .arg(format!("-j{jobs}"))
        .arg("criu")
        .current_dir(&src)
        .stdout(log_file.try_clone()?)
        .stderr(log_file)
        .status()
        .context("starting make")?;
    if !status.success() {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!("building CRIU failed ({status}):\n{}", tail.join("\n"));
    }
    let bin_dir = Path::new(PREFIX).join("bin");
    std::fs::create_dir_all(&bin_dir)?;
    // Install under a temporary name and rename: an interrupted copy never
    // leaves a half-written binary at the final path.
    let staged = bin_dir.join(".criu.new");
    std::fs::copy(src.join("criu/criu"), &staged)?;
    std::fs::rename(&staged, binary())?;
    std::fs::write(
        Path::new(PREFIX).join("SOURCE"),
        format!("criu {version} built from Debian's source package\n{orig_name} sha256 {actual}\n"),
    )?;
    Ok(())
}

fn find(dir: &Path, pred: impl Fn(&str) -> bool) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| pred(&n.to_string_lossy())))
}

/// The SHA-256 of `file` in a .dsc's `Checksums-Sha256:` field (lines of
/// "<sha256> <size> <name>").
fn sha256_in_dsc(dsc: &str, file: &str) -> Option<String> {
    let mut in_field = false;
    for line in dsc.lines() {
        if line.starts_with("Checksums-Sha256:") {
            in_field = true;
            continue;
        }
        if in_field {
            if !line.starts_with(' ') {
                break;
            }
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() == 3 && f[2] == file {
                return Some(f[0].to_owned());
            }
        }
    }
    None
}

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(base: &str) -> Result<Self> {
        let p = PathBuf::from(format!("{base}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p)?;
        Ok(Self(p))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_checksums_and_versions() {
        let dsc = "Format: 3.0 (quilt)\nVersion: 4.2.1-1\nChecksums-Sha256:\n 29ec abc 1038700 criu_4.2.1.orig.tar.xz\n 29ec0e 1038700 criu_4.2.1.orig.tar.xz\n e9f7 12964 criu_4.2.1-1.debian.tar.xz\nFiles:\n x\n";
        assert_eq!(
            sha256_in_dsc(dsc, "criu_4.2.1.orig.tar.xz").as_deref(),
            Some("29ec0e")
        );
        assert_eq!(sha256_in_dsc(dsc, "nope"), None);
        assert_eq!(parse_version("4.2.1-1"), Some((4, 2)));
        assert!(parse_version("3.17").unwrap() < MIN);
    }
}
