//! In-cluster connections: a migrating process holding a session to a real
//! PostgreSQL server (Debian's) on a third node keeps using that very
//! session after each migration, with no reconnect. Root only; skipped with
//! a reason otherwise.

use std::net::{SocketAddr, SocketAddrV4};
use std::time::Duration;

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::managed::{
    data_plane, migrate, migrate_with, run, runtime, wait_for_process, wait_until_gone,
};
use ferry_integration::pg_session::{self, SessionStatus};
use ferry_integration::postgres::{PG_PORT, PostgresServer};
use ferry_integration::topology::Family;
use ferry_proto::v1::{MigrationOutcome, SocketMigration};

const STATUS_PORT: u16 = 7300;

fn status_target(cluster: &Cluster) -> SocketAddrV4 {
    SocketAddrV4::new(cluster.public_addr(), STATUS_PORT)
}

/// Waits until the session has answered `n` more queries than `since`.
fn wait_for_queries(cluster: &Cluster, since: u64, n: u64) -> SessionStatus {
    pg_session::wait_for_queries(
        &cluster.netns_path("client1"),
        status_target(cluster),
        since,
        n,
        Duration::from_secs(20),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn a_postgresql_session_on_another_node_survives_migrations() {
    if !ferry_integration::can_run("a_postgresql_session_on_another_node_survives_migrations") {
        return;
    }
    a_postgresql_session_on_another_node_survives_migrations_on(Family::V4);
}

/// The same on an IPv6 cluster network: the session's connection is an
/// IPv6 one, rewritten in the images and rebuilt on the new node's IPv6
/// cluster address, and node3 translates its IPv6 flow.
#[test]
fn a_postgresql_session_over_an_ipv6_cluster_network_survives_migrations() {
    if !ferry_integration::can_run(
        "a_postgresql_session_over_an_ipv6_cluster_network_survives_migrations",
    ) {
        return;
    }
    a_postgresql_session_on_another_node_survives_migrations_on(Family::V6);
}

fn a_postgresql_session_on_another_node_survives_migrations_on(cluster_family: Family) {
    let rt = runtime();
    let mut spec = ClusterSpec::new(3, 1);
    spec.cluster_family = cluster_family;
    let cluster = Cluster::start(spec).expect("cluster");
    let node_ip = |n: &str| cluster.node_cluster_ip(n);
    let pg_addr = SocketAddr::new(node_ip("node3"), PG_PORT);
    let pg = PostgresServer::start(&cluster.netns_path("node3"), pg_addr).expect("PostgreSQL");
    let sessions = || {
        pg.query(
            "SELECT pid, host(client_addr), client_port FROM pg_stat_activity \
             WHERE application_name = 'ferry-pg-session'",
        )
        .expect("pg_stat_activity")
    };
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut node3 = cluster.control("node3").await.expect("control node3");
        let mut argv = vec![env!("CARGO_BIN_EXE_ferry-pg-session").to_owned()];
        argv.extend(pg_session::args(pg_addr, status_target(&cluster)));
        let mut pid = run(&mut node1, argv).await;
        wait_for_process(&mut node1, pid, |p| p.tcp_listening == 1).await;
        let first = wait_for_queries(&cluster, 0, 5);
        assert_eq!(first.client_addr, node_ip("node1").to_string(), "{first:?}");
        let seen_by_pg = sessions();
        assert_eq!(
            seen_by_pg,
            format!(
                "{}|{}|{}",
                first.backend_pid,
                node_ip("node1"),
                first.client_port
            ),
            "PostgreSQL's view of the session"
        );

        // Not to node3: the session would have to become a connection
        // within node3. Refused before anything is touched.
        let refused = migrate(&mut node1, pid, "node3")
            .await
            .expect_err("a migration onto the database's node");
        assert_eq!(
            refused.code(),
            tonic::Code::FailedPrecondition,
            "{refused:?}"
        );
        assert!(refused.message().contains("node3"), "{refused:?}");
        let still = wait_for_queries(&cluster, first.queries_ok, 5);
        assert_eq!(still.backend_pid, first.backend_pid);

        // A collective migration whose restore fails, after node2 rebuilt
        // the session's connection on its cluster address and held it: the
        // abort drops the hold and leaves node3's flow as it was, and the
        // session goes on from node1.
        {
            // A process node2's agent does not manage holds the status
            // port there: CRIU's restore of its listening socket fails.
            let _squatter = cluster
                .spawn_in_node(
                    "node2",
                    env!("CARGO_BIN_EXE_ferry-echo-server"),
                    &["--port", &STATUS_PORT.to_string()],
                )
                .expect("port squatter on node2");
            cluster
                .wait_listening("node2", STATUS_PORT, Duration::from_secs(10))
                .expect("squatter listening");
            let (report, err) = migrate_with(&mut node1, pid, "node2", SocketMigration::Collective)
                .await
                .expect("migration starts");
            assert!(err.is_some(), "{report:#?}");
            assert_eq!(
                report.outcome,
                MigrationOutcome::Aborted as i32,
                "{report:#?}"
            );
            assert!(report.error.contains("restore"), "{}", report.error);
            assert!(report.resumed_on_source, "{report:#?}");
        }
        let mut node2 = cluster.control("node2").await.expect("control node2");
        for (node, control) in [("node2", &mut node2), ("node3", &mut node3)] {
            let dp = data_plane(control).await;
            assert!(
                dp.translations.is_empty(),
                "{node} kept a rule of the aborted migration: {:?}",
                dp.translations
            );
        }
        let after_abort = wait_for_queries(&cluster, still.queries_ok, 5);
        assert_eq!(
            after_abort.backend_pid, first.backend_pid,
            "{after_abort:?}"
        );
        assert_eq!(
            after_abort.client_port, first.client_port,
            "{after_abort:?}"
        );
        assert_eq!(after_abort.queries_failed, 0, "{after_abort:?}");
        assert_eq!(sessions(), seen_by_pg, "PostgreSQL's view changed");

        // node1 -> node2 -> node1: away from where the connection was
        // opened, then home again (the translation goes away).
        let mut here = node1;
        let mut last = after_abort;
        // Away collectively (ferryd rebuilds the connection on node2's
        // cluster address), home again through CRIU's own path.
        for (from, to, sockets) in [
            ("node1", "node2", SocketMigration::Collective),
            ("node2", "node1", SocketMigration::Iterative),
        ] {
            let (report, err) = migrate_with(&mut here, pid, to, sockets)
                .await
                .expect("migration starts");
            assert!(err.is_none(), "{from} -> {to}: {err:?}\n{report:#?}");
            assert_eq!(report.sockets, sockets as i32, "{}", report.sockets_note);
            assert_eq!(
                report.outcome,
                MigrationOutcome::Committed as i32,
                "{report:#?}"
            );
            eprintln!(
                "{from} -> {to}: freeze {:.1} ms; phases {:?}",
                report.freeze_time_us as f64 / 1e3,
                report
                    .phases
                    .iter()
                    .map(|p| format!("{} {:.1}", p.phase, p.duration_us as f64 / 1e3))
                    .collect::<Vec<_>>()
            );
            assert!(
                report.phases.iter().any(|p| p.phase == "translate"),
                "no translate phase: {report:#?}"
            );
            // The source copy is dead (the commit waited for that) and reaped.
            wait_until_gone(pid);
            pid = report.destination_pid;
            here = cluster.control(to).await.expect("control");
            wait_for_process(&mut here, pid, |p| p.state == "running").await;

            // The same session goes on: same backend, the counter keeps
            // counting, not one query failed, PostgreSQL still sees node1.
            let now = wait_for_queries(&cluster, last.queries_ok, 10);
            assert_eq!(now.backend_pid, first.backend_pid, "{now:?}");
            assert_eq!(now.client_addr, first.client_addr, "{now:?}");
            assert_eq!(now.client_port, first.client_port, "{now:?}");
            assert!(
                now.last_counter > last.last_counter,
                "{now:?} after {last:?}"
            );
            assert_eq!(now.queries_failed, 0, "{now:?}");
            assert_eq!(now.last_error, None, "{now:?}");
            assert_eq!(sessions(), seen_by_pg, "PostgreSQL's view changed");

            // The process's end of the connection lives on `to`, on its
            // cluster address; node3 rewrites the flow only while the
            // process is away from node1.
            let local = SocketAddr::new(node_ip(to), first.client_port as u16);
            assert_eq!(
                cluster.established_tcp(to, local.port()),
                vec![pg_addr],
                "the session's socket on {to}"
            );
            let dp3 = data_plane(&mut node3).await;
            let away = to != "node1";
            assert_eq!(
                dp3.translations.len(),
                usize::from(away),
                "node3's rules: {:?}",
                dp3.translations
            );
            if away {
                let c = dp3.counters.unwrap();
                assert!(c.translated > 0, "{c:?}");
            }
            let dp_here = data_plane(&mut here).await;
            assert!(
                dp_here.translations.is_empty(),
                "a hold survived the commit on {to}: {:?}",
                dp_here.translations
            );
            last = now;
        }
    });
    drop(pg);
}

/// A session to a database on the process's own node, over that node's
/// cluster address, never crosses the cluster interface, where the peer's
/// translator works: moved away, the process would find its session hung.
/// The migration is refused before anything stops, naming the connection's
/// peer, and the session goes on.
#[test]
fn a_session_to_a_peer_on_its_own_node_is_refused_before_anything_stops() {
    if !ferry_integration::can_run(
        "a_session_to_a_peer_on_its_own_node_is_refused_before_anything_stops",
    ) {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    let node1_ip = cluster.node_cluster_addr("node1");
    let pg_addr = SocketAddrV4::new(node1_ip, PG_PORT);
    let pg = PostgresServer::start(&cluster.netns_path("node1"), pg_addr).expect("PostgreSQL");
    rt.block_on(async {
        let mut node1 = cluster.control("node1").await.expect("control node1");
        let mut argv = vec![env!("CARGO_BIN_EXE_ferry-pg-session").to_owned()];
        argv.extend(pg_session::args(pg_addr, status_target(&cluster)));
        let pid = run(&mut node1, argv).await;
        wait_for_process(&mut node1, pid, |p| p.tcp_listening == 1).await;
        let first = wait_for_queries(&cluster, 0, 5);
        for sockets in [SocketMigration::Collective, SocketMigration::Iterative] {
            let refused = migrate_with(&mut node1, pid, "node2", sockets)
                .await
                .expect_err("a migration away from the session's peer");
            assert_eq!(
                refused.code(),
                tonic::Code::FailedPrecondition,
                "{refused:?}"
            );
            assert!(
                refused.message().contains(&node1_ip.to_string())
                    && refused.message().contains("node1"),
                "{refused:?}"
            );
        }
        let p = wait_for_process(&mut node1, pid, |p| p.state == "running").await;
        assert_eq!(p.pid, pid);
        let after = wait_for_queries(&cluster, first.queries_ok, 5);
        assert_eq!(after.backend_pid, first.backend_pid, "{after:?}");
        assert_eq!(after.queries_failed, 0, "{after:?}");
    });
    drop(pg);
}
