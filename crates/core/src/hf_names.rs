//! Checkpoint names of a mixture-of-experts layer's tensors. The layout keeps each layer's
//! experts packed (`mlp.experts.gate_up_proj` `[E, 2·f_e, h]`, `mlp.experts.down_proj`
//! `[E, h, f_e]`, transformers 5's own parameters); checkpoints name each expert's matrices
//! apart, and every one of them is a contiguous piece of a packed tensor. transformers 5.23's
//! `save_pretrained` writes the per-expert names below (it converts back to the transformers 4
//! format), and loads both. GPT-OSS's checkpoints hold the packed tensors themselves.

use crate::names::{EXPERTS_DOWN, EXPERTS_GATE_UP, GPT_OSS_ROUTER, ROUTER};
use crate::{Arch, Error, ExpertKind, ModelLayout, MoeConfig, Result, TensorSpec, Unit};

/// How a checkpoint names the router and each expert's matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertNames {
    /// Qwen3-MoE, OLMoE: `mlp.gate.weight`, `mlp.experts.{e}.gate_proj.weight` `[f_e, h]`,
    /// `mlp.experts.{e}.up_proj.weight` `[f_e, h]`, `mlp.experts.{e}.down_proj.weight` `[h, f_e]`.
    Proj,
    /// Mixtral: `block_sparse_moe.gate.weight`, `block_sparse_moe.experts.{e}.w1.weight` (gate),
    /// `.w3.weight` (up), `.w2.weight` (down).
    Mixtral,
    /// GPT-OSS: the layout's own packed tensors (`mlp.router.*`, `mlp.experts.*`), in bf16 or,
    /// in the released checkpoints, the experts' matrices as MXFP4 `*_blocks` and `*_scales`.
    Packed,
}

/// The experts of a mixture-of-experts layer in the layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeLayout {
    /// Experts per layer.
    pub n_experts: usize,
    /// Width of one expert's SwiGLU.
    pub inter: usize,
    /// Model width.
    pub hidden: usize,
    /// How checkpoints name them.
    pub names: ExpertNames,
    /// GPT-OSS's experts (`ExpertKind::GptOss`): `[in, out]` matrices with biases, a biased
    /// router `mlp.router`.
    pub gpt_oss: bool,
}

impl MoeLayout {
    pub(crate) fn new(arch: Arch, m: &MoeConfig, hidden: usize) -> Self {
        let names = match arch {
            Arch::Mixtral => ExpertNames::Mixtral,
            Arch::GptOss => ExpertNames::Packed,
            _ => ExpertNames::Proj,
        };
        let gpt_oss = matches!(m.experts, ExpertKind::GptOss(_));
        MoeLayout { n_experts: m.num_experts, inter: m.moe_intermediate_size, hidden, names, gpt_oss }
    }

    /// The router's checkpoint name within a layer.
    fn router_name(&self) -> &'static str {
        match self.names {
            ExpertNames::Proj => ROUTER,
            ExpertNames::Mixtral => "block_sparse_moe.gate.weight",
            ExpertNames::Packed => GPT_OSS_ROUTER,
        }
    }

    /// Checkpoint name of expert `e`'s `which` matrix (0 gate, 1 up, 2 down) within a layer.
    fn expert_name(&self, e: usize, which: usize) -> String {
        match self.names {
            ExpertNames::Proj => {
                format!("mlp.experts.{e}.{}.weight", ["gate_proj", "up_proj", "down_proj"][which])
            }
            ExpertNames::Mixtral => {
                format!("block_sparse_moe.experts.{e}.{}.weight", ["w1", "w3", "w2"][which])
            }
            ExpertNames::Packed => unreachable!("packed experts have no per-expert names"),
        }
    }

    /// Parses a per-expert name within a layer into `(expert, which)`.
    fn parse_expert(&self, local: &str) -> Option<(usize, usize)> {
        let (prefix, kinds): (&str, [&str; 3]) = match self.names {
            ExpertNames::Proj => ("mlp.experts.", ["gate_proj", "up_proj", "down_proj"]),
            ExpertNames::Mixtral => ("block_sparse_moe.experts.", ["w1", "w3", "w2"]),
            ExpertNames::Packed => return None,
        };
        let rest = local.strip_prefix(prefix)?.strip_suffix(".weight")?;
        let (e, kind) = rest.split_once('.')?;
        let expert: usize = e.parse().ok()?;
        (expert < self.n_experts && e == expert.to_string()).then_some(())?;
        Some((expert, kinds.iter().position(|k| *k == kind)?))
    }

    /// Element offset (within the packed tensor) and shape of expert `e`'s `which` matrix.
    fn piece(&self, e: usize, which: usize) -> (usize, Vec<usize>) {
        let (f, h) = (self.inter, self.hidden);
        match which {
            0 => (e * 2 * f * h, vec![f, h]),
            1 => (e * 2 * f * h + f * h, vec![f, h]),
            _ => (e * h * f, vec![h, f]),
        }
    }
}

/// One tensor as a checkpoint holds it: a whole tensor of the layout or a contiguous piece of
/// one (an expert's matrix inside a packed tensor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfPiece {
    /// Full checkpoint name (`model.layers.{i}.` prefix for layers).
    pub name: String,
    /// The unit whose record holds it.
    pub unit: Unit,
    /// Its shape in the checkpoint.
    pub shape: Vec<usize>,
    /// Offset of its first element in the unit's record.
    pub offset: usize,
}

impl HfPiece {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

impl ModelLayout {
    /// The checkpoint tensors that hold the layout tensor `spec` of unit `u`: the tensor itself,
    /// or, for a MoE layer's router and packed experts, their per-expert names (expert by
    /// expert, gate, up, then down), as transformers' `save_pretrained` writes them.
    pub fn hf_pieces(&self, u: Unit, spec: &TensorSpec) -> Vec<HfPiece> {
        let whole =
            |name: String| vec![HfPiece { name, unit: u, shape: spec.shape.clone(), offset: spec.offset }];
        let (Unit::Layer(_), Some(m)) = (u, &self.moe) else { return whole(self.hf_name(u, &spec.name)) };
        if m.names == ExpertNames::Packed {
            return whole(self.hf_name(u, &spec.name));
        }
        let which: &[usize] = match spec.name.as_str() {
            ROUTER => return whole(self.hf_name(u, m.router_name())),
            EXPERTS_GATE_UP => &[0, 1],
            EXPERTS_DOWN => &[2],
            _ => return whole(self.hf_name(u, &spec.name)),
        };
        (0..m.n_experts)
            .flat_map(|e| which.iter().map(move |&k| (e, k)))
            .map(|(e, k)| {
                let (off, shape) = m.piece(e, k);
                HfPiece {
                    name: self.hf_name(u, &m.expert_name(e, k)),
                    unit: u,
                    shape,
                    offset: spec.offset + off,
                }
            })
            .collect()
    }

    /// Every checkpoint tensor of the model in store order ([`ModelLayout::hf_pieces`] of each
    /// layout tensor): what an export writes.
    pub fn hf_tensors(&self) -> Vec<HfPiece> {
        self.units()
            .flat_map(|u| self.unit(u).tensors.iter().flat_map(move |t| self.hf_pieces(u, t)))
            .collect()
    }

    /// Resolves a checkpoint name: a tensor of the layout (for MoE layers the packed
    /// transformers 5 names) or one expert's matrix / the router under the family's per-expert
    /// names.
    pub fn resolve_piece(&self, hf_name: &str) -> Result<HfPiece> {
        if let Ok((unit, spec)) = self.resolve(hf_name) {
            return Ok(HfPiece {
                name: hf_name.to_owned(),
                unit,
                shape: spec.shape.clone(),
                offset: spec.offset,
            });
        }
        let unknown = || Error::UnknownParam(hf_name.to_owned());
        let m = self.moe.as_ref().ok_or_else(unknown)?;
        let rest = hf_name.strip_prefix("model.layers.").ok_or_else(unknown)?;
        let (idx, local) = rest.split_once('.').ok_or_else(unknown)?;
        let i: usize = idx.parse().map_err(|_| unknown())?;
        if i >= self.n_layers || idx != i.to_string() {
            return Err(unknown());
        }
        let unit = Unit::Layer(i);
        if local == m.router_name() {
            let spec = self.layer.get(ROUTER)?;
            return Ok(HfPiece {
                name: hf_name.to_owned(),
                unit,
                shape: spec.shape.clone(),
                offset: spec.offset,
            });
        }
        let (e, which) = m.parse_expert(local).ok_or_else(unknown)?;
        let spec = self.layer.get(if which == 2 { EXPERTS_DOWN } else { EXPERTS_GATE_UP })?;
        let (off, shape) = m.piece(e, which);
        Ok(HfPiece { name: hf_name.to_owned(), unit, shape, offset: spec.offset + off })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::{ModelConfig, ModelLayout, Unit};

    fn layout(model_type: &str) -> ModelLayout {
        let v = json!({
            "model_type": model_type, "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
            "moe_intermediate_size": 6, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_experts": 3, "num_experts_per_tok": 2
        });
        ModelLayout::new(&ModelConfig::from_json(&v).unwrap())
    }

    #[test]
    fn pieces_tile_the_packed_tensors_exactly() {
        for family in ["qwen3_moe", "mixtral", "olmoe"] {
            let l = layout(family);
            let pieces = l.hf_tensors();
            // Per layer: 3 experts x 3 matrices + router, beside the attention's tensors.
            let per_layer = l.layer.tensors.len() - 3 + 1 + 9;
            assert_eq!(pieces.len(), l.outer.tensors.len() + 2 * per_layer, "{family}");
            for u in l.units() {
                let mut covered: Vec<(usize, usize)> =
                    pieces.iter().filter(|p| p.unit == u).map(|p| (p.offset, p.offset + p.numel())).collect();
                covered.sort_unstable();
                let mut want: Vec<(usize, usize)> =
                    l.unit(u).tensors.iter().map(|t| (t.offset, t.offset + t.numel())).collect();
                want.sort_unstable();
                // Merge the pieces' adjacent ranges: they must give back the tensors, no gaps.
                let mut merged: Vec<(usize, usize)> = Vec::new();
                for (a, b) in covered {
                    match merged.last_mut() {
                        Some(last) if last.1 == a && !want.iter().any(|w| w.0 == a) => last.1 = b,
                        _ => merged.push((a, b)),
                    }
                }
                assert_eq!(merged, want, "{family} {u:?}");
            }
            for p in &pieces {
                assert_eq!(l.resolve_piece(&p.name).unwrap(), *p, "{family}");
            }
        }
    }

    #[test]
    fn names_follow_each_family() {
        let q = layout("qwen3_moe");
        let p = q.resolve_piece("model.layers.1.mlp.experts.2.up_proj.weight").unwrap();
        let gu = q.layer.get(crate::names::EXPERTS_GATE_UP).unwrap();
        assert_eq!(
            (p.unit, p.shape.clone(), p.offset),
            (Unit::Layer(1), vec![6, 16], gu.offset + (2 * 12 + 6) * 16)
        );
        assert!(q.resolve_piece("model.layers.1.mlp.experts.3.up_proj.weight").is_err());
        assert!(q.resolve_piece("model.layers.1.mlp.experts.02.up_proj.weight").is_err());
        assert!(q.resolve_piece("model.layers.1.mlp.experts.gate_up_proj").is_ok());
        let m = layout("mixtral");
        assert!(m.resolve_piece("model.layers.0.block_sparse_moe.experts.0.w2.weight").is_ok());
        assert!(m.resolve_piece("model.layers.0.block_sparse_moe.gate.weight").is_ok());
        assert!(m.resolve_piece("model.layers.0.mlp.gate.weight").is_ok());
        assert!(m.resolve_piece("model.layers.0.mlp.experts.0.down_proj.weight").is_err());
        assert!(l_dense().resolve_piece("model.layers.0.mlp.experts.0.down_proj.weight").is_err());
    }

    fn l_dense() -> ModelLayout {
        ModelLayout::new(&ModelConfig::tiny_llama())
    }
}
