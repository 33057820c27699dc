//! Attention's share of `megatrain estimate`'s step time: our flash kernels' measured rates (the
//! Hopper kernels on compute capability 9.0, the portable ones elsewhere) and the materialised
//! path's.

use mt_sched::plan::Plan;

use crate::cli::EstimateArgs;

/// Our portable flash kernels' forward and backward TFLOP/s (causal FLOPs, the backward counted
/// as 2.5x the forward) by sequence length, measured on an H200 at 28 / 4 heads, head dim 128,
/// one sequence (`docs/decisions/0041`); interpolated in log2 of the length, the ends held beyond.
pub const FLASH_TFLOPS: [(usize, f64, f64); 4] =
    [(4096, 175.2, 115.8), (16384, 229.9, 194.3), (65536, 253.3, 193.0), (131072, 256.9, 195.5)];

/// The Hopper flash kernels' (`kernels/cuda/flash_attn_hopper.cu`) forward and backward TFLOP/s,
/// deterministic backward, by sequence length, measured as [`FLASH_TFLOPS`] on an H100
/// (`docs/decisions/0041`): 16k and longer with the masked and unmasked loop bodies compiled apart,
/// 4k and 8k from the kernels before that change (slower: a lower bound there). Short sequences
/// run slower: the ordered dQ adds wait more there.
pub const HOPPER_FLASH_TFLOPS: [(usize, f64, f64); 5] = [
    (4096, 302.0, 202.0),
    (8192, 449.0, 316.0),
    (16384, 629.0, 450.0),
    (65536, 646.0, 505.0),
    (131072, 592.0, 498.0),
];

/// TFLOP/s of the materialised attention (candle's GEMMs and our softmax kernels, the
/// `6·L·s·hidden·T` FLOPs and the recompute's forward), as the H200 runs of the 3.6B at 4 / 16 x
/// 2048 showed with the GEMMs at [`EstimateArgs::tflops`]'s 600 (`docs/decisions/0041`).
pub const MATERIALISED_ATTENTION_TFLOPS: f64 = 80.0;

/// Attention's own seconds of a step, forward and backward.
pub(super) struct AttentionTime {
    pub(super) forward: f64,
    pub(super) backward: f64,
}

/// The attention core's time (scores, softmax, the weighted sum; its projections are GEMMs):
/// forward `A = 2·seq·(heads·head_dim)·T·L` FLOPs (causal), run again in the backward's recompute
/// of every layer that keeps no activations, and the flash backward's `2.5·A` (it recomputes the
/// probabilities), at `--attention-tflops` or [`FLASH_TFLOPS`] at this length; the materialised
/// path's `3·A` and recompute at [`MATERIALISED_ATTENTION_TFLOPS`]. Whole sequences (packed
/// documents attend less).
pub(super) fn attention_s(cfg: &mt_core::ModelConfig, p: &Plan, args: &EstimateArgs) -> AttentionTime {
    let l = cfg.num_hidden_layers as f64;
    let a =
        2.0 * p.seq as f64 * (cfg.num_attention_heads * cfg.head_dim) as f64 * (p.batch * p.seq) as f64 * l;
    let recomputed = (cfg.num_hidden_layers - p.placement.kept_layers) as f64 / l;
    if !p.flash_attention {
        let rate = MATERIALISED_ATTENTION_TFLOPS * 1e12;
        return AttentionTime { forward: a / rate, backward: a * (2.0 + recomputed) / rate };
    }
    let table: &[(usize, f64, f64)] = if p.hopper_attention { &HOPPER_FLASH_TFLOPS } else { &FLASH_TFLOPS };
    let (fwd, bwd) = args.attention_tflops.map_or_else(|| flash_tflops(table, p.seq), |r| (r.0, r.1));
    AttentionTime {
        forward: a / (fwd * 1e12),
        backward: a * recomputed / (fwd * 1e12) + 2.5 * a / (bwd * 1e12),
    }
}

/// A table's rates at `seq` tokens.
fn flash_tflops(t: &[(usize, f64, f64)], seq: usize) -> (f64, f64) {
    let x = (seq.max(1) as f64).log2();
    let (first, last) = (t[0], t[t.len() - 1]);
    if x <= (first.0 as f64).log2() {
        return (first.1, first.2);
    }
    for w in t.windows(2) {
        let (x0, x1) = ((w[0].0 as f64).log2(), (w[1].0 as f64).log2());
        if x <= x1 {
            let f = (x - x0) / (x1 - x0);
            return (w[0].1 + f * (w[1].1 - w[0].1), w[0].2 + f * (w[1].2 - w[0].2));
        }
    }
    (last.1, last.2)
}
