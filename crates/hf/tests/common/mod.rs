//! Shared helpers of the `mt-hf` integration tests: golden configs, stores filled with distinct
//! seeded values, and hand-made Hugging Face directories written with the `safetensors` crate's
//! own serializer (an independent writer to check the reader against).
#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};

use half::{bf16, f16};
use mt_core::{ModelConfig, ModelLayout};
use mt_store::{GradDtype, HostStore};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::Value;

/// The golden fixtures directory of mt-testkit.
pub fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testkit/fixtures/golden")
}

/// The text of a golden `NAME.config.json`.
pub fn config_text(name: &str) -> String {
    std::fs::read_to_string(golden_dir().join(format!("{name}.config.json"))).unwrap()
}

/// A golden config as JSON.
pub fn config_json(name: &str) -> Value {
    serde_json::from_str(&config_text(name)).unwrap()
}

/// The layout of a config document.
pub fn layout_of(cfg: &Value) -> ModelLayout {
    ModelLayout::new(&ModelConfig::from_json(cfg).unwrap())
}

/// An empty (all-zero) anonymous store for a config document.
pub fn empty_store(cfg: &Value) -> HostStore {
    HostStore::anonymous(&layout_of(cfg), GradDtype::None).unwrap()
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `n` distinct-looking values in [-2, 2) with every mantissa bit in play, from `seed`.
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n).map(|_| (splitmix(&mut s) >> 40) as f32 / (1u64 << 22) as f32 - 2.0).collect()
}

/// A store for `cfg` whose every parameter holds distinct seeded values.
pub fn filled_store(cfg: &Value, seed: u64) -> HostStore {
    let store = empty_store(cfg);
    for (i, (name, _, spec)) in store.layout().all_params().into_iter().enumerate() {
        store.write_param(&name, &values(seed * 1000 + i as u64, spec.numel())).unwrap();
    }
    store
}

/// Asserts two stores hold bitwise-equal parameters (after mapping the first through `f`).
pub fn assert_params_eq(expected: &HostStore, actual: &HostStore, f: impl Fn(f32) -> f32) {
    for (name, _, _) in expected.layout().all_params() {
        let a: Vec<u32> = expected.read_param(&name).unwrap().into_iter().map(|x| f(x).to_bits()).collect();
        let b: Vec<u32> = actual.read_param(&name).unwrap().into_iter().map(f32::to_bits).collect();
        assert!(a == b, "{name} differs after the round trip");
    }
}

/// One tensor of a hand-made safetensors file.
pub struct Raw {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl Raw {
    /// A tensor from f32 values stored as `dtype` (F32, BF16 or F16).
    pub fn floats(name: &str, dtype: Dtype, shape: Vec<usize>, v: &[f32]) -> Raw {
        let bytes = match dtype {
            Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Dtype::BF16 => v.iter().flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes()).collect(),
            Dtype::F16 => v.iter().flat_map(|&x| f16::from_f32(x).to_bits().to_le_bytes()).collect(),
            other => panic!("Raw::floats does not encode {other}"),
        };
        Raw { name: name.to_owned(), dtype, shape, bytes }
    }
}

/// Every parameter of the store as an F32 `Raw` tensor, in layout order.
pub fn raw_params(store: &HostStore) -> Vec<Raw> {
    store
        .layout()
        .all_params()
        .into_iter()
        .map(|(name, _, spec)| {
            Raw::floats(&name, Dtype::F32, spec.shape.clone(), &store.read_param(&name).unwrap())
        })
        .collect()
}

/// Writes a safetensors file with the `safetensors` crate's serializer.
pub fn write_safetensors(path: &Path, tensors: &[Raw]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|t| (t.name.clone(), TensorView::new(t.dtype, t.shape.clone(), &t.bytes).unwrap()))
        .collect();
    let meta = std::collections::HashMap::from([("format".to_owned(), "pt".to_owned())]);
    safetensors::serialize_to_file(views, Some(meta), path).unwrap();
}

/// Writes `config.json` and a single `model.safetensors` into `dir`.
pub fn write_hf_dir(dir: &Path, config: &str, tensors: &[Raw]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
    write_safetensors(&dir.join("model.safetensors"), tensors);
}

/// Names of the files in `dir`, sorted.
pub fn file_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    v.sort();
    v
}
