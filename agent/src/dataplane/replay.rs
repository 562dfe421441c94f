//! Replaying captured packets into this node's stack when a process
//! resumes here (the destination's commit, or the source's abort): in
//! arrival order, minus what the source delivered itself, each connection's
//! consecutive segments joined, a large batch spread over one thread per
//! CPU (TCPmig's re-injection after the restore).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::DataPlane;
use super::capture::{DeliveredLog, digest};
use super::filter::{CapturedPacket, DataPlaneError};
use crate::process::nice::ThreadNice;
use crate::sync::lock;

/// At most this many threads replay one batch.
const MAX_REPLAY_LANES: usize = 4;
/// Batches of fewer segments than this are replayed by one thread: a
/// thread costs more than it saves on them.
const PARALLEL_REPLAY_MIN: usize = 256;

/// The replay threads' nice value while they replay (that of CRIU, whose
/// work the freeze waits on too). With the process resumed, every captured
/// segment still waits for its replay, and on a busy node the replay's
/// threads shared the cores with the clients' traffic they were catching
/// up with: at 4096 connections on 2 cores (no idle CPU before any
/// migration) 20,000-37,000 packets took 190-540 ms, while more arrived to
/// be captured, and clients whose segments waited past their RTO
/// retransmitted.
const REPLAY_NICE: i32 = crate::process::nice::AHEAD;

/// Hands packets to this node's stack as if just received. Faked in unit
/// tests.
pub trait PacketReplayer: Send {
    fn replay(&mut self, packet: &[u8]) -> Result<(), DataPlaneError>;
    /// Another replayer into the same stack, for another thread.
    fn try_clone(&self) -> Result<Box<dyn PacketReplayer>, DataPlaneError>;
}

impl PacketReplayer for ferry_ebpf::Replayer {
    fn replay(&mut self, packet: &[u8]) -> Result<(), DataPlaneError> {
        ferry_ebpf::Replayer::replay(self, packet)
            .map_err(|e| DataPlaneError(format!("replaying a packet: {e}")))
    }

    fn try_clone(&self) -> Result<Box<dyn PacketReplayer>, DataPlaneError> {
        ferry_ebpf::Replayer::try_clone(self)
            .map(|r| Box::new(r) as Box<dyn PacketReplayer>)
            .map_err(|e| DataPlaneError(format!("another replay socket: {e}")))
    }
}

/// Which of `lanes` replay threads takes `packet`. A TCP segment goes by
/// its connection (addresses and ports, hashed), so each connection's
/// segments enter the stack in their order, from one thread; segments of
/// different connections may interleave, which no socket can tell. The
/// rest goes to lane 0 in arrival order: UDP (datagrams from many peers
/// into one socket keep the order they arrived in), fragments (a fragment
/// carries no ports; TCP reorders the rare fragmented segment itself), other
/// protocols and anything malformed.
pub fn lane_of(packet: &[u8], lanes: usize) -> usize {
    if lanes <= 1 {
        return 0;
    }
    let (addresses, ports) = match packet.first().map(|b| b >> 4) {
        Some(4) if packet.len() >= 20 && packet[9] == 6 => {
            let ihl = usize::from(packet[0] & 0x0f) * 4;
            let fragment = u16::from_be_bytes([packet[6], packet[7]]) & 0x3fff != 0;
            if ihl < 20 || fragment || packet.len() < ihl + 4 {
                return 0;
            }
            (&packet[12..20], &packet[ihl..ihl + 4])
        }
        // IPv6 with TCP right after the fixed header; behind extension
        // headers (which TCP senders do not add) lane 0, as a fragment.
        Some(6) if packet.len() >= 44 && packet[6] == 6 => (&packet[8..40], &packet[40..44]),
        _ => return 0,
    };
    // FNV-1a over the addresses and ports, then a finaliser (MurmurHash3's)
    // so that the low bits, which pick the lane, depend on every byte.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in addresses.iter().chain(ports) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    (h % lanes as u64) as usize
}

#[cfg(any(test, feature = "fuzzing"))]
pub mod fake {
    use std::sync::{Arc, Mutex};

    /// Keeps every replayed packet.
    #[derive(Default, Clone)]
    pub struct FakeReplayer(pub Arc<Mutex<Vec<Vec<u8>>>>);

    impl super::PacketReplayer for FakeReplayer {
        fn replay(&mut self, packet: &[u8]) -> Result<(), super::DataPlaneError> {
            self.0.lock().unwrap().push(packet.to_vec());
            Ok(())
        }

        /// Records into the same list.
        fn try_clone(&self) -> Result<Box<dyn super::PacketReplayer>, super::DataPlaneError> {
            Ok(Box::new(self.clone()))
        }
    }
}

/// Captured packets replayed by this agent since it started.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplayTotals {
    pub replayed: u64,
    pub skipped_delivered: u64,
    pub failed: u64,
}

/// The replayers (one per lane, cloned from the first when a large batch
/// first needs them) and what they replayed.
pub(super) struct Replay {
    main: Mutex<Box<dyn PacketReplayer>>,
    /// Replayers for the other lanes of a parallel replay.
    others: Mutex<Vec<Box<dyn PacketReplayer>>>,
    /// How many threads replay a large batch: one per CPU, at most
    /// [`MAX_REPLAY_LANES`].
    lanes: usize,
    totals: Mutex<ReplayTotals>,
}

impl Replay {
    pub(super) fn new(replayer: Box<dyn PacketReplayer>) -> Self {
        Self {
            main: Mutex::new(replayer),
            others: Mutex::new(Vec::new()),
            lanes: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(MAX_REPLAY_LANES),
            totals: Mutex::new(ReplayTotals::default()),
        }
    }

    pub(super) fn totals(&self) -> ReplayTotals {
        *lock(&self.totals)
    }
}

/// What one replay thread did.
#[derive(Debug, Default)]
struct LaneDone {
    replayed: u64,
    segments: u64,
    failed: u64,
}

impl LaneDone {
    fn add(&mut self, other: LaneDone) {
        self.replayed += other.replayed;
        self.segments += other.segments;
        self.failed += other.failed;
    }
}

/// Replays `joined` in order through `replayer`.
fn replay_lane<'a>(
    replayer: &mut dyn PacketReplayer,
    joined: impl Iterator<Item = &'a ferry_ebpf::coalesce::Joined>,
) -> LaneDone {
    let mut done = LaneDone::default();
    for j in joined {
        match replayer.replay(&j.packet) {
            Ok(()) => {
                done.replayed += j.packets as u64;
                done.segments += 1;
            }
            Err(e) => {
                done.failed += j.packets as u64;
                tracing::warn!(packets = j.packets, error = %e, "replaying captured packets");
            }
        }
    }
    done
}

impl DataPlane {
    /// Replays what is captured for migration `id` (the ports must be
    /// releasing: capturing, egress open), then runs `open` (which must make
    /// the ports pass packets again) and replays what arrived in between.
    /// Packets are replayed in arrival order, except those found in
    /// `delivered` (digests of what the source delivered, see
    /// [`DeliveredLog`]), which are skipped. `carried`: the datagrams the
    /// source's sockets held unread, as packets, replayed first. Blocking.
    ///
    /// The ports open once what was captured until the call is replayed:
    /// the process already runs, so every packet captured after that would
    /// cost a copy out of the kernel and a second pass through the stack
    /// for nothing. Those captured while that first batch was replayed
    /// follow right after the opening and may be overtaken by a few live
    /// ones, which TCP reorders and UDP allows. (Up to three passes before
    /// the opening, as when the replay was inside the freeze, chased the
    /// peers' answers to the replay itself: at 4096 connections on 2 cores
    /// the later passes were acknowledgments of the resumed process's
    /// answers, 55-150 ms of replay in all.)
    pub fn replay_and_open<E>(
        &self,
        id: &str,
        carried: &[Vec<u8>],
        delivered: &[u64],
        unread: &[u64],
        open: impl FnOnce() -> Result<(), E>,
    ) -> Result<ferry_proto::v1::ReplayStats, E> {
        let mut stats = ferry_proto::v1::ReplayStats::default();
        let started = Instant::now();
        // The lanes `replay_joined` starts inherit it.
        let _ahead = ThreadNice::raise(REPLAY_NICE);
        let drops_before = super::softnet::backlog_drops();
        // First what the source's sockets held unread: it arrived before
        // anything the source left undelivered, which is all the replay
        // below hands over.
        if !carried.is_empty() {
            let mut main = lock(&self.replay.main);
            for packet in carried {
                match main.replay(packet) {
                    Ok(()) => stats.carried += 1,
                    Err(e) => {
                        stats.failed += 1;
                        tracing::warn!(error = %e, "handing over a datagram the source left unread");
                    }
                }
            }
        }
        let mut delivered = DeliveredLog::new(delivered);
        // The same multiset type, keyed by datagram: delivered on the
        // source but never read there.
        let mut unread = DeliveredLog::new(unread);
        let mut collecting = Duration::ZERO;
        let mut collect = |me: &Self| {
            let t = Instant::now();
            me.collect_captured();
            collecting += t.elapsed();
        };
        collect(self);
        let batch = self.capture.take_captured(id);
        self.replay_pass(&batch, &mut delivered, &mut unread, &mut stats);
        let opening = Instant::now();
        open()?;
        let opening = opening.elapsed();
        collect(self);
        let rest = self.capture.take_captured(id);
        self.replay_pass(&rest, &mut delivered, &mut unread, &mut stats);
        self.capture.close(id);
        stats.replay_time_us = started.elapsed().as_micros() as u64;
        match (drops_before, super::softnet::backlog_drops()) {
            (Ok(before), Ok(after)) => stats.input_backlog_drops = after.saturating_sub(before),
            (Err(e), _) | (_, Err(e)) => {
                tracing::debug!(error = %e, "the input backlog's drops during the replay")
            }
        }
        tracing::debug!(
            total_us = stats.replay_time_us,
            collecting_us = collecting.as_micros() as u64,
            opening_us = opening.as_micros() as u64,
            segments = stats.replayed_segments,
            "replay timings"
        );
        let mut totals = lock(&self.replay.totals);
        totals.replayed += stats.replayed;
        totals.skipped_delivered += stats.skipped_delivered;
        totals.failed += stats.failed;
        Ok(stats)
    }

    /// Replays one batch, skipping what the source delivered.
    fn replay_pass(
        &self,
        batch: &[CapturedPacket],
        delivered: &mut DeliveredLog,
        unread: &mut DeliveredLog,
        stats: &mut ferry_proto::v1::ReplayStats,
    ) {
        stats.captured += batch.len() as u64;
        let fresh = batch.iter().filter(|p| {
            let mut handled = !delivered.is_empty() && delivered.take(digest(&p.data));
            // Delivered, but left unread in a socket CRIU does not carry
            // the queue of: replayed after all.
            if handled
                && !unread.is_empty()
                && crate::sockstate::key_of_packet(&p.data).is_some_and(|k| unread.take(k))
            {
                handled = false;
            }
            if handled {
                stats.skipped_delivered += 1;
            }
            !handled
        });
        // Each connection's consecutive segments enter the stack as one
        // (ferry_ebpf::coalesce says why): the replay is inside the freeze.
        let joined = ferry_ebpf::coalesce::coalesce(fresh.map(|p| p.data.as_slice()));
        let done = self.replay.replay_joined(&joined);
        stats.replayed += done.replayed;
        stats.replayed_segments += done.segments;
        stats.failed += done.failed;
    }
}

impl Replay {
    /// Replays `joined`, on one thread per CPU when there are many: a
    /// replayed segment costs its whole receive path (and the ACK's way
    /// out) on the CPU that sends it, and with the process stopped the
    /// other CPUs are mostly idle, so a large batch is cut by connection
    /// ([`lane_of`]).
    fn replay_joined(&self, joined: &[ferry_ebpf::coalesce::Joined]) -> LaneDone {
        let mut main = lock(&self.main);
        let mut others = lock(&self.others);
        let mut lanes = if joined.len() >= PARALLEL_REPLAY_MIN {
            self.lanes
        } else {
            1
        };
        while others.len() + 1 < lanes {
            match main.try_clone() {
                Ok(r) => others.push(r),
                Err(e) => {
                    tracing::warn!(error = %e, "a replayer for another thread");
                    break;
                }
            }
        }
        lanes = lanes.min(others.len() + 1);
        if lanes == 1 {
            return replay_lane(&mut **main, joined.iter());
        }
        let mut split: Vec<Vec<&ferry_ebpf::coalesce::Joined>> = vec![Vec::new(); lanes];
        for j in joined {
            split[lane_of(&j.packet, lanes)].push(j);
        }
        let mut split = split.into_iter();
        let first = split.next().unwrap_or_default();
        std::thread::scope(|s| {
            let threads: Vec<_> = others
                .iter_mut()
                .zip(split)
                .map(|(r, lane)| {
                    let packets: usize = lane.iter().map(|j| j.packets).sum();
                    (
                        packets,
                        s.spawn(move || replay_lane(&mut **r, lane.into_iter())),
                    )
                })
                .collect();
            let mut done = replay_lane(&mut **main, first.into_iter());
            for (packets, t) in threads {
                done.add(t.join().unwrap_or_else(|_| {
                    tracing::error!(packets, "a replay thread panicked");
                    LaneDone {
                        failed: packets as u64,
                        ..LaneDone::default()
                    }
                }));
            }
            done
        })
    }
}
