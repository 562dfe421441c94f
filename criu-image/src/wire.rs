//! Just enough of the protobuf wire format to walk a message field by field
//! and copy what is not changed byte for byte.
//!
//! No schema is involved: a field is a tag (field number and wire type) and
//! a value whose extent the wire type alone determines. Groups (wire types
//! 3 and 4, deprecated and never written by CRIU) and the undefined wire
//! types 6 and 7 are rejected, since their extent cannot be known safely.

use std::fmt;

/// Wire type of varint-encoded scalars (`uint32`, `bool`, enums, ...).
pub(crate) const WIRE_VARINT: u8 = 0;
/// Wire type of `fixed64`, `sfixed64`, `double`.
pub(crate) const WIRE_FIXED64: u8 = 1;
/// Wire type of length-delimited values: strings, bytes, nested messages,
/// packed repeated scalars.
pub(crate) const WIRE_LEN: u8 = 2;
/// Wire type of `fixed32`, `sfixed32`, `float`.
pub(crate) const WIRE_FIXED32: u8 = 5;

/// The longest varint: ten bytes carry 64 bits.
const MAX_VARINT_LEN: usize = 10;
/// The largest field number protobuf allows (2^29 - 1).
const MAX_FIELD_NUMBER: u64 = (1 << 29) - 1;

/// What is wrong with a protobuf message, at an offset kept by the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireProblem {
    /// The message ends in the middle of a varint.
    TruncatedVarint,
    /// A varint longer than ten bytes, or whose tenth byte carries more than
    /// the 64th bit.
    OverlongVarint,
    /// A tag with field number 0 or above 2^29 - 1.
    BadFieldNumber(u64),
    /// A start-group or end-group tag (wire type 3 or 4).
    Group { field: u32, wire_type: u8 },
    /// Wire type 6 or 7, which protobuf does not define.
    UnknownWireType { field: u32, wire_type: u8 },
    /// A fixed-size value or a length-delimited value that runs past the end
    /// of its message.
    ValueTruncated {
        field: u32,
        needed: u64,
        available: usize,
    },
    /// A known field with another wire type than its schema allows.
    WrongWireType {
        field: u32,
        expected: &'static str,
        found: u8,
    },
    /// A `uint32` field holding a value above `u32::MAX`.
    Uint32OutOfRange { field: u32, value: u64 },
    /// A singular nested message that this crate would have to merge, which
    /// CRIU never writes.
    RepeatedMessage { field: u32 },
}

impl fmt::Display for WireProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TruncatedVarint => write!(f, "expected a varint, found the end of the message"),
            Self::OverlongVarint => write!(f, "expected a varint of at most 64 bits"),
            Self::BadFieldNumber(n) => {
                write!(f, "expected a field number in 1..=536870911, found {n}")
            }
            Self::Group { field, wire_type } => write!(
                f,
                "field {field}: groups (wire type {wire_type}) are not supported"
            ),
            Self::UnknownWireType { field, wire_type } => {
                write!(f, "field {field}: unknown wire type {wire_type}")
            }
            Self::ValueTruncated {
                field,
                needed,
                available,
            } => write!(
                f,
                "field {field}: expected {needed} bytes of value, only {available} left"
            ),
            Self::WrongWireType {
                field,
                expected,
                found,
            } => write!(
                f,
                "field {field}: expected {expected}, found wire type {found}"
            ),
            Self::Uint32OutOfRange { field, value } => {
                write!(f, "field {field}: expected a uint32, found {value}")
            }
            Self::RepeatedMessage { field } => write!(
                f,
                "field {field}: expected one nested message, found several"
            ),
        }
    }
}

/// A problem at `offset` bytes into the message being walked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WireError {
    pub offset: usize,
    pub problem: WireProblem,
}

impl WireError {
    pub(crate) fn new(offset: usize, problem: WireProblem) -> Self {
        Self { offset, problem }
    }
}

/// A field's value, as far as the wire type tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Value<'a> {
    Varint(u64),
    Fixed64(u64),
    Len(&'a [u8]),
    Fixed32(u32),
}

/// One field of a message.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Field<'a> {
    pub number: u32,
    pub wire_type: u8,
    pub value: Value<'a>,
    /// The tag bytes as found (kept verbatim when the value is re-encoded).
    pub tag: &'a [u8],
    /// The whole field: tag, length prefix if any, value.
    pub raw: &'a [u8],
    /// Offset of the tag from the start of the message.
    pub offset: usize,
    /// Offset of the value from the start of the message (after the length
    /// prefix of a length-delimited value).
    pub value_offset: usize,
}

impl<'a> Field<'a> {
    /// The value of a `uint32` field (wire type varint).
    pub(crate) fn uint32(&self) -> Result<u32, WireError> {
        match self.value {
            Value::Varint(v) => u32::try_from(v).map_err(|_| {
                WireError::new(
                    self.value_offset,
                    WireProblem::Uint32OutOfRange {
                        field: self.number,
                        value: v,
                    },
                )
            }),
            _ => Err(self.wrong_type("a varint")),
        }
    }

    /// The value of a `uint64` field (wire type varint).
    pub(crate) fn uint64(&self) -> Result<u64, WireError> {
        match self.value {
            Value::Varint(v) => Ok(v),
            _ => Err(self.wrong_type("a varint")),
        }
    }

    /// The value of a `bool` field (wire type varint): protobuf reads any
    /// non-zero varint as true.
    pub(crate) fn boolean(&self) -> Result<bool, WireError> {
        self.uint64().map(|v| v != 0)
    }

    /// The bytes of a length-delimited field.
    pub(crate) fn bytes(&self) -> Result<&'a [u8], WireError> {
        match self.value {
            Value::Len(b) => Ok(b),
            _ => Err(self.wrong_type("a length-delimited value")),
        }
    }

    pub(crate) fn wrong_type(&self, expected: &'static str) -> WireError {
        WireError::new(
            self.offset,
            WireProblem::WrongWireType {
                field: self.number,
                expected,
                found: self.wire_type,
            },
        )
    }
}

/// Decodes the varint at the start of `buf`: its value and its length.
/// Offsets in errors are relative to `buf`.
pub(crate) fn decode_varint(buf: &[u8]) -> Result<(u64, usize), WireError> {
    let mut value: u64 = 0;
    for (i, &byte) in buf.iter().enumerate().take(MAX_VARINT_LEN) {
        if i == MAX_VARINT_LEN - 1 && byte > 1 {
            return Err(WireError::new(0, WireProblem::OverlongVarint));
        }
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok((value, i + 1));
        }
    }
    if buf.len() >= MAX_VARINT_LEN {
        Err(WireError::new(0, WireProblem::OverlongVarint))
    } else {
        Err(WireError::new(0, WireProblem::TruncatedVarint))
    }
}

/// Appends the minimal varint encoding of `value` to `out`.
pub(crate) fn encode_varint(mut value: u64, out: &mut Vec<u8>) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Appends a length prefix and `bytes`.
pub(crate) fn encode_len(bytes: &[u8], out: &mut Vec<u8>) {
    encode_varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

/// Iterates over the fields of one message. After the first error it
/// yields nothing more.
#[derive(Debug, Clone)]
pub(crate) struct Fields<'a> {
    msg: &'a [u8],
    pos: usize,
    failed: bool,
}

impl<'a> Fields<'a> {
    pub(crate) fn new(msg: &'a [u8]) -> Self {
        Self {
            msg,
            pos: 0,
            failed: false,
        }
    }

    fn next_field(&mut self) -> Result<Field<'a>, WireError> {
        let start = self.pos;
        let rest = &self.msg[start..];
        let (key, tag_len) = decode_varint(rest).map_err(|e| at(start, e))?;
        let number = key >> 3;
        let wire_type = (key & 7) as u8;
        if number == 0 || number > MAX_FIELD_NUMBER {
            return Err(WireError::new(start, WireProblem::BadFieldNumber(number)));
        }
        let number = number as u32;
        let value_start = start + tag_len;
        let after_tag = &self.msg[value_start..];
        let (value, value_offset, end) = match wire_type {
            WIRE_VARINT => {
                let (v, n) = decode_varint(after_tag).map_err(|e| at(value_start, e))?;
                (Value::Varint(v), value_start, value_start + n)
            }
            WIRE_FIXED64 => {
                let b = fixed::<8>(after_tag, number).map_err(|e| at(value_start, e))?;
                (
                    Value::Fixed64(u64::from_le_bytes(b)),
                    value_start,
                    value_start + 8,
                )
            }
            WIRE_FIXED32 => {
                let b = fixed::<4>(after_tag, number).map_err(|e| at(value_start, e))?;
                (
                    Value::Fixed32(u32::from_le_bytes(b)),
                    value_start,
                    value_start + 4,
                )
            }
            WIRE_LEN => {
                let (len, n) = decode_varint(after_tag).map_err(|e| at(value_start, e))?;
                let data_start = value_start + n;
                let available = self.msg.len() - data_start;
                let len_usize = usize::try_from(len).ok().filter(|&l| l <= available);
                let Some(len) = len_usize else {
                    return Err(WireError::new(
                        value_start,
                        WireProblem::ValueTruncated {
                            field: number,
                            needed: len,
                            available,
                        },
                    ));
                };
                (
                    Value::Len(&self.msg[data_start..data_start + len]),
                    data_start,
                    data_start + len,
                )
            }
            3 | 4 => {
                return Err(WireError::new(
                    start,
                    WireProblem::Group {
                        field: number,
                        wire_type,
                    },
                ));
            }
            _ => {
                return Err(WireError::new(
                    start,
                    WireProblem::UnknownWireType {
                        field: number,
                        wire_type,
                    },
                ));
            }
        };
        self.pos = end;
        Ok(Field {
            number,
            wire_type,
            value,
            tag: &self.msg[start..value_start],
            raw: &self.msg[start..end],
            offset: start,
            value_offset,
        })
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<Field<'a>, WireError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.pos >= self.msg.len() {
            return None;
        }
        let field = self.next_field();
        self.failed = field.is_err();
        Some(field)
    }
}

/// One element of a packed repeated varint field: its value and where its
/// bytes are in the packed payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PackedVarint {
    pub value: u64,
    pub start: usize,
    pub end: usize,
}

/// Splits the payload of a packed repeated varint field into its elements.
/// Offsets in errors are relative to `payload`.
pub(crate) fn packed_varints(payload: &[u8]) -> Result<Vec<PackedVarint>, WireError> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < payload.len() {
        let (value, n) = decode_varint(&payload[pos..]).map_err(|e| at(pos, e))?;
        out.push(PackedVarint {
            value,
            start: pos,
            end: pos + n,
        });
        pos += n;
    }
    Ok(out)
}

fn fixed<const N: usize>(buf: &[u8], field: u32) -> Result<[u8; N], WireError> {
    buf.get(..N)
        .and_then(|b| <[u8; N]>::try_from(b).ok())
        .ok_or_else(|| {
            WireError::new(
                0,
                WireProblem::ValueTruncated {
                    field,
                    needed: N as u64,
                    available: buf.len(),
                },
            )
        })
}

/// Moves an error found in a sub-slice to the offsets of the whole.
fn at(base: usize, e: WireError) -> WireError {
    WireError::new(base + e.offset, e.problem)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varint_round_trip() {
        for v in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX] {
            let mut buf = Vec::new();
            encode_varint(v, &mut buf);
            assert_eq!(decode_varint(&buf), Ok((v, buf.len())));
        }
    }

    #[test]
    fn varint_errors() {
        assert_eq!(
            decode_varint(&[]).unwrap_err().problem,
            WireProblem::TruncatedVarint
        );
        assert_eq!(
            decode_varint(&[0x80, 0x80]).unwrap_err().problem,
            WireProblem::TruncatedVarint
        );
        assert_eq!(
            decode_varint(&[0xff; 11]).unwrap_err().problem,
            WireProblem::OverlongVarint
        );
        let mut tenth_too_big = [0xffu8; 10];
        tenth_too_big[9] = 0x02;
        assert_eq!(
            decode_varint(&tenth_too_big).unwrap_err().problem,
            WireProblem::OverlongVarint
        );
    }

    #[test]
    fn walks_all_wire_types() {
        // 1: varint 150, 2: fixed64, 3: "hi", 4: fixed32.
        let msg = [
            0x08, 0x96, 0x01, 0x11, 1, 2, 3, 4, 5, 6, 7, 8, 0x1a, 2, b'h', b'i', 0x25, 9, 0, 0, 0,
        ];
        let fields: Vec<_> = Fields::new(&msg).collect::<Result<_, _>>().unwrap();
        assert_eq!(fields.len(), 4);
        assert_eq!(fields[0].value, Value::Varint(150));
        assert_eq!(fields[0].raw, &msg[0..3]);
        assert_eq!(
            fields[1].value,
            Value::Fixed64(u64::from_le_bytes([1, 2, 3, 4, 5, 6, 7, 8]))
        );
        assert_eq!(fields[2].value, Value::Len(b"hi"));
        assert_eq!(fields[2].value_offset, 14);
        assert_eq!(fields[3].value, Value::Fixed32(9));
        assert_eq!(fields[3].offset, 16);
    }

    #[test]
    fn rejects_groups_unknown_types_and_bad_lengths() {
        let group = [0x0b, 0x0c];
        let e = Fields::new(&group).next().unwrap().unwrap_err();
        assert!(matches!(e.problem, WireProblem::Group { field: 1, .. }));

        let unknown = [0x0e];
        let e = Fields::new(&unknown).next().unwrap().unwrap_err();
        assert!(matches!(e.problem, WireProblem::UnknownWireType { .. }));

        let too_long = [0x08, 0x01, 0x12, 0x05, 1, 2];
        let mut it = Fields::new(&too_long);
        assert!(it.next().unwrap().is_ok());
        let e = it.next().unwrap().unwrap_err();
        assert_eq!(e.offset, 3);
        assert!(matches!(e.problem, WireProblem::ValueTruncated { .. }));
        assert!(it.next().is_none());

        let zero = [0x00, 0x01];
        let e = Fields::new(&zero).next().unwrap().unwrap_err();
        assert_eq!(e.problem, WireProblem::BadFieldNumber(0));

        let short_fixed = [0x0d, 1, 2];
        let e = Fields::new(&short_fixed).next().unwrap().unwrap_err();
        assert_eq!(e.offset, 1);
    }

    #[test]
    fn packed_elements_keep_their_spans() {
        let payload = [0x01, 0x96, 0x01, 0x7f];
        let els = packed_varints(&payload).unwrap();
        assert_eq!(
            els.iter().map(|e| e.value).collect::<Vec<_>>(),
            [1, 150, 127]
        );
        assert_eq!((els[1].start, els[1].end), (1, 3));
        let e = packed_varints(&[0x01, 0x80]).unwrap_err();
        assert_eq!(e.offset, 1);
    }

    #[test]
    fn garbage_never_panics() {
        // A cheap deterministic generator: every byte pattern walks to the
        // end or to an error.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for len in 0..200 {
            let buf: Vec<u8> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect();
            // Fields::new stops after the first error.
            for f in Fields::new(&buf).flatten() {
                let _ = f.uint32();
                if let Value::Len(b) = f.value {
                    let _ = packed_varints(b);
                    let _ = Fields::new(b).count();
                }
            }
        }
    }
}
