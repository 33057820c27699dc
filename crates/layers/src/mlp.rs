//! The MLP block of a decoder layer, one row tile at a time: `out = x1 + mlp(norm2(x1))`, the
//! dense SwiGLU MLP or a mixture of experts ([`crate::moe`]), with its backward through the
//! post-attention norm and the residual.

use candle_core::Tensor;
use mt_core::ModelConfig;

use crate::lora::Adapted;
use crate::moe::{self, MoeKernels, MoeSaved, RouterGrad, RouterStats};
use crate::ops::{add, rms_norm, rms_norm_backward, silu_grad, RmsCache};
use crate::profile::mark;
use crate::weights::{names, LayerWeights, MlpWeights};
use crate::Result;
use mt_core::LoraTarget;

/// What the backward needs of one MLP tile.
pub(crate) struct MlpSaved {
    pub(crate) norm2: RmsCache,
    /// Post-attention-norm output `[rows, h]`.
    pub(crate) c: Tensor,
    pub(crate) body: Body,
}

/// The MLP proper's saved tensors.
pub(crate) enum Body {
    Dense(DenseSaved),
    Moe(MoeSaved),
}

/// What the dense SwiGLU's backward needs.
pub(crate) struct DenseSaved {
    gate: Tensor,
    up: Tensor,
    /// `silu(gate)`; `None` on the fused CUDA path (recomputed by the backward kernel).
    act: Option<Tensor>,
    /// `silu(gate) ⊙ up`, the input of `down_proj`.
    mid: Tensor,
}

fn bytes_of(x: &Tensor) -> u64 {
    (x.elem_count() * x.dtype().size_in_bytes()) as u64
}

impl MlpSaved {
    /// Bytes of the tensors it holds.
    pub(crate) fn bytes(&self) -> u64 {
        let body = match &self.body {
            Body::Dense(d) => {
                bytes_of(&d.gate) + bytes_of(&d.up) + d.act.as_ref().map_or(0, bytes_of) + bytes_of(&d.mid)
            }
            Body::Moe(m) => m.bytes(),
        };
        self.norm2.bytes() + bytes_of(&self.c) + body
    }
}

/// One tile `x1: [rows, h]`: what its backward needs and, when `want_out`, its output
/// `x1 + mlp(norm2(x1))`. A MoE layer adds its router's statistics to `stats` when given and
/// runs the path `moe_kernels` asks for where it applies.
pub(crate) fn forward(
    cfg: &ModelConfig,
    w: &LayerWeights,
    x1: &Tensor,
    want_out: bool,
    stats: Option<&mut RouterStats>,
    moe_kernels: MoeKernels,
) -> Result<(Option<Tensor>, MlpSaved)> {
    let dev = x1.device();
    let (c, norm2) = rms_norm(x1, &w.post_norm, cfg.rms_norm_eps, cfg.norm_weight_before_cast())?;
    mark(dev, "fwd 6 post norm");
    let (out, body) = match &w.mlp {
        MlpWeights::Dense { gate, up, down } => {
            let lora = w.lora.as_ref();
            let gate = Adapted::of(lora, LoraTarget::Gate).forward(&c, gate, None)?;
            let up = Adapted::of(lora, LoraTarget::Up).forward(&c, up, None)?;
            mark(dev, "fwd 7 gate/up proj (GEMM)");
            let (act, mid) = swiglu(&gate, &up)?;
            mark(dev, "fwd 8 silu * up");
            let out = if want_out {
                Some(add(x1, &Adapted::of(lora, LoraTarget::Down).forward(&mid, down, None)?)?)
            } else {
                None
            };
            mark(dev, "fwd 9 down proj (GEMM) + residual");
            (out, Body::Dense(DenseSaved { gate, up, act, mid }))
        }
        MlpWeights::Moe { .. } => {
            let m = cfg.moe.as_ref().expect("MoE weights are bound only for a MoE config");
            let (out, saved) = moe::forward(m, &w.mlp, &c, x1, want_out, stats, moe_kernels)?;
            mark(dev, "fwd 7-9 experts + residual");
            (out, Body::Moe(saved))
        }
    };
    Ok((out, MlpSaved { norm2, c, body }))
}

/// Back-propagates `dy: [rows, h]` (the gradient of the tile's output) through the tile:
/// accumulates the MLP's and the post norm's weight gradients, returns `dx1`.
pub(crate) fn backward(
    cfg: &ModelConfig,
    w: &LayerWeights,
    m: MlpSaved,
    dy: &Tensor,
    grads: &crate::GradSink,
    aux: Option<&RouterGrad>,
) -> Result<Tensor> {
    let dev = dy.device();
    let MlpSaved { norm2, c, body } = m;
    let dc = match (&w.mlp, body) {
        (MlpWeights::Dense { gate, up, down }, Body::Dense(s)) => {
            let lora = w.lora.as_ref();
            let d_mid = Adapted::of(lora, LoraTarget::Down).backward(dy, &s.mid, down, grads, None)?;
            mark(dev, "bwd 9 down proj (2 GEMMs + accumulate)");
            let (d_gate, d_up) = swiglu_backward(&d_mid, &s.gate, &s.up, s.act.as_ref())?;
            mark(dev, "bwd 8 silu * up");
            let dc_gate = Adapted::of(lora, LoraTarget::Gate).backward(&d_gate, &c, gate, grads, None)?;
            let dc_up = Adapted::of(lora, LoraTarget::Up).backward(&d_up, &c, up, grads, None)?;
            let dc = add(&dc_gate, &dc_up)?;
            mark(dev, "bwd 7 gate/up proj (4 GEMMs + accumulate)");
            dc
        }
        (MlpWeights::Moe { .. }, Body::Moe(s)) => {
            let m = cfg.moe.as_ref().expect("MoE weights are bound only for a MoE config");
            let dc = moe::backward(&moe::Experts::of(m, &w.mlp), &c, s, dy, grads, aux)?;
            mark(dev, "bwd 7-9 experts");
            dc
        }
        _ => unreachable!("a layer's saved MLP tensors come from its own weights' kind"),
    };
    let (dx1_norm, d_post) = rms_norm_backward(&dc, &w.post_norm, &norm2)?;
    grads.accumulate(names::POST_NORM, &d_post)?;
    // Residual: x1 feeds both the MLP branch and the output.
    let dx1 = add(dy, &dx1_norm)?;
    mark(dev, "bwd 6 post norm");
    Ok(dx1)
}

/// `(silu(gate), silu(gate) ⊙ up)`; on CUDA in bf16 one fused kernel that keeps no `silu(gate)`.
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<(Option<Tensor>, Tensor)> {
    #[cfg(feature = "cuda")]
    if mt_kernels::applies(gate) {
        return Ok((None, mt_kernels::swiglu(gate, up)?));
    }
    let act = gate.silu()?;
    let mid = (&act * up)?;
    Ok((Some(act), mid))
}

/// `(d_gate, d_up)` from `d = dL/d(mid)`.
pub(crate) fn swiglu_backward(
    d: &Tensor,
    gate: &Tensor,
    up: &Tensor,
    act: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    match act {
        Some(act) => {
            let d_act = (d * up)?;
            let d_up = (d * act)?;
            Ok(((d_act * silu_grad(gate)?)?, d_up))
        }
        #[cfg(feature = "cuda")]
        None => Ok(mt_kernels::swiglu_backward(d, gate, up)?),
        #[cfg(not(feature = "cuda"))]
        None => unreachable!("silu(gate) is only dropped by the cuda feature's fused path"),
    }
}
