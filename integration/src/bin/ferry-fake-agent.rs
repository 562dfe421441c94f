//! `ferry-fake-agent --config ferryd.toml`: a stand-in for `ferryd` with
//! which the harness tests its own agent plumbing while the real agent may
//! not build or run: it reads the config the harness wrote (strictly, with
//! the agent's field names), must run in the node's network namespace (it
//! binds `peer_listen`), serves `Control.ListNodes` on the Unix socket
//! (asking every peer's `Hello`) and a Peer service with the real one-slot
//! `Prepare`/`Abort` reservation, and exits cleanly on SIGTERM.
//! Everything else answers UNIMPLEMENTED.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use ferry_proto::v1::control_server::{Control, ControlServer};
use ferry_proto::v1::peer_client::PeerClient;
use ferry_proto::v1::peer_server::{Peer, PeerServer};
use ferry_proto::v1::{
    AbortRequest, AbortResponse, CommitRequest, CommitResponse, GetMigrationRequest, HelloRequest,
    HelloResponse, ImageChunk, ListNodesRequest, ListNodesResponse, ListProcessesRequest,
    ListProcessesResponse, MigrateRequest, MigrationEvent, MigrationReport, Node, PrepareRequest,
    PrepareResponse, RestoreRequest, RestoreResponse, RunProcessRequest, RunProcessResponse,
    TransferImagesResponse,
};
use serde::Deserialize;
use tonic::{Request, Response, Status};

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, short)]
    config: PathBuf,
}

/// The agent's config contract (`ferry_agent::config::Config`), strictly.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)] // every field is parsed to hold the contract; not all are used
struct Config {
    node: String,
    work_dir: PathBuf,
    criu_path: PathBuf,
    criu_log_level: Option<i32>,
    control_socket: PathBuf,
    control_listen: Option<SocketAddr>,
    public: Public,
    cluster: ClusterSide,
    #[serde(default)]
    peers: Vec<PeerEntry>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct Public {
    interface: String,
    address: Ipv4Addr,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct ClusterSide {
    interface: String,
    address: Ipv4Addr,
    peer_listen: SocketAddr,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct PeerEntry {
    name: String,
    address: SocketAddr,
}

fn main() -> ExitCode {
    match main_exec() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry-fake-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn main_exec() -> Result<()> {
    let args = Args::parse();
    let text = std::fs::read_to_string(&args.config)
        .with_context(|| format!("reading {}", args.config.display()))?;
    let config: Config =
        toml::from_str(&text).with_context(|| format!("parsing {}", args.config.display()))?;
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    let fs = nix::sys::statfs::statfs(&config.work_dir)
        .with_context(|| format!("statfs {}", config.work_dir.display()))?;
    if fs.filesystem_type().0 as i64 != TMPFS_MAGIC {
        bail!("work_dir {} is not a tmpfs", config.work_dir.display());
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?
        .block_on(serve(config))
}

async fn serve(config: Config) -> Result<()> {
    // Only possible inside the node's namespace: the address lives there.
    let peer_listener = tokio::net::TcpListener::bind(config.cluster.peer_listen)
        .await
        .with_context(|| format!("binding {}", config.cluster.peer_listen))?;
    let _ = std::fs::remove_file(&config.control_socket);
    let control_listener = tokio::net::UnixListener::bind(&config.control_socket)
        .with_context(|| format!("binding {}", config.control_socket.display()))?;
    eprintln!(
        "ferry-fake-agent {} serving: peer {}, control {}",
        config.node,
        config.cluster.peer_listen,
        config.control_socket.display()
    );

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let peer = tonic::transport::Server::builder()
        .add_service(PeerServer::new(FakePeer {
            node: config.node.clone(),
            slot: Mutex::new(None),
        }))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(peer_listener),
            stopped(stop_rx.clone()),
        );
    let control = tonic::transport::Server::builder()
        .add_service(ControlServer::new(FakeControl {
            config: config.clone(),
        }))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(control_listener),
            stopped(stop_rx),
        );
    let signals = async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        eprintln!("ferry-fake-agent {}: stopping", config.node);
        let _ = stop_tx.send(true);
        Ok::<_, std::io::Error>(())
    };
    let (p, c, s) = tokio::join!(peer, control, signals);
    p.context("peer service")?;
    c.context("control service")?;
    s.context("signals")?;
    let _ = std::fs::remove_file(&config.control_socket);
    Ok(())
}

struct FakeControl {
    config: Config,
}

#[tonic::async_trait]
impl Control for FakeControl {
    async fn list_nodes(
        &self,
        _: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        let mut nodes = vec![Node {
            name: self.config.node.clone(),
            peer_address: self.config.cluster.peer_listen.to_string(),
            is_self: true,
            reachable: true,
            peer_protocol_version: ferry_proto::PEER_PROTOCOL_VERSION,
            ..Default::default()
        }];
        for p in &self.config.peers {
            let hello = async {
                let mut client = PeerClient::connect(format!("http://{}", p.address)).await?;
                let r = client
                    .hello(HelloRequest {
                        node: self.config.node.clone(),
                        protocol_versions: ferry_proto::PEER_PROTOCOL_VERSIONS.to_vec(),
                    })
                    .await?;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(r.into_inner())
            };
            let mut node = Node {
                name: p.name.clone(),
                peer_address: p.address.to_string(),
                ..Default::default()
            };
            match tokio::time::timeout(Duration::from_secs(1), hello).await {
                Ok(Ok(h)) => {
                    node.reachable = h.node == p.name;
                    node.peer_protocol_version = h.protocol_version;
                }
                Ok(Err(e)) => node.error = e.to_string(),
                Err(_) => node.error = "no answer within 1s".into(),
            }
            nodes.push(node);
        }
        Ok(Response::new(ListNodesResponse { nodes }))
    }

    async fn list_processes(
        &self,
        _: Request<ListProcessesRequest>,
    ) -> Result<Response<ListProcessesResponse>, Status> {
        Ok(Response::new(ListProcessesResponse::default()))
    }

    async fn run_process(
        &self,
        _: Request<RunProcessRequest>,
    ) -> Result<Response<RunProcessResponse>, Status> {
        Err(Status::unimplemented("fake agent"))
    }

    type MigrateStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<MigrationEvent, Status>> + Send + 'static>>;

    async fn migrate(
        &self,
        _: Request<MigrateRequest>,
    ) -> Result<Response<Self::MigrateStream>, Status> {
        Err(Status::unimplemented("fake agent"))
    }

    async fn get_migration(
        &self,
        _: Request<GetMigrationRequest>,
    ) -> Result<Response<MigrationReport>, Status> {
        Err(Status::unimplemented("fake agent"))
    }
}

struct FakePeer {
    node: String,
    /// The one incoming migration this node may hold.
    slot: Mutex<Option<String>>,
}

#[tonic::async_trait]
impl Peer for FakePeer {
    async fn hello(&self, _: Request<HelloRequest>) -> Result<Response<HelloResponse>, Status> {
        Ok(Response::new(HelloResponse {
            node: self.node.clone(),
            protocol_version: ferry_proto::PEER_PROTOCOL_VERSION,
            managed_processes: 0,
        }))
    }

    async fn prepare(
        &self,
        req: Request<PrepareRequest>,
    ) -> Result<Response<PrepareResponse>, Status> {
        let req = req.into_inner();
        let mut slot = self.slot.lock().map_err(|_| Status::internal("poisoned"))?;
        if let Some(cur) = slot.as_ref() {
            return Err(Status::resource_exhausted(format!(
                "{} is busy with incoming migration {cur}",
                self.node
            )));
        }
        *slot = Some(req.migration_id);
        Ok(Response::new(PrepareResponse {}))
    }

    async fn transfer_images(
        &self,
        _: Request<tonic::Streaming<ImageChunk>>,
    ) -> Result<Response<TransferImagesResponse>, Status> {
        Err(Status::unimplemented("fake agent"))
    }

    async fn restore(
        &self,
        _: Request<RestoreRequest>,
    ) -> Result<Response<RestoreResponse>, Status> {
        Err(Status::unimplemented("fake agent"))
    }

    async fn commit(&self, _: Request<CommitRequest>) -> Result<Response<CommitResponse>, Status> {
        Err(Status::unimplemented("fake agent"))
    }

    async fn abort(&self, req: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        let id = req.into_inner().migration_id;
        let mut slot = self.slot.lock().map_err(|_| Status::internal("poisoned"))?;
        if slot.as_deref() != Some(id.as_str()) {
            return Err(Status::not_found(format!("no incoming migration {id}")));
        }
        *slot = None;
        Ok(Response::new(AbortResponse {}))
    }
}
