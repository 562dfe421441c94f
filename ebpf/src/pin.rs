//! Keeping eBPF maps and links in the BPF filesystem, so that ferryd can
//! restart (crash, upgrade) while its programs stay attached and their
//! maps keep their entries: no packet of a live connection notices.
//!
//! A [`PinDir`] is one directory on bpffs for one data-plane component,
//! `/sys/fs/bpf/ferry/<component>/` by default, holding
//! - each map under its object name (`FERRY_XL_RULES`), as aya and libbpf
//!   name pinned maps;
//! - each tcx link as `link-<program>` (`link-ferry_xlate_in`).
//!
//! A component uses it in three steps:
//! 1. [`PinDir::loader`] before loading: an [`EbpfLoader`] that REOPENS
//!    every map already pinned (after checking it still has the type and
//!    sizes this build expects, see [`MapSpec`]) and CREATES AND PINS the
//!    others, so a restarted agent gets the same maps;
//! 2. per program, [`PinDir::open_link`]: a link still attached to the
//!    right interface gets the freshly loaded program swapped in
//!    atomically (aya's `attach_to_link`, BPF_LINK_UPDATE: no packet
//!    passes unfiltered, and an upgraded agent runs its own program);
//!    otherwise the component attaches anew and [`PinDir::pin_link`]s the
//!    link;
//! 3. [`PinDir::remove`] when the component is to go away for good: it
//!    detaches every pinned link (BPF_LINK_DETACH, so that no other holder
//!    of the link keeps the program attached) and removes the pins and the
//!    directory.
//!
//! Dropping the component's objects closes only file descriptors: what is
//! pinned stays attached. Pins need tcx links (Linux 6.6+); cls_bpf
//! filters attached through netlink are no links and cannot be pinned.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use aya::EbpfLoader;
use aya::maps::{MapData, MapError, MapType};
use aya::programs::links::{FdLink, LinkError};

/// Where bpffs is normally mounted.
pub const BPFFS: &str = "/sys/fs/bpf";
/// The parent of ferry's pin directories.
pub const FERRY_PIN_ROOT: &str = "/sys/fs/bpf/ferry";

/// Prefix of pinned links' file names. Map names are C identifiers, which
/// never contain a '-', so the two cannot collide. (Not a '.': bpffs
/// reserves names with dots and refuses even to look them up, EPERM.)
const LINK_PREFIX: &str = "link-";

/// Errors working with pinned objects.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    #[error(
        "{}: not on a BPF filesystem (mount one: `mount -t bpf bpf {BPFFS}`, or call pin::mount_bpffs)",
        path.display()
    )]
    NotBpffs { path: PathBuf },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("{call} on {}: {source}", path.display())]
    Bpf {
        path: PathBuf,
        call: &'static str,
        source: io::Error,
    },
    #[error("pinned map {}: {source}", path.display())]
    Map { path: PathBuf, source: MapError },
    #[error(
        "pinned map {} is {found}, this build expects {expected}: an incompatible ferry left it; remove the pins to start over",
        path.display()
    )]
    Mismatch {
        path: PathBuf,
        found: String,
        expected: String,
    },
    #[error("pinned link {}: {source}", path.display())]
    Link { path: PathBuf, source: LinkError },
    #[error("pinning {}: {source}", path.display())]
    Pin {
        path: PathBuf,
        source: aya::pin::PinError,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> PinError + '_ {
    move |source| PinError::Io {
        path: path.to_owned(),
        source,
    }
}

/// What a map must be for a pinned one to be reused: the values of its
/// C definition. A pin that differs was left by another build; using it
/// would make the programs misread every entry, so it is an error.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MapSpec {
    /// The map's name in the object (and its pin's file name).
    pub name: &'static str,
    pub map_type: MapType,
    pub key_size: u32,
    /// For per-CPU maps, the size of one CPU's value.
    pub value_size: u32,
    pub max_entries: u32,
}

impl MapSpec {
    fn describe(map_type: MapType, key: u32, value: u32, max: u32) -> String {
        format!("{map_type:?} key {key} value {value} max_entries {max}")
    }

    /// Checks a reopened map against the spec.
    fn check(&self, path: &Path, map: &MapData) -> Result<(), PinError> {
        let map_err = |source| PinError::Map {
            path: path.to_owned(),
            source,
        };
        let info = map.info().map_err(map_err)?;
        let map_type = info.map_type().map_err(map_err)?;
        let found = (
            map_type,
            info.key_size(),
            info.value_size(),
            info.max_entries(),
        );
        let expected = (
            self.map_type,
            self.key_size,
            self.value_size,
            self.max_entries,
        );
        if found != expected {
            return Err(PinError::Mismatch {
                path: path.to_owned(),
                found: Self::describe(found.0, found.1, found.2, found.3),
                expected: Self::describe(expected.0, expected.1, expected.2, expected.3),
            });
        }
        Ok(())
    }
}

/// Mounts bpffs at `path` unless one is there already; true if it
/// mounted. ferryd calls this for [`BPFFS`] at start-up: some systems
/// (and this project's test machines) do not mount it.
pub fn mount_bpffs(path: &Path) -> Result<bool, PinError> {
    if is_bpffs(path)? {
        return Ok(false);
    }
    std::fs::create_dir_all(path).map_err(io_err(path))?;
    nix::mount::mount(
        Some("bpf"),
        path,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|e| PinError::Io {
        path: path.to_owned(),
        source: e.into(),
    })?;
    tracing::info!(path = %path.display(), "bpffs mounted");
    Ok(true)
}

/// Whether `path` (which must exist) lies on a BPF filesystem.
fn is_bpffs(path: &Path) -> Result<bool, PinError> {
    match nix::sys::statfs::statfs(path) {
        Ok(st) => Ok(st.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC),
        Err(nix::errno::Errno::ENOENT) => Ok(false),
        Err(e) => Err(PinError::Io {
            path: path.to_owned(),
            source: e.into(),
        }),
    }
}

/// One component's directory of pins; see the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinDir {
    path: PathBuf,
}

impl PinDir {
    /// A pin directory at `path`, which must be (or be created) on bpffs.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// `/sys/fs/bpf/ferry/<component>`.
    pub fn ferry(component: &str) -> Self {
        Self::new(Path::new(FERRY_PIN_ROOT).join(component))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The pin of map `name`.
    pub fn map_path(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// The pin of the link that attaches program `program`.
    pub fn link_path(&self, program: &str) -> PathBuf {
        self.path.join(format!("{LINK_PREFIX}{program}"))
    }

    /// Creates the directory (and its parents) if needed, and checks that
    /// it is on bpffs: pins anywhere else fail with a less helpful error.
    pub fn create(&self) -> Result<(), PinError> {
        std::fs::create_dir_all(&self.path).map_err(io_err(&self.path))?;
        if !is_bpffs(&self.path)? {
            return Err(PinError::NotBpffs {
                path: self.path.clone(),
            });
        }
        Ok(())
    }

    /// Reopens the pinned map of `spec`, checked against it; None if it is
    /// not pinned.
    pub fn open_map(&self, spec: &MapSpec) -> Result<Option<MapData>, PinError> {
        let path = self.map_path(spec.name);
        if !exists(&path)? {
            return Ok(None);
        }
        let map = MapData::from_pin(&path).map_err(|source| PinError::Map {
            path: path.clone(),
            source,
        })?;
        spec.check(&path, &map)?;
        Ok(Some(map))
    }

    /// A loader that reopens the maps of `specs` pinned here and creates
    /// and pins the missing ones when it loads the object ("reopen what is
    /// pinned, load fresh and pin the rest"). Creates the directory, and
    /// fails on a pinned map that does not match its spec.
    pub fn loader(&self, specs: &'static [MapSpec]) -> Result<EbpfLoader<'static>, PinError> {
        self.create()?;
        let mut loader = EbpfLoader::new();
        for spec in specs {
            // Checked here because aya reuses whatever is pinned at the
            // path without looking at it.
            self.open_map(spec)?;
            loader.map_pin_path(spec.name, self.map_path(spec.name));
        }
        Ok(loader)
    }

    /// Reopens the link pinned for `program`, None if there is none.
    pub fn open_link(&self, program: &str) -> Result<Option<FdLink>, PinError> {
        let path = self.link_path(program);
        if !exists(&path)? {
            return Ok(None);
        }
        let link = aya::programs::links::PinnedLink::from_pin(&path)
            .map_err(|source| PinError::Link { path, source })?;
        Ok(Some(link.into()))
    }

    /// Pins `link` as the link of `program`; from now on it stays attached
    /// after every file descriptor of it is closed, until
    /// [`remove_link`](Self::remove_link) or [`remove`](Self::remove).
    pub fn pin_link(&self, program: &str, link: FdLink) -> Result<(), PinError> {
        let path = self.link_path(program);
        link.pin(&path)
            .map_err(|source| PinError::Pin { path, source })?;
        Ok(())
    }

    /// Detaches the link pinned for `program` and removes its pin; false if
    /// there was none.
    pub fn remove_link(&self, program: &str) -> Result<bool, PinError> {
        remove_link_at(&self.link_path(program))
    }

    /// Detaches every pinned link, removes every pin and the directory.
    /// What this process still holds open keeps working as unpinned
    /// objects (maps stay readable; the detached links filter nothing).
    /// No directory is no error: removing twice is fine.
    pub fn remove(&self) -> Result<(), PinError> {
        let entries = match std::fs::read_dir(&self.path) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_err(&self.path)(e)),
        };
        // Links first: once they are gone no program uses the maps.
        let mut maps = Vec::new();
        for entry in entries {
            let path = entry.map_err(io_err(&self.path))?.path();
            let is_link = path
                .file_name()
                .is_some_and(|n| n.as_bytes().starts_with(LINK_PREFIX.as_bytes()));
            if is_link {
                remove_link_at(&path)?;
            } else {
                maps.push(path);
            }
        }
        for path in maps {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(&path)(e)),
            }
        }
        match std::fs::remove_dir(&self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&self.path)(e)),
        }
        tracing::info!(path = %self.path.display(), "pins removed");
        Ok(())
    }
}

fn exists(path: &Path) -> Result<bool, PinError> {
    path.try_exists().map_err(io_err(path))
}

fn remove_link_at(path: &Path) -> Result<bool, PinError> {
    let bpf_err = |call| {
        move |source| PinError::Bpf {
            path: path.to_owned(),
            call,
            source,
        }
    };
    let fd = match obj_get(path) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(bpf_err("BPF_OBJ_GET")(e)),
    };
    match link_detach(fd.as_fd()) {
        Ok(()) => {}
        // Link types without detach go when the last reference does, which
        // removing the pin below is, unless someone else holds one.
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
        Err(e) => return Err(bpf_err("BPF_LINK_DETACH")(e)),
    }
    std::fs::remove_file(path).map_err(io_err(path))?;
    Ok(true)
}

// aya 0.14 has neither a public BPF_OBJ_GET returning a plain descriptor
// nor BPF_LINK_DETACH, so these two are issued here.
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_DETACH: libc::c_long = 34;

/// `union bpf_attr` as BPF_OBJ_GET reads it.
#[repr(C)]
struct ObjGetAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// `union bpf_attr` as BPF_LINK_DETACH reads it.
#[repr(C)]
struct LinkDetachAttr {
    link_fd: u32,
}

/// Opens the object pinned at `path`.
fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let cpath = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let attr = ObjGetAttr {
        pathname: cpath.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    // SAFETY: bpf(2) reads size_of::<ObjGetAttr>() bytes of `attr`, a live
    // repr(C) value laid out as the kernel's bpf_attr for BPF_OBJ_GET, whose
    // pathname points at `cpath`, a NUL-terminated string alive until after
    // the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET,
            &attr as *const ObjGetAttr,
            std::mem::size_of::<ObjGetAttr>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: on success BPF_OBJ_GET returns a new descriptor (opened
    // O_CLOEXEC) that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as i32) })
}

/// Detaches a link from its hook (the link object lives on, defunct,
/// until its last reference goes).
fn link_detach(link: BorrowedFd<'_>) -> io::Result<()> {
    let attr = LinkDetachAttr {
        link_fd: link.as_raw_fd() as u32,
    };
    // SAFETY: bpf(2) reads size_of::<LinkDetachAttr>() bytes of `attr`, a
    // live repr(C) value laid out as the kernel's bpf_attr for
    // BPF_LINK_DETACH; the descriptor is borrowed for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_DETACH,
            &attr as *const LinkDetachAttr,
            std::mem::size_of::<LinkDetachAttr>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
