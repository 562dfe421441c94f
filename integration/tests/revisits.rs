//! A process sent straight back to a node it has just left finds its
//! connections' address pairs free there: nothing of its stay (the killed
//! copy, a CRIU that dumped or restored it, ferryd's own descriptors)
//! still holds one of its sockets once the migration that took it away
//! reports. A socket left over makes the rebuild of the same connection
//! fail with EADDRNOTAVAIL (the kernel finds the address pair taken), and
//! the process cannot come back. Root only; run by `cargo xtask test`.
//!
//! Every core is kept busy by CPU-bound processes at the default
//! priority, so that work the agents leave to idle time (CRIU's exit
//! after it answered) gets no CPU unless something waits for it.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::{Child, Command};
use std::time::Duration;

use ferry_integration::cluster::{Cluster, ClusterSpec};
use ferry_integration::inspect::{socket_holders, tcp_sockets};
use ferry_integration::managed::{migrate_with, run, runtime, wait_for_process};
use ferry_integration::workload::SeqClient;
use ferry_proto::v1::SocketMigration;

const SHARED_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
const PORT: u16 = 7000;

/// CPU-bound processes, one per core, killed when dropped.
struct Busy(Vec<Child>);

impl Busy {
    fn every_core() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self(
            (0..cores)
                .map(|_| {
                    Command::new(env!("CARGO_BIN_EXE_ferry-burn"))
                        .spawn()
                        .expect("ferry-burn")
                })
                .collect(),
        )
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn a_process_sent_straight_back_finds_its_connections_free_on_the_node_it_left() {
    if !ferry_integration::can_run(
        "a_process_sent_straight_back_finds_its_connections_free_on_the_node_it_left",
    ) {
        return;
    }
    let rt = runtime();
    let cluster = Cluster::start(ClusterSpec::new(2, 1)).expect("cluster");
    rt.block_on(async {
        let nodes = ["node1", "node2"];
        let mut controls = [
            cluster.control("node1").await.expect("control node1"),
            cluster.control("node2").await.expect("control node2"),
        ];
        let server = vec![
            env!("CARGO_BIN_EXE_ferry-dve-server").to_owned(),
            "--port".into(),
            PORT.to_string(),
        ];
        let mut pid = run(&mut controls[0], server).await;
        wait_for_process(&mut controls[0], pid, |p| p.tcp_listening == 1).await;
        let clients = SeqClient::start(
            cluster.netns_path("client1"),
            SocketAddrV4::new(SHARED_IP, PORT),
            16,
            Duration::from_millis(20),
            256,
        )
        .expect("16 TCP clients");
        wait_for_process(&mut controls[0], pid, |p| p.tcp_established == 16).await;
        let busy = Busy::every_core();
        // Away by CRIU's path (whose dump holds each connection while it
        // works) and straight back by ferryd's, then away by ferryd's and
        // back by CRIU's, five times over.
        let modes = [SocketMigration::Iterative, SocketMigration::Collective];
        let mut here = 0;
        for n in 0..10 {
            let there = 1 - here;
            let mode = modes[(n + n / 2) % 2];
            let (report, status) = migrate_with(&mut controls[here], pid, nodes[there], mode)
                .await
                .expect("migration starts");
            assert!(
                status.is_none(),
                "migration {n} ({} to {}, {mode:?}) failed: {status:?}\n{}",
                nodes[here],
                nodes[there],
                report.error
            );
            // Once the migration reports, the node it left holds nothing
            // of the server's port.
            let left: Vec<_> = tcp_sockets(&cluster.netns_path(nodes[here]))
                .expect("the left node's sockets")
                .into_iter()
                .filter(|e| e.local.port() == PORT)
                .collect();
            assert!(
                left.is_empty(),
                "after migration {n}, {} still holds {left:?}, by {:?}",
                nodes[here],
                socket_holders(&left.iter().map(|e| e.inode).collect())
            );
            pid = report.destination_pid;
            here = there;
        }
        drop(busy);
        let before = clients.verified_per_connection();
        clients
            .wait_until_each_passes(&before, 10, Duration::from_secs(20))
            .expect("every client served after the trips");
        clients.stop().assert_clean();
    });
}
