//! Iterators linked to one process: the task filter of an iterator link
//! (Linux 6.1+), which aya's `Iter::attach` does not take.

/// `bpf(2)` commands and the attach type of iterator links
/// (<linux/bpf.h>); aya's `Iter::attach` takes no link parameters, and the
/// task filter is one.
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_ITER_CREATE: libc::c_long = 33;
const BPF_TRACE_ITER: u32 = 28;

/// `union bpf_iter_link_info`, its `task` member: iterate the threads of
/// process `pid` only (Linux 6.1+).
#[repr(C)]
#[derive(Default)]
struct IterTaskInfo {
    tid: u32,
    pid: u32,
    pid_fd: u32,
}

/// `union bpf_attr` as BPF_LINK_CREATE reads it for an iterator.
#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    iter_info: u64,
    iter_info_len: u32,
    _pad: u32,
}

/// `union bpf_attr` as BPF_ITER_CREATE reads it.
#[repr(C)]
#[derive(Default)]
struct IterCreateAttr {
    link_fd: u32,
    flags: u32,
}

/// Links the per-process iterator to process `pid` and opens it for
/// reading; the link lives as long as the returned file.
pub(crate) fn iter_of_process(
    prog: std::os::fd::BorrowedFd<'_>,
    pid: i32,
) -> std::io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let info = IterTaskInfo {
        pid: u32::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?,
        ..Default::default()
    };
    let attr = LinkCreateAttr {
        prog_fd: prog.as_raw_fd() as u32,
        attach_type: BPF_TRACE_ITER,
        iter_info: &info as *const IterTaskInfo as u64,
        iter_info_len: size_of::<IterTaskInfo>() as u32,
        ..Default::default()
    };
    // `info`, which `attr` points to, lives until the call returns.
    let link = bpf_new_fd(BPF_LINK_CREATE, &attr)?;
    let iter = bpf_new_fd(
        BPF_ITER_CREATE,
        &IterCreateAttr {
            link_fd: link.as_raw_fd() as u32,
            flags: 0,
        },
    )?;
    // The iterator holds the link; the link's own descriptor closes here.
    Ok(std::fs::File::from(iter))
}

/// `bpf(cmd, attr)` for a command that answers with a new descriptor;
/// `attr` is that command's `union bpf_attr` member (and whatever it
/// points to is live).
fn bpf_new_fd<T>(cmd: libc::c_long, attr: &T) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: `attr` is live, initialised and `size_of::<T>()` bytes, the
    // size passed; the kernel reads that many (and what the caller says
    // its pointers point to) and writes nothing back for these commands.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *const T, size_of::<T>() as u32) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the command returned a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}
