/// Errors loading, attaching or updating the eBPF programs.
#[derive(Debug, thiserror::Error)]
pub enum DataPlaneError {
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("the eBPF object lacks {0}")]
    Missing(&'static str),
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        source: aya::maps::MapError,
    },
    #[error("cgroup {path}: {source}")]
    Cgroup {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("adding the clsact qdisc to {iface}: {source}")]
    Qdisc {
        iface: String,
        source: aya::programs::tc::TcError,
    },
    #[error("pinned objects: {0}")]
    Pin(#[from] crate::pin::PinError),
    #[error("link of program {name}: {source}")]
    Link {
        name: &'static str,
        source: aya::programs::links::LinkError,
    },
    #[error("the kernel's BTF (needed to relocate the program): {0}")]
    Btf(String),
    #[error("reading the iterator: {0}")]
    Iter(String),
    #[error("translation rule {rule}: {reason}")]
    InvalidRule { rule: String, reason: &'static str },
    #[error(
        "translation rule {rule} conflicts with {existing}: both would claim the same incoming packets"
    )]
    RuleConflict { rule: String, existing: String },
}

/// `DataPlaneError::Program` for program `name`, as a `map_err` argument.
pub(crate) fn prog_err(
    name: &'static str,
) -> impl Fn(aya::programs::ProgramError) -> DataPlaneError {
    move |source| DataPlaneError::Program { name, source }
}

/// `DataPlaneError::Map` for map `name`, as a `map_err` argument.
pub(crate) fn map_err(name: &'static str) -> impl Fn(aya::maps::MapError) -> DataPlaneError {
    move |source| DataPlaneError::Map { name, source }
}
