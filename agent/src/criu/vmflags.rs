//! The mappings' flags for CRIU's dump without `/proc/<pid>/smaps`
//! (`xtask/criu/vma-flags-without-smaps.patch`, external
//! `ferry:vma-flags`).
//!
//! CRIU reads smaps for one line per mapping, "VmFlags:" (MAP_GROWSDOWN,
//! mlock, madvise advice...), but the kernel also counts every resident
//! page of every mapping for smaps' other lines: ~15 ms a GiB of the
//! freeze on this machine. ferryd instead opens, before the freeze, one
//! BPF iterator per process of the tree (`ferry_ebpf::VmaFlagsReader`:
//! each mapping's range and `vm_flags` word, read when CRIU reads it, the
//! process stopped) and lists them in [`FILE`] with the bit of each
//! mnemonic CRIU reads; the patch reads `/proc/<pid>/maps` (no page walk)
//! and spells each mapping's flags from its word. A process without an
//! iterator (forked since, or one whose flags this cannot spell) is read
//! from smaps as before, and so is one whose mappings the iterator and
//! maps do not agree on.
//!
//! `vm_flags`' bits are not ABI (the high ones moved between kernels), so
//! the bits are learned on this kernel, once per ferryd: it makes a
//! mapping with each flag ([`PROBES`]), reads its own mappings both ways,
//! and takes the bit that differs; then checks the whole table against
//! every mapping of its own. Anything that does not add up leaves CRIU on
//! smaps.
//!
//! File layout, host byte order: `{ u32 magic "FVF1", u32 mnemonics, u32
//! processes, u32 0 }`, then per mnemonic `{ char name[2], u8 bit, u8 0 }`,
//! then per process `{ i32 pid, i32 fd }` (the iterator's descriptor, which
//! CRIU inherits at that number).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use ferry_ebpf::{VmaFlags, VmaFlagsReader};

use super::CriuError;

/// The file CRIU reads, in the image directory.
pub const FILE: &str = "ferry-vmflags.img";
const MAGIC: u32 = 0x3146_5646; // "FVF1"

/// The mnemonics CRIU's dump reads (`__parse_vmflags` in
/// criu/proc_parse.c), but "ss" (a shadow stack: no mapping made here
/// has one, so a process that uses shadow stacks is left to smaps).
const CRIU_READS: [&str; 15] = [
    "gd", "lo", "nr", "ht", "dp", "sr", "rr", "dc", "dd", "mg", "hg", "nh", "wf", "io", "pf",
];

/// Flags no mapping made here can have (a device's, hugetlbfs'), with
/// their bit in include/linux/mm.h, the same from 2.6 to 6.18: VM_PFNMAP,
/// VM_IO, VM_HUGETLB.
const FIXED: [(&str, u8); 3] = [("pf", 10), ("io", 14), ("ht", 22)];

/// How a probe mapping gets its flag.
#[derive(Debug, Clone, Copy)]
enum Probe {
    /// mmap(2) with these flags besides MAP_ANONYMOUS, and MAP_PRIVATE
    /// unless they are a mapping type of their own (`own_type`:
    /// MAP_DROPPABLE).
    Map {
        flags: i32,
        own_type: bool,
    },
    Advise(i32),
    Lock,
}

/// MAP_DROPPABLE (Linux 6.11), a mapping type of its own.
const MAP_DROPPABLE: i32 = 0x08;

/// One mapping per learned mnemonic; a kernel that refuses the call
/// (EINVAL: no KSM, no THP, no droppable mappings) can have no such
/// mapping, so that mnemonic is not needed. "dp" last: a droppable
/// mapping is also wipe-on-fork and no-huge-page, learned before it.
const PROBES: [(&str, Probe); 12] = [
    (
        "gd",
        Probe::Map {
            flags: libc::MAP_GROWSDOWN,
            own_type: false,
        },
    ),
    (
        "nr",
        Probe::Map {
            flags: libc::MAP_NORESERVE,
            own_type: false,
        },
    ),
    ("lo", Probe::Lock),
    ("sr", Probe::Advise(libc::MADV_SEQUENTIAL)),
    ("rr", Probe::Advise(libc::MADV_RANDOM)),
    ("dc", Probe::Advise(libc::MADV_DONTFORK)),
    ("dd", Probe::Advise(libc::MADV_DONTDUMP)),
    ("mg", Probe::Advise(libc::MADV_MERGEABLE)),
    ("hg", Probe::Advise(libc::MADV_HUGEPAGE)),
    ("nh", Probe::Advise(libc::MADV_NOHUGEPAGE)),
    ("wf", Probe::Advise(libc::MADV_WIPEONFORK)),
    (
        "dp",
        Probe::Map {
            flags: MAP_DROPPABLE,
            own_type: true,
        },
    ),
];

/// Which bit of `vm_flags` each mnemonic CRIU reads is on this kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mnemonics(BTreeMap<&'static str, u8>);

impl Mnemonics {
    /// The mnemonics of `flags` this table knows, as smaps would print
    /// them (in the table's order, which CRIU does not mind).
    pub fn spell(&self, flags: u64) -> BTreeSet<&'static str> {
        self.0
            .iter()
            .filter(|(_, bit)| flags & (1 << **bit) != 0)
            .map(|(m, _)| *m)
            .collect()
    }
}

/// Why CRIU reads smaps instead.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct Unavailable(String);

/// The loaded iterator and the learned bits, once per ferryd.
struct Learned {
    reader: Mutex<VmaFlagsReader>,
    mnemonics: Mnemonics,
}

static LEARNED: OnceLock<Result<Learned, Unavailable>> = OnceLock::new();

fn learned() -> &'static Result<Learned, Unavailable> {
    LEARNED.get_or_init(|| {
        let mut reader = VmaFlagsReader::load()
            .map_err(|e| Unavailable(format!("the mappings' iterator did not load: {e}")))?;
        // Another thread of this process may map or unmap between the two
        // reads of its mappings: a mismatch is tried again, twice.
        let mut tries = 0;
        let mnemonics = loop {
            match learn(&mut reader) {
                Ok(m) => break m,
                Err(e) if tries < 2 => {
                    tracing::debug!(error = %e, "learning the vm_flags bits again");
                    tries += 1;
                }
                Err(e) => return Err(e),
            }
        };
        tracing::debug!(?mnemonics, "vm_flags bits learned for CRIU");
        Ok(Learned {
            reader: Mutex::new(reader),
            mnemonics,
        })
    })
}

/// Whether this ferryd can hand CRIU the mappings' flags (loads and
/// learns on the first call; blocking).
pub fn available() -> Result<(), Unavailable> {
    learned().as_ref().map(drop).map_err(Clone::clone)
}

/// The iterators CRIU reads: they must stay open until the dump ends.
#[derive(Debug)]
pub struct ForCriu {
    pub files: Vec<File>,
}

impl ForCriu {
    /// Their descriptors, which CRIU inherits at the same numbers.
    pub fn fds(&self) -> Vec<RawFd> {
        self.files.iter().map(AsRawFd::as_raw_fd).collect()
    }
}

/// Opens an iterator for each of `pids` (host PIDs) and writes [`FILE`]
/// into `images_dir`. `Ok(None)`: CRIU is to read smaps (why is logged).
/// Blocking.
pub fn prepare(images_dir: &Path, pids: &[i32]) -> Result<Option<ForCriu>, CriuError> {
    let learned = match learned() {
        Ok(l) => l,
        Err(why) => {
            tracing::debug!(%why, "CRIU reads smaps for the mappings' flags");
            return Ok(None);
        }
    };
    let mut files = Vec::new();
    let mut listed = Vec::new();
    {
        let mut reader = crate::sync::lock(&learned.reader);
        for &pid in pids {
            if uses_shadow_stack(pid) {
                tracing::debug!(pid, "a shadow stack: CRIU reads this process's smaps");
                continue;
            }
            match reader.open(pid) {
                Ok(f) => {
                    listed.push((pid, f.as_raw_fd()));
                    files.push(f);
                }
                // Gone already, or not linkable: CRIU reads smaps.
                Err(e) => tracing::debug!(pid, error = %e, "no mappings' iterator"),
            }
        }
    }
    if files.is_empty() {
        return Ok(None);
    }
    let path = images_dir.join(FILE);
    std::fs::write(&path, encode(&learned.mnemonics, &listed))
        .map_err(|source| CriuError::Io { path, source })?;
    Ok(Some(ForCriu { files }))
}

/// Whether `name` is [`FILE`]: ferryd's note to its own CRIU, which the
/// destination does not need.
pub fn is_vmflags_file(name: &str) -> bool {
    name == FILE
}

fn encode(mnemonics: &Mnemonics, listed: &[(i32, RawFd)]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(MAGIC.to_ne_bytes());
    b.extend((mnemonics.0.len() as u32).to_ne_bytes());
    b.extend((listed.len() as u32).to_ne_bytes());
    b.extend(0u32.to_ne_bytes());
    for (m, bit) in &mnemonics.0 {
        b.extend(m.as_bytes());
        b.push(*bit);
        b.push(0);
    }
    for (pid, fd) in listed {
        b.extend(pid.to_ne_bytes());
        b.extend(fd.to_ne_bytes());
    }
    b
}

/// Whether `pid` has shadow stacks on (x86 user shadow stack, Linux 6.6):
/// their mappings' "ss" is not learned here.
fn uses_shadow_stack(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
        s.lines()
            .filter(|l| l.starts_with("x86_Thread_features:"))
            .any(|l| l.split_whitespace().any(|w| w == "shstk"))
    })
}

/// One probe mapping, unmapped on drop.
struct ProbeMapping {
    addr: *mut libc::c_void,
    len: usize,
}

impl Drop for ProbeMapping {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` are a mapping this value made and nothing
        // else refers to.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf reads a constant.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

/// A one-page anonymous mapping with `probe`'s flag; `Ok(None)` if this
/// kernel refuses it (EINVAL: it has no such mappings).
fn make(probe: Option<Probe>) -> Result<Option<ProbeMapping>, Unavailable> {
    let len = page_size();
    let (extra, own_type) = match probe {
        Some(Probe::Map { flags, own_type }) => (flags, own_type),
        _ => (0, false),
    };
    let kind = if own_type { 0 } else { libc::MAP_PRIVATE };
    // SAFETY: a new anonymous mapping at an address the kernel picks; no
    // memory of this process changes.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            kind | libc::MAP_ANONYMOUS | extra,
            -1,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EINVAL) {
            return Ok(None);
        }
        return Err(Unavailable(format!("a probe mapping: {e}")));
    }
    let m = ProbeMapping { addr, len };
    let r = match probe {
        // SAFETY: advice on, or locking, the mapping just made.
        Some(Probe::Advise(advice)) => unsafe { libc::madvise(addr, len, advice) },
        // SAFETY: as above.
        Some(Probe::Lock) => unsafe { libc::mlock(addr, len) },
        _ => 0,
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EINVAL) {
            return Ok(None);
        }
        return Err(Unavailable(format!("a probe mapping's flag: {e}")));
    }
    Ok(Some(m))
}

/// The mnemonics of smaps' "VmFlags:" lines of this process, by mapping
/// start.
fn own_smaps() -> Result<BTreeMap<u64, (u64, BTreeSet<String>)>, Unavailable> {
    let maps = crate::memtrack::mappings(std::process::id() as i32)
        .map_err(|e| Unavailable(format!("reading /proc/self/smaps: {e}")))?;
    Ok(maps
        .into_iter()
        .map(|m| (m.start, (m.end, m.vm_flags)))
        .collect())
}

/// The mapping of `by_start` holding `addr`.
fn holding<T>(by_start: &BTreeMap<u64, (u64, T)>, addr: u64) -> Option<&T> {
    by_start
        .range(..=addr)
        .next_back()
        .filter(|(_, (end, _))| addr < *end)
        .map(|(_, (_, v))| v)
}

/// Learns the bits ([`PROBES`], [`FIXED`]) and checks them against every
/// mapping of this process.
fn learn(reader: &mut VmaFlagsReader) -> Result<Mnemonics, Unavailable> {
    let base = make(None)?.ok_or_else(|| Unavailable("a plain mapping refused".into()))?;
    let probes: Vec<(&'static str, Option<ProbeMapping>)> = PROBES
        .iter()
        .map(|(m, p)| Ok((*m, make(Some(*p))?)))
        .collect::<Result<_, Unavailable>>()?;
    let smaps = own_smaps()?;
    let words: BTreeMap<u64, (u64, u64)> = reader
        .read(std::process::id() as i32)
        .map_err(|e| Unavailable(format!("reading this process's mappings: {e}")))?
        .into_iter()
        .map(|VmaFlags { start, end, flags }| (start, (end, flags)))
        .collect();
    let both = |addr: *mut libc::c_void| {
        let a = addr as u64;
        Some((holding(&smaps, a)?.clone(), *holding(&words, a)?))
    };
    let relevant = |set: &BTreeSet<String>| -> BTreeSet<String> {
        set.iter()
            .filter(|m| CRIU_READS.contains(&m.as_str()))
            .cloned()
            .collect()
    };
    let (base_names, base_word) =
        both(base.addr).ok_or_else(|| Unavailable("the plain probe mapping not found".into()))?;
    let base_names = relevant(&base_names);
    if !base_names.is_empty() {
        return Err(Unavailable(format!("a plain mapping shows {base_names:?}")));
    }
    let mut table: BTreeMap<&'static str, u8> = FIXED.iter().map(|(m, b)| (*m, *b)).collect();
    for (m, mapping) in &probes {
        let Some(mapping) = mapping else {
            continue;
        };
        let (names, word) = both(mapping.addr)
            .ok_or_else(|| Unavailable(format!("the probe mapping for {m:?} not found")))?;
        // Less what is already learned (a droppable mapping is also "wf"
        // and "nh").
        let mut new_names = relevant(&names);
        // Bits it has and a plain one has not (a plain one may have
        // some it lacks: VM_ACCOUNT beside MAP_NORESERVE).
        let mut new_bits = word & !base_word;
        for known in new_names.clone() {
            if let Some(bit) = table.get(known.as_str()) {
                new_names.remove(&known);
                new_bits &= !(1 << bit);
            }
        }
        if new_names.len() != 1 || !new_names.contains(*m) || new_bits.count_ones() != 1 {
            return Err(Unavailable(format!(
                "the mapping made for {m:?} shows {new_names:?} and bits {new_bits:#x} beside a plain one"
            )));
        }
        table.insert(m, new_bits.trailing_zeros() as u8);
    }
    let mnemonics = Mnemonics(table);
    // Every mapping of this process, the probes' too: smaps' mnemonics
    // that the table knows must be the ones it spells.
    for (start, (end, names)) in &smaps {
        // Not in both reads alike: the vsyscall page (in smaps, not a
        // mapping of the process), or a mapping another thread changed
        // between them.
        let Some((_, word)) = words.get(start).filter(|(e, _)| e == end) else {
            continue;
        };
        let known: BTreeSet<&str> = names
            .iter()
            .map(String::as_str)
            .filter(|n| mnemonics.0.contains_key(n))
            .collect();
        if mnemonics.spell(*word) != known {
            return Err(Unavailable(format!(
                "mapping {start:#x}-{end:#x}: smaps says {known:?}, the table {:?}",
                mnemonics.spell(*word)
            )));
        }
    }
    drop(probes);
    drop(base);
    Ok(mnemonics)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_has_the_layout_the_patch_reads() {
        let t = Mnemonics([("gd", 8u8), ("dd", 26)].into_iter().collect());
        let b = encode(&t, &[(42, 7)]);
        assert_eq!(&b[0..4], &MAGIC.to_ne_bytes());
        assert_eq!(u32::from_ne_bytes(b[4..8].try_into().unwrap()), 2);
        assert_eq!(u32::from_ne_bytes(b[8..12].try_into().unwrap()), 1);
        // BTreeMap order: "dd" then "gd".
        assert_eq!(&b[16..20], b"dd\x1a\0");
        assert_eq!(&b[20..24], b"gd\x08\0");
        assert_eq!(i32::from_ne_bytes(b[24..28].try_into().unwrap()), 42);
        assert_eq!(i32::from_ne_bytes(b[28..32].try_into().unwrap()), 7);
        assert_eq!(t.spell((1 << 8) | (1 << 3)), ["gd"].into_iter().collect());
    }

    /// On this machine's kernel, as root: the bits are learned and agree
    /// with smaps for every mapping of the test process.
    #[test]
    fn the_bits_are_learned_on_this_kernel() {
        available().expect("learned");
        let Ok(l) = learned() else { unreachable!() };
        eprintln!("learned: {:?}", l.mnemonics);
        // The flags of 2.6 that every kernel since has at these bits.
        assert_eq!(l.mnemonics.0.get("gd"), Some(&8));
        assert_eq!(l.mnemonics.0.get("dd"), Some(&26));
        assert_eq!(l.mnemonics.0.get("lo"), Some(&13));
    }
}
