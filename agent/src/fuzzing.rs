//! The bodies of the fuzz targets in `fuzz/` (run by `cargo xtask fuzz`),
//! one function per target, each taking the fuzzer's bytes. Whatever the
//! bytes, none may panic, hang or leave the agent inconsistent: the
//! `assert!`s here are the invariants, and a failed one is a finding.
//!
//! They live in the agent (behind the `fuzzing` feature, and in its unit
//! tests) rather than in `fuzz/` because they reach private parts of it,
//! and so that the unit test at the bottom replays the kept corpus on
//! stable Rust with every `cargo test`: a crash once fixed stays fixed
//! without nightly or cargo-fuzz.
//!
//! Nothing here touches the system beyond a temporary directory and a
//! loopback connection: the agent is the destination's test fixture
//! (fakes for the eBPF filter, the replayer and the flow rules, a shell
//! script for CRIU that only answers `--version`).
//!
//! `FERRY_FUZZ_TRACE=1` prints each peer step, its outcome and the slot.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use ferry_proto::v1 as pb;
use prost::Message;

use crate::engine::destination::{self, fixture::Fixture};
use crate::process::{PortKey, Transport};

/// A fuzz target's body: the fuzzer's bytes in, a panic on a finding.
pub type Target = fn(&[u8]);

/// The fuzz targets, by the name of their directory under `fuzz/corpus/`.
pub const TARGETS: &[(&str, Target)] = &[
    ("control_request", control_request),
    ("peer_protocol", peer_protocol),
    ("local_pages", local_pages),
    ("membership", membership),
    ("criu_image", criu_image),
    ("config", config),
];

/// The fuzzer's bytes, read as a few small fields; what is missing reads
/// as empty, so every input means something.
struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn byte(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else {
            return 0;
        };
        self.0 = rest;
        b
    }

    /// A field: a little-endian u16 length, then that many bytes (or what
    /// is left).
    fn field(&mut self) -> &'a [u8] {
        let len = usize::from(u16::from_le_bytes([self.byte(), self.byte()]));
        let (field, rest) = self.0.split_at(len.min(self.0.len()));
        self.0 = rest;
        field
    }

    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }
}

/// Encodes one [`Input::field`] (for the seeds).
fn field(bytes: &[u8]) -> Vec<u8> {
    let len = u16::try_from(bytes.len()).expect("a seed field under 64 KiB");
    let mut out = len.to_le_bytes().to_vec();
    out.extend_from_slice(bytes);
    out
}

/// The messages of a gRPC stream, as length-delimited protobuf messages one
/// after the other; stops at the first that does not decode (as tonic
/// ends the stream with an error there).
fn stream_of<M: Message + Default>(mut bytes: &[u8]) -> Vec<Result<M, tonic::Status>> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        match M::decode_length_delimited(&mut bytes) {
            Ok(m) => out.push(Ok(m)),
            Err(e) => {
                out.push(Err(tonic::Status::invalid_argument(e.to_string())));
                break;
            }
        }
    }
    out
}

/// A request stream as a tonic handler receives it: the messages framed as
/// gRPC frames, decoded by tonic's own decoder.
fn streaming<M: Message + Default + Send + 'static>(
    messages: &[Result<M, tonic::Status>],
) -> tonic::Streaming<M> {
    let mut body = Vec::new();
    for m in messages {
        match m {
            Ok(m) => {
                let bytes = m.encode_to_vec();
                body.push(0u8);
                body.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
                body.extend_from_slice(&bytes);
            }
            // A frame that does not decode: the stream breaks there.
            Err(_) => {
                body.extend_from_slice(&[0, 0, 0, 0, 2, 0xff, 0xff]);
                break;
            }
        }
    }
    tonic::Streaming::new_request(
        tonic_prost::ProstDecoder::<M>::default(),
        http_body_util::Full::new(bytes::Bytes::from(body)),
        None,
        None,
    )
}

/// One runtime for every run: the agent's async steps (and their blocking
/// tasks) run on it as they do under tonic.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime")
    })
}

/// Decodes `bytes` as `M`; what decodes encodes back to the same message.
/// Compared encoded: a NaN (a peer may send one) is not equal to itself.
fn decode<M: Message + Default + std::fmt::Debug>(bytes: &[u8]) -> Option<M> {
    let m = M::decode(bytes).ok()?;
    let encoded = m.encode_to_vec();
    let again = M::decode(encoded.as_slice()).expect("re-encoded message decodes");
    assert_eq!(
        encoded,
        again.encode_to_vec(),
        "{m:?} changed by an encode/decode round trip"
    );
    Some(m)
}

// ---------------------------------------------------------------- Control

/// `control_request`: the first byte picks one of the Control (and
/// Balance) requests, the rest is its protobuf encoding, decoded as tonic
/// would; then the agent's checks that run without root or a cluster:
/// SetBalancer's settings all the way to the balancer they configure and
/// a decision of it, Migrate's option checks.
pub fn control_request(data: &[u8]) {
    let mut input = Input(data);
    let which = input.byte();
    let msg = input.rest();
    match which % 18 {
        0 => drop(decode::<pb::ListNodesRequest>(msg)),
        1 => drop(decode::<pb::ListProcessesRequest>(msg)),
        2 => drop(decode::<pb::RunProcessRequest>(msg)),
        3 => {
            if let Some(req) = decode::<pb::MigrateRequest>(msg) {
                migrate_options(&req);
            }
        }
        4 => drop(decode::<pb::GetMigrationRequest>(msg)),
        5 => drop(decode::<pb::GetDataPlaneRequest>(msg)),
        6 => drop(decode::<pb::GetBalancerRequest>(msg)),
        7 => {
            if let Some(req) = decode::<pb::SetBalancerRequest>(msg) {
                set_balancer(&req);
            }
        }
        8 => drop(decode::<pb::OfferRequest>(msg)),
        9 => drop(decode::<pb::FinishRequest>(msg)),
        10 => drop(decode::<pb::CancelMigrationRequest>(msg)),
        11 => {
            if let Some(req) = decode::<pb::DrainNodeRequest>(msg)
                && let Err(s) = crate::api::drain_options(&req)
            {
                assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
            }
        }
        12 => drop(decode::<pb::SetCordonRequest>(msg)),
        13 => drop(decode::<pb::WatchEventsRequest>(msg)),
        14 => drop(decode::<pb::AdoptProcessRequest>(msg)),
        15 => drop(decode::<pb::WaitProcessRequest>(msg)),
        16 => drop(decode::<pb::CancelDrainRequest>(msg)),
        _ => {
            if let Some(req) = decode::<pb::SignalProcessRequest>(msg) {
                match crate::managed::signal_to_send(req.signal) {
                    Ok(s) => assert!(
                        (1..=31).contains(&(s as i32)) && s != nix::sys::signal::Signal::SIGSTOP,
                        "{s:?} accepted"
                    ),
                    Err(e) => assert!(e.starts_with("signal: "), "{e}"),
                }
            }
        }
    }
}

/// `ControlService::migrate`'s checks of a request: an accepted one is
/// within the documented bounds, a refused one is INVALID_ARGUMENT.
fn migrate_options(req: &pb::MigrateRequest) {
    match crate::api::migrate_options(req) {
        Ok((pid, destination, options)) => {
            assert!(pid > 0 && !destination.is_empty(), "{req:?}");
            assert!(
                options.downtime_budget.is_none_or(
                    |d| d.as_millis() <= u128::from(crate::config::MAX_DOWNTIME_BUDGET_MS)
                ),
                "{req:?}"
            );
            assert!(
                options
                    .max_rounds
                    .is_none_or(|r| r <= crate::config::MAX_PRECOPY_ROUNDS),
                "{req:?}"
            );
        }
        Err(s) => assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}"),
    }
}

/// What `ControlService::set_balancer` does with a request, minus the
/// conductor's lock: apply the settings, check them as the conductor does,
/// build the balancer and its information policy, and let it decide.
fn set_balancer(req: &pb::SetBalancerRequest) {
    use rand::SeedableRng;

    let Ok(policy) = crate::api::apply_settings(&ferry_policy::Config::default(), &req.settings)
    else {
        return;
    };
    if crate::config::unsupported_policy(&policy).is_some() || policy.validate().is_err() {
        return;
    }
    // What GetBalancer shows of an accepted policy reads back as itself.
    let shown = toml::to_string(&policy).expect("an accepted policy is TOML");
    let back: ferry_policy::Config = toml::from_str(&shown).expect("GetBalancer's TOML reads back");
    assert_eq!(back, policy, "{shown}");
    let node = crate::conductor::node_id;
    let local = node("node1");
    let members = [local, node("node2"), node("node3")];
    let _info = policy.information.policy(local, &members);
    let mut balancer = ferry_policy::Balancer::new(&policy);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let processes: Vec<_> = (1..=4)
        .map(|i| ferry_policy::selection::ProcessLoad {
            pid: ferry_policy::ProcessId(i),
            load: i as f64 * 0.3,
            resident_for: Duration::from_secs(i * 30),
            migratable: i != 2,
        })
        .collect();
    // Underloaded, balanced and overloaded views of the cluster, over time.
    for (step, local_load) in [0.0, 1.0, 4.0, 0.5, 9.0].into_iter().enumerate() {
        let peers: Vec<_> = members[1..]
            .iter()
            .zip([0.2, 2.5])
            .map(|(&n, load)| ferry_policy::PeerLoad {
                node: n,
                load,
                age: Duration::from_millis(500),
            })
            .collect();
        let now = ferry_policy::Instant::from_millis(1_000_000 + step as u64 * 60_000);
        let _ = balancer.plan(now, local_load, &peers, &processes, &mut rng);
    }
}

// ----------------------------------------------------------- Peer protocol

/// The source node and another node, by the fixture's configuration.
const PEERS: &[(&str, &str)] = &[("node1", "198.19.0.1"), ("node3", "198.19.0.3")];

/// The steps of the peer protocol a sequence is made of. Left out: a
/// TransferSockets' rebuild (TCP repair sockets: root, and the real
/// network stack; its checks run), and any step after a successful
/// Restore, which only real CRIU gives: Commit and the discard of a
/// restored copy are reached only through their refusals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
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

const STEPS: [Step; 14] = [
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
            Some(destination::abort(engine, req).await.map(|()| Some(id)))
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

// ------------------------------------------------------------ Local pages

/// `local_pages`: CRIU's lazy-pages daemon and the source's page server,
/// as assisted post-copy's tunnel carries them (`engine::localpages`).
/// Fields: a PageBatch (pages pre-copied into the store; each run's data
/// is stretched to whole pages, the store refuses anything else), a
/// RestoreRequest whose `local_pages` name the pages answered here (those
/// missing from the store are dropped, as Restore refuses them), the
/// daemon's requests (raw page-server headers), and the source's answers
/// (TunnelBytes messages). The session must end, whatever they say.
pub fn local_pages(data: &[u8]) {
    runtime().block_on(local_pages_session(data));
}

async fn local_pages_session(data: &[u8]) {
    let mut input = Input(data);
    let batch = pb::PageBatch::decode(input.field()).unwrap_or_default();
    let restore = pb::RestoreRequest::decode(input.field()).unwrap_or_default();
    let requests = input.field().to_vec();
    let tunnel = stream_of::<pb::TunnelBytes>(input.rest());

    let page = crate::memtrack::page_size();
    let dir = tempfile::tempdir().unwrap();
    let mut store = crate::engine::pagestore::PageStore::new(&dir.path().join("precopy"));
    let mut batch = batch;
    for run in &mut batch.runs {
        let pages = (run.data.len() as u64).div_ceil(page).clamp(1, 4);
        let mut data = run.data.clone();
        if data.is_empty() {
            data.push(0);
        }
        run.data = data
            .iter()
            .copied()
            .cycle()
            .take((pages * page) as usize)
            .collect();
    }
    let _ = store.write(&batch);
    let mut held: HashMap<u32, crate::memtrack::RangeSet> = HashMap::new();
    for p in &restore.local_pages {
        if p.length > 0 && store.first_missing(p).is_none() {
            held.entry(p.pid)
                .or_default()
                .insert(p.vaddr, p.vaddr + p.length);
        }
    }
    let local = Arc::new(OnceLock::new());
    let _ = local.set(crate::engine::localpages::LocalPages {
        held,
        store: Arc::new(Mutex::new(store)),
    });

    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await
        .unwrap();
    let daemon = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (ours, _) = listener.accept().await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::channel(8);
    // The source's side: takes what is forwarded to it.
    let forwarded = tokio::spawn(async move {
        let mut bytes = 0usize;
        while let Some(m) = rx.recv().await {
            let m: Result<pb::TunnelBytes, tonic::Status> = m;
            bytes += m.map(|m| m.data.len()).unwrap_or(0);
        }
        bytes
    });
    // The daemon's side: asks, then reads every answer until the end.
    let asking = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut rd, mut wr) = daemon.into_split();
        let reading = tokio::spawn(async move {
            let mut answers = Vec::new();
            let _ = rd.read_to_end(&mut answers).await;
            answers.len()
        });
        let _ = wr.write_all(&requests).await;
        let _ = wr.shutdown().await;
        reading.await.unwrap_or(0)
    });
    let inbound = tokio_stream::iter(tunnel);
    let served = tokio::time::timeout(
        Duration::from_secs(10),
        crate::engine::localpages::serve(
            ours,
            inbound,
            tx,
            local,
            Arc::new(std::sync::atomic::AtomicU64::new(0)),
        ),
    )
    .await
    .expect("the page-server session ended");
    drop(served);
    let _ = tokio::time::timeout(Duration::from_secs(10), asking)
        .await
        .expect("the daemon's connection closed");
    let _ = forwarded.await;
}

// ------------------------------------------------------------- Membership

/// `membership`: what arrives on the gossip port. The first byte picks:
/// a discovery beacon (decoded; what decodes re-encodes to itself), a
/// sequence of load broadcasts to the load handler (each node's are passed
/// on once, newest first, never our own, and fit the policy's message), or
/// a datagram to the MAC check (only a sealed one opens, to its payload).
pub fn membership(data: &[u8]) {
    use crate::membership::wire;
    use foca::BroadcastHandler;

    let mut input = Input(data);
    match input.byte() % 3 {
        0 => {
            let bytes = input.rest();
            if let Some(ident) = wire::decode_beacon(bytes) {
                let again = wire::decode_beacon(&wire::encode_beacon(&ident));
                assert_eq!(again.as_ref(), Some(&ident));
            }
        }
        1 => {
            let passed: Arc<Mutex<Vec<crate::membership::LoadBroadcast>>> = Arc::default();
            let inbox = passed.clone();
            let mut handler = wire::LoadHandler::new(
                "node1".into(),
                Box::new(move |b| inbox.lock().unwrap().push(b)),
            );
            while !input.is_empty() {
                let _ = handler.receive_item(input.field(), None);
            }
            let mut newest: HashMap<String, u64> = HashMap::new();
            for b in passed.lock().unwrap().iter() {
                assert_ne!(b.node, "node1", "our own broadcast passed on");
                assert!(b.entries.len() <= wire::MAX_ENTRIES);
                if let Some(&seq) = newest.get(&b.node) {
                    assert!(b.seq > seq, "an old broadcast of {} passed on", b.node);
                }
                newest.insert(b.node.clone(), b.seq);
                let m = b.to_message(crate::conductor::node_id(&b.node));
                assert_eq!(m.entries.len(), b.entries.len());
            }
        }
        _ => {
            let sealer = crate::membership::auth::Sealer::new(b"fuzzing key, 32 bytes long.....");
            let now_ms = 1_800_000_000_000;
            let datagram = input.rest();
            let _ = sealer.open(datagram, now_ms);
            let mut sealed = datagram.to_vec();
            sealer.seal(&mut sealed, now_ms);
            assert_eq!(sealer.open(&sealed, now_ms + 1).ok(), Some(datagram));
        }
    }
}

// -------------------------------------------------------------- CRIU images

/// `criu_image`: the image files the destination reads from what a peer
/// sent (`ferry_criu_image`): `files.img` and `inetsk.img` (the inet
/// sockets, listed, then every IPv4 one moved to another local address,
/// which must list as moved and leave nothing to move the second time),
/// and a pagemap with its pages file (the page runs, checked against the
/// file's size). The first byte says which files exist.
pub fn criu_image(data: &[u8]) {
    let mut input = Input(data);
    let present = input.byte();
    let files = input.field();
    let inetsk = input.field();
    let pagemap = input.field();
    let pages_len = u64::from(u16::from_le_bytes([input.byte(), input.byte()])) * 64;
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, bytes: &[u8]| std::fs::write(dir.path().join(name), bytes).unwrap();
    if present & 1 != 0 {
        write("files.img", files);
    }
    if present & 2 != 0 {
        write("inetsk.img", inetsk);
    }
    write("pagemap-1.img", pagemap);
    if present & 4 != 0 {
        // Whatever pages_id the head names: the first few.
        for id in 0..4 {
            let f = std::fs::File::create(dir.path().join(format!("pages-{id}.img"))).unwrap();
            f.set_len(pages_len).unwrap();
        }
    }
    images_sockets(dir.path());
    if let Ok(pm) = ferry_criu_image::pagemap::read_pagemap(dir.path(), 1) {
        let _ = pm.present_bytes();
        for vaddr in [0, 0x1000, 0x40_0000, 0x7fff_ffff_f000, u64::MAX] {
            let run = pm.run_containing(vaddr);
            let offset = pm.pages_file_offset_of(vaddr);
            if offset.is_some() {
                assert!(run.is_some_and(|r| r.is_present()));
            }
        }
        let _ = pm.check_pages_file(dir.path());
    }
}

fn images_sockets(dir: &Path) {
    let Ok(sockets) = ferry_criu_image::inet_sockets(dir) else {
        return;
    };
    let new_local = Ipv4Addr::new(198, 19, 0, 2);
    let rules: Vec<_> = sockets
        .iter()
        .filter_map(|s| {
            let local = s.local_v4()?;
            (*local.ip() != new_local).then(|| ferry_criu_image::LocalAddressRewrite {
                matches: ferry_criu_image::SocketMatch {
                    proto: s.proto as u8,
                    local,
                    remote: s.remote_v4(),
                },
                new_local,
            })
        })
        .filter(|r| u32::from(r.matches.proto) == sockets_proto(&sockets, r))
        .collect();
    let Ok(summary) = ferry_criu_image::rewrite_local_addresses(dir, &rules) else {
        return;
    };
    let after = ferry_criu_image::inet_sockets(dir).expect("rewritten images still read");
    assert_eq!(after.len(), sockets.len(), "a rewrite changed the sockets");
    for r in &summary.rewritten {
        assert_eq!(
            r.after.local_v4(),
            Some(SocketAddrV4::new(
                new_local,
                r.before.local_v4().unwrap().port()
            ))
        );
        assert!(
            after.contains(&r.after),
            "a rewritten socket is not in the images"
        );
    }
    let again = ferry_criu_image::rewrite_local_addresses(dir, &rules)
        .expect("rewritten images rewrite again");
    assert!(
        again.rewritten.is_empty(),
        "a second rewrite moved {again:?}"
    );
}

/// The protocol of the socket a rule was made from (rules take it as a
/// byte: protocols above 255 cannot be matched).
fn sockets_proto(
    sockets: &[ferry_criu_image::InetSocket],
    r: &ferry_criu_image::LocalAddressRewrite,
) -> u32 {
    sockets
        .iter()
        .find(|s| s.local_v4() == Some(r.matches.local) && s.remote_v4() == r.matches.remote)
        .map_or(0, |s| s.proto)
}

// ------------------------------------------------------------------ Config

/// `config`: ferryd's configuration file (`Config::parse`, all of its
/// checks); one that parses writes back as TOML that parses to the same.
/// Also CRIU's `--version` output, as Prepare reads it.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = crate::criu::CriuVersion::parse_version_output(text);
    let path = Path::new("fuzz.toml");
    if let Ok(c) = crate::config::Config::parse(text, path) {
        let written = toml::to_string(&c).expect("a parsed configuration writes as TOML");
        let again = crate::config::Config::parse(&written, path);
        assert!(again.is_ok(), "{written}\nreads back as {again:?}");
    }
}

// ------------------------------------------------------------------ Seeds

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

/// One peer step for [`peer_protocol`]'s seeds.
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
    let page = crate::memtrack::page_size();
    let port = |protocol: pb::Protocol, port| pb::Port {
        protocol: protocol as i32,
        port,
    };
    let mut out = Vec::new();

    // Control: a SetBalancer that passes, and one of each request.
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
    out.push((
        "control_request",
        [&[7u8][..], &set.encode_to_vec()].concat(),
    ));
    let migrate = pb::MigrateRequest {
        pid: 42,
        destination_node: "node2".into(),
        strategy: 2,
        downtime_budget_ms: 50,
        ..Default::default()
    };
    out.push((
        "control_request",
        [&[3u8][..], &migrate.encode_to_vec()].concat(),
    ));
    for which in [0u8, 1, 2, 4, 5, 6, 8, 9] {
        out.push(("control_request", vec![which]));
    }

    // Peer protocol: a total copy with an in-cluster connection up to the
    // restore (which the fake CRIU fails), then the abort; a pre-copy one;
    // a post-copy one with its tunnel.
    // Fix bits: id "m1", source "node1", version 6 (bits 5-7 index 4).
    let fix = 0x01 | 0x04 | 0x10 | (4 << 5);
    let prepare = pb::PrepareRequest {
        migration_id: "m1".into(),
        source_node: "node1".into(),
        protocol_version: 6,
        source_pid: 42,
        argv: vec!["server".into()],
        ports: vec![port(pb::Protocol::Tcp, 7000)],
    }
    .encode_to_vec();
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
    let images = delimited(&[
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
    ]);
    let pages = delimited(&[pb::PageBatch {
        migration_id: "m1".into(),
        round: 1,
        runs: vec![pb::PageRun {
            pid: 1,
            vaddr: 0x40_0000,
            data: vec![0xa5; page as usize],
        }],
    }]);
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
    let total = [
        step(Step::Prepare, fix, &prepare),
        step(Step::Arm, fix, &arm),
        step(Step::TransferPages, fix, &pages),
        step(Step::TransferImages, fix, &images),
        step(Step::Restore, fix, &restore),
        step(Step::Commit, fix, &[]),
        step(Step::Abort, fix, &abort),
        step(Step::Prepare, fix, &prepare),
    ]
    .concat();
    out.push(("peer_protocol", total));
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
    let post = [
        step(Step::Prepare, fix, &prepare),
        step(Step::TransferPages, fix, &pages),
        step(Step::TransferSockets, fix, &sockets),
        step(Step::PageTunnel, fix, &tunnel),
        step(Step::TransferImages, fix, &images),
        step(Step::Restore, fix, &lazy),
        step(Step::PostCopyStatus, fix, &[]),
    ]
    .concat();
    out.push(("peer_protocol", post));
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
    let misc = [
        step(Step::Hello, 0, &hello),
        step(Step::Prepare, fix, &prepare),
        step(Step::PortOwnership, 0, &owned),
        step(Step::AddTranslations, 0, &translations),
        step(Step::RemoveTranslations, 0, &translations),
    ]
    .concat();
    out.push(("peer_protocol", misc));

    // Local pages: one page held here, one asked of the source; a close.
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
            data: vec![0x5a; 16],
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
    out.push((
        "local_pages",
        [
            field(&batch.encode_to_vec()),
            field(&held.encode_to_vec()),
            field(&requests),
            answers,
        ]
        .concat(),
    ));

    // Membership: a beacon, two load broadcasts, a datagram.
    let ident = crate::membership::NodeIdent {
        name: "node3".into(),
        gossip: "198.19.0.3:7200".parse().unwrap(),
        peer: "198.19.0.3:7100".parse().unwrap(),
        bump: 1,
    };
    out.push((
        "membership",
        [&[0u8][..], &crate::membership::wire::encode_beacon(&ident)].concat(),
    ));
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
        })
        .unwrap()
    };
    out.push((
        "membership",
        [
            vec![1u8],
            field(&bcast(2)),
            field(&bcast(1)),
            field(&bcast(3)),
        ]
        .concat(),
    ));
    out.push(("membership", [&[2u8][..], b"ping"].concat()));

    // CRIU images: sockets, and a pagemap of three runs with its pages.
    out.push((
        "criu_image",
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
    ));
    let inetsk = criu_image_file(
        0x5644_3851,
        &[inet_sk(
            9,
            "198.19.0.1:5001".parse().unwrap(),
            "198.19.0.3:6001".parse().unwrap(),
        )],
    );
    out.push((
        "criu_image",
        [vec![2], field(&[]), field(&inetsk), field(&[]), vec![0, 0]].concat(),
    ));

    // Config: the packaged example, and a minimal one.
    out.push((
        "config",
        include_bytes!("../../packaging/ferryd.toml.example").to_vec(),
    ));
    out.push((
        "config",
        b"node = \"node1\"\nwork_dir = \"/run/ferry/work\"\n[public]\ninterface = \"pub0\"\naddress = \"198.18.0.100\"\n[cluster]\ninterface = \"clu0\"\naddress = \"198.19.0.1\"\npeer_listen = \"198.19.0.1:7100\"\n[[peers]]\nname = \"node2\"\naddress = \"198.19.0.2:7100\"\n".to_vec(),
    ));
    out
}

/// Inputs of bugs found and fixed, by target and name (`fuzz/regressions/`
/// holds these and the fuzzer's own crash files).
pub fn regressions() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let page = crate::memtrack::page_size();
    let fix = 0x01 | 0x04 | 0x10 | (4 << 5);
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
            data: vec![1; page as usize],
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
            step(Step::Prepare, fix, &prepare.encode_to_vec()),
            step(Step::TransferPages, fix, &pages),
            step(Step::PageTunnel, fix, &[]),
            step(Step::TransferImages, fix, &images),
            step(Step::Restore, fix, &restore.encode_to_vec()),
        ]
        .concat(),
    )]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the fuzz targets' kept inputs are: the minimised corpus and
    /// the crashes found and fixed.
    fn kept(target: &str) -> Vec<std::path::PathBuf> {
        let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
        let mut files = Vec::new();
        for dir in ["corpus", "regressions"] {
            let Ok(entries) = std::fs::read_dir(fuzz.join(dir).join(target)) else {
                continue;
            };
            files.extend(entries.flatten().map(|e| e.path()).filter(|p| p.is_file()));
        }
        files.sort();
        files
    }

    /// Every kept input of every target, once, as the fuzzer ran them:
    /// what `cargo xtask fuzz` found and was fixed stays fixed.
    #[test]
    fn fuzz_corpus_replays_without_a_finding() {
        for (target, run) in TARGETS {
            let files = kept(target);
            for path in &files {
                let data = std::fs::read(path).unwrap();
                let outcome = std::panic::catch_unwind(|| run(&data));
                assert!(outcome.is_ok(), "{target}: {} fails", path.display());
            }
            eprintln!("{target}: {} inputs replayed", files.len());
        }
    }

    #[test]
    fn regressions_run_clean() {
        for (target, _, data) in regressions() {
            let run = TARGETS.iter().find(|(t, _)| *t == target).unwrap().1;
            run(&data);
        }
    }

    #[test]
    fn seeds_run_clean() {
        for (target, data) in seeds() {
            let run = TARGETS.iter().find(|(t, _)| *t == target).unwrap().1;
            run(&data);
        }
    }

    #[test]
    fn short_and_empty_inputs_mean_something() {
        for (_, run) in TARGETS {
            run(&[]);
            run(&[0]);
            run(&[0xff; 3]);
        }
    }

    /// Writes [`seeds`] into `fuzz/corpus/<target>/seed-<n>`.
    #[test]
    #[ignore = "writes the fuzz seeds: cargo test -p ferry-agent write_fuzz_seeds -- --ignored"]
    fn write_fuzz_seeds() {
        let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus");
        let mut n: HashMap<&str, usize> = HashMap::new();
        for (target, data) in seeds() {
            let i = n.entry(target).or_default();
            *i += 1;
            let dir = corpus.join(target);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(format!("seed-{i}")), data).unwrap();
        }
        let kept = corpus.join("../regressions");
        for (target, name, data) in regressions() {
            let dir = kept.join(target);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(name), data).unwrap();
        }
    }
}
