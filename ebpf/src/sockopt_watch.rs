//! The setsockopt watch of an incremental collective migration
//! (c/sockopts.bpf.c, `ferry_sockopt_watch`).
//!
//! ferryd reads a process's connections' socket options before the
//! freeze, while the process runs, and must know inside the freeze which
//! of them changed since. Options change by setsockopt, and a
//! `cgroup/setsockopt` program sees every such call made by a task of its
//! cgroup (or of one below), before the kernel handles it. [`SockoptWatch`]
//! attaches it to the cgroups of the migrating process tree, for the time
//! of one migration: attach it BEFORE reading the options, so that a call
//! racing with the read is recorded, and ask [`SockoptWatch::touched`]
//! once the tree is frozen. Dropping it detaches and unloads the program:
//! do that as soon as the tree is frozen, since every setsockopt call in
//! the cgroup (CRIU's, ferryd's own, a whole node's when the process is in
//! the root cgroup) runs the program while it is attached.
//!
//! What it cannot see: options set on the socket by a task of another
//! cgroup through a shared or passed descriptor, or by another BPF program
//! (`bpf_setsockopt`); the kernel's own tuning of unlocked buffer sizes,
//! which ferryd reads in the freeze anyway.

use std::collections::HashSet;
use std::io;
use std::mem::{offset_of, size_of};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;

use aya::maps::{Array, HashMap, MapData};
use aya::programs::cgroup_sockopt::CgroupSockoptLinkId;
use aya::programs::{CgroupAttachMode, CgroupSockopt};
use aya::{Ebpf, include_bytes_aligned};

use crate::DataPlaneError;
use crate::error::{map_err, prog_err};

static OBJECT: &[u8] = include_bytes_aligned!(concat!(env!("OUT_DIR"), "/sockopts.bpf.o"));

const PROGRAM: &str = "ferry_sockopt_watch";
const TOUCHED_MAP: &str = "FERRY_SO_TOUCHED";
const LOST_MAP: &str = "FERRY_SO_LOST";
const NETNS_MAP: &str = "FERRY_SO_NETNS";

/// `struct ferry_sockopt_key` (include/ferry_sockopts.h).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct SockoptKey {
    netns: u64,
    family: u32,
    /// Host byte order.
    local_port: u16,
    remote_port: u16,
    /// Network byte order; IPv4 in word 0.
    local_addr: [u32; 4],
    remote_addr: [u32; 4],
}

// SAFETY: SockoptKey is repr(C) and made only of integers and integer
// arrays laid out without padding (8 + 4 + 2 + 2 + 16 + 16 = 48 bytes,
// asserted below), so every bit pattern is valid and it may be copied to
// and from the kernel as plain bytes.
unsafe impl aya::Pod for SockoptKey {}

const _: () = assert!(size_of::<SockoptKey>() == 48);
const _: () = assert!(offset_of!(SockoptKey, netns) == 0);
const _: () = assert!(offset_of!(SockoptKey, family) == 8);
const _: () = assert!(offset_of!(SockoptKey, local_port) == 12);
const _: () = assert!(offset_of!(SockoptKey, remote_port) == 14);
const _: () = assert!(offset_of!(SockoptKey, local_addr) == 16);
const _: () = assert!(offset_of!(SockoptKey, remote_addr) == 32);

/// One TCP connection, as its own socket sees it, in the network
/// namespace with cookie `netns` (`SO_NETNS_COOKIE`). IPv6 addresses carry
/// neither flow label nor scope: two views of one socket compare equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WatchedConnection {
    pub netns: u64,
    pub local: SocketAddr,
    pub remote: SocketAddr,
}

impl WatchedConnection {
    pub fn new(netns: u64, local: SocketAddr, remote: SocketAddr) -> Self {
        let bare = |a: SocketAddr| SocketAddr::new(a.ip(), a.port());
        Self {
            netns,
            local: bare(local),
            remote: bare(remote),
        }
    }

    fn from_key(k: &SockoptKey) -> Option<Self> {
        let ip = |words: &[u32; 4]| -> Option<IpAddr> {
            match i32::try_from(k.family).ok()? {
                libc::AF_INET => Some(IpAddr::V4(Ipv4Addr::from(words[0].to_ne_bytes()))),
                libc::AF_INET6 => {
                    let mut b = [0u8; 16];
                    for (i, w) in words.iter().enumerate() {
                        b[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
                    }
                    Some(IpAddr::V6(Ipv6Addr::from(b)))
                }
                _ => None,
            }
        };
        Some(Self::new(
            k.netns,
            SocketAddr::new(ip(&k.local_addr)?, k.local_port),
            SocketAddr::new(ip(&k.remote_addr)?, k.remote_port),
        ))
    }
}

/// What the watch saw since it was attached.
#[derive(Debug, Default, Clone)]
pub struct Touched {
    /// The connections some setsockopt call was made on.
    pub connections: HashSet<WatchedConnection>,
    /// Calls whose connection did not fit in the map: when not 0, any
    /// connection may have changed.
    pub lost: u64,
}

impl Touched {
    /// Whether `c`'s options may have changed since the attach.
    pub fn may_have_changed(&self, c: &WatchedConnection) -> bool {
        self.lost > 0 || self.connections.contains(c)
    }
}

/// `ferry_sockopt_watch` attached to some cgroups, until dropped. Dropped,
/// it detaches and its loaded program waits for the next watch (see
/// [`SPARE`]).
pub struct SockoptWatch {
    /// `None` only while dropping.
    ebpf: Option<Ebpf>,
    cgroups: Vec<PathBuf>,
    links: Vec<CgroupSockoptLinkId>,
}

/// Loaded programs of earlier watches, detached, for the next ones:
/// loading one (the verifier) and attaching it took 28-35 ms of CPU at
/// every migration's pre-read, right before the freeze. At most
/// [`SPARE_WATCHES`] are kept.
static SPARE: std::sync::Mutex<Vec<Ebpf>> = std::sync::Mutex::new(Vec::new());

/// The most detached programs kept for later watches.
const SPARE_WATCHES: usize = 4;

impl std::fmt::Debug for SockoptWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SockoptWatch")
            .field("cgroups", &self.cgroups)
            .finish()
    }
}

impl SockoptWatch {
    /// Loads the program and attaches it to every directory of `cgroups`
    /// (cgroup v2; programs attached there by others stay and run too). Blocking: a load
    /// takes milliseconds.
    pub fn attach(cgroups: &[PathBuf]) -> Result<Self, DataPlaneError> {
        let spare = SPARE.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut ebpf = match spare.map(emptied) {
            Some(Ok(ebpf)) => ebpf,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "a spare setsockopt watch could not be emptied; loading one");
                loaded()?
            }
            None => loaded()?,
        };
        let prog = program(&mut ebpf)?;
        let mut attached = Vec::new();
        let mut links = Vec::new();
        for dir in cgroups {
            if attached.contains(dir) {
                continue;
            }
            let file = std::fs::File::open(dir).map_err(|source| DataPlaneError::Cgroup {
                path: dir.clone(),
                source,
            })?;
            // A link (aya makes one on 5.7+): the kernel takes no flags for
            // it and always attaches it beside other programs, as with
            // BPF_F_ALLOW_MULTI; "Single" is aya's name for no flags.
            links.push(
                prog.attach(file, CgroupAttachMode::Single)
                    .map_err(prog_err(PROGRAM))?,
            );
            attached.push(dir.clone());
        }
        Ok(Self {
            ebpf: Some(ebpf),
            cgroups: attached,
            links,
        })
    }

    /// Loads a program for the next watch if none is spare. The first
    /// migration from a node paid the load (the verifier: 32-93 ms here)
    /// in its pre-read, after pre-copy's last round, and every page the
    /// process wrote meanwhile joined the freeze (~100 more at 1,000
    /// pages/s). The source calls it as a migration starts, so the load
    /// runs beside the rounds. Blocking.
    pub fn load_spare() -> Result<(), DataPlaneError> {
        if !SPARE.lock().unwrap_or_else(|p| p.into_inner()).is_empty() {
            return Ok(());
        }
        let ebpf = loaded()?;
        let mut spare = SPARE.lock().unwrap_or_else(|p| p.into_inner());
        if spare.len() < SPARE_WATCHES {
            spare.push(ebpf);
        }
        Ok(())
    }

    fn ebpf(&self) -> &Ebpf {
        self.ebpf.as_ref().expect("taken only by drop")
    }

    fn ebpf_mut(&mut self) -> &mut Ebpf {
        self.ebpf.as_mut().expect("taken only by drop")
    }

    /// The program's id in the kernel (`bpftool prog show id N`).
    pub fn program_id(&self) -> Result<u32, DataPlaneError> {
        let prog = self
            .ebpf()
            .program(PROGRAM)
            .ok_or(DataPlaneError::Missing(PROGRAM))?;
        prog.info().map(|i| i.id()).map_err(prog_err(PROGRAM))
    }

    /// From now on, records only connections of the network namespace
    /// with cookie `netns` (`SO_NETNS_COOKIE`); until then, of any. Calls
    /// of other namespaces (the cgroup may hold a whole node) then cost no
    /// map update.
    pub fn only_netns(&mut self, netns: u64) -> Result<(), DataPlaneError> {
        let map = self
            .ebpf_mut()
            .map_mut(NETNS_MAP)
            .ok_or(DataPlaneError::Missing(NETNS_MAP))?;
        let mut cfg: Array<&mut MapData, u64> = Array::try_from(map).map_err(map_err(NETNS_MAP))?;
        cfg.set(0, netns, 0).map_err(map_err(NETNS_MAP))
    }

    /// The cgroups it is attached to.
    pub fn cgroups(&self) -> &[PathBuf] {
        &self.cgroups
    }

    /// The connections touched since the attach.
    pub fn touched(&self) -> Result<Touched, DataPlaneError> {
        let map = |name: &'static str| self.ebpf().map(name).ok_or(DataPlaneError::Missing(name));
        let touched: HashMap<&MapData, SockoptKey, u32> =
            HashMap::try_from(map(TOUCHED_MAP)?).map_err(map_err(TOUCHED_MAP))?;
        let lost: Array<&MapData, u64> =
            Array::try_from(map(LOST_MAP)?).map_err(map_err(LOST_MAP))?;
        let mut out = Touched {
            lost: lost.get(&0, 0).map_err(map_err(LOST_MAP))?,
            ..Touched::default()
        };
        for key in touched.keys() {
            let key = key.map_err(map_err(TOUCHED_MAP))?;
            if let Some(c) = WatchedConnection::from_key(&key) {
                out.connections.insert(c);
            }
        }
        Ok(out)
    }
}

/// Detaches, and keeps the loaded program for the next watch; one that
/// does not detach is dropped whole (the kernel then detaches and unloads
/// it).
impl Drop for SockoptWatch {
    fn drop(&mut self) {
        let Some(mut ebpf) = self.ebpf.take() else {
            return;
        };
        let detached = program(&mut ebpf).and_then(|prog| {
            self.links
                .drain(..)
                .try_for_each(|l| prog.detach(l).map_err(prog_err(PROGRAM)))
        });
        match detached {
            Ok(()) => {
                let mut spare = SPARE.lock().unwrap_or_else(|p| p.into_inner());
                if spare.len() < SPARE_WATCHES {
                    spare.push(ebpf);
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "detaching the setsockopt watch; dropped whole")
            }
        }
    }
}

/// The object loaded, its program through the verifier.
fn loaded() -> Result<Ebpf, DataPlaneError> {
    let mut ebpf = Ebpf::load(OBJECT)?;
    program(&mut ebpf)?.load().map_err(prog_err(PROGRAM))?;
    Ok(ebpf)
}

fn program(ebpf: &mut Ebpf) -> Result<&mut CgroupSockopt, DataPlaneError> {
    crate::object::program(ebpf, PROGRAM)
}

/// A detached object of an earlier watch, its maps as a new one's: no
/// connection touched, none lost, every namespace recorded.
fn emptied(mut ebpf: Ebpf) -> Result<Ebpf, DataPlaneError> {
    crate::object::clear_hash_map::<SockoptKey, u32>(&mut ebpf, TOUCHED_MAP)?;
    for name in [LOST_MAP, NETNS_MAP] {
        let map = ebpf.map_mut(name).ok_or(DataPlaneError::Missing(name))?;
        let mut a: Array<&mut MapData, u64> = Array::try_from(map).map_err(map_err(name))?;
        a.set(0, 0, 0).map_err(map_err(name))?;
    }
    Ok(ebpf)
}

/// The cgroup v2 directory of process `pid`: the unified hierarchy's
/// mount point (as this process sees it) joined with the `0::` line of
/// /proc/PID/cgroup. NotFound when no cgroup v2 hierarchy is mounted.
pub fn cgroup_v2_dir(pid: i32) -> io::Result<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    let mount = cgroup2_mount(&mountinfo).ok_or_else(|| {
        io::Error::new(io::ErrorKind::NotFound, "no cgroup2 file system is mounted")
    })?;
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let path = cgroups
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("process {pid} is in no cgroup v2 (no 0:: line in /proc/{pid}/cgroup)"),
            )
        })?;
    Ok(mount.join(path.trim_start_matches('/')))
}

/// The mount point of the first cgroup2 file system in a mountinfo text
/// ("... mountpoint ... - cgroup2 ...").
fn cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        if right.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let point = left.split_whitespace().nth(4)?;
        Some(PathBuf::from(unescape(point)))
    })
}

/// mountinfo escapes space, tab, newline and backslash as three octal
/// digits; other bytes (also non-UTF-8 ones) are as they are.
fn unescape(s: &str) -> std::ffi::OsString {
    use std::os::unix::ffi::OsStringExt;
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).filter(|d| {
            b[i] == b'\\' && d[0] <= b'3' && d.iter().all(|c| (b'0'..=b'7').contains(c))
        });
        match octal {
            Some(d) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    std::ffi::OsString::from_vec(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cgroup2_mount_is_found_among_v1_hierarchies() {
        let info = "\
29 23 0:26 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
31 29 0:28 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
40 29 0:37 / /sys/fs/cgroup/un\\040ified rw,relatime - cgroup2 cgroup2 rw
";
        assert_eq!(
            cgroup2_mount(info),
            Some(PathBuf::from("/sys/fs/cgroup/un ified"))
        );
        assert_eq!(cgroup2_mount("29 23 0:26 / /x rw - tmpfs tmpfs rw\n"), None);
    }

    #[test]
    fn keys_become_connections_without_flow_label_or_scope() {
        let v4 = SockoptKey {
            netns: 7,
            family: libc::AF_INET as u32,
            local_port: 80,
            remote_port: 40000,
            local_addr: [u32::from_ne_bytes([198, 18, 0, 1]), 0, 0, 0],
            remote_addr: [u32::from_ne_bytes([198, 18, 0, 2]), 0, 0, 0],
        };
        let c = WatchedConnection::from_key(&v4).unwrap();
        assert_eq!(c.local, "198.18.0.1:80".parse().unwrap());
        assert_eq!(c.remote, "198.18.0.2:40000".parse().unwrap());
        assert_eq!(c.netns, 7);
        let scoped: SocketAddr = "[fe80::1%2]:80".parse().unwrap();
        let with_label = SocketAddr::V6(std::net::SocketAddrV6::new(
            "fe80::1".parse().unwrap(),
            80,
            5,
            0,
        ));
        let r: SocketAddr = "[::1]:9".parse().unwrap();
        assert_eq!(
            WatchedConnection::new(1, scoped, r),
            WatchedConnection::new(1, with_label, r)
        );
        let other = SockoptKey { family: 99, ..v4 };
        assert_eq!(WatchedConnection::from_key(&other), None);
    }
}
