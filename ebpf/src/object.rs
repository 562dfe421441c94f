//! What every loaded object is asked for: one of its programs, of the type
//! the caller expects, and a hash map emptied for another use.

use aya::Ebpf;
use aya::programs::{Program, ProgramError};

use crate::DataPlaneError;
use crate::error::{map_err, prog_err};

/// Program `name` of `ebpf`, as the type `P` it must have (a
/// `SchedClassifier`, an `Iter`, ...).
pub(crate) fn program<'e, P>(
    ebpf: &'e mut Ebpf,
    name: &'static str,
) -> Result<&'e mut P, DataPlaneError>
where
    &'e mut P: TryFrom<&'e mut Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(DataPlaneError::Missing(name))?
        .try_into()
        .map_err(prog_err(name))
}

/// Removes every key of the hash map `name` of `ebpf`, whose keys are `K`
/// and values `V` (a system call per key to list it and one to remove
/// it): a loaded object made ready for another use.
pub(crate) fn clear_hash_map<K: aya::Pod, V: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &'static str,
) -> Result<(), DataPlaneError> {
    let map = ebpf.map_mut(name).ok_or(DataPlaneError::Missing(name))?;
    let mut map: aya::maps::HashMap<&mut aya::maps::MapData, K, V> =
        aya::maps::HashMap::try_from(map).map_err(map_err(name))?;
    let keys = map
        .keys()
        .collect::<Result<Vec<K>, _>>()
        .map_err(map_err(name))?;
    for k in keys {
        map.remove(&k).map_err(map_err(name))?;
    }
    Ok(())
}
