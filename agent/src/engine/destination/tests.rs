//! The destination's steps against the fixture's fakes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_ebpf::{CaptureKind, CapturedPacket, Protocol};
use ferry_proto::v1::{
    self as pb, AbortRequest, ArmRequest, CommitRequest, PrepareRequest, RestoreRequest,
};

use super::fixture::Fixture;
use super::*;
use crate::dataplane::capture::digest;
use crate::engine::{Engine, EngineError};
use crate::process::{PortKey, Transport};
use crate::sockstate::packed::FixedParts;

fn fixture() -> Fixture {
    Fixture::new(&[])
}

/// The source's Abort of migration `id`, which must succeed.
async fn abort_test_migration(engine: &Arc<Engine>, id: &str) {
    abort(
        engine,
        AbortRequest {
            migration_id: id.into(),
            reason: "test".into(),
        },
        None,
    )
    .await
    .unwrap();
}

fn prepare_req(id: &str, port: u32) -> PrepareRequest {
    PrepareRequest {
        protocol_version: ferry_proto::PEER_PROTOCOL_VERSION,
        migration_id: id.into(),
        source_node: "node1".into(),
        source_pid: 42,
        argv: vec!["server".into()],
        ports: vec![pb::Port {
            protocol: pb::Protocol::Tcp as i32,
            port,
        }],
        resident_bytes: 8 << 20,
        dumped_bytes: 6 << 20,
        strategy: pb::Strategy::TotalCopy as i32,
    }
}

/// A destination lacking what the strategy needs of it refuses at Prepare,
/// naming the feature and itself, before it reserves anything: also when
/// the source did not check (an older or foreign one). An unspecified
/// strategy (an older source) is not checked; an unknown one is refused.
#[tokio::test]
async fn a_destination_without_a_needed_feature_refuses_at_prepare() {
    let f = Fixture::with_config(r#"features_off = ["uffd_events"]"#);
    for strategy in [pb::Strategy::PostCopy, pb::Strategy::AssistedPostCopy] {
        let err = prepare(
            &f.engine,
            PrepareRequest {
                strategy: strategy as i32,
                ..prepare_req("aaaa", 7000)
            },
        )
        .await
        .unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
        let text = err.to_string();
        assert!(
            text.contains("uffd_events") && text.contains("node2"),
            "{text}"
        );
        assert!(f.filter.0.lock().unwrap().is_empty(), "ports touched");
        assert!(f.engine.incoming.lock().await.is_none(), "slot reserved");
    }
    let err = prepare(
        &f.engine,
        PrepareRequest {
            strategy: 99,
            ..prepare_req("aaaa", 7000)
        },
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("strategy"), "{err}");
    for strategy in [pb::Strategy::Unspecified, pb::Strategy::PreCopy] {
        let id = format!("ok{}", strategy as i32);
        prepare(
            &f.engine,
            PrepareRequest {
                strategy: strategy as i32,
                ..prepare_req(&id, 7000)
            },
        )
        .await
        .unwrap();
        abort_test_migration(&f.engine, &id).await;
    }
}

#[tokio::test]
async fn a_process_larger_than_the_node_can_hold_is_refused_before_anything_is_reserved() {
    let f = fixture();
    let huge = PrepareRequest {
        resident_bytes: 1 << 60,
        ..prepare_req("aaaa", 7000)
    };
    let err = prepare(&f.engine, huge).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
    assert!(
        err.to_string()
            .contains("1099511627776.0 MiB for the process"),
        "{err}"
    );
    assert!(f.filter.0.lock().unwrap().is_empty(), "ports touched");
    assert!(!f.engine.config.work_dir.join("incoming/aaaa").exists());
    // Nothing held: the next Prepare gets the slot.
    prepare(&f.engine, prepare_req("bbbb", 7000)).await.unwrap();
    abort_test_migration(&f.engine, "bbbb").await;
}

#[tokio::test]
async fn one_incoming_migration_at_a_time_with_its_ports_frozen() {
    let f = fixture();
    prepare(&f.engine, prepare_req("aaaa", 7000)).await.unwrap();
    assert_eq!(*f.filter.0.lock().unwrap(), vec!["set 7000/tcp Frozen"]);
    let err = prepare(&f.engine, prepare_req("bbbb", 7001))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
    assert!(err.to_string().contains("aaaa"), "{err}");
    let dir = f.engine.config.work_dir.join("incoming/aaaa");
    assert!(dir.is_dir());

    abort_test_migration(&f.engine, "aaaa").await;
    assert!(!dir.exists(), "images directory left behind");
    assert_eq!(
        f.filter.0.lock().unwrap().last().unwrap(),
        "remove 7000/tcp"
    );
    // Idempotent, and the slot is free again.
    abort(
        &f.engine,
        AbortRequest {
            migration_id: "aaaa".into(),
            reason: "again".into(),
        },
        None,
    )
    .await
    .unwrap();
    prepare(&f.engine, prepare_req("bbbb", 7001)).await.unwrap();
}

/// A Prepare that comes after its source gave the migration up (the
/// Abort overtook it: slow, or held on a cut link) reserves nothing.
#[tokio::test]
async fn a_prepare_its_abort_overtook_reserves_nothing() {
    let f = fixture();
    abort_test_migration(&f.engine, "aaaa").await;
    let err = prepare(&f.engine, prepare_req("aaaa", 7000))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, EngineError::GivenUp { migration_id, .. } if migration_id == "aaaa"),
        "{err:?}"
    );
    assert_eq!(err.code(), tonic::Code::Aborted);
    assert!(f.engine.incoming.lock().await.is_none());
    // The node is free for the next migration, on the same port.
    prepare(&f.engine, prepare_req("bbbb", 7000)).await.unwrap();
}

#[tokio::test]
async fn steps_out_of_order_are_refused() {
    let f = fixture();
    let err = restore(
        &f.engine,
        RestoreRequest {
            migration_id: "nope".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
    prepare(&f.engine, prepare_req("aaaa", 7000)).await.unwrap();
    let err = restore(
        &f.engine,
        RestoreRequest {
            migration_id: "aaaa".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    assert!(err.to_string().contains("reserved"), "{err}");
    let err = commit(
        &f.engine,
        CommitRequest {
            migration_id: "aaaa".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
}

#[tokio::test]
async fn bad_prepare_requests_name_the_field() {
    let f = fixture();
    let mut r = prepare_req("aaaa", 7000);
    r.protocol_version = 99;
    let err = prepare(&f.engine, r).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    let err = prepare(&f.engine, prepare_req("../etc", 7000))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("migration_id"), "{err}");
    let err = prepare(&f.engine, prepare_req("aaaa", 70000))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("ports"), "{err}");
    // None of these reserved anything.
    assert!(f.engine.incoming.lock().await.is_none());
    assert!(f.filter.0.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_port_owned_here_is_not_taken_by_an_incoming_process() {
    let f = fixture();
    let port = PortKey {
        transport: Transport::Tcp,
        port: 7000,
    };
    f.adopt_local(4242, &[port]);
    // No peer owns it (none answers here): owned.
    f.engine.ports.check_claims(vec![port]).await;
    f.engine.ports.apply().await.unwrap();
    assert_eq!(f.engine.ports.owned(), [port].into());
    let err = prepare(&f.engine, prepare_req("aaaa", 7000))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    assert!(err.to_string().contains("4242"), "{err}");
}

fn captured(port: u16, data: &[u8]) -> CapturedPacket {
    CapturedPacket {
        kind: CaptureKind::Captured,
        protocol: Protocol::Tcp,
        port,
        // Taken after any session of the test opened.
        ktime_ns: u64::MAX,
        data: data.to_vec(),
    }
}

/// Arm's connections (protocol 7): a bad entry is refused with the
/// entry and field named, before anything is armed; good ones come back
/// to be opened, but those on the source's cluster address, which the
/// rebuild moves to this node's, are left out.
#[tokio::test]
async fn arm_checks_the_connections_it_names_and_leaves_the_in_cluster_ones_out() {
    let f = Fixture::new(&[("node1", "198.19.0.1"), ("node3", "198.19.0.3")]);
    prepare(&f.engine, prepare_req("aaaa", 7000)).await.unwrap();
    let conn = |inode: u64, local: &str, remote: &str| pb::StagedConnection {
        inode,
        local: local.into(),
        remote: remote.into(),
        fixed: None,
        sndbuf: 0,
    };
    let with_fixed = |c: pb::StagedConnection, f: pb::TcpConnectionFixed| pb::StagedConnection {
        fixed: Some(f),
        ..c
    };
    let good = conn(11, "198.18.0.100:7000", "198.18.1.2:40000");
    let arm_with = |connections: Vec<pb::StagedConnection>| ArmRequest {
        migration_id: "aaaa".into(),
        ports: vec![pb::Port {
            protocol: pb::Protocol::Tcp as i32,
            port: 7000,
        }],
        connections,
    };
    for (bad, names) in [
        (conn(12, "198.18.0.100", "198.18.1.2:1"), "[1].local"),
        (conn(12, "198.18.0.100:7000", "[::1]:1"), "[1].remote"),
        (conn(0, "198.18.0.100:7000", "198.18.1.2:1"), "[1].inode"),
        (conn(11, "198.18.0.100:7000", "198.18.1.2:1"), "[1].inode"),
        (
            with_fixed(
                conn(12, "198.18.0.100:7000", "198.18.1.2:1"),
                pb::TcpConnectionFixed {
                    send_wscale: 15,
                    ..Default::default()
                },
            ),
            "[1].fixed.send_wscale",
        ),
        (
            with_fixed(
                conn(12, "198.18.0.100:7000", "198.18.1.2:1"),
                pb::TcpConnectionFixed {
                    options: 0x80,
                    ..Default::default()
                },
            ),
            "[1].fixed.options",
        ),
    ] {
        let err = arm(&f.engine, arm_with(vec![good.clone(), bad]))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
        assert!(
            err.to_string()
                .starts_with(&format!("connections: {names}")),
            "{err}"
        );
    }
    assert!(
        !f.filter
            .0
            .lock()
            .unwrap()
            .iter()
            .any(|r| r.contains("Capturing")),
        "a refused Arm armed a capture"
    );
    let in_cluster = conn(13, "198.19.0.1:5000", "198.19.0.3:5432");
    let staging = arm(&f.engine, arm_with(vec![good, in_cluster]))
        .await
        .unwrap();
    assert_eq!(
        staging.conns,
        vec![crate::sockstate::ToStage {
            inode: 11,
            local: "198.18.0.100:7000".parse().unwrap(),
            remote: "198.18.1.2:40000".parse().unwrap(),
            sndbuf: 0,
        }]
    );
    // What the agent points TransferSockets at: the slot's place.
    let pointed = || f.engine.incoming.staged_for("aaaa");
    assert!(Arc::ptr_eq(&staging.into, &pointed().unwrap()));
    // The slot's end drops what was opened for it.
    drop(staging);
    abort_test_migration(&f.engine, "aaaa").await;
    assert!(take_staged(&f.engine, "aaaa").is_none());
    assert!(
        pointed().is_none(),
        "the aborted slot's place for staged sockets outlived it"
    );
}

/// Protocol 9: TransferSockets' packed records are joined with the
/// fixed parts Arm carried, the in-cluster ones (which Arm opens no
/// socket for) moved to this node's address like whole ones; a record
/// for a connection Arm did not describe, or one also sent whole, is
/// refused with the field named.
#[tokio::test]
async fn packed_connections_join_what_arm_carried() {
    use crate::sockstate::packed::{Fixed, pack};
    let f = Fixture::new(&[("node1", "198.19.0.1"), ("node3", "198.19.0.3")]);
    prepare(&f.engine, prepare_req("aaaa", 7000)).await.unwrap();
    let state = |inode: u64, local: &str, remote: &str| crate::sockstate::TcpConnectionState {
        inode,
        local: local.parse().unwrap(),
        remote: remote.parse().unwrap(),
        send_seq: 1000 + inode as u32,
        recv_seq: 2000,
        send_queue: b"queued".to_vec(),
        unsent: 2,
        recv_queue: Vec::new(),
        mss_clamp: 1460,
        options: 0,
        send_wscale: 0,
        recv_wscale: 0,
        timestamp: 0,
        window: Default::default(),
        reuseaddr: true,
        sndbuf: 4096,
        socket_options: Some(pb::TcpSocketOptions {
            rcvbuf: 8192,
            ..Default::default()
        }),
    };
    let states = vec![
        state(11, "198.18.0.100:7000", "198.18.1.2:40000"),
        state(13, "198.19.0.1:5000", "198.19.0.3:5432"),
    ];
    let fixed: FixedParts = states.iter().map(|c| (c.inode, Fixed::of(c))).collect();
    let staging = arm(
        &f.engine,
        ArmRequest {
            migration_id: "aaaa".into(),
            ports: vec![pb::Port {
                protocol: pb::Protocol::Tcp as i32,
                port: 7000,
            }],
            connections: states
                .iter()
                .map(|c| pb::StagedConnection {
                    inode: c.inode,
                    local: c.local.to_string(),
                    remote: c.remote.to_string(),
                    fixed: Some(fixed[&c.inode].to_pb()),
                    sndbuf: c.sndbuf,
                })
                .collect(),
        },
    )
    .await
    .unwrap();
    assert_eq!(staging.conns.len(), 1, "no socket for the in-cluster one");
    let (packed, whole) = pack(&states, &fixed);
    assert!(whole.is_empty());
    let request = |packed: &crate::sockstate::packed::Packed| pb::TransferSocketsRequest {
        migration_id: "aaaa".into(),
        source_node: "node1".into(),
        tcp_connections: Vec::new(),
        packed: packed.records.clone(),
        packed_queues: packed.queues.clone(),
    };
    let (got, in_cluster) = sockets_to_rebuild(&f.engine, &mut request(&packed)).unwrap();
    let mut want = states.clone();
    want[1].local = "198.19.0.2:5000".parse().unwrap();
    assert_eq!(got, want);
    assert_eq!(in_cluster.len(), 1);
    assert_eq!(in_cluster[0].new_local.to_string(), "198.19.0.2:5000");

    // Sent twice: packed and whole.
    let mut twice = request(&packed);
    twice.tcp_connections = vec![states[0].to_pb()];
    let err = sockets_to_rebuild(&f.engine, &mut twice).unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("tcp_connections"), "{err}");
    assert!(
        err.to_string().contains("[0].inode: 11 is in packed too"),
        "{err}"
    );

    // One connection in two records.
    let (doubled, _) = pack(&[states[0].clone(), states[0].clone()], &fixed);
    let err = sockets_to_rebuild(&f.engine, &mut request(&doubled)).unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("packed"), "{err}");
    assert!(err.to_string().contains("in two records"), "{err}");

    // A record for a connection Arm did not describe.
    let mut unknown = states[0].clone();
    unknown.inode = 99;
    let mut more = fixed.clone();
    more.insert(99, fixed[&11].clone());
    let (stray, _) = pack(std::slice::from_ref(&unknown), &more);
    let err = sockets_to_rebuild(&f.engine, &mut request(&stray)).unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert!(
        err.to_string()
            .contains("packed[0].inode: 99 was not named"),
        "{err}"
    );
    drop(staging);
    abort_test_migration(&f.engine, "aaaa").await;
}

#[tokio::test]
async fn arm_captures_every_port_in_one_call_and_abort_drops_the_capture() {
    let f = fixture();
    prepare(&f.engine, prepare_req("aaaa", 7000)).await.unwrap();
    f.filter.0.lock().unwrap().clear();
    // Ports opened since Prepare are armed too.
    arm(
        &f.engine,
        ArmRequest {
            migration_id: "aaaa".into(),
            ports: vec![
                pb::Port {
                    protocol: pb::Protocol::Tcp as i32,
                    port: 7000,
                },
                pb::Port {
                    protocol: pb::Protocol::Udp as i32,
                    port: 7001,
                },
            ],
            connections: vec![],
        },
    )
    .await
    .unwrap();
    assert_eq!(
        *f.filter.0.lock().unwrap(),
        vec!["set 7000/tcp Capturing", "set 7001/udp Capturing"]
    );
    // Arm twice, or out of order, is refused.
    let err = arm(
        &f.engine,
        ArmRequest {
            migration_id: "bbbb".into(),
            ports: vec![],
            connections: vec![],
        },
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");

    f.filter.1.lock().unwrap().push(captured(7000, b"kept"));
    abort_test_migration(&f.engine, "aaaa").await;
    let calls = f.filter.0.lock().unwrap().clone();
    assert!(
        calls.ends_with(&["remove 7000/tcp".into(), "remove 7001/udp".into()]),
        "{calls:?}"
    );
    f.engine.dataplane.collect_captured();
    assert!(f.engine.dataplane.capture.take_captured("aaaa").is_empty());
    assert!(
        f.replayed.0.lock().unwrap().is_empty(),
        "nothing replayed on abort"
    );
}

const TCP_7000: PortKey = PortKey {
    transport: Transport::Tcp,
    port: 7000,
};

/// The destination drains the ring in the background while it
/// captures, and the commit drains too: whoever drains, packets reach
/// their session in ring order, and the background collection alone takes
/// everything in.
#[test]
fn packets_collected_in_the_background_keep_their_order() {
    const PACKETS: usize = 20_000;
    let f = fixture();
    f.engine.dataplane.capture.open("m", [TCP_7000]);
    f.engine.dataplane.collect_while_capturing("m");
    let ring = f.filter.1.clone();
    let producer = std::thread::spawn(move || {
        for chunk in (0..PACKETS).collect::<Vec<_>>().chunks(7) {
            let mut r = ring.lock().unwrap();
            r.extend(chunk.iter().map(|i| captured(7000, &i.to_le_bytes())));
        }
    });
    // Foreground drains race the background thread meanwhile.
    while !producer.is_finished() {
        f.engine.dataplane.collect_captured();
    }
    producer.join().unwrap();
    // Until the session has them all: an empty ring is not enough, as the
    // background thread may hold a batch it took and has not filed yet.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got: Vec<usize> = Vec::with_capacity(PACKETS);
    while got.len() < PACKETS {
        assert!(
            Instant::now() < deadline,
            "the background collection stopped at {} packets",
            got.len()
        );
        got.extend(
            f.engine
                .dataplane
                .capture
                .take_captured("m")
                .iter()
                .map(|p| usize::from_le_bytes(p.data.as_slice().try_into().unwrap())),
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(got.len(), PACKETS);
    assert!(
        got.windows(2).all(|w| w[0] + 1 == w[1]),
        "packets out of ring order"
    );
    f.engine.dataplane.capture.close("m");
}

/// A batch large enough to be replayed on several threads: every
/// segment once, each connection's in its order.
#[test]
fn a_large_replay_keeps_each_connections_order() {
    const CONNECTIONS: u16 = 300;
    const EACH: u32 = 4;
    let f = fixture();
    f.engine.dataplane.capture.open("m", [TCP_7000]);
    {
        let mut ring = f.filter.1.lock().unwrap();
        for ack in 0..EACH {
            for c in 0..CONNECTIONS {
                ring.push(captured(
                    7000,
                    &crate::dataplane::capture::tests::tcp_ack(20_000 + c, ack),
                ));
            }
        }
    }
    let stats = f
        .engine
        .dataplane
        .replay_and_open("m", &[], &[], &[], || Ok::<(), EngineError>(()))
        .unwrap();
    let total = u64::from(CONNECTIONS) * u64::from(EACH);
    assert_eq!(
        (stats.replayed, stats.replayed_segments, stats.failed),
        (total, total, 0)
    );
    let replayed = f.replayed.0.lock().unwrap();
    assert_eq!(replayed.len() as u64, total);
    let mut next = std::collections::HashMap::new();
    for p in replayed.iter() {
        let conn = u16::from_be_bytes([p[20], p[21]]);
        let ack = u32::from_be_bytes([p[28], p[29], p[30], p[31]]);
        let want = next.entry(conn).or_insert(0u32);
        assert_eq!(ack, *want, "connection {conn} out of order");
        *want += 1;
    }
    assert!(next.values().all(|&n| n == EACH));
}

/// And the datagrams the source's sockets held unread come first.
#[test]
fn replay_skips_what_the_source_delivered_and_opens_between_batches() {
    let f = fixture();
    f.engine.dataplane.capture.open("m", [TCP_7000]);
    f.filter.1.lock().unwrap().extend([
        captured(7000, b"p1"),
        captured(7000, b"p2"),
        captured(7000, b"p3"),
        captured(9999, b"not ours"),
    ]);
    // The source delivered p0..p2 after the destination armed at p1.
    let delivered = [digest(b"p0"), digest(b"p1"), digest(b"p2")];
    let ring = f.filter.1.clone();
    let replayed = f.replayed.clone();
    let carried = [b"q0".to_vec(), b"q1".to_vec()];
    let stats = f
        .engine
        .dataplane
        .replay_and_open("m", &carried, &delivered, &[], || {
            // By the time the ports open, the backlog is replayed; a
            // packet that arrives now is replayed after it.
            assert_eq!(replayed.0.lock().unwrap().len(), 3);
            ring.lock().unwrap().push(captured(7000, b"p4"));
            Ok::<(), EngineError>(())
        })
        .unwrap();
    assert_eq!(
        *f.replayed.0.lock().unwrap(),
        vec![
            b"q0".to_vec(),
            b"q1".to_vec(),
            b"p3".to_vec(),
            b"p4".to_vec()
        ]
    );
    assert_eq!(stats.carried, 2);
    assert_eq!(stats.captured, 4);
    assert_eq!(stats.skipped_delivered, 2);
    assert_eq!(stats.replayed, 2);
    assert_eq!(stats.failed, 0);
    // The session is closed: later packets for the port are strays.
    assert_eq!(
        f.engine
            .dataplane
            .capture
            .route(vec![captured(7000, b"late")]),
        1
    );
}

/// The table in the module's documentation and [`IncomingState`]'s guards
/// say the same, for every step and state.
#[test]
fn steps_and_the_table_agree() {
    let states = [
        ("Reserved", IncomingState::Reserved),
        ("Received", IncomingState::Received),
        ("Restored", IncomingState::Restored { pid: 7 }),
    ];
    let doc = include_str!("mod.rs");
    let rows: Vec<Vec<&str>> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("//! | "))
        .filter(|l| !l.starts_with("step |") && !l.starts_with("---"))
        .map(|l| l.trim_end_matches(" |").split(" | ").collect())
        .collect();
    let mut seen = Vec::new();
    for row in rows {
        let [name, file, accepted, leaves] = row[..] else {
            panic!("a row of four columns: {row:?}");
        };
        let file = file.trim_matches('`');
        assert!(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("src/engine/destination")
                .join(file)
                .exists(),
            "{name}: {file} is not a file of the module"
        );
        let Some(step) = Step::ALL.into_iter().find(|s| s.as_str() == name) else {
            // Prepare takes an empty slot: no state to guard.
            assert_eq!((name, accepted, leaves), ("Prepare", "-", "Reserved"));
            continue;
        };
        seen.push(step);
        let said: Vec<&str> = accepted.split(", ").collect();
        for (state_name, state) in &states {
            assert_eq!(
                said.contains(state_name),
                state.accepts(step),
                "{name} in {state_name}"
            );
            if !state.accepts(step) {
                continue;
            }
            let after = state.after(step, 7);
            let want = match leaves {
                "-" => None,
                "unchanged" => Some(*state),
                other => states.iter().find(|(n, _)| *n == other).map(|(_, s)| *s),
            };
            assert_eq!(after, want, "{name} from {state_name}");
        }
    }
    assert_eq!(seen, Step::ALL, "one row per step, in order");
}

#[tokio::test]
async fn an_abort_of_a_migration_committed_here_says_so_and_undoes_nothing() {
    use crate::engine::journal::{IncomingStage, Record};
    let f = fixture();
    let committed = |id: &str| Record::Incoming {
        migration_id: id.into(),
        pid: 4321,
        start_ticks: 1,
        argv: vec!["server".into()],
        from: "node1".into(),
        stage: IncomingStage::Committed,
    };
    f.engine.journal.write(&committed("c1")).unwrap();
    let ask = |id: &str| AbortRequest {
        migration_id: id.into(),
        reason: "the source did not hear the Commit's answer".into(),
    };
    // Its source learns that it committed; the record stays, for the
    // next time it asks.
    assert!(abort(&f.engine, ask("c1"), Some("node1")).await.unwrap());
    assert!(abort(&f.engine, ask("c1"), None).await.unwrap());
    assert_eq!(
        f.engine.journal.incoming("c1").unwrap(),
        Some(committed("c1"))
    );
    // Another node is not told, and learns nothing.
    let e = abort(&f.engine, ask("c1"), Some("node3"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    // A migration never seen, or one restored and never resumed, was not
    // committed.
    assert!(!abort(&f.engine, ask("never"), Some("node1")).await.unwrap());
    // A record that cannot be read is no answer: "not committed" could
    // run the process twice.
    std::fs::write(f.engine.journal.dir().join("in-bad.json"), b"{").unwrap();
    let e = abort(&f.engine, ask("bad"), None).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Internal, "{e}");
}
