//! A GPT-OSS checkpoint written the way the released ones are (config.json in their transformers
//! 4 spelling, MXFP4 experts, `crates/hf/tests/fixtures/gpt_oss_mxfp4`, `scripts/make_mxfp4.py`),
//! imported and run by the CPU engine, gives transformers' own logits for it; and it trains.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{Device, Tensor};
use mt_core::ModelLayout;
use mt_hf::{import_weights, HfModelDir};
use mt_sched::{Batch, CpuBackend, CpuOptions, Engine, EngineOptions};
use mt_store::{GradDtype, HostStore};
use mt_testkit::tol::diff;
use mt_testkit::Tolerance;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../hf/tests/fixtures/gpt_oss_mxfp4")
}

fn engine() -> Engine<CpuBackend> {
    let src = HfModelDir::open(&fixture().join("model")).unwrap();
    let store = HostStore::anonymous(&ModelLayout::new(&src.config), GradDtype::F32).unwrap();
    import_weights(&src, &store).unwrap();
    let backend = CpuBackend::new(CpuOptions::default());
    Engine::new(&src.config, Arc::new(store), backend, EngineOptions::default()).unwrap()
}

#[test]
fn an_imported_released_layout_gives_transformers_logits() {
    let st = candle_core::safetensors::load(fixture().join("expected.safetensors"), &Device::Cpu).unwrap();
    let ids: Vec<u32> =
        st["input_ids"].flatten_all().unwrap().to_vec1::<i64>().unwrap().iter().map(|&x| x as u32).collect();
    let t = ids.len();
    let batch = Batch::from_labels(1, t, ids.clone(), &ids.iter().map(|&x| i64::from(x)).collect::<Vec<_>>())
        .unwrap();
    let ours = engine().logits(&batch).unwrap();
    let want: &Tensor = &st["logits"];
    // transformers ran in float32: the two agree to float32 rounding.
    let d = diff(&ours, want).unwrap();
    eprintln!("SUMMARY gpt_oss mxfp4 import: logits vs transformers rel err {:.2e}", d.rel_err);
    assert!(
        Tolerance::F32_GOLDEN.accepts(d.rel_err),
        "logits differ from transformers' by {:.3e}",
        d.rel_err
    );
}

#[test]
fn an_imported_released_layout_trains() {
    let mut e = engine();
    // 2 sequences of 16 tokens, past the 4-token window of layer 0.
    let ids: Vec<u32> = (0..32u32).map(|i| (i * 7 + 3) % 64).collect();
    let batch =
        Batch::from_labels(2, 16, ids.clone(), &ids.iter().map(|&x| i64::from(x)).collect::<Vec<_>>())
            .unwrap();
    let losses: Vec<f64> = (0..8).map(|_| e.step(&batch, 1e-2).unwrap().loss).collect();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(losses[7] < 0.8 * losses[0], "the loss falls on a repeated batch: {losses:?}");
}

/// `--device cuda` refuses GPT-OSS by name, before anything is allocated, where its attention
/// would not run on the flash kernels (portable or Hopper: the only GPU kernels with its sinks
/// and sliding windows): the materialised scores, fp32 weights.
#[test]
fn the_gpu_refuses_gpt_oss_where_its_attention_cannot_run_with_a_sentence() {
    for (flags, words) in [
        (["--attention", "materialized"], "in the flash attention kernels only"),
        (["--precision", "fp32"], "in the flash attention kernels only"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_megatrain"))
            .args(["train", "--device", "cuda", "--steps", "1"])
            .args(flags)
            .arg("--model")
            .arg(fixture().join("model"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?}");
        assert!(
            err.contains("--device cuda") && err.contains("gpt_oss on a GPU") && err.contains(words),
            "{flags:?}: {err}"
        );
    }
}
