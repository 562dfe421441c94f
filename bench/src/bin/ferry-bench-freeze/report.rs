//! The Markdown tables and the SVG chart of the rows.

use super::*;

/// The freeze's median and p95 against the number of connections, a line
/// for each per mode (Gerofi et al. (DVE), Fig. 5b/5c).
/// `freezes`: (TCP connections, mode, freeze in ms) per migration.
pub(crate) fn plot(
    freezes: &[(usize, String, f64)],
    counts: &[usize],
    modes: &[&str],
    runs: usize,
) -> String {
    use ferry_policy::sim::svg::{Chart, Series};
    let mut series = Vec::new();
    for &mode in modes {
        let mut medians = Vec::new();
        let mut p95s = Vec::new();
        for &tcp in counts {
            let mut v: Vec<f64> = freezes
                .iter()
                .filter(|(n, m, _)| *n == tcp && m == mode)
                .map(|(_, _, ms)| *ms)
                .collect();
            if v.is_empty() {
                continue;
            }
            v.sort_by(f64::total_cmp);
            medians.push((tcp as f64, median(&v)));
            p95s.push((tcp as f64, percentile(&v, 95.0)));
        }
        series.push(Series {
            name: format!("{mode}, median"),
            points: medians,
        });
        series.push(Series {
            name: format!("{mode}, p95"),
            points: p95s,
        });
    }
    Chart {
        title: format!("Freeze time by established TCP connections ({runs} migrations each)"),
        x_label: "established TCP connections".into(),
        y_label: "freeze (ms)".into(),
        y_range: None,
        x_log2: true,
        series,
    }
    .render()
}

pub(crate) fn tables(
    rows: &[Row],
    args: &Args,
    modes: &[(&'static str, SocketMigration)],
    backlog_size: u32,
) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "{} migrations per connection count and mode, {} build ({} UDP players beside the TCP clients{}{}); medians, p95 of the freeze. The gap beyond the interval is each client's longest silence less its 50 ms send interval; the replay runs after the resume, outside the freeze; backlog drops are the machine's input backlog's ({backlog_size} packets per CPU) over the whole migration (in brackets: during the destination's replay).\n",
        args.runs,
        ferry_bench::run::profile(),
        args.udp,
        if args.db {
            ", and the server's session to PostgreSQL on another node, kept through every migration"
        } else {
            ""
        },
        if args.bystanders > 0 {
            format!(
                "; {} established connections of another server on each of the two nodes",
                args.bystanders
            )
        } else {
            String::new()
        }
    );
    let _ = writeln!(
        t,
        "| TCP conns | mode | freeze median (ms) | freeze p95 (ms) | dump | transfer | restore | bytes in freeze | image files | TCP gap, median client (ms) | gap beyond the interval, median / p99 client (ms) | worst gap (ms) | replay after the resume (ms) | packets replayed | TCP RTOs | UDP lost | backlog drops (in the replay) |"
    );
    let _ = writeln!(
        t,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for &tcp in &args.tcp.0 {
        for &(mode, _) in modes {
            let rs: Vec<&Row> = rows
                .iter()
                .filter(|r| r.tcp == tcp && r.mode == mode)
                .collect();
            if rs.is_empty() {
                continue;
            }
            let m = Summary::of(&rs);
            if mode == PAUSE {
                let _ = writeln!(
                    t,
                    "| {tcp} | {mode} (in place) | {:.1} | {:.1} | - | - | - | - | - | {:.1} | {:.1} / {:.1} | {:.1} | - | - | {:.0} | {:.0} | {:.0} |",
                    m.freeze,
                    m.freeze_p95,
                    m.gap_median,
                    m.gap_beyond_median,
                    m.gap_beyond_p99,
                    m.gap_max,
                    m.rtos,
                    m.udp_lost,
                    m.backlog_drops,
                );
                continue;
            }
            let _ = writeln!(
                t,
                "| {tcp} | {mode} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.1} | {:.1} / {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} | {:.0} ({:.0}) |",
                m.freeze,
                m.freeze_p95,
                m.dump,
                m.transfer,
                m.restore,
                m.bytes,
                m.image_files,
                m.gap_median,
                m.gap_beyond_median,
                m.gap_beyond_p99,
                m.gap_max,
                m.replay_duration,
                m.replayed,
                m.rtos,
                m.udp_lost,
                m.backlog_drops,
                m.replay_backlog_drops,
            );
        }
    }
    udp_table(&mut t, rows, args, modes);
    parts_table(&mut t, rows, args, modes);
    let list = |v: &[usize]| {
        v.iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let _ = writeln!(
        t,
        "\nReproduce: `cargo xtask bench freeze -- --runs {} --tcp={} --udp {} --udp-only={} --db {} --bulk {} --bystanders {} --drain-ms {} --modes {} --strategy {} --input-backlog {}` (root; 2 cores here).",
        args.runs,
        list(&args.tcp.0),
        args.udp,
        list(&args.udp_only.0),
        args.db,
        args.bulk,
        args.bystanders,
        args.drain_ms,
        args.modes.join(","),
        args.strategy.name(),
        args.input_backlog
    );
    t
}

/// The medians of one count and mode's migrations, and the p95 of their
/// freeze.
pub(crate) struct Summary {
    pub(crate) freeze: f64,
    freeze_p95: f64,
    pub(crate) dump: f64,
    pub(crate) transfer: f64,
    pub(crate) restore: f64,
    pub(crate) bytes: f64,
    pub(crate) image_files: f64,
    pub(crate) gap_median: f64,
    pub(crate) gap_max: f64,
    pub(crate) rtos: f64,
    pub(crate) udp_lost: f64,
    pub(crate) backlog_drops: f64,
    pub(crate) gap_beyond_median: f64,
    gap_beyond_p99: f64,
    pub(crate) replay_duration: f64,
    pub(crate) replayed: f64,
    pub(crate) replay_backlog_drops: f64,
}

impl Summary {
    fn of(rs: &[&Row]) -> Self {
        let med = |f: fn(&Row) -> f64| {
            let v: Vec<f64> = rs.iter().map(|r| f(r)).collect();
            median_unsorted(&v)
        };
        let freezes: Vec<f64> = rs.iter().map(|r| r.freeze_ms).collect();
        Self {
            freeze: med(|r| r.freeze_ms),
            freeze_p95: percentile(&freezes, 95.0),
            dump: med(|r| r.dump_ms),
            transfer: med(|r| r.transfer_ms),
            restore: med(|r| r.restore_ms),
            bytes: med(|r| r.frozen_bytes as f64),
            image_files: med(|r| r.image_files as f64),
            gap_median: med(|r| r.gap_median_ms),
            gap_max: med(|r| r.gap_max_ms),
            rtos: med(|r| r.rtos as f64),
            udp_lost: med(|r| r.udp_lost as f64),
            backlog_drops: med(|r| r.backlog_drops as f64),
            gap_beyond_median: med(|r| r.gap_beyond_median_ms),
            gap_beyond_p99: med(|r| r.gap_beyond_p99_ms),
            replay_duration: med(|r| r.replay_duration_ms),
            replayed: med(|r| r.replayed as f64),
            replay_backlog_drops: med(|r| r.replay_backlog_drops as f64),
        }
    }
}

/// The UDP-only server's rows: no TCP client, so no TCP gap or RTO.
pub(crate) fn udp_table(
    t: &mut String,
    rows: &[Row],
    args: &Args,
    modes: &[(&'static str, SocketMigration)],
) {
    if args.udp_only.0.is_empty() {
        return;
    }
    let _ = writeln!(
        t,
        "\nThe UDP server alone (players at 20 Hz, no TCP client), medians, p95 of the freeze:\n"
    );
    let _ = writeln!(
        t,
        "| UDP players | mode | freeze median (ms) | freeze p95 (ms) | dump | transfer | restore | bytes in freeze | worst gap (ms) | replay after the resume (ms) | packets replayed | UDP lost | backlog drops (in the replay) |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for &udp in &args.udp_only.0 {
        for &(mode, _) in modes {
            let rs: Vec<&Row> = rows
                .iter()
                .filter(|r| r.tcp == 0 && r.udp == udp && r.mode == mode)
                .collect();
            if rs.is_empty() {
                continue;
            }
            let m = Summary::of(&rs);
            if mode == PAUSE {
                let _ = writeln!(
                    t,
                    "| {udp} | {mode} (in place) | {:.1} | {:.1} | - | - | - | - | {:.1} | - | - | {:.0} | {:.0} |",
                    m.freeze, m.freeze_p95, m.gap_max, m.udp_lost, m.backlog_drops,
                );
                continue;
            }
            let _ = writeln!(
                t,
                "| {udp} | {mode} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} ({:.0}) |",
                m.freeze,
                m.freeze_p95,
                m.dump,
                m.transfer,
                m.restore,
                m.bytes,
                m.gap_max,
                m.replay_duration,
                m.replayed,
                m.udp_lost,
                m.backlog_drops,
                m.replay_backlog_drops,
            );
        }
    }
}

/// Medians of every part of the freeze, one column per count and mode: the
/// main table folds them into dump, transfer, restore and replay.
pub(crate) fn parts_table(
    t: &mut String,
    rows: &[Row],
    args: &Args,
    modes: &[(&'static str, SocketMigration)],
) {
    let mut names: Vec<&str> = Vec::new();
    for r in rows {
        for (name, _) in &r.parts {
            if !names.contains(&name.as_str()) {
                names.push(name);
            }
        }
    }
    let columns: Vec<(usize, &str)> = args
        .tcp
        .0
        .iter()
        .flat_map(|&tcp| modes.iter().map(move |&(mode, _)| (tcp, mode)))
        .filter(|&(tcp, mode)| mode != PAUSE && rows.iter().any(|r| r.tcp == tcp && r.mode == mode))
        .collect();
    if names.is_empty() || columns.is_empty() {
        return;
    }
    let _ = writeln!(t, "\nParts of the freeze, medians (ms):\n");
    let _ = write!(t, "| part |");
    for (tcp, mode) in &columns {
        let _ = write!(t, " {tcp} {mode} |");
    }
    let _ = writeln!(t, "\n|---|{}", "---:|".repeat(columns.len()));
    for name in names {
        let _ = write!(t, "| {name} |");
        for &(tcp, mode) in &columns {
            let mut v: Vec<f64> = rows
                .iter()
                .filter(|r| r.tcp == tcp && r.mode == mode)
                .map(|r| {
                    r.parts
                        .iter()
                        .filter(|(n, _)| n == name)
                        .map(|(_, ms)| ms)
                        .sum()
                })
                .collect();
            v.sort_by(f64::total_cmp);
            let _ = write!(t, " {:.1} |", median(&v));
        }
        let _ = writeln!(t);
    }
}
