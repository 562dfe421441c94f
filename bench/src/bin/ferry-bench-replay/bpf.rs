//! Just enough of bpf(2) for counting programs: each returns a constant,
//! and the kernel's run statistics (`BPF_ENABLE_STATS`) count the calls.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use anyhow::{Context, Result};

pub const PROG_TYPE_SCHED_CLS: u32 = 3;
pub const PROG_TYPE_NETFILTER: u32 = 32;
pub const ATTACH_NETFILTER: u32 = 45;
pub const ATTACH_TCX_INGRESS: u32 = 46;
const CMD_PROG_LOAD: i32 = 5;
const CMD_OBJ_GET_INFO_BY_FD: i32 = 15;
const CMD_LINK_CREATE: i32 = 28;
const CMD_ENABLE_STATS: i32 = 32;
const NFPROTO_IPV4: u32 = 2;
/// PRE_ROUTING, LOCAL_IN, LOCAL_OUT, POST_ROUTING.
pub const NF_HOOKS: [u32; 4] = [0, 1, 3, 4];
/// `struct bpf_prog_info`: its size and the offset of `run_cnt`.
const PROG_INFO_LEN: usize = 232;
const RUN_CNT_AT: usize = 200;

/// A zeroed `union bpf_attr` (the prefix this file uses).
struct Attr([u8; 152]);

impl Attr {
    fn new() -> Self {
        Self([0; 152])
    }
    fn u32(&mut self, at: usize, v: u32) -> &mut Self {
        self.0[at..at + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(&mut self, at: usize, v: u64) -> &mut Self {
        self.0[at..at + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn call(&mut self, cmd: i32) -> std::io::Result<i32> {
        // SAFETY: the attr buffer is valid for its length and every
        // pointer stored in it refers to memory the caller keeps alive
        // for the call.
        let r =
            unsafe { libc::syscall(libc::SYS_bpf, cmd, self.0.as_mut_ptr(), self.0.len() as u32) };
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(r as i32)
        }
    }
    fn fd(&mut self, cmd: i32) -> std::io::Result<OwnedFd> {
        let fd = self.call(cmd)?;
        // SAFETY: the kernel just returned this new descriptor.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// Run-time statistics on until the descriptor is closed.
pub fn enable_stats() -> Result<OwnedFd> {
    Ok(Attr::new().u32(0, 0).fd(CMD_ENABLE_STATS)?) // BPF_STATS_RUN_TIME
}

/// `r0 = ret; exit`.
pub fn load_counter(prog_type: u32, attach: u32, ret: i32) -> Result<OwnedFd> {
    let insns: [u64; 2] = [0xb7 | (u64::from(ret as u32) << 32), 0x95];
    let license = b"GPL\0";
    let mut log = vec![0u8; 4096];
    let mut name = [0u8; 16];
    name[..11].copy_from_slice(b"ferry_br_ct");
    let mut a = Attr::new();
    a.u32(0, prog_type)
        .u32(4, insns.len() as u32)
        .u64(8, insns.as_ptr() as u64)
        .u64(16, license.as_ptr() as u64)
        .u32(24, 1)
        .u32(28, log.len() as u32)
        .u64(32, log.as_mut_ptr() as u64)
        .u32(68, attach);
    a.0[48..64].copy_from_slice(&name);
    a.fd(CMD_PROG_LOAD).with_context(|| {
        let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
        format!(
            "BPF_PROG_LOAD (type {prog_type}): {}",
            String::from_utf8_lossy(&log[..end])
        )
    })
}

pub fn attach_tcx(prog: &OwnedFd, ifindex: u32) -> Result<OwnedFd> {
    Ok(Attr::new()
        .u32(0, prog.as_raw_fd() as u32)
        .u32(4, ifindex)
        .u32(8, ATTACH_TCX_INGRESS)
        .fd(CMD_LINK_CREATE)?)
}

/// In the calling thread's network namespace.
pub fn attach_netfilter(prog: &OwnedFd, hook: u32) -> Result<OwnedFd> {
    Ok(Attr::new()
        .u32(0, prog.as_raw_fd() as u32)
        .u32(8, ATTACH_NETFILTER)
        .u32(16, NFPROTO_IPV4)
        .u32(20, hook)
        .u32(24, (-100i32) as u32)
        .fd(CMD_LINK_CREATE)?)
}

pub fn run_count(prog: &OwnedFd) -> Result<u64> {
    let mut info = [0u8; PROG_INFO_LEN];
    Attr::new()
        .u32(0, prog.as_raw_fd() as u32)
        .u32(4, PROG_INFO_LEN as u32)
        .u64(8, info.as_mut_ptr() as u64)
        .call(CMD_OBJ_GET_INFO_BY_FD)
        .context("BPF_OBJ_GET_INFO_BY_FD")?;
    Ok(u64::from_ne_bytes(
        info[RUN_CNT_AT..RUN_CNT_AT + 8].try_into().unwrap(),
    ))
}
