//! Finding out whether the configured CRIU can do what ferry asks of it.

use std::path::Path;
use std::process::Command;

use super::CriuError;

/// Oldest CRIU that works here: 3.17 fails on the vDSO layout of current
/// kernels and 4.1 fails to dump TCP sockets (SO_PASSCRED now returns
/// EOPNOTSUPP on them); 4.2 fixed both.
pub const MIN_CRIU_VERSION: CriuVersion = CriuVersion {
    major: 4,
    minor: 2,
    patch: 0,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CriuVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl std::fmt::Display for CriuVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl CriuVersion {
    /// Parses the output of `criu --version` ("Version: 4.2.1" or "Version: 4.2").
    pub fn parse_version_output(out: &str) -> Option<Self> {
        let line = out
            .lines()
            .find_map(|l| l.trim().strip_prefix("Version:"))?;
        let mut parts = line.trim().split('.').map(|p| p.trim().parse::<u32>());
        let major = parts.next()?.ok()?;
        let minor = parts.next()?.ok()?;
        let patch = match parts.next() {
            Some(p) => p.ok()?,
            None => 0,
        };
        Some(Self {
            major,
            minor,
            patch,
        })
    }
}

/// Runs `criu --version` and checks it against [`MIN_CRIU_VERSION`].
pub fn probe_version(path: &Path) -> Result<CriuVersion, CriuError> {
    if !path.exists() {
        return Err(CriuError::NotFound {
            path: path.to_owned(),
        });
    }
    let out = Command::new(path)
        .arg("--version")
        .output()
        .map_err(|source| CriuError::Spawn {
            path: path.to_owned(),
            source,
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version =
        CriuVersion::parse_version_output(&text).ok_or_else(|| CriuError::UnknownVersion {
            path: path.to_owned(),
            reason: format!("unexpected output {:?}", text.trim()),
        })?;
    if version < MIN_CRIU_VERSION {
        return Err(CriuError::TooOld {
            path: path.to_owned(),
            found: version.to_string(),
            required: MIN_CRIU_VERSION.to_string(),
        });
    }
    Ok(version)
}

/// What ferry's patch `xtask/criu/notify-dump-rollback.patch` puts in the
/// binary (a log message): with it, a dump that fails tells the caller
/// (`network-unlock`) before the frozen tasks run again.
pub const DUMP_ROLLBACK_MARK: &str = "ferry-dump-rollback";

/// The mark of `xtask/criu/inherit-tcp-connections.patch`: a restore takes
/// the TCP connections ferryd rebuilt (collective socket migration);
/// without it CRIU would restore them closed.
pub const INHERITED_TCP_MARK: &str = "ferry-inherited-tcp";

/// The mark of `xtask/criu/inherited-connections-by-pidfd.patch`:
/// connections handed over as `ferry-tcp:[<ino>]` are taken from CRIU's
/// process by pidfd (no fdstore, no linear search). "2": the version that
/// closes that pidfd before the tasks resume; a build of the first one
/// (which left it open in the restored process, one more per migration)
/// is not used for it, and its connections go through the fdstore.
pub const TCP_BY_PIDFD_MARK: &str = "ferry-tcp-by-pidfd2";

/// The mark of `xtask/criu/tcp-options-by-caller.patch`: a dump asked to
/// (`ferry:tcp-opts-by-caller`) records established connections without
/// their socket options, which ferryd carries; the restore skips them.
pub const OPTS_BY_CALLER_MARK: &str = "ferry-opts-by-caller";

/// The mark of `xtask/criu/connections-table.patch`: the connections are
/// handed over as one table (`ferry-tcp-table`, a memfd naming ferryd's
/// PID and each connection's descriptor there), and the restored task
/// takes them from ferryd by pidfd; CRIU inherits one descriptor.
pub const TCP_TABLE_MARK: &str = "ferry-tcp-table1";

/// The mark of `xtask/criu/connections-out-of-images.patch`: a dump asked
/// to (`ferry:conns-out`) keeps the connections ferryd moves out of the
/// images (each recorded by descriptor number, inode and flags in
/// `ferry-conns-<files id>.img`, never passed out of the task), and the
/// restore installs them from ferryd's table at those numbers. "2": the
/// version that places the restored task's service fds above those
/// numbers too (the first could put a service fd on a connection's).
pub const CONNS_OUT_MARK: &str = "ferry-conns-out2";

/// The mark of `xtask/criu/held-pages-left-out.patch`: a dump asked to
/// (`ferry:held-pages`) leaves out the pages the destination holds (listed
/// per task in `ferry-held-<pid>.img`, and not written since, by
/// PAGEMAP_SCAN) as parent runs of the pagemap.
pub const HELD_PAGES_MARK: &str = "ferry-held-pages";

/// The mark of `xtask/criu/held-pages-written-or-not.patch`: a held-pages
/// file with the magic "FHP2" leaves out every page with data in its
/// ranges, written or not (post-copy whose pages ferryd sends from the
/// stopped task after the resume).
pub const HELD_ALL_MARK: &str = "ferry-held-all";

/// The mark of `xtask/criu/held-pages-everywhere.patch`: a held-pages file
/// with the magic "FHP3" leaves held pages not written since out of every
/// private area (private file mappings the task wrote, locked areas), not
/// only out of those a lazy restore fills.
pub const HELD_EVERYWHERE_MARK: &str = "ferry-held-everywhere";

/// The mark of `xtask/criu/vma-flags-without-smaps.patch`: a dump asked
/// to (`ferry:vma-flags`) reads each mapping's flags from ferryd's BPF
/// iterators (`ferry-vmflags.img`, `super::vmflags`) and
/// `/proc/<pid>/maps`, not from smaps, whose page counts walk every
/// resident page in the freeze.
pub const VMA_FLAGS_MARK: &str = "ferry-vma-flags";

/// The mark of `xtask/criu/rlimits-from-procfs.patch`: a dump reads the
/// resource limits of a task of another user from `/proc/<pid>/limits`
/// when `prlimit()` is refused (it needs CAP_SYS_RESOURCE for them).
/// Without it such a process cannot be dumped by an agent that lacks that
/// capability (`crate::process::privileges`).
pub const RLIMITS_PROCFS_MARK: &str = "ferry-rlimits-procfs";

/// How the files of that patch are named in an image directory
/// (`ferry-conns-<files id>.img`).
pub const CONNS_OUT_IMAGE_PREFIX: &str = "ferry-conns-";

/// ferry's patches to CRIU, by their mark, with what each is for.
pub const FERRY_PATCHES: &[(&str, &str)] = &[
    (
        INHERITED_TCP_MARK,
        "inherited TCP connections (collective socket migration)",
    ),
    (
        DUMP_ROLLBACK_MARK,
        "failed dump notified (connections read during the dump)",
    ),
    (
        "ferry-flushed-close",
        "page-server close pushed out (post-copy)",
    ),
    (
        "ferry-socket-fdinfo",
        "socket flags without fdinfo (a shorter dump)",
    ),
    (
        TCP_BY_PIDFD_MARK,
        "inherited connections taken by pidfd (a shorter restore)",
    ),
    (
        OPTS_BY_CALLER_MARK,
        "connection options carried by ferryd (a shorter dump and restore)",
    ),
    (
        TCP_TABLE_MARK,
        "handed-over connections as one table (a shorter CRIU start-up)",
    ),
    (
        CONNS_OUT_MARK,
        "connections kept out of the images (a shorter dump and restore)",
    ),
    (
        "ferry-cgroup-by-criu",
        "cgroups read without the parasite (a shorter dump)",
    ),
    (
        "ferry-timens-offsets",
        "time namespace dumped from its offsets (a shorter dump)",
    ),
    (
        "ferry-kdat-ahead",
        "kernel features read before the request (a shorter restore)",
    ),
    (
        "ferry-no-pidns-proc",
        "pid namespace's procfs only when needed (a shorter dump, a read-only working directory)",
    ),
    (
        "ferry-conns-in-place3",
        "kept-out connections installed at their numbers by pidfd_getfd alone (a shorter restore)",
    ),
    (
        "ferry-conns-uncollected",
        "only listening TCP sockets collected by the dump (a dump that does not grow with the machine's other connections)",
    ),
    (
        HELD_PAGES_MARK,
        "pre-copied pages left out of the dump (a dump that follows the pages written, not the memory's size)",
    ),
    (
        "ferry-held-scan",
        "held pages scanned by their write-protect bits alone (a dump that does not read each held page's struct page)",
    ),
    (
        VMA_FLAGS_MARK,
        "mappings' flags from ferryd's iterators, not smaps (a dump that does not count every resident page)",
    ),
    (
        "ferry-anon-scan",
        "anonymous memory scanned without struct page reads (a post-copy dump that does not read every page)",
    ),
    (
        "ferry-lazy-waits",
        "lazy-pages daemon waiting for answers, not spinning (a core left to the process during post-copy)",
    ),
    (
        HELD_ALL_MARK,
        "post-copy's pages left in the stopped task (a post-copy dump that moves no page)",
    ),
    (
        "ferry-held-guards2",
        "guard markers of held ranges found by the held pages' scan (a dump that walks a pre-copied process's page tables once)",
    ),
    (
        "ferry-held-prescan2",
        "held pages scanned from the seizing on (the scan of a pre-copied process's page tables beside the rest of the dump)",
    ),
    (
        HELD_EVERYWHERE_MARK,
        "held pages left out of every private area (a freeze that carries none of a process's written file pages the destination holds)",
    ),
    (
        RLIMITS_PROCFS_MARK,
        "limits of another user's tasks read from procfs (servers that drop root move without CAP_SYS_RESOURCE)",
    ),
];

/// What the CRIU at `path` lacks of [`FERRY_PATCHES`].
pub fn missing_patches(path: &Path) -> Vec<&'static str> {
    let found = marks_found(path);
    FERRY_PATCHES
        .iter()
        .zip(found)
        .filter(|(_, found)| !found)
        .map(|((_, what), _)| *what)
        .collect()
}

/// Whether the CRIU at `path` was built with the patch whose mark (one of
/// [`FERRY_PATCHES`]) is `mark` (`cargo xtask setup` applies them all).
pub fn has_patch(path: &Path, mark: &str) -> bool {
    let found = marks_found(path);
    FERRY_PATCHES
        .iter()
        .zip(found)
        .any(|((m, _), found)| *m == mark && found)
}

/// [`has_patch`], as the error a step that needs the patch returns.
pub fn require_patch(path: &Path, mark: &str) -> Result<(), CriuError> {
    if has_patch(path, mark) {
        return Ok(());
    }
    let what = FERRY_PATCHES
        .iter()
        .find(|(m, _)| *m == mark)
        .map_or("an unknown patch", |(_, what)| *what);
    Err(CriuError::Unpatched {
        path: path.to_owned(),
        what,
    })
}

/// Which of [`FERRY_PATCHES`] the binary at `path` carries, in that
/// order. The binary (~6 MB) is read once per version of the file (its
/// modification time and size); none when it cannot be read.
fn marks_found(path: &Path) -> Vec<bool> {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::time::SystemTime;
    type Seen = HashMap<std::path::PathBuf, ((SystemTime, u64), Vec<bool>)>;
    static SEEN: Mutex<Option<Seen>> = Mutex::new(None);
    let Ok(meta) = std::fs::metadata(path) else {
        return vec![false; FERRY_PATCHES.len()];
    };
    let version = (
        meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
        meta.len(),
    );
    if let Some((v, found)) = crate::sync::lock(&SEEN)
        .get_or_insert_with(HashMap::new)
        .get(path)
        && *v == version
    {
        return found.clone();
    }
    let bin = std::fs::read(path).unwrap_or_default();
    let found: Vec<bool> = FERRY_PATCHES
        .iter()
        .map(|(mark, _)| contains(&bin, mark.as_bytes()))
        .collect();
    crate::sync::lock(&SEEN)
        .get_or_insert_with(HashMap::new)
        .insert(path.to_owned(), (version, found.clone()));
    found
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_patch_is_known_by_its_mark_in_the_binary() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("criu");
        std::fs::write(
            &bin,
            b"\x7fELF...ferry-dump-rollback: the caller is told...",
        )
        .unwrap();
        assert!(has_patch(&bin, DUMP_ROLLBACK_MARK));
        assert!(!has_patch(&bin, "ferry-something-else"));
        // Every patch but the one whose mark is there, in their order.
        let expected: Vec<&str> = FERRY_PATCHES
            .iter()
            .filter(|(mark, _)| *mark != DUMP_ROLLBACK_MARK)
            .map(|(_, what)| *what)
            .collect();
        assert_eq!(expected.len(), FERRY_PATCHES.len() - 1);
        assert_eq!(missing_patches(&bin), expected);
        // A rebuilt binary is read again, not answered from the first look.
        std::fs::write(&bin, b"\x7fELF... upstream, no marks at all").unwrap();
        assert!(!has_patch(&bin, DUMP_ROLLBACK_MARK));
        assert_eq!(missing_patches(&bin).len(), FERRY_PATCHES.len());
        assert!(!has_patch(&dir.path().join("absent"), DUMP_ROLLBACK_MARK));
        let err = require_patch(&bin, INHERITED_TCP_MARK)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("inherited TCP connections (collective socket migration)")
                && err.contains("cargo xtask setup"),
            "{err}"
        );
    }

    #[test]
    fn parses_criu_version_lines() {
        let v = CriuVersion::parse_version_output("Version: 4.2.1\n").unwrap();
        assert_eq!(v.to_string(), "4.2.1");
        let v = CriuVersion::parse_version_output("Version: 3.17\nGitID: x\n").unwrap();
        assert!(v < MIN_CRIU_VERSION);
        assert!(CriuVersion::parse_version_output("criu: unknown").is_none());
    }

    #[test]
    fn missing_binary_is_reported_as_not_found() {
        let err = probe_version(Path::new("/nonexistent/criu")).unwrap_err();
        assert!(matches!(err, CriuError::NotFound { .. }), "{err}");
    }

    #[test]
    fn old_version_is_refused_with_both_versions_named() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("criu");
        std::fs::write(&fake, "#!/bin/sh\necho 'Version: 3.17'\n").unwrap();
        std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let err = probe_version(&fake).unwrap_err().to_string();
        assert!(err.contains("3.17") && err.contains("4.2.0"), "{err}");
    }
}
