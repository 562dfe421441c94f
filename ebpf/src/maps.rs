//! Rust mirrors of the layouts in include/ferry_dataplane.h.

/// `struct ferry_port_key`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PortKey {
    pub proto: u8,
    pub pad: u8,
    /// Host byte order.
    pub port: u16,
}

// SAFETY: PortKey is repr(C), made only of integers, with no padding (4
// bytes: u8, u8, u16), so every bit pattern is valid and it may be copied
// to and from the kernel as bytes.
unsafe impl aya::Pod for PortKey {}

pub(crate) const PORT_OWNED: u32 = 1;
pub(crate) const PORT_FROZEN: u32 = 2;

pub(crate) const CNT_PASSED: u32 = 0;
pub(crate) const CNT_DROPPED_NOT_OWNED: u32 = 1;
pub(crate) const CNT_DROPPED_FROZEN: u32 = 2;
pub(crate) const CNT_PASSED_OTHER: u32 = 3;
pub(crate) const CNT_EGRESS_BLOCKED: u32 = 4;

const _: () = assert!(std::mem::size_of::<PortKey>() == 4);
