//! Edits CRIU image files so that chosen inet sockets are restored with
//! another local (source) address.
//!
//! A process dumped on node A holds TCP connections to in-cluster peers
//! from A's cluster IP; restored on node B they must use B's cluster IP
//! (the peer's node translates, see DESIGN.md). CRIU binds a restored
//! socket to the address in its image, so [`rewrite_local_addresses`]
//! changes that address in the images, and [`inet_sockets`] lists what the
//! images hold.
//!
//! [`raise_receive_buffers`] gives sockets a wider receive buffer in the
//! images (`opts.so_rcvbuf`, field 2 of the `sk_opts_entry` in field 14),
//! which CRIU's restore sets with `SO_RCVBUFFORCE`: the destination's UDP
//! sockets then have room for the replay of what arrived during the freeze
//! without a scan of the restored process's descriptors inside it.
//!
//! [`pagemap`] reads which pages of a process a dump holds and where each
//! page's bytes are in the pages file, for moving pages into a dump.
//!
//! # What is edited, and how
//!
//! CRIU 3.x and 4.x keep every inet socket in `files.img` as a `file_entry`
//! (fdinfo.proto) with `type = INETSK (4)` and the socket in field 4,
//! `isk`, an `inet_sk_entry` (sk-inet.proto). Older CRIU wrote bare
//! `inet_sk_entry`s to `inetsk.img`; both are handled. The file is a magic
//! header then `[u32 size][protobuf]` entries, with no payload after these
//! entries (see `image.rs`).
//!
//! The entries are not decoded against a schema (that would drop fields a
//! newer CRIU adds): a wire-format walker copies every field byte for byte
//! except the one word of `src_addr` (field 11, `repeated uint32`) that
//! changes, re-encodes it in the encoding it had (unpacked, as protobuf-c
//! writes proto2, or packed), and fixes the length prefix of `isk` and the
//! entry's size, since a varint's length depends on its value.
//!
//! **Byte order of addresses.** CRIU `memcpy`s the `in_addr` (network byte
//! order) into a `uint32` (`dump_sockaddr`, `restore_sockaddr` in
//! sk-inet.c): the stored integer is the four address bytes read in the
//! host's byte order, `u32::from_ne_bytes(ip.octets())`. On x86_64 and
//! aarch64 198.18.200.1 is stored as `0x01c812c6`: the last octet holds the
//! integer's top bits, so an address ending below 16 is a four-byte varint
//! and any other a five-byte one.
//! An AF_INET address is one word (CRIU 0.1 wrote four, the rest zero; only
//! word 0 is used); an AF_INET6 address is four words, the IPv4 address of
//! an IPv4-mapped one (`::ffff:a.b.c.d`, a dual-stack socket talking IPv4)
//! in word 3. Both are matched and rewritten as IPv4 sockets.
//!
//! # What else a restore needs (CRIU 4.2.1, read in its source)
//!
//! - The addresses of an inet socket are only in `inet_sk_entry`
//!   (`src_addr`/`src_port`, `dst_addr`/`dst_port`). `tcp-stream-<ino>.img`
//!   holds sequence numbers, windows, window scales, MSS, the timestamp and
//!   the queued data, keyed by the socket's `ino`, which does not change.
//!   `ip_opts` holds freebind, tos, ttl, pktinfo and raw-socket options;
//!   `sk_opts` the socket options, among them `so_bound_dev` (a device name
//!   from SO_BINDTODEVICE, which must exist on the destination, rare).
//!   `ifname` is only set for IPv6 link-local addresses. The net namespace
//!   images (`netdev`, `ifaddr`, `route`, `iptables`...) are only written
//!   when CRIU dumps the namespace itself, not when it runs inside the
//!   process's namespace as ferry does. Nothing else needs rewriting.
//! - An established TCP socket is restored by libsoccr in TCP_REPAIR mode:
//!   `bind(src)` *without* IP_FREEBIND (CRIU sets it only for AF_INET6 in
//!   `inet_bind`, which established sockets do not go through), so the new
//!   local address must be configured in the restoring namespace (or
//!   `net.ipv4.ip_nonlocal_bind=1`); the kernel has no repair-mode exemption
//!   there. `connect(dst)` sends nothing in repair mode but needs a route to
//!   the peer. Sequence numbers and timestamps are absolute values from the
//!   image (TCP_TIMESTAMP sets the socket's offset), independent of the
//!   addresses. When repair mode ends the kernel sends a window probe from
//!   the new address: the peer's node must translate by then, or the peer
//!   answers with an RST.
//! - Listening and connected UDP sockets bound to A's cluster IP go through
//!   `inet_bind` and fail with EADDRNOTAVAIL on B unless rewritten too: a
//!   [`SocketMatch`] without `remote` covers them.
//! - Not in the images: an application that cached its own address
//!   (`getsockname`) keeps the old one in memory.

mod error;
mod image;
pub mod mm;
pub mod pagemap;
mod socket;
mod wire;

#[cfg(test)]
mod tests;

use std::fs;
use std::io::Write;
use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

pub use error::ImageError;
pub use wire::WireProblem;

use image::{EntryKind, ImageKind};
use socket::{Fault, InetEntry};

/// IPPROTO_TCP, for [`SocketMatch::proto`].
pub const IPPROTO_TCP: u8 = 6;
/// IPPROTO_UDP, for [`SocketMatch::proto`].
pub const IPPROTO_UDP: u8 = 17;
/// The TCP state of an established connection, as in [`InetSocket::state`].
pub const TCP_ESTABLISHED: u32 = 1;
/// The TCP state of a listening socket, as in [`InetSocket::state`].
pub const TCP_LISTEN: u32 = 10;

/// Which sockets a rewrite applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketMatch {
    /// IP protocol: [`IPPROTO_TCP`], [`IPPROTO_UDP`].
    pub proto: u8,
    /// Local address and port, IPv4 or IPv6; an AF_INET6 socket talking
    /// IPv4 matches an IPv4 address through its IPv4-mapped one.
    pub local: SocketAddr,
    /// The peer; `None` matches any peer, and sockets without one
    /// (listening, unconnected UDP).
    pub remote: Option<SocketAddr>,
}

/// Give the sockets that [`SocketMatch`] selects the local address
/// `new_local` (the port stays): an IPv4 one to AF_INET sockets and to
/// AF_INET6 ones talking IPv4 (as IPv4-mapped), an IPv6 one to AF_INET6
/// sockets talking IPv6.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalAddressRewrite {
    pub matches: SocketMatch,
    pub new_local: IpAddr,
}

/// Address family of a socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// AF_INET.
    Inet,
    /// AF_INET6 (possibly talking IPv4 through IPv4-mapped addresses).
    Inet6,
}

/// An inet socket as the images describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InetSocket {
    /// The file id (what fdinfo entries refer to).
    pub id: u32,
    /// The socket's inode number on the dumped host (names its
    /// `tcp-stream-<ino>.img`).
    pub ino: u32,
    pub family: Family,
    /// SOCK_STREAM (1), SOCK_DGRAM (2), SOCK_RAW (3).
    pub sock_type: u32,
    /// IP protocol: 6 TCP, 17 UDP, ...
    pub proto: u32,
    /// TCP state as in the kernel ([`TCP_ESTABLISHED`], [`TCP_LISTEN`], 7
    /// for closed/unconnected).
    pub state: u32,
    pub local: SocketAddr,
    /// `None` when the image has no peer (port 0, address all zero).
    pub remote: Option<SocketAddr>,
}

impl InetSocket {
    /// The local address as IPv4, unmapping `::ffff:a.b.c.d`.
    pub fn local_v4(&self) -> Option<SocketAddrV4> {
        as_v4(self.local)
    }

    /// The peer as IPv4, unmapping `::ffff:a.b.c.d`.
    pub fn remote_v4(&self) -> Option<SocketAddrV4> {
        self.remote.and_then(as_v4)
    }

    /// The local address, an IPv4-mapped one as IPv4.
    pub fn local_canonical(&self) -> SocketAddr {
        canonical(self.local)
    }

    /// The peer, an IPv4-mapped one as IPv4.
    pub fn remote_canonical(&self) -> Option<SocketAddr> {
        self.remote.map(canonical)
    }

    fn matches(&self, m: &SocketMatch) -> bool {
        self.proto == u32::from(m.proto)
            && self.local_canonical() == canonical(m.local)
            && m.remote
                .is_none_or(|r| self.remote_canonical() == Some(canonical(r)))
    }
}

/// `a` with an IPv4-mapped IPv6 address as the IPv4 one (and no flow
/// label or scope: what sockets are matched by).
fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

fn as_v4(a: SocketAddr) -> Option<SocketAddrV4> {
    match a {
        SocketAddr::V4(a) => Some(a),
        SocketAddr::V6(a) => a
            .ip()
            .to_ipv4_mapped()
            .map(|ip| SocketAddrV4::new(ip, a.port())),
    }
}

/// One socket that a rewrite matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RewrittenSocket {
    /// Index of the rewrite in the slice given (the first that matched).
    pub rule: usize,
    pub before: InetSocket,
    pub after: InetSocket,
}

/// What [`rewrite_local_addresses`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RewriteSummary {
    pub rewritten: Vec<RewrittenSocket>,
    /// Indices of the rewrites that matched no socket.
    pub unmatched: Vec<usize>,
    /// The image files replaced.
    pub files_written: Vec<PathBuf>,
}

/// Lists the inet sockets in the images in `images_dir`, in image order.
pub fn inet_sockets(images_dir: &Path) -> Result<Vec<InetSocket>, ImageError> {
    let mut sockets = Vec::new();
    for (path, kind) in socket_images(images_dir)? {
        let bytes = read(&path)?;
        edit_image(&path, &bytes, &kind, &mut |msg| {
            sockets.push(InetEntry::parse(msg)?.to_socket());
            Ok(None)
        })?;
    }
    Ok(sockets)
}

/// Gives the sockets selected by `rewrites` their new local address in the
/// images in `images_dir`. A socket takes the first rewrite that matches
/// it. Each changed file is replaced atomically (a temporary file in the
/// same directory, with the original's permissions and owner, renamed over
/// it); every file is checked whole before it is replaced.
pub fn rewrite_local_addresses(
    images_dir: &Path,
    rewrites: &[LocalAddressRewrite],
) -> Result<RewriteSummary, ImageError> {
    let mut summary = RewriteSummary::default();
    let mut used = vec![false; rewrites.len()];
    for (path, kind) in socket_images(images_dir)? {
        let bytes = read(&path)?;
        let mut visit = |sock: &InetSocket, rule: Option<(usize, &InetSocket)>| {
            if let Some((rule, after)) = rule {
                used[rule] = true;
                summary.rewritten.push(RewrittenSocket {
                    rule,
                    before: sock.clone(),
                    after: after.clone(),
                });
            }
        };
        let edited = edit_image(&path, &bytes, &kind, &mut |msg| {
            edit_inet(msg, rewrites, &mut visit)
        })?;
        if let Some(new) = edited {
            write_atomically(&path, &new)?;
            summary.files_written.push(path);
        }
    }
    summary.unmatched = (0..rewrites.len()).filter(|&i| !used[i]).collect();
    Ok(summary)
}

/// A socket whose receive buffer [`raise_receive_buffers`] raised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaisedBuffer {
    pub socket: InetSocket,
    /// `so_rcvbuf` as the image had it: the size `getsockopt(SO_RCVBUF)`
    /// reported on the dumped host, twice what `setsockopt` takes.
    pub before: u32,
}

/// Gives every socket of protocol `proto` (e.g. [`IPPROTO_UDP`]) whose
/// receive buffer in the images in `images_dir` is under `at_least` a
/// receive buffer of `at_least` (in `getsockopt` terms: CRIU halves it for
/// `SO_RCVBUFFORCE`). CRIU then restores them that wide, and whoever
/// restored them can give each its own size back later from what this
/// returns. Each changed file is replaced atomically, as by
/// [`rewrite_local_addresses`].
pub fn raise_receive_buffers(
    images_dir: &Path,
    proto: u8,
    at_least: u32,
) -> Result<Vec<RaisedBuffer>, ImageError> {
    let mut raised = Vec::new();
    for (path, kind) in socket_images(images_dir)? {
        let bytes = read(&path)?;
        let edited = edit_image(&path, &bytes, &kind, &mut |msg| {
            // A thousand connections and one UDP socket: the protocol is
            // looked at before anything else is decoded.
            if socket::protocol(msg)? != Some(u32::from(proto)) {
                return Ok(None);
            }
            let entry = InetEntry::parse(msg)?;
            let before = socket::receive_buffer(msg)?;
            if before >= at_least {
                return Ok(None);
            }
            raised.push(RaisedBuffer {
                socket: entry.to_socket(),
                before,
            });
            Ok(Some(socket::replace_receive_buffer(msg, at_least)?))
        })?;
        if let Some(new) = edited {
            write_atomically(&path, &new)?;
        }
    }
    Ok(raised)
}

/// The socket images present in `dir`.
fn socket_images(dir: &Path) -> Result<Vec<(PathBuf, ImageKind)>, ImageError> {
    let mut found = Vec::new();
    for kind in [image::FILES, image::INETSK] {
        let path = dir.join(kind.file_name);
        match fs::symlink_metadata(&path) {
            Ok(_) => found.push((path, kind)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(ImageError::Io {
                    path,
                    op: "stat",
                    source,
                });
            }
        }
    }
    if found.is_empty() {
        return Err(ImageError::NoSocketImage {
            dir: dir.to_owned(),
        });
    }
    Ok(found)
}

fn read(path: &Path) -> Result<Vec<u8>, ImageError> {
    fs::read(path).map_err(|source| ImageError::Io {
        path: path.to_owned(),
        op: "read",
        source,
    })
}

/// What a visitor of [`rewrite_local_addresses`] sees for each socket: the
/// socket, and the rewrite applied with the result, if any.
type Visit<'v> = dyn FnMut(&InetSocket, Option<(usize, &InetSocket)>) + 'v;

/// What [`edit_image`] does to one `inet_sk_entry`: its new encoding, or
/// `None` to keep it as it is.
type EditInet<'e> = dyn FnMut(&[u8]) -> Result<Option<Vec<u8>>, Fault> + 'e;

/// Walks every inet socket of one image through `edit`. Returns the new
/// file contents if anything changed.
fn edit_image(
    path: &Path,
    bytes: &[u8],
    kind: &ImageKind,
    edit: &mut EditInet<'_>,
) -> Result<Option<Vec<u8>>, ImageError> {
    let framed = image::frame(path, bytes, kind)?;
    let mut out: Vec<u8> = Vec::new();
    let mut changed = false;
    out.extend_from_slice(framed.header);
    for entry in &framed.entries {
        let fault = |f: Fault| to_image_error(path, entry.payload_offset, f);
        let new_payload = match kind.entries {
            EntryKind::InetSkEntry => edit(entry.payload).map_err(fault)?,
            EntryKind::FileEntry => {
                match socket::isk_of_file_entry(entry.payload).map_err(fault)? {
                    None => None,
                    Some(isk) => {
                        let inner = isk.bytes().map_err(|e| fault(e.into()))?;
                        match edit(inner).map_err(|f| fault(f.shifted(isk.value_offset)))? {
                            None => None,
                            Some(new_isk) => Some(
                                socket::replace_isk(entry.payload, &new_isk)
                                    .map_err(|e| fault(e.into()))?,
                            ),
                        }
                    }
                }
            }
        };
        let payload = match &new_payload {
            Some(p) => {
                changed = true;
                p.as_slice()
            }
            None => entry.payload,
        };
        let size = u32::try_from(payload.len()).map_err(|_| ImageError::EntryTooLarge {
            path: path.to_owned(),
            offset: entry.offset as u64,
            size: payload.len(),
        })?;
        out.extend_from_slice(&size.to_ne_bytes());
        out.extend_from_slice(payload);
    }
    Ok(changed.then_some(out))
}

/// Reads one `inet_sk_entry`, reports it, and returns it rewritten if a
/// rewrite matches and changes it.
fn edit_inet(
    msg: &[u8],
    rewrites: &[LocalAddressRewrite],
    visit: &mut Visit<'_>,
) -> Result<Option<Vec<u8>>, Fault> {
    let entry = InetEntry::parse(msg)?;
    let before = entry.to_socket();
    // The words of the local address to write: word 0 of AF_INET, word 3
    // of an IPv4-mapped AF_INET6 address, all four of an IPv6 one.
    let words: Option<(usize, Vec<(usize, u32)>)> = rewrites
        .iter()
        .position(|r| before.matches(&r.matches))
        .and_then(|rule| match rewrites[rule].new_local {
            IpAddr::V4(v4) => entry
                .local_ipv4_word()
                .map(|w| (rule, vec![(w, socket::ipv4_word(v4))])),
            IpAddr::V6(v6) => (entry.family == socket::AF_INET6
                && entry.src_addr.len() == 4
                && entry.local_ipv4_word().is_none())
            .then(|| {
                let words = v6
                    .octets()
                    .chunks_exact(4)
                    .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
                    .enumerate()
                    .collect();
                (rule, words)
            }),
        });
    let Some((rule, words)) = words else {
        visit(&before, None);
        return Ok(None);
    };
    let mut new_msg: Option<Vec<u8>> = None;
    for (word, value) in words {
        if entry.src_addr[word] == value {
            continue;
        }
        let current = new_msg.as_deref().unwrap_or(msg);
        new_msg = Some(socket::replace_repeated_uint32(
            current,
            socket::SRC_ADDR_FIELD,
            word,
            value,
        )?);
    }
    let after = match &new_msg {
        Some(m) => InetEntry::parse(m)?.to_socket(),
        None => before.clone(),
    };
    visit(&before, Some((rule, &after)));
    Ok(new_msg)
}

fn to_image_error(path: &Path, base: usize, fault: Fault) -> ImageError {
    match fault {
        Fault::Wire(e) => ImageError::Protobuf {
            path: path.to_owned(),
            offset: (base + e.offset) as u64,
            problem: e.problem,
        },
        Fault::Socket { offset, problem } => ImageError::BadSocket {
            path: path.to_owned(),
            offset: (base + offset) as u64,
            problem,
        },
    }
}

/// Replaces `path` with `bytes` through a temporary file in the same
/// directory, keeping the original's mode and owner.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ImageError> {
    let io = |op: &'static str| {
        move |source| ImageError::Io {
            path: path.to_owned(),
            op,
            source,
        }
    };
    let meta = fs::metadata(path).map_err(io("stat"))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::Builder::new()
        .prefix(".ferry-criu-image.")
        .tempfile_in(dir)
        .map_err(io("create a temporary file next to"))?;
    tmp.write_all(bytes)
        .map_err(io("write the temporary copy of"))?;
    let file = tmp.as_file();
    file.set_permissions(meta.permissions())
        .map_err(io("set the mode of the temporary copy of"))?;
    let tmp_meta = file.metadata().map_err(io("stat the temporary copy of"))?;
    if (tmp_meta.uid(), tmp_meta.gid()) != (meta.uid(), meta.gid()) {
        std::os::unix::fs::fchown(file, Some(meta.uid()), Some(meta.gid()))
            .map_err(io("set the owner of the temporary copy of"))?;
    }
    file.sync_all().map_err(io("sync the temporary copy of"))?;
    tmp.persist(path)
        .map_err(|e| io("rename the temporary copy over")(e.error))?;
    Ok(())
}
