//! CRIU >= 4.2 at <prefix>/bin/criu (default /opt/ferry/criu, the agent's
//! default `criu_path`), built from Debian's source package.
//!
//! Why: Debian 12's criu 3.17 fails on current kernels (vDSO layout), and
//! 4.1 fails to dump TCP sockets (SO_PASSCRED on a TCP socket now returns
//! EOPNOTSUPP). sid carries 4.2.x. `apt-get source --download-only` fetches
//! the .dsc and the upstream tarball and then fails on the Debian patch
//! tarball (404 on the mirror); neither the patches nor the packaging are
//! needed to build the binary, and the .dsc's checksum still pins the
//! tarball we build.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::cmd;
use crate::setup::Step;

pub const DEFAULT_PREFIX: &str = "/opt/ferry/criu";
const SOURCES_FILE: &str = "/etc/apt/sources.list.d/ferry-criu-src.sources";
const SOURCES: &str = "# Written by ferry's `cargo xtask setup`: CRIU >= 4.2 is built from sid's source package.\n\
Types: deb-src\n\
URIs: http://deb.debian.org/debian\n\
Suites: sid\n\
Components: main\n\
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n";
const MIN: (u32, u32) = (4, 2);
/// CRIU's RUNDIR, where it caches its kernel probes (`criu.kdat`), and only
/// on a tmpfs: `/run` is not one on every machine, `/dev/shm` is. Must match
/// the agent's default `criu_cache_dir` (`agent/src/criu/cache.rs`, which
/// says why the cache matters: ~85 ms of every restore's freeze).
pub const RUNDIR: &str = "/dev/shm/ferry-criu";

pub fn binary(prefix: &Path) -> PathBuf {
    prefix.join("bin/criu")
}

/// The version `criu --version` reports, if the binary runs at all.
fn installed_version(prefix: &Path) -> Option<String> {
    let out = cmd::output(Command::new(binary(prefix)).arg("--version")).ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Version:"))
        .map(|v| v.trim().to_owned())
}

/// The installed CRIU's version, if it is there, new enough, built with
/// ferry's RUNDIR and with ferry's patch.
pub fn installed_ok(prefix: &Path) -> Option<String> {
    installed_version(prefix)
        .filter(|v| new_enough(v) && built_with_rundir(prefix) && built_with_patch(prefix))
}

/// ferry's patches to CRIU: what each is for, its text, and a string it
/// puts in the binary (a log message), by which a build is known to have it.
struct Patch {
    what: &'static str,
    text: &'static str,
    mark: &'static str,
}

const PATCHES: &[Patch] = &[
    // A TCP connection that ferryd restored itself (collective socket
    // migration, `agent/src/sockstate`) is handed to the restore as
    // `--inherit-fd "socket:[<ino>]"`; CRIU then restores only its file and
    // socket options. Upstream CRIU takes inherited descriptors for pipes,
    // files, Unix sockets and ttys, not for TCP connections.
    Patch {
        what: "inherited TCP connections",
        text: include_str!("../criu/inherit-tcp-connections.patch"),
        mark: "ferry-inherited-tcp",
    },
    // A failed dump lets the frozen tasks run again: CRIU tells ferryd
    // first (network-unlock), which holds their TCP connections in repair
    // mode from the query-ext-files notification on and must turn repair
    // off before they run (`agent/src/engine/sockettaker.rs`).
    Patch {
        what: "failed dump notified before the tasks run",
        text: include_str!("../criu/notify-dump-rollback.patch"),
        mark: "ferry-dump-rollback",
    },
    // A socket's flags are read with F_GETFL instead of parsing its
    // /proc/PID/fdinfo file, inside the freeze (~20 ms at 1024 sockets,
    // measured A/B in commit 271331c).
    Patch {
        what: "socket flags without fdinfo",
        text: include_str!("../criu/socket-flags-without-fdinfo.patch"),
        mark: "ferry-socket-fdinfo",
    },
    // The last message of a page-server session (post-copy's lazy pages)
    // leaves at once instead of at the kernel's 200 ms cork limit.
    Patch {
        what: "page-server close pushed out",
        text: include_str!("../criu/flush-page-server-close.patch"),
        mark: "ferry-flushed-close",
    },
    // Connections handed over as `ferry-tcp:[<ino>]` stay in CRIU's
    // process and the restored task takes each by pidfd_getfd(), instead
    // of through CRIU's fdstore, whose lookups are quadratic (~6 ms of the
    // restore at 1024 connections, measured A/B in commit fecccdc). Its
    // pidfd is closed before the tasks resume since mark "2" (the first
    // version leaked it into the restored process).
    Patch {
        what: "inherited connections taken by pidfd",
        text: include_str!("../criu/inherited-connections-by-pidfd.patch"),
        mark: "ferry-tcp-by-pidfd2",
    },
    // A dump asked to (`ferry:tcp-opts-by-caller`) records established
    // connections without their socket options, which ferryd carries; the
    // restore skips them.
    Patch {
        what: "connection options carried by ferryd",
        text: include_str!("../criu/tcp-options-by-caller.patch"),
        mark: "ferry-opts-by-caller",
    },
    // The connections are handed over as one table (`ferry-tcp-table`, a
    // memfd naming ferryd and each connection's descriptor there) instead
    // of one inherited descriptor each; the restored task takes them from
    // ferryd by pidfd_getfd().
    Patch {
        what: "handed-over connections as one table",
        text: include_str!("../criu/connections-table.patch"),
        mark: "ferry-tcp-table1",
    },
    // A dump asked to (`ferry:conns-out`) keeps the connections ferryd
    // moves out of CRIU altogether: each is recorded by descriptor number,
    // inode and flags (a new parasite command; no connection leaves the
    // task), and the restore installs them from ferryd's table at those
    // numbers before any other descriptor.
    Patch {
        what: "connections kept out of the images",
        text: include_str!("../criu/connections-out-of-images.patch"),
        mark: "ferry-conns-out2",
    },
    // The root task's cgroups are read by CRIU itself when the tree shares
    // CRIU's cgroup namespace, instead of by the parasite (a round trip and
    // a procfs mount in the stopped task per thread, in the freeze).
    Patch {
        what: "cgroups read without the parasite",
        text: include_str!("../criu/cgroup-without-parasite.patch"),
        mark: "ferry-cgroup-by-criu",
    },
    // A time namespace's clocks are read from its offsets by CRIU itself,
    // instead of by a child forked into the namespace (a fork and a wait
    // in the freeze, at every migration after the first).
    Patch {
        what: "time namespace dumped from its offsets",
        text: include_str!("../criu/timens-from-offsets.patch"),
        mark: "ferry-timens-offsets",
    },
    // A service worker reads the kernel's features before its request
    // comes (a fork, a ptrace attach and CPUID's VM exits, out of the
    // freeze for the workers ferryd starts ahead).
    Patch {
        what: "kernel features read before the request",
        text: include_str!("../criu/kerndat-before-request.patch"),
        mark: "ferry-kdat-ahead",
    },
    // The pid namespace's procfs is fetched through the root task's
    // parasite only for zombies or a mount namespace (a round trip and a
    // procfs mounted in a directory made in the task's working directory,
    // in the freeze; a dump that fails where that directory is read-only).
    Patch {
        what: "pid namespace's procfs only when needed",
        text: include_str!("../criu/pidns-proc-when-needed.patch"),
        mark: "ferry-no-pidns-proc",
    },
    // The connections kept out of the images land on their descriptor
    // numbers straight from pidfd_getfd(), in ascending order, the free
    // numbers below each filled first, instead of a check, a dup3() and
    // a close() each (in the single-threaded restore).
    Patch {
        what: "kept-out connections installed in place",
        text: include_str!("../criu/connections-in-place.patch"),
        mark: "ferry-conns-in-place3",
    },
    // When the connections stay out of the images, the dump collects only
    // listening TCP sockets with sock_diag, and the task reports each TCP
    // socket's state: a dump of any other state walks every connection of
    // the machine (other processes' too) inside the freeze.
    Patch {
        what: "only listening sockets collected",
        text: include_str!("../criu/connections-not-collected.patch"),
        mark: "ferry-conns-uncollected",
    },
    // After pre-copy the dump leaves out the pages the destination holds
    // and the task did not write since (ferryd lists them; PAGEMAP_SCAN
    // tells written ones): the freeze does not read, write or send them.
    Patch {
        what: "pre-copied pages left out of the dump",
        text: include_str!("../criu/held-pages-left-out.patch"),
        mark: "ferry-held-pages",
    },
    // ... and scans those pages by their write-protect bits alone, the
    // kernel's fast path, not each page's struct page (~17 ms a GiB).
    Patch {
        what: "held pages scanned by write-protect bits alone",
        text: include_str!("../criu/held-pages-fast-scan.patch"),
        mark: "ferry-held-scan",
    },
    // The mappings' flags from ferryd's BPF iterators and maps, not smaps,
    // whose page counts walk every resident page in the freeze.
    Patch {
        what: "mappings' flags without smaps",
        text: include_str!("../criu/vma-flags-without-smaps.patch"),
        mark: "ferry-vma-flags",
    },
    // No struct page reads in the scan of private anonymous memory (a
    // post-copy dump scans all of it in the freeze).
    Patch {
        what: "anonymous memory scanned without struct page reads",
        text: include_str!("../criu/anonymous-scan-without-struct-pages.patch"),
        mark: "ferry-anon-scan",
    },
    // The lazy-pages daemon waits for answers and faults instead of
    // spinning a core through the post-copy fill.
    Patch {
        what: "lazy-pages daemon without spinning",
        text: include_str!("../criu/lazy-pages-wait-for-answers.patch"),
        mark: "ferry-lazy-waits",
    },
    // A held-pages file may hold every page, written or not: post-copy's
    // pages stay in the stopped task for ferryd to send after the resume,
    // instead of being spliced into pipes inside the freeze.
    Patch {
        what: "post-copy's pages left in the stopped task",
        text: include_str!("../criu/held-pages-written-or-not.patch"),
        mark: "ferry-held-all",
    },
    // The walk of the whole address space for guard markers leaves the
    // held ranges to the page dump's scan of them, which finds every
    // marker there (~3 ms for 4 GiB in the freeze).
    Patch {
        what: "guard markers of held ranges found by the held pages' scan",
        text: include_str!("../criu/held-pages-guards.patch"),
        mark: "ferry-held-guards2",
    },
    // The held pages' scan by write-protect bits (~4.4 ms for 4 GiB) and
    // the full scans of the written runs run on a thread from the seizing
    // on, beside the rest of the dump, instead of at its end.
    Patch {
        what: "held pages scanned from the seizing on",
        text: include_str!("../criu/held-pages-prescan.patch"),
        mark: "ferry-held-prescan2",
    },
    // Held pages are left out of every private area, not only of those a
    // lazy restore fills: the destination gives the restore a parent
    // image of the others, from its store (a slow link's freeze carried
    // ~20 pages of a small process's file mappings in every migration).
    Patch {
        what: "held pages left out of every private area",
        text: include_str!("../criu/held-pages-everywhere.patch"),
        mark: "ferry-held-everywhere",
    },
    // A task of another user (a server's workers after they drop root)
    // has its resource limits read from /proc/<pid>/limits when prlimit()
    // is refused: reading another user's limits by prlimit needs
    // CAP_SYS_RESOURCE, which root in a container, or an agent run without
    // it, lacks.
    Patch {
        what: "limits of another user's tasks read from procfs",
        text: include_str!("../criu/rlimits-from-procfs.patch"),
        mark: "ferry-rlimits-procfs",
    },
];

/// The patches a build at `prefix` lacks.
fn missing_patches(prefix: &Path) -> Vec<&'static str> {
    let bin = std::fs::read(binary(prefix)).unwrap_or_default();
    PATCHES
        .iter()
        .filter(|p| !contains(&bin, p.mark.as_bytes()))
        .map(|p| p.what)
        .collect()
}

fn built_with_patch(prefix: &Path) -> bool {
    missing_patches(prefix).is_empty()
}

/// Applies every patch to the unpacked source tree.
fn apply_patches(src: &Path) -> Result<()> {
    for patch in PATCHES {
        apply_patch(src, patch)?;
    }
    Ok(())
}

fn apply_patch(src: &Path, patch: &Patch) -> Result<()> {
    let mut child = Command::new("patch")
        .args(["-p1", "--forward", "--batch"])
        .current_dir(src)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("starting patch (Debian package `patch`)")?;
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().context("patch's stdin")?;
        stdin.write_all(patch.text.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "ferry's CRIU patch ({}) does not apply to {} ({}):\n{}{}",
            patch.what,
            src.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    eprintln!("applied ferry's CRIU patch ({})", patch.what);
    Ok(())
}

/// Whether the binary was built with [`RUNDIR`]: the cache path is a string
/// constant in it. An older ferry build (RUNDIR /run) is rebuilt.
fn built_with_rundir(prefix: &Path) -> bool {
    let needle = format!("{RUNDIR}/criu.kdat");
    std::fs::read(binary(prefix)).is_ok_and(|bin| contains(&bin, needle.as_bytes()))
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// Major and minor of an upstream or Debian version ("4.2.1", "4.2.1-1",
/// "1:4.2~rc1-2").
fn parse_version(v: &str) -> Option<(u32, u32)> {
    let v = match v.split_once(':') {
        Some((epoch, rest)) if epoch.bytes().all(|b| b.is_ascii_digit()) => rest,
        _ => v,
    };
    let mut it = v.split(['.', '-', '~', '+']);
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

fn new_enough(v: &str) -> bool {
    parse_version(v).is_some_and(|v| v >= MIN)
}

pub fn ensure(prefix: &Path) -> Result<Step> {
    let bin = binary(prefix);
    match installed_version(prefix) {
        Some(v) if new_enough(&v) && !built_with_rundir(prefix) => eprintln!(
            "CRIU {v} at {} was built without RUNDIR={RUNDIR} (no cache of its kernel probes): rebuilding",
            bin.display()
        ),
        Some(v) if new_enough(&v) && !built_with_patch(prefix) => eprintln!(
            "CRIU {v} at {} was built without ferry's patches ({}): rebuilding",
            bin.display(),
            missing_patches(prefix).join(", ")
        ),
        Some(v) if new_enough(&v) => {
            let msg = format!("CRIU {v} already at {}", bin.display());
            eprintln!("{msg}");
            return Ok(Step::Skipped(msg));
        }
        Some(v) => eprintln!("CRIU {v} at {} is too old (need >= 4.2)", bin.display()),
        None => eprintln!("no working CRIU at {}", bin.display()),
    }
    let version = build_and_install(prefix)?;
    let reported = installed_ok(prefix).with_context(|| {
        format!(
            "the CRIU just installed at {} does not report a version >= 4.2",
            bin.display()
        )
    })?;
    eprintln!("+ {} check", bin.display());
    let check = cmd::output(Command::new(&bin).arg("check"))?;
    let stdout = String::from_utf8_lossy(&check.stdout);
    let stderr = String::from_utf8_lossy(&check.stderr);
    if !check.status.success() {
        bail!(
            "CRIU {version} installed at {}, but `criu check` failed ({}):\n{}{}",
            bin.display(),
            check.status,
            stdout,
            tail(&stderr, 20)
        );
    }
    // "Looks good." goes to stdout; CRIU logs harmless complaints (such as
    // the missing CAP_SYS_RESOURCE) to stderr.
    let verdict = last_line(&stdout)
        .or_else(|| last_line(&stderr))
        .unwrap_or("(no output)");
    eprintln!("criu check: {verdict}");
    Ok(Step::Done(format!(
        "CRIU {reported} built from {version} into {}; criu check: {verdict}",
        bin.display()
    )))
}

fn last_line(s: &str) -> Option<&str> {
    s.lines().map(str::trim).rfind(|l| !l.is_empty())
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Fetches, checks, builds and installs; returns the Debian version built.
fn build_and_install(prefix: &Path) -> Result<String> {
    // Rewritten only when different, so repeated setups leave it alone.
    if std::fs::read_to_string(SOURCES_FILE).ok().as_deref() != Some(SOURCES) {
        eprintln!("writing {SOURCES_FILE} (deb-src for sid)");
        std::fs::write(SOURCES_FILE, SOURCES).with_context(|| format!("writing {SOURCES_FILE}"))?;
    }
    cmd::run(Command::new("apt-get").args(["update", "-q"]))
        .context("apt-get update (for sid's criu source package)")?;

    let tmp = TempDir::new("ferry-criu-build")?;
    let mut fetch = Command::new("apt-get");
    fetch
        .args(["source", "--download-only", "criu"])
        .current_dir(tmp.path());
    eprintln!(
        "+ {}   (in {})",
        cmd::describe(&fetch),
        tmp.path().display()
    );
    let fetched = cmd::output(&mut fetch)?;
    // It exits non-zero on the 404 for the .debian.tar.xz: judged by the
    // files it leaves, not by its exit status.
    let dsc = find(tmp.path(), |n| {
        n.starts_with("criu_") && n.ends_with(".dsc")
    });
    let orig = find(tmp.path(), |n| {
        n.starts_with("criu_") && n.ends_with(".orig.tar.xz")
    });
    let (Some(dsc), Some(orig)) = (dsc, orig) else {
        bail!(
            "`apt-get source --download-only criu` did not fetch both the .dsc and the .orig.tar.xz ({}):\n{}{}",
            fetched.status,
            String::from_utf8_lossy(&fetched.stdout),
            tail(&String::from_utf8_lossy(&fetched.stderr), 20)
        );
    };
    if !fetched.status.success() {
        eprintln!(
            "apt-get source exited with {} (expected: the .debian.tar.xz is not on the mirror and is not needed)",
            fetched.status
        );
    }

    let dsc_text =
        std::fs::read_to_string(&dsc).with_context(|| format!("reading {}", dsc.display()))?;
    let version = dsc_text
        .lines()
        .find_map(|l| l.strip_prefix("Version:"))
        .map(|v| v.trim().to_owned())
        .context("the .dsc has no Version field")?;
    if !new_enough(&version) {
        bail!("Debian's source package has CRIU {version}; ferry needs >= 4.2");
    }
    let orig_name = file_name(&orig);
    let expected = sha256_in_dsc(&dsc_text, &orig_name)
        .with_context(|| format!("{orig_name} is not listed in the .dsc's Checksums-Sha256"))?;
    let actual = sha256(&orig)?;
    if actual != expected {
        bail!(
            "{orig_name}: SHA-256 mismatch: the file has {actual}, {} says {expected}; not building it",
            file_name(&dsc)
        );
    }
    eprintln!("CRIU {version}: {orig_name} matches the .dsc's SHA-256 ({actual})");

    cmd::run(
        Command::new("tar")
            .arg("xf")
            .arg(&orig)
            .current_dir(tmp.path()),
    )?;
    let src = std::fs::read_dir(tmp.path())?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.is_dir() && file_name(p).starts_with("criu-"))
        .context("the tarball did not unpack into criu-*")?;
    apply_patches(&src)?;
    make(&src, tmp.path())?;

    let bin_dir = prefix.join("bin");
    std::fs::create_dir_all(&bin_dir).with_context(|| format!("creating {}", bin_dir.display()))?;
    // Install under a temporary name and rename: an interrupted copy never
    // leaves a half-written binary at the path the fast check trusts.
    let staged = bin_dir.join(".criu.new");
    std::fs::copy(src.join("criu/criu"), &staged)
        .with_context(|| format!("copying criu/criu to {}", staged.display()))?;
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&staged, binary(prefix))?;
    std::fs::write(
        prefix.join("SOURCE"),
        format!(
            "criu {version} built from Debian's source package\n{orig_name} sha256 {actual}\n\
             with ferry's patches in xtask/criu/ ({})\n",
            PATCHES
                .iter()
                .map(|p| p.what)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    )?;
    eprintln!(
        "installed {} (provenance in {})",
        binary(prefix).display(),
        prefix.join("SOURCE").display()
    );
    Ok(version)
}

/// `make -j$(nproc) criu`, logged to a file whose tail is shown on failure
/// (and kept, since the build directory goes away).
fn make(src: &Path, tmp: &Path) -> Result<()> {
    let jobs = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    let log = tmp.join("build.log");
    let log_file = std::fs::File::create(&log)?;
    eprintln!(
        "+ make -j{jobs} RUNDIR={RUNDIR} criu   (in {}, log in {}; about 30 s)",
        src.display(),
        log.display()
    );
    let status = Command::new("make")
        .arg(format!("-j{jobs}"))
        .arg(format!("RUNDIR={RUNDIR}"))
        .arg("criu")
        .current_dir(src)
        .stdin(std::process::Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file)
        .status()
        .context("starting make")?;
    if !status.success() {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let kept = std::env::temp_dir().join("ferry-criu-build.log");
        let kept_note = match std::fs::copy(&log, &kept) {
            Ok(_) => format!("full log: {}", kept.display()),
            Err(_) => "the full log could not be kept".to_owned(),
        };
        bail!(
            "building CRIU failed ({status}); last lines of the build log ({kept_note}):\n{}",
            tail(&text, 40)
        );
    }
    Ok(())
}

fn sha256(path: &Path) -> Result<String> {
    let out = cmd::output(Command::new("sha256sum").arg(path))?;
    if !out.status.success() {
        bail!("sha256sum {} failed ({})", path.display(), out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_owned())
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn find(dir: &Path, pred: impl Fn(&str) -> bool) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| pred(&file_name(p)))
}

/// The SHA-256 of `file` in a .dsc's `Checksums-Sha256:` field (lines of
/// " <sha256> <size> <name>").
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
                return Some(f[0].to_ascii_lowercase());
            }
        }
    }
    None
}

/// A fresh scratch directory, removed on drop (also when the build fails).
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!("{name}.{}.{nanos}", std::process::id()));
        // create_dir, not create_dir_all: the directory must be new.
        std::fs::create_dir(&p).with_context(|| format!("creating {}", p.display()))?;
        Ok(Self(p))
    }

    fn path(&self) -> &Path {
        &self.0
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

    /// Every patch puts its mark in the patch text, and the agent, which
    /// tells a patched CRIU by the same marks (`agent/src/criu/version.rs`,
    /// FERRY_PATCHES), knows each of them.
    #[test]
    fn every_patch_mark_is_in_its_patch_and_known_to_the_agent() {
        let agent = include_str!("../../agent/src/criu/version.rs");
        for p in PATCHES {
            assert!(
                p.text.contains(p.mark),
                "{}: mark {:?} not in the patch",
                p.what,
                p.mark
            );
            assert!(
                agent.contains(&format!("\"{}\"", p.mark)),
                "{}: mark {:?} unknown to the agent",
                p.what,
                p.mark
            );
        }
    }

    #[test]
    fn reads_checksums() {
        let dsc = "Format: 3.0 (quilt)\nVersion: 4.2.1-1\nChecksums-Sha1:\n aaaa 1038700 criu_4.2.1.orig.tar.xz\nChecksums-Sha256:\n 29EC0E 1038700 criu_4.2.1.orig.tar.xz\n e9f7 12964 criu_4.2.1-1.debian.tar.xz\nFiles:\n x 1 criu_4.2.1.orig.tar.xz\n";
        assert_eq!(
            sha256_in_dsc(dsc, "criu_4.2.1.orig.tar.xz").as_deref(),
            Some("29ec0e")
        );
        assert_eq!(
            sha256_in_dsc(dsc, "criu_4.2.1-1.debian.tar.xz").as_deref(),
            Some("e9f7")
        );
        assert_eq!(sha256_in_dsc(dsc, "nope"), None);
    }

    #[test]
    fn finds_the_rundir_in_a_binary() {
        assert!(contains(
            b"..\0/dev/shm/ferry-criu/criu.kdat\0..",
            b"/dev/shm/ferry-criu/criu.kdat"
        ));
        assert!(!contains(
            b"..\0/run/criu.kdat\0..",
            b"/dev/shm/ferry-criu/criu.kdat"
        ));
        assert!(!contains(b"", b"x"));
    }

    #[test]
    fn compares_versions() {
        assert_eq!(parse_version("4.2.1-1"), Some((4, 2)));
        assert_eq!(parse_version("1:4.10~rc1-2"), Some((4, 10)));
        assert!(new_enough("4.2"));
        assert!(new_enough("4.2.1"));
        assert!(new_enough("5.0"));
        assert!(!new_enough("4.1.1-3"));
        assert!(!new_enough("3.17.1"));
        assert!(!new_enough("garbage"));
    }
}
