//! Who may call what: the Control API's roles and the Peer port's node
//! check, as tower layers in front of the gRPC routes. Layers rather than
//! per-service interceptors so that health and reflection, served beside
//! Control, are covered by the same rule and no route can be forgotten.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::Status;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use super::{Identity, Role, identity_of};
use crate::config::TokenConfig;

/// The role a Control API method needs, by its gRPC path. Only the
/// read-only methods are listed: anything else, a method added later
/// included, needs an operator (fail closed).
pub fn required_role(path: &str) -> Role {
    const READ_ONLY: &[&str] = &[
        "/ferry.v1.Control/ListNodes",
        "/ferry.v1.Control/ListGroups",
        "/ferry.v1.Control/ListProcesses",
        "/ferry.v1.Control/GetMigration",
        "/ferry.v1.Control/GetDataPlane",
        "/ferry.v1.Control/GetBalancer",
        "/ferry.v1.Control/WatchEvents",
        "/ferry.v1.Control/WaitProcess",
    ];
    if READ_ONLY.contains(&path)
        || path.starts_with("/grpc.health.v1.Health/")
        || path.starts_with("/grpc.reflection.")
    {
        Role::Observer
    } else {
        Role::Operator
    }
}

/// SHA-256 of a bearer token, lower-case hex: what `[[tls.tokens]]` holds,
/// so that the config file does not give the tokens away.
pub fn token_digest(token: &str) -> String {
    ring::digest::digest(&ring::digest::SHA256, token.as_bytes())
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The accepted bearer tokens, by digest.
#[derive(Debug, Default)]
pub struct Tokens {
    by_digest: HashMap<String, (String, Role)>,
}

impl Tokens {
    pub fn from_config(tokens: &[TokenConfig]) -> Self {
        Tokens {
            by_digest: tokens
                .iter()
                .map(|t| (t.sha256.to_ascii_lowercase(), (t.name.clone(), t.role)))
                .collect(),
        }
    }

    /// The name and role of `token`. The lookup compares digests, not the
    /// token: timing tells an attacker about a digest, which does not help
    /// to find a token that hashes to it.
    fn get(&self, token: &str) -> Option<&(String, Role)> {
        self.by_digest.get(&token_digest(token))
    }
}

/// Who called, once authenticated; put into the request's extensions for
/// the handlers' logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// A certificate's common name or a token's name.
    pub name: String,
    pub role: Role,
    /// "certificate" or "token".
    pub by: &'static str,
}

fn peer_identity<B>(req: &http::Request<B>) -> Option<Result<Identity, String>> {
    let certs = req
        .extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()?
        .peer_certs()?;
    let leaf = certs.first()?;
    Some(identity_of(leaf))
}

/// The Control API's check: a bearer token or a client certificate with a
/// role, and a role that may call the method.
pub fn authorize_control<B>(tokens: &Tokens, req: &http::Request<B>) -> Result<Caller, Status> {
    let path = req.uri().path();
    let needed = required_role(path);
    let caller = match req.headers().get(http::header::AUTHORIZATION) {
        Some(value) => {
            let token = value
                .to_str()
                .ok()
                .and_then(|v| {
                    v.strip_prefix("Bearer ")
                        .or_else(|| v.strip_prefix("bearer "))
                })
                .map(str::trim)
                .ok_or_else(|| {
                    Status::unauthenticated(
                        "authorization: not a bearer token (give `authorization: Bearer <token>`)",
                    )
                })?;
            let (name, role) = tokens.get(token).ok_or_else(|| {
                Status::unauthenticated(
                    "authorization: the bearer token is not one of [[tls.tokens]]",
                )
            })?;
            Caller {
                name: name.clone(),
                role: *role,
                by: "token",
            }
        }
        None => match peer_identity(req) {
            None => {
                return Err(Status::unauthenticated(
                    "no credentials: present a client certificate of the cluster CA with a \
                     ferry:role:observer or ferry:role:operator URI (`ferry cert client`), \
                     or an `authorization: Bearer <token>` header",
                ));
            }
            Some(Err(e)) => {
                return Err(Status::unauthenticated(format!(
                    "client certificate unreadable: {e}"
                )));
            }
            Some(Ok(id)) => match (id.role, id.node) {
                (Some(Ok(role)), _) => Caller {
                    name: id.common_name,
                    role,
                    by: "certificate",
                },
                (Some(Err(unknown)), _) => {
                    return Err(Status::unauthenticated(format!(
                        "client certificate {:?}: unknown role {unknown:?} (observer or operator)",
                        id.common_name
                    )));
                }
                // A node of the cluster may already push migrations over
                // the Peer port: it is an operator here too (an agent
                // forwarding a call for the cluster).
                (None, Some(node)) => Caller {
                    name: node,
                    role: Role::Operator,
                    by: "certificate",
                },
                (None, None) => {
                    return Err(Status::unauthenticated(format!(
                        "client certificate {:?} carries no ferry:role: URI (make one with \
                         `ferry cert client --role ...`)",
                        id.common_name
                    )));
                }
            },
        },
    };
    if caller.role < needed {
        return Err(Status::permission_denied(format!(
            "{path} needs role {needed}; {} {:?} is {}",
            caller.by, caller.name, caller.role
        )));
    }
    Ok(caller)
}

/// The Peer port's check, after rustls verified the client certificate
/// against the CA: it must be a node's (a Control client's certificate of
/// the same CA is not a node).
pub fn authorize_peer<B>(req: &http::Request<B>) -> Result<Caller, Status> {
    match peer_identity(req) {
        Some(Ok(Identity {
            node: Some(node), ..
        })) => Ok(Caller {
            name: node,
            role: Role::Operator,
            by: "certificate",
        }),
        Some(Ok(id)) => Err(Status::permission_denied(format!(
            "peer port: certificate {:?} is not a node certificate (no ferry:node: URI)",
            id.common_name
        ))),
        Some(Err(e)) => Err(Status::unauthenticated(format!(
            "peer port: client certificate unreadable: {e}"
        ))),
        None => Err(Status::unauthenticated(
            "peer port: no client certificate of the cluster CA",
        )),
    }
}

type Check = Arc<dyn Fn(&http::Request<tonic::body::Body>) -> Result<Caller, Status> + Send + Sync>;

/// A tower layer that runs a check before the routes and answers a refusal
/// itself (a gRPC status in an HTTP 200, as gRPC wants).
#[derive(Clone)]
pub struct AuthLayer {
    check: Check,
    what: &'static str,
}

impl std::fmt::Debug for AuthLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthLayer")
            .field("what", &self.what)
            .finish()
    }
}

impl AuthLayer {
    /// The Control API on TCP.
    pub fn control(tokens: Arc<Tokens>) -> Self {
        AuthLayer {
            check: Arc::new(move |req: &http::Request<tonic::body::Body>| {
                authorize_control(&tokens, req)
            }),
            what: "control",
        }
    }

    /// The Peer port.
    pub fn peer() -> Self {
        AuthLayer {
            check: Arc::new(authorize_peer),
            what: "peer",
        }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct AuthService<S> {
    inner: S,
    layer: AuthLayer,
}

impl<S> tower::Service<http::Request<tonic::body::Body>> for AuthService<S>
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<tonic::body::Body>) -> Self::Future {
        match (self.layer.check)(&req) {
            Ok(caller) => {
                tracing::trace!(
                    listener = self.layer.what,
                    path = req.uri().path(),
                    caller = %caller.name,
                    role = %caller.role,
                    "authorized"
                );
                req.extensions_mut().insert(caller);
                Box::pin(self.inner.call(req))
            }
            Err(status) => {
                tracing::info!(
                    listener = self.layer.what,
                    path = req.uri().path(),
                    code = ?status.code(),
                    reason = status.message(),
                    "call refused"
                );
                Box::pin(async move { Ok(status.into_http()) })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(path: &str, auth: Option<&str>) -> http::Request<()> {
        let mut b = http::Request::builder().uri(format!("http://x{path}"));
        if let Some(a) = auth {
            b = b.header("authorization", a);
        }
        b.body(()).unwrap()
    }

    fn tokens() -> Tokens {
        Tokens::from_config(&[
            TokenConfig {
                name: "dash".into(),
                role: Role::Observer,
                sha256: token_digest("obs-secret"),
            },
            TokenConfig {
                name: "sched".into(),
                role: Role::Operator,
                sha256: token_digest("op-secret").to_ascii_uppercase(),
            },
        ])
    }

    #[test]
    fn read_only_methods_need_an_observer_everything_else_an_operator() {
        for p in [
            "/ferry.v1.Control/ListNodes",
            "/ferry.v1.Control/ListProcesses",
            "/ferry.v1.Control/GetMigration",
            "/ferry.v1.Control/GetDataPlane",
            "/ferry.v1.Control/GetBalancer",
            "/grpc.health.v1.Health/Check",
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        ] {
            assert_eq!(required_role(p), Role::Observer, "{p}");
        }
        for p in [
            "/ferry.v1.Control/Migrate",
            "/ferry.v1.Control/RunProcess",
            "/ferry.v1.Control/SetBalancer",
            "/ferry.v1.Control/SomethingAddedLater",
            "/ferry.v1.Peer/Prepare",
            "",
        ] {
            assert_eq!(required_role(p), Role::Operator, "{p}");
        }
        assert!(Role::Operator > Role::Observer);
    }

    #[test]
    fn tokens_map_to_roles_and_roles_gate_methods() {
        let t = tokens();
        let ok = authorize_control(
            &t,
            &req("/ferry.v1.Control/ListNodes", Some("Bearer obs-secret")),
        )
        .unwrap();
        assert_eq!((ok.name.as_str(), ok.role), ("dash", Role::Observer));
        let denied = authorize_control(
            &t,
            &req("/ferry.v1.Control/Migrate", Some("Bearer obs-secret")),
        )
        .unwrap_err();
        assert_eq!(denied.code(), tonic::Code::PermissionDenied);
        assert!(
            denied.message().contains("needs role operator"),
            "{denied:?}"
        );
        let op = authorize_control(
            &t,
            &req("/ferry.v1.Control/Migrate", Some("Bearer op-secret")),
        )
        .unwrap();
        assert_eq!(op.role, Role::Operator);
        for bad in [Some("Bearer nope"), Some("Basic abc"), None] {
            let e = authorize_control(&t, &req("/ferry.v1.Control/ListNodes", bad)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "{bad:?}: {e:?}");
        }
        let none = authorize_control(&t, &req("/ferry.v1.Control/ListNodes", None)).unwrap_err();
        assert!(none.message().contains("no credentials"), "{none:?}");
    }

    #[test]
    fn the_peer_port_wants_a_node_certificate() {
        let e = authorize_peer(&req("/ferry.v1.Peer/Prepare", None)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
    }
}
