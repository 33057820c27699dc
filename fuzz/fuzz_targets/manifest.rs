//! cargo-fuzz target `manifest`: [`mt_fuzz::manifest`] under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mt_fuzz::manifest(data));
