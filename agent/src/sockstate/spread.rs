//! Per-connection work spread over the cores: reading, rebuilding and
//! resuming a thousand connections is a dozen system calls each, all in
//! the kernel and independent of the others, inside the freeze. The
//! threads share the caller's network namespace.

use super::SockStateError;

/// At most this many threads, whatever the machine.
const MAX_THREADS: usize = 4;

/// Asked once: `available_parallelism` reads the cgroup's CPU limit from
/// its files on every call, tens of microseconds, three times a freeze.
fn threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .clamp(1, MAX_THREADS)
    })
}

/// How many of `len` items each thread takes.
pub(super) fn chunk_len(len: usize) -> usize {
    len.div_ceil(threads()).max(1)
}

/// Runs `work` on every part, each on a thread of its own, and gives the
/// results in the parts' order. A thread that panics gives an error
/// naming `op`.
pub(super) fn on_threads<P: Send, R: Send>(
    parts: impl IntoIterator<Item = P>,
    op: &'static str,
    work: impl Fn(P) -> Result<R, SockStateError> + Sync,
) -> Vec<Result<R, SockStateError>> {
    let work = &work;
    std::thread::scope(|s| {
        let handles: Vec<_> = parts
            .into_iter()
            .map(|part| s.spawn(move || work(part)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(SockStateError::Sys {
                        op,
                        conn: "?".into(),
                        source: std::io::Error::other(format!("{op} thread panicked")),
                    })
                })
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_item_on_at_most_the_threads_allowed() {
        for len in [0usize, 1, 2, 3, 7, 1024, 1025] {
            let items: Vec<usize> = (0..len).collect();
            let parts: Vec<&[usize]> = items.chunks(chunk_len(len)).collect();
            assert!(parts.len() <= MAX_THREADS, "{len}: {}", parts.len());
            assert_eq!(parts.concat(), items);
        }
    }

    #[test]
    fn results_come_in_order_and_a_panic_is_an_error() {
        let r = on_threads([1, 2, 3], "test", |n| {
            assert_ne!(n, 2, "the second part panics");
            Ok(n * 10)
        });
        assert_eq!(r[0].as_ref().unwrap(), &10);
        assert!(r[1].as_ref().unwrap_err().to_string().contains("test"));
        assert_eq!(r[2].as_ref().unwrap(), &30);
    }
}
