use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

use super::certs::{Ca, new_token, write_private};
use super::*;
use crate::config::{Config, TlsConfig};

fn pem_to_der(pem: &str) -> Vec<u8> {
    x509_parser::pem::Pem::iter_from_buffer(pem.as_bytes())
        .next()
        .unwrap()
        .unwrap()
        .contents
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

/// A CA dir and node1's certificate in `dir`, and the `[tls]` naming them.
fn cluster(dir: &Path) -> (Ca, TlsConfig) {
    let ca = Ca::generate("test", 30).unwrap();
    ca.write(dir, false).unwrap();
    let ip: IpAddr = "198.19.0.1".parse().unwrap();
    ca.node("node1", &[ip], 30)
        .unwrap()
        .write(dir, "node1", false)
        .unwrap();
    let tls = TlsConfig {
        ca: dir.join(certs::CA_CERT),
        cert: dir.join("node1.crt"),
        key: dir.join("node1.key"),
        membership_key: Some(dir.join(certs::MEMBERSHIP_KEY)),
        tokens: vec![],
    };
    (ca, tls)
}

#[test]
fn certificates_carry_the_identity_the_checks_read() {
    let ca = Ca::generate("test", 30).unwrap();
    let node = ca
        .node("node-2", &["198.19.0.2".parse().unwrap()], 30)
        .unwrap();
    let id = identity_of(&pem_to_der(&node.cert_pem)).unwrap();
    assert_eq!(id.node.as_deref(), Some("node-2"));
    assert_eq!(id.role, None);
    let obs = ca.client("dash", Role::Observer, 30).unwrap();
    let id = identity_of(&pem_to_der(&obs.cert_pem)).unwrap();
    assert_eq!(
        (id.common_name.as_str(), id.role, id.node),
        ("dash", Some(Ok(Role::Observer)), None)
    );
    let op = ca.client("sched", Role::Operator, 30).unwrap();
    assert_eq!(
        identity_of(&pem_to_der(&op.cert_pem)).unwrap().role,
        Some(Ok(Role::Operator))
    );
    assert!(matches!(
        ca.node("no de", &[], 30),
        Err(SecurityError::Usage(m)) if m.contains("--name")
    ));
}

#[test]
fn files_are_root_only_and_never_silently_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let (_, tls) = cluster(dir.path());
    for f in [
        "ca.crt",
        "ca.key",
        "membership.key",
        "node1.crt",
        "node1.key",
    ] {
        assert_eq!(mode(&dir.path().join(f)), 0o600, "{f}");
    }
    let again = Ca::generate("test", 30).unwrap().write(dir.path(), false);
    assert!(
        matches!(&again, Err(SecurityError::Usage(m)) if m.contains("--force")),
        "{again:?}"
    );
    // A CA written elsewhere loads and signs certificates the node accepts.
    let loaded = Ca::load(dir.path()).unwrap();
    loaded
        .node("node1", &[], 30)
        .unwrap()
        .write(dir.path(), "node1", true)
        .unwrap();
    TlsMaterial::load(&tls, "node1").unwrap();
    // An existing file of another mode becomes 0600 when replaced.
    let p = dir.path().join("loose");
    std::fs::write(&p, "x").unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    write_private(&p, b"y", true).unwrap();
    assert_eq!(mode(&p), 0o600);
}

#[test]
fn tls_material_is_checked_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, tls) = cluster(dir.path());
    let m = TlsMaterial::load(&tls, "node1").unwrap();
    assert_eq!(m.membership_key.as_ref().map(Vec::len), Some(32));

    let err = |tls: &TlsConfig, node: &str| TlsMaterial::load(tls, node).unwrap_err().to_string();
    // Another node's certificate.
    let e = err(&tls, "node2");
    assert!(
        e.starts_with("tls.cert:") && e.contains("node \"node1\""),
        "{e}"
    );
    // A key that is not the certificate's.
    ca.node("node9", &[], 30)
        .unwrap()
        .write(dir.path(), "node9", false)
        .unwrap();
    let e = err(
        &TlsConfig {
            key: dir.path().join("node9.key"),
            ..tls.clone()
        },
        "node1",
    );
    assert!(e.starts_with("tls.key:"), "{e}");
    // A certificate of another CA.
    let other = tempfile::tempdir().unwrap();
    let (_, foreign) = cluster(other.path());
    let e = err(
        &TlsConfig {
            ca: tls.ca.clone(),
            ..foreign.clone()
        },
        "node1",
    );
    assert!(
        e.starts_with("tls.cert:") && e.contains("not signed"),
        "{e}"
    );
    // A client certificate is not a node's.
    ca.client("dash", Role::Observer, 30)
        .unwrap()
        .write(dir.path(), "dash", false)
        .unwrap();
    let e = err(
        &TlsConfig {
            cert: dir.path().join("dash.crt"),
            key: dir.path().join("dash.key"),
            ..tls.clone()
        },
        "node1",
    );
    assert!(e.contains("not a node certificate"), "{e}");
    // Missing and malformed files.
    let e = err(
        &TlsConfig {
            ca: dir.path().join("nope.crt"),
            ..tls.clone()
        },
        "node1",
    );
    assert!(e.starts_with("tls.ca:"), "{e}");
    let e = err(
        &TlsConfig {
            ca: dir.path().join("membership.key"),
            ..tls.clone()
        },
        "node1",
    );
    assert!(e.starts_with("tls.ca:"), "{e}");
    let e = err(
        &TlsConfig {
            membership_key: Some(dir.path().join("ca.crt")),
            ..tls.clone()
        },
        "node1",
    );
    assert!(e.starts_with("tls.membership_key:"), "{e}");
}

const BASE: &str = r#"
node = "node1"
work_dir = "/run/ferry/work"
[public]
interface = "pub0"
address = "198.18.0.100"
[cluster]
interface = "clu0"
address = "198.19.0.1"
peer_listen = "198.19.0.1:7100"
"#;

#[test]
fn the_tls_section_is_optional_and_validated() {
    let c = Config::parse(BASE, Path::new("x.toml")).unwrap();
    assert!(c.tls.is_none());
    assert!(
        !toml::to_string(&c).unwrap().contains("[tls]"),
        "no [tls] in the effective config when there is none"
    );
    let (_, digest) = new_token();
    let good = format!(
        "{BASE}[tls]\nca = \"/etc/ferry/tls/ca.crt\"\ncert = \"/etc/ferry/tls/node1.crt\"\n\
         key = \"/etc/ferry/tls/node1.key\"\nmembership_key = \"/etc/ferry/tls/membership.key\"\n\
         [[tls.tokens]]\nname = \"sched\"\nrole = \"operator\"\nsha256 = \"{digest}\"\n"
    );
    let c = Config::parse(&good, Path::new("x.toml")).unwrap();
    let tls = c.tls.as_ref().unwrap();
    assert_eq!(tls.tokens[0].role, Role::Operator);
    // The effective config round-trips.
    Config::parse(&toml::to_string(&c).unwrap(), Path::new("y.toml")).unwrap();

    let bad = |text: String, field: &str| {
        let e = Config::parse(&text, Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(field), "{field}: {e}");
    };
    bad(good.replace(&digest, "abc"), "tls.tokens[0].sha256");
    bad(good.replace("\"operator\"", "\"admin\""), "role");
    bad(good.replace("cert = ", "#cert = "), "cert");
    bad(
        good.replace("key = \"/etc/ferry/tls/node1.key\"", "key = \"\""),
        "tls.key",
    );
    bad(format!("{good}bogus = 1\n"), "bogus");
    bad(
        format!(
            "{good}[[tls.tokens]]\nname = \"sched\"\nrole = \"observer\"\nsha256 = \"{digest}\"\n"
        ),
        "tls.tokens[1].name",
    );
    // Membership on: the key is required.
    bad(
        format!(
            "{}\n[membership]\nenabled = true\n",
            good.replace("membership_key = ", "#membership_key = ")
        ),
        "tls.membership_key",
    );
    Config::parse(
        &format!("{good}\n[membership]\nenabled = true\n"),
        Path::new("x.toml"),
    )
    .unwrap();
}

#[test]
fn tokens_are_stored_as_digests() {
    let (token, digest) = new_token();
    assert_eq!(token.len(), 64);
    assert_eq!(authz::token_digest(&token), digest);
    assert_ne!(token, digest);
}
