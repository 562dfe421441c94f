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
