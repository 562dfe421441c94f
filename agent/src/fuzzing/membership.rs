//! The `membership` target: what arrives on the gossip port.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::Input;

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
