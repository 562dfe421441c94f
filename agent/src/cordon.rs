//! A cordoned node takes no incoming migration, balancer offer or new
//! process. The flag survives restarts: a file in the work directory.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use ferry_proto::v1::{CordonChange, cluster_event::Event};

use crate::events::EventBus;

/// The file whose presence says the node is cordoned.
const CORDON_FILE: &str = "cordoned";

/// Why the cordon could not be changed.
#[derive(Debug, thiserror::Error)]
#[error("writing {path}: {source}")]
pub struct CordonError {
    path: PathBuf,
    source: std::io::Error,
}

/// Refused: the node is cordoned.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{node} is cordoned: it takes no new processes (`ferry cordon --off {node}` lifts it)")]
pub struct Cordoned {
    pub node: String,
}

#[derive(Debug)]
pub struct Cordon {
    node: String,
    file: PathBuf,
    on: AtomicBool,
    events: Arc<EventBus>,
}

impl Cordon {
    /// As the work directory says.
    pub fn new(node: &str, work_dir: &std::path::Path, events: Arc<EventBus>) -> Self {
        let file = work_dir.join(CORDON_FILE);
        Self {
            node: node.to_owned(),
            on: AtomicBool::new(file.exists()),
            file,
            events,
        }
    }

    /// Whether this node takes no new work.
    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::SeqCst)
    }

    /// Cordons or uncordons this node; `by` says who, in the event.
    /// Returns whether it changed.
    pub fn set(&self, cordoned: bool, by: &str) -> Result<bool, CordonError> {
        let written = if cordoned {
            std::fs::write(&self.file, format!("{by}\n"))
        } else {
            std::fs::remove_file(&self.file).or_else(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    Ok(())
                } else {
                    Err(e)
                }
            })
        };
        written.map_err(|source| CordonError {
            path: self.file.clone(),
            source,
        })?;
        let was = self.on.swap(cordoned, Ordering::SeqCst);
        if was != cordoned {
            tracing::info!(cordoned, by, "cordon changed");
            self.events.publish(Event::Cordon(CordonChange {
                cordoned,
                by: by.to_owned(),
            }));
        }
        Ok(was != cordoned)
    }

    /// Refuses new work on a cordoned node.
    pub fn refuse_if_on(&self) -> Result<(), Cordoned> {
        if self.is_on() {
            return Err(Cordoned {
                node: self.node.clone(),
            });
        }
        Ok(())
    }
}
