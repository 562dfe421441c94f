//! packaging/: the example configuration stays a valid and complete one,
//! and the systemd unit starts ferryd the way the example expects.

use std::collections::BTreeSet;
use std::path::Path;

use ferry_agent::config::Config;

const EXAMPLE: &str = include_str!("../../packaging/ferryd.toml.example");
const UNIT: &str = include_str!("../../packaging/ferryd.service");

/// The example with its `#name = value` lines (settings left at their
/// default or off) switched on; prose comments (`# text`) stay comments.
fn with_optional_settings(text: &str) -> String {
    text.lines()
        .map(|line| match line.strip_prefix('#') {
            Some(rest)
                if rest.split_once(" = ").is_some_and(|(key, _)| {
                    !key.is_empty() && key.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
                }) =>
            {
                rest
            }
            _ => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every key path of a TOML table ("membership.port", "peers.name").
fn key_paths(table: &toml::Table, prefix: &str, out: &mut BTreeSet<String>) {
    for (key, value) in table {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match value {
            toml::Value::Table(t) => key_paths(t, &path, out),
            toml::Value::Array(items) => {
                for item in items {
                    if let toml::Value::Table(t) = item {
                        key_paths(t, &path, out);
                    }
                }
                out.insert(path);
            }
            _ => {
                out.insert(path);
            }
        }
    }
}

#[test]
fn the_example_config_is_valid_as_shipped() {
    let c =
        Config::parse(EXAMPLE, Path::new("ferryd.toml.example")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.node, "node1");
    assert_eq!(c.peers.len(), 2);
    assert!(
        !c.membership.enabled && !c.balancer.enabled && c.metrics.listen.is_none(),
        "what is off by default is off in the example"
    );
    assert!(
        c.control_listen.is_none(),
        "no unauthenticated TCP by default"
    );
}

#[test]
fn the_example_config_sets_or_shows_every_setting() {
    let full = with_optional_settings(EXAMPLE);
    let c = Config::parse(&full, Path::new("ferryd.toml.example (all settings on)"))
        .unwrap_or_else(|e| panic!("{e}\n{full}"));
    assert!(
        c.control_listen.is_some()
            && c.metrics.listen.is_some()
            && c.membership.broadcast.is_some()
            && c.dataplane.pin_dir.is_some(),
        "the optional settings are written as `#name = value`"
    );
    // What ferryd knows (every field, serialised from the parsed config)
    // against what the example writes.
    let known = toml::Table::try_from(&c).unwrap();
    let written: toml::Table = toml::from_str(&full).unwrap();
    let (mut known_keys, mut written_keys) = (BTreeSet::new(), BTreeSet::new());
    key_paths(&known, "", &mut known_keys);
    key_paths(&written, "", &mut written_keys);
    let missing: Vec<_> = known_keys.difference(&written_keys).collect();
    assert!(
        missing.is_empty(),
        "packaging/ferryd.toml.example lacks these settings: {missing:?}"
    );
    // Each setting is explained: a comment within the lines above it or in
    // its section's header.
    for key in ["peer_timeout_secs", "criu_cache_dir", "offer_timeout_ms"] {
        let at = full.find(&format!("\n{key} = ")).unwrap();
        assert!(
            full[..at]
                .trim_end()
                .lines()
                .last()
                .unwrap()
                .starts_with('#')
        );
    }
}

#[test]
fn the_unit_checks_and_runs_the_same_config() {
    let line = |prefix: &str| {
        UNIT.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in ferryd.service"))
    };
    let start = line("ExecStart=");
    let pre = line("ExecStartPre=");
    let config = start
        .split_once("--config ")
        .map(|(_, c)| c.trim())
        .expect("ExecStart names its config");
    assert!(
        pre.contains("--check-config") && pre.ends_with(config),
        "{pre} vs {start}"
    );
    assert_eq!(
        line("KillMode="),
        "process",
        "managed processes outlive a restart"
    );
    // The capabilities ferryd and CRIU cannot work without.
    let caps: String = UNIT
        .split("CapabilityBoundingSet=")
        .nth(1)
        .and_then(|rest| rest.split("\n#").next())
        .expect("a bounding set")
        .replace("\\\n", " ");
    for cap in [
        "CAP_BPF",
        "CAP_SYS_ADMIN",
        "CAP_NET_ADMIN",
        "CAP_NET_RAW",
        "CAP_CHECKPOINT_RESTORE",
        "CAP_SYS_PTRACE",
        "CAP_SETUID",
    ] {
        assert!(
            caps.split_whitespace().any(|c| c == cap),
            "{cap} missing: {caps}"
        );
    }
}

const APP_UNIT: &str = include_str!("../../packaging/ferry-app@.service");

#[test]
fn the_example_app_unit_follows_its_process_through_ferry() {
    let line = |prefix: &str| {
        APP_UNIT
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in ferry-app@.service"))
    };
    // The form that stays with the process and ends as it did.
    let start = line("ExecStart=");
    assert!(
        start.starts_with("/usr/local/bin/ferry run --foreground -- "),
        "{start}"
    );
    // Where ferryd.service installs the CLI.
    assert!(
        UNIT.contains("target/release/ferry /usr/local/bin/"),
        "ferryd.service's install lines put the CLI there"
    );
    assert_eq!(line("Requires="), "ferryd.service");
    assert_eq!(line("After="), "ferryd.service");
    // A process stopped by the SIGTERM ferry passes on ends ferry by it.
    assert_eq!(line("SuccessExitStatus="), "SIGTERM");
}
