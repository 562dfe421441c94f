//! A thread's nice value, set for a while and given back.
//!
//! Linux keeps a nice value per thread, which `setpriority(PRIO_PROCESS,
//! tid)` sets; a thread starts with its creator's. ferryd raises the
//! threads whose delay a migrated process's peers or the process itself
//! would feel (the replay of captured packets, the answers to a restored
//! process's page faults) to CRIU's own value, so the node's other work
//! does not queue them.

/// CRIU's nice value for the restore, and ferryd's for the work a migrated
/// process waits on.
pub const AHEAD: i32 = -10;

/// The calling thread's nice value set for a while and given back on
/// drop (threads it starts meanwhile inherit the new one).
#[derive(Debug)]
pub struct ThreadNice {
    tid: libc::id_t,
    before: i32,
}

impl ThreadNice {
    /// Raises this thread to `nice` (a lower value); `None` when it is
    /// there already or the kernel refuses (raising needs CAP_SYS_NICE).
    pub fn raise(nice: i32) -> Option<Self> {
        let (tid, before) = this_thread()?;
        if before <= nice {
            return None;
        }
        Self::set(tid, before, nice)
    }

    /// Sets this thread to `nice`, up or down; `None` when it is there
    /// already or the kernel refuses.
    pub fn set_to(nice: i32) -> Option<Self> {
        let (tid, before) = this_thread()?;
        if before == nice {
            return None;
        }
        Self::set(tid, before, nice)
    }

    fn set(tid: libc::id_t, before: i32, nice: i32) -> Option<Self> {
        // SAFETY: setpriority takes plain integers and changes only this
        // thread's nice value.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) } != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), nice, "a thread left at its nice value");
            return None;
        }
        Some(Self { tid, before })
    }
}

/// This thread's ID and nice value.
pub fn this_thread() -> Option<(libc::id_t, i32)> {
    // SAFETY: gettid takes nothing and returns the caller's thread ID.
    let tid = unsafe { libc::gettid() } as libc::id_t;
    // getpriority may return -1 as a value: errno tells.
    // SAFETY: __errno_location returns this thread's errno; getpriority
    // takes plain integers and reads one thread's nice value.
    let nice = unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, tid)
    };
    if nice == -1 && std::io::Error::last_os_error().raw_os_error() != Some(0) {
        return None;
    }
    Some((tid, nice))
}

impl Drop for ThreadNice {
    fn drop(&mut self) {
        // SAFETY: as in `set`; the thread is named by its ID, so this is
        // right wherever the guard is dropped.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, self.tid, self.before) } != 0 {
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                nice = self.before,
                "giving a thread its nice value back"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nice_of_this_thread() -> i32 {
        this_thread().unwrap().1
    }

    /// A raised thread gives the value back; a thread started meanwhile
    /// inherits it and can set its own back.
    #[test]
    fn a_raised_nice_value_is_inherited_and_given_back() {
        std::thread::spawn(|| {
            let before = nice_of_this_thread();
            assert!(before > AHEAD, "the test thread starts at {before}");
            {
                let _ahead = ThreadNice::raise(AHEAD).expect("raising needs CAP_SYS_NICE (root)");
                assert_eq!(nice_of_this_thread(), AHEAD);
                let lane = std::thread::spawn(nice_of_this_thread).join().unwrap();
                assert_eq!(lane, AHEAD);
                let worker = std::thread::spawn(move || {
                    let _own = ThreadNice::set_to(before).expect("lowering is allowed");
                    nice_of_this_thread()
                })
                .join()
                .unwrap();
                assert_eq!(worker, before);
                // Already there: nothing to do, nothing to give back.
                assert!(ThreadNice::raise(-5).is_none());
                assert!(ThreadNice::set_to(AHEAD).is_none());
            }
            assert_eq!(nice_of_this_thread(), before);
        })
        .join()
        .unwrap();
    }
}
