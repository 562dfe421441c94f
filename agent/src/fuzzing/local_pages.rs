//! The `local_pages` target: CRIU's page-server protocol on the assisted
//! post-copy tunnel.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use ferry_proto::v1 as pb;
use prost::Message;

use super::{Input, runtime, stream_of};

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
        let mut data = run.data.to_vec();
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
