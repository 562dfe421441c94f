//! CRIU, driven through its `swrk` RPC mode.
//!
//! rust-criu's `Criu` wrapper has no calls for `--network-lock skip`,
//! `--leave-stopped` or notifications, so ferry speaks the RPC itself on the
//! protobuf types rust-criu exports (`swrk.rs`). Every call here blocks; the
//! engine runs them on tokio's blocking pool.

mod cache;
mod error;
pub mod lazy;
mod sched_hooks;
mod spawn;
mod swrk;
mod version;

pub use cache::{
    CACHE_FILE, CacheDir, DEFAULT_CACHE_DIR, cache_present, default_cache_dir, prepare_cache_dir,
    warm,
};
pub use error::CriuError;
pub use sched_hooks::SchedHooks;
pub use swrk::{
    DumpRequest, LazyDump, Notifications, RestoreOutcome, RestoreRequest, TcpConnections, Worker,
    dump, restore, start_restore_worker,
};
pub use version::{
    CONNS_OUT_IMAGE_PREFIX, CONNS_OUT_MARK, CriuVersion, DUMP_ROLLBACK_MARK, FERRY_PATCHES,
    INHERITED_TCP_MARK, MIN_CRIU_VERSION, OPTS_BY_CALLER_MARK, TCP_BY_PIDFD_MARK, TCP_TABLE_MARK,
    has_patch, missing_patches, probe_version, require_patch,
};
