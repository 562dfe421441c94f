//! How much of post-copy's background traffic may be in flight: the
//! pages sent to the destination and not acknowledged as stored.
//!
//! Enough to keep the path full, and a little more: the destination
//! stores at rate `r`, a batch takes at least `min_rtt` from its read here
//! to its acknowledgement (the path's own delay: reading, sealing, the
//! link, storing), so `r × min_rtt` keeps it busy. A fault's ask waits
//! behind what is in flight: [`QUEUED`] of it at that rate, the path
//! included, or the path and [`FAULTING_QUEUED`] where the path alone is
//! longer; while faults ask, the path and [`FAULTING_QUEUED`]. Some queue
//! there must be: with none, the rate measured could never exceed the
//! rate sent, and would only fall.
//!
//! The window before this one was `r × QUEUED`, and a fixed 128 KiB while
//! faults asked, which with a process that faults throughout (the
//! memory bench's writer asks ~60 times a second) was nearly always: the
//! fill then ran at 128 KiB a round, whatever the cores could carry. Here
//! the faulting window follows the rate too. Measured (1 GiB, release
//! build, no link limit, interleaved, with the Peer connections' read
//! buffer of `crate::peer_io`): 391-448 MB/s against 233-371; at 1 Gb/s
//! the fill is the link's either way and the faults' summed wait the same
//! (744-763 ms against 766-768). The shortest round seen was 80-260 µs
//! without a link limit, ~240 µs at 1 Gb/s (the lead batches of asks are
//! 16 KiB): shorter than [`QUEUED`] here, so outside faults the window is
//! the one before.
//!
//! `min_rtt` is the shortest round seen on the stream: a queue only
//! lengthens a round, so the shortest is the path's own delay (as in
//! BBR's model, Cardwell et al., 2016).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The queue behind which a fault's pages may wait, at the fill's rate.
/// At 1 Gb/s: 2 ms kept the faults' summed wait as low as CRIU's lazy
/// pages' (1 GiB, release build); 4 ms raised it by half.
pub const QUEUED: Duration = Duration::from_millis(2);
/// The least in flight: two of the smallest batches.
pub const MIN_WINDOW: u64 = 256 << 10;
/// The most in flight.
pub const MAX_WINDOW: u64 = 16 << 20;
/// While faults ask: the queue allowed, and at least this much in flight,
/// so that the fill does not stop between two faults.
pub const FAULTING_QUEUED: Duration = Duration::from_micros(500);
pub const FAULTING_MIN: u64 = 128 << 10;
/// How often the rate is measured again.
pub const RATE_PERIOD: Duration = Duration::from_millis(50);

/// The window's state: batches in flight, the shortest round, the rate.
#[derive(Debug)]
pub struct Window {
    /// Each batch not acknowledged yet: the stream's offset at its end,
    /// and when it was read.
    in_flight: VecDeque<(u64, Instant)>,
    min_rtt: Option<Duration>,
    /// Bytes stored by the destination, and when that was last measured.
    mark: (Instant, u64),
    rate: f64,
    stored: u64,
}

impl Window {
    pub fn new(now: Instant) -> Window {
        Window {
            in_flight: VecDeque::new(),
            min_rtt: None,
            mark: (now, 0),
            rate: 0.0,
            stored: 0,
        }
    }

    /// A batch ending at offset `end` of the stream was read at `at`.
    pub fn sent(&mut self, end: u64, at: Instant) {
        self.in_flight.push_back((end, at));
    }

    /// The destination has stored the stream up to offset `stored`.
    pub fn stored(&mut self, stored: u64, now: Instant) {
        self.stored = self.stored.max(stored);
        while let Some(&(end, at)) = self.in_flight.front() {
            if end > self.stored {
                break;
            }
            self.in_flight.pop_front();
            let rtt = now.saturating_duration_since(at);
            self.min_rtt = Some(self.min_rtt.map_or(rtt, |m| m.min(rtt)));
        }
        let elapsed = now.saturating_duration_since(self.mark.0);
        if elapsed >= RATE_PERIOD {
            self.rate = (self.stored - self.mark.1) as f64 / elapsed.as_secs_f64();
            self.mark = (now, self.stored);
        }
    }

    /// Of the stream's first `sent` bytes, those not acknowledged yet.
    pub fn in_flight(&self, sent: u64) -> u64 {
        sent.saturating_sub(self.stored)
    }

    /// Bytes stored per second, as last measured.
    #[cfg(test)]
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// The shortest round seen.
    pub fn min_rtt(&self) -> Option<Duration> {
        self.min_rtt
    }

    /// What may be in flight: [`QUEUED`] at the rate (or the path and
    /// [`FAULTING_QUEUED`], if longer), or the path and
    /// [`FAULTING_QUEUED`] while faults ask.
    pub fn limit(&self, faulting: bool) -> u64 {
        let short = self.min_rtt.unwrap_or_default() + FAULTING_QUEUED;
        if faulting {
            ((self.rate * short.as_secs_f64()) as u64).clamp(FAULTING_MIN, MAX_WINDOW)
        } else {
            ((self.rate * short.max(QUEUED).as_secs_f64()) as u64).clamp(MIN_WINDOW, MAX_WINDOW)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Sends what the window allows in batches of `batch`, over a path
    /// that takes `delay` and stores at most `capacity` bytes a second;
    /// returns the window after `for_`.
    fn run(batch: u64, delay: Duration, capacity: f64, faulting: bool, for_: Duration) -> Window {
        let t0 = Instant::now();
        let mut w = Window::new(t0);
        let (mut sent, mut now) = (0u64, t0);
        // When each batch is stored: the path's delay, and no sooner than
        // the path can store it after the one before.
        let mut done: VecDeque<(u64, Instant)> = VecDeque::new();
        let mut free_at = t0;
        let step = Duration::from_micros(50);
        while now < t0 + for_ {
            while done.front().is_some_and(|&(_, at)| at <= now) {
                let (end, _) = done.pop_front().unwrap();
                w.stored(end, now);
            }
            while w.in_flight(sent) < w.limit(faulting) {
                sent += batch;
                w.sent(sent, now);
                let service = Duration::from_secs_f64(batch as f64 / capacity);
                free_at = free_at.max(now + delay) + service;
                done.push_back((sent, free_at));
            }
            now += step;
        }
        w
    }

    #[test]
    fn the_window_grows_to_what_the_path_carries_with_a_short_queue() {
        // 1 GB/s behind a 3 ms path, longer than the queue allowed: 256
        // KiB in flight would carry ~80 MB/s (and a window of the rate
        // times 2 ms alone would stay there); the window must grow to
        // carry the gigabyte.
        let w = run(256 << 10, 3 * MS, 1e9, false, Duration::from_secs(1));
        assert!(w.rate() > 0.9e9, "rate {}", w.rate());
        let rtt = w.min_rtt().unwrap();
        assert!(rtt >= 3 * MS && rtt < 4 * MS, "min rtt {rtt:?}");
        // About the path's delay and half a millisecond, at 1 GB/s.
        let limit = w.limit(false);
        assert!((3_300_000..4_500_000).contains(&limit), "limit {limit}");
    }

    #[test]
    fn a_slow_link_keeps_the_window_small() {
        // 125 MB/s (1 Gb/s), the path's delay a batch's own time on it.
        let w = run(
            128 << 10,
            Duration::from_micros(200),
            125e6,
            false,
            Duration::from_secs(1),
        );
        assert!(w.rate() > 110e6 && w.rate() < 126e6, "rate {}", w.rate());
        // A fault's ask waits behind ~3-4 ms of traffic at most.
        assert!(w.limit(false) < 600 << 10, "limit {}", w.limit(false));
    }

    #[test]
    fn while_faults_ask_the_queue_is_short_and_the_fill_goes_on() {
        let w = run(64 << 10, MS, 1e9, true, Duration::from_secs(1));
        assert!(w.rate() > 0.9e9, "rate {}", w.rate());
        let path = w.min_rtt().unwrap().as_secs_f64();
        let limit = w.limit(true);
        let most = w.rate() * (path + FAULTING_QUEUED.as_secs_f64());
        assert!(limit as f64 <= most + 1.0, "limit {limit}");
        assert!(limit >= FAULTING_MIN);
        assert!(limit < w.limit(false));
    }

    #[test]
    fn before_any_measure_the_window_is_its_floor() {
        let w = Window::new(Instant::now());
        assert_eq!(w.limit(false), MIN_WINDOW);
        assert_eq!(w.limit(true), FAULTING_MIN);
    }
}
