//! One migration's row: what the report and the clients said, its CSV columns.

#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) tcp: usize,
    pub(crate) udp: usize,
    pub(crate) mode: &'static str,
    pub(crate) run: usize,
    pub(crate) freeze_ms: f64,
    pub(crate) dump_ms: f64,
    pub(crate) transfer_ms: f64,
    pub(crate) restore_ms: f64,
    pub(crate) replay_ms: f64,
    pub(crate) frozen_bytes: u64,
    pub(crate) image_files: u32,
    pub(crate) gap_median_ms: f64,
    pub(crate) gap_max_ms: f64,
    pub(crate) rtos: u64,
    pub(crate) udp_lost: u64,
    /// Drain before freeze: its wait, the bytes queued when it began and
    /// those it left.
    pub(crate) drain_ms: f64,
    pub(crate) drain_start: u64,
    pub(crate) drain_left: u64,
    /// Bytes of the connections' send queues the freeze carried.
    pub(crate) send_queues: u64,
    /// Packets the machine's input backlog dropped meanwhile (the test
    /// rig's veth pairs, not ferry: `softnet::backlog_drops`).
    pub(crate) backlog_drops: u64,
    /// Over the TCP clients, each one's longest silence less the send
    /// interval (what the migration added to what a client waits anyway):
    /// median and p99.
    pub(crate) gap_beyond_median_ms: f64,
    pub(crate) gap_beyond_p99_ms: f64,
    /// The destination's replay of the captured packets, from its first
    /// packet to the ports passing packets again (after the resume, so not
    /// in the freeze), how many packets it replayed and the input
    /// backlog's drops meanwhile (`ReplayStats`).
    pub(crate) replay_duration_ms: f64,
    pub(crate) replayed: u64,
    pub(crate) replay_backlog_drops: u64,
    /// Every part of the freeze the migration report names, in its order.
    pub(crate) parts: Vec<(String, f64)>,
}

pub(crate) const HEADER: [&str; 27] = [
    "tcp",
    "udp",
    "mode",
    "run",
    "freeze_ms",
    "dump_ms",
    "transfer_ms",
    "restore_ms",
    "replay_ms",
    "bytes_in_freeze",
    "image_files",
    "tcp_gap_median_ms",
    "gap_max_ms",
    "tcp_rtos",
    "udp_lost",
    "drain_ms",
    "drain_start_bytes",
    "drain_left_bytes",
    "send_queue_bytes_in_freeze",
    "backlog_drops",
    "profile",
    "gap_beyond_interval_median_ms",
    "gap_beyond_interval_p99_ms",
    "replay_duration_ms",
    "replayed_packets",
    "replay_backlog_drops",
    "replay_packets_per_ms",
];

impl Row {
    pub(crate) fn cells(&self) -> Vec<String> {
        vec![
            self.tcp.to_string(),
            self.udp.to_string(),
            self.mode.to_owned(),
            self.run.to_string(),
            format!("{:.1}", self.freeze_ms),
            format!("{:.1}", self.dump_ms),
            format!("{:.1}", self.transfer_ms),
            format!("{:.1}", self.restore_ms),
            format!("{:.1}", self.replay_ms),
            self.frozen_bytes.to_string(),
            self.image_files.to_string(),
            format!("{:.1}", self.gap_median_ms),
            format!("{:.1}", self.gap_max_ms),
            self.rtos.to_string(),
            self.udp_lost.to_string(),
            format!("{:.1}", self.drain_ms),
            self.drain_start.to_string(),
            self.drain_left.to_string(),
            self.send_queues.to_string(),
            self.backlog_drops.to_string(),
            ferry_bench::run::profile().to_owned(),
            format!("{:.1}", self.gap_beyond_median_ms),
            format!("{:.1}", self.gap_beyond_p99_ms),
            format!("{:.1}", self.replay_duration_ms),
            self.replayed.to_string(),
            self.replay_backlog_drops.to_string(),
            format!("{:.0}", self.replay_rate()),
        ]
    }
}

impl Row {
    /// Packets replayed per millisecond of the replay (0 without one).
    pub(crate) fn replay_rate(&self) -> f64 {
        if self.replay_duration_ms > 0.0 {
            self.replayed as f64 / self.replay_duration_ms
        } else {
            0.0
        }
    }
}
