//! A LoRA run's int8 or NF4 base on the GPU, compiled only with the `cuda` feature and run on the
//! GPU machine: its layers go up encoded and are dequantised on the H2D stream by
//! `kernels/cuda/base.cu` into the weight slots, and the run is bitwise one on an fp32 base
//! holding the dequantised weights, with the uploads the plan prices (the body is the CPU
//! test's, `common::lora_base`).
#![cfg(feature = "cuda")]

mod common;

use mt_sched::{CpuOptions, CudaBackend};
use mt_testkit::lora;

use common::lora_base;

#[test]
fn cuda_encoded_base_trains_as_its_dequantised_weights() {
    for name in lora::LORA_NAMES {
        let g = lora::load(name).unwrap();
        lora_base::an_encoded_base_trains_as_its_dequantised_weights(&g, || {
            CudaBackend::new(0, CpuOptions::uniform(300, 35)).unwrap()
        });
    }
}
