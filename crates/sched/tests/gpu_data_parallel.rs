//! Data parallel on GPUs through NCCL, compiled only with the `nccl` feature and run on a GPU
//! machine with libnccl on LD_LIBRARY_PATH (README, "Several GPUs"):
//! - one rank through the real NCCL path (an all-reduce over one rank) trains bitwise as the
//!   plain engine on GPU 0 (any machine with one GPU or more);
//! - 2 ranks (and 4, where there are 4 GPUs), each on its own GPU and thread over the one host
//!   store, train 3 steps as one GPU with the whole batch cut into as many chunks: losses and
//!   weights within the fp32 / bf16 reduction-order tolerances. With fewer GPUs than a case needs,
//!   the case says so on a SUMMARY line and is not run.
//!
//! Every figure is printed (SUMMARY lines) before the bounds are asserted.
#![cfg(feature = "nccl")]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use mt_core::ModelConfig;
use mt_sched::{
    Batch, CpuOptions, CudaBackend, DataParallel, Engine, EngineOptions, NcclId, NcclReduce, Ranks,
};
use mt_store::GradDtype;
use mt_testkit::golden;
use mt_testkit::init::{random_batch, random_params};
use mt_testkit::tol::compare_maps;
use mt_testkit::Tolerance;

use common::*;

fn config() -> ModelConfig {
    let mut cfg = golden::load("llama_gqa").unwrap().cfg;
    cfg.num_hidden_layers = 4;
    cfg
}

fn batches(cfg: &ModelConfig) -> Vec<Batch> {
    (0..3)
        .map(|s| {
            let (input_ids, targets) = random_batch(cfg, 4, 16, 60 + s, 0.2);
            Batch { batch: 4, seq: 16, input_ids, targets, positions: None }
        })
        .collect()
}

fn opts(dtype: DType, n_chunks: usize) -> EngineOptions {
    EngineOptions { weight_dtype: dtype, n_chunks, ..golden_opts() }
}

/// Three steps on GPU 0 alone, the batch in `n_chunks` chunks: losses and final weights.
fn one_gpu(
    cfg: &ModelConfig,
    params: &BTreeMap<String, Tensor>,
    dtype: DType,
    n_chunks: usize,
) -> (Vec<f64>, BTreeMap<String, Tensor>) {
    let store = store_with(cfg, params, GradDtype::F32);
    let backend = CudaBackend::new(0, CpuOptions::uniform(200, 1)).unwrap();
    let mut e = Engine::new(cfg, Arc::clone(&store), backend, opts(dtype, n_chunks)).unwrap();
    let losses = batches(cfg).iter().map(|b| e.step(b, 1e-3).unwrap().loss).collect();
    e.flush_pending().unwrap();
    drop(e);
    (losses, params_of(&store))
}

/// Three steps on GPUs `0..world`, one rank each (one chunk each), through NCCL.
fn ranks(
    cfg: &ModelConfig,
    params: &BTreeMap<String, Tensor>,
    dtype: DType,
    world: usize,
) -> (Vec<f64>, BTreeMap<String, Tensor>) {
    let store = store_with(cfg, params, GradDtype::F32);
    let id = NcclId::new().expect("libnccl on LD_LIBRARY_PATH (README, \"Several GPUs\")");
    let (c, s, o) = (cfg.clone(), Arc::clone(&store), opts(dtype, 1));
    let r = Ranks::start(cfg, world, move |rank| {
        let b = CudaBackend::new(rank, CpuOptions::uniform(200, 2 + rank as u64))?;
        let reduce = NcclReduce::new(&b, rank, world, id)?;
        let mut e = Engine::new(&c, Arc::clone(&s), b, o.clone())?;
        e.set_data_parallel(DataParallel { rank, world, lead: 0, reduce: Box::new(reduce) })?;
        Ok(e)
    })
    .unwrap();
    let losses = batches(cfg).iter().map(|b| r.step(b, 1e-3).unwrap().loss).collect();
    r.with_rank0(|e| e.flush_pending()).unwrap().unwrap();
    drop(r);
    (losses, params_of(&store))
}

fn gpus() -> usize {
    CudaBackend::device_count().unwrap()
}

#[test]
fn one_nccl_rank_trains_bitwise_as_the_plain_engine() {
    let cfg = config();
    let params = random_params(&cfg, 3);
    for dtype in [DType::F32, DType::BF16] {
        let (l1, p1) = one_gpu(&cfg, &params, dtype, 1);
        let (ln, pn) = ranks(&cfg, &params, dtype, 1);
        eprintln!("SUMMARY dp {dtype:?} 1 rank via NCCL: losses {ln:?} vs plain {l1:?}");
        assert_eq!(
            ln.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
            l1.iter().map(|l| l.to_bits()).collect::<Vec<_>>()
        );
        mt_testkit::tol::assert_bitwise_eq(&pn, &p1, &format!("{dtype:?} weights, 1 NCCL rank vs plain"));
    }
}

#[test]
fn ranks_on_several_gpus_train_as_one_gpu_with_the_whole_batch() {
    let cfg = config();
    let params = random_params(&cfg, 4);
    let have = gpus();
    for world in [2, 4] {
        if have < world {
            eprintln!("SUMMARY dp {world} ranks: not run, this machine has {have} GPU(s)");
            continue;
        }
        for (dtype, tol) in [(DType::F32, Tolerance::F32_GOLDEN), (DType::BF16, Tolerance::BF16)] {
            let (l1, p1) = one_gpu(&cfg, &params, dtype, world);
            let (ln, pn) = ranks(&cfg, &params, dtype, world);
            let worst = ln.iter().zip(&l1).map(|(a, b)| (a - b).abs() / b.abs()).fold(0.0, f64::max);
            eprintln!(
                "SUMMARY dp {dtype:?} {world} ranks: losses {ln:?} vs one GPU {l1:?}, worst rel {worst:.2e}"
            );
            let r = compare_maps(&pn, &p1, tol);
            let w = r.worst().map_or(f64::NAN, |t| t.rel_err());
            eprintln!(
                "SUMMARY dp {dtype:?} {world} ranks: weights worst rel {w:.2e} (bound {:.0e})",
                tol.rel
            );
            assert!(worst <= tol.rel, "{dtype:?}, {world} ranks: losses differ by {worst:.2e} (relative)");
            r.assert_ok(&format!("{dtype:?} weights, {world} ranks vs one GPU"));
        }
    }
}
