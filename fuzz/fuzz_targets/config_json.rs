//! cargo-fuzz target `config_json`: [`mt_fuzz::config_json`] under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mt_fuzz::config_json(data));
