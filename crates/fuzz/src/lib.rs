//! The fuzz targets of megatrain-rs's input parsers, as plain functions of the input bytes:
//! `config.json`, a safetensors header, a shard index, a JSON Lines data file (`input_ids`,
//! `text`, `messages`), the messages a chat template renders, a `--config-file` TOML file and a
//! checkpoint manifest. Every target feeds its bytes to the parser a run uses, and whatever it
//! accepts on to what the run does next with it; a parser may refuse any input (with an error),
//! never panic, loop or allocate without bound.
//!
//! `fuzz/` (cargo-fuzz, nightly) runs them under libFuzzer (`scripts/fuzz.sh SECONDS`); the
//! committed corpus (`crates/fuzz/corpus/TARGET/`: seeds, and every input that ever crashed a
//! target) is replayed by `cargo test -p mt-fuzz` on stable, with a short seeded mutation smoke.
#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use mt_core::{ModelConfig, ModelLayout};
use mt_data::{DataOptions, Dataset, Message, Tokenizer};
use serde_json::Value;

mod targets;

pub use targets::{Target, TARGETS};

/// A scratch directory for the targets that read files, made once per process (a fuzzing
/// process runs one input at a time).
fn scratch() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("a scratch directory for the fuzz targets")).path()
}

fn write(name: &str, bytes: &[u8]) -> PathBuf {
    let path = scratch().join(name);
    std::fs::write(&path, bytes).expect("writing a scratch file");
    path
}

/// The repository's `crates/` directory (fixtures live under it).
fn crates_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("crates/fuzz has a parent").to_owned()
}

/// The data crate's tiny tokenizers: one with a chat template in `tokenizer_config.json`, one
/// with a BOS token and a `chat_template.jinja`.
fn tokenizers() -> &'static [Tokenizer; 2] {
    static TOKS: OnceLock<[Tokenizer; 2]> = OnceLock::new();
    TOKS.get_or_init(|| {
        let dir = crates_dir().join("data/fixtures");
        let load = |name: &str| Tokenizer::from_model_dir(&dir.join(name)).expect("the fixture tokenizer");
        [load("tiny_tok"), load("tiny_tok_bos")]
    })
}

/// `config.json`: parsed and validated; an accepted config gets its layout (every size the
/// store and the planner derive from it) and must read back from its own JSON unchanged.
pub fn config_json(data: &[u8]) {
    let Ok(value) = serde_json::from_slice::<Value>(data) else { return };
    let Ok(cfg) = ModelConfig::from_json(&value) else { return };
    let layout = ModelLayout::new(&cfg);
    let _ = (layout.n_params(), layout.n_units(), cfg.q_dim(), cfg.kv_dim());
    let _ = cfg.check_seq_len(cfg.max_position_embeddings);
    let back = ModelConfig::from_json(&cfg.to_hf_json()).expect("a config reads back from its own JSON");
    assert_eq!(back, cfg, "a config must read back from its own JSON unchanged");
}

/// A safetensors file's header (the input is the whole file).
pub fn safetensors_header(data: &[u8]) {
    let Ok(h) = mt_hf::header_from_bytes(Path::new("fuzz.safetensors"), data) else { return };
    for t in &h.tensors {
        assert!(t.start + t.len <= h.file_len, "tensor {} runs past the file", t.name);
        let _ = (t.numel(), h.get(&t.name));
    }
}

/// `model.safetensors.index.json` of a model directory whose config and one shard (the tiny
/// Llama fixture's weights, as `model-00001-of-00001.safetensors`) are real.
pub fn safetensors_index(data: &[u8]) {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = scratch().join("model");
        let fixture = crates_dir().join("megatrain/tests/fixtures/roundtrip/llama/model");
        std::fs::create_dir_all(&dir).expect("scratch model directory");
        std::fs::copy(fixture.join("config.json"), dir.join("config.json")).expect("fixture config");
        let shard = dir.join("model-00001-of-00001.safetensors");
        std::fs::copy(fixture.join("model.safetensors"), shard).expect("fixture weights");
        dir
    });
    std::fs::write(dir.join("model.safetensors.index.json"), data).expect("writing the index");
    let Ok(hf) = mt_hf::HfModelDir::open(dir) else { return };
    let _ = (hf.n_params(), hf.shard_paths().count());
}

/// A JSON Lines data file, loaded as a run loads it: without a tokenizer (`input_ids` only) and
/// with each fixture tokenizer (`text`, `messages`); the first byte picks the options. What
/// loads is batched as training and evaluation batch it.
pub fn jsonl(data: &[u8]) {
    let Some((&flags, rest)) = data.split_first() else { return };
    let path = write("data.jsonl", rest);
    let opts = DataOptions {
        seq_len: [1, 4, 16, 64][usize::from(flags & 3)],
        vocab_size: 320,
        pack: flags & 4 != 0,
        truncate: flags & 8 != 0,
        eval_fraction: if flags & 16 != 0 { 0.25 } else { 0.0 },
        shuffle: flags & 32 != 0,
        seed: u64::from(flags >> 6),
    };
    let tok = match flags >> 6 {
        0 => None,
        k => Some(&tokenizers()[usize::from(k) % 2]),
    };
    let Ok(d) = Dataset::load(&path, tok, &opts) else { return };
    for step in 0..3 {
        let b = d.train_batch(step, 2);
        assert_eq!(b.input_ids.len(), 2 * opts.seq_len, "a batch is batch x seq_len tokens");
        let _ = d.cursor(step, 2);
    }
    let _ = d.eval_batches(2);
}

/// The messages a chat template renders: the input as a JSON list of messages or, failing
/// that, raw bytes split into turns (first byte of each: the role). Rendered by both fixture
/// templates, then loaded as a one-line `messages` data file (the loss mask of the assistant
/// turns is found by rendering prefixes).
pub fn chat_template(data: &[u8]) {
    let messages: Vec<Message> = match serde_json::from_slice(data) {
        Ok(m) => m,
        Err(_) => data
            .split(|&b| b == 0xff)
            .map(|turn| {
                let (role, text) = turn.split_first().map_or((0, &[][..]), |(&r, t)| (r, t));
                let role = ["user", "assistant", "system", "tool"][usize::from(role & 3)];
                Message::new(role, String::from_utf8_lossy(text))
            })
            .collect(),
    };
    for tok in tokenizers() {
        let _ = tok.render_chat(&messages, false);
        let _ = tok.render_chat(&messages, true);
    }
    let Ok(line) = serde_json::to_string(&serde_json::json!({ "messages": messages })) else { return };
    let path = write("chat.jsonl", line.as_bytes());
    for tok in tokenizers() {
        let opts = DataOptions { truncate: true, ..DataOptions::new(64, 320) };
        let _ = Dataset::load(&path, Some(tok), &opts);
    }
}

/// A `--config-file` TOML file: its options spliced into `megatrain train` and parsed as the
/// command line is, then turned into the run's configuration.
pub fn toml_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(options) = megatrain::cli::config_text_options(text, Path::new("fuzz.toml")) else { return };
    let argv = [OsString::from("megatrain"), OsString::from("train")].into_iter().chain(options);
    let Ok(cli) = megatrain::cli::parse_args(argv) else { return };
    if let megatrain::Command::Train(args) = &cli.command {
        let _ = args.to_config();
    }
}

/// A checkpoint manifest, as `--resume` reads it: listed in a checkpoint directory beside a
/// snapshot file of the size it may name, then compared with a run's defining options.
pub fn manifest(data: &[u8]) {
    let dir = scratch().join("checkpoints");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch checkpoint directory");
    std::fs::write(dir.join("step-000000003.json"), data).expect("writing the manifest");
    std::fs::write(dir.join("step-000000003.store"), [0u8; 100]).expect("writing a snapshot");
    let defining = serde_json::json!({ "lr": 0.001, "seq_len": 16, "model_config": { "hidden_size": 64 } });
    if let Ok(Some((_, m))) = mt_train::checkpoint::latest(&dir) {
        let _ = mt_train::checkpoint::check_same_run(&m, &defining);
    }
    if let Ok(m) = serde_json::from_slice::<mt_train::checkpoint::Manifest>(data) {
        let _ = mt_train::checkpoint::check_same_run(&m, &defining);
        let _ = mt_train::checkpoint::hash_json(&m.defining);
    }
}
