//! A test cluster's CA, certificates and tokens, made by the code behind
//! `ferry cert` (`ferry_agent::security::certs`), and the client TLS
//! configurations tests use to talk to the agents as a node, an observer
//! or an operator would.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use ferry_agent::security::certs::{self, Ca};
use ferry_agent::security::{Role, SecurityError};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

/// The files of a cluster's security, in one directory (mode 0700, files
/// 0600, inside the cluster's temp dir: removed with it).
#[derive(Debug, Clone)]
pub struct ClusterTls {
    dir: PathBuf,
    /// Bearer token of each role, as a client holds it.
    tokens: BTreeMap<Role, String>,
}

/// One `[[tls.tokens]]` entry.
#[derive(Debug, Clone)]
pub struct TokenEntry {
    pub name: String,
    pub role: Role,
    pub sha256: String,
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

impl ClusterTls {
    /// A CA, a certificate per node (named and addressed as given), an
    /// observer's and an operator's client certificate (`observer.crt`,
    /// `operator.crt`) and a token per role, in `dir`.
    pub fn generate(dir: &Path, nodes: &[(String, IpAddr)]) -> Result<Self, SecurityError> {
        let ca = Ca::generate("ferry-test", 2)?;
        ca.write(dir, false)?;
        for (name, ip) in nodes {
            ca.node(name, &[*ip], 2)?.write(dir, name, false)?;
        }
        for role in [Role::Observer, Role::Operator] {
            ca.client(role.as_str(), role, 2)?
                .write(dir, role.as_str(), false)?;
        }
        let tokens = [Role::Observer, Role::Operator]
            .into_iter()
            .map(|r| (r, certs::new_token().0))
            .collect();
        Ok(ClusterTls {
            dir: dir.to_owned(),
            tokens,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join(certs::CA_CERT)
    }

    pub fn membership_key(&self) -> PathBuf {
        self.dir.join(certs::MEMBERSHIP_KEY)
    }

    /// (certificate, key) of a node or of a role's client (`observer`,
    /// `operator`).
    pub fn files(&self, stem: &str) -> (PathBuf, PathBuf) {
        (
            self.dir.join(format!("{stem}.crt")),
            self.dir.join(format!("{stem}.key")),
        )
    }

    pub fn token(&self, role: Role) -> &str {
        &self.tokens[&role]
    }

    pub fn token_entries(&self) -> Vec<TokenEntry> {
        self.tokens
            .iter()
            .map(|(role, token)| TokenEntry {
                name: format!("{role}-token"),
                role: *role,
                sha256: ferry_agent::security::authz::token_digest(token),
            })
            .collect()
    }

    fn identity(&self, stem: &str) -> Identity {
        let (cert, key) = self.files(stem);
        Identity::from_pem(read(&cert), read(&key))
    }

    /// TLS to `server_node` (its Peer port or its Control API on TCP),
    /// checking it against the CA, presenting the certificate `stem`
    /// (a node's name, `observer`, `operator`) or none.
    pub fn client(&self, server_node: &str, stem: Option<&str>) -> ClientTlsConfig {
        let mut c = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read(&self.ca_cert())))
            .domain_name(server_node);
        if let Some(stem) = stem {
            c = c.identity(self.identity(stem));
        }
        c
    }

    /// The Control API tokens for a node's config (`[[tls.tokens]]`
    /// entries, after its `[tls]`).
    pub fn token_section(&self) -> String {
        let mut t = String::new();
        for e in self.token_entries() {
            t.push_str(&format!(
                "\n[[tls.tokens]]\nname = \"{}\"\nrole = \"{}\"\nsha256 = \"{}\"\n",
                e.name, e.role, e.sha256
            ));
        }
        t
    }
}
