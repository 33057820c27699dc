//! What a decoder layer's forward keeps for its backward ([`LayerState`], the internal
//! [`Saved`]) and how many bytes that is for a batch shape ([`DecoderLayer::kept_state_bytes`]),
//! the figure the planner counts kept activations with.

use std::sync::Arc;

use candle_core::Tensor;
use mt_core::{ExpertKind, ModelConfig};

use super::DecoderLayer;
use crate::attention::{AttnCache, Dims};
use crate::mlp::MlpSaved;
use crate::ops::RmsCache;
use crate::positions::Docs;

/// What a forward kept for its backward ([`DecoderLayer::forward_keep`]): device activations
/// only, no view of the weights, so it outlives the ring slot the forward ran from.
pub struct LayerState(pub(super) Saved);

impl LayerState {
    /// Bytes of the tensors it holds, beyond what it shares: the layer input (which the fused
    /// CUDA path's input norm keeps itself) and RoPE's `cos`, `sin` (views of the model's table).
    pub fn bytes(&self) -> u64 {
        let s = &self.0;
        let t = |x: &Tensor| (x.elem_count() * x.dtype().size_in_bytes()) as u64;
        let norm = |c: &RmsCache| c.bytes();
        let qk = s.q_norm.as_ref().map_or(0, norm) + s.k_norm.as_ref().map_or(0, norm);
        let input_shared = if s.norm1.shares_input() { t(s.norm1.input()) } else { 0 };
        let mlp: u64 = s.mlp.iter().map(MlpSaved::bytes).sum();
        norm(&s.norm1) - input_shared
            + t(&s.a)
            + qk
            + s.attn.bytes()
            + t(&s.o)
            + s.x1.as_ref().map_or(0, t)
            + mlp
    }
}

impl std::fmt::Debug for LayerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LayerState({} rows, {} B)", self.0.rows, self.bytes())
    }
}

/// Everything the backward needs, from the forward or recomputed from the layer input.
pub(super) struct Saved {
    pub(super) rows: usize,
    pub(super) dims: Dims,
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
    pub(super) docs: Option<Arc<Docs>>,
    pub(super) norm1: RmsCache,
    /// Input-norm output `[N, h]`.
    pub(super) a: Tensor,
    pub(super) q_norm: Option<RmsCache>,
    pub(super) k_norm: Option<RmsCache>,
    pub(super) attn: AttnCache,
    /// Attention output before `o_proj` `[N, nh·hd]`.
    pub(super) o: Tensor,
    /// The attention block's output `x1 = x + o_proj(o)` `[N, h]`, when the MLP tiles are to be
    /// recomputed from it (`mlp` empty).
    pub(super) x1: Option<Tensor>,
    /// The MLP's saved tensors, tile by tile (`tile_ranges`), or none: recomputed in the
    /// backward.
    pub(super) mlp: Vec<MlpSaved>,
}

impl DecoderLayer {
    /// Bytes a [`LayerState`] of `b` sequences of `s` tokens holds (weights and activations of
    /// `e` bytes), beyond the layer's input checkpoint when it shares it: exactly
    /// [`LayerState::bytes`]. `fused`: the CUDA bf16 kernels of compute capability 8.0+
    /// ([`fused_kernels`]): the input-norm output, q (and Qwen3's pre-norm q, k), k, v, the raw
    /// scores and bf16 probabilities (`2 × b·heads·s²`) with f32 row statistics, the attention
    /// output, `x1`, the post-norm output, gate, up and their product, the norms' f32 reciprocal
    /// RMS; `flash` (fused only, [`flash_attention`]): each row's f32 log-sum-exp instead of the
    /// scores and probabilities. Otherwise (candle's ops) also each norm's statistics-dtype
    /// input copy and normalised input, `silu(gate)`, and f32 probabilities instead of the
    /// scores; GPT-OSS: each row's sink probability, the norms' `x·r` in the statistics dtype,
    /// and no activation of its clamped GLU. Linear in `b`: a batch's chunks together hold what
    /// the whole batch would. A mixture of experts on the device kernels (`moe_device`: fused,
    /// and [`moe_kernels_apply`]) keeps per routed row `[gate | up]` and `mid` and the routing
    /// (per token the f32 probabilities, per routed row the expert, weight, permuted row and
    /// slot), and per MLP tile its counts and offsets (`8·E + 4` bytes, counted here once: a
    /// step of several chunks or tiles holds that much more per extra one).
    ///
    /// [`fused_kernels`]: crate::fused_kernels
    /// [`moe_kernels_apply`]: crate::moe_kernels_apply
    pub fn kept_state_bytes(
        cfg: &ModelConfig,
        b: usize,
        s: usize,
        e: u64,
        fused: bool,
        flash: bool,
        moe_device: bool,
    ) -> u64 {
        let (n, sq) = ((b * s) as u64, (s * s) as u64);
        let (h, f, hd) = (cfg.hidden_size as u64, cfg.intermediate_size as u64, cfg.head_dim as u64);
        let (qd, kvd) = (cfg.q_dim() as u64, cfg.kv_dim() as u64);
        let heads = (b * cfg.num_attention_heads) as u64;
        // The MLP's gate, up and mid, and (unfused) silu(gate): per token for a dense MLP; per
        // routed (token, expert) pair for a mixture of experts, which on the portable path also
        // keeps each pair's u32 row index (its router probabilities and routing stay on the
        // host), on the device path its routing.
        let (mlp, act) = match &cfg.moe {
            None => (n * e * 3 * f, n * f * e),
            Some(m) if moe_device && fused => {
                let (pairs, fe, ne) =
                    (n * m.num_experts_per_tok as u64, m.moe_intermediate_size as u64, m.num_experts as u64);
                (pairs * (3 * fe * e + 4 * 4) + n * ne * 4 + 8 * ne + 4, 0)
            }
            Some(m) => {
                let (pairs, fe) = (n * m.num_experts_per_tok as u64, m.moe_intermediate_size as u64);
                // GPT-OSS's clamped GLU keeps no activation of its own (its backward recomputes).
                let act = if matches!(m.experts, ExpertKind::GptOss(_)) { 0 } else { pairs * fe * e };
                (pairs * (3 * fe * e + 4), act)
            }
        };
        // a, c, q, k, v, o, the MLP's; the norms' f32 reciprocal RMS per row.
        let common = n * e * (2 * h + 2 * qd + 2 * kvd) + mlp + 2 * n * 4;
        // Qwen3: the q and k norms keep their pre-norm input and an f32 reciprocal RMS per head
        // (OLMoE: per row).
        let qk_rows = if cfg.qk_norm_full { n * 2 * 4 } else { n * ((qd + kvd) / hd) * 4 };
        if fused {
            // x1 (the post-norm's input); raw scores and bf16 probabilities, (max, sum) per row,
            // or, flash, each row's log-sum-exp.
            let scores =
                if flash { heads * s as u64 * 4 } else { heads * sq * 2 * e + heads * s as u64 * 2 * 4 };
            let qk = if cfg.qk_norm { n * (qd + kvd) * e + qk_rows } else { 0 };
            return common + n * h * e + scores + qk;
        }
        // The statistics dtype: f32 for f32, bf16 and f16 weights.
        let sd = 4;
        // Input norm: an f32 copy of the input unless it is f32 already (then the input itself),
        // and x·r in the weights' dtype; post norm: x1 in the statistics dtype (a copy or x1
        // itself) and x·r; silu(gate); the probabilities in the statistics dtype.
        // GPT-OSS multiplies the norms' weights before the cast: x·r stays in the statistics
        // dtype.
        let xhat = if cfg.norm_weight_before_cast() { sd } else { e };
        let norm1 = if e == sd { 0 } else { n * h * sd } + n * h * xhat;
        let norm2 = n * h * sd + n * h * xhat;
        // With sinks, each row's sink probability too.
        let sinks = if cfg.attention_sinks { heads * s as u64 * sd } else { 0 };
        let scores = heads * sq * sd + sinks;
        // Qwen3: the norms' inputs in the statistics dtype and x·r in the weights' dtype.
        let qk = if cfg.qk_norm { n * (qd + kvd) * (sd + e) + qk_rows } else { 0 };
        common + norm1 + norm2 + act + scores + qk
    }
}
