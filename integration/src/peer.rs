//! Talking to an agent's `Peer` service the way another node's agent does:
//! over TCP on the cluster network, from inside a node's namespace (the
//! cluster addresses do not exist in the test process's namespace).

use std::future::Future;
use std::net::SocketAddrV4;
use std::path::{Path, PathBuf};

use ferry_proto::v1::peer_client::PeerClient;
use ferry_proto::v1::{AbortRequest, HelloRequest, PrepareRequest};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

use crate::netns::{self, NetNsError};

#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error(transparent)]
    NetNs(#[from] NetNsError),
    #[error("building a runtime: {0}")]
    Runtime(std::io::Error),
    #[error("connecting to the peer service at {addr}: {source}")]
    Connect {
        addr: SocketAddrV4,
        source: tonic::transport::Error,
    },
    #[error("{call} on {addr}: {source}")]
    Rpc {
        call: &'static str,
        addr: SocketAddrV4,
        source: Box<tonic::Status>,
    },
}

/// Runs the future made by `f` on a fresh thread inside the namespace at
/// `netns`, on its own single-threaded runtime: every socket it opens is in
/// that namespace. Callable from sync code and from inside a runtime.
pub fn block_on_in<T, F, Fut>(netns: &Path, f: F) -> Result<T, PeerError>
where
    T: Send,
    F: FnOnce() -> Fut + Send,
    Fut: Future<Output = T>,
{
    netns::run_in(netns, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(PeerError::Runtime)?;
        Ok(runtime.block_on(f()))
    })?
}

/// Connects to a Peer service, over TLS with `tls`; call on a thread
/// inside a node's namespace (see [`block_on_in`]).
pub async fn connect(
    addr: SocketAddrV4,
    tls: Option<ClientTlsConfig>,
) -> Result<PeerClient<Channel>, PeerError> {
    let endpoint = match tls {
        Some(tls) => Endpoint::from_shared(format!("https://{addr}"))
            .expect("a socket address makes a valid URI")
            .tls_config(tls)
            .map_err(|source| PeerError::Connect { addr, source })?,
        None => Endpoint::from_shared(format!("http://{addr}"))
            .expect("a socket address makes a valid URI"),
    };
    let channel = endpoint
        .connect_timeout(std::time::Duration::from_secs(5))
        .connect()
        .await
        .map_err(|source| PeerError::Connect { addr, source })?;
    Ok(PeerClient::new(channel))
}

fn rpc_err(call: &'static str, addr: SocketAddrV4) -> impl FnOnce(tonic::Status) -> PeerError {
    move |s| PeerError::Rpc {
        call,
        addr,
        source: Box::new(s),
    }
}

/// An incoming-migration slot held on a destination agent, as a source in
/// the middle of a migration would hold it. Released (`Abort`) on drop.
#[derive(Debug)]
pub struct Reservation {
    netns: PathBuf,
    addr: SocketAddrV4,
    migration_id: String,
    tls: Option<ClientTlsConfig>,
    released: bool,
}

impl Reservation {
    /// `Hello` then `Prepare` (no process, no ports) to the agent at `addr`,
    /// from the namespace of node `source_node` (with its certificate in
    /// `tls` on a TLS cluster).
    pub fn reserve(
        netns: &Path,
        source_node: &str,
        addr: SocketAddrV4,
        migration_id: &str,
        tls: Option<ClientTlsConfig>,
    ) -> Result<Self, PeerError> {
        let t = tls.clone();
        block_on_in(netns, || async {
            let mut peer = connect(addr, t).await?;
            let hello = peer
                .hello(HelloRequest {
                    node: source_node.to_owned(),
                    protocol_versions: ferry_proto::PEER_PROTOCOL_VERSIONS.to_vec(),
                })
                .await
                .map_err(rpc_err("Hello", addr))?
                .into_inner();
            peer.prepare(PrepareRequest {
                protocol_version: hello.protocol_version,
                migration_id: migration_id.to_owned(),
                source_node: source_node.to_owned(),
                ..Default::default()
            })
            .await
            .map_err(rpc_err("Prepare", addr))?;
            Ok::<_, PeerError>(())
        })??;
        Ok(Self {
            netns: netns.to_owned(),
            addr,
            migration_id: migration_id.to_owned(),
            tls,
            released: false,
        })
    }

    pub fn migration_id(&self) -> &str {
        &self.migration_id
    }

    /// `Abort`s the reservation; idempotent.
    pub fn release(&mut self) -> Result<(), PeerError> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        let (addr, id, tls) = (self.addr, self.migration_id.clone(), self.tls.clone());
        block_on_in(&self.netns, || async move {
            connect(addr, tls)
                .await?
                .abort(AbortRequest {
                    migration_id: id,
                    reason: "test reservation released".into(),
                })
                .await
                .map_err(rpc_err("Abort", addr))?;
            Ok::<_, PeerError>(())
        })?
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            eprintln!(
                "ferry-integration: releasing reservation {}: {e}",
                self.migration_id
            );
        }
    }
}
