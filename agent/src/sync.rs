//! The one way ferryd takes a `std::sync::Mutex`.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, recovering it if a thread panicked while holding it.
///
/// ferryd's locks guard plain data (maps of processes, ports, captured
/// packets, flags): a panic half-way through an update leaves it consistent
/// enough to go on, and refusing every later call would stop the node's
/// migrations and port ownership for good. The panic itself is logged where
/// it happened.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
