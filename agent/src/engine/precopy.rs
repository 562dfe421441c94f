//! Pre-copy: the process's private memory crosses while it still runs, in
//! rounds, so that the freeze carries only the pages the destination lacks
//! (Noack (2003) §2.3.5 and §2.3.6).
//!
//! ```text
//! start tracking ─> round 1 ─> round 2 ─> … ─> (convergence says freeze) ─> Arm, Dump …
//!                   scan+send   scan+send          │
//!                                                  └─ after the dump, process stopped:
//!                                                     last scan, tracking stops, and the
//!                                                     image stream names the pages the
//!                                                     destination holds (StoredPages)
//! ```
//!
//! Each round scans for pages written since the last scan and protects
//! them again in the same step ([`crate::memtrack`]), then reads and sends
//! (`Peer.TransferPages`):
//!
//! - **pre-copy** sends what the scan found (the first scan finds
//!   everything: nothing was protected before);
//! - **queued pre-copy** holds written pages back ("delayed") and sends a
//!   delayed page only once a whole round passed without a write to it, so
//!   that hot pages cross once, at the freeze. Its first round only
//!   observes (everything is delayed, nothing sent) for
//!   [`QUEUED_OBSERVATION`].
//!
//! After each scan from the second round on, the [`Convergence`] predicate
//! decides between another round and the freeze, from what would be left
//! for the freeze and the rate measured so far. The destination then holds,
//! for each page it received, the content of the moment of its read; a
//! page written after its read is found by a later scan (or the last one,
//! taken with the process stopped) and is never counted as held.
//!
//! With ferry's held-pages patch to CRIU, the dump in the freeze leaves out
//! every page the destination holds and the process did not write since
//! (ferryd lists the held ranges, the write-protect bits tell written
//! pages; the patch reads the page tables' bits alone there, never each
//! page's struct page) and the destination installs those pages from its
//! store after the resume (`crate::fill`): no last scan in the freeze. A
//! CRIU without the patch dumps all of the memory, and the last scan after
//! the dump names the pages the destination holds.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ferry_proto::v1::{self as pb, PageBatch, PageRun};
use tokio::sync::mpsc;

use crate::memtrack::{self, RangeSet, Tracker};

use super::EngineError;
use super::compression::Compressor;
use super::throttle::Throttle;

/// How a queued pre-copy's first round watches the process before it
/// sends anything: pages written within it count as hot.
pub const QUEUED_OBSERVATION: Duration = Duration::from_millis(50);

/// Most bytes of page data in one `PageBatch` message.
const BATCH_BYTES: usize = 1 << 20;

pub use crate::config::MemoryStrategy;

/// When the rounds stop (cloud-hypervisor's idea of a pluggable predicate;
/// the limit on rounds and their reruns in Noack (2003)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Convergence {
    /// Freeze once what is left would cross in this long at the rate
    /// measured so far (no faster than the freeze handles pages,
    /// [`FREEZE_PAGE_COST`]).
    pub downtime_budget: Duration,
    /// Freeze after this many rounds whatever is left.
    pub max_rounds: u32,
    /// Slow the process down ([`Throttle`]) when its dirty set stops
    /// shrinking, and further each round the budget is still not met,
    /// instead of freezing with what is left.
    pub throttle: bool,
}

/// What the predicate says after a round's scan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Continue,
    /// Within the budget already, but the rounds still halve what is left:
    /// one more (a throttle on is not tightened for it).
    Shorten,
    Freeze(&'static str),
}

/// Within the budget, the freeze is short enough once what is left
/// crosses in this share of the budget (30 ms: 3 ms).
const SHORT_ENOUGH_SHARE: f64 = 0.1;

/// What a page left for the freeze costs there at least, whatever the
/// link: CRIU splices it out of the stopped process, it crosses as part
/// of the images, and the restore reads it into memory the destination's
/// kernel has just allocated. On this machine (release build, a 64 MiB
/// process writing 1,000 pages/s, unshaped link, 5 runs) the freeze grew
/// by ~20 µs a page (82 pages: 16.2 ms; 256-342 pages: 18.0-22.5 ms),
/// ten times what the link alone takes (~2 µs at 2 GB/s). Predicting the
/// freeze from the link's rate alone stopped the rounds with ~250 pages
/// left that one more round would have cut to a few dozen.
const FREEZE_PAGE_COST: Duration = Duration::from_micros(20);

/// The freeze reason that the throttle overrides.
const NOT_SHRINKING: &str = "dirty set not shrinking";

impl Convergence {
    /// `round`: the round whose scan just found `pending` bytes for the
    /// freeze (counting from 1); `rate`: bytes per second sent so far, if
    /// anything was; `earlier`: `pending` of the earlier rounds from the
    /// second on.
    pub fn decide(&self, round: u32, pending: u64, rate: Option<f64>, earlier: &[u64]) -> Verdict {
        if pending == 0 {
            return Verdict::Freeze("downtime budget met");
        }
        let budget = self.downtime_budget.as_secs_f64();
        // The freeze moves pages no faster than FREEZE_PAGE_COST allows.
        let freeze_rate = memtrack::page_size() as f64 / FREEZE_PAGE_COST.as_secs_f64();
        let rate = rate.map(|r| r.min(freeze_rate));
        if let Some(rate) = rate.filter(|r| *r > 0.0)
            && round > 1
            && pending as f64 / rate <= budget
        {
            // The budget is a ceiling, not a target: another round takes
            // about as long as what is left takes to cross and leaves only
            // what the process writes meanwhile, so it pays while the
            // rounds still halve what is left (round 2 is compared with
            // round 1's everything) and what is left is not already a
            // small share of the budget.
            let halving = earlier.last().is_none_or(|before| pending * 2 <= *before);
            if halving
                && pending as f64 / rate > SHORT_ENOUGH_SHARE * budget
                && round < self.max_rounds
            {
                return Verdict::Shorten;
            }
            return Verdict::Freeze("downtime budget met");
        }
        if round >= self.max_rounds {
            return Verdict::Freeze("round limit");
        }
        // Two rounds in a row without shrinking by 5 %: the process
        // writes as fast as the link carries its pages.
        if let [.., a, b] = earlier
            && round > 1
            && pending as f64 >= 0.95 * *b as f64
            && *b as f64 >= 0.95 * *a as f64
        {
            return Verdict::Freeze(NOT_SHRINKING);
        }
        Verdict::Continue
    }
}

/// One tracked process of the migrating tree.
struct Tracked {
    /// Host PID, for ptrace and /proc.
    pid: i32,
    /// PID in its namespace, as the images and the destination know it.
    vpid: u32,
    tracker: Tracker,
    /// Pages the destination holds with their current content.
    held: RangeSet,
    /// Queued pre-copy: pages known written and not sent since.
    delayed: RangeSet,
}

/// A pre-copy in progress: tracking on, pages sent so far.
pub struct Precopy {
    strategy: MemoryStrategy,
    tracked: Vec<Tracked>,
    pub rounds: Vec<pb::PrecopyRound>,
    pub convergence: String,
    pub bytes_sent: u64,
    /// The smallest share of its time the process ran during the rounds,
    /// in percent (100: never throttled).
    pub throttled_to: u32,
    /// A throttle still on after rounds that converged with it: it stays
    /// on until CRIU is about to freeze the process (the caller drops it
    /// then), so that the process does not rewrite at full speed what the
    /// rounds just sent while the dump starts.
    pub throttle: Option<Throttle>,
    /// How the rounds' pages go (set by the caller before the rounds); the
    /// freeze's pages images go on from where it left.
    pub compressor: Compressor,
    /// Of `bytes_sent`, those that crossed compressed, and their size.
    pub lz4_raw_bytes: u64,
    pub lz4_bytes: u64,
}

impl std::fmt::Debug for Precopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Precopy")
            .field("strategy", &self.strategy)
            .field("rounds", &self.rounds.len())
            .finish()
    }
}

/// What the rounds need from the migration.
pub struct Link<'a> {
    pub peer: &'a dyn super::link::PeerLink,
    pub migration_id: &'a str,
    pub destination: &'a crate::config::PeerConfig,
    /// The bound on one step's answer (`peer_timeout_secs`).
    pub deadline: Duration,
    /// Checked before each round and raced against each round's transfer
    /// (not against a scan: the trackers are away on a blocking thread
    /// then, and must come back to be ended).
    pub cancel: &'a super::cancel::Cancel,
}

impl Precopy {
    /// Starts tracking every process of the tree rooted at `pid`.
    pub async fn start(pid: i32, strategy: MemoryStrategy) -> Result<Self, EngineError> {
        let tracked = tokio::task::spawn_blocking(move || {
            let mut tracked = Vec::new();
            for p in crate::process::process_tree(pid) {
                let vpid = memtrack::ns_pid(p)
                    .map_err(EngineError::io(format!("reading the namespace PID of {p}")))?;
                let tracker = Tracker::start(p).map_err(|e| EngineError::NotMigratable {
                    pid,
                    reason: format!("its memory cannot be tracked for {}: {e}", strategy.name()),
                })?;
                tracked.push(Tracked {
                    pid: p,
                    vpid,
                    tracker,
                    held: RangeSet::new(),
                    delayed: RangeSet::new(),
                });
            }
            Ok::<_, EngineError>(tracked)
        })
        .await
        .map_err(|source| EngineError::Task {
            what: "starting dirty-page tracking",
            source,
        })??;
        Ok(Precopy {
            strategy,
            tracked,
            rounds: Vec::new(),
            convergence: String::new(),
            bytes_sent: 0,
            throttled_to: 100,
            throttle: None,
            compressor: Compressor::new(crate::config::Compression::Off, false),
            lz4_raw_bytes: 0,
            lz4_bytes: 0,
        })
    }

    /// Runs rounds until `convergence` says freeze. `on_round` hears of each
    /// round as it ends. A throttle that helped them converge stays on
    /// ([`Precopy::throttle`]); on an error the process runs freely again.
    pub async fn rounds(
        &mut self,
        link: Link<'_>,
        convergence: Convergence,
        on_round: impl FnMut(&pb::PrecopyRound),
    ) -> Result<(), EngineError> {
        let mut throttle = Throttle::new(self.tracked.iter().map(|t| t.pid).collect());
        let result = self
            .run_rounds(link, convergence, &mut throttle, on_round)
            .await;
        if result.is_ok() && throttle.percent() < 100 {
            self.throttle = Some(throttle);
        } else {
            throttle.release().await;
        }
        result
    }

    async fn run_rounds(
        &mut self,
        link: Link<'_>,
        convergence: Convergence,
        throttle: &mut Throttle,
        mut on_round: impl FnMut(&pb::PrecopyRound),
    ) -> Result<(), EngineError> {
        let page = memtrack::page_size();
        let mut earlier: Vec<u64> = Vec::new();
        let (mut sent_total, mut send_time) = (0u64, Duration::ZERO);
        for round in 1.. {
            link.cancel.check()?;
            let started = Instant::now();
            let scans = self.scan_all(true).await?;
            let mut written_pages = 0;
            let mut to_send: Vec<(i32, u32, RangeSet)> = Vec::new();
            let mut pending = 0u64;
            for (t, scan) in self.tracked.iter_mut().zip(scans) {
                written_pages += scan.written.len() / page;
                tracing::debug!(
                    round,
                    vpid = t.vpid,
                    written = scan.written.len() / page,
                    stale = scan.stale.len() / page,
                    tracked = scan.tracked.len() / page,
                    held_before = t.held.len() / page,
                    "pre-copy scan"
                );
                t.held.remove_all(&scan.stale);
                let send = match self.strategy {
                    MemoryStrategy::QueuedPreCopy => {
                        // Delayed pages not written since the last scan
                        // go now; written ones (wait again) join the rest.
                        let mut quiet = t.delayed.clone();
                        quiet.remove_all(&scan.stale);
                        t.delayed = scan.written.clone();
                        if round == 1 {
                            // Only watching: nothing is known quiet yet.
                            quiet = RangeSet::new();
                        }
                        // Left for a freeze now: all of it.
                        pending += t.delayed.len() + quiet.len();
                        quiet
                    }
                    _ => {
                        pending += scan.written.len();
                        scan.written
                    }
                };
                to_send.push((t.pid, t.vpid, send));
            }
            let rate = (send_time > Duration::ZERO && sent_total > 0)
                .then(|| sent_total as f64 / send_time.as_secs_f64());
            let mut verdict = if round == 1 {
                Verdict::Continue
            } else {
                convergence.decide(round, pending, rate, &earlier)
            };
            // The process writes faster than its pages cross: slow it
            // down, and further each round until the budget is met.
            let throttling = throttle.percent() < 100;
            let wants_throttle = match verdict {
                Verdict::Freeze(NOT_SHRINKING) => true,
                Verdict::Continue => throttling,
                Verdict::Shorten | Verdict::Freeze(_) => false,
            };
            if convergence.throttle
                && wants_throttle
                && let Some(percent) = throttle.tighten()
            {
                tracing::info!(
                    round,
                    percent,
                    pending_bytes = pending,
                    "the process writes faster than its pages cross: throttled"
                );
                self.throttled_to = self.throttled_to.min(percent);
                verdict = Verdict::Continue;
            }
            if round > 1 {
                earlier.push(pending);
            }
            let mut record = pb::PrecopyRound {
                round,
                written_pages,
                ..Default::default()
            };
            if let Verdict::Freeze(why) = verdict {
                // What the scan found goes in the freeze: it was protected
                // again, so any later write is found by the last scan.
                for (t, (_, _, send)) in self.tracked.iter_mut().zip(&to_send) {
                    t.delayed.insert_all(send);
                }
                record.delayed_pages = self.delayed_pages();
                record.duration_us = started.elapsed().as_micros() as u64;
                on_round(&record);
                self.rounds.push(record);
                self.convergence = if self.throttled_to < 100 {
                    format!("{why} (throttled to {} %)", self.throttled_to)
                } else {
                    why.to_owned()
                };
                tracing::info!(
                    round,
                    reason = why,
                    pending_bytes = pending,
                    "pre-copy converged"
                );
                return Ok(());
            }
            let send_started = Instant::now();
            let (sent, bytes, packed) = tokio::select! {
                r = send_round(&link, round, to_send, &mut self.compressor) => r?,
                e = link.cancel.requested() => return Err(e),
            };
            self.lz4_raw_bytes += packed.raw;
            self.lz4_bytes += packed.lz4;
            if bytes > 0 {
                sent_total += bytes;
                send_time += send_started.elapsed();
            }
            for (t, (vpid, ranges)) in self.tracked.iter_mut().zip(sent) {
                debug_assert_eq!(t.vpid, vpid);
                t.held.insert_all(&ranges);
                record.sent_pages += ranges.len() / page;
            }
            record.sent_bytes = bytes;
            self.bytes_sent += bytes;
            if self.strategy == MemoryStrategy::QueuedPreCopy && bytes == 0 {
                // Nothing quiet to send: let the process run a while so
                // that the next scan tells hot pages from cold ones.
                tokio::select! {
                    _ = tokio::time::sleep(QUEUED_OBSERVATION) => {}
                    e = link.cancel.requested() => return Err(e),
                }
            }
            record.delayed_pages = self.delayed_pages();
            record.duration_us = started.elapsed().as_micros() as u64;
            tracing::info!(
                round,
                written_pages = record.written_pages,
                sent_pages = record.sent_pages,
                delayed_pages = record.delayed_pages,
                ms = record.duration_us as f64 / 1000.0,
                "pre-copy round"
            );
            on_round(&record);
            self.rounds.push(record);
        }
        unreachable!("the round loop only ends by returning")
    }

    fn delayed_pages(&self) -> u64 {
        let page = memtrack::page_size();
        self.tracked.iter().map(|t| t.delayed.len() / page).sum()
    }

    /// Scans every tracked process (blocking work, off the runtime).
    async fn scan_all(&mut self, rearm: bool) -> Result<Vec<memtrack::Scan>, EngineError> {
        let mut tracked = std::mem::take(&mut self.tracked);
        let (tracked, scans) = tokio::task::spawn_blocking(move || {
            let scans: Result<Vec<_>, _> =
                tracked.iter_mut().map(|t| t.tracker.scan(rearm)).collect();
            (tracked, scans)
        })
        .await
        .map_err(|source| EngineError::Task {
            what: "a dirty-page scan",
            source,
        })?;
        self.tracked = tracked;
        scans.map_err(|source| EngineError::Tracking {
            what: "dirty-page scan",
            source,
        })
    }

    /// Per PID in its namespace, the pages the destination holds with the
    /// content they had at the last round's scan, which write-protected
    /// them again: a write since shows in the next scan (CRIU's, with
    /// ferry's held-pages patch, or [`Precopy::finish`]).
    pub fn held(&self) -> Vec<(u32, RangeSet)> {
        self.tracked
            .iter()
            .map(|t| (t.vpid, t.held.clone()))
            .collect()
    }

    /// With the process stopped (after the dump): the last scan, then
    /// tracking ends. Returns, per PID in its namespace, the pages the
    /// destination holds with the content they have now. Blocking.
    pub fn finish(mut self) -> Result<HashMap<u32, RangeSet>, EngineError> {
        let mut held = HashMap::new();
        for t in &mut self.tracked {
            let scan = t
                .tracker
                .scan(false)
                .map_err(|source| EngineError::Tracking {
                    what: "last dirty-page scan",
                    source,
                })?;
            // Held and not written since, only in mappings still tracked
            // (anything else may have changed unseen), and only pages
            // still the process's own (not zapped and faulted in again
            // from the file or as zeros).
            let mut h = t.held.clone();
            h.remove_all(&scan.stale);
            let h = h.intersection(&scan.tracked);
            let own = t
                .tracker
                .own_pages(&h)
                .map_err(|source| EngineError::Tracking {
                    what: "last dirty-page scan",
                    source,
                })?;
            t.tracker.stop();
            let h = h.intersection(&own);
            let page = memtrack::page_size();
            tracing::debug!(
                vpid = t.vpid,
                held_at_last_round = t.held.len() / page,
                written_since = scan.stale.len() / page,
                tracked = scan.tracked.len() / page,
                own = own.len() / page,
                held = h.len() / page,
                "last dirty-page scan"
            );
            held.insert(t.vpid, h);
        }
        Ok(held)
    }

    /// Ends tracking without a last scan (an abort). Blocking.
    pub fn stop(mut self) {
        for t in &mut self.tracked {
            t.tracker.stop();
        }
    }

    /// Ends tracking of processes that are being killed (see
    /// [`Tracker::abandon`]).
    pub fn abandon(mut self) {
        for t in &mut self.tracked {
            t.tracker.abandon();
        }
    }
}

/// What a round sent: per process the ranges read and sent, the bytes
/// (before compression), and what went compressed.
type RoundSent = (Vec<(u32, RangeSet)>, u64, Packed);

/// What a round sent compressed: the pages' bytes and their size on the
/// wire.
#[derive(Debug, Clone, Copy, Default)]
struct Packed {
    raw: u64,
    lz4: u64,
}

/// Reads `to_send` from the running processes and streams it to the
/// destination, compressed as `compressor` says; returns, per process, the
/// ranges that were read and sent (a range unmapped meanwhile is skipped),
/// the bytes sent (before compression) and what went compressed.
async fn send_round(
    link: &Link<'_>,
    round: u32,
    to_send: Vec<(i32, u32, RangeSet)>,
    compressor: &mut Compressor,
) -> Result<RoundSent, EngineError> {
    let total: u64 = to_send.iter().map(|(_, _, r)| r.len()).sum();
    if total == 0 {
        return Ok((
            to_send
                .into_iter()
                .map(|(_, v, _)| (v, RangeSet::new()))
                .collect(),
            0,
            Packed::default(),
        ));
    }
    let (tx, rx) = mpsc::channel(4);
    let id = link.migration_id.to_owned();
    let mut reading = compressor.clone();
    let reader = tokio::task::spawn_blocking(move || {
        let read = read_pages(&id, round, to_send, &mut reading, tx);
        (read, reading)
    });
    // A round may be long on a slow link: bounded by the step deadline
    // plus the time its bytes take at 1 Mb/s.
    let limit = link.deadline + Duration::from_secs(total / 125_000);
    let answer = tokio::time::timeout(
        limit,
        link.peer
            .transfer_pages(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
    .await;
    let (read, reading) = reader.await.map_err(|source| EngineError::Task {
        what: "reading a pre-copy round's pages",
        source,
    })?;
    *compressor = reading;
    match answer {
        Ok(Ok(_)) => {}
        Ok(Err(s)) => return Err(super::link::peer_error(&link.destination.name, s)),
        Err(_) => {
            return Err(super::link::silent(
                link.destination,
                "a pre-copy round",
                limit,
            ));
        }
    }
    read
}

/// The blocking half of [`send_round`].
fn read_pages(
    migration_id: &str,
    round: u32,
    to_send: Vec<(i32, u32, RangeSet)>,
    compressor: &mut Compressor,
    tx: mpsc::Sender<PageBatch>,
) -> Result<RoundSent, EngineError> {
    let page = memtrack::page_size();
    let mut packed = Packed::default();
    let mut done = Vec::new();
    let mut batch = PageBatch {
        migration_id: migration_id.to_owned(),
        round,
        runs: Vec::new(),
    };
    let mut batch_bytes = 0usize;
    let mut bytes = 0u64;
    let closed = || EngineError::StreamClosed("page");
    for (pid, vpid, ranges) in to_send {
        let mut read = RangeSet::new();
        for (start, end) in ranges.iter() {
            let mut at = start;
            while at < end {
                let len = ((end - at) as usize).min(BATCH_BYTES);
                let mut data = match memtrack::read_remote_vec(pid, at, len) {
                    Ok(data) => data,
                    // Unmapped since the scan: the next scan (or the last)
                    // accounts for it.
                    Err(e) if e.raw_os_error() == Some(libc::EFAULT) => Vec::new(),
                    Err(e) => {
                        return Err(EngineError::Io {
                            what: format!("reading the memory of {pid}"),
                            source: e,
                        });
                    }
                };
                let n = (data.len() as u64 / page * page) as usize;
                if n == 0 {
                    // Skip the page that failed; try the rest.
                    at += page;
                    continue;
                }
                data.truncate(n);
                read.insert(at, at + n as u64);
                bytes += n as u64;
                batch_bytes += n;
                match compressor.pack(&data) {
                    Some(lz4) => {
                        packed.raw += n as u64;
                        packed.lz4 += lz4.len() as u64;
                        batch.runs.push(PageRun {
                            pid: vpid,
                            vaddr: at,
                            lz4,
                            lz4_length: n as u64,
                            ..Default::default()
                        });
                    }
                    None => batch.runs.push(PageRun {
                        pid: vpid,
                        vaddr: at,
                        data: data.into(),
                        ..Default::default()
                    }),
                }
                at += n as u64;
                if batch_bytes >= BATCH_BYTES {
                    let full = std::mem::replace(
                        &mut batch,
                        PageBatch {
                            migration_id: migration_id.to_owned(),
                            round,
                            runs: Vec::new(),
                        },
                    );
                    batch_bytes = 0;
                    tx.blocking_send(full).map_err(|_| closed())?;
                }
            }
        }
        done.push((vpid, read));
    }
    if !batch.runs.is_empty() {
        tx.blocking_send(batch).map_err(|_| closed())?;
    }
    Ok((done, bytes, packed))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c() -> Convergence {
        Convergence {
            downtime_budget: Duration::from_millis(30),
            max_rounds: 10,
            throttle: false,
        }
    }

    #[test]
    fn freezes_when_what_is_left_fits_the_budget() {
        // 100 MB/s: 3 MB in 30 ms.
        let rate = Some(100e6);
        assert_eq!(
            c().decide(2, 200_000, rate, &[]),
            Verdict::Freeze("downtime budget met")
        );
        assert_eq!(c().decide(2, 4_000_000, rate, &[]), Verdict::Continue);
        assert_eq!(
            c().decide(2, 0, None, &[]),
            Verdict::Freeze("downtime budget met")
        );
        // Without a measured rate only an empty set fits.
        assert_eq!(c().decide(2, 1, None, &[]), Verdict::Continue);
    }

    #[test]
    fn within_the_budget_goes_on_while_the_rounds_halve_what_is_left() {
        // 100 MB/s: 2 MB cross in 20 ms, within 30 but above 3.
        let rate = Some(100e6);
        // Round 2 against round 1's everything: halving.
        assert_eq!(c().decide(2, 2_000_000, rate, &[]), Verdict::Shorten);
        assert_eq!(
            c().decide(3, 2_000_000, rate, &[5_000_000]),
            Verdict::Shorten
        );
        // Less than halved: another round would not pay.
        assert_eq!(
            c().decide(3, 2_000_000, rate, &[3_000_000]),
            Verdict::Freeze("downtime budget met")
        );
        // Already within a tenth of the budget.
        assert_eq!(
            c().decide(3, 250_000, rate, &[5_000_000]),
            Verdict::Freeze("downtime budget met")
        );
        // Never past the round limit.
        assert_eq!(
            c().decide(10, 2_000_000, rate, &[5_000_000]),
            Verdict::Freeze("downtime budget met")
        );
    }

    #[test]
    fn a_fast_link_does_not_make_the_freeze_cheaper_than_its_pages() {
        // 2 GB/s unshaped: 235 pages cross in 0.5 ms, within 3 ms, but
        // inside the freeze each costs FREEZE_PAGE_COST (4.7 ms in all):
        // one more round.
        let left = 235 * memtrack::page_size();
        assert_eq!(c().decide(2, left, Some(2e9), &[]), Verdict::Shorten);
        // A few dozen cost less than a tenth of the budget.
        assert_eq!(
            c().decide(3, 30 * memtrack::page_size(), Some(2e9), &[left]),
            Verdict::Freeze("downtime budget met")
        );
    }

    #[test]
    fn freezes_at_the_round_limit() {
        assert_eq!(
            c().decide(10, 1 << 30, Some(1e6), &[]),
            Verdict::Freeze("round limit")
        );
        assert_eq!(c().decide(9, 1 << 30, Some(1e6), &[]), Verdict::Continue);
    }

    #[test]
    fn freezes_when_the_dirty_set_stops_shrinking() {
        let rate = Some(1e6);
        // Shrinking: go on.
        assert_eq!(
            c().decide(4, 500_000, rate, &[2_000_000, 1_000_000]),
            Verdict::Continue
        );
        // Flat for two rounds: freeze.
        assert_eq!(
            c().decide(4, 1_000_000, rate, &[1_010_000, 1_000_000]),
            Verdict::Freeze("dirty set not shrinking")
        );
        // Flat only once: one more round.
        assert_eq!(
            c().decide(4, 1_000_000, rate, &[3_000_000, 1_000_000]),
            Verdict::Continue
        );
    }

    #[test]
    fn strategies_map_to_the_api() {
        for s in [
            MemoryStrategy::TotalCopy,
            MemoryStrategy::PreCopy,
            MemoryStrategy::QueuedPreCopy,
            MemoryStrategy::PostCopy,
            MemoryStrategy::AssistedPostCopy,
        ] {
            assert_eq!(
                s.is_precopy() && s.is_postcopy(),
                s == MemoryStrategy::AssistedPostCopy
            );
            assert_eq!(MemoryStrategy::from_pb(s.to_pb()), Some(s));
        }
        assert_eq!(MemoryStrategy::from_pb(pb::Strategy::Unspecified), None);
    }
}
