//! The messages between ferryd and its page filler, on a `SOCK_SEQPACKET`
//! pair (one message per send, descriptors attached to theirs).
//!
//! ferryd -> filler: first, once the plan is known, `S` + the store's
//! index (u32, little endian) with the store attached, for each store, then
//! `P` + the plan file's path (UTF-8); then `U` + the task's PID in its
//! namespace (i32, little endian) with its userfaultfd attached; `F`:
//! CRIU's restore finished (the areas are in place); `K` + a task's host
//! PID (i32) with its pidfd attached, for each task of the restored tree:
//! the filler kills them should it fail; `G`: the process resumed, the
//! background installs may start. For a plan whose
//! pages follow ([`super::Plan::follows`]): `A` + the store's task (u32)
//! and ranges `{u64 start, u64 end}` of store offsets: those pages are in
//! the store now; `X` + text: no more will come. Filler -> ferryd: `R`:
//! ready (plan read, stores mapped); `W` + task (u32) + start + end (u64):
//! a page fault waits on those store pages, ask for them first; `D` + the
//! [`FillStats`] as JSON: every page is in; `E` + text: it failed.
//! Integers little endian.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{
    AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, recvmsg,
    sendmsg, socketpair,
};

use super::{FillError, FillStats};

/// A message's bytes and the descriptor attached to it, if any.
pub(super) type Received = (Vec<u8>, Option<OwnedFd>);

/// The largest message: a report.
const MAX_MESSAGE: usize = 4096;

/// What ferryd tells the filler.
#[derive(Debug)]
pub enum ToFiller {
    Store {
        index: u32,
        store: OwnedFd,
    },
    Plan {
        path: String,
    },
    Uffd {
        vpid: i32,
        uffd: OwnedFd,
    },
    RestoreFinished,
    /// The restored process runs: the background installs start. Before,
    /// only faults are answered: in the freeze, installing threads would
    /// take the two CPUs from the restore and the commit, and every area
    /// change the restorer makes (its own memory unmapped: a message the
    /// filler must read before the task goes on) would wait for their
    /// chunks.
    Resumed,
    /// A task of the restored tree (host PID, and a pidfd of it), which
    /// the filler kills should it fail: once no one holds its
    /// userfaultfd, a page the filler did not install reads as zeros.
    Guard {
        pid: i32,
        pidfd: OwnedFd,
    },
    /// Pages of task `vpid`'s store that arrived, as store offsets; at most
    /// [`MAX_ARRIVED`] ranges.
    Arrived {
        vpid: u32,
        ranges: Vec<(u64, u64)>,
    },
    /// The pages still to come never will (the source is gone).
    Lost {
        why: String,
    },
}

/// The most ranges one `Arrived` message carries.
pub const MAX_ARRIVED: usize = (MAX_MESSAGE - 5) / 16;

/// What the filler tells ferryd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FromFiller {
    Ready,
    /// A fault waits on these store offsets of task `vpid`'s store.
    Want {
        vpid: u32,
        start: u64,
        end: u64,
    },
    Done(FillStats),
    Failed(String),
}

/// A connected pair: (ferryd's end, the filler's end), close-on-exec.
pub fn pair() -> Result<(OwnedFd, OwnedFd), FillError> {
    socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(|e| FillError::io("creating the filler's control socket")(e.into()))
}

fn send(sock: BorrowedFd<'_>, bytes: &[u8], fd: Option<RawFd>) -> Result<(), FillError> {
    let iov = [IoSlice::new(bytes)];
    let fds = fd.map(|f| [f]);
    let cmsgs: Vec<ControlMessage<'_>> = fds
        .as_ref()
        .map(|f| vec![ControlMessage::ScmRights(f)])
        .unwrap_or_default();
    loop {
        match sendmsg::<()>(sock.as_raw_fd(), &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(_) => return Ok(()),
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(FillError::io("sending to the page filler's peer")(e.into())),
        }
    }
}

/// Receives one message and the descriptor attached to it, if any; `None`
/// at the end (the peer closed). Blocking unless the socket is not.
fn recv(sock: BorrowedFd<'_>) -> Result<Option<Received>, FillError> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut cmsg = nix::cmsg_space!([RawFd; 1]);
    loop {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = match recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(m) => m,
            Err(nix::Error::EINTR) => continue,
            // The peer closed with messages of ours unread (ferryd's last
            // word crossed the filler's report and exit): the kernel says
            // so once, ahead of what the peer sent before closing, which
            // is still to read.
            Err(nix::Error::ECONNRESET) => continue,
            Err(e) => {
                return Err(FillError::io("reading from the page filler's peer")(
                    e.into(),
                ));
            }
        };
        let mut fd = None;
        for c in msg
            .cmsgs()
            .map_err(|e| FillError::Protocol(format!("control message: {e}")))?
        {
            if let ControlMessageOwned::ScmRights(fds) = c {
                for f in fds {
                    // SAFETY: SCM_RIGHTS installed these descriptors in our
                    // table for this message; nothing else owns them.
                    let owned = unsafe { OwnedFd::from_raw_fd(f) };
                    if fd.is_none() {
                        fd = Some(owned);
                    }
                }
            }
        }
        let n = msg.bytes;
        if n == 0 && fd.is_none() {
            return Ok(None);
        }
        buf.truncate(n);
        return Ok(Some((buf, fd)));
    }
}

pub fn send_to_filler(sock: BorrowedFd<'_>, m: &ToFiller) -> Result<(), FillError> {
    match m {
        ToFiller::Store { index, store } => {
            let mut b = vec![b'S'];
            b.extend(index.to_le_bytes());
            send(sock, &b, Some(store.as_raw_fd()))
        }
        ToFiller::Plan { path } => {
            let mut b = vec![b'P'];
            b.extend(path.as_bytes());
            if b.len() > MAX_MESSAGE {
                return Err(FillError::Plan(format!("plan path {path:?} is too long")));
            }
            send(sock, &b, None)
        }
        ToFiller::Uffd { vpid, uffd } => {
            let mut b = vec![b'U'];
            b.extend(vpid.to_le_bytes());
            send(sock, &b, Some(uffd.as_raw_fd()))
        }
        ToFiller::RestoreFinished => send(sock, b"F", None),
        ToFiller::Resumed => send(sock, b"G", None),
        ToFiller::Guard { pid, pidfd } => {
            let mut b = vec![b'K'];
            b.extend(pid.to_le_bytes());
            send(sock, &b, Some(pidfd.as_raw_fd()))
        }
        ToFiller::Arrived { vpid, ranges } => {
            if ranges.len() > MAX_ARRIVED {
                return Err(FillError::Protocol(format!(
                    "{} arrived ranges in one message, more than {MAX_ARRIVED}",
                    ranges.len()
                )));
            }
            let mut b = vec![b'A'];
            b.extend(vpid.to_le_bytes());
            for (start, end) in ranges {
                b.extend(start.to_le_bytes());
                b.extend(end.to_le_bytes());
            }
            send(sock, &b, None)
        }
        ToFiller::Lost { why } => {
            let mut b = vec![b'X'];
            b.extend(why.as_bytes().iter().take(MAX_MESSAGE - 1));
            send(sock, &b, None)
        }
    }
}

/// The next message for the filler; `None` once ferryd closed its end.
pub fn recv_in_filler(sock: BorrowedFd<'_>) -> Result<Option<ToFiller>, FillError> {
    let Some((b, fd)) = recv(sock)? else {
        return Ok(None);
    };
    match (b.first(), fd) {
        (Some(b'U'), Some(uffd)) if b.len() == 5 => Ok(Some(ToFiller::Uffd {
            vpid: i32::from_le_bytes(b[1..5].try_into().expect("4 bytes")),
            uffd,
        })),
        (Some(b'F'), None) if b.len() == 1 => Ok(Some(ToFiller::RestoreFinished)),
        (Some(b'G'), None) if b.len() == 1 => Ok(Some(ToFiller::Resumed)),
        (Some(b'K'), Some(pidfd)) if b.len() == 5 => Ok(Some(ToFiller::Guard {
            pid: i32::from_le_bytes(b[1..5].try_into().expect("4 bytes")),
            pidfd,
        })),
        (Some(b'S'), Some(store)) if b.len() == 5 => Ok(Some(ToFiller::Store {
            index: u32::from_le_bytes(b[1..5].try_into().expect("4 bytes")),
            store,
        })),
        (Some(b'A'), None) if b.len() >= 5 && (b.len() - 5) % 16 == 0 => {
            let long = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
            Ok(Some(ToFiller::Arrived {
                vpid: u32::from_le_bytes(b[1..5].try_into().expect("4 bytes")),
                ranges: (5..b.len())
                    .step_by(16)
                    .map(|i| (long(i), long(i + 8)))
                    .collect(),
            }))
        }
        (Some(b'X'), None) => Ok(Some(ToFiller::Lost {
            why: String::from_utf8_lossy(&b[1..]).into_owned(),
        })),
        (Some(b'P'), None) => Ok(Some(ToFiller::Plan {
            path: String::from_utf8(b[1..].to_vec())
                .map_err(|_| FillError::Protocol("a plan path that is not UTF-8".into()))?,
        })),
        (first, fd) => Err(FillError::Protocol(format!(
            "unexpected message {first:?} of {} bytes{}",
            b.len(),
            if fd.is_some() {
                " with a descriptor"
            } else {
                ""
            }
        ))),
    }
}

pub fn send_from_filler(sock: BorrowedFd<'_>, m: &FromFiller) -> Result<(), FillError> {
    let b = match m {
        FromFiller::Ready => b"R".to_vec(),
        FromFiller::Want { vpid, start, end } => {
            let mut b = b"W".to_vec();
            b.extend(vpid.to_le_bytes());
            b.extend(start.to_le_bytes());
            b.extend(end.to_le_bytes());
            b
        }
        FromFiller::Done(stats) => {
            let mut b = b"D".to_vec();
            b.extend(serde_json::to_vec(stats).expect("plain numbers serialize"));
            b
        }
        FromFiller::Failed(why) => {
            let mut b = b"E".to_vec();
            b.extend(why.as_bytes().iter().take(MAX_MESSAGE - 1));
            b
        }
    };
    send(sock, &b, None)
}

/// The filler's next word; `None` once it closed its end (exited).
pub fn recv_from_filler(sock: BorrowedFd<'_>) -> Result<Option<FromFiller>, FillError> {
    let Some((b, _)) = recv(sock)? else {
        return Ok(None);
    };
    match b.split_first() {
        Some((b'R', [])) => Ok(Some(FromFiller::Ready)),
        Some((b'W', rest)) if rest.len() == 20 => Ok(Some(FromFiller::Want {
            vpid: u32::from_le_bytes(rest[0..4].try_into().expect("4 bytes")),
            start: u64::from_le_bytes(rest[4..12].try_into().expect("8 bytes")),
            end: u64::from_le_bytes(rest[12..20].try_into().expect("8 bytes")),
        })),
        Some((b'D', json)) => serde_json::from_slice(json)
            .map(|s| Some(FromFiller::Done(s)))
            .map_err(|e| FillError::Protocol(format!("a report that is not JSON: {e}"))),
        Some((b'E', text)) => Ok(Some(FromFiller::Failed(
            String::from_utf8_lossy(text).into_owned(),
        ))),
        other => Err(FillError::Protocol(format!(
            "unexpected message {:?}",
            other.map(|(c, _)| *c)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn messages_cross_with_their_descriptors() {
        let (ours, theirs) = pair().unwrap();
        let (probe, _keep) = pair().unwrap();
        send_to_filler(
            ours.as_fd(),
            &ToFiller::Uffd {
                vpid: 42,
                uffd: probe,
            },
        )
        .unwrap();
        send_to_filler(ours.as_fd(), &ToFiller::RestoreFinished).unwrap();
        send_to_filler(ours.as_fd(), &ToFiller::Resumed).unwrap();
        let (store, _keep_store) = pair().unwrap();
        send_to_filler(ours.as_fd(), &ToFiller::Store { index: 3, store }).unwrap();
        send_to_filler(
            ours.as_fd(),
            &ToFiller::Plan {
                path: "/run/ferry/plan.json".into(),
            },
        )
        .unwrap();
        match recv_in_filler(theirs.as_fd()).unwrap() {
            Some(ToFiller::Uffd { vpid: 42, uffd }) => assert!(uffd.as_raw_fd() >= 0),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            recv_in_filler(theirs.as_fd()).unwrap(),
            Some(ToFiller::RestoreFinished)
        ));
        assert!(matches!(
            recv_in_filler(theirs.as_fd()).unwrap(),
            Some(ToFiller::Resumed)
        ));
        match recv_in_filler(theirs.as_fd()).unwrap() {
            Some(ToFiller::Store { index: 3, store }) => assert!(store.as_raw_fd() >= 0),
            other => panic!("{other:?}"),
        }
        match recv_in_filler(theirs.as_fd()).unwrap() {
            Some(ToFiller::Plan { path }) => assert_eq!(path, "/run/ferry/plan.json"),
            other => panic!("{other:?}"),
        }
        let (pidfd, _keep_pidfd) = pair().unwrap();
        send_to_filler(ours.as_fd(), &ToFiller::Guard { pid: 77, pidfd }).unwrap();
        match recv_in_filler(theirs.as_fd()).unwrap() {
            Some(ToFiller::Guard { pid: 77, pidfd }) => assert!(pidfd.as_raw_fd() >= 0),
            other => panic!("{other:?}"),
        }
        let ranges: Vec<(u64, u64)> = (0..MAX_ARRIVED as u64)
            .map(|i| (i << 20, (i << 20) + 0x3000))
            .collect();
        send_to_filler(
            ours.as_fd(),
            &ToFiller::Arrived {
                vpid: 9,
                ranges: ranges.clone(),
            },
        )
        .unwrap();
        match recv_in_filler(theirs.as_fd()).unwrap() {
            Some(ToFiller::Arrived { vpid: 9, ranges: r }) => assert_eq!(r, ranges),
            other => panic!("{other:?}"),
        }
        let mut too_many = ranges;
        too_many.push((0, 0x1000));
        assert!(
            send_to_filler(
                ours.as_fd(),
                &ToFiller::Arrived {
                    vpid: 9,
                    ranges: too_many
                }
            )
            .is_err()
        );
        send_to_filler(ours.as_fd(), &ToFiller::Lost { why: "cut".into() }).unwrap();
        match recv_in_filler(theirs.as_fd()).unwrap() {
            Some(ToFiller::Lost { why }) => assert_eq!(why, "cut"),
            other => panic!("{other:?}"),
        }
        let stats = FillStats {
            pages: 7,
            faults: 2,
            ..Default::default()
        };
        for m in [
            FromFiller::Ready,
            FromFiller::Want {
                vpid: 3,
                start: 0x7f00_0000_0000,
                end: 0x7f00_0001_0000,
            },
            FromFiller::Done(stats),
            FromFiller::Failed("no".into()),
        ] {
            send_from_filler(theirs.as_fd(), &m).unwrap();
            assert_eq!(recv_from_filler(ours.as_fd()).unwrap(), Some(m));
        }
        drop(theirs);
        assert_eq!(recv_from_filler(ours.as_fd()).unwrap(), None);
    }

    #[test]
    fn a_report_is_read_even_when_the_filler_left_a_message_unread() {
        // ferryd's message crosses the filler's report and exit: the filler
        // closes with it unread, and the kernel reports ECONNRESET to
        // ferryd's end once, before the report still queued there.
        let (ours, theirs) = pair().unwrap();
        send_to_filler(ours.as_fd(), &ToFiller::RestoreFinished).unwrap();
        let done = FromFiller::Done(FillStats {
            pages: 15,
            ..Default::default()
        });
        send_from_filler(theirs.as_fd(), &done).unwrap();
        drop(theirs);
        assert_eq!(recv_from_filler(ours.as_fd()).unwrap(), Some(done));
        assert_eq!(recv_from_filler(ours.as_fd()).unwrap(), None);
    }
}
