//! CRIU's cache of kernel-feature probes (`criu.kdat`).
//!
//! Every CRIU run starts by probing the kernel (`kerndat_init`: vDSO
//! layouts, socket diag modules, netns links, memory tracking, ...), which
//! takes about 85 ms on this project's machines and under 10 ms when the
//! result is cached (measured with `criu check -v4`, commit a39bad0). On
//! the source that cost is paid before CRIU's
//! `pre-dump` notification, while the process still runs; on the
//! destination the restore's CRIU starts after the process was stopped, so
//! without the cache every migration's freeze carries it.
//!
//! CRIU keeps the cache in `<RUNDIR>/criu.kdat`, RUNDIR being fixed when
//! CRIU is built (`/run` by default), and only if that directory is on a
//! tmpfs: the probes must not outlive a reboot or a kernel change. Hosts
//! whose `/run` is a tmpfs (systemd) get it with a distribution's CRIU.
//! `cargo xtask setup` builds CRIU with RUNDIR = [`DEFAULT_CACHE_DIR`], on
//! `/dev/shm`, which is a tmpfs wherever glibc's shared memory works, so
//! the cache works on hosts whose `/run` is a plain directory too. Since
//! root's CRIU trusts what it reads there, the directory must be root's
//! and writable by nobody else: a world-writable `/dev/shm` itself would
//! let any user plant a cache.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::CriuError;

/// The RUNDIR of the CRIU that `cargo xtask setup` builds.
pub const DEFAULT_CACHE_DIR: &str = "/dev/shm/ferry-criu";

/// The cache file CRIU writes in its RUNDIR.
pub const CACHE_FILE: &str = "criu.kdat";

const TMPFS_MAGIC: i64 = 0x0102_1994;

/// Whether CRIU can keep its cache in a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheDir {
    /// Root's, private, on a tmpfs: CRIU will keep its cache there.
    Usable,
    /// Not on a tmpfs: CRIU refuses to keep a cache there and probes the
    /// kernel on every run.
    NotTmpfs,
}

/// Makes `dir` ready to hold CRIU's cache: creates it (mode 0700) if it is
/// missing, and refuses one that is not a directory, not owned by this
/// (root) user, or writable by group or others.
pub fn prepare_cache_dir(dir: &Path) -> Result<CacheDir, CriuError> {
    let bad = |reason: String| CriuError::CacheDir {
        path: dir.to_owned(),
        reason,
    };
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => tracing::info!(dir = %dir.display(), "created CRIU's cache directory"),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(bad(format!("cannot create it: {e}"))),
    }
    // symlink_metadata: a symlink planted in place of the directory is
    // refused rather than followed.
    let meta = std::fs::symlink_metadata(dir).map_err(|e| bad(e.to_string()))?;
    if !meta.is_dir() {
        return Err(bad("it is not a directory".into()));
    }
    // SAFETY: geteuid() has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(bad(format!(
            "it belongs to uid {}, not to this agent's uid {me}",
            meta.uid()
        )));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(bad(format!(
            "its mode {mode:o} lets others write into it (CRIU trusts what it finds there)"
        )));
    }
    match nix::sys::statfs::statfs(dir) {
        Ok(s) if s.filesystem_type().0 == TMPFS_MAGIC => Ok(CacheDir::Usable),
        Ok(_) => Ok(CacheDir::NotTmpfs),
        Err(e) => Err(bad(format!("statfs: {e}"))),
    }
}

/// Whether a cache file is present in `dir`.
pub fn cache_present(dir: &Path) -> bool {
    dir.join(CACHE_FILE).is_file()
}

/// Runs `criu check` once, which probes the kernel and, if CRIU's RUNDIR
/// is a usable cache directory, leaves the cache there, so that the first
/// migration's restore does not pay for the probes either. Returns CRIU's
/// verdict (its last line of output).
pub fn warm(criu: &Path, work_dir: &Path) -> Result<String, CriuError> {
    let out = Command::new(criu)
        .arg("check")
        // CRIU writes its log into the current directory.
        .current_dir(work_dir)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| CriuError::Spawn {
            path: criu.to_owned(),
            source,
        })?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let verdict = text
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .unwrap_or("(no output)")
        .to_owned();
    if out.status.success() {
        Ok(verdict)
    } else {
        Err(CriuError::Failed {
            operation: "check",
            reason: verdict,
        })
    }
}

/// The default cache directory as a path.
pub fn default_cache_dir() -> PathBuf {
    PathBuf::from(DEFAULT_CACHE_DIR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_a_private_directory_and_accepts_it_again() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("kdat");
        let first = prepare_cache_dir(&dir).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        assert_eq!(prepare_cache_dir(&dir).unwrap(), first);
    }

    #[test]
    fn refuses_a_directory_others_can_write() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("open");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = prepare_cache_dir(&dir).unwrap_err().to_string();
        assert!(err.contains("777"), "{err}");
    }

    #[test]
    fn refuses_a_file_or_a_symlink_in_its_place() {
        let base = tempfile::tempdir().unwrap();
        let file = base.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let err = prepare_cache_dir(&file).unwrap_err().to_string();
        assert!(err.contains("not a directory"), "{err}");
        let target = base.path().join("target");
        std::fs::create_dir(&target).unwrap();
        let link = base.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = prepare_cache_dir(&link).unwrap_err().to_string();
        assert!(err.contains("not a directory"), "{err}");
    }
}
