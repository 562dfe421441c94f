//! What the agent must remember across its own restarts: the processes it
//! manages. They outlive `ferryd` (nothing kills them when it exits), and so
//! do the pinned data-plane maps that keep their ports owned; a restarted
//! agent adopts them again from `<work_dir>/managed.json` instead of
//! releasing their ports.
//!
//! A PID alone could by then name another process: each entry keeps the
//! process's start time (clock ticks since boot), and only a process whose
//! PID and start time both match is adopted.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::Origin;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a managed-process list: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// One managed process as remembered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remembered {
    pub pid: i32,
    pub start_ticks: u64,
    pub argv: Vec<String>,
    /// Set when it arrived by migration.
    pub migrated_in: Option<MigratedIn>,
    /// Set when it was adopted running (`ferry adopt`); lists written
    /// before adoption existed lack the field.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adopted: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigratedIn {
    pub migration_id: String,
    pub from: String,
}

impl Remembered {
    pub fn origin(&self) -> Origin {
        match &self.migrated_in {
            None if self.adopted => Origin::Adopted,
            None => Origin::Run,
            Some(m) => Origin::MigratedIn {
                migration_id: m.migration_id.clone(),
                from: m.from.clone(),
            },
        }
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct File {
    processes: Vec<Remembered>,
}

pub fn path(work_dir: &Path) -> PathBuf {
    work_dir.join("managed.json")
}

/// Writes the list atomically (a temp file renamed over the old one), so a
/// crash leaves the old list or the new one, never half of one.
pub fn save(path: &Path, processes: &[Remembered]) -> Result<(), StateError> {
    let io = |source| StateError::Io {
        path: path.to_owned(),
        source,
    };
    let body = serde_json::to_vec_pretty(&File {
        processes: processes.to_vec(),
    })
    .map_err(|source| StateError::Parse {
        path: path.to_owned(),
        source,
    })?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, body).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// The remembered list; none if there is no file yet.
pub fn load(path: &Path) -> Result<Vec<Remembered>, StateError> {
    match std::fs::read(path) {
        Ok(body) => serde_json::from_slice::<File>(&body)
            .map(|f| f.processes)
            .map_err(|source| StateError::Parse {
                path: path.to_owned(),
                source,
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(source) => Err(StateError::Io {
            path: path.to_owned(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saves_and_loads_and_a_missing_file_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let p = path(dir.path());
        assert!(load(&p).unwrap().is_empty());
        let list = vec![
            Remembered {
                pid: 42,
                start_ticks: 1234,
                argv: vec!["redis-server".into(), "--port".into(), "7000".into()],
                migrated_in: None,
                adopted: false,
            },
            Remembered {
                pid: 44,
                start_ticks: 5,
                argv: vec!["nginx".into()],
                migrated_in: None,
                adopted: true,
            },
            Remembered {
                pid: 43,
                start_ticks: 99,
                argv: vec!["x".into()],
                migrated_in: Some(MigratedIn {
                    migration_id: "ab".into(),
                    from: "node1".into(),
                }),
                adopted: false,
            },
        ];
        save(&p, &list).unwrap();
        assert_eq!(load(&p).unwrap(), list);
        assert_eq!(list[0].origin(), Origin::Run);
        assert_eq!(list[1].origin(), Origin::Adopted);
        assert_eq!(
            list[2].origin(),
            Origin::MigratedIn {
                migration_id: "ab".into(),
                from: "node1".into()
            }
        );
        // A list from before adoption existed reads as it did.
        std::fs::write(
            &p,
            br#"{"processes":[{"pid":7,"start_ticks":1,"argv":["a"],"migrated_in":null}]}"#,
        )
        .unwrap();
        assert_eq!(load(&p).unwrap()[0].origin(), Origin::Run);
        std::fs::write(&p, b"{ not json").unwrap();
        let e = load(&p).unwrap_err().to_string();
        assert!(e.contains("managed.json"), "{e}");
    }
}
