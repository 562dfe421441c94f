//! `inet_sk_entry` (sk-inet.proto): reading the fields this crate needs and
//! re-encoding one word of `src_addr`, copying everything else verbatim.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use crate::wire::{
    Field, Fields, Value, WireError, WireProblem, encode_len, encode_varint, packed_varints,
};
use crate::{Family, InetSocket};

// Field numbers of inet_sk_entry.
const ID: u32 = 1;
const INO: u32 = 2;
const FAMILY: u32 = 3;
const TYPE: u32 = 4;
const PROTO: u32 = 5;
const STATE: u32 = 6;
const SRC_PORT: u32 = 7;
const DST_PORT: u32 = 8;
const SRC_ADDR: u32 = 11;
const DST_ADDR: u32 = 12;
const OPTS: u32 = 14;

// Field number of sk_opts_entry (sk-opts.proto) holding the receive buffer.
const SO_RCVBUF: u32 = 2;

/// The required scalar fields read, in the order of [`InetEntry::parse`].
const REQUIRED: [(u32, &str); 8] = [
    (ID, "id"),
    (INO, "ino"),
    (FAMILY, "family"),
    (TYPE, "type"),
    (PROTO, "proto"),
    (STATE, "state"),
    (SRC_PORT, "src_port"),
    (DST_PORT, "dst_port"),
];

// Field numbers of file_entry and the fd_types value of inet sockets.
const FILE_TYPE: u32 = 1;
const FILE_ISK: u32 = 4;
const FD_TYPES_INETSK: u32 = 4;

const AF_INET: u32 = 2;
pub(crate) const AF_INET6: u32 = 10;

/// Why an entry cannot be used, at an offset into the message examined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fault {
    Wire(WireError),
    Socket { offset: usize, problem: String },
}

impl From<WireError> for Fault {
    fn from(e: WireError) -> Self {
        Self::Wire(e)
    }
}

impl Fault {
    /// Moves the offset of a fault found in a nested message to the
    /// offsets of the enclosing one.
    pub(crate) fn shifted(self, base: usize) -> Self {
        match self {
            Self::Wire(e) => Self::Wire(WireError::new(base + e.offset, e.problem)),
            Self::Socket { offset, problem } => Self::Socket {
                offset: base + offset,
                problem,
            },
        }
    }
}

/// The `isk` field of a `file_entry`, if the entry is an inet socket.
pub(crate) fn isk_of_file_entry(msg: &[u8]) -> Result<Option<Field<'_>>, Fault> {
    let mut fd_type = None;
    let mut isk: Option<Field<'_>> = None;
    for field in Fields::new(msg) {
        let field = field?;
        match field.number {
            FILE_TYPE => fd_type = Some(field.uint32()?),
            FILE_ISK => {
                field.bytes()?;
                if isk.is_some() {
                    return Err(WireError::new(
                        field.offset,
                        WireProblem::RepeatedMessage { field: FILE_ISK },
                    )
                    .into());
                }
                isk = Some(field);
            }
            _ => {}
        }
    }
    match (fd_type, isk) {
        (Some(FD_TYPES_INETSK), Some(isk)) => Ok(Some(isk)),
        (Some(FD_TYPES_INETSK), None) => Err(Fault::Socket {
            offset: 0,
            problem: "file_entry of type INETSK without its isk field".to_owned(),
        }),
        (None, Some(isk)) => Err(Fault::Socket {
            offset: isk.offset,
            problem: "file_entry with an isk field but no type".to_owned(),
        }),
        _ => Ok(None),
    }
}

/// The fields of one `inet_sk_entry` this crate reads. Addresses are the
/// raw words: see [`ipv4_word`] for their byte order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InetEntry {
    pub id: u32,
    pub ino: u32,
    pub family: u32,
    pub sock_type: u32,
    pub proto: u32,
    pub state: u32,
    pub src_port: u32,
    pub dst_port: u32,
    pub src_addr: Vec<u32>,
    pub dst_addr: Vec<u32>,
}

impl InetEntry {
    /// Reads and validates an entry as CRIU's restore does
    /// (`inet_validate_address`): AF_INET needs at least one word per
    /// address (CRIU 0.1 wrote four), AF_INET6 exactly four.
    pub(crate) fn parse(msg: &[u8]) -> Result<Self, Fault> {
        let mut scalars: [Option<u32>; 8] = [None; 8];
        let mut src_addr = Vec::new();
        let mut dst_addr = Vec::new();
        for field in Fields::new(msg) {
            let field = field?;
            match field.number {
                SRC_ADDR => repeated_uint32(&field, &mut src_addr)?,
                DST_ADDR => repeated_uint32(&field, &mut dst_addr)?,
                n => {
                    if let Some(i) = REQUIRED.iter().position(|&(r, _)| r == n) {
                        // The last occurrence of a scalar wins, as protobuf says.
                        scalars[i] = Some(field.uint32()?);
                    }
                }
            }
        }
        let mut values = [0u32; 8];
        for (i, v) in scalars.iter().enumerate() {
            let (number, name) = REQUIRED[i];
            values[i] = v.ok_or_else(|| Fault::Socket {
                offset: 0,
                problem: format!("required field {number} ({name}) is missing"),
            })?;
        }
        let [id, ino, family, sock_type, proto, state, src_port, dst_port] = values;
        let e = Self {
            id,
            ino,
            family,
            sock_type,
            proto,
            state,
            src_port,
            dst_port,
            src_addr,
            dst_addr,
        };
        let bad = |problem: String| Fault::Socket { offset: 0, problem };
        let (s, d) = (e.src_addr.len(), e.dst_addr.len());
        match family {
            AF_INET if s >= 1 && d >= 1 => {}
            AF_INET6 if s == 4 && d == 4 => {}
            AF_INET | AF_INET6 => {
                return Err(bad(format!(
                    "socket {id:#x}: family {family} with {s} src_addr and {d} dst_addr words"
                )));
            }
            _ => return Err(bad(format!("socket {id:#x}: unknown family {family}"))),
        }
        for (name, port) in [("src_port", src_port), ("dst_port", dst_port)] {
            if port > u32::from(u16::MAX) {
                return Err(bad(format!("socket {id:#x}: {name} {port} is not a port")));
            }
        }
        Ok(e)
    }

    /// The listing form.
    pub(crate) fn to_socket(&self) -> InetSocket {
        let family = if self.family == AF_INET {
            Family::Inet
        } else {
            Family::Inet6
        };
        let remote_unset = self.dst_port == 0 && self.dst_addr.iter().all(|&w| w == 0);
        InetSocket {
            id: self.id,
            ino: self.ino,
            family,
            sock_type: self.sock_type,
            proto: self.proto,
            state: self.state,
            local: address(family, &self.src_addr, self.src_port),
            remote: (!remote_unset).then(|| address(family, &self.dst_addr, self.dst_port)),
        }
    }

    /// Index of the word of `src_addr` that holds the socket's IPv4 local
    /// address, if it has one.
    pub(crate) fn local_ipv4_word(&self) -> Option<usize> {
        ipv4_word_index(self.family, &self.src_addr)
    }
}

/// The word for `ip` as CRIU stores it in `src_addr`/`dst_addr`.
///
/// CRIU `memcpy`s the `in_addr` (network byte order bytes) into a `uint32`
/// (`dump_sockaddr` in sk-inet.c) and back (`restore_sockaddr`), so the
/// varint on the wire is the address bytes read as a host-order integer:
/// 198.18.200.1 is `0x01c812c6` on little-endian hosts (crit prints it
/// with `ntohl`).
pub(crate) fn ipv4_word(ip: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(ip.octets())
}

/// Inverse of [`ipv4_word`].
pub(crate) fn ipv4_of_word(word: u32) -> Ipv4Addr {
    Ipv4Addr::from(word.to_ne_bytes())
}

/// Word 2 of an IPv4-mapped IPv6 address (::ffff:a.b.c.d).
fn mapped_marker() -> u32 {
    u32::from_ne_bytes([0, 0, 0xff, 0xff])
}

/// Where the IPv4 address is in an address of `family`: word 0 of an
/// AF_INET address, word 3 of an IPv4-mapped AF_INET6 address.
pub(crate) fn ipv4_word_index(family: u32, words: &[u32]) -> Option<usize> {
    match family {
        AF_INET => (!words.is_empty()).then_some(0),
        AF_INET6 => matches!(words, [0, 0, m, _] if *m == mapped_marker()).then_some(3),
        _ => None,
    }
}

fn address(family: Family, words: &[u32], port: u32) -> SocketAddr {
    let port = port as u16;
    match family {
        Family::Inet => SocketAddr::V4(SocketAddrV4::new(ipv4_of_word(words[0]), port)),
        Family::Inet6 => {
            let mut octets = [0u8; 16];
            for (chunk, w) in octets.chunks_exact_mut(4).zip(words) {
                chunk.copy_from_slice(&w.to_ne_bytes());
            }
            SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(octets), port, 0, 0))
        }
    }
}

/// Appends the elements of one occurrence of a repeated `uint32` field,
/// unpacked (a varint) or packed (a length-delimited run of varints).
fn repeated_uint32(field: &Field<'_>, out: &mut Vec<u32>) -> Result<(), WireError> {
    match field.value {
        Value::Varint(_) => out.push(field.uint32()?),
        Value::Len(payload) => {
            for el in packed_varints(payload)
                .map_err(|e| WireError::new(field.value_offset + e.offset, e.problem))?
            {
                let v = u32::try_from(el.value).map_err(|_| {
                    WireError::new(
                        field.value_offset + el.start,
                        WireProblem::Uint32OutOfRange {
                            field: field.number,
                            value: el.value,
                        },
                    )
                })?;
                out.push(v);
            }
        }
        _ => return Err(field.wrong_type("a varint or packed varints")),
    }
    Ok(())
}

/// `msg` with element `index` of the repeated `uint32` field `number`
/// replaced by `value`. Only the occurrence holding that element is
/// re-encoded, in the encoding it had (unpacked or packed); every other
/// byte is copied. `msg` must have passed [`InetEntry::parse`].
pub(crate) fn replace_repeated_uint32(
    msg: &[u8],
    number: u32,
    index: usize,
    value: u32,
) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(msg.len() + 8);
    let mut seen = 0usize;
    for field in Fields::new(msg) {
        let field = field?;
        if field.number != number {
            out.extend_from_slice(field.raw);
            continue;
        }
        match field.value {
            Value::Varint(_) => {
                if seen == index {
                    out.extend_from_slice(field.tag);
                    encode_varint(u64::from(value), &mut out);
                } else {
                    out.extend_from_slice(field.raw);
                }
                seen += 1;
            }
            Value::Len(payload) => {
                let elements = packed_varints(payload)
                    .map_err(|e| WireError::new(field.value_offset + e.offset, e.problem))?;
                match elements.get(index.wrapping_sub(seen)) {
                    Some(el) if index >= seen => {
                        let mut packed = Vec::with_capacity(payload.len() + 5);
                        packed.extend_from_slice(&payload[..el.start]);
                        encode_varint(u64::from(value), &mut packed);
                        packed.extend_from_slice(&payload[el.end..]);
                        out.extend_from_slice(field.tag);
                        encode_len(&packed, &mut out);
                    }
                    _ => out.extend_from_slice(field.raw),
                }
                seen += elements.len();
            }
            _ => return Err(field.wrong_type("a varint or packed varints")),
        }
    }
    Ok(out)
}

/// `msg` (a `file_entry`) with its `isk` field's value replaced by `isk`;
/// the tag is kept, the length prefix re-encoded.
pub(crate) fn replace_isk(msg: &[u8], isk: &[u8]) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(msg.len() + 8);
    for field in Fields::new(msg) {
        let field = field?;
        if field.number == FILE_ISK {
            out.extend_from_slice(field.tag);
            encode_len(isk, &mut out);
        } else {
            out.extend_from_slice(field.raw);
        }
    }
    Ok(out)
}

/// The field number of `src_addr`, for [`replace_repeated_uint32`].
pub(crate) const SRC_ADDR_FIELD: u32 = SRC_ADDR;

/// The entry's `proto` (the last occurrence, as protobuf says), without
/// decoding the rest.
pub(crate) fn protocol(msg: &[u8]) -> Result<Option<u32>, WireError> {
    let mut found = None;
    for field in Fields::new(msg) {
        let field = field?;
        if field.number == PROTO {
            found = Some(field.uint32()?);
        }
    }
    Ok(found)
}

/// `so_rcvbuf` of the entry's `opts` (both required in sk-inet.proto and
/// sk-opts.proto; the last occurrence wins, as protobuf says).
pub(crate) fn receive_buffer(msg: &[u8]) -> Result<u32, Fault> {
    let mut found = None;
    for field in Fields::new(msg) {
        let field = field?;
        if field.number != OPTS {
            continue;
        }
        let opts = field.bytes()?;
        for inner in Fields::new(opts) {
            let inner =
                inner.map_err(|e| WireError::new(field.value_offset + e.offset, e.problem))?;
            if inner.number == SO_RCVBUF {
                found = Some(
                    inner
                        .uint32()
                        .map_err(|e| WireError::new(field.value_offset + e.offset, e.problem))?,
                );
            }
        }
    }
    found.ok_or_else(|| Fault::Socket {
        offset: 0,
        problem: "required field opts.so_rcvbuf is missing".to_owned(),
    })
}

/// `msg` (an `inet_sk_entry` that passed [`receive_buffer`]) with every
/// `opts.so_rcvbuf` set to `value`; every other byte is copied, and the
/// length prefix of `opts` re-encoded.
pub(crate) fn replace_receive_buffer(msg: &[u8], value: u32) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(msg.len() + 8);
    for field in Fields::new(msg) {
        let field = field?;
        if field.number != OPTS {
            out.extend_from_slice(field.raw);
            continue;
        }
        let opts = field.bytes()?;
        let mut new_opts = Vec::with_capacity(opts.len() + 5);
        for inner in Fields::new(opts) {
            let inner =
                inner.map_err(|e| WireError::new(field.value_offset + e.offset, e.problem))?;
            if inner.number == SO_RCVBUF {
                new_opts.extend_from_slice(inner.tag);
                encode_varint(u64::from(value), &mut new_opts);
            } else {
                new_opts.extend_from_slice(inner.raw);
            }
        }
        out.extend_from_slice(field.tag);
        encode_len(&new_opts, &mut out);
    }
    Ok(out)
}
