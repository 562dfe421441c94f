//! The state of TCP connections read in one pass (c/tcpstate.bpf.c:
//! `ferry_task_tcp_state`, an `iter/task_file` program, and
//! `ferry_tcp_state`, an `iter/tcp` one).
//!
//! Inside the freeze ferryd reads every connection of the migrating
//! process: its sequence numbers, queue sizes, window, options, timestamp
//! and buffer sizes, a dozen getsockopt and ioctl calls each, a thousand
//! connections at a time. An iterator walks the process's descriptors
//! ([`TcpStateReader::read_processes`]) or the network namespace's TCP
//! sockets ([`TcpStateReader::read`]) in the kernel and writes those same
//! fields for the connections asked for ([`TcpStateReader::want`], by
//! socket cookie) into one read.
//! Ask before the freeze (a map update per connection), read inside it,
//! with the process stopped and its packets held (what keeps the fields
//! still). The namespace read is the calling thread's.

use std::io::Read;
use std::mem::{offset_of, size_of};
use std::os::fd::AsFd;

use aya::maps::{HashMap, MapData};
use aya::programs::Iter;
use aya::{Btf, Ebpf, include_bytes_aligned};

use crate::DataPlaneError;
use crate::error::{map_err, prog_err};
use crate::task_iter::iter_of_process;

static OBJECT: &[u8] = include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tcpstate.bpf.o"));

const PROGRAM: &str = "ferry_tcp_state";
const TASK_PROGRAM: &str = "ferry_task_tcp_state";
const TASK_SOCKETS_PROGRAM: &str = "ferry_task_sockets";
const WANTED_MAP: &str = "FERRY_TCPSTATE_WANTED";

/// `struct ferry_tcp_state` (include/ferry_tcpstate.h): one connection, as
/// the kernel holds it; each field names the call that reads it otherwise.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpKernelState {
    /// SO_COOKIE.
    pub cookie: u64,
    /// TCP_INFO's tcpi_state.
    pub state: u32,
    /// TCP_QUEUE_SEQ of the send queue.
    pub write_seq: u32,
    pub snd_una: u32,
    pub snd_nxt: u32,
    /// TCP_QUEUE_SEQ of the receive queue.
    pub rcv_nxt: u32,
    pub copied_seq: u32,
    /// TCP_REPAIR_WINDOW, in its order.
    pub snd_wl1: u32,
    pub snd_wnd: u32,
    pub max_window: u32,
    pub rcv_wnd: u32,
    pub rcv_wup: u32,
    /// SO_SNDBUF and SO_RCVBUF.
    pub sndbuf: i32,
    pub rcvbuf: i32,
    /// Non-zero: urgent data pending (SIOCINQ then counts differently).
    pub urg_data: u32,
    /// TCP_MAXSEG in repair mode.
    pub mss_clamp: u32,
    /// What TCP_TIMESTAMP adds to the TCP clock ([`TcpKernelState::timestamp`]).
    pub tsoffset: u32,
}

const _: () = assert!(size_of::<TcpKernelState>() == 72);
const _: () = assert!(offset_of!(TcpKernelState, state) == 8);
const _: () = assert!(offset_of!(TcpKernelState, rcv_wup) == 48);
const _: () = assert!(offset_of!(TcpKernelState, mss_clamp) == 64);
const _: () = assert!(offset_of!(TcpKernelState, tsoffset) == 68);

/// The clock of the kernel's TCP timestamps, read once for a batch of
/// connections: CLOCK_MONOTONIC (`tcp_clock_ns()`), counted in
/// milliseconds, or in microseconds by a connection that negotiated
/// microsecond timestamps (Linux 6.7+).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpClock {
    ns: u64,
}

impl TcpClock {
    /// The clock now.
    pub fn now() -> std::io::Result<Self> {
        let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)?;
        Ok(Self {
            ns: (t.tv_sec() as u64)
                .saturating_mul(1_000_000_000)
                .saturating_add(t.tv_nsec() as u64),
        })
    }
}

impl TcpKernelState {
    /// SIOCOUTQ: bytes sent or not, not yet acknowledged.
    pub fn outq(&self) -> u32 {
        self.write_seq.wrapping_sub(self.snd_una)
    }

    /// SIOCOUTQNSD: bytes not sent yet.
    pub fn unsent(&self) -> u32 {
        self.write_seq.wrapping_sub(self.snd_nxt)
    }

    /// SIOCINQ of an ESTABLISHED connection without urgent data: bytes
    /// received and not read (no FIN among them: one would have moved the
    /// connection on to CLOSE_WAIT).
    pub fn inq(&self) -> u32 {
        self.rcv_nxt.wrapping_sub(self.copied_seq)
    }

    /// What TCP_TIMESTAMP reads of the connection at `clock`, without
    /// the call (`do_tcp_getsockopt()`): the clock, in the connection's
    /// ticks (microseconds when `usec`, TCP_INFO's TCPI_OPT_USEC_TS), plus
    /// its offset. Linux 6.7+ keeps in the value's low bit whether the
    /// ticks are microseconds, and TCP_TIMESTAMP's setter takes it from
    /// there; earlier kernels neither set nor read the bit, and clearing
    /// it there moves the timestamp back at most one tick, which PAWS
    /// tolerates (TCP_PAWS_WINDOW) and a freeze's milliseconds outgrow.
    pub fn timestamp(&self, clock: TcpClock, usec: bool) -> u32 {
        let ticks = if usec {
            clock.ns / 1_000
        } else {
            clock.ns / 1_000_000
        };
        // The kernel's clock, truncated to 32 bits as its tcp_time_stamp.
        let at = (ticks as u32).wrapping_add(self.tsoffset);
        if usec { at | 1 } else { at & !1 }
    }

    /// One record as the program wrote it (`bytes` holds at least one).
    fn parse(bytes: &[u8]) -> Self {
        let at = |o: usize| u32::from_ne_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        Self {
            cookie: u64::from_ne_bytes(bytes[..8].try_into().expect("8 bytes")),
            state: at(offset_of!(Self, state)),
            write_seq: at(offset_of!(Self, write_seq)),
            snd_una: at(offset_of!(Self, snd_una)),
            snd_nxt: at(offset_of!(Self, snd_nxt)),
            rcv_nxt: at(offset_of!(Self, rcv_nxt)),
            copied_seq: at(offset_of!(Self, copied_seq)),
            snd_wl1: at(offset_of!(Self, snd_wl1)),
            snd_wnd: at(offset_of!(Self, snd_wnd)),
            max_window: at(offset_of!(Self, max_window)),
            rcv_wnd: at(offset_of!(Self, rcv_wnd)),
            rcv_wup: at(offset_of!(Self, rcv_wup)),
            sndbuf: at(offset_of!(Self, sndbuf)) as i32,
            rcvbuf: at(offset_of!(Self, rcvbuf)) as i32,
            urg_data: at(offset_of!(Self, urg_data)),
            mss_clamp: at(offset_of!(Self, mss_clamp)),
            tsoffset: at(offset_of!(Self, tsoffset)),
        }
    }
}

/// `struct ferry_task_socket` (include/ferry_tcpstate.h): one socket
/// descriptor of a process, as [`TcpStateReader::list_sockets`] lists it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TaskSocket {
    /// The socket's inode (fstat's st_ino).
    pub inode: u64,
    /// The descriptor's number in the process.
    pub fd: u32,
    /// SO_DOMAIN (0: the socket had no sock, being released).
    pub family: u16,
    /// SO_TYPE.
    pub kind: u16,
    /// SO_PROTOCOL.
    pub protocol: u16,
    /// The socket's state (TCP_INFO's tcpi_state for a TCP one).
    pub state: u8,
}

/// The size of one `struct ferry_task_socket`.
const TASK_SOCKET_LEN: usize = 24;

impl TaskSocket {
    /// One record as the program wrote it (`bytes` holds at least one).
    fn parse(bytes: &[u8]) -> Self {
        let u16_at = |o: usize| u16::from_ne_bytes(bytes[o..o + 2].try_into().expect("2 bytes"));
        Self {
            inode: u64::from_ne_bytes(bytes[..8].try_into().expect("8 bytes")),
            fd: u32::from_ne_bytes(bytes[8..12].try_into().expect("4 bytes")),
            family: u16_at(12),
            kind: u16_at(14),
            protocol: u16_at(16),
            state: bytes[18],
        }
    }
}

/// The loaded iterators and the cookies they report.
pub struct TcpStateReader {
    ebpf: Ebpf,
    wanted: usize,
    /// Whether the per-process iterators loaded and link with a task
    /// filter (`bpf_sock_from_file`, Linux 5.11+; the filter, 6.1+).
    by_task: bool,
}

impl std::fmt::Debug for TcpStateReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStateReader")
            .field("wanted", &self.wanted)
            .finish()
    }
}

/// Readers given back by earlier migrations ([`TcpStateReader::give_back`]),
/// for the next ones: loading one (BTF, two programs through the verifier,
/// a trial link) took 44-49 ms of CPU at each migration's pre-read, right
/// before the freeze, on the cores the migrating process needs. Each
/// migration has a reader of its own; the pool holds as many as ran at
/// once, up to [`SPARE_READERS`].
static SPARE: std::sync::Mutex<Vec<TcpStateReader>> = std::sync::Mutex::new(Vec::new());

/// The most readers kept for later migrations.
const SPARE_READERS: usize = 4;

impl TcpStateReader {
    /// A reader asking for no connection: one an earlier migration gave
    /// back (its map emptied here, one system call per connection it had
    /// asked for), or a new one ([`Self::load`]). Blocking.
    pub fn take() -> Result<Self, DataPlaneError> {
        let spare = SPARE.lock().unwrap_or_else(|p| p.into_inner()).pop();
        if let Some(mut reader) = spare {
            match reader.forget_wanted() {
                Ok(()) => return Ok(reader),
                Err(e) => {
                    tracing::debug!(error = %e, "a spare TCP state reader could not be emptied; loading one")
                }
            }
        }
        Self::load()
    }

    /// Keeps this reader for a later migration's [`Self::take`] (no
    /// system call: it is emptied when taken).
    pub fn give_back(self) {
        let mut spare = SPARE.lock().unwrap_or_else(|p| p.into_inner());
        if spare.len() < SPARE_READERS {
            spare.push(self);
        }
    }

    /// How many readers wait in the pool for a later migration.
    pub fn spare() -> usize {
        SPARE.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Forgets every connection asked for.
    fn forget_wanted(&mut self) -> Result<(), DataPlaneError> {
        if self.wanted == 0 {
            return Ok(());
        }
        crate::object::clear_hash_map::<u64, u8>(&mut self.ebpf, WANTED_MAP)?;
        self.wanted = 0;
        Ok(())
    }

    /// Loads the programs, relocated against this kernel's BTF (blocking:
    /// the verifier runs). Fails on a kernel without BTF or TCP iterators
    /// (before 5.9); the caller then reads each connection by its calls.
    /// The per-process one is kept where the kernel takes it and its task
    /// filter ([`Self::reads_by_process`]).
    pub fn load() -> Result<Self, DataPlaneError> {
        let btf = Btf::from_sys_fs().map_err(|e| DataPlaneError::Btf(e.to_string()))?;
        let mut ebpf = Ebpf::load(OBJECT)?;
        iter_program(&mut ebpf, PROGRAM)?
            .load("tcp", &btf)
            .map_err(prog_err(PROGRAM))?;
        // Loaded, and linked once to this process: a kernel before 6.1
        // loads the program but refuses the link's task filter.
        let by_task = match [TASK_PROGRAM, TASK_SOCKETS_PROGRAM]
            .into_iter()
            .try_for_each(|name| {
                let p = iter_program(&mut ebpf, name)?;
                p.load("task_file", &btf).map_err(prog_err(name))?;
                let fd = p.fd().map_err(prog_err(name))?;
                iter_of_process(fd.as_fd(), std::process::id() as i32)
                    .map(drop)
                    .map_err(|e| DataPlaneError::Iter(format!("a task-filtered link: {e}")))
            }) {
            Ok(_) => true,
            Err(e) => {
                tracing::debug!(error = %e, "the per-process TCP state iterator did not load; the namespace's is read");
                false
            }
        };
        Ok(Self {
            ebpf,
            wanted: 0,
            by_task,
        })
    }

    /// Whether [`Self::read_processes`] can read by process (and
    /// [`Self::list_sockets`] list a process's sockets).
    pub fn reads_by_process(&self) -> bool {
        self.by_task
    }

    /// Every socket descriptor of process `pid` (its threads share its
    /// descriptor table; a thread with a table of its own is listed too),
    /// in one pass over its descriptors. Fails if the iterator did not
    /// load or the kernel has no task filter for it (before 6.1).
    pub fn list_sockets(&mut self, pid: i32) -> Result<Vec<TaskSocket>, DataPlaneError> {
        let mut bytes = Vec::with_capacity(TASK_SOCKET_LEN * 64);
        self.read_task_iter(TASK_SOCKETS_PROGRAM, &[pid], &mut bytes)?;
        Ok(whole_records(&bytes, TASK_SOCKET_LEN)?
            .map(TaskSocket::parse)
            .collect())
    }

    /// Appends to `bytes` what the per-process iterator `program` writes
    /// for each process of `pids`, in turn. Fails if the per-process
    /// iterators did not load or link with a task filter.
    fn read_task_iter(
        &mut self,
        program: &'static str,
        pids: &[i32],
        bytes: &mut Vec<u8>,
    ) -> Result<(), DataPlaneError> {
        if !self.by_task {
            return Err(DataPlaneError::Iter(format!(
                "the per-process iterator {program} is not loaded"
            )));
        }
        let prog_fd = iter_program(&mut self.ebpf, program)?
            .fd()
            .map_err(prog_err(program))?;
        for &pid in pids {
            let mut file = iter_of_process(prog_fd.as_fd(), pid)
                .map_err(|e| DataPlaneError::Iter(format!("iterating process {pid}: {e}")))?;
            file.read_to_end(bytes)
                .map_err(|e| DataPlaneError::Iter(e.to_string()))?;
        }
        Ok(())
    }

    fn wanted_map(&mut self) -> Result<HashMap<&mut MapData, u64, u8>, DataPlaneError> {
        HashMap::try_from(
            self.ebpf
                .map_mut(WANTED_MAP)
                .ok_or(DataPlaneError::Missing(WANTED_MAP))?,
        )
        .map_err(map_err(WANTED_MAP))
    }

    /// Adds connections to report, by socket cookie (one system call
    /// each: do it before the freeze).
    pub fn want(&mut self, cookies: impl IntoIterator<Item = u64>) -> Result<(), DataPlaneError> {
        let mut map = self.wanted_map()?;
        let mut added = 0;
        for c in cookies {
            map.insert(c, 1, 0).map_err(map_err(WANTED_MAP))?;
            added += 1;
        }
        self.wanted += added;
        Ok(())
    }

    /// One pass over the descriptors of each process `pids` names: the
    /// state of every connection asked for that one of them holds (once,
    /// however many hold it). It costs their descriptors only, where
    /// [`Self::read`] walks the namespace's whole hash table. Fails if
    /// the iterator did not load or the kernel has no task filter for it
    /// (before 6.1).
    pub fn read_processes(&mut self, pids: &[i32]) -> Result<Vec<TcpKernelState>, DataPlaneError> {
        let record = size_of::<TcpKernelState>();
        let mut bytes = Vec::with_capacity(record * self.wanted.max(1));
        self.read_task_iter(TASK_PROGRAM, pids, &mut bytes)?;
        let mut seen = std::collections::HashSet::new();
        Ok(records(&bytes)?.filter(|r| seen.insert(r.cookie)).collect())
    }

    /// One pass over the calling thread's network namespace: the state of
    /// every connection asked for that still exists, in the kernel's hash
    /// order.
    pub fn read(&mut self) -> Result<Vec<TcpKernelState>, DataPlaneError> {
        let prog = iter_program(&mut self.ebpf, PROGRAM)?;
        let link_id = prog.attach().map_err(prog_err(PROGRAM))?;
        let link = prog.take_link(link_id).map_err(prog_err(PROGRAM))?;
        let mut file = link.into_file().map_err(|source| DataPlaneError::Link {
            name: PROGRAM,
            source,
        })?;
        let record = size_of::<TcpKernelState>();
        let mut bytes = Vec::with_capacity(record * self.wanted.max(1));
        file.read_to_end(&mut bytes)
            .map_err(|e| DataPlaneError::Iter(e.to_string()))?;
        Ok(records(&bytes)?.collect())
    }
}

/// The iterator program `name` of the object.
fn iter_program<'e>(
    ebpf: &'e mut Ebpf,
    name: &'static str,
) -> Result<&'e mut Iter, DataPlaneError> {
    crate::object::program(ebpf, name)
}

/// The records an iterator wrote.
fn records(bytes: &[u8]) -> Result<impl Iterator<Item = TcpKernelState> + '_, DataPlaneError> {
    Ok(whole_records(bytes, size_of::<TcpKernelState>())?.map(TcpKernelState::parse))
}

/// `bytes` cut into the `len`-byte records an iterator wrote, if they are
/// a whole number of them.
pub(crate) fn whole_records(
    bytes: &[u8],
    len: usize,
) -> Result<std::slice::ChunksExact<'_, u8>, DataPlaneError> {
    if !bytes.len().is_multiple_of(len) {
        return Err(DataPlaneError::Iter(format!(
            "{} bytes is no whole number of {len}-byte records",
            bytes.len()
        )));
    }
    Ok(bytes.chunks_exact(len))
}
