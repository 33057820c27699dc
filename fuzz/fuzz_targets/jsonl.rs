//! cargo-fuzz target `jsonl`: [`mt_fuzz::jsonl`] under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mt_fuzz::jsonl(data));
