//! The C ABI (`include/ferry_handoff.h`): the same calls as the Rust API,
//! for servers in C and any language with a C FFI. Each call returns -1 on
//! failure with `errno` set and the reason in [`ferry_handoff_error`].

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, IntoRawFd, OwnedFd};
use std::time::Duration;

use crate::{Error, HandoffOptions, Reply, wire};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// The port each channel `ferry_serve` gave serves: `ferry_accept`
/// registers again on it when ferryd restarts, as [`crate::Server::accept`]
/// does.
static CHANNELS: std::sync::Mutex<Vec<(c_int, u16)>> = std::sync::Mutex::new(Vec::new());

fn port_of(channel: c_int) -> Option<u16> {
    let channels = CHANNELS.lock().unwrap_or_else(|e| e.into_inner());
    channels
        .iter()
        .find(|(c, _)| *c == channel)
        .map(|(_, p)| *p)
}

fn fail(e: &Error) -> c_int {
    let message = CString::new(e.to_string().replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = message);
    // SAFETY: __errno_location() returns this thread's errno, always valid
    // to write.
    unsafe { *libc::__errno_location() = e.errno() };
    -1
}

/// The reason of this thread's last failed call, valid until its next call.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_handoff_error() -> *const c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// Registers the calling process as a server of the group on `port`.
/// Returns the channel descriptor (readable when a connection is handed to
/// the process; keep it open to stay a server), or -1.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_serve(port: u16) -> c_int {
    match crate::Server::serve(port) {
        Ok(s) => {
            let fd = s.channel.into_raw_fd();
            let mut channels = CHANNELS.lock().unwrap_or_else(|e| e.into_inner());
            // A number closed and given again by the kernel serves the
            // newest port.
            channels.retain(|(c, _)| *c != fd);
            channels.push((fd, port));
            fd
        }
        Err(e) => fail(&e),
    }
}

/// Takes the next connection handed to this process on `channel` (blocking
/// as the descriptor is). If ferryd restarted, registers again on the same
/// descriptor number first (for up to 30 s). The donor's state is copied into `state` (up to
/// `*state_len` bytes), and `*state_len` is set to its whole length.
/// Returns the connection's descriptor, or -1.
///
/// # Safety
/// `state` must be valid for writes of `*state_len` bytes (or null with
/// `*state_len` 0), and `state_len` valid for a read and a write (or null).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_accept(
    channel: c_int,
    state: *mut c_void,
    state_len: *mut usize,
) -> c_int {
    // SAFETY: the caller passes a descriptor it keeps open for the call.
    let channel = unsafe { BorrowedFd::borrow_raw(channel) };
    let got = loop {
        match wire::recv::<Reply>(channel) {
            Ok(g) => break g,
            // ferryd restarted: register again on the same descriptor.
            Err(wire::WireError::Closed) if let Some(port) = port_of(channel.as_raw_fd()) => {
                if let Err(e) = crate::register_again_onto(channel, &crate::socket_path(), port) {
                    return fail(&e);
                }
            }
            Err(e) => return fail(&e.into()),
        }
    };
    let fd: OwnedFd = match (got.head, got.fd) {
        (Reply::Accepted { .. }, Some(fd)) => fd,
        (head, _) => return fail(&crate::refused(head)),
    };
    if !state_len.is_null() {
        // SAFETY: the caller gives a valid `state_len`, and `state` valid
        // for `*state_len` bytes; at most that many are written.
        unsafe {
            let room = *state_len;
            if !state.is_null() {
                let n = room.min(got.state.len());
                std::ptr::copy_nonoverlapping(got.state.as_ptr(), state.cast::<u8>(), n);
            }
            *state_len = got.state.len();
        }
    }
    fd.into_raw_fd()
}

/// Hands the connection `conn` to the group's server on `node`, with
/// `state_len` bytes of `state` for it; `drain_ms` > 0 first waits up to
/// that long for the client to acknowledge what was sent. Returns 0 (the
/// connection is the acceptor's: close `conn`, which sends nothing) or -1
/// (it is still the caller's, untouched).
///
/// # Safety
/// `node` must be a NUL-terminated string and `state` valid for reads of
/// `state_len` bytes (or null with `state_len` 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_handoff(
    conn: c_int,
    node: *const c_char,
    state: *const c_void,
    state_len: usize,
    drain_ms: u32,
) -> c_int {
    if node.is_null() || (state.is_null() && state_len > 0) {
        return fail(&Error::Refused {
            kind: wire::ErrorKind::BadRequest,
            message: "ferry_handoff: node or state is NULL".into(),
        });
    }
    // SAFETY: checked non-null; the caller promises a C string.
    let node = unsafe { CStr::from_ptr(node) }.to_string_lossy();
    let state = if state_len == 0 {
        &[][..]
    } else {
        // SAFETY: non-null, and the caller promises `state_len` bytes.
        unsafe { std::slice::from_raw_parts(state.cast::<u8>(), state_len) }
    };
    // SAFETY: the caller passes a descriptor it keeps open for the call.
    let conn = unsafe { BorrowedFd::borrow_raw(conn) };
    let options = HandoffOptions {
        drain: Duration::from_millis(u64::from(drain_ms)),
    };
    match crate::handoff_fd(conn, &node, state, &options) {
        Ok(_) => 0,
        Err(e) => fail(&e),
    }
}

/// Which member should serve a new connection of the group on `port`: its
/// name is copied into `node` (NUL-terminated, at most `node_len` bytes
/// with the NUL). Returns 1 if it is this node (serve it here), 0 if
/// another (hand it off there), or -1.
///
/// # Safety
/// `node` must be valid for writes of `node_len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_place(port: u16, node: *mut c_char, node_len: usize) -> c_int {
    match crate::place(port) {
        Ok(p) => {
            if p.node.len() + 1 > node_len || node.is_null() {
                return fail(&Error::Refused {
                    kind: wire::ErrorKind::BadRequest,
                    message: format!("ferry_place: the node's name {:?} does not fit", p.node),
                });
            }
            // SAFETY: the caller gives `node_len` writable bytes; the name
            // and its NUL fit, checked above.
            unsafe {
                std::ptr::copy_nonoverlapping(p.node.as_ptr(), node.cast::<u8>(), p.node.len());
                *node.add(p.node.len()) = 0;
            }
            c_int::from(p.here)
        }
        Err(e) => fail(&e),
    }
}
