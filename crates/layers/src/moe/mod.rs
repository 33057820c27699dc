//! The mixture-of-experts MLP (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS): a linear router, softmax,
//! top-k, each token's rows grouped by expert (no capacity limit: every token reaches its k
//! experts), one GLU per expert over its rows, the outputs weighted and summed per token; and the
//! statistics of the load-balancing loss ([`RouterStats`], `stats.rs`).
//!
//! Two paths compute it, chosen per tile ([`forward`]):
//! - the device kernels (`device.rs`, cuda only; decisions 0047, 0049): on a CUDA GPU in bf16
//!   with SwiGLU experts within the kernels' limits ([`moe_kernels_apply`]), unless
//!   [`MoeKernels::Portable`] is asked: routing, grouping by expert, grouped GEMMs over the
//!   routed rows, the combine and the whole backward on the device, nothing read back;
//! - the portable path (`host.rs`, `host_backward.rs`) everywhere else: the routing on the host,
//!   one chain of candle ops per expert. GPT-OSS, any non-bf16 and any CPU run take it.
//!
//! GPT-OSS's router has a bias and takes the softmax of the top-k logits, which is the top-k of
//! the softmax renormalised (`norm_topk_prob`), in value and in gradient; its experts have
//! biases, store their matrices `[in, out]` with gate and up in alternate columns, and apply the
//! clamped GLU `(clamp(up, ±L) + 1) · g σ(α g)`, `g = min(gate, L)` ([`ExpertKind::GptOss`]).
//!
//! Numerics, as transformers' modelling code: the router logits in the compute dtype, their
//! softmax, top-k and the renormalisation (`norm_topk_prob`, Mixtral always) in f32 (here
//! evaluated in f64 and rounded to f32 once, on either path), the routing weights cast to the
//! compute dtype. On the CPU in f32 the expert outputs are weighted and summed with the
//! residual in f64 and rounded once (`ops::is_wide`); elsewhere summed in f32, each token's
//! experts in ascending expert order on both paths.

use candle_core::Tensor;
use mt_core::{ClampedGlu, ExpertKind, ModelConfig, MoeConfig};

use crate::mlp::swiglu;
use crate::ops::{linear, wide_dtype};
use crate::weights::MlpWeights;
use crate::{GradSink, Result};

#[cfg(feature = "cuda")]
mod device;
mod host;
mod host_backward;
mod stats;

pub use stats::{RouterGrad, RouterStats};

/// Which mixture-of-experts path a MoE layer runs (`megatrain train --moe-kernels`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MoeKernels {
    /// The device kernels wherever they apply ([`moe_kernels_apply`]), the portable path
    /// elsewhere.
    #[default]
    Device,
    /// The portable path everywhere: the routing on the host, candle ops per expert (the
    /// reference the device kernels are compared with).
    Portable,
}

/// Whether the MoE kernels take this model's MoE layers at all: SwiGLU experts (not GPT-OSS's
/// biased, clamped, interleaved ones) within the kernels' limits (`mt_kernels::moe_fits`: at most
/// 1024 experts, top-k at most 32, hidden size and expert width multiples of 8). `false` for a
/// dense model.
pub fn moe_kernels_fit(cfg: &ModelConfig) -> bool {
    cfg.moe.as_ref().is_some_and(|m| fits(m, cfg.hidden_size, 1))
}

/// Whether a MoE layer of `cfg` runs the device kernels for activations of `dtype` on `device`
/// with `kernels` asked: [`MoeKernels::Device`], the fused kernels' device and dtype (bf16 on a
/// CUDA GPU of compute capability 8.0+, [`crate::fused_kernels`]) and [`moe_kernels_fit`]. (A tile
/// of `2^31 / k` rows or more also takes the portable path; no plan makes one.)
pub fn moe_kernels_apply(
    cfg: &ModelConfig,
    device: &candle_core::Device,
    dtype: candle_core::DType,
    kernels: MoeKernels,
) -> bool {
    kernels == MoeKernels::Device && crate::fused_kernels(device, dtype) && moe_kernels_fit(cfg)
}

/// Bytes of the device MoE path's tensors over one MLP tile of `rows` tokens with activations of
/// `e` bytes (`R = rows·k` routed rows), all counted as alive at once (the backward frees some
/// before it forms others): the routing's (the router logits `[rows, E]`, f32 probabilities, five
/// u32 / f32 per routed row: expert, weight, sort rank, permuted row, slot; the sort's per-chunk
/// counts and bases, the counts and offsets), what the backward keeps (`gu` `[R, 2f]`, `mid`
/// `[R, f]`) and the backward's transients (`d_mid` `[R, f]`, `dgu` `[R, 2f]`, the weighted
/// `dy` rows and the dX product `[R, h]`, the f32 partials `[R, ⌈f / 128⌉]`, the f64 routing
/// weights' gradient `[R]`, `dlogit` `[rows, E]`, the router's and the combined `dc`
/// `[rows, h]`). The planner's figure for a tile of that path; 0 for a dense model.
pub fn moe_device_workspace_bytes(cfg: &ModelConfig, rows: usize, e: u64) -> u64 {
    let Some(m) = &cfg.moe else { return 0 };
    let (t, ne, h, f) =
        (rows as u64, m.num_experts as u64, cfg.hidden_size as u64, m.moe_intermediate_size as u64);
    let r = t * m.num_experts_per_tok as u64;
    let sort_chunks = r.div_ceil(mt_kernels::MOE_SORT_CHUNK as u64);
    let routing = t * ne * (e + 4) + 5 * r * 4 + (2 * sort_chunks * ne + 2 * ne + 1) * 4;
    let saved = r * 3 * f * e;
    let partial = r * f.div_ceil(mt_kernels::MOE_GEMM_TILE as u64) * 4;
    let backward = r * (3 * f + 2 * h) * e + partial + r * 8 + t * ne * e + 2 * t * h * e;
    routing + saved + backward
}

fn fits(m: &MoeConfig, hidden: usize, tokens: usize) -> bool {
    matches!(m.experts, ExpertKind::SwiGlu)
        && mt_kernels::moe_fits(m.num_experts, m.num_experts_per_tok, hidden, m.moe_intermediate_size, tokens)
}

/// What the backward needs of one tile of a MoE layer, by the path its forward took.
pub(crate) enum MoeSaved {
    Host(host::HostSaved),
    #[cfg(feature = "cuda")]
    Device(device::DeviceSaved),
}

impl MoeSaved {
    /// Bytes of its device tensors (what `DecoderLayer::kept_state_bytes` counts).
    pub(crate) fn bytes(&self) -> u64 {
        match self {
            MoeSaved::Host(s) => s.bytes(),
            #[cfg(feature = "cuda")]
            MoeSaved::Device(s) => s.bytes(),
        }
    }
}

/// Views of one MoE layer's router and experts ([`MlpWeights::Moe`]) with their kind.
pub(crate) struct Experts<'a> {
    pub(crate) kind: ExpertKind,
    pub(crate) router: &'a Tensor,
    pub(crate) router_bias: Option<&'a Tensor>,
    gate_up: &'a Tensor,
    gate_up_bias: Option<&'a Tensor>,
    down: &'a Tensor,
    down_bias: Option<&'a Tensor>,
}

impl<'a> Experts<'a> {
    /// The experts of `w`, a MoE layer's MLP weights.
    pub(crate) fn of(m: &MoeConfig, w: &'a MlpWeights) -> Self {
        let MlpWeights::Moe { router, router_bias, gate_up, gate_up_bias, down, down_bias } = w else {
            unreachable!("MoE experts are bound only for a MoE config")
        };
        Experts {
            kind: m.experts,
            router,
            router_bias: router_bias.as_ref(),
            gate_up,
            gate_up_bias: gate_up_bias.as_ref(),
            down,
            down_bias: down_bias.as_ref(),
        }
    }

    /// Expert `e`'s gate-and-up matrix as `[2·f_e, h]` (`[out, in]`; GPT-OSS's transposed
    /// view, its rows alternating gate and up).
    pub(crate) fn gate_up_out_in(&self, e: usize) -> Result<Tensor> {
        let w = self.gate_up.get(e)?;
        Ok(if self.gpt_oss() { w.t()? } else { w })
    }

    /// Expert `e`'s down matrix as `[h, f_e]` (`[out, in]`).
    pub(crate) fn down_out_in(&self, e: usize) -> Result<Tensor> {
        let w = self.down.get(e)?;
        Ok(if self.gpt_oss() { w.t()? } else { w })
    }

    /// Expert `e`'s down bias `[h]` (GPT-OSS).
    pub(crate) fn down_bias(&self, e: usize) -> Result<Option<Tensor>> {
        Ok(self.down_bias.map(|b| b.get(e)).transpose()?)
    }

    pub(crate) fn gpt_oss(&self) -> bool {
        matches!(self.kind, ExpertKind::GptOss(_))
    }

    /// Expert `e`'s gate and up projections (biases added) of its rows `ce: [n_e, h]`.
    fn gate_up(&self, e: usize, ce: &Tensor, fe: usize) -> Result<(Tensor, Tensor)> {
        let bias = self.gate_up_bias.map(|b| b.get(e)).transpose()?;
        let gu = linear(ce, &self.gate_up_out_in(e)?, bias.as_ref())?;
        if self.gpt_oss() {
            // Alternate columns: gate at even, up at odd ones.
            let gu = gu.reshape((ce.dim(0)?, fe, 2))?;
            let pick = |j| -> Result<Tensor> { Ok(gu.narrow(2, j, 1)?.squeeze(2)?.contiguous()?) };
            return Ok((pick(0)?, pick(1)?));
        }
        Ok((gu.narrow(1, 0, fe)?.contiguous()?, gu.narrow(1, fe, fe)?.contiguous()?))
    }

    /// The GLU of `gate` and `up`: `(silu(gate) when kept, its output)`.
    fn glu(&self, gate: &Tensor, up: &Tensor) -> Result<(Option<Tensor>, Tensor)> {
        match self.kind {
            ExpertKind::SwiGlu => swiglu(gate, up),
            ExpertKind::GptOss(glu) => Ok((None, clamped_glu(glu, gate, up)?)),
        }
    }
}

/// GPT-OSS's GLU, `(clamp(up, -L, L) + 1) · g σ(α g)` with `g = min(gate, L)`, evaluated in
/// [`wide_dtype`] and rounded to `gate`'s dtype once.
fn clamped_glu(glu: ClampedGlu, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let wd = wide_dtype(gate);
    let g = gate.to_dtype(wd)?.minimum(glu.limit)?;
    let u = up.to_dtype(wd)?.clamp(-glu.limit, glu.limit)?;
    let sig = ((&g * -glu.alpha)?.exp()? + 1.0)?.recip()?;
    Ok(((u + 1.0)? * (g * sig)?)?.to_dtype(gate.dtype())?)
}

/// Backward of [`clamped_glu`] for `d = dL/d(out)`: with `s = σ(α g)`,
/// `∂out/∂up = g s` where `-L <= up <= L` (0 where the clamp binds: torch's clamp passes the
/// gradient on its bounds), `∂out/∂gate = (u + 1) (s + α g s (1 - s))` where `gate <= L`.
/// Returns `(d_gate, d_up)` in `d`'s dtype.
pub(crate) fn clamped_glu_backward(
    glu: ClampedGlu,
    d: &Tensor,
    gate: &Tensor,
    up: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let wd = wide_dtype(d);
    let (gate, up) = (gate.to_dtype(wd)?, up.to_dtype(wd)?);
    let g = gate.minimum(glu.limit)?;
    let u = up.clamp(-glu.limit, glu.limit)?;
    let sig = ((&g * -glu.alpha)?.exp()? + 1.0)?.recip()?;
    let gate_open = gate.le(glu.limit)?.to_dtype(wd)?;
    let up_open = (up.ge(-glu.limit)?.to_dtype(wd)? * up.le(glu.limit)?.to_dtype(wd)?)?;
    let ds = d.to_dtype(wd)?;
    let d_up = ((&ds * (&g * &sig)?)? * up_open)?;
    let slope = (&sig + ((&g * glu.alpha)? * (&sig * (1.0 - &sig)?)?)?)?;
    let d_gate = (((ds * (u + 1.0)?)? * slope)? * gate_open)?;
    Ok((d_gate.to_dtype(d.dtype())?, d_up.to_dtype(d.dtype())?))
}

/// The MoE MLP of one tile, from the post-attention-norm output `c: [rows, h]`: what the
/// backward needs and, when `want_out`, the tile's output `x1 + Σ_j w_j · expert_j(c)`. The
/// tile's router statistics are added to `stats` when given. The device kernels where they
/// apply (`kernels` asked, [`moe_kernels_apply`]'s conditions and the tile's rows), the portable
/// path elsewhere.
pub(crate) fn forward(
    m: &MoeConfig,
    w: &MlpWeights,
    c: &Tensor,
    x1: &Tensor,
    want_out: bool,
    stats: Option<&mut RouterStats>,
    kernels: MoeKernels,
) -> Result<(Option<Tensor>, MoeSaved)> {
    let ex = Experts::of(m, w);
    #[cfg(feature = "cuda")]
    if kernels == MoeKernels::Device
        && mt_kernels::applies(c)
        && ex.router_bias.is_none()
        && fits(m, c.dim(1)?, c.dim(0)?)
    {
        let (out, saved) = device::forward(m, &ex, c, x1, want_out, stats)?;
        return Ok((out, MoeSaved::Device(saved)));
    }
    let _ = kernels;
    let (out, saved) = host::forward(m, &ex, c, x1, want_out, stats)?;
    Ok((out, MoeSaved::Host(saved)))
}

/// Back-propagates `dy: [rows, h]` (the gradient of the MoE output) through one tile, by the
/// path its forward took; returns `dc`, the gradient of the post-attention-norm output `c`.
pub(crate) fn backward(
    ex: &Experts<'_>,
    c: &Tensor,
    s: MoeSaved,
    dy: &Tensor,
    grads: &GradSink,
    aux: Option<&RouterGrad>,
) -> Result<Tensor> {
    match s {
        MoeSaved::Host(s) => host_backward::backward(ex, c, s, dy, grads, aux),
        #[cfg(feature = "cuda")]
        MoeSaved::Device(s) => device::backward(ex, c, s, dy, grads, aux),
    }
}
