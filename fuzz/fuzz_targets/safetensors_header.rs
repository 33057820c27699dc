//! cargo-fuzz target `safetensors_header`: [`mt_fuzz::safetensors_header`] under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mt_fuzz::safetensors_header(data));
