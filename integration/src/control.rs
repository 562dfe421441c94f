//! gRPC `Control` clients over an agent's Unix socket.
//!
//! A path-named Unix socket is reachable from any network namespace, so the
//! test process talks to every node's agent without leaving its own.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ferry_proto::v1::control_client::ControlClient;
use ferry_proto::v1::{ListNodesRequest, ListNodesResponse};
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("connecting to {path}: {source}")]
    Connect {
        path: PathBuf,
        source: tonic::transport::Error,
    },
    #[error("ListNodes on {path}: {source}")]
    Rpc {
        path: PathBuf,
        source: Box<tonic::Status>,
    },
    #[error("{what} on {path}: no answer within {timeout:?}")]
    Timeout {
        what: &'static str,
        path: PathBuf,
        timeout: Duration,
    },
}

/// The URI is required by tonic but ignored by the connector; it only ends
/// up in the `:authority` header.
fn endpoint() -> Endpoint {
    Endpoint::from_static("http://ferryd.control")
}

fn connector(
    path: &Path,
) -> impl tower::Service<
    Uri,
    Response = TokioIo<tokio::net::UnixStream>,
    Error = std::io::Error,
    Future = impl Send + 'static,
> + Send
+ Clone
+ 'static {
    let path = path.to_owned();
    tower::service_fn(move |_: Uri| {
        let path = path.clone();
        async move {
            tokio::net::UnixStream::connect(path)
                .await
                .map(TokioIo::new)
        }
    })
}

/// A client that connects on first use and reconnects after failures (an
/// agent restarted by a test is picked up again). Must be called inside a
/// Tokio runtime: the channel spawns its worker task right away.
pub fn lazy_client(path: &Path) -> ControlClient<Channel> {
    assert!(
        tokio::runtime::Handle::try_current().is_ok(),
        "a control client needs a Tokio runtime (use #[tokio::test])"
    );
    ControlClient::new(endpoint().connect_with_connector_lazy(connector(path)))
}

/// Connects now, failing if nobody listens on `path`.
pub async fn connect(path: &Path) -> Result<ControlClient<Channel>, ControlError> {
    Ok(ControlClient::new(channel(path).await?))
}

/// A channel to the agent's control socket, for any service served there
/// (Control, health, reflection).
pub async fn channel(path: &Path) -> Result<Channel, ControlError> {
    endpoint()
        .connect_with_connector(connector(path))
        .await
        .map_err(|source| ControlError::Connect {
            path: path.to_owned(),
            source,
        })
}

/// One `ListNodes` round trip within `timeout`: the agent's readiness probe.
pub async fn list_nodes(path: &Path, timeout: Duration) -> Result<ListNodesResponse, ControlError> {
    let call = async {
        let mut client = connect(path).await?;
        client
            .list_nodes(ListNodesRequest {})
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| ControlError::Rpc {
                path: path.to_owned(),
                source: Box::new(s),
            })
    };
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| ControlError::Timeout {
            what: "ListNodes",
            path: path.to_owned(),
            timeout,
        })?
}
