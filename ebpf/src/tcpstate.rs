//! The state of TCP connections read in one pass (c/tcpstate.bpf.c,
//! `ferry_tcp_state`, an `iter/tcp` program).
//!
//! Inside the freeze ferryd reads every connection of the migrating
//! process: its sequence numbers, queue sizes, window, options, timestamp
//! and buffer sizes, a dozen getsockopt and ioctl calls each, a thousand
//! connections at a time. The iterator walks the network namespace's TCP
//! sockets in the kernel and writes those same fields for the connections
//! asked for ([`TcpStateReader::want`], by socket cookie) into one read.
//! Ask before the freeze (a map update per connection), read inside it,
//! after turning repair mode on for each connection (TCP repair is what
//! keeps the fields still). The namespace read is the calling thread's.

use std::io::Read;
use std::mem::{offset_of, size_of};

use aya::maps::{HashMap, MapData};
use aya::programs::Iter;
use aya::{Btf, Ebpf, include_bytes_aligned};

use crate::DataPlaneError;
use crate::error::{map_err, prog_err};

static OBJECT: &[u8] = include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tcpstate.bpf.o"));

const PROGRAM: &str = "ferry_tcp_state";
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
    // The C struct's `pad` is this struct's tail padding (u64 alignment).
}

const _: () = assert!(size_of::<TcpKernelState>() == 72);
const _: () = assert!(offset_of!(TcpKernelState, state) == 8);
const _: () = assert!(offset_of!(TcpKernelState, rcv_wup) == 48);
const _: () = assert!(offset_of!(TcpKernelState, mss_clamp) == 64);

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
        }
    }
}

/// The loaded iterator and the cookies it reports.
pub struct TcpStateReader {
    ebpf: Ebpf,
    wanted: usize,
}

impl std::fmt::Debug for TcpStateReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStateReader")
            .field("wanted", &self.wanted)
            .finish()
    }
}

impl TcpStateReader {
    /// Loads the program, relocated against this kernel's BTF (blocking:
    /// the verifier runs). Fails on a kernel without BTF or TCP iterators
    /// (before 5.9); the caller then reads each connection by its calls.
    pub fn load() -> Result<Self, DataPlaneError> {
        let btf = Btf::from_sys_fs().map_err(|e| DataPlaneError::Btf(e.to_string()))?;
        let mut ebpf = Ebpf::load(OBJECT)?;
        let prog: &mut Iter = ebpf
            .program_mut(PROGRAM)
            .ok_or(DataPlaneError::Missing(PROGRAM))?
            .try_into()
            .map_err(prog_err(PROGRAM))?;
        prog.load("tcp", &btf).map_err(prog_err(PROGRAM))?;
        Ok(Self { ebpf, wanted: 0 })
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

    /// One pass over the calling thread's network namespace: the state of
    /// every connection asked for that still exists, in the kernel's hash
    /// order.
    pub fn read(&mut self) -> Result<Vec<TcpKernelState>, DataPlaneError> {
        let prog: &mut Iter = self
            .ebpf
            .program_mut(PROGRAM)
            .ok_or(DataPlaneError::Missing(PROGRAM))?
            .try_into()
            .map_err(prog_err(PROGRAM))?;
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
        if bytes.len() % record != 0 {
            return Err(DataPlaneError::Iter(format!(
                "{} bytes is no whole number of {record}-byte records",
                bytes.len()
            )));
        }
        Ok(bytes
            .chunks_exact(record)
            .map(TcpKernelState::parse)
            .collect())
    }
}
