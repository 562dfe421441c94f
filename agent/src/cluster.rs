//! The other nodes of the cluster as this agent knows them: the configured
//! `[[peers]]` and those membership found, their addresses, and Peer
//! connections to them (mutual TLS when `[tls]` is set).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use ferry_proto::v1::peer_client::PeerClient;
use tonic::transport::{Channel, Endpoint};

use crate::config::{Config, PeerConfig};
use crate::error_chain::error_chain;
use crate::membership::{MemberState, Membership};
use crate::security::TlsMaterial;

/// Why a Peer connection to a node could not be opened.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{node} unreachable at {address}: {reason}")]
pub struct Unreachable {
    pub node: String,
    pub address: String,
    pub reason: String,
}

/// Why `Peer.Hello` to a node got no answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum HelloFailed {
    #[error(transparent)]
    Unreachable(#[from] Unreachable),
    /// Its agent answered with an error.
    #[error("{}", .0.message())]
    Refused(tonic::Status),
    #[error("no answer within 2 s")]
    Timeout,
}

/// An address or TLS setting that makes no Peer endpoint.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct BadEndpoint(String);

/// This node's view of the cluster.
#[derive(Debug)]
pub struct Cluster {
    node: String,
    cluster_address: IpAddr,
    configured: Vec<PeerConfig>,
    /// SWIM membership, when `[membership] enabled`.
    membership: Option<Arc<Membership>>,
    /// This node's certificate and the cluster CA, when `[tls]` is set:
    /// then every Peer connection is mutual TLS.
    tls: Option<TlsMaterial>,
    /// `peer_timeout_secs`: also how long a Peer connection may stay
    /// silent (see [`keepalive`]).
    peer_timeout: Duration,
}

/// HTTP/2 keepalive of a Peer connection that waits `peer_timeout` at most
/// for an answer: a ping every half of it, and the connection closed when
/// a ping is not answered within it. A connection whose peer is cut off
/// (no reset, no ICMP: packets just vanish) would otherwise hang until the
/// kernel gives up on it after a quarter of an hour; a post-copy's page
/// stream, which has no end of its own to wait for, would hold the
/// restored process on its faults as long. Returns (interval, timeout).
pub fn keepalive(peer_timeout: Duration) -> (Duration, Duration) {
    ((peer_timeout / 2).max(Duration::from_secs(1)), peer_timeout)
}

impl Cluster {
    pub fn new(
        config: &Config,
        membership: Option<Arc<Membership>>,
        tls: Option<TlsMaterial>,
    ) -> Self {
        Self {
            node: config.node.clone(),
            cluster_address: config.cluster.address,
            configured: config.peers.clone(),
            membership,
            tls,
            peer_timeout: Duration::from_secs(config.peer_timeout_secs),
        }
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    pub fn membership(&self) -> Option<&Arc<Membership>> {
        self.membership.as_ref()
    }

    pub fn tls(&self) -> Option<&TlsMaterial> {
        self.tls.as_ref()
    }

    /// Every other node this agent knows: the configured `[[peers]]`, then
    /// the nodes membership found that the configuration does not list
    /// (alive or suspect, not down). A configured address wins.
    pub fn known_peers(&self) -> Vec<PeerConfig> {
        let mut peers = self.configured.clone();
        if let Some(m) = &self.membership {
            for member in m.members() {
                let name = &member.ident.name;
                if *name != self.node
                    && member.state != MemberState::Down
                    && !peers.iter().any(|p| p.name == *name)
                {
                    peers.push(PeerConfig {
                        name: name.clone(),
                        address: member.ident.peer,
                    });
                }
            }
        }
        peers
    }

    /// The configured `[[peers]]` only.
    pub fn configured_peers(&self) -> &[PeerConfig] {
        &self.configured
    }

    /// The Peer address of node `name`: configured, or found by membership.
    pub fn peer(&self, name: &str) -> Option<PeerConfig> {
        if let Some(p) = self.configured.iter().find(|p| p.name == name) {
            return Some(p.clone());
        }
        let address = self.membership.as_ref()?.peer_address(name)?;
        Some(PeerConfig {
            name: name.to_owned(),
            address,
        })
    }

    /// The cluster address of node `name` (this node's own included).
    pub fn cluster_address_of(&self, name: &str) -> Option<IpAddr> {
        if name == self.node {
            return Some(self.cluster_address);
        }
        Some(self.peer(name)?.address.ip())
    }

    /// The peer whose cluster address is `ip`.
    pub fn peer_at(&self, ip: IpAddr) -> Option<PeerConfig> {
        self.known_peers()
            .into_iter()
            .find(|p| p.address.ip() == ip)
    }

    /// Where node `name`'s Peer port is reached: over mutual TLS when
    /// `[tls]` is set, the server's certificate checked against the CA and
    /// the node's name (an address from membership or the config only says
    /// where to dial, not whom the migration goes to).
    pub fn peer_endpoint(&self, name: &str, address: SocketAddr) -> Result<Endpoint, BadEndpoint> {
        match &self.tls {
            Some(tls) => Endpoint::from_shared(format!("https://{address}"))
                .and_then(|e| e.tls_config(tls.peer_client(name))),
            None => Endpoint::from_shared(format!("http://{address}")),
        }
        .map_err(|e| BadEndpoint(error_chain(&e)))
    }

    /// `Peer.Hello` to `peer`, answered within 2 s, or why not.
    pub async fn hello(
        &self,
        peer: &PeerConfig,
    ) -> Result<ferry_proto::v1::HelloResponse, HelloFailed> {
        let hello = async {
            let mut client = self.peer_client(peer).await?;
            client
                .hello(ferry_proto::v1::HelloRequest {
                    node: self.node.clone(),
                    protocol_versions: ferry_proto::PEER_PROTOCOL_VERSIONS.to_vec(),
                })
                .await
                .map(|r| r.into_inner())
                .map_err(HelloFailed::Refused)
        };
        match tokio::time::timeout(Duration::from_secs(2), hello).await {
            Ok(answer) => answer,
            Err(_) => Err(HelloFailed::Timeout),
        }
    }

    /// A Peer client for `peer`, connected with a short timeout.
    pub async fn peer_client(&self, peer: &PeerConfig) -> Result<PeerClient<Channel>, Unreachable> {
        Ok(PeerClient::new(self.peer_channel(peer).await?)
            .max_decoding_message_size(16 << 20)
            .max_encoding_message_size(16 << 20))
    }

    /// A channel to `peer`'s Peer port (every agent-to-agent service is
    /// served there), connected with a short timeout.
    pub async fn peer_channel(&self, peer: &PeerConfig) -> Result<Channel, Unreachable> {
        let unreachable = |reason: String| Unreachable {
            node: peer.name.clone(),
            address: peer.address.to_string(),
            reason,
        };
        let endpoint = self
            .peer_endpoint(&peer.name, peer.address)
            .map_err(|e| unreachable(e.to_string()))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true);
        let (interval, timeout) = keepalive(self.peer_timeout);
        let endpoint = endpoint
            .http2_keep_alive_interval(interval)
            .keep_alive_timeout(timeout);
        // TLS runs over a read buffer (crate::peer_io).
        let address = peer.address;
        let connect = tower::service_fn(move |_: http::Uri| async move {
            let tcp = tokio::net::TcpStream::connect(address).await?;
            tcp.set_nodelay(true)?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                crate::peer_io::BufferedTcp::new(tcp),
            ))
        });
        endpoint
            .connect_with_connector(connect)
            .await
            .map_err(|e| unreachable(error_chain(&e)))
    }
}
