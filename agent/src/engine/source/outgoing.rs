//! The migrations this node runs as the source, by id, with their cancel
//! switches (`Control.CancelMigration`, a drain's cancel).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::engine::cancel::Cancel;
use crate::sync::lock;

#[derive(Debug, Default)]
pub struct Outgoing(Mutex<HashMap<String, Arc<Cancel>>>);

impl Outgoing {
    /// A migration from this node started: it can be cancelled by id.
    pub fn started(&self, id: &str, cancel: Arc<Cancel>) {
        lock(&self.0).insert(id.to_owned(), cancel);
    }

    pub fn finished(&self, id: &str) {
        lock(&self.0).remove(id);
    }

    /// The cancel switch of a migration from this node still running.
    pub fn cancel_switch(&self, id: &str) -> Option<Arc<Cancel>> {
        lock(&self.0).get(id).cloned()
    }

    /// The migrations from this node still running.
    pub fn ids(&self) -> Vec<String> {
        lock(&self.0).keys().cloned().collect()
    }
}
