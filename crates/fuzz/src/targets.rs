//! The table of targets: each one's name (its corpus directory and cargo-fuzz binary) and
//! function.

/// One fuzz target.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    /// Its name: `fuzz/fuzz_targets/NAME.rs`, `crates/fuzz/corpus/NAME/`.
    pub name: &'static str,
    /// The function under test.
    pub run: fn(&[u8]),
}

/// Every target, in the order `scripts/fuzz.sh` runs them.
pub const TARGETS: [Target; 7] = [
    Target { name: "config_json", run: crate::config_json },
    Target { name: "safetensors_header", run: crate::safetensors_header },
    Target { name: "safetensors_index", run: crate::safetensors_index },
    Target { name: "jsonl", run: crate::jsonl },
    Target { name: "chat_template", run: crate::chat_template },
    Target { name: "toml_config", run: crate::toml_config },
    Target { name: "manifest", run: crate::manifest },
];
