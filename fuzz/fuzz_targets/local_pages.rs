//! `local_pages`: see `ferry_agent::fuzzing::local_pages` for what it feeds and checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry_agent::fuzzing::local_pages(data));
