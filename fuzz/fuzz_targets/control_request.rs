//! `control_request`: see `ferry_agent::fuzzing::control_request` for what it feeds and checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry_agent::fuzzing::control_request(data));
