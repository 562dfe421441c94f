//! Rust mirrors of the layouts in include/ferry_translate.h (same sizes and
//! offsets, asserted on both sides).

use std::mem::{offset_of, size_of};

/// `struct ferry_xlate_key`. Addresses and ports are in network byte
/// order, as the programs read them from the packet.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct XlateKey {
    pub local_addr: [u8; 4],
    /// The old address in `FERRY_XL_RULES`, the new one in `FERRY_XL_REV`
    /// (a hold rule's remote address in both).
    pub remote_addr: [u8; 4],
    pub local_port: [u8; 2],
    pub remote_port: [u8; 2],
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub proto: u8,
    /// Always 0: the kernel hashes every key byte.
    pub pad: [u8; 3],
}

// SAFETY: XlateKey is repr(C) and made only of byte arrays and a u8 (16
// bytes, alignment 1, no padding: asserted below), so every bit pattern is
// valid and it may be copied to and from the kernel as plain bytes.
unsafe impl aya::Pod for XlateKey {}

const _: () = assert!(size_of::<XlateKey>() == 16);
const _: () = assert!(offset_of!(XlateKey, local_addr) == 0);
const _: () = assert!(offset_of!(XlateKey, remote_addr) == 4);
const _: () = assert!(offset_of!(XlateKey, local_port) == 8);
const _: () = assert!(offset_of!(XlateKey, remote_port) == 10);
const _: () = assert!(offset_of!(XlateKey, proto) == 12);
const _: () = assert!(offset_of!(XlateKey, pad) == 13);

/// `struct ferry_xlate_rule`, the value of `FERRY_XL_RULES`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct XlateRule {
    /// Network byte order. A hold rule's remote address.
    pub new_addr: [u8; 4],
    /// `enum ferry_xlate_action`: [`ACTION_TRANSLATE`] or [`ACTION_HOLD`].
    pub action: u32,
    pub packets_egress: u64,
    pub packets_ingress: u64,
    pub last_seen_ns: u64,
    pub fin_egress: u32,
    pub fin_ingress: u32,
    pub rst_egress: u32,
    pub rst_ingress: u32,
}

// SAFETY: XlateRule is repr(C) and made only of integers and a byte array
// laid out without padding (4 + 4 + 3 * 8 + 4 * 4 = 48 bytes, asserted
// below), so every bit pattern is valid and it may be copied to and from
// the kernel as plain bytes.
unsafe impl aya::Pod for XlateRule {}

const _: () = assert!(size_of::<XlateRule>() == 48);
const _: () = assert!(offset_of!(XlateRule, new_addr) == 0);
const _: () = assert!(offset_of!(XlateRule, action) == 4);
const _: () = assert!(offset_of!(XlateRule, packets_egress) == 8);
const _: () = assert!(offset_of!(XlateRule, packets_ingress) == 16);
const _: () = assert!(offset_of!(XlateRule, last_seen_ns) == 24);
const _: () = assert!(offset_of!(XlateRule, fin_egress) == 32);
const _: () = assert!(offset_of!(XlateRule, fin_ingress) == 36);
const _: () = assert!(offset_of!(XlateRule, rst_egress) == 40);
const _: () = assert!(offset_of!(XlateRule, rst_ingress) == 44);

/// `struct ferry_xlate6_key`: [`XlateKey`] with IPv6 addresses.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Xlate6Key {
    pub local_addr: [u8; 16],
    pub remote_addr: [u8; 16],
    pub local_port: [u8; 2],
    pub remote_port: [u8; 2],
    pub proto: u8,
    pub pad: [u8; 3],
}

// SAFETY: Xlate6Key is repr(C) and made only of byte arrays and a u8 (40
// bytes, alignment 1, no padding: asserted below), so every bit pattern is
// valid and it may be copied to and from the kernel as plain bytes.
unsafe impl aya::Pod for Xlate6Key {}

const _: () = assert!(size_of::<Xlate6Key>() == 40);
const _: () = assert!(offset_of!(Xlate6Key, remote_addr) == 16);
const _: () = assert!(offset_of!(Xlate6Key, local_port) == 32);
const _: () = assert!(offset_of!(Xlate6Key, remote_port) == 34);
const _: () = assert!(offset_of!(Xlate6Key, proto) == 36);

/// `struct ferry_xlate6_rule`, the value of `FERRY_XL_RULES6`: as
/// [`XlateRule`] with a 16-byte address (and a pad after the action).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Xlate6Rule {
    pub new_addr: [u8; 16],
    pub action: u32,
    pub pad: u32,
    pub packets_egress: u64,
    pub packets_ingress: u64,
    pub last_seen_ns: u64,
    pub fin_egress: u32,
    pub fin_ingress: u32,
    pub rst_egress: u32,
    pub rst_ingress: u32,
}

// SAFETY: Xlate6Rule is repr(C) and made only of integers and a byte array
// laid out without padding (16 + 4 + 4 + 3 * 8 + 4 * 4 = 64 bytes, asserted
// below), so every bit pattern is valid and it may be copied to and from
// the kernel as plain bytes.
unsafe impl aya::Pod for Xlate6Rule {}

const _: () = assert!(size_of::<Xlate6Rule>() == 64);
const _: () = assert!(offset_of!(Xlate6Rule, action) == 16);
const _: () = assert!(offset_of!(Xlate6Rule, packets_egress) == 24);
const _: () = assert!(offset_of!(Xlate6Rule, rst_ingress) == 60);

/// Sizes of `struct ferry_xlate6_frag_key` and `struct ferry_xlate6_frag`.
pub(crate) const FRAG6_KEY_SIZE: u32 = 40;
pub(crate) const FRAG6_VALUE_SIZE: u32 = 24;

/// `enum ferry_xlate_action`.
pub(crate) const ACTION_TRANSLATE: u32 = 0;
pub(crate) const ACTION_HOLD: u32 = 1;

/// Sizes of `struct ferry_xlate_frag_key` and `struct ferry_xlate_frag`,
/// which only the programs use; known here to check a pinned
/// `FERRY_XL_FRAGS`.
pub(crate) const FRAG_KEY_SIZE: u32 = 12;
pub(crate) const FRAG_VALUE_SIZE: u32 = 8;

/// `max_entries` of the maps in c/translate.bpf.c, to check pinned maps.
pub(crate) const RULES_MAX: u32 = 65536;
pub(crate) const FRAGS_MAX: u32 = 4096;

/// Indices of `FERRY_XL_COUNT` (`enum ferry_xlate_counter`).
pub(crate) const CNT_EGRESS: u32 = 0;
pub(crate) const CNT_INGRESS: u32 = 1;
pub(crate) const CNT_PASSED: u32 = 2;
pub(crate) const CNT_MALFORMED: u32 = 3;
pub(crate) const CNT_REDIRECT_NEIGH: u32 = 4;
pub(crate) const CNT_DROPPED: u32 = 5;
pub(crate) const CNT_HELD: u32 = 6;
pub(crate) const CNT_MAX: u32 = 7;
