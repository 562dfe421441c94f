//! `criu_image`: see `ferry_agent::fuzzing::criu_image` for what it feeds and checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry_agent::fuzzing::criu_image(data));
