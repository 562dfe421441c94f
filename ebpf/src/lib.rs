//! ferry's eBPF data plane: C programs in `c/` (built by build.rs with
//! clang), loaded and driven through aya.
//!
//! [`OwnershipFilter`] is the node's port ownership on the shared public
//! address: tc programs on the public interface that pass only the ports
//! this node owns (as packets for this host) and drop everything else, and
//! that cut a migrating process's ports off in both directions.
//!
//! [`Translator`] keeps a migrated process's in-cluster connections alive
//! from its peers' side: tc programs on the peer node's cluster interface
//! that rewrite the old node's address to the new one and back. Its maps
//! and links can be pinned ([`pin`]) so that the agent restarts without
//! disturbing them.

pub mod coalesce;
mod error;
mod maps;
mod object;
mod ownership;
pub mod pin;
mod replay;
mod sockopt_watch;
mod task_iter;
mod tcpstate;
mod translate;
mod translate_maps;
mod translate_table;
mod vmaflags;

pub use error::DataPlaneError;
pub use ownership::{
    CaptureKind, CapturedPacket, Counters, Flow, FlowState, OwnershipFilter, PortState, Protocol,
};
pub use replay::{MAX_UDP_PAYLOAD, ReplayError, Replayer, udp_datagram};
pub use sockopt_watch::{SockoptWatch, Touched, WatchedConnection, cgroup_v2_dir};
pub use tcpstate::{TaskSocket, TcpClock, TcpKernelState, TcpStateReader};
pub use translate::{RuleAction, RuleState, TranslationCounters, TranslationRule, Translator};
pub use vmaflags::{VmaFlags, VmaFlagsReader};
