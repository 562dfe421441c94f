//! The cluster CA and its certificates, as `ferry cert` makes them (the
//! test harness calls the same functions).
//!
//! Every key is ECDSA P-256. Every file is written mode 0600 and never over
//! an existing one unless asked: overwriting `ca.key` by mistake would
//! orphan every certificate of the cluster.

use std::io::Write as _;
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use ring::rand::SecureRandom as _;

use super::{NODE_URI_PREFIX, ROLE_URI_PREFIX, Role, SecurityError};

/// The CA's certificate, in a CA directory.
pub const CA_CERT: &str = "ca.crt";
/// The CA's private key: keep it off the nodes.
pub const CA_KEY: &str = "ca.key";
/// The membership HMAC key (32 random bytes, hex), for every node.
pub const MEMBERSHIP_KEY: &str = "membership.key";

/// A certificate and its private key, both PEM.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

/// A CA able to sign.
pub struct Ca {
    pub cert_pem: String,
    key: KeyPair,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

fn random(n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .expect("the kernel's random source failed");
    b
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Valid from an hour ago (clocks of the cluster disagree a little) for
/// `days` days.
fn validity(params: &mut CertificateParams, days: u32) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(i64::from(days));
    // Random serials: two certificates for the same name stay distinct.
    let mut serial = random(16);
    serial[0] &= 0x7f;
    params.serial_number = Some(SerialNumber::from_slice(&serial));
}

fn uri(s: String) -> Result<SanType, SecurityError> {
    Ok(SanType::URI(s.try_into()?))
}

impl Ca {
    /// A new CA named `cluster` (its common name is "ferry CA <cluster>").
    pub fn generate(cluster: &str, days: u32) -> Result<Ca, SecurityError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, format!("ferry CA {cluster}"));
        dn.push(DnType::OrganizationName, "ferry");
        params.distinguished_name = dn;
        // Signs leaves only: no intermediate CA can be made from it.
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        validity(&mut params, days);
        let cert = params.self_signed(&key)?;
        Ok(Ca {
            cert_pem: cert.pem(),
            key,
        })
    }

    /// The CA in `dir` (`ca.crt`, `ca.key`).
    pub fn load(dir: &Path) -> Result<Ca, SecurityError> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read_to_string(&path).map_err(|source| SecurityError::Read {
                field: "--ca",
                path,
                source,
            })
        };
        let cert_pem = read(CA_CERT)?;
        let key = KeyPair::from_pem(&read(CA_KEY)?).map_err(|e| SecurityError::Invalid {
            field: "--ca",
            path: dir.join(CA_KEY),
            reason: format!("not a private key: {e}"),
        })?;
        // Checked here rather than at the first signature.
        Issuer::from_ca_cert_pem(&cert_pem, &key).map_err(|e| SecurityError::Invalid {
            field: "--ca",
            path: dir.join(CA_CERT),
            reason: format!("not a CA certificate: {e}"),
        })?;
        Ok(Ca { cert_pem, key })
    }

    /// Writes `ca.crt`, `ca.key` and a new `membership.key` into `dir`.
    pub fn write(&self, dir: &Path, force: bool) -> Result<Vec<PathBuf>, SecurityError> {
        let mut written = Vec::new();
        for (name, text) in [
            (CA_CERT, self.cert_pem.clone()),
            (CA_KEY, self.key.serialize_pem()),
            (MEMBERSHIP_KEY, format!("{}\n", hex(&random(32)))),
        ] {
            let path = dir.join(name);
            write_private(&path, text.as_bytes(), force)?;
            written.push(path);
        }
        Ok(written)
    }

    fn sign(&self, params: &CertificateParams) -> Result<Issued, SecurityError> {
        let issuer = Issuer::from_ca_cert_pem(&self.cert_pem, &self.key)?;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// A node's certificate: server and client of the Peer port, server of
    /// the Control API on TCP. It names the node as a DNS name (what peers
    /// verify), as `ferry:node:<name>` (what the Peer server checks), and
    /// carries its IP addresses (for clients that dial an address, grpcurl).
    pub fn node(&self, name: &str, ips: &[IpAddr], days: u32) -> Result<Issued, SecurityError> {
        if !crate::config::valid_node_name(name) {
            return Err(SecurityError::Usage(format!(
                "--name: {name:?} is not a node name (1-64 characters of a-z, A-Z, 0-9, '-', '_', '.')"
            )));
        }
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        dn.push(DnType::OrganizationName, "ferry");
        params.distinguished_name = dn;
        params.subject_alt_names = vec![
            SanType::DnsName(name.try_into()?),
            uri(format!("{NODE_URI_PREFIX}{name}"))?,
        ];
        params
            .subject_alt_names
            .extend(ips.iter().map(|ip| SanType::IpAddress(*ip)));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        validity(&mut params, days);
        self.sign(&params)
    }

    /// A Control API client's certificate for `role`, named `name`.
    pub fn client(&self, name: &str, role: Role, days: u32) -> Result<Issued, SecurityError> {
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        dn.push(DnType::OrganizationName, "ferry");
        dn.push(DnType::OrganizationalUnitName, role.as_str());
        params.distinguished_name = dn;
        params.subject_alt_names = vec![uri(format!("{ROLE_URI_PREFIX}{role}"))?];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        validity(&mut params, days);
        self.sign(&params)
    }
}

impl Issued {
    /// Writes `<dir>/<stem>.crt` and `<dir>/<stem>.key`.
    pub fn write(
        &self,
        dir: &Path,
        stem: &str,
        force: bool,
    ) -> Result<(PathBuf, PathBuf), SecurityError> {
        let cert = dir.join(format!("{stem}.crt"));
        let key = dir.join(format!("{stem}.key"));
        write_private(&cert, self.cert_pem.as_bytes(), force)?;
        write_private(&key, self.key_pem.as_bytes(), force)?;
        Ok((cert, key))
    }
}

/// A new bearer token and the SHA-256 (hex) that goes into the config.
pub fn new_token() -> (String, String) {
    let token = hex(&random(32));
    let digest = super::authz::token_digest(&token);
    (token, digest)
}

/// Writes `bytes` to `path`, mode 0600 from the first byte on (no window
/// in which another user could open it), creating `path`'s directory
/// (0700) if needed. An existing file is kept unless `force`.
pub fn write_private(path: &Path, bytes: &[u8], force: bool) -> Result<(), SecurityError> {
    let err = |source| SecurityError::Write {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(err)?;
    }
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).mode(0o600);
    if force {
        opts.create(true).truncate(true);
    } else {
        opts.create_new(true);
    }
    let mut f = opts.open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            SecurityError::Usage(format!(
                "{} exists: not overwritten (--force to replace it)",
                path.display()
            ))
        } else {
            err(e)
        }
    })?;
    // A file that existed keeps its mode on open: make sure of 0600.
    use std::os::unix::fs::PermissionsExt as _;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(err)?;
    f.write_all(bytes).map_err(err)?;
    f.sync_all().map_err(err)
}
