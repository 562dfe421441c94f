//! Finding out whether the configured CRIU can do what ferry asks of it.

use std::path::Path;
use std::process::Command;

use super::CriuError;

/// Oldest CRIU that works here: 3.17 fails on the vDSO layout of current
/// kernels and 4.1 fails to dump TCP sockets (SO_PASSCRED now returns
/// EOPNOTSUPP on them); 4.2 fixed both.
pub const MIN_CRIU_VERSION: CriuVersion = CriuVersion {
    major: 4,
    minor: 2,
    patch: 0,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CriuVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl std::fmt::Display for CriuVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl CriuVersion {
    /// Parses the output of `criu --version` ("Version: 4.2.1" or "Version: 4.2").
    pub fn parse_version_output(out: &str) -> Option<Self> {
        let line = out
            .lines()
            .find_map(|l| l.trim().strip_prefix("Version:"))?;
        let mut parts = line.trim().split('.').map(|p| p.trim().parse::<u32>());
        let major = parts.next()?.ok()?;
        let minor = parts.next()?.ok()?;
        let patch = match parts.next() {
            Some(p) => p.ok()?,
            None => 0,
        };
        Some(Self {
            major,
            minor,
            patch,
        })
    }
}

/// Runs `criu --version` and checks it against [`MIN_CRIU_VERSION`].
pub fn probe_version(path: &Path) -> Result<CriuVersion, CriuError> {
    if !path.exists() {
        return Err(CriuError::NotFound {
            path: path.to_owned(),
        });
    }
    let out = Command::new(path)
        .arg("--version")
        .output()
        .map_err(|source| CriuError::Spawn {
            path: path.to_owned(),
            source,
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version =
        CriuVersion::parse_version_output(&text).ok_or_else(|| CriuError::UnknownVersion {
            path: path.to_owned(),
            reason: format!("unexpected output {:?}", text.trim()),
        })?;
    if version < MIN_CRIU_VERSION {
        return Err(CriuError::TooOld {
            path: path.to_owned(),
            found: version.to_string(),
            required: MIN_CRIU_VERSION.to_string(),
        });
    }
    Ok(version)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_criu_version_lines() {
        let v = CriuVersion::parse_version_output("Version: 4.2.1\n").unwrap();
        assert_eq!(v.to_string(), "4.2.1");
        let v = CriuVersion::parse_version_output("Version: 3.17\nGitID: x\n").unwrap();
        assert!(v < MIN_CRIU_VERSION);
        assert!(CriuVersion::parse_version_output("criu: unknown").is_none());
    }

    #[test]
    fn missing_binary_is_reported_as_not_found() {
        let err = probe_version(Path::new("/nonexistent/criu")).unwrap_err();
        assert!(matches!(err, CriuError::NotFound { .. }), "{err}");
    }

    #[test]
    fn old_version_is_refused_with_both_versions_named() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("criu");
        std::fs::write(&fake, "#!/bin/sh\necho 'Version: 3.17'\n").unwrap();
        std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let err = probe_version(&fake).unwrap_err().to_string();
        assert!(err.contains("3.17") && err.contains("4.2.0"), "{err}");
    }
}
