//! CRIU, driven through its `swrk` RPC mode.
//!
//! rust-criu's `Criu` wrapper has no calls for `--network-lock skip`,
//! `--leave-stopped` or notifications, so ferry speaks the RPC itself on the
//! protobuf types rust-criu exports (`swrk.rs`). Every call here blocks; the
//! engine runs them on tokio's blocking pool.

mod cache;
mod error;
mod exits;
pub mod held;
pub mod lazy;
mod sched_hooks;
pub(crate) mod spawn;
mod swrk;
mod version;
pub mod vmflags;

pub use cache::{
    CACHE_FILE, CacheDir, DEFAULT_CACHE_DIR, cache_present, default_cache_dir, prepare_cache_dir,
    warm,
};
pub use error::CriuError;
pub use exits::settle as settle_exits;
pub use sched_hooks::SchedHooks;
pub use swrk::{
    DumpRequest, HookRefused, LazyDump, Notifications, NotifyHook, RestoreOutcome, RestoreRequest,
    TcpConnections, Worker, dump, restore, start_restore_worker,
};
pub use version::{
    CONNS_OUT_IMAGE_PREFIX, CONNS_OUT_MARK, CriuVersion, DUMP_ROLLBACK_MARK, FERRY_PATCHES,
    HELD_ALL_MARK, HELD_EVERYWHERE_MARK, HELD_PAGES_MARK, INHERITED_TCP_MARK, MIN_CRIU_VERSION,
    OPTS_BY_CALLER_MARK, RLIMITS_PROCFS_MARK, TCP_BY_PIDFD_MARK, TCP_TABLE_MARK, VMA_FLAGS_MARK,
    has_patch, missing_patches, probe_version, require_patch,
};

/// CRIU as the source of a migration uses it: which build it is, and the
/// dump. Behind a trait so that the engine's source side runs in unit tests
/// against a scripted CRIU; ferryd uses the installed one
/// ([`InstalledCriu`]). Every call blocks.
pub trait Checkpointer: Send + Sync + std::fmt::Debug {
    /// Its version, refused if too old ([`probe_version`]).
    fn probe(&self) -> Result<CriuVersion, CriuError>;
    /// Whether it carries the ferry patch marked `mark` ([`has_patch`]).
    fn has_patch(&self, mark: &str) -> bool;
    /// Dumps `req.pid` ([`dump`]): `on_notify` hears each notification
    /// (`pre-dump` before the tree is frozen, `query-ext-files` once it is,
    /// `network-unlock` before a failed dump lets it run again).
    fn dump(
        &self,
        req: &DumpRequest,
        on_notify: NotifyHook<'_>,
    ) -> Result<Notifications, CriuError>;
}

/// The CRIU binary at `criu_path`.
#[derive(Debug, Clone)]
pub struct InstalledCriu(pub std::path::PathBuf);

impl Checkpointer for InstalledCriu {
    fn probe(&self) -> Result<CriuVersion, CriuError> {
        probe_version(&self.0)
    }

    fn has_patch(&self, mark: &str) -> bool {
        has_patch(&self.0, mark)
    }

    fn dump(
        &self,
        req: &DumpRequest,
        on_notify: NotifyHook<'_>,
    ) -> Result<Notifications, CriuError> {
        dump(req, on_notify)
    }
}
