//! The migration journal: what an agent must still know about a migration
//! after its own crash, to settle it when it comes back
//! ([`super::recover`]).
//!
//! A migration is a two-phase commit whose decision is the destination's:
//! the source's Release is its "prepared" (from there it may send the
//! Commit, and must not resume its copy by itself), and the destination's
//! resume of the process on Commit is "committed". Each side writes one
//! record per migration, a small file under `<work_dir>/journal/`,
//! replaced whole (written beside, then renamed over: a crash leaves the
//! old record or the new one):
//!
//! | side | stage | written | a restarted agent |
//! |---|---|---|---|
//! | source | `started` | at Start, before anything is touched; again at Translate, naming the flows each peer's node is asked to translate | has those translations undone, resumes its copy (no Commit was sent) and tells the destination to abort |
//! | source | `released` | at Release, before the Commit is sent | asks the destination (`Peer.Abort`, protocol 11): committed, it kills its copy; not, it resumes it; no answer, the copy stays stopped, "in doubt", and it asks again |
//! | destination | `prepared` | at Prepare (pid 0, `start_ticks` the time it was written) | kills a copy CRIU restored unrecorded (the agent died inside the restore): its PID namespace's init, in this node's network namespace, started since, with the migration's command line |
//! | destination | `restored` | when the Restore succeeded | kills the restored copy, which never ran |
//! | destination | `committed` | on Commit, before the resume | resumes the process if it is still stopped, manages it, and keeps the record to answer the source |
//!
//! The source removes its record when the migration ends; the
//! destination removes a `prepared` or `restored` record when the
//! migration aborts, and
//! keeps the last [`COMMITTED_KEPT`] `committed` ones: a source that
//! comes back hours later still learns what was decided.
//!
//! Records are not synced to the disk: they must outlive the agent, not
//! the node. A crashed node takes the processes they describe with it,
//! and an fsync in the freeze (the `released` record) would cost
//! milliseconds on a disk-backed work dir.

use std::path::{Path, PathBuf};

use ferry_proto::v1 as pb;
use serde::{Deserialize, Serialize};

/// How many `committed` records a destination keeps.
pub const COMMITTED_KEPT: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a journal record: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("migration id {0:?} cannot name a journal record")]
    BadId(String),
}

/// Where an outgoing migration stands, as its source records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OutgoingStage {
    /// Started: no Commit has been sent.
    Started,
    /// Released: the Commit may have been sent; only the destination
    /// knows whether it resumed the process.
    Released,
}

/// Where an incoming migration stands, as its destination records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IncomingStage {
    /// Prepared: this node reserved; a restore may come. The record's
    /// `pid` is 0 and its `start_ticks` the time it was written (ticks
    /// since boot): a copy CRIU restored for it started later.
    Prepared,
    /// Restored, stopped, not resumed.
    Restored,
    /// Committed: resumed here (or about to be).
    Committed,
}

/// One migration as this agent recorded it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "side", rename_all = "kebab-case")]
pub enum Record {
    Outgoing {
        migration_id: String,
        /// The process here, and its start time (a PID alone could name
        /// another process after a restart).
        pid: i32,
        start_ticks: u64,
        argv: Vec<String>,
        destination: String,
        /// The peer protocol version the migration speaks: a destination
        /// older than 11 does not say whether it committed.
        protocol_version: u32,
        stage: OutgoingStage,
        /// The in-cluster flows each peer's node was asked to translate
        /// (Translate), recorded before the first ask: undone if the
        /// migration does not commit.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        translated: Vec<Translated>,
    },
    Incoming {
        migration_id: String,
        pid: i32,
        start_ticks: u64,
        argv: Vec<String>,
        from: String,
        stage: IncomingStage,
    },
}

/// The flows one peer's node was asked to translate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Translated {
    pub node: String,
    pub flows: Vec<TranslatedFlow>,
}

/// `ferry_proto::v1::InClusterFlow`, as the journal keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TranslatedFlow {
    pub protocol: i32,
    pub old_local: String,
    pub new_local: String,
    pub remote: String,
}

impl From<&pb::InClusterFlow> for TranslatedFlow {
    fn from(f: &pb::InClusterFlow) -> Self {
        Self {
            protocol: f.protocol,
            old_local: f.old_local.clone(),
            new_local: f.new_local.clone(),
            remote: f.remote.clone(),
        }
    }
}

impl From<&TranslatedFlow> for pb::InClusterFlow {
    fn from(f: &TranslatedFlow) -> Self {
        Self {
            protocol: f.protocol,
            old_local: f.old_local.clone(),
            new_local: f.new_local.clone(),
            remote: f.remote.clone(),
        }
    }
}

impl Translated {
    /// By node, as the source's undo ledger holds them.
    pub fn of(by_node: &[(String, Vec<pb::InClusterFlow>)]) -> Vec<Self> {
        by_node
            .iter()
            .map(|(node, flows)| Self {
                node: node.clone(),
                flows: flows.iter().map(TranslatedFlow::from).collect(),
            })
            .collect()
    }

    /// Back to the ledger's form.
    pub fn by_node(translated: &[Self]) -> Vec<(String, Vec<pb::InClusterFlow>)> {
        translated
            .iter()
            .map(|t| (t.node.clone(), t.flows.iter().map(Into::into).collect()))
            .collect()
    }
}

impl Record {
    pub fn migration_id(&self) -> &str {
        match self {
            Record::Outgoing { migration_id, .. } | Record::Incoming { migration_id, .. } => {
                migration_id
            }
        }
    }

    fn file_name(&self) -> Result<String, JournalError> {
        match self {
            Record::Outgoing { migration_id, .. } => file_name("out", migration_id),
            Record::Incoming { migration_id, .. } => file_name("in", migration_id),
        }
    }
}

fn file_name(side: &str, migration_id: &str) -> Result<String, JournalError> {
    if migration_id.is_empty() || !super::valid_image_name(migration_id) {
        return Err(JournalError::BadId(migration_id.to_owned()));
    }
    Ok(format!("{side}-{migration_id}.json"))
}

/// The journal of one agent: `<work_dir>/journal`.
#[derive(Debug, Clone)]
pub struct Journal {
    dir: PathBuf,
}

impl Journal {
    pub fn new(work_dir: &Path) -> Self {
        Self {
            dir: work_dir.join("journal"),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> JournalError + '_ {
        move |source| JournalError::Io {
            path: path.to_owned(),
            source,
        }
    }

    /// Writes `record` over the migration's earlier one, if any.
    pub fn write(&self, record: &Record) -> Result<(), JournalError> {
        let path = self.dir.join(record.file_name()?);
        std::fs::create_dir_all(&self.dir).map_err(Self::io(&self.dir))?;
        let body = serde_json::to_vec(record).map_err(|source| JournalError::Parse {
            path: path.clone(),
            source,
        })?;
        let tmp = path.with_extension("json.new");
        std::fs::write(&tmp, body).map_err(Self::io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(Self::io(&path))
    }

    /// Removes the source's record of `migration_id` (none is fine).
    pub fn remove_outgoing(&self, migration_id: &str) -> Result<(), JournalError> {
        self.remove(&file_name("out", migration_id)?)
    }

    /// Removes the destination's record of `migration_id` (none is fine).
    pub fn remove_incoming(&self, migration_id: &str) -> Result<(), JournalError> {
        self.remove(&file_name("in", migration_id)?)
    }

    fn remove(&self, name: &str) -> Result<(), JournalError> {
        let path = self.dir.join(name);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Self::io(&path)(e)),
            _ => Ok(()),
        }
    }

    /// The destination's record of `migration_id`, if it has one.
    pub fn incoming(&self, migration_id: &str) -> Result<Option<Record>, JournalError> {
        let path = self.dir.join(file_name("in", migration_id)?);
        read(&path)
    }

    /// Every record, oldest first (by when it was last written); one that
    /// cannot be read is returned as its error, the others still are.
    pub fn records(&self) -> Vec<Result<Record, JournalError>> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
            Err(e) => return vec![Err(Self::io(&self.dir)(e))],
        };
        let mut files: Vec<(std::time::SystemTime, PathBuf)> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .map(|p| {
                let t = std::fs::metadata(&p)
                    .and_then(|m| m.modified())
                    .unwrap_or(std::time::UNIX_EPOCH);
                (t, p)
            })
            .collect();
        files.sort();
        files
            .into_iter()
            .filter_map(|(_, p)| read(&p).transpose())
            .collect()
    }

    /// Removes the oldest `committed` records beyond the last `keep`.
    pub fn prune_committed(&self, keep: usize) {
        // Cheap when there is nothing to prune: names only.
        let incoming = std::fs::read_dir(&self.dir)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("in-"))
                    .count()
            })
            .unwrap_or(0);
        if incoming <= keep {
            return;
        }
        let committed: Vec<String> = self
            .records()
            .into_iter()
            .flatten()
            .filter(|r| {
                matches!(
                    r,
                    Record::Incoming {
                        stage: IncomingStage::Committed,
                        ..
                    }
                )
            })
            .map(|r| r.migration_id().to_owned())
            .collect();
        let extra = committed.len().saturating_sub(keep);
        for id in &committed[..extra] {
            if let Err(e) = self.remove_incoming(id) {
                tracing::warn!(error = %e, "pruning the journal");
            }
        }
    }
}

fn read(path: &Path) -> Result<Option<Record>, JournalError> {
    let body = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(JournalError::Io {
                path: path.to_owned(),
                source,
            });
        }
    };
    serde_json::from_slice(&body)
        .map(Some)
        .map_err(|source| JournalError::Parse {
            path: path.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translated_flows_come_back_as_they_were_asked() {
        let asked = vec![(
            "node3".to_owned(),
            vec![pb::InClusterFlow {
                protocol: pb::Protocol::Tcp as i32,
                old_local: "198.19.0.1:40000".into(),
                new_local: "198.19.0.2:40000".into(),
                remote: "198.19.0.3:5432".into(),
            }],
        )];
        let record = Record::Outgoing {
            migration_id: "m1".into(),
            pid: 42,
            start_ticks: 7,
            argv: vec!["server".into()],
            destination: "node2".into(),
            protocol_version: 11,
            stage: OutgoingStage::Started,
            translated: Translated::of(&asked),
        };
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::new(dir.path());
        j.write(&record).unwrap();
        let back = j.records().pop().unwrap().unwrap();
        let Record::Outgoing { translated, .. } = &back else {
            panic!("{back:?}")
        };
        assert_eq!(Translated::by_node(translated), asked);
        // A record without translations (and an older agent's) has none.
        let plain = r#"{"side":"outgoing","migration_id":"m2","pid":1,"start_ticks":1,"argv":[],"destination":"node2","protocol_version":11,"stage":"started"}"#;
        let Record::Outgoing { translated, .. } = serde_json::from_str(plain).unwrap() else {
            panic!()
        };
        assert!(translated.is_empty());
    }

    fn outgoing(id: &str, stage: OutgoingStage) -> Record {
        Record::Outgoing {
            migration_id: id.into(),
            pid: 42,
            start_ticks: 7,
            argv: vec!["server".into()],
            destination: "node2".into(),
            protocol_version: 11,
            stage,
            translated: Vec::new(),
        }
    }

    fn incoming(id: &str, stage: IncomingStage) -> Record {
        Record::Incoming {
            migration_id: id.into(),
            pid: 43,
            start_ticks: 8,
            argv: vec!["server".into()],
            from: "node1".into(),
            stage,
        }
    }

    #[test]
    fn a_record_is_replaced_whole_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::new(dir.path());
        assert!(j.records().is_empty(), "no journal yet is an empty one");
        j.write(&outgoing("m1", OutgoingStage::Started)).unwrap();
        j.write(&outgoing("m1", OutgoingStage::Released)).unwrap();
        j.write(&incoming("m2", IncomingStage::Restored)).unwrap();
        let records: Vec<Record> = j.records().into_iter().map(Result::unwrap).collect();
        assert_eq!(
            records,
            vec![
                outgoing("m1", OutgoingStage::Released),
                incoming("m2", IncomingStage::Restored)
            ]
        );
        assert_eq!(
            j.incoming("m2").unwrap(),
            Some(incoming("m2", IncomingStage::Restored))
        );
        assert_eq!(j.incoming("m1").unwrap(), None, "m1 is an outgoing record");
        j.remove_outgoing("m1").unwrap();
        j.remove_outgoing("m1").unwrap();
        j.remove_incoming("m2").unwrap();
        assert!(j.records().is_empty());
        // Nothing half-written is left beside them.
        assert_eq!(std::fs::read_dir(j.dir()).unwrap().count(), 0);
    }

    #[test]
    fn an_id_that_is_no_file_name_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::new(dir.path());
        for id in ["", "../x", "a/b"] {
            assert!(
                matches!(
                    j.write(&outgoing(id, OutgoingStage::Started)),
                    Err(JournalError::BadId(_))
                ),
                "{id:?}"
            );
            assert!(matches!(j.incoming(id), Err(JournalError::BadId(_))));
        }
    }

    #[test]
    fn an_unreadable_record_is_an_error_and_the_others_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::new(dir.path());
        j.write(&incoming("m1", IncomingStage::Committed)).unwrap();
        std::fs::write(j.dir().join("in-m0.json"), b"{\"side\":").unwrap();
        let records = j.records();
        assert_eq!(records.len(), 2);
        assert!(records.iter().any(
            |r| matches!(r, Err(JournalError::Parse { path, .. }) if path.ends_with("in-m0.json"))
        ));
        assert!(
            records
                .iter()
                .any(|r| matches!(r, Ok(r) if r.migration_id() == "m1"))
        );
    }

    #[test]
    fn only_the_newest_committed_records_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::new(dir.path());
        for i in 0..5 {
            j.write(&incoming(&format!("c{i}"), IncomingStage::Committed))
                .unwrap();
            // Distinct modification times, whatever the file system's
            // resolution.
            let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000 + i);
            let f = std::fs::File::options()
                .write(true)
                .open(j.dir().join(format!("in-c{i}.json")))
                .unwrap();
            f.set_modified(t).unwrap();
        }
        j.write(&incoming("r", IncomingStage::Restored)).unwrap();
        j.write(&outgoing("o", OutgoingStage::Started)).unwrap();
        j.prune_committed(2);
        let mut left: Vec<String> = j
            .records()
            .into_iter()
            .map(|r| r.unwrap().migration_id().to_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["c3", "c4", "o", "r"]);
    }
}
