//! What every migration bench asks of its run: the strategy a name on the
//! command line means, and the build profile of the binaries under test.

use ferry_proto::v1::Strategy;

/// A strategy name no bench knows.
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown strategy {0:?} (total-copy, pre-copy, queued-pre-copy, post-copy, assisted-post-copy)"
)]
pub struct UnknownStrategy(pub String);

/// The strategy a `--strategies` name means.
pub fn strategy_of(name: &str) -> Result<Strategy, UnknownStrategy> {
    Ok(match name {
        "total-copy" => Strategy::TotalCopy,
        "pre-copy" => Strategy::PreCopy,
        "queued-pre-copy" => Strategy::QueuedPreCopy,
        "post-copy" => Strategy::PostCopy,
        "assisted-post-copy" => Strategy::AssistedPostCopy,
        other => return Err(UnknownStrategy(other.to_owned())),
    })
}

/// "release" or "debug": the profile of the agent under test, as its
/// `ferryd --version` says (binaries copied out of `target/` keep it), or,
/// from an older ferryd that does not say, from where it is
/// (`FERRY_BIN_DIR`, which `cargo xtask bench` sets).
pub fn profile() -> &'static str {
    let ferryd = ferry_integration::bin_path("ferryd");
    let said = std::process::Command::new(&ferryd)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| profile_in_version(&String::from_utf8_lossy(&o.stdout)));
    said.unwrap_or_else(|| {
        if ferryd.components().any(|c| c.as_os_str() == "release") {
            "release"
        } else {
            "debug"
        }
    })
}

/// The profile `ferryd --version` names ("ferryd 0.1.0 (release build)").
fn profile_in_version(version: &str) -> Option<&'static str> {
    if version.contains("(release build)") {
        Some("release")
    } else if version.contains("(debug build)") {
        Some("debug")
    } else {
        None
    }
}

/// A report's freeze parts of 1 ms or more, "phase ms; phase ms", in the
/// report's order (the benches' CSV column `freeze_parts`).
pub fn freeze_parts(report: &ferry_proto::v1::MigrationReport) -> String {
    report
        .freeze_parts
        .iter()
        .filter(|p| p.duration_us >= 1000)
        .map(|p| format!("{} {:.0}", p.phase, p.duration_us as f64 / 1000.0))
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_profile_is_read_from_ferryds_version() {
        assert_eq!(
            profile_in_version("ferryd 0.1.0 (release build)\n"),
            Some("release")
        );
        assert_eq!(
            profile_in_version("ferryd 0.1.0 (debug build)\n"),
            Some("debug")
        );
        assert_eq!(profile_in_version("ferryd 0.1.0\n"), None);
    }

    #[test]
    fn names_every_strategy() {
        for (name, s) in [
            ("total-copy", Strategy::TotalCopy),
            ("pre-copy", Strategy::PreCopy),
            ("queued-pre-copy", Strategy::QueuedPreCopy),
            ("post-copy", Strategy::PostCopy),
            ("assisted-post-copy", Strategy::AssistedPostCopy),
        ] {
            assert_eq!(strategy_of(name).unwrap(), s);
        }
        assert!(
            strategy_of("post-it")
                .unwrap_err()
                .to_string()
                .contains("post-it")
        );
    }
}
