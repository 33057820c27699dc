//! cargo-fuzz target `safetensors_index`: [`mt_fuzz::safetensors_index`] under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mt_fuzz::safetensors_index(data));
