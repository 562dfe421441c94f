//! The `peer_protocol` target: sequences of Peer requests against one
//! destination agent, with the invariants checked between any two steps.

use std::collections::{BTreeMap, BTreeSet};

use ferry_proto::v1 as pb;
use prost::Message;

use super::{Input, runtime, stream_of, streaming};
use crate::engine::destination::{self, fixture::Fixture};
use crate::process::{PortKey, Transport};

/// The source node and another node, by the fixture's configuration.
const PEERS: &[(&str, &str)] = &[("node1", "198.19.0.1"), ("node3", "198.19.0.3")];

/// The steps of the peer protocol a sequence is made of. Left out: a
/// TransferSockets' rebuild (TCP repair sockets: root, and the real
/// network stack; its checks run), and any step after a successful
/// Restore, which only real CRIU gives: Commit and the discard of a
/// restored copy are reached only through their refusals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    Prepare,
    Arm,
    TransferImages,
    TransferPages,
    TransferSockets,
    PageTunnel,
    Restore,
    Commit,
    Abort,
    Hello,
    PortOwnership,
    PostCopyStatus,
    AddTranslations,
    RemoveTranslations,
}

pub(super) const STEPS: [Step; 14] = [
    Step::Prepare,
    Step::Arm,
    Step::TransferImages,
    Step::TransferPages,
    Step::TransferSockets,
    Step::PageTunnel,
    Step::Restore,
    Step::Commit,
    Step::Abort,
    Step::Hello,
    Step::PortOwnership,
    Step::PostCopyStatus,
    Step::AddTranslations,
    Step::RemoveTranslations,
];

/// How a step's decoded message is nudged towards the ones that get
/// somewhere: a fuzzer rarely guesses the id that a Prepare before it
/// chose. Bits 0-1: migration id (kept, "m1", "m2", "m1"); bits 2-3:
/// source node (kept, "node1", "node3", "node2" = this node); bit 4: a
/// protocol version this agent speaks, bits 5-7 which.
#[derive(Debug, Clone, Copy)]
struct Fix(u8);

impl Fix {
    fn id(self, id: &mut String) {
        match self.0 & 3 {
            0 => {}
            2 => *id = "m2".into(),
            _ => *id = "m1".into(),
        }
    }

    fn node(self, node: &mut String) {
        match (self.0 >> 2) & 3 {
            0 => {}
            1 => *node = "node1".into(),
            2 => *node = "node3".into(),
            _ => *node = "node2".into(),
        }
    }

    fn version(self, v: &mut u32) {
        if self.0 & 0x10 != 0 {
            let versions = ferry_proto::PEER_PROTOCOL_VERSIONS;
            *v = versions[usize::from(self.0 >> 5) % versions.len()];
        }
    }
}

/// What a step saw of the slot, for the invariants.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SlotView {
    migration_id: String,
    state: &'static str,
    ports: BTreeSet<PortKey>,
}

async fn slot_view(f: &Fixture) -> Option<SlotView> {
    let slot = f.engine.incoming.lock().await;
    slot.as_ref().map(|inc| SlotView {
        migration_id: inc.migration_id.clone(),
        state: destination::fixture::state_name(inc),
        ports: inc.ports.iter().copied().collect(),
    })
}

/// The filter's ports as its recorded calls left them.
fn filter_ports(f: &Fixture) -> BTreeMap<String, String> {
    let mut ports = BTreeMap::new();
    for call in f.filter.0.lock().unwrap().iter() {
        let mut words = call.split(' ');
        match (words.next(), words.next(), words.next()) {
            (Some("set"), Some(port), Some(state)) => {
                ports.insert(port.to_owned(), state.to_owned());
            }
            (Some("remove"), Some(port), None) => {
                ports.remove(port);
            }
            _ => panic!("unexpected filter call {call:?}"),
        }
    }
    ports
}

/// The invariants between any two steps: the ports this node owns are
/// exactly those of the incoming migration, and the filter says so; with
/// no migration held, nothing of one is left: no port, no capture
/// session, no hold on an in-cluster connection, no image directory.
async fn check_consistent(f: &Fixture, ports_seen: &BTreeSet<PortKey>) {
    let view = slot_view(f).await;
    let owned = f.engine.ports.owned();
    let expected = view.as_ref().map(|v| v.ports.clone()).unwrap_or_default();
    assert_eq!(owned, expected, "owned ports vs the incoming slot {view:?}");
    let filtered: BTreeSet<String> = filter_ports(f).into_keys().collect();
    let expected: BTreeSet<String> = expected.iter().map(|p| p.to_string()).collect();
    assert_eq!(filtered, expected, "filter vs the incoming slot {view:?}");
    if view.is_none() {
        let holds = f
            .flows
            .0
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.action == ferry_ebpf::RuleAction::Hold)
            .count();
        assert_eq!(holds, 0, "holds left without an incoming migration");
        // A packet for any port ever used belongs to no capture session.
        let strays: Vec<_> = ports_seen
            .iter()
            .map(|p| ferry_ebpf::CapturedPacket {
                kind: ferry_ebpf::CaptureKind::Captured,
                protocol: match p.transport {
                    Transport::Tcp => ferry_ebpf::Protocol::Tcp,
                    Transport::Udp => ferry_ebpf::Protocol::Udp,
                },
                port: p.port,
                ktime_ns: u64::MAX,
                data: vec![0x45],
            })
            .collect();
        let n = strays.len();
        assert_eq!(
            f.engine.dataplane.capture.route(strays),
            n,
            "capture left open"
        );
        let incoming = f.engine.config.work_dir.join("incoming");
        if let Ok(dirs) = std::fs::read_dir(&incoming) {
            let left: Vec<_> = dirs.flatten().map(|d| d.file_name()).collect();
            assert!(left.is_empty(), "image directories left: {left:?}");
        }
    }
}

/// `peer_protocol`: a sequence of Peer requests to one destination agent.
/// Each step is a byte (which step), a [`Fix`] byte and a field with its
/// message (streams: length-delimited messages one after the other). After
/// every step the invariants of [`check_consistent`] hold, a refused step
/// changed nothing, and an Abort of the migration held leaves nothing of
/// it; at the end the source aborts whatever is left.
pub fn peer_protocol(data: &[u8]) {
    runtime().block_on(peer_sequence(data));
}

async fn peer_sequence(data: &[u8]) {
    let f = Fixture::new(PEERS);
    let mut input = Input(data);
    let mut ports_seen = BTreeSet::new();
    let mut steps = 0;
    // Each step costs a few processes at most: bounded, to keep runs fast.
    while !input.is_empty() && steps < 24 {
        steps += 1;
        let step = STEPS[usize::from(input.byte()) % STEPS.len()];
        let fix = Fix(input.byte());
        let msg = input.field();
        let before = slot_view(&f).await;
        let outcome = run_step(&f, step, fix, msg, &mut ports_seen).await;
        let after = slot_view(&f).await;
        if std::env::var_os("FERRY_FUZZ_TRACE").is_some() {
            eprintln!("{step:?}: {outcome:?} -> {after:?}");
        }
        match outcome {
            // Did not decode: tonic refuses it before any handler runs.
            None => assert_eq!(before, after),
            Some(Err(e)) => {
                // Every refusal maps to a gRPC status, as the handlers do.
                let _ = tonic::Status::from(e);
                if step == Step::TransferImages || step == Step::Restore {
                    // They may fail after some work; the slot stays.
                    assert_eq!(
                        before.map(|v| v.migration_id),
                        after.map(|v| v.migration_id)
                    );
                } else {
                    assert_eq!(before, after, "a refused {step:?} changed the slot");
                }
            }
            Some(Ok(aborted)) => {
                if let Some(id) = aborted
                    && before.as_ref().is_some_and(|v| v.migration_id == id)
                {
                    assert_eq!(after, None, "an Abort left its migration");
                }
            }
        }
        check_consistent(&f, &ports_seen).await;
    }
    if let Some(v) = slot_view(&f).await {
        let aborted = destination::abort(
            &f.engine,
            pb::AbortRequest {
                migration_id: v.migration_id,
                reason: "end of sequence".into(),
            },
            None,
        )
        .await;
        assert!(aborted.is_ok(), "abort refused: {aborted:?}");
        assert_eq!(slot_view(&f).await, None);
    }
    check_consistent(&f, &ports_seen).await;
}

/// Runs one step: `None` if its message did not decode, else the step's
/// result, `Ok(Some(id))` for an Abort of `id`.
async fn run_step(
    f: &Fixture,
    step: Step,
    fix: Fix,
    msg: &[u8],
    ports_seen: &mut BTreeSet<PortKey>,
) -> Option<Result<Option<String>, crate::engine::EngineError>> {
    let engine = &f.engine;
    let mut note_ports = |ports: &[pb::Port]| {
        ports_seen.extend(
            ports
                .iter()
                .filter_map(|p| crate::process::PortKey::from_pb(p).ok()),
        );
    };
    let done = |r: Result<(), crate::engine::EngineError>| Some(r.map(|()| None));
    match step {
        Step::Prepare => {
            let mut req = pb::PrepareRequest::decode(msg).ok()?;
            fix.id(&mut req.migration_id);
            fix.node(&mut req.source_node);
            fix.version(&mut req.protocol_version);
            note_ports(&req.ports);
            done(destination::prepare(engine, req).await.map(drop))
        }
        Step::Arm => {
            let mut req = pb::ArmRequest::decode(msg).ok()?;
            fix.id(&mut req.migration_id);
            note_ports(&req.ports);
            // The sockets it names are checked here, not opened: the
            // peer API's `destination::stage` touches the system.
            done(destination::arm(engine, req).await.map(drop))
        }
        Step::TransferImages => {
            let mut chunks = stream_of::<pb::ImageChunk>(msg);
            for c in chunks.iter_mut().flatten() {
                fix.id(&mut c.migration_id);
            }
            let caller = caller(fix);
            let r = destination::transfer_images(engine, caller, streaming(&chunks)).await;
            done(r.map(drop))
        }
        Step::TransferPages => {
            let mut batches = stream_of::<pb::PageBatch>(msg);
            for b in batches.iter_mut().flatten() {
                fix.id(&mut b.migration_id);
            }
            let caller = caller(fix);
            let r = destination::transfer_pages(engine, caller, streaming(&batches)).await;
            done(r.map(drop))
        }
        Step::TransferSockets => {
            let mut req = pb::TransferSocketsRequest::decode(msg).ok()?;
            fix.id(&mut req.migration_id);
            fix.node(&mut req.source_node);
            let r = destination::sockets_to_rebuild(engine, &mut req);
            done(r.map(drop))
        }
        Step::PageTunnel => {
            let mut messages = stream_of::<pb::TunnelBytes>(msg);
            // The first message names the migration.
            let mut first = pb::TunnelBytes::default();
            fix.id(&mut first.migration_id);
            messages.insert(0, Ok(first));
            let caller = caller(fix);
            let r = destination::page_tunnel(engine, caller, streaming(&messages)).await;
            done(r.map(drop))
        }
        Step::Restore => {
            let mut req = pb::RestoreRequest::decode(msg).ok()?;
            fix.id(&mut req.migration_id);
            done(destination::restore(engine, req).await.map(drop))
        }
        Step::Commit => {
            let mut req = pb::CommitRequest::decode(msg).ok()?;
            fix.id(&mut req.migration_id);
            let r = destination::commit(engine, req).await;
            assert!(r.is_err(), "a commit without a restored process");
            done(r.map(drop))
        }
        Step::Abort => {
            let mut req = pb::AbortRequest::decode(msg).ok()?;
            fix.id(&mut req.migration_id);
            let id = req.migration_id.clone();
            Some(
                destination::abort(engine, req, None)
                    .await
                    .map(|_| Some(id)),
            )
        }
        Step::Hello => {
            // The handler's only logic: the version both speak.
            let req = pb::HelloRequest::decode(msg).ok()?;
            if let Some(v) = ferry_proto::negotiate_peer_version(&req.protocol_versions) {
                assert!(req.protocol_versions.contains(&v));
                assert!(ferry_proto::PEER_PROTOCOL_VERSIONS.contains(&v));
            }
            Some(Ok(None))
        }
        Step::PortOwnership => {
            // As the handler answers: the asked ports this node owns.
            let req = pb::PortOwnershipRequest::decode(msg).ok()?;
            let asked: Result<Vec<_>, _> = req
                .ports
                .iter()
                .map(crate::process::PortKey::from_pb)
                .collect();
            if let Ok(asked) = &asked {
                let owned = engine.ports.owned();
                for p in asked.iter().filter(|p| owned.contains(p)) {
                    assert_eq!(crate::process::PortKey::from_pb(&p.to_pb()).ok(), Some(*p));
                }
            }
            Some(
                asked
                    .map(drop)
                    .map(|()| None)
                    .map_err(crate::engine::EngineError::from),
            )
        }
        Step::PostCopyStatus => {
            let mut req = pb::PostCopyStatusRequest::decode(msg).ok()?;
            fix.id(&mut req.migration_id);
            // Nothing commits here, so no post-copy is ever known: the
            // answer comes at once, whatever `wait_ms` says.
            let r = destination::post_copy_status(engine, caller(fix), req).await;
            assert!(r.is_err());
            done(r.map(drop))
        }
        Step::AddTranslations | Step::RemoveTranslations => {
            let mut req = pb::TranslationsRequest::decode(msg).ok()?;
            fix.id(&mut req.migration_id);
            let r = if step == Step::AddTranslations {
                engine.dataplane.add_translations(engine.here(), &req)
            } else {
                engine.dataplane.remove_translations(engine.here(), &req)
            };
            done(r.map(drop).map_err(crate::engine::EngineError::from))
        }
    }
}

/// The node a streamed step's client certificate names: none (no TLS), or
/// the node the fix byte's source bits name.
fn caller(fix: Fix) -> Option<String> {
    let mut node = String::new();
    fix.node(&mut node);
    (!node.is_empty()).then_some(node)
}
