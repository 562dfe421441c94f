//! Drain before freeze (XtreemOS distributed servers §3.2.3): with the process
//! stopped but its packets still flowing, wait a bounded time for its
//! connections' send queues to empty.
//!
//! What a stopped process had written keeps leaving, and the peers'
//! acknowledgements keep arriving, as long as the data plane has not cut
//! the ports off. Once every byte is acknowledged the connection's state
//! is a few sequence numbers: nothing of its send queue crosses in the
//! freeze, nothing is retransmitted from the destination, and a peer
//! waiting on a delayed ACK does not wait through the freeze for its
//! answer. The cost is the wait itself, inside the process's stop: worth
//! it only where queues are large against the link (a bulk sender), and
//! bounded for a peer that reads nothing.

use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use super::sys;

/// How often the queues are asked while they drain. An ioctl per
/// connection each time: ~1 ms of CPU per 1,000 connections, so not much
/// more often.
const POLL: Duration = Duration::from_millis(2);

/// What a drain found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Flushed {
    /// Bytes in the send queues (sent or not, unacknowledged) at the start.
    pub bytes_at_start: u64,
    /// Bytes still there at the end (0: every queue emptied in time).
    pub bytes_left: u64,
    /// How long it waited.
    pub waited: Duration,
}

/// Waits until the send queue (SIOCOUTQ: bytes not yet acknowledged) of
/// every socket of `conns` is empty, for at most `bound`. A socket that
/// cannot be asked (closed meanwhile) counts as empty. Blocking.
pub fn flush_send_queues<'a>(
    conns: impl IntoIterator<Item = BorrowedFd<'a>>,
    bound: Duration,
) -> Flushed {
    let started = Instant::now();
    let queued = |fd: BorrowedFd<'_>| u64::from(sys::outq(fd).unwrap_or(0));
    let mut waiting: Vec<(BorrowedFd<'a>, u64)> = conns
        .into_iter()
        .map(|fd| (fd, queued(fd)))
        .filter(|(_, q)| *q > 0)
        .collect();
    let bytes_at_start = waiting.iter().map(|(_, q)| q).sum();
    loop {
        let left: u64 = waiting.iter().map(|(_, q)| q).sum();
        let elapsed = started.elapsed();
        if left == 0 || elapsed >= bound {
            return Flushed {
                bytes_at_start,
                bytes_left: left,
                waited: elapsed,
            };
        }
        std::thread::sleep(POLL.min(bound - elapsed));
        for (fd, q) in waiting.iter_mut() {
            *q = queued(*fd);
        }
        waiting.retain(|(_, q)| *q > 0);
    }
}
