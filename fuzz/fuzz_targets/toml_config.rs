//! cargo-fuzz target `toml_config`: [`mt_fuzz::toml_config`] under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mt_fuzz::toml_config(data));
