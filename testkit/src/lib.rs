//! What ferry's tests share across crates.
//!
//! Many tests need root, CRIU, network namespaces or a tool on `PATH`. A
//! bare `cargo test` on a developer's machine may lack them, and those
//! tests then skip, saying why. `cargo xtask test` (and so CI) sets
//! [`MUST_RUN`]: there a test that cannot run fails, so a run without
//! root or without CRIU cannot pass by skipping everything. `cargo xtask
//! test --allow-skip` is the explicit way to skip there.

/// The environment variable `cargo xtask test` sets ("1") unless told to
/// allow skips.
pub const MUST_RUN: &str = "FERRY_TESTS_MUST_RUN";

/// Whether a test that cannot run here must fail rather than skip.
pub fn must_run() -> bool {
    std::env::var_os(MUST_RUN).is_some_and(|v| v == "1")
}

/// For the first lines of a test that needs something this machine may
/// lack: `reason` says what is missing (none: the test runs). Returns true
/// when the test should return now (it is skipped, and says so on
/// stderr); panics instead when skipping is not allowed ([`must_run`]).
///
/// ```
/// # fn check() -> Option<String> { None }
/// if ferry_testkit::skip("crate::module::test", check()) {
///     return;
/// }
/// ```
pub fn skip(test: &str, reason: Option<String>) -> bool {
    let Some(reason) = reason else {
        return false;
    };
    if must_run() {
        panic!(
            "{test} cannot run here: {reason} ({MUST_RUN}=1: `cargo xtask test --allow-skip` skips instead)"
        );
    }
    eprintln!("skipping {test}: {reason}");
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_that_can_run_is_not_skipped() {
        assert!(!skip("t", None));
    }

    // The variable is read by the process; one test sets and clears it, so
    // that no other test of this crate sees it half-way.
    #[test]
    fn a_missing_need_skips_unless_the_run_must_run() {
        // SAFETY: no other thread of this test binary reads or writes the
        // environment while this test runs (the other test does not touch
        // it).
        unsafe { std::env::remove_var(MUST_RUN) };
        assert!(skip("t", Some("needs root".into())));
        // SAFETY: as above.
        unsafe { std::env::set_var(MUST_RUN, "1") };
        let caught = std::panic::catch_unwind(|| skip("t", Some("needs root".into())));
        // SAFETY: as above.
        unsafe { std::env::remove_var(MUST_RUN) };
        let message = caught.expect_err("must fail, not skip");
        let text = message
            .downcast_ref::<String>()
            .expect("a formatted message");
        assert!(text.contains("t cannot run here: needs root"), "{text}");
        assert!(text.contains("--allow-skip"), "{text}");
    }
}
