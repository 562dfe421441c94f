//! `ferry init`: a node's `ferryd.toml` (`ferry_agent::config::init`),
//! written once its certificates are in place.

use anyhow::{Context, Result, bail};
use ferry_agent::config::init::{NodeInit, parse_peer};

use crate::args::InitArgs;

pub(crate) fn run(a: InitArgs) -> Result<()> {
    let mut init = NodeInit::new(
        &a.node,
        (&a.public_interface, a.public_address),
        (&a.cluster_interface, a.cluster_address),
    );
    init.public_address6 = a.public_address6;
    init.peer_port = a.peer_port;
    init.peers = a
        .peers
        .iter()
        .map(|p| parse_peer(p, a.peer_port))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)
        .context("--peer")?;
    if init.peers.iter().any(|(name, _)| *name == a.node) {
        bail!("--peer: {} is this node", a.node);
    }
    init.tls_dir = a.tls_dir;
    init.work_dir = a.work_dir;
    init.criu_path = a.criu;
    init.control_socket = a.control_socket;
    // The certificates first: a config naming files that are not there
    // only fails when ferryd starts.
    if let Some((ca, cert, key, membership)) = init.tls_files() {
        for (file, made_by) in [
            (&ca, "ferry cert ca"),
            (&membership, "ferry cert ca"),
            (&cert, "ferry cert node"),
            (&key, "ferry cert node"),
        ] {
            if !file.is_file() {
                bail!(
                    "--tls-dir: no {} (made by `{made_by}`, see docs/deploy.md)",
                    file.display()
                );
            }
        }
    }
    let text = init.render().context("the configuration")?;
    if a.out.as_os_str() == "-" {
        print!("{text}");
        return Ok(());
    }
    if a.out.exists() && !a.force {
        bail!("{} exists (--force replaces it)", a.out.display());
    }
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(&a.out, text).with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!(
        "wrote {}; check it with `ferryd --check-config {}`",
        a.out.display(),
        a.out.display()
    );
    Ok(())
}
