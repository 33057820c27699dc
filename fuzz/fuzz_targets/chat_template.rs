//! cargo-fuzz target `chat_template`: [`mt_fuzz::chat_template`] under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mt_fuzz::chat_template(data));
