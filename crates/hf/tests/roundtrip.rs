//! Export then import: the files are valid safetensors (read back with the `safetensors` crate),
//! sharding and the index are right, and the parameters survive bit for bit (f32) or as their
//! bf16 rounding; re-exports replace stale shards; tokenizer files are copied.

mod common;

use std::collections::BTreeMap;

use common::*;
use half::bf16;
use mt_hf::{export, import_weights, read_header, Dtype, ExportDtype, ExportOptions, HfModelDir};
use safetensors::SafeTensors;
use serde_json::Value;

fn reimport(dir: &std::path::Path) -> (HfModelDir, mt_store::HostStore, mt_hf::ImportReport) {
    let src = HfModelDir::open(dir).unwrap();
    let store = empty_store(&src.config_json);
    let report = import_weights(&src, &store).unwrap();
    (src, store, report)
}

#[test]
fn f32_single_file_round_trip_is_bitwise() {
    let cfg = config_json("llama_gqa");
    let store = filled_store(&cfg, 1);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out"); // created by export
    let rep = export(&store, &cfg, &out, &ExportOptions::default()).unwrap();
    assert_eq!(rep.n_shards, 1);
    assert_eq!(file_names(&out), ["config.json", "model.safetensors"]);
    assert_eq!(rep.files.last().unwrap(), &out.join("config.json"));
    let on_disk: u64 = rep.files.iter().map(|f| std::fs::metadata(f).unwrap().len()).sum();
    assert_eq!(rep.bytes_written, on_disk);

    let (src, back, report) = reimport(&out);
    assert_params_eq(&store, &back, |x| x);
    let n = store.layout().n_params();
    assert_eq!((report.n_tensors, report.n_params), (store.layout().all_params().len(), n));
    assert_eq!(report.bytes_read, 4 * n as u64);
    assert_eq!(report.source_dtypes, BTreeMap::from([("F32".to_owned(), report.n_tensors)]));
    assert_eq!(src.n_params(), n);
    assert_eq!(src.config, mt_core::ModelConfig::from_json(&cfg).unwrap());
}

#[test]
fn the_written_file_is_what_the_safetensors_crate_reads() {
    let cfg = config_json("qwen2_bias");
    let store = filled_store(&cfg, 2);
    let tmp = tempfile::tempdir().unwrap();
    export(&store, &cfg, tmp.path(), &ExportOptions::default()).unwrap();
    let bytes = std::fs::read(tmp.path().join("model.safetensors")).unwrap();
    let (n, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(n % 8, 0, "header must be padded to a multiple of 8");
    assert_eq!(meta.metadata().as_ref().unwrap().get("format").map(String::as_str), Some("pt"));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let names: Vec<String> = store.layout().all_params().into_iter().map(|p| p.0).collect();
    assert_eq!(meta.offset_keys(), names, "tensors are stored in layout order");
    for (name, _, spec) in store.layout().all_params() {
        let t = st.tensor(&name).unwrap();
        assert_eq!((t.dtype(), t.shape()), (Dtype::F32, &spec.shape[..]), "{name}");
        let want: Vec<u8> = store.read_param(&name).unwrap().iter().flat_map(|x| x.to_le_bytes()).collect();
        assert!(t.data() == &want[..], "{name}: data differs");
    }
}

#[test]
fn sharded_round_trip_is_bitwise_and_the_index_is_right() {
    let cfg = config_json("qwen2_bias");
    let store = filled_store(&cfg, 3);
    let total = 4 * store.layout().n_params() as u64;
    let tmp = tempfile::tempdir().unwrap();
    let opts = ExportOptions { max_shard_bytes: total / 4, ..ExportOptions::default() };
    let rep = export(&store, &cfg, tmp.path(), &opts).unwrap();
    assert!(rep.n_shards >= 3, "{} shards", rep.n_shards);
    let files = file_names(tmp.path());
    assert!(!files.iter().any(|f| f.ends_with(".tmp") || f == "model.safetensors"), "{files:?}");
    for i in 1..=rep.n_shards {
        assert!(files.contains(&format!("model-{i:05}-of-{:05}.safetensors", rep.n_shards)), "{files:?}");
    }

    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(index["metadata"]["total_size"], total);
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), store.layout().all_params().len());
    for (name, _, spec) in store.layout().all_params() {
        let file = map[&name].as_str().unwrap();
        let h = read_header(&tmp.path().join(file)).unwrap();
        let t = h.get(&name).unwrap_or_else(|| panic!("{file} lacks {name}"));
        assert_eq!(t.shape, spec.shape);
        assert_eq!(h.metadata.get("format").map(String::as_str), Some("pt"));
        // Each shard respects the limit (a single larger tensor would stand alone).
        let data: u64 = h.tensors.iter().map(|t| t.len).sum();
        assert!(data <= opts.max_shard_bytes || h.tensors.len() == 1, "{file}: {data} bytes");
    }

    let (src, back, _) = reimport(tmp.path());
    assert_eq!(src.shard_paths().count(), rep.n_shards);
    assert_params_eq(&store, &back, |x| x);
}

#[test]
fn bf16_export_imports_as_the_rounded_originals() {
    let cfg = config_json("llama_gqa");
    let store = filled_store(&cfg, 4);
    let tmp = tempfile::tempdir().unwrap();
    let opts =
        ExportOptions { dtype: ExportDtype::Bf16, max_shard_bytes: 60_000, ..ExportOptions::default() };
    let rep = export(&store, &cfg, tmp.path(), &opts).unwrap();
    assert!(rep.n_shards > 1);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    assert!(config.get("dtype").is_none(), "`dtype` is set only when the source had it");

    let (_, back, report) = reimport(tmp.path());
    assert_eq!(report.source_dtypes, BTreeMap::from([("BF16".to_owned(), report.n_tensors)]));
    assert_eq!(report.bytes_read, 2 * store.layout().n_params() as u64);
    assert_params_eq(&store, &back, |x| bf16::from_f32(x).to_f32());
    // The rounding is not a no-op for these values.
    let name = "model.layers.0.mlp.up_proj.weight";
    assert_ne!(store.read_param(name).unwrap(), back.read_param(name).unwrap());
}

#[test]
fn tied_model_writes_no_lm_head() {
    let cfg = config_json("llama_tied");
    let store = filled_store(&cfg, 5);
    let tmp = tempfile::tempdir().unwrap();
    export(&store, &cfg, tmp.path(), &ExportOptions::default()).unwrap();
    let h = read_header(&tmp.path().join("model.safetensors")).unwrap();
    assert!(h.get("lm_head.weight").is_none());
    assert!(h.get("model.embed_tokens.weight").is_some());
    let (_, back, _) = reimport(tmp.path());
    assert_params_eq(&store, &back, |x| x);
}

#[test]
fn config_keeps_every_field_and_sets_both_dtype_spellings() {
    let mut cfg = config_json("llama_gqa");
    cfg["dtype"] = "float32".into();
    cfg["torch_dtype"] = "float16".into();
    let store = filled_store(&cfg, 6);
    let tmp = tempfile::tempdir().unwrap();
    let opts = ExportOptions { dtype: ExportDtype::Bf16, ..ExportOptions::default() };
    export(&store, &cfg, tmp.path(), &opts).unwrap();
    let written: Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap()).unwrap();
    let mut expected = cfg.clone();
    expected["dtype"] = "bfloat16".into();
    expected["torch_dtype"] = "bfloat16".into();
    assert_eq!(written, expected);
}

#[test]
fn a_reexport_removes_stale_shards_of_the_earlier_one() {
    let cfg = config_json("llama_gqa");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path();
    let sharded = ExportOptions { max_shard_bytes: 50_000, ..ExportOptions::default() };
    let first = export(&filled_store(&cfg, 7), &cfg, out, &sharded).unwrap();
    assert!(first.n_shards >= 3);

    // Fewer shards: the extra model-*-of-* files of the first export must go.
    let fewer = ExportOptions { max_shard_bytes: 150_000, ..ExportOptions::default() };
    let second = export(&filled_store(&cfg, 8), &cfg, out, &fewer).unwrap();
    assert!(second.n_shards > 1 && second.n_shards < first.n_shards);
    let n = second.n_shards;
    let shards: Vec<String> = file_names(out).into_iter().filter(|f| f.starts_with("model-")).collect();
    assert_eq!(shards, (1..=n).map(|i| format!("model-{i:05}-of-{n:05}.safetensors")).collect::<Vec<_>>());

    // One file: no shards, no index.
    let store = filled_store(&cfg, 9);
    export(&store, &cfg, out, &ExportOptions::default()).unwrap();
    assert_eq!(file_names(out), ["config.json", "model.safetensors"]);
    let (_, back, _) = reimport(out);
    assert_params_eq(&store, &back, |x| x);

    // And back to shards: model.safetensors must go (transformers would prefer it).
    let store = filled_store(&cfg, 10);
    export(&store, &cfg, out, &sharded).unwrap();
    assert!(!out.join("model.safetensors").exists());
    let (_, back, _) = reimport(out);
    assert_params_eq(&store, &back, |x| x);
}

#[test]
fn tokenizer_and_generation_files_are_copied() {
    let cfg = config_json("llama_gqa");
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("tokenizer.json"), b"{\"tok\": 1}").unwrap();
    std::fs::write(src.join("generation_config.json"), b"{\"gen\": 2}").unwrap();
    std::fs::write(src.join("merges.txt"), b"a b\n").unwrap();
    std::fs::write(src.join("README.md"), b"not copied").unwrap();
    let out = tmp.path().join("out");
    let opts = ExportOptions { copy_files_from: Some(src.clone()), ..ExportOptions::default() };
    let rep = export(&filled_store(&cfg, 11), &cfg, &out, &opts).unwrap();
    assert_eq!(
        file_names(&out),
        ["config.json", "generation_config.json", "merges.txt", "model.safetensors", "tokenizer.json"]
    );
    assert_eq!(rep.files.len(), 5);
    assert_eq!(std::fs::read(out.join("tokenizer.json")).unwrap(), b"{\"tok\": 1}");
    assert_eq!(std::fs::read(out.join("merges.txt")).unwrap(), b"a b\n");
}

#[test]
fn imports_f16_bf16_and_f32_and_skips_non_parameter_buffers() {
    let cfg_text = config_text("llama_tied");
    let cfg: Value = serde_json::from_str(&cfg_text).unwrap();
    let reference = filled_store(&cfg, 12);
    let dtypes = [Dtype::F32, Dtype::BF16, Dtype::F16];
    let mut tensors: Vec<Raw> = reference
        .layout()
        .all_params()
        .into_iter()
        .enumerate()
        .map(|(i, (name, _, spec))| {
            Raw::floats(&name, dtypes[i % 3], spec.shape.clone(), &reference.read_param(&name).unwrap())
        })
        .collect();
    // Buffers some exporters save: a rotary table and, for a tied model, the head.
    tensors.push(Raw::floats("model.layers.0.self_attn.rotary_emb.inv_freq", Dtype::F32, vec![8], &[1.0; 8]));
    tensors.push(Raw::floats("lm_head.weight", Dtype::F32, vec![128, 64], &values(99, 128 * 64)));
    let tmp = tempfile::tempdir().unwrap();
    write_hf_dir(tmp.path(), &cfg_text, &tensors);

    let src = HfModelDir::open(tmp.path()).unwrap();
    assert_eq!(src.n_params(), reference.layout().n_params(), "ignored buffers are not parameters");
    let store = empty_store(&cfg);
    let report = import_weights(&src, &store).unwrap();
    assert_eq!(report.n_tensors, reference.layout().all_params().len());
    assert_eq!(report.source_dtypes.len(), 3);
    for (i, (name, _, _)) in reference.layout().all_params().into_iter().enumerate() {
        let round = |x: f32| match dtypes[i % 3] {
            Dtype::BF16 => bf16::from_f32(x).to_f32(),
            Dtype::F16 => half::f16::from_f32(x).to_f32(),
            _ => x,
        };
        let want: Vec<u32> =
            reference.read_param(&name).unwrap().into_iter().map(|x| round(x).to_bits()).collect();
        let got: Vec<u32> = store.read_param(&name).unwrap().into_iter().map(f32::to_bits).collect();
        assert!(want == got, "{name} ({:?})", dtypes[i % 3]);
    }
}

#[test]
fn golden_fixture_header_lists_every_tensor_with_shape_and_dtype() {
    let h = read_header(&golden_dir().join("llama_gqa.safetensors")).unwrap();
    let input = h.get("input_ids").unwrap();
    assert_eq!((input.dtype, &input.shape[..]), (Dtype::I64, &[4usize, 16][..]));
    let layout = layout_of(&config_json("llama_gqa"));
    for (name, _, spec) in layout.all_params() {
        for prefix in ["param.", "grad."] {
            let t = h.get(&format!("{prefix}{name}")).unwrap_or_else(|| panic!("no {prefix}{name}"));
            assert_eq!((t.dtype, &t.shape), (Dtype::F32, &spec.shape), "{prefix}{name}");
            assert_eq!(t.len, 4 * spec.numel() as u64);
        }
    }
    // Tensors are listed in file order and tile the data section exactly.
    let mut at = h.tensors[0].start;
    for t in &h.tensors {
        assert_eq!(t.start, at, "{}", t.name);
        at += t.len;
    }
    assert_eq!(at, h.file_len);
    assert_eq!(h.metadata.get("model").map(String::as_str), Some("llama_gqa"));
}
