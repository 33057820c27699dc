//! Parsing and validation of `config.json`: defaults, both transformers spellings, refusals
//! naming the field, and the round trip through `to_hf_json`.

use super::*;
use serde_json::json;

fn base() -> Value {
    json!({
        "model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "hidden_act": "silu"
    })
}

#[test]
fn to_hf_json_round_trips_every_golden_config() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testkit/fixtures/golden");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.to_string_lossy().ends_with(".config.json") {
            let c = ModelConfig::from_file(&p).unwrap();
            assert_eq!(ModelConfig::from_json(&c.to_hf_json()).unwrap(), c, "{}", p.display());
            n += 1;
        }
    }
    assert_eq!(n, 8);
    let t = ModelConfig::tiny_llama();
    assert_eq!(ModelConfig::from_json(&t.to_hf_json()).unwrap(), t);
}

#[test]
fn parses_minimal_llama_with_defaults() {
    let c = ModelConfig::from_json(&base()).unwrap();
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!(c.head_dim, 4);
    assert_eq!(c.rope_theta, 10_000.0);
    assert!(!c.tie_word_embeddings && !c.qkv_bias && !c.qk_norm);
}

#[test]
fn reads_rope_from_transformers5_rope_parameters() {
    let mut v = base();
    v["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let c = ModelConfig::from_json(&v).unwrap();
    assert_eq!(c.rope_theta, 500000.0);
    assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0));
}

#[test]
fn qwen_flags() {
    let mut v = base();
    v["model_type"] = json!("qwen2");
    assert!(ModelConfig::from_json(&v).unwrap().qkv_bias);
    v["model_type"] = json!("qwen3");
    v["head_dim"] = json!(8);
    let c = ModelConfig::from_json(&v).unwrap();
    assert!(c.qk_norm && !c.qkv_bias);
    assert_eq!(c.q_dim(), 32);
}

#[test]
fn bad_configs_name_the_problem() {
    let cases: Vec<(Value, &str)> = vec![
        (json!([1, 2]), "JSON object"),
        (
            {
                let mut v = base();
                v["model_type"] = json!("gpt2");
                v
            },
            "gpt2",
        ),
        (
            {
                let mut v = base();
                v.as_object_mut().unwrap().remove("hidden_size");
                v
            },
            "hidden_size",
        ),
        (
            {
                let mut v = base();
                v["hidden_size"] = json!("big");
                v
            },
            "hidden_size",
        ),
        (
            {
                let mut v = base();
                v["num_key_value_heads"] = json!(3);
                v
            },
            "num_key_value_heads",
        ),
        (
            {
                let mut v = base();
                v["hidden_act"] = json!("gelu");
                v
            },
            "gelu",
        ),
        (
            {
                let mut v = base();
                v["rope_scaling"] = json!({"rope_type": "dynamic", "factor": 4.0});
                v
            },
            "dynamic",
        ),
        (
            {
                let mut v = base();
                v["vocab_size"] = json!(0);
                v
            },
            "vocab_size",
        ),
    ];
    for (v, needle) in cases {
        let err = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(err.contains(needle), "error {err:?} should mention {needle:?}");
    }
}

#[test]
fn sliding_window_refuses_longer_sequences() {
    let mut v = base();
    v["sliding_window"] = json!(8);
    let c = ModelConfig::from_json(&v).unwrap();
    assert!(c.check_seq_len(8).is_ok());
    assert!(c.check_seq_len(9).unwrap_err().to_string().contains("sliding_window"));
}

#[test]
fn training_longer_than_max_position_embeddings_is_refused() {
    let mut v = base();
    v["max_position_embeddings"] = json!(8192);
    let c = ModelConfig::from_json(&v).unwrap();
    assert!(c.check_train_seq_len(8192).is_ok());
    let e = c.check_train_seq_len(8193).unwrap_err().to_string();
    assert!(e.contains("8193") && e.contains("max_position_embeddings (8192)"), "{e}");
    // Within the positions, the sliding window still binds.
    v["sliding_window"] = json!(4096);
    let c = ModelConfig::from_json(&v).unwrap();
    assert!(c.check_train_seq_len(4096).is_ok());
    assert!(c.check_train_seq_len(4097).unwrap_err().to_string().contains("sliding_window"));
}
