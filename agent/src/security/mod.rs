//! Cluster security: who may talk to an agent, and over what.
//!
//! - **Peer port (agent to agent)**: mutual TLS with the cluster CA. The
//!   server requires a client certificate the CA signed and that names a
//!   node (`ferry:node:<name>` URI SAN, see [`Identity`]); the client checks
//!   the server's certificate against the CA *and* the peer's node name,
//!   so an address learned from membership cannot send a migration to
//!   anyone but the node it names. Process memory and socket state cross
//!   this port: without a node certificate nothing is read or pushed.
//! - **Control API on TCP** (`control_listen`): TLS with the node's
//!   certificate; a client proves its role ([`Role`]) with a certificate
//!   the CA signed carrying a `ferry:role:<role>` URI SAN, or with a
//!   bearer token listed (as its SHA-256) in `[[tls.tokens]]`. The Unix
//!   socket stays what it was: root only, operator, no setup.
//! - **Membership datagrams**: HMAC-SHA256 with the cluster's membership
//!   key (`membership::auth` says why a MAC rather than signatures).
//!
//! Certificates and keys are made by `ferry cert` ([`certs`]).

pub mod authz;
pub mod certs;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tonic::transport::{Certificate, ClientTlsConfig, Identity as TlsIdentity, ServerTlsConfig};

use crate::config::TlsConfig;

/// URI SAN prefix naming a node: `ferry:node:node1`.
pub const NODE_URI_PREFIX: &str = "ferry:node:";
/// URI SAN prefix naming a Control API role: `ferry:role:operator`.
pub const ROLE_URI_PREFIX: &str = "ferry:role:";

/// How long a TLS handshake may take before the connection is dropped: a
/// client that connects and says nothing must not hold a task forever.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error("{field}: reading {path}: {source}")]
    Read {
        field: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{field}: {path}: {reason}")]
    Invalid {
        field: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("making a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("{path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Usage(String),
}

pub use crate::config::Role;

/// Who a (CA-verified) certificate says its holder is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The subject's common name, for messages and logs.
    pub common_name: String,
    /// `ferry:node:<name>`: a cluster node.
    pub node: Option<String>,
    /// `ferry:role:<role>`: a Control API client. An unknown role name is
    /// kept as `Err(name)`, so the refusal can say what was found.
    pub role: Option<Result<Role, String>>,
}

/// Reads the identity URIs out of a DER certificate. Called on certificates
/// rustls already verified against the cluster CA: parsing only.
pub fn identity_of(der: &[u8]) -> Result<Identity, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| e.to_string())?;
    let common_name = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .unwrap_or("")
        .to_owned();
    let mut id = Identity {
        common_name,
        node: None,
        role: None,
    };
    let san = cert.subject_alternative_name().map_err(|e| e.to_string())?;
    for name in san.iter().flat_map(|s| s.value.general_names.iter()) {
        if let x509_parser::extensions::GeneralName::URI(uri) = name {
            if let Some(n) = uri.strip_prefix(NODE_URI_PREFIX) {
                id.node = Some(n.to_owned());
            } else if let Some(r) = uri.strip_prefix(ROLE_URI_PREFIX) {
                id.role = Some(Role::parse(r).ok_or_else(|| r.to_owned()));
            }
        }
    }
    Ok(id)
}

/// The TLS material of a node, read once at start.
#[derive(Debug, Clone)]
pub struct TlsMaterial {
    ca_pem: Vec<u8>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    /// The node name the certificate carries.
    pub node: String,
    /// SHA-256 of each accepted bearer token, with its role and name.
    pub tokens: Arc<authz::Tokens>,
    /// The membership HMAC key, when configured.
    pub membership_key: Option<Vec<u8>>,
}

fn read(field: &'static str, path: &Path) -> Result<Vec<u8>, SecurityError> {
    std::fs::read(path).map_err(|source| SecurityError::Read {
        field,
        path: path.to_owned(),
        source,
    })
}

/// The DER certificates in a PEM file.
fn pem_certs(field: &'static str, path: &Path, pem: &[u8]) -> Result<Vec<Vec<u8>>, SecurityError> {
    let invalid = |reason: String| SecurityError::Invalid {
        field,
        path: path.to_owned(),
        reason,
    };
    let mut out = Vec::new();
    for block in x509_parser::pem::Pem::iter_from_buffer(pem) {
        let block = block.map_err(|e| invalid(format!("not PEM: {e}")))?;
        if block.label == "CERTIFICATE" {
            x509_parser::parse_x509_certificate(&block.contents)
                .map_err(|e| invalid(format!("not an X.509 certificate: {e}")))?;
            out.push(block.contents);
        }
    }
    if out.is_empty() {
        return Err(invalid("no CERTIFICATE in it".into()));
    }
    Ok(out)
}

impl TlsMaterial {
    /// Reads and checks the files `[tls]` names, for the node `node`: the
    /// certificate must be the CA's, name this node, and match its key. The
    /// error names the field.
    pub fn load(tls: &TlsConfig, node: &str) -> Result<Self, SecurityError> {
        let ca_pem = read("tls.ca", &tls.ca)?;
        let cert_pem = read("tls.cert", &tls.cert)?;
        let key_pem = read("tls.key", &tls.key)?;
        let ca = pem_certs("tls.ca", &tls.ca, &ca_pem)?;
        let chain = pem_certs("tls.cert", &tls.cert, &cert_pem)?;
        let invalid = |field: &'static str, path: &Path, reason: String| SecurityError::Invalid {
            field,
            path: path.to_owned(),
            reason,
        };
        let key = rcgen::KeyPair::from_pem(&String::from_utf8_lossy(&key_pem))
            .map_err(|e| invalid("tls.key", &tls.key, format!("not a private key: {e}")))?;
        let (_, leaf) = x509_parser::parse_x509_certificate(&chain[0])
            .map_err(|e| invalid("tls.cert", &tls.cert, e.to_string()))?;
        if leaf.public_key().raw != rcgen::PublicKeyData::subject_public_key_info(&key) {
            return Err(invalid(
                "tls.key",
                &tls.key,
                format!("is not the key of {}", tls.cert.display()),
            ));
        }
        let id = identity_of(&chain[0]).map_err(|e| invalid("tls.cert", &tls.cert, e))?;
        match id.node.as_deref() {
            Some(n) if n == node => {}
            Some(n) => {
                return Err(invalid(
                    "tls.cert",
                    &tls.cert,
                    format!("is node {n:?}'s certificate, this node is {node:?}"),
                ));
            }
            None => {
                return Err(invalid(
                    "tls.cert",
                    &tls.cert,
                    format!(
                        "is not a node certificate (no {NODE_URI_PREFIX}{node} URI): make one with `ferry cert node --name {node}`"
                    ),
                ));
            }
        }
        if !signed_by_any(&chain[0], &ca) {
            return Err(invalid(
                "tls.cert",
                &tls.cert,
                format!("is not signed by the CA in {}", tls.ca.display()),
            ));
        }
        let membership_key = match &tls.membership_key {
            Some(p) => Some(crate::membership::auth::read_key(p).map_err(|reason| {
                SecurityError::Invalid {
                    field: "tls.membership_key",
                    path: p.clone(),
                    reason,
                }
            })?),
            None => None,
        };
        Ok(TlsMaterial {
            ca_pem,
            cert_pem,
            key_pem,
            node: node.to_owned(),
            tokens: Arc::new(authz::Tokens::from_config(&tls.tokens)),
            membership_key,
        })
    }

    fn identity(&self) -> TlsIdentity {
        TlsIdentity::from_pem(&self.cert_pem, &self.key_pem)
    }

    fn ca(&self) -> Certificate {
        Certificate::from_pem(&self.ca_pem)
    }

    /// The Peer server: a client certificate signed by the CA is required
    /// in the handshake (no certificate, another CA's: the handshake fails).
    pub fn peer_server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity())
            .client_ca_root(self.ca())
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// The Control server on TCP: a client certificate is optional in the
    /// handshake (a token may stand for it), but if one is presented it
    /// must be the CA's; [`authz::ControlAuth`] then wants one or the other.
    pub fn control_server(&self) -> ServerTlsConfig {
        self.peer_server().client_auth_optional(true)
    }

    /// A client of node `peer`'s Peer port: this node's certificate, and the
    /// server must prove it is `peer` with a certificate of the CA.
    pub fn peer_client(&self, peer: &str) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(self.ca())
            .identity(self.identity())
            .domain_name(peer)
    }
}

/// Whether `leaf` carries a valid signature of one of the `cas`. A check
/// at load time that the files go together (rustls does the real chain
/// verification on every connection).
fn signed_by_any(leaf: &[u8], cas: &[Vec<u8>]) -> bool {
    let Ok((_, leaf)) = x509_parser::parse_x509_certificate(leaf) else {
        return false;
    };
    cas.iter().any(|ca| {
        x509_parser::parse_x509_certificate(ca).is_ok_and(|(_, ca)| {
            leaf.issuer() == ca.subject() && leaf.verify_signature(Some(ca.public_key())).is_ok()
        })
    })
}

#[cfg(test)]
mod tests;
