//! The connection to an agent's Control API: the local one over its Unix
//! socket, or a remote one over TLS with a client certificate or a token.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use ferry_proto::v1::control_client::ControlClient;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

use crate::args::Args;

/// Adds the bearer token, if any, to every call.
#[derive(Debug, Clone)]
pub(crate) struct BearerToken(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

pub(crate) type Client =
    ControlClient<tonic::service::interceptor::InterceptedService<Channel, BearerToken>>;

/// The local agent over its Unix socket, or a remote one over TLS.
pub(crate) async fn connect(args: &Args) -> Result<Client> {
    let Some(agent) = &args.agent else {
        return Ok(ControlClient::with_interceptor(
            connect_local(args.socket.clone()).await?,
            BearerToken(None),
        ));
    };
    let ca = args
        .ca
        .as_ref()
        .context("--agent needs --ca: the cluster CA's certificate")?;
    let name = match &args.agent_name {
        Some(n) => n.clone(),
        None => agent
            .rsplit_once(':')
            .map(|(h, _)| h.to_owned())
            .unwrap_or_else(|| agent.clone()),
    };
    let read = |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let mut tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(read(ca)?))
        .domain_name(name);
    if let (Some(cert), Some(key)) = (&args.cert, &args.key) {
        tls = tls.identity(tonic::transport::Identity::from_pem(
            read(cert)?,
            read(key)?,
        ));
    }
    let token = match &args.token {
        Some(t) => Some(
            format!("Bearer {t}")
                .parse()
                .context("--token: not a valid header value")?,
        ),
        None => None,
    };
    if args.cert.is_none() && token.is_none() {
        bail!("--agent needs credentials: --cert and --key, or --token");
    }
    let channel = Endpoint::from_shared(format!("https://{agent}"))
        .with_context(|| format!("--agent {agent:?}"))?
        .tls_config(tls)?
        .connect_timeout(std::time::Duration::from_secs(5))
        .connect()
        .await
        .with_context(|| format!("connecting to the agent at {agent}"))?;
    Ok(ControlClient::with_interceptor(channel, BearerToken(token)))
}

async fn connect_local(socket: PathBuf) -> Result<Channel> {
    let path = socket.clone();
    // The URI is required by the API but unused: the connector dials the
    // Unix socket.
    let channel = Endpoint::try_from("http://ferryd.local")?
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                tokio::net::UnixStream::connect(path)
                    .await
                    .map(TokioIo::new)
            }
        }))
        .await
        .with_context(|| {
            format!(
                "connecting to ferryd at {} (is it running? is this root?)",
                socket.display()
            )
        })?;
    Ok(channel)
}

/// An agent's refusal as an error: its gRPC code and message.
pub(crate) fn status_error(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", s.code(), s.message())
}
