//! What each thing the planner places costs in bytes: the host store's arena, a LoRA run's
//! frozen base (held, staged and uploaded in its encoding), and the transient workspace of a
//! layer's backward and of the loss (counted tensor by tensor, measured against the device
//! pool's high-water mark).

use candle_core::DType;
use mt_core::{ModelConfig, ModelLayout, StateDtype, Unit};
use mt_store::{GradDtype, TransferDtype, PAGE};

/// `[t, hidden]` tensors alive at the peak of a layer's backward (a, x1, c, output, dy, dx1,
/// da, dx).
const HIDDEN_TENSORS: u64 = 8;
/// `[t, q_dim + 2 kv_dim]` tensors alive (projections, their RoPE'd and heads-first copies,
/// the three gradients and their RoPE backward).
const QKV_TENSORS: u64 = 6;
/// `[rows, ffn]` tensors alive in one MLP tile (saved gate, up, silu, product; down dx, d_act,
/// d_up, silu', d_gate).
const FFN_TENSORS: u64 = 9;
/// Flash attention: f32 values per (token, head) alive in a layer's backward (the forward's
/// log-sum-exp and the backward's `rowsum(dO ⊙ O)`); no `[s, s]` tensor exists.
const FLASH_ROW_F32: u64 = 2;
/// Flash attention, `[t, hidden]` tensors alive at the two peaks of a layer's backward (with
/// `q_dim`- and `kv_dim`-wide ones beside them, [`flash_acts`]).
const FLASH_MLP_PEAK_HIDDEN: u64 = 5;
const FLASH_ATTN_PEAK_HIDDEN: u64 = 2;
/// f32 `[b, heads, s, s]` tensors alive in the attention backward (P, dP, dP - rowsum, the
/// product, and the weight-dtype copies of P and dS).
const SCORE_TENSORS: u64 = 5;
/// f32 `[rows, vocab]` tensors alive in one loss block (logits, exp, softmax, dlogits, and
/// the weight-dtype copies).
const LOGIT_TENSORS: u64 = 5;
/// With the fused kernels (`PlanInput::fused_kernels`), bytes per `[b, heads, s, s]` element
/// alive in a layer's backward: S and P (bf16; recomputed, or kept and then also counted in the
/// kept state), dP and dS (bf16). No f32 copy of any of them exists on that path.
const FUSED_SCORE_BYTES: u64 = 8;
/// With the fused kernels, bytes per `[rows, vocab]` element alive in one loss block: the bf16
/// logits and the bf16 dlogits of `mt_ce_grad`; the head's weight gradient is accumulated into
/// its f32 buffer by the GEMM itself (no transient copy).
const FUSED_LOGIT_BYTES: u64 = 4;

/// A LoRA run's frozen base as it is held, staged and uploaded into slots of a weight dtype
/// ([`base_bytes`]); all zero without LoRA.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BaseBytes {
    /// Its encoding (`--base-dtype`).
    pub dtype: mt_core::BaseDtype,
    /// In host memory (`mt_store::FrozenBase::bytes`): its encoding's.
    pub host: u64,
    /// Uploaded with a decoder layer's slot: the encoded bytes where the device dequantises them
    /// (`mt_store::uploads_encoded`), else the weights in the slot's dtype.
    pub layer_up: u64,
    /// Uploaded with the outer unit's slot (never encoded: its tensors stay bf16 or fp32).
    pub outer_up: u64,
    /// Host memory read and written staging a decoder layer's base into its upload copy: the
    /// encoding read, then what goes up written.
    pub layer_stage: u64,
    /// The same for the outer unit's base.
    pub outer_stage: u64,
    /// The device buffer a layer's encoded base lands in before its dequantisation
    /// (`mt_pool::PoolSpec::base_scratch`; 0 where the base goes up as weights).
    pub scratch: u64,
}

/// The staging buffers' element type for device weights of `d`.
pub(crate) fn transfer_dtype(d: DType) -> TransferDtype {
    match d {
        DType::F32 => TransferDtype::F32,
        DType::F16 => TransferDtype::F16,
        _ => TransferDtype::Bf16,
    }
}

/// `cfg`'s frozen base (`cfg.lora`'s `base` encoding) staged and uploaded into slots of
/// `weight_dtype`.
pub fn base_bytes(cfg: &ModelConfig, weight_dtype: DType) -> BaseBytes {
    let Some(l) = &cfg.lora else { return BaseBytes::default() };
    let layout = ModelLayout::new(&ModelConfig { lora: None, ..cfg.clone() });
    let (e, td) = (weight_dtype.size_in_bytes(), transfer_dtype(weight_dtype));
    // (held, staged, uploaded, encoded) bytes of a unit.
    let unit = |u: Unit| {
        let (enc, n) = (l.base.encoding(layout.unit(u), u), layout.unit(u).len);
        let encoded = mt_store::uploads_encoded(&enc, td);
        let up = if encoded { enc.bytes } else { n * e } as u64;
        (enc.bytes as u64, enc.bytes as u64 + up, up, encoded)
    };
    let ((oh, os, ou, _), (lh, ls, lu, lenc)) = (unit(Unit::Outer), unit(Unit::Layer(0)));
    BaseBytes {
        dtype: l.base,
        host: oh + layout.n_layers as u64 * lh,
        layer_up: lu,
        outer_up: ou,
        layer_stage: ls,
        outer_stage: os,
        scratch: if lenc { lu } else { 0 },
    }
}

pub(super) fn grad_elem_bytes(grad: GradDtype) -> u64 {
    match grad {
        GradDtype::F32 => 4,
        GradDtype::Bf16 => 2,
        GradDtype::None => 0,
    }
}

pub(super) fn round_page(n: u64) -> u64 {
    n.div_ceil(PAGE as u64) * PAGE as u64
}

/// Exactly the bytes [`mt_store::HostStore`] maps for `layout` with `grad` gradients and
/// `states` moments: per record a meta page, the fp32 master and the two moments and the gradient,
/// each page-rounded (`4 + 2·s + g` B/param and padding).
pub fn store_bytes(layout: &ModelLayout, grad: GradDtype, states: StateDtype) -> u64 {
    let record = |len: usize| record_bytes(len, grad, states);
    PAGE as u64 + record(layout.outer.len) + layout.n_layers as u64 * record(layout.layer.len)
}

/// Bytes of one store record of `len` parameters (meta page and page-rounded regions).
fn record_bytes(len: usize, grad: GradDtype, states: StateDtype) -> u64 {
    let moment = round_page(states.moment_bytes(len) as u64);
    PAGE as u64 + round_page(len as u64 * 4) + 2 * moment + round_page(len as u64 * grad_elem_bytes(grad))
}

/// Bytes of the store's largest record: the unit a paged store moves between disk and RAM.
pub fn largest_record(layout: &ModelLayout, grad: GradDtype, states: StateDtype) -> u64 {
    record_bytes(layout.outer.len.max(layout.layer.len), grad, states)
}

/// Records a paged store's RAM window holds at least: the one in use and the next.
pub const PAGED_MIN_RECORDS: u64 = 2;

/// How a decoder layer runs, as far as its memory goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerPath {
    /// The fused CUDA kernels (`mt_layers::fused_kernels`).
    pub fused: bool,
    /// Flash attention (`mt_layers::flash_attention`; fused only).
    pub flash: bool,
    /// ... on the Hopper kernels (their fp32 dQ buffer: `mt_layers::hopper_dq_buffer_bytes`).
    pub hopper: bool,
    /// A mixture of experts on the device MoE kernels (fused only;
    /// `mt_layers::moe_kernels_apply`).
    pub moe_kernels: bool,
    /// Rows of an MLP tile (`mt_layers::LayerOptions::mlp_rows`), 0 = all of a chunk's.
    pub mlp_rows: usize,
}

/// Peak transient bytes of one layer's backward with recompute over a chunk of `b` sequences of
/// `s` tokens (`t = b·s` rows, MLP tiles of `r = min(mlp_rows, t)` rows):
/// `e·(8·t·hidden + 6·t·(q_dim + 2·kv_dim) + 9·r·ffn)` plus the attention's own, and the largest
/// weight gradient before accumulation. Candle's ops: scores `5·b·heads·s²·4` and the gradient
/// `numel × (e + 4 + 4)` (the gradient, its f32 copy and the sum written back). The fused
/// kernels: scores `8·b·heads·s²` ([`FUSED_SCORE_BYTES`]) and no gradient copy (the GEMM
/// accumulates into the f32 buffer); with flash attention no scores, `2·t·heads` f32. (The
/// candle-path count, held against the device pool's high-water mark, overestimated the fused
/// path by gigabytes: docs/decisions/0041.)
///
/// A mixture of experts: `ffn` is the routed width `k·f_e` per token (each token's rows reach
/// `k` experts of width `f_e`), plus the router's `[t, E]` probabilities; the largest weight
/// gradient formed at once is one expert's matrix, not the packed tensor. On the device MoE
/// kernels (fused, `path.moe_kernels`) the tile's MLP tensors are instead
/// `mt_layers::moe_device_workspace_bytes` (the routing, `gu`, `mid` and the backward's routed
/// rows; no weight gradient is formed apart: the GEMMs add into the f32 buffer).
///
/// `trainable` is the layout of what trains ([`ModelLayout::trainable`]): a LoRA run forms
/// the gradients of its adapters only, never a frozen weight's.
pub fn layer_workspace(
    cfg: &ModelConfig,
    trainable: &ModelLayout,
    b: usize,
    s: usize,
    e: u64,
    path: LayerPath,
) -> u64 {
    let t = (b * s) as u64;
    let rows = if path.mlp_rows == 0 { t } else { t.min(path.mlp_rows as u64) };
    let h = cfg.hidden_size as u64;
    let (f, router) = match &cfg.moe {
        None => (cfg.intermediate_size as u64, 0),
        Some(m) => {
            ((m.num_experts_per_tok * m.moe_intermediate_size) as u64, rows * m.num_experts as u64 * 4)
        }
    };
    let qkv = (cfg.q_dim() + 2 * cfg.kv_dim()) as u64;
    // The MLP tile's own tensors.
    let mlp = if path.fused && path.moe_kernels && cfg.moe.is_some() {
        mt_layers::moe_device_workspace_bytes(cfg, rows as usize, e)
    } else {
        e * rows * FFN_TENSORS * f + router
    };
    let acts = e * t * (HIDDEN_TENSORS * h + QKV_TENSORS * qkv) + mlp;
    let heads = cfg.num_attention_heads as u64;
    let score_elems = b as u64 * heads * (s * s) as u64;
    if path.fused && path.flash {
        let dq = if path.hopper {
            mt_layers::hopper_dq_buffer_bytes(b, s, cfg.num_attention_heads, cfg.head_dim)
        } else {
            0
        };
        return flash_acts(cfg, t, e, dq) + mlp + FLASH_ROW_F32 * 4 * t * heads;
    }
    if path.fused {
        return acts + FUSED_SCORE_BYTES * score_elems;
    }
    let scores = SCORE_TENSORS * score_elems * 4;
    let experts = trainable.moe.as_ref().map_or(1, |m| m.n_experts);
    let matrix = |t: &mt_core::TensorSpec| match t.shape.len() {
        3 => t.numel() / experts,
        _ => t.numel(),
    };
    let dw = trainable.layer.tensors.iter().map(|t| matrix(t) as u64).max().unwrap_or(0) * (e + 8);
    acts + scores + dw
}

/// Flash attention's `[t, ·]` activations at the peak of a layer's backward (the backward drops
/// each tensor once nothing later needs it, `mt_layers::DecoderLayer`): in the MLP tiles, the
/// input norm's output `a`, `x1`, `dx1` in pieces and joined, one spare (`5 × hidden`) beside
/// the attention's `q`, `o` and `k`, `v` (`2 × q_dim + 2 × kv_dim`); in the attention's backward,
/// `a` and `dx1` (`2 × hidden`) beside the inputs, `dO` and the three gradients (`4 × q_dim +
/// 4 × kv_dim`): a little above the pool's measured high-water mark (docs/decisions/0041). The
/// Hopper kernels' backward adds its fp32 dQ buffer (`dq_buffer` bytes) to the attention's.
fn flash_acts(cfg: &ModelConfig, t: u64, e: u64, dq_buffer: u64) -> u64 {
    let h = cfg.hidden_size as u64;
    let (qd, kvd) = (cfg.q_dim() as u64, cfg.kv_dim() as u64);
    let mlp_peak = FLASH_MLP_PEAK_HIDDEN * h + 2 * qd + 2 * kvd;
    let attn_peak = FLASH_ATTN_PEAK_HIDDEN * h + 4 * qd + 4 * kvd;
    (e * t * mlp_peak).max(e * t * attn_peak + dq_buffer)
}

/// Peak transient bytes of the loss over a chunk of `t` tokens: one block of logits
/// (`rows = min(rows_per_block, t)`), and the normed input and its gradient
/// (`2 × t × hidden × e`). Candle's ops: `5 × rows × vocab × 4` for the block plus the LM-head
/// gradient before accumulation (`vocab × hidden × (e + 8)`; none in a LoRA run, whose head is
/// frozen); the fused kernels: `rows × vocab × 4` ([`FUSED_LOGIT_BYTES`]) and none.
pub fn loss_workspace(cfg: &ModelConfig, t: usize, rows_per_block: usize, e: u64, fused: bool) -> u64 {
    let (v, h) = (cfg.vocab_size as u64, cfg.hidden_size as u64);
    let rows = rows_per_block.min(t) as u64;
    let io = 2 * t as u64 * h * e;
    if fused {
        return FUSED_LOGIT_BYTES * rows * v + io;
    }
    let head_grad = if cfg.lora.is_some() { 0 } else { v * h * (e + 8) };
    LOGIT_TENSORS * rows * v * 4 + head_grad + io
}
