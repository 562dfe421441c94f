//! ferry's eBPF data plane: C programs in `c/` (built by build.rs with
//! clang), loaded and driven through aya.
//!
//! [`OwnershipFilter`] is the node's port ownership on the shared public
//! address: tc programs on the public interface that pass only the ports
//! this node owns (as packets for this host) and drop everything else, and
//! that cut a migrating process's ports off in both directions.

mod error;
mod maps;
mod ownership;
mod replay;

pub use error::DataPlaneError;
pub use ownership::{CaptureKind, CapturedPacket, Counters, OwnershipFilter, PortState, Protocol};
pub use replay::{ReplayError, Replayer};
