//! The inputs the fuzzer starts from, one function per target, and the
//! inputs of bugs found and fixed.

use std::net::{Ipv4Addr, SocketAddrV4};

use ferry_proto::v1 as pb;
use prost::Message;

use super::field;
use super::peer_protocol::{STEPS, Step};

/// A protobuf message built field by field (for seeds of CRIU images,
/// whose messages ferry does not generate code for).
#[derive(Default)]
struct Pb(Vec<u8>);

impl Pb {
    fn varint(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push(v as u8 | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    fn uint(mut self, field: u64, v: u64) -> Self {
        Self::varint(field << 3, &mut self.0);
        Self::varint(v, &mut self.0);
        self
    }

    fn bytes(mut self, field: u64, b: &[u8]) -> Self {
        Self::varint(field << 3 | 2, &mut self.0);
        Self::varint(b.len() as u64, &mut self.0);
        self.0.extend_from_slice(b);
        self
    }
}

/// A CRIU image: the common magic, the image's magic, sized entries.
fn criu_image_file(magic: u32, entries: &[Vec<u8>]) -> Vec<u8> {
    let mut b = 0x5456_4319u32.to_ne_bytes().to_vec();
    b.extend(magic.to_ne_bytes());
    for e in entries {
        b.extend((e.len() as u32).to_ne_bytes());
        b.extend(e);
    }
    b
}

/// An established TCP socket's `inet_sk_entry` (sk-inet.proto).
fn inet_sk(id: u64, local: SocketAddrV4, remote: SocketAddrV4) -> Vec<u8> {
    let word = |ip: Ipv4Addr| u64::from(u32::from_ne_bytes(ip.octets()));
    Pb::default()
        .uint(1, id)
        .uint(2, id + 0x1000)
        .uint(3, 2)
        .uint(4, 1)
        .uint(5, 6)
        .uint(6, 1)
        .uint(7, u64::from(local.port()))
        .uint(8, u64::from(remote.port()))
        .uint(9, 2)
        .uint(10, 0)
        .uint(11, word(*local.ip()))
        .uint(12, word(*remote.ip()))
        .bytes(13, &Pb::default().uint(1, 0).uint(2, 0).uint(3, 0).0)
        .bytes(14, &Pb::default().uint(1, 212_992).uint(2, 131_072).0)
        .0
}

/// `files.img` with one in-cluster connection (node1 to node3) and one
/// to a client.
fn files_img() -> Vec<u8> {
    let sa = |s: &str| s.parse::<SocketAddrV4>().unwrap();
    let file = |id: u64, isk: Vec<u8>| Pb::default().uint(1, 4).uint(2, id).bytes(4, &isk).0;
    criu_image_file(
        0x5630_3138,
        &[
            file(7, inet_sk(7, sa("198.19.0.1:5000"), sa("198.19.0.3:6000"))),
            file(
                8,
                inet_sk(8, sa("198.18.0.100:7000"), sa("198.18.1.9:40000")),
            ),
        ],
    )
}

/// A pagemap: head (pages_id 0), then runs (vaddr, nr_pages, flags).
fn pagemap_img(runs: &[(u64, u64, u64)]) -> Vec<u8> {
    let mut entries = vec![Pb::default().uint(1, 0).0];
    for &(vaddr, nr, flags) in runs {
        entries.push(Pb::default().uint(1, vaddr).uint(2, nr).uint(4, flags).0);
    }
    criu_image_file(0x5600_4227, &entries)
}

fn delimited<M: Message>(messages: &[M]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in messages {
        m.encode_length_delimited(&mut out).unwrap();
    }
    out
}

/// One peer step for [`peer_protocol`](super::peer_protocol())'s seeds.
fn step(step: Step, fix: u8, msg: &[u8]) -> Vec<u8> {
    let i = STEPS.iter().position(|s| *s == step).unwrap() as u8;
    let mut out = vec![i, fix];
    out.extend(field(msg));
    out
}

/// Inputs that reach deep into each target, to start the fuzzer from
/// (`cargo test -p ferry-agent --features fuzzing write_fuzz_seeds --
/// --ignored` writes them into `fuzz/corpus/`).
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let by_target = [
        ("control_request", control_request_seeds()),
        ("peer_protocol", peer_protocol_seeds()),
        ("local_pages", local_pages_seeds()),
        ("membership", membership_seeds()),
        ("criu_image", criu_image_seeds()),
        ("config", config_seeds()),
    ];
    by_target
        .into_iter()
        .flat_map(|(target, inputs)| inputs.into_iter().map(move |input| (target, input)))
        .collect()
}

/// Control: a SetBalancer that passes, and one of each request.
fn control_request_seeds() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let set = pb::SetBalancerRequest {
        enabled: Some(true),
        settings: vec![
            pb::PolicySetting {
                key: "transfer.threshold".into(),
                value: "0.5".into(),
            },
            pb::PolicySetting {
                key: "policy.information.kind".into(),
                value: "\"hearsay\"".into(),
            },
        ],
        ..Default::default()
    };
    out.push([&[7u8][..], &set.encode_to_vec()].concat());
    let migrate = pb::MigrateRequest {
        pid: 42,
        destination_node: "node2".into(),
        strategy: 2,
        downtime_budget_ms: 50,
        ..Default::default()
    };
    out.push([&[3u8][..], &migrate.encode_to_vec()].concat());
    for which in [0u8, 1, 2, 4, 5, 6, 8, 9] {
        out.push(vec![which]);
    }
    out
}

/// The `Fix` byte of the peer seeds' steps: id "m1", source "node1",
/// version 6 (bits 5-7 index 4).
const FIX: u8 = 0x01 | 0x04 | 0x10 | (4 << 5);

fn port(protocol: pb::Protocol, port: u32) -> pb::Port {
    pb::Port {
        protocol: protocol as i32,
        port,
    }
}

/// Peer protocol: a total copy, a post-copy and the steps outside a
/// migration.
fn peer_protocol_seeds() -> Vec<Vec<u8>> {
    vec![total_copy_steps(), post_copy_steps(), other_peer_steps()]
}

/// The Prepare of migration "m1" from node1, for TCP port 7000.
fn prepare_m1() -> Vec<u8> {
    pb::PrepareRequest {
        migration_id: "m1".into(),
        source_node: "node1".into(),
        protocol_version: 6,
        source_pid: 42,
        argv: vec!["server".into()],
        ports: vec![port(pb::Protocol::Tcp, 7000)],
        ..Default::default()
    }
    .encode_to_vec()
}

/// One page pre-copied for "m1".
fn pages_m1() -> Vec<u8> {
    let page = crate::memtrack::page_size();
    delimited(&[pb::PageBatch {
        migration_id: "m1".into(),
        round: 1,
        runs: vec![pb::PageRun {
            pid: 1,
            vaddr: 0x40_0000,
            data: vec![0xa5; page as usize].into(),
            ..Default::default()
        }],
    }])
}

/// The images of "m1": `files.img` and a pagemap in one chunk, then the
/// page stored by [`pages_m1`].
fn images_m1() -> Vec<u8> {
    let page = crate::memtrack::page_size();
    delimited(&[
        pb::ImageChunk {
            migration_id: "m1".into(),
            file_name: "files.img".into(),
            data: files_img(),
            more: vec![pb::ImagePiece {
                file_name: "pagemap-1.img".into(),
                data: pagemap_img(&[(0x40_0000, 1, 4)]),
                ..Default::default()
            }],
            ..Default::default()
        },
        pb::ImageChunk {
            migration_id: "m1".into(),
            file_name: "pages-0.img".into(),
            stored: Some(pb::StoredPages {
                pid: 1,
                vaddr: 0x40_0000,
                length: page,
            }),
            ..Default::default()
        },
    ])
}

/// A total copy with an in-cluster connection up to the restore (which the
/// fake CRIU fails), then the abort, and a new Prepare.
fn total_copy_steps() -> Vec<u8> {
    let prepare = prepare_m1();
    let arm = pb::ArmRequest {
        migration_id: "m1".into(),
        ports: vec![port(pb::Protocol::Tcp, 7000), port(pb::Protocol::Udp, 7001)],
        connections: vec![pb::StagedConnection {
            inode: 4242,
            local: "198.18.0.100:7000".into(),
            remote: "198.18.1.2:40000".into(),
            fixed: Some(pb::TcpConnectionFixed {
                options: 7,
                send_wscale: 7,
                recv_wscale: 7,
                reuseaddr: false,
                socket_options: Some(Default::default()),
            }),
            sndbuf: 87_040,
        }],
    }
    .encode_to_vec();
    let restore = pb::RestoreRequest {
        migration_id: "m1".into(),
        ..Default::default()
    }
    .encode_to_vec();
    let abort = pb::AbortRequest {
        migration_id: "m1".into(),
        reason: "seed".into(),
    }
    .encode_to_vec();
    [
        step(Step::Prepare, FIX, &prepare),
        step(Step::Arm, FIX, &arm),
        step(Step::TransferPages, FIX, &pages_m1()),
        step(Step::TransferImages, FIX, &images_m1()),
        step(Step::Restore, FIX, &restore),
        step(Step::Commit, FIX, &[]),
        step(Step::Abort, FIX, &abort),
        step(Step::Prepare, FIX, &prepare),
    ]
    .concat()
}

/// A post-copy: pages, connections and the tunnel, then a lazy Restore
/// and a PostCopyStatus.
fn post_copy_steps() -> Vec<u8> {
    let page = crate::memtrack::page_size();
    let lazy = pb::RestoreRequest {
        migration_id: "m1".into(),
        lazy_pages: true,
        local_pages: vec![pb::StoredPages {
            pid: 1,
            vaddr: 0x40_0000,
            length: page,
        }],
        ..Default::default()
    }
    .encode_to_vec();
    let tunnel = delimited(&[pb::TunnelBytes {
        migration_id: String::new(),
        data: vec![0; 36],
    }]);
    let sockets = pb::TransferSocketsRequest {
        migration_id: "m1".into(),
        source_node: "node1".into(),
        tcp_connections: vec![pb::TcpConnectionState {
            inode: 7,
            local: "198.19.0.1:5000".into(),
            remote: "198.19.0.3:6000".into(),
            mss_clamp: 1460,
            window: Some(Default::default()),
            ..Default::default()
        }],
        // The connection Arm named, packed (protocol 9), with a byte in
        // each queue.
        packed: [
            &4242u64.to_le_bytes()[..],
            &[1u32, 2, 1, 0, 1, 1460, 0, 0, 0, 0, 0, 0, 0, 0, 0]
                .map(u32::to_le_bytes)
                .concat(),
        ]
        .concat(),
        packed_queues: vec![b's', b'r'],
    }
    .encode_to_vec();
    [
        step(Step::Prepare, FIX, &prepare_m1()),
        step(Step::TransferPages, FIX, &pages_m1()),
        step(Step::TransferSockets, FIX, &sockets),
        step(Step::PageTunnel, FIX, &tunnel),
        step(Step::TransferImages, FIX, &images_m1()),
        step(Step::Restore, FIX, &lazy),
        step(Step::PostCopyStatus, FIX, &[]),
    ]
    .concat()
}

/// Hello, PortOwnership and the in-cluster translations.
fn other_peer_steps() -> Vec<u8> {
    let translations = pb::TranslationsRequest {
        migration_id: "m9".into(),
        flows: vec![pb::InClusterFlow {
            protocol: pb::Protocol::Tcp as i32,
            old_local: "198.19.0.1:5000".into(),
            new_local: "198.19.0.3:5000".into(),
            remote: "198.19.0.2:6000".into(),
        }],
    }
    .encode_to_vec();
    let hello = pb::HelloRequest {
        node: "node1".into(),
        protocol_versions: vec![2, 5, 6, 7],
    }
    .encode_to_vec();
    let owned = pb::PortOwnershipRequest {
        ports: vec![port(pb::Protocol::Tcp, 7000)],
    }
    .encode_to_vec();
    [
        step(Step::Hello, 0, &hello),
        step(Step::Prepare, FIX, &prepare_m1()),
        step(Step::PortOwnership, 0, &owned),
        step(Step::AddTranslations, 0, &translations),
        step(Step::RemoveTranslations, 0, &translations),
    ]
    .concat()
}

/// Local pages: one page held here, one asked of the source; a close.
fn local_pages_seeds() -> Vec<Vec<u8>> {
    let page = crate::memtrack::page_size();
    let get = |vaddr: u64, nr: u64, cmd: u32| {
        let mut b = vec![0u8; 32];
        b[0..4].copy_from_slice(&cmd.to_ne_bytes());
        b[8..16].copy_from_slice(&nr.to_ne_bytes());
        b[16..24].copy_from_slice(&vaddr.to_ne_bytes());
        b[24..32].copy_from_slice(&1u64.to_ne_bytes());
        b
    };
    let batch = pb::PageBatch {
        migration_id: "m1".into(),
        round: 1,
        runs: vec![pb::PageRun {
            pid: 1,
            vaddr: 0x40_0000,
            data: vec![0x5a; 16].into(),
            ..Default::default()
        }],
    };
    let held = pb::RestoreRequest {
        local_pages: vec![pb::StoredPages {
            pid: 1,
            vaddr: 0x40_0000,
            length: page,
        }],
        ..Default::default()
    };
    let requests = [
        get(0x40_0000, 2, 7),
        get(0x40_0000 + page, 1, 7),
        get(0, 0, 0x1023),
    ]
    .concat();
    let mut answer = get(0x40_0000 + page, 1, 4 << 16 | 6);
    answer.extend(vec![0x11; 64]);
    let answers = delimited(&[
        pb::TunnelBytes {
            migration_id: String::new(),
            data: answer,
        },
        pb::TunnelBytes {
            migration_id: String::new(),
            data: vec![0; 4],
        },
    ]);
    vec![
        [
            field(&batch.encode_to_vec()),
            field(&held.encode_to_vec()),
            field(&requests),
            answers,
        ]
        .concat(),
    ]
}

/// Membership: a beacon, two load broadcasts, a datagram.
fn membership_seeds() -> Vec<Vec<u8>> {
    let ident = crate::membership::NodeIdent {
        name: "node3".into(),
        gossip: "198.19.0.3:7200".parse().unwrap(),
        peer: "198.19.0.3:7100".parse().unwrap(),
        bump: 1,
    };
    let bcast = |seq| {
        postcard::to_stdvec(&crate::membership::LoadBroadcast {
            node: "node3".into(),
            seq,
            managed: 2,
            entries: vec![crate::membership::WireEntry {
                node: 3,
                load: 0.7,
                stamped_at_ms: 1000,
                age_ms: 5,
            }],
            capacity_unknown: String::new(),
        })
        .unwrap()
    };
    vec![
        [&[0u8][..], &crate::membership::wire::encode_beacon(&ident)].concat(),
        [
            vec![1u8],
            field(&bcast(2)),
            field(&bcast(1)),
            field(&bcast(3)),
        ]
        .concat(),
        [&[2u8][..], b"ping"].concat(),
    ]
}

/// CRIU images: sockets, and a pagemap of three runs with its pages.
fn criu_image_seeds() -> Vec<Vec<u8>> {
    let page = crate::memtrack::page_size();
    let inetsk = criu_image_file(
        0x5644_3851,
        &[inet_sk(
            9,
            "198.19.0.1:5001".parse().unwrap(),
            "198.19.0.3:6001".parse().unwrap(),
        )],
    );
    vec![
        [
            vec![1 | 4],
            field(&files_img()),
            field(&[]),
            field(&pagemap_img(&[
                (0x40_0000, 2, 4),
                (0x40_0000 + 4 * page, 1, 2),
                (0x7fff_0000_0000, 3, 4),
            ])),
            ((5 * page / 64) as u16).to_le_bytes().to_vec(),
        ]
        .concat(),
        [vec![2], field(&[]), field(&inetsk), field(&[]), vec![0, 0]].concat(),
    ]
}

/// Config: the packaged example, and a minimal one.
fn config_seeds() -> Vec<Vec<u8>> {
    vec![
        include_bytes!("../../../packaging/ferryd.toml.example").to_vec(),
        b"node = \"node1\"\nwork_dir = \"/run/ferry/work\"\n[public]\ninterface = \"pub0\"\naddress = \"198.18.0.100\"\n[cluster]\ninterface = \"clu0\"\naddress = \"198.19.0.1\"\npeer_listen = \"198.19.0.1:7100\"\n[[peers]]\nname = \"node2\"\naddress = \"198.19.0.2:7100\"\n".to_vec(),
    ]
}

/// Inputs of bugs found and fixed, by target and name (`fuzz/regressions/`
/// holds these and the fuzzer's own crash files).
pub fn regressions() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let page = crate::memtrack::page_size();
    let prepare = pb::PrepareRequest {
        migration_id: "m1".into(),
        source_node: "node1".into(),
        protocol_version: 6,
        ..Default::default()
    };
    let pages = delimited(&[pb::PageBatch {
        migration_id: "m1".into(),
        round: 1,
        runs: vec![pb::PageRun {
            pid: 1,
            vaddr: 0x40_0000,
            data: vec![1; page as usize].into(),
            ..Default::default()
        }],
    }]);
    let images = delimited(&[pb::ImageChunk {
        migration_id: "m1".into(),
        file_name: "inventory.img".into(),
        data: vec![0; 8],
        ..Default::default()
    }]);
    // From the stored page to past 2^64: PageStore::first_missing once
    // found nothing missing there, and Restore overflowed adding it up.
    let restore = pb::RestoreRequest {
        migration_id: "m1".into(),
        lazy_pages: true,
        local_pages: vec![pb::StoredPages {
            pid: 1,
            vaddr: 0x40_0000,
            length: u64::MAX - (page - 1),
        }],
        ..Default::default()
    };
    vec![(
        "peer_protocol",
        "restore-local-pages-past-2-64",
        [
            step(Step::Prepare, FIX, &prepare.encode_to_vec()),
            step(Step::TransferPages, FIX, &pages),
            step(Step::PageTunnel, FIX, &[]),
            step(Step::TransferImages, FIX, &images),
            step(Step::Restore, FIX, &restore.encode_to_vec()),
        ]
        .concat(),
    )]
}
