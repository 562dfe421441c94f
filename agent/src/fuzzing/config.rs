//! The `config` target: `ferryd.toml` and CRIU's `--version` output.

use std::path::Path;

/// `config`: ferryd's configuration file (`Config::parse`, all of its
/// checks); one that parses writes back as TOML that parses to the same.
/// Also CRIU's `--version` output, as Prepare reads it.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = crate::criu::CriuVersion::parse_version_output(text);
    let path = Path::new("fuzz.toml");
    if let Ok(c) = crate::config::Config::parse(text, path) {
        let written = toml::to_string(&c).expect("a parsed configuration writes as TOML");
        let again = crate::config::Config::parse(&written, path);
        assert!(again.is_ok(), "{written}\nreads back as {again:?}");
    }
}
