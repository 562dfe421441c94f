//! The live DVE experiment's parts against a real migration: a zone server
//! (`ferry-zone-server`, 20 Hz UDP updates) under ferry with its players
//! (`ferry-dve-players`) in the client namespace, moved node1 -> node2 ->
//! node1 while they play. Root only; run by `cargo xtask integration -- dve`.

use std::process::Command;
use std::time::Duration;

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{migrate, run, runtime, wait_for_process};
use ferry_integration::topology::PUBLIC_ADDR;
use ferry_proto::v1::MigrationOutcome;

const PLAYERS: usize = 50;
const PLAY_SECS: u64 = 14;

#[test]
fn players_keep_their_zone_while_its_server_moves() {
    if !ferry_integration::can_run("players_keep_their_zone_while_its_server_moves") {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    let dir = tempfile::tempdir().expect("tempdir");
    let report_path = dir.path().join("players.json");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control");
        let mut node2 = cluster.control("node2").await.expect("control");
        let server = ferry_integration::bin_path("ferry-zone-server");
        let pid = run(
            &mut node1,
            vec![
                server.display().to_string(),
                "--port".into(),
                "30000".into(),
                "--zone".into(),
                "0".into(),
                "--cpu-per-player-us".into(),
                "20".into(),
            ],
        )
        .await;
        let mut cmd = Command::new(ferry_integration::bin_path("ferry-dve-players"));
        cmd.args([
            "--server",
            &PUBLIC_ADDR.to_string(),
            "--players",
            &PLAYERS.to_string(),
            "--fixed-zone",
            "0",
            "--duration-s",
            &PLAY_SECS.to_string(),
            "--stats-every-s",
            "2",
            "--report",
        ])
        .arg(&report_path);
        let client = cluster.client_names()[0].clone();
        let mut players = cluster.spawn_in(&client, cmd).expect("players");
        tokio::time::sleep(Duration::from_secs(4)).await;
        let mut freezes = Vec::new();
        let (report, status) = migrate(&mut node1, pid, "node2").await.expect("Migrate");
        assert!(status.is_none(), "{status:?}\n{report:#?}");
        assert_eq!(report.outcome, MigrationOutcome::Committed as i32, "{report:#?}");
        freezes.push(report.freeze_time_us as f64 / 1000.0);
        let moved = report.destination_pid;
        wait_for_process(&mut node2, moved, |p| p.state == "running").await;
        tokio::time::sleep(Duration::from_secs(4)).await;
        let (report, status) = migrate(&mut node2, moved, "node1").await.expect("Migrate back");
        assert!(status.is_none(), "{status:?}\n{report:#?}");
        assert_eq!(report.outcome, MigrationOutcome::Committed as i32, "{report:#?}");
        freezes.push(report.freeze_time_us as f64 / 1000.0);
        let exit = tokio::task::spawn_blocking(move || players.wait())
            .await
            .expect("join")
            .expect("players ran");
        assert!(exit.success(), "ferry-dve-players: {exit:?}");
        let text = std::fs::read_to_string(&report_path).expect("the players' report");
        let r: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        let updates = r["updates"].as_u64().unwrap();
        let longest = r["longest_gap_ms"].as_f64().unwrap();
        let gaps = r["gaps"].as_array().unwrap();
        eprintln!(
            "{PLAYERS} players, {updates} updates in {PLAY_SECS} s; freezes {freezes:?} ms; longest gap {longest:.1} ms; {} gaps over {} ms",
            gaps.len(),
            r["gap_threshold_ms"]
        );
        // 20 updates a second each, less the two freezes and the start: a
        // player that lost its zone at a migration would miss half.
        let expected = (PLAYERS as u64) * 20 * PLAY_SECS;
        assert!(updates * 10 >= expected * 8, "{updates} of {expected} updates");
        // The zone's state moved with it: its tick never went back.
        assert_eq!(r["seq_regressions"].as_u64(), Some(0), "{text}");
        // No update lost: around every long gap the server's ticks are
        // consecutive (it sent nothing while frozen, then the next one).
        for g in gaps {
            assert_eq!(
                g["seq_after"].as_u64().unwrap(),
                g["seq_before"].as_u64().unwrap() + 1,
                "updates lost: {g}"
            );
        }
    });
}
