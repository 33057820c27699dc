//! The parameter layout table: for each unit (the outer unit and one decoder layer), the names,
//! shapes and element offsets of its tensors inside one flat record. Host store records, device
//! slots and gradient buffers all share this layout, so binding is a matter of making views.

use crate::hf_names::MoeLayout;
use crate::names::*;
use crate::{Error, ExpertKind, ModelConfig, Result};

/// Every tensor in a flat record starts at a multiple of this many elements (256 bytes in f32),
/// so views handed to GEMM libraries are well aligned.
pub const TENSOR_ALIGN_ELEMS: usize = 64;

/// One tensor inside a unit's flat record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Name within the unit, e.g. `self_attn.q_proj.weight` or `model.embed_tokens.weight`.
    pub name: String,
    /// Shape (row-major, PyTorch convention: a Linear weight is `[out, in]`).
    pub shape: Vec<usize>,
    /// Offset of the first element in the record, in elements.
    pub offset: usize,
}

impl TensorSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The layout of one unit's flat record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitLayout {
    /// Tensors in record order.
    pub tensors: Vec<TensorSpec>,
    /// Record length in elements, including alignment padding.
    pub len: usize,
}

impl UnitLayout {
    fn build(specs: Vec<(String, Vec<usize>)>) -> Self {
        let mut off = 0;
        let tensors = specs
            .into_iter()
            .map(|(name, shape)| {
                let t = TensorSpec { name, shape, offset: off };
                off = (off + t.numel()).div_ceil(TENSOR_ALIGN_ELEMS) * TENSOR_ALIGN_ELEMS;
                t
            })
            .collect();
        UnitLayout { tensors, len: off }
    }

    /// Looks up a tensor by its name within the unit.
    pub fn get(&self, name: &str) -> Result<&TensorSpec> {
        self.tensors.iter().find(|t| t.name == name).ok_or_else(|| Error::UnknownParam(name.to_owned()))
    }

    /// Number of parameters (padding excluded).
    pub fn n_params(&self) -> usize {
        self.tensors.iter().map(TensorSpec::numel).sum()
    }
}

/// A unit of streaming: the outer unit (embedding, final norm, LM head) or one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unit {
    /// Embedding, final norm and (untied) LM head; resident on the device for a whole step.
    Outer,
    /// Decoder layer `i`, streamed through the weight ring.
    Layer(usize),
}

impl Unit {
    /// Index of the unit's record in the store: 0 for the outer unit, `i + 1` for layer `i`.
    pub fn index(self) -> usize {
        match self {
            Unit::Outer => 0,
            Unit::Layer(i) => i + 1,
        }
    }
}

/// The layouts of every unit of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelLayout {
    /// Layout of the outer unit.
    pub outer: UnitLayout,
    /// Layout shared by every decoder layer.
    pub layer: UnitLayout,
    /// Number of decoder layers.
    pub n_layers: usize,
    /// The experts of a mixture-of-experts layer (their packed tensors and how checkpoints name
    /// each expert); `None` for dense layers.
    pub moe: Option<MoeLayout>,
}

impl ModelLayout {
    /// Builds the layout table for a config.
    pub fn new(cfg: &ModelConfig) -> Self {
        let (h, v, f) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        let (q, kv, hd) = (cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let mut outer = vec![(EMBED.to_owned(), vec![v, h]), (FINAL_NORM.to_owned(), vec![h])];
        if !cfg.tie_word_embeddings {
            outer.push((LM_HEAD.to_owned(), vec![v, h]));
        }
        let mut layer: Vec<(String, Vec<usize>)> = Vec::new();
        let mut p = |n: &str, s: Vec<usize>| layer.push((n.to_owned(), s));
        p(INPUT_NORM, vec![h]);
        p(Q, vec![q, h]);
        if cfg.qkv_bias {
            p(Q_BIAS, vec![q]);
        }
        p(K, vec![kv, h]);
        if cfg.qkv_bias {
            p(K_BIAS, vec![kv]);
        }
        p(V, vec![kv, h]);
        if cfg.qkv_bias {
            p(V_BIAS, vec![kv]);
        }
        p(O, vec![h, q]);
        if cfg.o_bias {
            p(O_BIAS, vec![h]);
        }
        if cfg.qk_norm {
            // Per head (Qwen3) or over the whole projection (OLMoE).
            let (qn, kn) = if cfg.qk_norm_full { (q, kv) } else { (hd, hd) };
            p(Q_NORM, vec![qn]);
            p(K_NORM, vec![kn]);
        }
        if cfg.attention_sinks {
            p(SINKS, vec![cfg.num_attention_heads]);
        }
        p(POST_NORM, vec![h]);
        let moe = cfg.moe.as_ref().map(|m| MoeLayout::new(cfg.arch, m, h));
        match &moe {
            None => {
                p(GATE, vec![f, h]);
                p(UP, vec![f, h]);
                p(DOWN, vec![h, f]);
            }
            // One unit: the router and every expert, packed (all experts stream with the layer).
            Some(m) if !m.gpt_oss => {
                p(ROUTER, vec![m.n_experts, h]);
                p(EXPERTS_GATE_UP, vec![m.n_experts, 2 * m.inter, h]);
                p(EXPERTS_DOWN, vec![m.n_experts, h, m.inter]);
            }
            // transformers' own tensors: each expert's matrices `[in, out]`, with biases.
            Some(m) => {
                let (e, fe) = (m.n_experts, m.inter);
                p(GPT_OSS_ROUTER, vec![e, h]);
                p(ROUTER_BIAS, vec![e]);
                p(EXPERTS_GATE_UP, vec![e, h, 2 * fe]);
                p(EXPERTS_GATE_UP_BIAS, vec![e, 2 * fe]);
                p(EXPERTS_DOWN, vec![e, fe, h]);
                p(EXPERTS_DOWN_BIAS, vec![e, h]);
            }
        }
        // A LoRA layer's adapters follow its base tensors, as in [`ModelLayout::trainable`].
        layer.extend(adapter_specs(cfg));
        ModelLayout {
            outer: UnitLayout::build(outer),
            layer: UnitLayout::build(layer),
            n_layers: cfg.num_hidden_layers,
            moe,
        }
    }

    /// The layout of what trains: [`ModelLayout::new`]'s, but with LoRA adapters
    /// (`cfg.lora`) the adapters alone: an empty outer unit and, per layer, `A` and `B` of each
    /// target. The base's tensors come first in a device slot ([`ModelLayout::new`]) and each
    /// tensor starts on an aligned offset, so an adapter sits at
    /// [`ModelLayout::frozen_len`] plus its offset here.
    pub fn trainable(cfg: &ModelConfig) -> Self {
        let full = Self::new(cfg);
        if cfg.lora.is_none() {
            return full;
        }
        ModelLayout {
            outer: UnitLayout::build(Vec::new()),
            layer: UnitLayout::build(adapter_specs(cfg)),
            n_layers: full.n_layers,
            moe: full.moe,
        }
    }

    /// Elements of `u`'s frozen base at the start of its slot (`slot` a [`ModelLayout::new`]
    /// layout, `self` the [`ModelLayout::trainable`] one of the same config): 0 without LoRA.
    pub fn frozen_len(&self, slot: &ModelLayout, u: Unit) -> usize {
        slot.unit(u).len - self.unit(u).len
    }

    /// Number of units (outer + layers).
    pub fn n_units(&self) -> usize {
        self.n_layers + 1
    }

    /// All units in forward (= optimizer update) order: outer first, then layers 0..L-1.
    pub fn units(&self) -> impl Iterator<Item = Unit> {
        std::iter::once(Unit::Outer).chain((0..self.n_layers).map(Unit::Layer))
    }

    /// Layout of a unit.
    pub fn unit(&self, u: Unit) -> &UnitLayout {
        match u {
            Unit::Outer => &self.outer,
            Unit::Layer(_) => &self.layer,
        }
    }

    /// Total number of parameters.
    pub fn n_params(&self) -> usize {
        self.outer.n_params() + self.n_layers * self.layer.n_params()
    }

    /// HF name of a tensor of a unit (`model.layers.{i}.` prefix for layers).
    pub fn hf_name(&self, u: Unit, local: &str) -> String {
        match u {
            Unit::Outer => local.to_owned(),
            Unit::Layer(i) => format!("model.layers.{i}.{local}"),
        }
    }

    /// Resolves an HF parameter name to its unit and tensor spec.
    pub fn resolve(&self, hf_name: &str) -> Result<(Unit, &TensorSpec)> {
        if let Some(rest) = hf_name.strip_prefix("model.layers.") {
            let (idx, local) = rest.split_once('.').ok_or_else(|| Error::UnknownParam(hf_name.to_owned()))?;
            let i: usize = idx.parse().map_err(|_| Error::UnknownParam(hf_name.to_owned()))?;
            // Canonical spelling only: "01" or "+1" would silently alias layer 1.
            if i >= self.n_layers || idx != i.to_string() {
                return Err(Error::UnknownParam(hf_name.to_owned()));
            }
            let spec = self.layer.get(local).map_err(|_| Error::UnknownParam(hf_name.to_owned()))?;
            Ok((Unit::Layer(i), spec))
        } else {
            Ok((Unit::Outer, self.outer.get(hf_name)?))
        }
    }

    /// Every HF parameter name with its unit and spec, in store order.
    pub fn all_params(&self) -> Vec<(String, Unit, &TensorSpec)> {
        self.units()
            .flat_map(|u| self.unit(u).tensors.iter().map(move |t| (self.hf_name(u, &t.name), u, t)))
            .collect()
    }
}

/// Every LoRA adapter tensor of a layer (`cfg.lora`), in layout order: per target `A [r, in]`,
/// then `B [out, r]`.
fn adapter_specs(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let Some(l) = &cfg.lora else { return Vec::new() };
    l.targets
        .iter()
        .flat_map(|t| {
            let (out, inp) = t.dims(cfg);
            [(t.a_name().to_owned(), vec![l.rank, inp]), (t.b_name().to_owned(), vec![out, l.rank])]
        })
        .collect()
}

/// Most parameters a config may describe: 2^48 (281 T). Every size derived from it (a unit's
/// elements, a store's bytes at 16 B/param, offsets) then fits in 64 bits.
const MAX_PARAMS: u128 = 1 << 48;

/// Refuses sizes whose parameter counts would overflow the layout's arithmetic (found by the
/// `config_json` fuzz target: a `hidden_size` of 6.4e17 wrapped around). An upper bound, in
/// saturating 128-bit arithmetic: every tensor a layer may have, biases, norms and experts
/// included.
pub(crate) fn check_magnitudes(c: &ModelConfig) -> Result<()> {
    let [v, h, f, l, heads, kvh, hd] = [
        c.vocab_size,
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
    ]
    .map(|x| x as u128);
    let (q, kv) = (heads.saturating_mul(hd), kvh.saturating_mul(hd));
    let sum = |xs: &[u128]| xs.iter().fold(0u128, |a, &x| a.saturating_add(x));
    let mlp = match &c.moe {
        None => f.saturating_mul(h).saturating_mul(3),
        Some(m) => {
            let (e, fe) = (m.num_experts as u128, m.moe_intermediate_size as u128);
            // The router and every expert's gate, up and down projections, and their biases.
            let biases = e.saturating_mul(fe.saturating_mul(2).saturating_add(h).saturating_add(1));
            e.saturating_mul(h)
                .saturating_add(e.saturating_mul(fe).saturating_mul(h).saturating_mul(3))
                .saturating_add(biases)
        }
    };
    let layer = sum(&[
        2 * h,
        q.saturating_mul(h).saturating_mul(2),
        kv.saturating_mul(h).saturating_mul(2),
        mlp,
        q,
        2 * kv,
        h,
        2 * hd,
        q.saturating_add(kv),
        heads,
    ]);
    let total = sum(&[v.saturating_mul(h).saturating_mul(2), h, l.saturating_mul(layer)]);
    if total > MAX_PARAMS {
        return Err(Error::config(
            "<sizes>",
            format!(
                "vocab_size {v}, hidden_size {h}, intermediate_size {f}, num_hidden_layers {l}, {heads} x {hd} \
                 attention heads{} make more than 2^48 parameters",
                c.moe.as_ref().map_or(String::new(), |m| format!(
                    ", {} experts of width {}",
                    m.num_experts, m.moe_intermediate_size
                ))
            ),
        ));
    }
    Ok(())
}

/// Parameters one token's forward uses: every parameter of a dense model; for a mixture of
/// experts, all but the experts it is not routed to (`(E - k)` experts' `3·h·f_e` per layer
/// excluded, and GPT-OSS's `2·f_e + h` biases of each; the router counts in full).
pub fn active_params(cfg: &ModelConfig) -> usize {
    let n = ModelLayout::new(cfg).n_params();
    match &cfg.moe {
        None => n,
        Some(m) => {
            let (h, fe) = (cfg.hidden_size, m.moe_intermediate_size);
            let per_expert = match m.experts {
                ExpertKind::SwiGlu => 3 * h * fe,
                ExpertKind::GptOss(_) => 3 * h * fe + 2 * fe + h,
            };
            n - cfg.num_hidden_layers * (m.num_experts - m.num_experts_per_tok) * per_expert
        }
    }
}

/// Model FLOPs of one training step of `batch` sequences of `seq` tokens — the one convention
/// every figure in this project uses (the peers' in `docs/peers.md`):
/// `6·N·T + 6·L·seq·hidden·T`, `N` the active parameters ([`active_params`]: all parameters of a
/// dense model, the input embedding, a lookup, included: +11% on the `6·N·T` term at the 3.6B
/// Llama-3 shape; a mixture of experts counts the router and the `k` experts a token is routed
/// to, not the other `E - k`), `T = batch·seq`, `L` decoder layers. The attention term is the
/// causal half of the full `12·L·seq·hidden·T`; recompute is not counted.
pub fn model_flops_per_step(cfg: &ModelConfig, batch: usize, seq: usize) -> f64 {
    let n = active_params(cfg) as f64;
    let t = (batch * seq) as f64;
    6.0 * n * t + 6.0 * cfg.num_hidden_layers as f64 * seq as f64 * cfg.hidden_size as f64 * t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_aligned_and_disjoint() {
        let cfg = ModelConfig::tiny_llama();
        let l = ModelLayout::new(&cfg);
        for unit in [&l.outer, &l.layer] {
            let mut end = 0;
            for t in &unit.tensors {
                assert_eq!(t.offset % TENSOR_ALIGN_ELEMS, 0, "{}", t.name);
                assert!(t.offset >= end, "{} overlaps its predecessor", t.name);
                end = t.offset + t.numel();
            }
            assert!(unit.len >= end && unit.len % TENSOR_ALIGN_ELEMS == 0);
        }
    }

    #[test]
    fn parameter_count_matches_closed_form() {
        let c = ModelConfig::tiny_llama();
        let (h, v, f) = (c.hidden_size, c.vocab_size, c.intermediate_size);
        let per_layer = 2 * h + h * c.q_dim() * 2 + 2 * h * c.kv_dim() + 3 * h * f;
        let l = ModelLayout::new(&c);
        assert_eq!(l.n_params(), 2 * v * h + h + c.num_hidden_layers * per_layer);
    }

    #[test]
    fn resolves_hf_names() {
        let l = ModelLayout::new(&ModelConfig::tiny_llama());
        let (u, t) = l.resolve("model.layers.3.mlp.down_proj.weight").unwrap();
        assert_eq!(u, Unit::Layer(3));
        assert_eq!(t.shape, vec![128, 344]);
        assert!(l.resolve("model.layers.4.mlp.down_proj.weight").is_err());
        assert!(l.resolve("model.layers.0.mlp.nonsense").is_err());
        assert!(l.resolve("model.layers.01.mlp.down_proj.weight").is_err());
        assert_eq!(l.resolve("lm_head.weight").unwrap().0, Unit::Outer);
        assert_eq!(l.all_params().len(), 3 + 4 * 9);
    }

    #[test]
    fn lora_adapters_follow_the_base_at_their_trainable_offsets() {
        let mut cfg = ModelConfig::tiny_llama();
        let base = ModelLayout::new(&cfg);
        cfg.lora = Some(crate::LoraConfig::new(4, 8.0, &crate::LoraTarget::ALL, 0.0, false).unwrap());
        let (slot, train) = (ModelLayout::new(&cfg), ModelLayout::trainable(&cfg));
        assert_eq!(train.outer.len, 0);
        assert_eq!(train.frozen_len(&slot, Unit::Outer), base.outer.len);
        let frozen = train.frozen_len(&slot, Unit::Layer(0));
        assert_eq!(frozen, base.layer.len);
        assert_eq!(train.layer.tensors.len(), 14);
        for t in &train.layer.tensors {
            assert_eq!(slot.layer.get(&t.name).unwrap().offset, frozen + t.offset, "{}", t.name);
        }
        let q_a = train.resolve("model.layers.1.self_attn.q_proj.lora_A.weight").unwrap().1;
        assert_eq!(q_a.shape, vec![4, 128]);
        let n = cfg.lora.as_ref().unwrap().params_per_layer(&cfg);
        assert_eq!(train.n_params(), 4 * n);
        assert_eq!(ModelLayout::trainable(&ModelConfig::tiny_llama()), base);
    }

    #[test]
    fn model_flops_follow_the_measured_notes_convention() {
        // 3.6B Llama-3 shape at 4 x 2048: 14_505 tok/s is 329 TFLOP/s in docs/peers.md.
        let cfg = crate::ModelConfig::from_json(
            &serde_json::from_str(
                r#"{"model_type":"llama","hidden_size":3072,"intermediate_size":8192,"num_attention_heads":24,
            "num_key_value_heads":8,"num_hidden_layers":28,"vocab_size":128256,"max_position_embeddings":8192,
            "rms_norm_eps":1e-5,"tie_word_embeddings":false}"#,
            )
            .unwrap(),
        )
        .unwrap();
        let f = model_flops_per_step(&cfg, 4, 2048);
        let tflops = f * 14_505.0 / 8192.0 / 1e12;
        assert!((tflops - 329.0).abs() < 0.5, "{tflops}");
    }
}
