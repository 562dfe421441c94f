//! A process's mappings with their kernel flags, without a page walk
//! (c/vmaflags.bpf.c): what CRIU's dump reads from `/proc/<pid>/smaps`'
//! "VmFlags:" lines, whose page counts cost ~15 ms a GiB in the freeze.

use std::fs::File;
use std::io::Read;
use std::os::fd::AsFd;

use aya::programs::Iter;
use aya::{Btf, Ebpf, include_bytes_aligned};

use crate::DataPlaneError;
use crate::error::prog_err;
use crate::task_iter::iter_of_process;
use crate::tcpstate::whole_records;

static OBJECT: &[u8] = include_bytes_aligned!(concat!(env!("OUT_DIR"), "/vmaflags.bpf.o"));
const PROGRAM: &str = "ferry_vma_flags";

/// One mapping: its range and its `vm_flags` word (`struct
/// ferry_vma_flags`, c/../include/ferry_vmaflags.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmaFlags {
    pub start: u64,
    pub end: u64,
    pub flags: u64,
}

/// The size of one record.
pub const VMA_FLAGS_RECORD: usize = 24;

impl VmaFlags {
    fn parse(b: &[u8]) -> Self {
        let word = |i: usize| u64::from_ne_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Self {
            start: word(0),
            end: word(8),
            flags: word(16),
        }
    }

    /// The records an iterator wrote.
    pub fn parse_all(bytes: &[u8]) -> Result<Vec<Self>, DataPlaneError> {
        Ok(whole_records(bytes, VMA_FLAGS_RECORD)?
            .map(Self::parse)
            .collect())
    }
}

/// The loaded iterator.
pub struct VmaFlagsReader {
    ebpf: Ebpf,
}

impl std::fmt::Debug for VmaFlagsReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmaFlagsReader").finish_non_exhaustive()
    }
}

impl VmaFlagsReader {
    /// Loads the program, relocated against this kernel's BTF, and links
    /// it once to this process (blocking: the verifier runs). Fails on a
    /// kernel without BTF, task_vma iterators (5.12) or their task filter
    /// (6.1): CRIU then reads smaps.
    pub fn load() -> Result<Self, DataPlaneError> {
        let btf = Btf::from_sys_fs().map_err(|e| DataPlaneError::Btf(e.to_string()))?;
        let mut ebpf = Ebpf::load(OBJECT)?;
        let mut reader = {
            let p: &mut Iter = crate::object::program(&mut ebpf, PROGRAM)?;
            p.load("task_vma", &btf).map_err(prog_err(PROGRAM))?;
            Self { ebpf }
        };
        reader.read(std::process::id() as i32)?;
        Ok(reader)
    }

    /// An iterator over process `pid`'s mappings, which runs when read
    /// (CRIU reads it once the process is stopped).
    pub fn open(&mut self, pid: i32) -> Result<File, DataPlaneError> {
        let p: &mut Iter = crate::object::program(&mut self.ebpf, PROGRAM)?;
        let fd = p.fd().map_err(prog_err(PROGRAM))?;
        iter_of_process(fd.as_fd(), pid).map_err(|e| {
            DataPlaneError::Iter(format!("iterating the mappings of process {pid}: {e}"))
        })
    }

    /// Process `pid`'s mappings now, in address order.
    pub fn read(&mut self, pid: i32) -> Result<Vec<VmaFlags>, DataPlaneError> {
        let mut bytes = Vec::with_capacity(VMA_FLAGS_RECORD * 256);
        self.open(pid)?.read_to_end(&mut bytes).map_err(|e| {
            DataPlaneError::Iter(format!("reading the mappings of process {pid}: {e}"))
        })?;
        VmaFlags::parse_all(&bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_parse_and_partial_ones_are_refused() {
        let mut b = Vec::new();
        for w in [0x1000u64, 0x3000, 0x73] {
            b.extend_from_slice(&w.to_ne_bytes());
        }
        assert_eq!(
            VmaFlags::parse_all(&b).unwrap(),
            vec![VmaFlags {
                start: 0x1000,
                end: 0x3000,
                flags: 0x73
            }]
        );
        b.push(0);
        assert!(VmaFlags::parse_all(&b).is_err());
    }
}
