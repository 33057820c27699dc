//! A device out-of-memory error in a training step, said as one paragraph a user can act on
//! (instead of the tensor library's message and backtrace): what ran out, what the plan counted,
//! and what to change.

use mt_sched::plan::Plan;

use crate::error::Error;

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// `err` of global step `step` as an error a user reads: an out-of-memory as the paragraph
/// below, anything else unchanged (with the step as its context).
pub(crate) fn step_error(err: mt_sched::Error, step: u64, plan: &Plan) -> Error {
    if !err.is_out_of_memory() {
        return Error::Engine { context: format!("training step {step}"), source: Box::new(err) };
    }
    let during = err.op().map(|op| format!(" during {op}")).unwrap_or_default();
    let g = &plan.gpu;
    // The budget the plan filled is 92% of the GPU; a tenth less leaves room for what it missed.
    let suggest = gib(g.budget) / mt_sched::plan::GPU_USABLE_FRACTION * 0.9;
    Error::OutOfMemory(format!(
        "training step {step}: the GPU ran out of memory{during}. The plan accepted for this run counted \
         {:.2} GiB of the {:.2} GiB it may use (workspace {:.2} GiB, checkpoints {:.2} GiB; the table above), \
         so the planner under-counted something: please report it with that plan. To run now, give the \
         planner less memory to fill with --gpu-mem {suggest:.0} (GiB), or use fewer tokens per step \
         (--batch-size, --seq-len) or more --chunks; checkpoints already written are intact (--resume continues \
         from the last one).",
        gib(g.total),
        gib(g.budget),
        gib(g.workspace),
        gib(g.checkpoints),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Plan {
        mt_sched::plan::plan(&mt_sched::plan::PlanInput {
            cfg: mt_core::ModelConfig::tiny_llama(),
            batch: 2,
            seq: 16,
            weight_dtype: candle_core::DType::BF16,
            grad_dtype: mt_store::GradDtype::Bf16,
            state_dtype: mt_core::StateDtype::F32,
            mode: mt_sched::OptimMode::Exact,
            gpu_bytes: 80 << 30,
            host_bytes: 64 << 30,
            ring_depth: None,
            n_chunks: None,
            rows_per_block: 1024,
            fused_kernels: true,
            flash_attention: None,
            hopper_attention: false,
            moe_kernels: true,
            mlp_rows: None,
            store_file: false,
            host_reserved: 0,
            placement: mt_sched::Placement {
                resident_outer: Some(false),
                resident_layers: Some(0),
                kept_layers: Some(0),
                held_layers: Some(0),
                gpu_updated_layers: Some(0),
                late_state_downloads: Some(0),
                early_state_uploads: Some(0),
                spilled_checkpoints: None,
            },
        })
        .unwrap()
    }

    #[test]
    fn out_of_memory_is_one_paragraph_naming_the_op_and_the_plan() {
        use mt_sched::Error;
        let oom = Error::Op {
            op: "Backward { layer: 3, slot: Ring(1), grad_buf: Some(0) }".into(),
            source: Box::new(Error::Cuda(
                "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")\n   0: backtrace".into(),
            )),
        };
        let msg = step_error(oom, 7, &plan()).to_string();
        assert!(
            msg.starts_with("training step 7: the GPU ran out of memory during Backward { layer: 3"),
            "{msg}"
        );
        assert!(msg.contains("--gpu-mem 72 ") && !msg.contains("backtrace") && !msg.contains('\n'), "{msg}");
        let other = step_error(Error::Options("no".into()), 7, &plan());
        assert_eq!(other.to_string(), "training step 7: invalid engine options: no");
    }
}
