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
mod ownership;
pub mod pin;
mod replay;
mod sockopt_watch;
mod tcpstate;
mod translate;
mod translate_maps;

pub use error::DataPlaneError;
pub use ownership::{CaptureKind, CapturedPacket, Counters, OwnershipFilter, PortState, Protocol};
pub use replay::{ReplayError, Replayer};
pub use sockopt_watch::{SockoptWatch, Touched, WatchedConnection, cgroup_v2_dir};
pub use tcpstate::{TcpKernelState, TcpStateReader};
pub use translate::{RuleAction, RuleState, TranslationCounters, TranslationRule, Translator};

/// Removes every key of the hash map `name` of `ebpf`, whose keys are `K`
/// and values `V` (a system call per key to list it and one to remove
/// it): a loaded object made ready for another use.
pub(crate) fn clear_hash_map<K: aya::Pod, V: aya::Pod>(
    ebpf: &mut aya::Ebpf,
    name: &'static str,
) -> Result<(), DataPlaneError> {
    let map = ebpf.map_mut(name).ok_or(DataPlaneError::Missing(name))?;
    let mut map: aya::maps::HashMap<&mut aya::maps::MapData, K, V> =
        aya::maps::HashMap::try_from(map).map_err(error::map_err(name))?;
    let keys = map
        .keys()
        .collect::<Result<Vec<K>, _>>()
        .map_err(error::map_err(name))?;
    for k in keys {
        map.remove(&k).map_err(error::map_err(name))?;
    }
    Ok(())
}
