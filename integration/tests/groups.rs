//! Distributed servers (the XtreemOS distributed servers on ferry's
//! single-IP cluster): a group of server processes on several nodes serves
//! one port of the cluster's address, and a connection is handed from one
//! node's server to another's in the middle of its life. Unmodified
//! clients (curl, a plain socket) must notice nothing: every byte arrives
//! once and in order in both directions, and a handoff that fails leaves
//! the connection with the donor. Root only; run by `cargo xtask test`
//! (or `cargo xtask integration`).

use std::io::{Read, Write};
use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use ferry_integration::cluster::Cluster;
use ferry_integration::group::{
    TEST_PORT, create_group, create_group_with_backups, echo, group_server, group_view, pattern,
    start_cluster as start, wait_server,
};
use ferry_integration::managed::{run, runtime};
use ferry_integration::netns;
use ferry_integration::topology::Family;
use ferry_proto::v1 as pb;
use ferry_proto::v1::control_client::ControlClient;
use tonic::transport::Channel;

const PORT: u16 = TEST_PORT;
const SIZE: u64 = 1_000_000;
const HALF: u64 = 500_000;

/// The contact node's download server: sends [`HALF`] of each download,
/// hands the connection to `to`, logs the handoff to `log`.
async fn download_donor(c: &mut ControlClient<Channel>, to: &str, log: &Path) {
    let (half, size) = (HALF.to_string(), SIZE.to_string());
    let log = log.to_string_lossy();
    let args = [
        "--mode",
        "download",
        "--size",
        &size,
        "--handoff-after",
        &half,
        "--to",
        to,
        "--log",
        &log,
    ];
    group_server(c, &args).await;
}

/// A member's download server: sends the rest of what is handed to it.
async fn download_acceptor(c: &mut ControlClient<Channel>) {
    group_server(c, &["--mode", "download", "--size", &SIZE.to_string()]).await;
}

/// curl from the client's namespace: the download's body, all of it.
fn curl(cluster: &Cluster) -> Vec<u8> {
    let mut cmd = Command::new("curl");
    cmd.args([
        "--silent",
        "--show-error",
        "--max-time",
        "30",
        &format!("http://{}:{PORT}/", cluster.public_addr()),
    ]);
    let out = netns::output_in(&cluster.netns_path("client1"), cmd).expect("curl");
    assert!(
        out.status.success(),
        "curl: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[track_caller]
fn assert_whole_download(body: &[u8]) {
    assert_eq!(body.len() as u64, SIZE, "the download's length");
    let expected = pattern(0, SIZE as usize);
    if let Some(at) = body.iter().zip(&expected).position(|(a, b)| a != b) {
        panic!("the download differs from byte {at} on");
    }
}

/// The server's handoff log, once it has `n` lines: the donor's server
/// writes a line when its ferryd answers, which can be after the acceptor
/// already finished the download.
fn handoff_log(path: &Path, n: usize) -> Vec<serde_json::Value> {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        // Whole lines only: the server may be writing the next one.
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(path)
            .unwrap_or_default()
            .split_inclusive('\n')
            .filter(|l| l.ends_with('\n'))
            .map(|l| serde_json::from_str(l.trim_end()).expect("a JSON line"))
            .collect();
        if lines.len() >= n || Instant::now() > until {
            return lines;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn downloads_handed_off_midway_reach_curl_whole() {
    let Some(cluster) = start("downloads_handed_off_midway_reach_curl_whole", 2) else {
        return;
    };
    let log = cluster.dir().join("handoffs.jsonl");
    runtime().block_on(async {
        let (mut c1, mut c2) = (
            cluster.control("node1").await.unwrap(),
            cluster.control("node2").await.unwrap(),
        );
        create_group(&mut c1, "node1", &["node2"]).await;
        download_donor(&mut c1, "node2", &log).await;
        download_acceptor(&mut c2).await;
        wait_server(&mut c1, "node1").await;
        wait_server(&mut c2, "node2").await;

        const DOWNLOADS: u64 = 3;
        for _ in 0..DOWNLOADS {
            assert_whole_download(&curl(&cluster));
        }
        let given = handoff_log(&log, DOWNLOADS as usize);
        assert_eq!(given.len() as u64, DOWNLOADS, "{given:?}");
        for h in &given {
            assert_eq!(h["outcome"], "handed-off", "{h}");
            assert_eq!(h["acceptor"], "node2", "{h}");
            assert_eq!(h["at"], HALF, "{h}");
        }
        let (v1, v2) = (group_view(&mut c1).await, group_view(&mut c2).await);
        assert_eq!((v1.role.as_str(), v2.role.as_str()), ("contact", "member"));
        assert_eq!(
            (v1.handoffs_given, v1.handoffs_failed, v2.handoffs_taken),
            (DOWNLOADS, 0, DOWNLOADS)
        );
        // The contact node knows each connection is served by node2.
        assert_eq!(v1.connections.len() as u64, DOWNLOADS);
        assert!(v1.connections.iter().all(|c| c.node == "node2"), "{v1:?}");
        let client = cluster.client_addr("client1").to_string();
        assert!(
            v2.connections.iter().all(|c| c
                .connection
                .as_ref()
                .unwrap()
                .remote
                .starts_with(&client)),
            "{v2:?}"
        );
    });
}

#[test]
fn an_echo_stream_survives_a_handoff_in_both_directions() {
    let Some(cluster) = start("an_echo_stream_survives_a_handoff_in_both_directions", 2) else {
        return;
    };
    an_echo_stream_survives_a_handoff_in(cluster, Family::V4);
}

/// The same over IPv6: the connection's entries are IPv6 ones in both
/// nodes' filters (FERRY_FLOWS6), and its state rebuilt on node2 is an
/// IPv6 socket's.
#[test]
fn an_ipv6_echo_stream_survives_a_handoff_in_both_directions() {
    let Some(cluster) = start(
        "an_ipv6_echo_stream_survives_a_handoff_in_both_directions",
        2,
    ) else {
        return;
    };
    an_echo_stream_survives_a_handoff_in(cluster, Family::V6);
}

fn an_echo_stream_survives_a_handoff_in(cluster: Cluster, family: Family) {
    let bind = match family {
        Family::V4 => "0.0.0.0",
        Family::V6 => "::",
    };
    let log = cluster.dir().join("handoffs.jsonl");
    const STREAM: usize = 4 << 20;
    runtime().block_on(async {
        let (mut c1, mut c2) = (
            cluster.control("node1").await.unwrap(),
            cluster.control("node2").await.unwrap(),
        );
        create_group(&mut c1, "node1", &["node2"]).await;
        let log_arg = log.to_string_lossy().into_owned();
        group_server(
            &mut c1,
            &[
                "--mode",
                "echo",
                "--handoff-after",
                "262144",
                "--to",
                "node2",
                "--log",
                &log_arg,
                "--bind",
                bind,
            ],
        )
        .await;
        group_server(&mut c2, &["--mode", "echo", "--bind", bind]).await;
        wait_server(&mut c1, "node1").await;
        wait_server(&mut c2, "node2").await;
    });
    let addr = SocketAddr::new(family.public_addr(), PORT);
    // The client writes all the time, the handoff included, while it
    // reads the echo back: both directions are in flight when the
    // connection moves.
    let echoed = netns::run_in(&cluster.netns_path("client1"), move || {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut w = s.try_clone().unwrap();
        let writer = std::thread::spawn(move || {
            for chunk in pattern(0, STREAM).chunks(8192) {
                w.write_all(chunk).expect("writing");
            }
            w.shutdown(std::net::Shutdown::Write).unwrap();
        });
        let mut back = Vec::with_capacity(STREAM);
        s.read_to_end(&mut back).expect("reading the echo");
        writer.join().unwrap();
        back
    })
    .expect("the client");
    assert_eq!(echoed.len(), STREAM, "echoed bytes");
    if let Some(at) = echoed
        .iter()
        .zip(&pattern(0, STREAM))
        .position(|(a, b)| a != b)
    {
        panic!("the echo differs from byte {at} on");
    }
    let given = handoff_log(&log, 1);
    assert_eq!(given.len(), 1, "{given:?}");
    assert_eq!(given[0]["outcome"], "handed-off", "{}", given[0]);
}

#[test]
fn a_handoff_to_an_acceptor_that_dies_before_the_commit_leaves_the_connection_with_the_donor() {
    let Some(mut cluster) = start(
        "a_handoff_to_an_acceptor_that_dies_before_the_commit_leaves_the_connection_with_the_donor",
        2,
    ) else {
        return;
    };
    cluster
        .start_agent_with_env("node2", &[("FERRY_FAULT_AT", "destination:HandoffRebuilt")])
        .expect("node2's agent, dying at the fault point");
    let log = cluster.dir().join("handoffs.jsonl");
    runtime().block_on(async {
        let (mut c1, mut c2) = (
            cluster.control("node1").await.unwrap(),
            cluster.control("node2").await.unwrap(),
        );
        create_group(&mut c1, "node1", &["node2"]).await;
        download_donor(&mut c1, "node2", &log).await;
        download_acceptor(&mut c2).await;
        wait_server(&mut c1, "node1").await;
        wait_server(&mut c2, "node2").await;
    });
    assert_whole_download(&curl(&cluster));
    assert!(
        cluster
            .wait_agent_exit("node2", Duration::from_secs(5))
            .is_some(),
        "node2's agent died at the fault point"
    );
    let given = handoff_log(&log, 1);
    assert_eq!(given.len(), 1, "{given:?}");
    assert_eq!(given[0]["outcome"], "failed", "{}", given[0]);
    runtime().block_on(async {
        let mut c1 = cluster.control("node1").await.unwrap();
        let v1 = group_view(&mut c1).await;
        assert_eq!((v1.handoffs_given, v1.handoffs_failed), (0, 1), "{v1:?}");
        // Served here again: a second download is whole too.
    });
    assert_whole_download(&curl(&cluster));
}

#[test]
fn bad_groups_and_handoffs_are_refused_with_the_reason() {
    let Some(cluster) = start("bad_groups_and_handoffs_are_refused_with_the_reason", 3) else {
        return;
    };
    let log = cluster.dir().join("handoffs.jsonl");
    runtime().block_on(async {
        let mut c1 = cluster.control("node1").await.unwrap();
        let refused = |g: pb::Group| {
            let mut c = c1.clone();
            async move {
                c.create_group(pb::CreateGroupRequest { group: Some(g) })
                    .await
                    .expect_err("refused")
            }
        };
        let g = |port: u32, contact: &str, members: &[&str]| pb::Group {
            port,
            contact: contact.into(),
            members: members.iter().map(|m| m.to_string()).collect(),
            ..Default::default()
        };
        let e = refused(g(0, "node1", &["node2"])).await;
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("group.port"), "{e}");
        let e = refused(g(8081, "node1", &["node9"])).await;
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("node9"), "{e}");
        let e = refused(g(8081, "node1", &["node1"])).await;
        assert!(e.message().contains("group.members"), "{e}");

        // A group of node1 and node2; node1's server hands off to node3,
        // which is not in it: refused, and the download goes on from node1.
        create_group(&mut c1, "node1", &["node2"]).await;
        download_donor(&mut c1, "node3", &log).await;
        wait_server(&mut c1, "node1").await;
    });
    assert_whole_download(&curl(&cluster));
    let given = handoff_log(&log, 1);
    assert_eq!(given.len(), 1, "{given:?}");
    assert_eq!(given[0]["outcome"], "failed", "{}", given[0]);
    let error = given[0]["error"].as_str().unwrap();
    assert!(error.contains("node3 is not a member"), "{error}");

    // A process that is not one ferryd manages may not serve.
    let err = ferry_handoff::Server::serve_via(&cluster.handoff_socket("node1"), PORT)
        .expect_err("a process ferryd does not manage");
    match err {
        ferry_handoff::Error::Refused { kind, message } => {
            assert_eq!(kind, ferry_handoff::ErrorKind::NotMember, "{message}");
            assert!(
                message.contains("not a process ferryd manages"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    // Nor may one serve a port without a group.
    let err = ferry_handoff::Server::serve_via(&cluster.handoff_socket("node3"), PORT)
        .expect_err("no group on node3");
    assert!(
        matches!(err, ferry_handoff::Error::Refused { .. }),
        "{err:?}"
    );
}

#[test]
fn the_contact_nodes_failure_loses_no_connection_served_elsewhere() {
    let Some(cluster) = start(
        "the_contact_nodes_failure_loses_no_connection_served_elsewhere",
        3,
    ) else {
        return;
    };
    const CLIENTS: usize = 8;
    runtime().block_on(async {
        let mut c = [
            cluster.control("node1").await.unwrap(),
            cluster.control("node2").await.unwrap(),
            cluster.control("node3").await.unwrap(),
        ];
        create_group_with_backups(&mut c[0], "node1", &["node2"], &["node3"]).await;
        // The contact node hands every connection to node3 after its first
        // exchange; node2, its backup, serves what it takes itself.
        group_server(
            &mut c[0],
            &["--mode", "echo", "--handoff-after", "8", "--to", "node3"],
        )
        .await;
        group_server(&mut c[1], &["--mode", "echo"]).await;
        group_server(&mut c[2], &["--mode", "echo"]).await;
        for (i, node) in ["node1", "node2", "node3"].iter().enumerate() {
            wait_server(&mut c[i], node).await;
        }
    });
    let addr = SocketAddrV4::new(cluster.public_addr(), PORT);
    let client = cluster.netns_path("client1");
    let mut conns = netns::run_in(&client, move || {
        (0..CLIENTS)
            .map(|i| {
                let mut s = TcpStream::connect_timeout(&addr.into(), Duration::from_secs(5))
                    .expect("connect");
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                echo(&mut s, format!("hello-{i:02}").as_bytes()).expect("the first exchange");
                s
            })
            .collect::<Vec<_>>()
    })
    .expect("the clients");
    runtime().block_on(async {
        let mut c3 = cluster.control("node3").await.unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        while group_view(&mut c3).await.handoffs_taken < CLIENTS as u64 {
            assert!(Instant::now() < until, "node3 took every connection");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut c2 = cluster.control("node2").await.unwrap();
        let v2 = group_view(&mut c2).await;
        assert_eq!(v2.role, "backup");
        assert_eq!(
            v2.connections.iter().filter(|c| c.node == "node3").count(),
            CLIENTS,
            "the backup knows who serves each connection: {v2:?}"
        );
    });

    // node2's own events: it must say it took over.
    let rt = runtime();
    let mut events = rt.block_on(async {
        let mut c2 = cluster.control("node2").await.unwrap();
        c2.watch_events(pb::WatchEventsRequest {
            this_node_only: true,
        })
        .await
        .expect("WatchEvents")
        .into_inner()
    });
    cluster.fail_node("node1").expect("node1 failing");
    let failed = Instant::now();
    // New connections: served again once node2 took over.
    let served_again = netns::run_in(&client, move || {
        loop {
            let attempt = TcpStream::connect_timeout(&addr.into(), Duration::from_millis(200))
                .and_then(|mut s| {
                    s.set_read_timeout(Some(Duration::from_millis(500)))?;
                    echo(&mut s, b"new")
                });
            if attempt.is_ok() {
                return failed.elapsed();
            }
            assert!(
                failed.elapsed() < Duration::from_secs(15),
                "no new connection served"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .expect("a new client");
    println!("new connections served again {served_again:?} after the contact node failed");
    // Every connection served elsewhere goes on: not one lost or reset.
    for (i, s) in conns.iter_mut().enumerate() {
        echo(s, format!("after-failover-{i:02}").as_bytes())
            .unwrap_or_else(|e| panic!("connection {i} after the failover: {e}"));
    }
    rt.block_on(async {
        let took_over = tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(ev) = events.message().await.expect("the event stream") {
                if let Some(pb::cluster_event::Event::Group(g)) = ev.event
                    && g.what == "contact"
                {
                    return g;
                }
            }
            panic!("the event stream ended");
        })
        .await
        .expect("a `contact` event from node2");
        assert!(
            took_over
                .detail
                .starts_with(&format!("{CLIENTS} connections")),
            "{took_over:?}"
        );
        let mut c2 = cluster.control("node2").await.unwrap();
        let v2 = group_view(&mut c2).await;
        let g = v2.group.clone().unwrap();
        assert_eq!((v2.role.as_str(), g.epoch), ("contact", 2), "{v2:?}");
        assert_eq!(g.members, ["node3", "node2"], "{g:?}");
        let mut c3 = cluster.control("node3").await.unwrap();
        let g3 = group_view(&mut c3).await.group.unwrap();
        assert_eq!((g3.contact.as_str(), g3.epoch), ("node2", 2));
    });
}

#[test]
fn the_contact_node_places_new_connections_round_robin() {
    let Some(cluster) = start("the_contact_node_places_new_connections_round_robin", 3) else {
        return;
    };
    let log = cluster.dir().join("handoffs.jsonl");
    runtime().block_on(async {
        let mut c = [
            cluster.control("node1").await.unwrap(),
            cluster.control("node2").await.unwrap(),
            cluster.control("node3").await.unwrap(),
        ];
        create_group(&mut c[0], "node1", &["node2", "node3"]).await;
        let size = SIZE.to_string();
        let log_arg = log.to_string_lossy().into_owned();
        group_server(
            &mut c[0],
            &[
                "--mode",
                "download",
                "--size",
                &size,
                "--handoff-after",
                "1000",
                "--to",
                "auto",
                "--log",
                &log_arg,
            ],
        )
        .await;
        for member in &mut c[1..] {
            group_server(member, &["--mode", "download", "--size", &size]).await;
        }
        for (i, node) in ["node1", "node2", "node3"].iter().enumerate() {
            wait_server(&mut c[i], node).await;
        }
    });
    for _ in 0..6 {
        assert_whole_download(&curl(&cluster));
    }
    let acceptors: Vec<String> = handoff_log(&log, 4)
        .iter()
        .map(|h| h["acceptor"].as_str().unwrap_or("-").to_owned())
        .collect();
    // node1, node2, node3, node1, ...: node1 serves its turns itself.
    assert_eq!(acceptors, ["node2", "node3", "node2", "node3"]);
    runtime().block_on(async {
        let mut c2 = cluster.control("node2").await.unwrap();
        assert_eq!(group_view(&mut c2).await.handoffs_taken, 2);
    });
}

/// `integration/c/group_echo.c` built against the handoff library's C ABI
/// (its header and the static library `cargo xtask test` builds beside
/// ferry's binaries), into `dir`.
fn build_c_server(dir: &Path) -> std::path::PathBuf {
    let bin_dir = ferry_integration::bin_path("ferryd")
        .parent()
        .expect("the binaries' directory")
        .to_owned();
    let lib = bin_dir.join("libferry_handoff.a");
    assert!(
        lib.is_file(),
        "{} is missing: `cargo build -p ferry-handoff` (cargo xtask test does)",
        lib.display()
    );
    let src = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = dir.join("group_echo");
    let status = Command::new("cc")
        .arg("-Wall")
        .arg("-Werror")
        .arg("-I")
        .arg(src.join("../handoff/include"))
        .arg(src.join("c/group_echo.c"))
        .arg(&lib)
        .args(["-lpthread", "-ldl", "-lm", "-o"])
        .arg(&out)
        .status()
        .expect("running cc");
    assert!(status.success(), "cc group_echo.c: {status}");
    out
}

#[test]
fn a_server_written_in_c_hands_connections_off_through_the_c_abi() {
    let Some(mut cluster) = start(
        "a_server_written_in_c_hands_connections_off_through_the_c_abi",
        3,
    ) else {
        return;
    };
    let server = build_c_server(cluster.dir());
    runtime().block_on(async {
        let mut c = [
            cluster.control("node1").await.unwrap(),
            cluster.control("node2").await.unwrap(),
            cluster.control("node3").await.unwrap(),
        ];
        create_group(&mut c[0], "node1", &["node2", "node3"]).await;
        for (i, node) in ["node1", "node2", "node3"].iter().enumerate() {
            run(
                &mut c[i],
                vec![server.to_string_lossy().into_owned(), PORT.to_string()],
            )
            .await;
            wait_server(&mut c[i], node).await;
        }
    });
    let addr = SocketAddrV4::new(cluster.public_addr(), PORT);
    let clients = move || {
        for i in 0..6 {
            let mut s =
                TcpStream::connect_timeout(&addr.into(), Duration::from_secs(5)).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            echo(&mut s, format!("hello {i}\n").as_bytes()).expect("the first line");
            // Placed by now: node1 keeps its turns, node2 and node3 echo
            // theirs after the handoff.
            for j in 0..3 {
                echo(&mut s, format!("line {j} of {i}\n").as_bytes()).expect("echoed after");
            }
        }
    };
    netns::run_in(&cluster.netns_path("client1"), clients).expect("the clients");
    let taken = |cluster: &Cluster| {
        runtime().block_on(async {
            let mut taken = Vec::new();
            for node in ["node1", "node2", "node3"] {
                let mut c = cluster.control(node).await.unwrap();
                taken.push(group_view(&mut c).await.handoffs_taken);
            }
            taken
        })
    };
    assert_eq!(
        taken(&cluster),
        [0, 2, 2],
        "handoffs taken by node1, node2, node3"
    );
    // node2's agent restarts: its C server, waiting in ferry_accept,
    // registers again with the new one and takes its turns as before.
    cluster.stop_agent("node2").expect("stopping node2's agent");
    cluster
        .start_agent("node2")
        .expect("starting node2's agent");
    runtime().block_on(async {
        let mut c2 = cluster.control("node2").await.unwrap();
        wait_server(&mut c2, "node2").await;
    });
    netns::run_in(&cluster.netns_path("client1"), clients).expect("the clients after");
    // node2's count started again with its agent.
    assert_eq!(
        taken(&cluster),
        [0, 2, 4],
        "handoffs taken after node2's agent restarted"
    );
}

#[test]
fn an_operator_hands_a_connection_off_without_its_server() {
    let Some(cluster) = start("an_operator_hands_a_connection_off_without_its_server", 2) else {
        return;
    };
    runtime().block_on(async {
        let (mut c1, mut c2) = (
            cluster.control("node1").await.unwrap(),
            cluster.control("node2").await.unwrap(),
        );
        create_group(&mut c1, "node1", &["node2"]).await;
        // Servers that never hand anything off themselves.
        group_server(&mut c1, &["--mode", "echo"]).await;
        group_server(&mut c2, &["--mode", "echo"]).await;
        wait_server(&mut c1, "node1").await;
        wait_server(&mut c2, "node2").await;
    });
    let addr = SocketAddrV4::new(cluster.public_addr(), PORT);
    let mut s = netns::run_in(&cluster.netns_path("client1"), move || {
        let mut s = TcpStream::connect_timeout(&addr.into(), Duration::from_secs(5)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        echo(&mut s, b"served by node1").unwrap();
        s
    })
    .expect("the client");
    let remote = s.local_addr().unwrap().to_string();
    runtime().block_on(async {
        let mut c1 = cluster.control("node1").await.unwrap();
        let handoff = |remote: &str, to: &str| pb::HandoffConnectionRequest {
            node: String::new(),
            connection: Some(pb::GroupConnection {
                remote: remote.into(),
                port: u32::from(PORT),
            }),
            to: to.into(),
            drain_ms: 0,
        };
        // Bad input first: the connection stays where it is.
        let e = c1
            .handoff_connection(handoff("198.18.0.11:1", "node2"))
            .await
            .expect_err("no such connection");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
        assert!(e.message().contains("no connection"), "{e}");
        let e = c1
            .handoff_connection(handoff(&remote, "node9"))
            .await
            .expect_err("node9 is not in the group");
        assert!(e.message().contains("node9 is not a member"), "{e}");
        let e = c1
            .handoff_connection(handoff("not an address", "node2"))
            .await
            .expect_err("a bad address");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
        assert!(e.message().contains("connection.remote"), "{e}");

        let r = c1
            .handoff_connection(handoff(&remote, "node2"))
            .await
            .expect("HandoffConnection")
            .into_inner();
        assert_eq!(r.acceptor, "node2");
        let mut c2 = cluster.control("node2").await.unwrap();
        assert_eq!(group_view(&mut c2).await.handoffs_taken, 1);
    });
    // The same connection, answered by node2's server now.
    echo(&mut s, b"served by node2 now").expect("after the operator's handoff");
    let more = pattern(0, 200_000);
    let mut w = s.try_clone().unwrap();
    let writer = std::thread::spawn(move || w.write_all(&more).unwrap());
    let mut back = vec![0; 200_000];
    s.read_exact(&mut back).unwrap();
    writer.join().unwrap();
    assert_eq!(back, pattern(0, 200_000));
}
