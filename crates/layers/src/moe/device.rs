//! The MoE MLP on the device kernels (`mt_kernels::MoeRouting`, `kernels/cuda/moe.cu`; decisions
//! 0047, 0049), chained as `scripts/moe_bench.py`'s `Moe` chains them. Nothing is read back to
//! the host and nothing is copied per expert:
//!
//! - forward: the router logits by the dense linear (cuBLAS), the routing (softmax, top-k,
//!   weights, counts and a stable grouping of the `R = T·k` routed rows by expert); the gate-and-up
//!   grouped GEMM reading the token rows through the routing (no permuted copy of `c`); SwiGLU
//!   over all rows; the down grouped GEMM; the combine back to token order, each token's experts
//!   in ascending expert order, weighted, with the residual `x1`;
//! - backward: the down projection's backward GEMM gives `d_mid = bf16(g w)` and the routing
//!   weights' partial gradients (`g = dy W_down[e]`); SwiGLU's backward; both expert weight
//!   gradients added by K-grouped GEMMs straight into the f32 gradient buffer
//!   ([`GradSink::accumulate_in_place`]); `dc`'s expert share by the dX grouped GEMM through
//!   gate-and-up and the unweighted combine, into which the router's `dc` is added; the router's
//!   backward (the routing weights' and the load-balancing loss's gradient, the softmax) on the
//!   device, then the router's linear backward.
//!
//! Every product rounds to bf16 where the portable path's candle ops round (decision 0047), so
//! the two paths differ by reduction order only. What the backward keeps of a tile
//! ([`DeviceSaved`]): the routing, `gu = [gate | up]` `[R, 2f]` and `mid` `[R, f]`.

use candle_core::Tensor;
use mt_core::MoeConfig;
use mt_kernels::{moe_swiglu, moe_swiglu_backward, ExpertMatrix, MoeRouting};

use super::{Experts, RouterGrad, RouterStats};
use crate::ops::{linear, linear_backward};
use crate::weights::names;
use crate::{GradSink, Result};

/// What the backward needs of one device-routed tile.
pub(crate) struct DeviceSaved {
    routing: MoeRouting,
    /// The gate and up projections of every routed row, `[R, 2f]` (gate columns, then up).
    gu: Tensor,
    /// SwiGLU's output, the down projection's input, `[R, f]`.
    mid: Tensor,
}

fn bytes_of(x: &Tensor) -> u64 {
    (x.elem_count() * x.dtype().size_in_bytes()) as u64
}

impl DeviceSaved {
    /// Bytes of its device tensors: the routing's (probabilities, top-k, weights, counts,
    /// offsets, permutation and its inverse), `gu` and `mid`.
    pub(crate) fn bytes(&self) -> u64 {
        let r = &self.routing;
        [
            r.probs(),
            r.top(),
            r.weights(),
            r.counts(),
            r.offsets(),
            r.perm(),
            r.row_slot(),
            &self.gu,
            &self.mid,
        ]
        .into_iter()
        .map(bytes_of)
        .sum()
    }
}

/// The forward of one tile `c: [T, h]` (bf16, on the device), `x1` the residual: as
/// [`super::forward`].
pub(crate) fn forward(
    m: &MoeConfig,
    ex: &Experts<'_>,
    c: &Tensor,
    x1: &Tensor,
    want_out: bool,
    stats: Option<&mut RouterStats>,
) -> Result<(Option<Tensor>, DeviceSaved)> {
    let c = c.contiguous()?;
    let logits = linear(&c, ex.router, None)?;
    let routing = MoeRouting::route(&logits, m.num_experts_per_tok, m.norm_topk_prob)?;
    drop(logits);
    if let Some(s) = stats {
        s.add_device(routing.counts(), routing.probs(), |sums| Ok(routing.prob_sums_add(sums)?))?;
    }
    let gu = routing.matmul(&c, true, ex.gate_up, ExpertMatrix::OutIn)?;
    let mid = moe_swiglu(&gu)?;
    let out = if want_out {
        let y = routing.matmul(&mid, false, ex.down, ExpertMatrix::OutIn)?;
        Some(routing.combine(&y, true, Some(&x1.contiguous()?))?)
    } else {
        None
    };
    Ok((out, DeviceSaved { routing, gu, mid }))
}

/// Back-propagates `dy: [T, h]` through a device-routed tile: accumulates both expert weight
/// gradients and the router's, returns `dc` (bf16 `[T, h]`: each token's expert rows and the
/// router's share summed in f32, rounded once).
pub(crate) fn backward(
    ex: &Experts<'_>,
    c: &Tensor,
    s: DeviceSaved,
    dy: &Tensor,
    grads: &GradSink,
    aux: Option<&RouterGrad>,
) -> Result<Tensor> {
    let DeviceSaved { routing: rt, gu, mid } = s;
    let (c, dy) = (c.contiguous()?, dy.contiguous()?);
    let (d_mid, partial) = rt.down_backward(&dy, ex.down, &mid)?;
    let dgu = moe_swiglu_backward(&d_mid, &gu)?;
    drop((d_mid, gu));
    // dW_down[e] += (dy ⊙ w)ᵀ mid over the expert's rows.
    let dys = rt.gather(&dy, true)?;
    grads.accumulate_in_place(names::EXPERTS_DOWN, |g| Ok(rt.weight_grad(g, &dys, &mid, false)?))?;
    drop((dys, mid));
    // dW_gate_up[e] += [d_gate | d_up]ᵀ c over the expert's rows, c read through the routing.
    grads.accumulate_in_place(names::EXPERTS_GATE_UP, |g| Ok(rt.weight_grad(g, &dgu, &c, true)?))?;
    let dcp = rt.matmul(&dgu, false, ex.gate_up, ExpertMatrix::InOut)?;
    drop(dgu);
    let aux = aux.map(|a| a.on_device(dy.device())).transpose()?;
    let (dlogit, _) = rt.router_backward(&partial, aux.as_ref())?;
    drop(partial);
    let dc_router = linear_backward(&dlogit, &c, ex.router, grads, names::ROUTER, None)?;
    Ok(rt.combine(&dcp, false, Some(&dc_router))?)
}
