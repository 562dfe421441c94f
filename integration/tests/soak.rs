//! The soak's short run: 20 migrations of one server across three nodes
//! under load (256 TCP clients, every byte checked; 24 UDP players at
//! 20 Hz; a PostgreSQL session), strategy and socket mode drawn per
//! migration (the seed is printed; `FERRY_SOAK_SEED` repeats a run).
//! Every migration commits and keeps every client and the session,
//! nothing is lost, and nothing is left behind. The long run is
//! `cargo xtask soak`. Root only; run by `cargo xtask test`.

use std::time::Duration;

use ferry_integration::managed::runtime;
use ferry_integration::soak::{SoakSpec, run_soak};

#[test]
fn twenty_migrations_under_load_lose_nothing_and_leave_nothing() {
    if !ferry_integration::can_run("twenty_migrations_under_load_lose_nothing_and_leave_nothing") {
        return;
    }
    let seed = std::env::var("FERRY_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
    eprintln!("soak seed {seed} (FERRY_SOAK_SEED={seed} repeats it)");
    let spec = SoakSpec {
        migrations: 20,
        time_limit: Duration::from_secs(600),
        seed,
        tcp: 256,
        udp: 24,
        sample_every: 5,
    };
    let cluster = ferry_integration::soak::cluster().expect("cluster");
    let rt = runtime();
    let report = rt
        .block_on(run_soak(&cluster, &spec, |m| eprintln!("{m:?}")))
        .expect("the soak runs");
    eprintln!(
        "TCP {} of {} bytes verified, {} connections failed; UDP {} sent, {} lost, {} corrupt; {} database queries; left: {:?}; RSS slopes (KiB / 100 migrations): {:?}",
        report.tcp_verified_bytes,
        report.tcp_sent_bytes,
        report.tcp_failures.len(),
        report.udp_sent,
        report.udp_lost,
        report.udp_corrupt,
        report.db_queries_ok,
        report.leftovers,
        report.rss_slopes()
    );
    assert_eq!(report.migrations.len(), 20, "seed {seed}");
    assert!(report.is_clean(), "seed {seed}: {report:#?}");
    assert!(report.tcp_verified_bytes > 0 && report.udp_sent > 0);
}
