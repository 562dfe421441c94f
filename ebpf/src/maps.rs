//! Rust mirrors of the layouts in include/ferry_dataplane.h (same sizes and
//! offsets, asserted on both sides).

use std::mem::{offset_of, size_of};

/// `struct ferry_port_key`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PortKey {
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub proto: u8,
    /// Always 0: the kernel hashes every key byte.
    pub pad: u8,
    /// Host byte order.
    pub port: u16,
}

// SAFETY: PortKey is repr(C) and made only of integers with no padding
// (u8, u8, u16 = 4 bytes, asserted below), so every bit pattern is valid and
// it may be copied to and from the kernel as plain bytes.
unsafe impl aya::Pod for PortKey {}

const _: () = assert!(size_of::<PortKey>() == 4);
const _: () = assert!(offset_of!(PortKey, proto) == 0);
const _: () = assert!(offset_of!(PortKey, pad) == 1);
const _: () = assert!(offset_of!(PortKey, port) == 2);

/// Flags in the `u32` value of `FERRY_PORTS`.
pub(crate) const PORT_OWNED: u32 = 1;
pub(crate) const PORT_FROZEN: u32 = 2;

/// Indices of `FERRY_COUNTERS` (`enum ferry_counter`).
pub(crate) const CNT_PASSED: u32 = 0;
pub(crate) const CNT_DROPPED_NOT_OWNED: u32 = 1;
pub(crate) const CNT_DROPPED_FROZEN: u32 = 2;
pub(crate) const CNT_PASSED_OTHER: u32 = 3;
pub(crate) const CNT_EGRESS_BLOCKED: u32 = 4;

pub(crate) const PORT_CAPTURE: u32 = 4;
pub(crate) const PORT_RECORD: u32 = 8;
pub(crate) const PORT_HOLD_NEW: u32 = 16;
pub(crate) const PORT_SHARED: u32 = 32;

/// `struct ferry_flow_key`: one TCP connection of a shared port.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FlowKey {
    /// The client's address, network byte order (as in the IP header).
    pub remote_addr: [u8; 4],
    /// Host byte order.
    pub remote_port: u16,
    /// Host byte order.
    pub local_port: u16,
}

// SAFETY: FlowKey is repr(C) and made only of integers and a byte array
// with no padding (4 + 2 + 2 = 8 bytes, asserted below), so every bit
// pattern is valid and it may be copied to and from the kernel as bytes.
unsafe impl aya::Pod for FlowKey {}

const _: () = assert!(size_of::<FlowKey>() == 8);
const _: () = assert!(offset_of!(FlowKey, remote_port) == 4);
const _: () = assert!(offset_of!(FlowKey, local_port) == 6);

/// `struct ferry_flow6_key`: one TCP connection of a shared port, over IPv6.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Flow6Key {
    /// The client's address, network byte order (as in the IPv6 header).
    pub remote_addr: [u8; 16],
    /// Host byte order.
    pub remote_port: u16,
    /// Host byte order.
    pub local_port: u16,
}

// SAFETY: Flow6Key is repr(C) and made only of a byte array and integers
// with no padding (16 + 2 + 2 = 20 bytes, asserted below), so every bit
// pattern is valid and it may be copied to and from the kernel as bytes.
unsafe impl aya::Pod for Flow6Key {}

const _: () = assert!(size_of::<Flow6Key>() == 20);
const _: () = assert!(offset_of!(Flow6Key, remote_port) == 16);
const _: () = assert!(offset_of!(Flow6Key, local_port) == 18);

pub(crate) const CNT_CAPTURED: u32 = 5;
pub(crate) const CNT_CAPTURE_LOST: u32 = 6;
pub(crate) const CNT_RECORDED: u32 = 7;

/// `struct ferry_capture_hdr`, the head of every FERRY_CAPTURE record.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CaptureHdr {
    pub ktime_ns: u64,
    pub pkt_len: u32,
    pub cap_len: u32,
    pub port: u16,
    pub proto: u8,
    pub kind: u8,
    pub pad: u32,
}

const _: () = assert!(size_of::<CaptureHdr>() == 24);
const _: () = assert!(offset_of!(CaptureHdr, pkt_len) == 8);
const _: () = assert!(offset_of!(CaptureHdr, cap_len) == 12);
const _: () = assert!(offset_of!(CaptureHdr, port) == 16);
const _: () = assert!(offset_of!(CaptureHdr, proto) == 18);
const _: () = assert!(offset_of!(CaptureHdr, kind) == 19);

/// `enum ferry_capture_kind`.
pub(crate) const KIND_CAPTURED: u8 = 0;
pub(crate) const KIND_DELIVERED: u8 = 1;

impl CaptureHdr {
    /// Reads the header at the start of a ring record (native byte order,
    /// as the program wrote it), or None if the record is too short.
    pub fn parse(rec: &[u8]) -> Option<Self> {
        let b = rec.get(..size_of::<Self>())?;
        let u32_at = |o: usize| u32::from_ne_bytes(b[o..o + 4].try_into().unwrap());
        Some(Self {
            ktime_ns: u64::from_ne_bytes(b[0..8].try_into().unwrap()),
            pkt_len: u32_at(8),
            cap_len: u32_at(12),
            port: u16::from_ne_bytes(b[16..18].try_into().unwrap()),
            proto: b[18],
            kind: b[19],
            pad: u32_at(20),
        })
    }
}
