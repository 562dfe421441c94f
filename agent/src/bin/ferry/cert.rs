//! `ferry cert`: the cluster's CA, node and client certificates and bearer
//! tokens, written as files; no agent is asked.

use std::path::PathBuf;

use anyhow::{Context, Result};
use serde_json::json;

use crate::args::CertCommand;

/// `ferry cert ...`: files only, no agent.
pub(crate) fn run(cmd: CertCommand, as_json: bool) -> Result<()> {
    use ferry_agent::security::Role;
    use ferry_agent::security::certs::{self, Ca};
    let role = |r: &str| Role::parse(r).context("--role: observer or operator");
    let mut written: Vec<PathBuf> = Vec::new();
    let mut config = String::new();
    match cmd {
        CertCommand::Ca {
            out,
            name,
            days,
            force,
        } => {
            written = Ca::generate(&name, days)?.write(&out, force)?;
            config = format!(
                "[tls]\nca = {:?}\nmembership_key = {:?}\n",
                out.join(certs::CA_CERT),
                out.join(certs::MEMBERSHIP_KEY)
            );
        }
        CertCommand::Node {
            name,
            ip,
            ca,
            out,
            days,
            force,
        } => {
            let (cert, key) = Ca::load(&ca)?
                .node(&name, &ip, days)?
                .write(&out, &name, force)?;
            config = format!("cert = {cert:?}\nkey = {key:?}\n");
            written.extend([cert, key]);
        }
        CertCommand::Client {
            role: r,
            name,
            ca,
            out,
            days,
            force,
        } => {
            let (cert, key) = Ca::load(&ca)?
                .client(&name, role(&r)?, days)?
                .write(&out, &name, force)?;
            written.extend([cert, key]);
        }
        CertCommand::Token { role: r, name } => {
            let role = role(&r)?;
            let (token, digest) = certs::new_token();
            if as_json {
                println!(
                    "{}",
                    json!({"name": name, "role": role.as_str(), "token": token, "sha256": digest})
                );
            } else {
                println!("token: {token}");
                println!(
                    "\n# for every node's ferryd.toml:\n[[tls.tokens]]\nname = {name:?}\nrole = \"{role}\"\nsha256 = \"{digest}\""
                );
            }
            return Ok(());
        }
    }
    if as_json {
        println!("{}", json!({ "written": written }));
    } else {
        for p in &written {
            println!("wrote {}", p.display());
        }
        if !config.is_empty() {
            println!("\n# for ferryd.toml:\n{config}");
        }
    }
    Ok(())
}
