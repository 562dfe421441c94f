//! Gerofi et al. (DVE)'s virtual environment, live: the protocol between
//! the zone servers (`ferry-zone-server`) and the players
//! (`ferry-dve-players`), and how a player judges its updates.
//!
//! A zone is a UDP port of the cluster's public address (`BASE_PORT` +
//! zone). A player joins its zone's server with a datagram and repeats it
//! every second (a keepalive); moving to another zone, it leaves the old
//! one and joins the new. The server sends every player of the zone an
//! update each tick (20 Hz). A player measures the gap between two updates
//! of the zone it is in: a frozen zone server shows as a gap.

use std::time::{Duration, Instant};

use serde::Serialize;

/// The zone servers' tick: 20 Hz, as the paper's game servers.
pub const TICK: Duration = Duration::from_millis(50);
/// An update's size on the wire (a small state delta).
pub const UPDATE_BYTES: usize = 64;
/// Zone `z` is served on `BASE_PORT + z`.
pub const BASE_PORT: u16 = 30_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    /// A player is in the zone (also its keepalive).
    Join {
        player: u32,
    },
    Leave {
        player: u32,
    },
    /// The zone's state, for one player, tick `seq`.
    Update {
        player: u32,
        zone: u16,
        seq: u64,
    },
}

impl Message {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16);
        match *self {
            Message::Join { player } => {
                out.push(1);
                out.extend_from_slice(&player.to_le_bytes());
            }
            Message::Leave { player } => {
                out.push(2);
                out.extend_from_slice(&player.to_le_bytes());
            }
            Message::Update { player, zone, seq } => {
                out.push(3);
                out.extend_from_slice(&player.to_le_bytes());
                out.extend_from_slice(&zone.to_le_bytes());
                out.extend_from_slice(&seq.to_le_bytes());
            }
        }
        out
    }

    /// Encoded, then padded with zeros to `len` bytes.
    pub fn encode_padded(&self, len: usize) -> Vec<u8> {
        let mut out = self.encode();
        if out.len() < len {
            out.resize(len, 0);
        }
        out
    }

    pub fn decode(data: &[u8]) -> Option<Message> {
        let u32_at = |i: usize| Some(u32::from_le_bytes(data.get(i..i + 4)?.try_into().ok()?));
        match *data.first()? {
            1 => Some(Message::Join { player: u32_at(1)? }),
            2 => Some(Message::Leave { player: u32_at(1)? }),
            3 => Some(Message::Update {
                player: u32_at(1)?,
                zone: u16::from_le_bytes(data.get(5..7)?.try_into().ok()?),
                seq: u64::from_le_bytes(data.get(7..15)?.try_into().ok()?),
            }),
            _ => None,
        }
    }
}

/// A gap between two updates longer than the threshold.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Gap {
    /// When the update that ended it came (ms since the Unix epoch).
    pub at_unix_ms: u64,
    pub player: u32,
    pub zone: usize,
    pub gap_ms: f64,
    /// The server's ticks on either side: consecutive ticks mean the
    /// server sent nothing in between (frozen, or late), a jump that
    /// updates were lost.
    pub seq_before: u64,
    pub seq_after: u64,
}

/// What one player saw of its zone's updates.
#[derive(Debug, Clone)]
pub struct PlayerView {
    pub player: u32,
    pub zone: usize,
    last: Option<(Instant, u64)>,
    pub updates: u64,
    pub longest_gap: Duration,
    /// Updates whose tick was not after the one before (a server that went
    /// back in time: state lost).
    pub seq_regressions: u64,
}

impl PlayerView {
    pub fn new(player: u32, zone: usize) -> Self {
        PlayerView {
            player,
            zone,
            last: None,
            updates: 0,
            longest_gap: Duration::ZERO,
            seq_regressions: 0,
        }
    }

    /// The player walked into `zone`: the next update starts a new count
    /// (the time to the first update of a new zone is not a gap).
    pub fn switch(&mut self, zone: usize) {
        self.zone = zone;
        self.last = None;
    }

    /// An update arrived at `now`; returns the gap it ends if longer than
    /// `threshold`. Updates of a zone the player left are ignored.
    pub fn update(
        &mut self,
        zone: usize,
        seq: u64,
        now: Instant,
        now_unix_ms: u64,
        threshold: Duration,
    ) -> Option<Gap> {
        if zone != self.zone {
            return None;
        }
        self.updates += 1;
        let last = self.last.replace((now, seq));
        let (at, before) = last?;
        if seq <= before {
            self.seq_regressions += 1;
            return None;
        }
        let gap = now.saturating_duration_since(at);
        self.longest_gap = self.longest_gap.max(gap);
        (gap > threshold).then_some(Gap {
            at_unix_ms: now_unix_ms,
            player: self.player,
            zone,
            gap_ms: gap.as_secs_f64() * 1000.0,
            seq_before: before,
            seq_after: seq,
        })
    }
}

/// What `ferry-dve-players` writes at the end (JSON).
#[derive(Debug, Clone, Serialize)]
pub struct PlayersReport {
    pub players: usize,
    pub duration_secs: f64,
    pub updates: u64,
    /// Gaps over the threshold, in order of arrival.
    pub gaps: Vec<Gap>,
    pub gap_threshold_ms: f64,
    pub longest_gap_ms: f64,
    pub seq_regressions: u64,
    /// Zone switches the players made.
    pub switches: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        for m in [
            Message::Join { player: 7 },
            Message::Leave { player: u32::MAX },
            Message::Update {
                player: 3,
                zone: 99,
                seq: 1 << 40,
            },
        ] {
            assert_eq!(Message::decode(&m.encode_padded(UPDATE_BYTES)), Some(m));
        }
        assert_eq!(Message::decode(&[3, 1, 2]), None);
        assert_eq!(Message::decode(&[]), None);
        assert_eq!(Message::decode(&[9, 0, 0, 0, 0]), None);
    }

    #[test]
    fn a_player_counts_gaps_within_a_zone_only() {
        let t0 = Instant::now();
        let ms = |m| t0 + Duration::from_millis(m);
        let limit = Duration::from_millis(100);
        let mut p = PlayerView::new(1, 5);
        assert_eq!(p.update(5, 1, ms(0), 0, limit), None);
        assert_eq!(p.update(5, 2, ms(50), 50, limit), None);
        // Frozen for 180 ms: one gap, consecutive ticks.
        let gap = p.update(5, 3, ms(230), 230, limit).expect("a gap");
        assert_eq!((gap.seq_before, gap.seq_after, gap.zone), (2, 3, 5));
        assert!((gap.gap_ms - 180.0).abs() < 1e-6);
        // The old zone's late update is ignored after a switch, and the
        // wait for the new zone's first one is no gap.
        p.switch(6);
        assert_eq!(p.update(5, 4, ms(240), 240, limit), None);
        assert_eq!(p.update(6, 10, ms(900), 900, limit), None);
        assert_eq!(p.update(6, 11, ms(950), 950, limit), None);
        // A tick from the past: state went back.
        assert_eq!(p.update(6, 11, ms(1000), 1000, limit), None);
        assert_eq!(p.seq_regressions, 1);
        assert_eq!(p.longest_gap, Duration::from_millis(180));
        assert_eq!(p.updates, 6);
    }
}
