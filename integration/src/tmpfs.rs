//! tmpfs mounts for the nodes' work dirs: checkpoint images must not touch a
//! disk (it would lengthen the freeze), and each node must see only its own.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::mount::{MntFlags, MsFlags, mount, umount2};

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("creating {path}: {source}")]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("mounting a tmpfs or bpffs on {path}: {source}")]
    Mount { path: PathBuf, source: nix::Error },
    #[error("unmounting {path}: {source}")]
    Unmount { path: PathBuf, source: nix::Error },
    #[error("reading /proc/self/mountinfo: {0}")]
    MountInfo(std::io::Error),
}

/// A tmpfs mounted at a directory, unmounted on drop (or by
/// [`Tmpfs::unmount`]).
#[derive(Debug)]
pub struct Tmpfs {
    path: PathBuf,
    mounted: bool,
}

impl Tmpfs {
    /// Creates `path` if needed and mounts a fresh tmpfs on it.
    pub fn mount(path: &Path) -> Result<Self, MountError> {
        Self::mount_fs(path, "tmpfs", Some("mode=0755"))
    }

    /// A fresh bpffs instance at `path`, for one node's pinned eBPF maps
    /// and links: unmounting it drops the pins (and detaches the links),
    /// and nothing of a test lands in the host's /sys/fs/bpf.
    pub fn mount_bpffs(path: &Path) -> Result<Self, MountError> {
        Self::mount_fs(path, "bpf", None)
    }

    fn mount_fs(path: &Path, fstype: &str, data: Option<&str>) -> Result<Self, MountError> {
        std::fs::create_dir_all(path).map_err(|source| MountError::Create {
            path: path.to_owned(),
            source,
        })?;
        mount(
            Some(fstype),
            path,
            Some(fstype),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            data,
        )
        .map_err(|source| MountError::Mount {
            path: path.to_owned(),
            source,
        })?;
        Ok(Self {
            path: path.to_owned(),
            mounted: true,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Unmounts; idempotent. A mount still busy after a few tries (a process
    /// that has not quite exited) is detached instead, so teardown never
    /// leaves it in the mount table.
    pub fn unmount(&mut self) -> Result<(), MountError> {
        if !self.mounted {
            return Ok(());
        }
        self.mounted = false;
        unmount_path(&self.path)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        if let Err(e) = self.unmount() {
            eprintln!("ferry-integration: {e}");
        }
    }
}

/// Caps the tmpfs at `path` at `bytes` (at least what it holds), or gives
/// it back tmpfs's default, half the memory (`None`; not `size=0`, no
/// limit: a tmpfs cannot be limited again after that), by remounting it:
/// what it holds stays.
pub fn remount_size(path: &Path, bytes: Option<u64>) -> Result<(), MountError> {
    let data = match bytes {
        Some(b) => format!("size={b}"),
        None => "size=50%".to_owned(),
    };
    mount(
        None::<&str>,
        path,
        None::<&str>,
        MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(data.as_str()),
    )
    .map_err(|source| MountError::Mount {
        path: path.to_owned(),
        source,
    })
}

/// Unmounts `path`, retrying while busy, then lazily.
pub fn unmount_path(path: &Path) -> Result<(), MountError> {
    for _ in 0..10 {
        match umount2(path, MntFlags::empty()) {
            Ok(()) => return Ok(()),
            Err(nix::Error::EBUSY) => std::thread::sleep(Duration::from_millis(50)),
            Err(source) => {
                return Err(MountError::Unmount {
                    path: path.to_owned(),
                    source,
                });
            }
        }
    }
    umount2(path, MntFlags::MNT_DETACH).map_err(|source| MountError::Unmount {
        path: path.to_owned(),
        source,
    })
}

/// Mount points of this mount namespace at or below `prefix`.
pub fn mounts_under(prefix: &Path) -> Result<Vec<PathBuf>, MountError> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").map_err(MountError::MountInfo)?;
    Ok(info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mountinfo)
        .map(PathBuf::from)
        .filter(|p| p.starts_with(prefix))
        .collect())
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && let Ok(digits) = std::str::from_utf8(&b[i + 1..i + 4])
            && let Ok(v) = u8::from_str_radix(digits, 8)
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_decoded() {
        assert_eq!(unescape_mountinfo(r"/tmp/a\040b"), "/tmp/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        assert_eq!(unescape_mountinfo(r"/end\"), r"/end\");
    }
}
