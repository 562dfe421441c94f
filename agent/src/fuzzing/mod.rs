//! The bodies of the fuzz targets in `fuzz/` (run by `cargo xtask fuzz`),
//! one function per target, each taking the fuzzer's bytes. Whatever the
//! bytes, none may panic, hang or leave the agent inconsistent: the
//! `assert!`s here are the invariants, and a failed one is a finding.
//!
//! They live in the agent (behind the `fuzzing` feature, and in its unit
//! tests) rather than in `fuzz/` because they reach private parts of it,
//! and so that the unit tests in `replay.rs` replay the kept corpus on
//! stable Rust with every `cargo test`: a crash once fixed stays fixed
//! without nightly or cargo-fuzz. One file per target, named as it is;
//! `seeds.rs` has the inputs the fuzzer starts from.
//!
//! Nothing here touches the system beyond a temporary directory and a
//! loopback connection: the agent is the destination's test fixture
//! (fakes for the eBPF filter, the replayer and the flow rules, a shell
//! script for CRIU that only answers `--version`).
//!
//! `FERRY_FUZZ_TRACE=1` prints each peer step, its outcome and the slot.

use std::sync::OnceLock;

use prost::Message;

mod config;
mod control_request;
mod criu_image;
mod local_pages;
mod membership;
mod peer_protocol;
#[cfg(test)]
mod replay;
mod seeds;

pub use config::config;
pub use control_request::control_request;
pub use criu_image::criu_image;
pub use local_pages::local_pages;
pub use membership::membership;
pub use peer_protocol::peer_protocol;
pub use seeds::{regressions, seeds};

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
