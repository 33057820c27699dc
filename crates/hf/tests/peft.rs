//! peft's adapter format: the committed adapters peft saved (crates/testkit/fixtures/lora, made
//! by scripts/make_lora_golden.py) read, written back and read again bitwise; bad adapters
//! refused by a sentence.

use std::path::PathBuf;

use mt_core::{LoraConfig, LoraTarget, ModelConfig, ModelLayout};
use mt_hf::peft::{export_adapter, import_adapter, read_adapter_config, ADAPTER_CONFIG, PEFT_PREFIX};
use mt_store::{GradDtype, HostStore};

fn fixture(name: &str) -> (PathBuf, ModelConfig) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testkit/fixtures");
    let cfg = ModelConfig::from_file(&root.join(format!("golden/{name}.config.json"))).unwrap();
    (root.join("lora").join(name), cfg)
}

#[test]
fn peft_adapters_read_export_and_read_back_bitwise() {
    for (name, rslora) in [("llama_gqa", false), ("qwen2_bias", true)] {
        let (dir, mut cfg) = fixture(name);
        let lora = read_adapter_config(&dir).unwrap();
        assert_eq!(lora, LoraConfig::new(4, 8.0, &LoraTarget::ALL, 0.0, rslora).unwrap(), "{name}");
        cfg.lora = Some(lora.clone());
        let layout = ModelLayout::trainable(&cfg);
        let store = HostStore::anonymous(&layout, GradDtype::None).unwrap();
        assert_eq!(import_adapter(&dir, &store).unwrap(), cfg.num_hidden_layers * 7 * 2);
        let out = tempfile::tempdir().unwrap();
        export_adapter(&store, &lora, "some/base", out.path()).unwrap();
        assert_eq!(read_adapter_config(out.path()).unwrap(), lora);
        let again = HostStore::anonymous(&layout, GradDtype::None).unwrap();
        import_adapter(out.path(), &again).unwrap();
        for (n, _, _) in layout.all_params() {
            let (a, b) = (store.read_param(&n).unwrap(), again.read_param(&n).unwrap());
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{name}: {n}");
            assert!(a.iter().any(|&x| x != 0.0), "{name}: {n} read as zeros");
        }
        let st = std::fs::read(out.path().join("adapter_model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&st).unwrap();
        assert!(st.names().iter().all(|k| k.starts_with(PEFT_PREFIX)));
        let cfg_json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.path().join(ADAPTER_CONFIG)).unwrap()).unwrap();
        for k in [
            "peft_type",
            "task_type",
            "r",
            "lora_alpha",
            "target_modules",
            "base_model_name_or_path",
            "lora_dropout",
            "use_rslora",
            "bias",
        ] {
            assert!(cfg_json.get(k).is_some(), "{k} missing");
        }
    }
}

#[test]
fn unsupported_adapters_are_refused_by_a_sentence() {
    let (dir, cfg) = fixture("llama_gqa");
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(ADAPTER_CONFIG)).unwrap()).unwrap();
    for (key, value, says) in [
        ("use_dora", serde_json::json!(true), "use_dora"),
        ("target_modules", serde_json::json!(".*proj"), "regular expression"),
        ("target_modules", serde_json::json!(["q_proj", "lm_head"]), "lm_head"),
        ("peft_type", serde_json::json!("IA3"), "LORA"),
        ("rank_pattern", serde_json::json!({"q_proj": 8}), "rank_pattern"),
    ] {
        let t = tempfile::tempdir().unwrap();
        let mut v = base.clone();
        v[key] = value;
        std::fs::write(t.path().join(ADAPTER_CONFIG), v.to_string()).unwrap();
        let err = read_adapter_config(t.path()).unwrap_err().to_string();
        assert!(err.contains(says), "{key}: {err}");
    }
    // An adapter of rank 4 into a model configured for rank 8.
    let mut c8 = cfg;
    c8.lora = Some(LoraConfig::new(8, 8.0, &LoraTarget::ALL, 0.0, false).unwrap());
    let store = HostStore::anonymous(&ModelLayout::trainable(&c8), GradDtype::None).unwrap();
    let err = import_adapter(&dir, &store).unwrap_err().to_string();
    assert!(err.contains("shape"), "{err}");
}
