//! LoRA adapters: which linear layers of a decoder layer carry one, their rank and scale, and
//! the names peft gives their tensors. A LoRA model is its base plus, per targeted projection
//! `W [out, in]`, `A [r, in]` and `B [out, r]`: `y = x Wᵀ + s · (x Aᵀ) Bᵀ` with `s = alpha / r`
//! (rsLoRA: `alpha / √r`). Only `A` and `B` train.

use crate::{BaseDtype, Error, ModelConfig, Result};

/// A linear layer of a decoder layer that an adapter may target (peft's `target_modules` names
/// them by their module's last component: `q_proj`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LoraTarget {
    /// `self_attn.q_proj`.
    Q,
    /// `self_attn.k_proj`.
    K,
    /// `self_attn.v_proj`.
    V,
    /// `self_attn.o_proj`.
    O,
    /// `mlp.gate_proj` (dense MLPs).
    Gate,
    /// `mlp.up_proj` (dense MLPs).
    Up,
    /// `mlp.down_proj` (dense MLPs).
    Down,
}

impl LoraTarget {
    /// Every target, in layout order.
    pub const ALL: [LoraTarget; 7] = [Self::Q, Self::K, Self::V, Self::O, Self::Gate, Self::Up, Self::Down];

    /// peft's module name (`target_modules`).
    pub fn module(self) -> &'static str {
        match self {
            Self::Q => "q_proj",
            Self::K => "k_proj",
            Self::V => "v_proj",
            Self::O => "o_proj",
            Self::Gate => "gate_proj",
            Self::Up => "up_proj",
            Self::Down => "down_proj",
        }
    }

    /// The base weight it adapts (a name of the layer layout).
    pub fn weight(self) -> &'static str {
        use crate::names::*;
        match self {
            Self::Q => Q,
            Self::K => K,
            Self::V => V,
            Self::O => O,
            Self::Gate => GATE,
            Self::Up => UP,
            Self::Down => DOWN,
        }
    }

    /// `A`'s name within the layer (`self_attn.q_proj.lora_A.weight`): transformers' module path,
    /// then peft's.
    pub fn a_name(self) -> &'static str {
        match self {
            Self::Q => "self_attn.q_proj.lora_A.weight",
            Self::K => "self_attn.k_proj.lora_A.weight",
            Self::V => "self_attn.v_proj.lora_A.weight",
            Self::O => "self_attn.o_proj.lora_A.weight",
            Self::Gate => "mlp.gate_proj.lora_A.weight",
            Self::Up => "mlp.up_proj.lora_A.weight",
            Self::Down => "mlp.down_proj.lora_A.weight",
        }
    }

    /// `B`'s name within the layer (`self_attn.q_proj.lora_B.weight`).
    pub fn b_name(self) -> &'static str {
        match self {
            Self::Q => "self_attn.q_proj.lora_B.weight",
            Self::K => "self_attn.k_proj.lora_B.weight",
            Self::V => "self_attn.v_proj.lora_B.weight",
            Self::O => "self_attn.o_proj.lora_B.weight",
            Self::Gate => "mlp.gate_proj.lora_B.weight",
            Self::Up => "mlp.up_proj.lora_B.weight",
            Self::Down => "mlp.down_proj.lora_B.weight",
        }
    }

    /// `(out, in)` of the adapted projection.
    pub fn dims(self, cfg: &ModelConfig) -> (usize, usize) {
        let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
        match self {
            Self::Q => (cfg.q_dim(), h),
            Self::K | Self::V => (cfg.kv_dim(), h),
            Self::O => (h, cfg.q_dim()),
            Self::Gate | Self::Up => (f, h),
            Self::Down => (h, f),
        }
    }

    /// The target peft calls `module` (`q_proj`, ...).
    pub fn parse(module: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.module() == module)
    }

    fn is_mlp(self) -> bool {
        matches!(self, Self::Gate | Self::Up | Self::Down)
    }
}

/// The adapters of a LoRA run: the same on every decoder layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Rank `r`.
    pub rank: usize,
    /// `lora_alpha`.
    pub alpha: f64,
    /// The adapted projections, in [`LoraTarget::ALL`] order, each once. Empty: not chosen
    /// (`--lora-targets` not given), the model's default ([`LoraConfig::for_model`]).
    pub targets: Vec<LoraTarget>,
    /// Dropout probability on the adapter's input (peft's `lora_dropout`).
    pub dropout: f64,
    /// rsLoRA scaling: `alpha / √r` instead of `alpha / r`.
    pub rslora: bool,
    /// How the frozen base is held in host memory (`--base-dtype`; [`LoraConfig::new`]: fp32,
    /// the weights as imported).
    pub base: BaseDtype,
}

impl LoraConfig {
    /// Checks the values and puts `targets` in layout order (duplicates dropped).
    pub fn new(rank: usize, alpha: f64, targets: &[LoraTarget], dropout: f64, rslora: bool) -> Result<Self> {
        if rank == 0 {
            return Err(Error::Unsupported("a LoRA rank of 0; give --lora-rank at least 1".into()));
        }
        if !alpha.is_finite() || alpha <= 0.0 {
            return Err(Error::Unsupported(format!("lora_alpha {alpha}; it must be a positive number")));
        }
        if !(0.0..1.0).contains(&dropout) {
            return Err(Error::Unsupported(format!("lora_dropout {dropout}; it must be in [0, 1)")));
        }
        if targets.is_empty() {
            return Err(Error::Unsupported("LoRA with no target module".into()));
        }
        let targets = LoraTarget::ALL.into_iter().filter(|t| targets.contains(t)).collect();
        Ok(LoraConfig { rank, alpha, targets, dropout, rslora, base: BaseDtype::F32 })
    }

    /// The scale `s` of the adapter's output: `alpha / r`, or `alpha / √r` with rsLoRA.
    pub fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    /// Whether `t` carries an adapter.
    pub fn targets(&self, t: LoraTarget) -> bool {
        self.targets.contains(&t)
    }

    /// These adapters on `cfg`: targets not chosen become every linear layer of its decoder that
    /// an adapter can go on, all seven, or the attention's four on a mixture of experts (whose
    /// experts are packed tensors, [`LoraConfig::check`]).
    pub fn for_model(self, cfg: &ModelConfig) -> Self {
        if !self.targets.is_empty() {
            return self;
        }
        let targets = LoraTarget::ALL.into_iter().filter(|t| cfg.moe.is_none() || !t.is_mlp()).collect();
        LoraConfig { targets, ..self }
    }

    /// Refuses what the model cannot carry: MLP targets on a mixture of experts (its experts
    /// are packed tensors that peft's LoRA does not wrap; attention is adapted).
    pub fn check(&self, cfg: &ModelConfig) -> Result<()> {
        if cfg.moe.is_some() {
            if let Some(t) = self.targets.iter().find(|t| t.is_mlp()) {
                return Err(Error::Unsupported(format!(
                    "a LoRA adapter on {} of a mixture-of-experts model: its experts are packed tensors; \
                     target the attention (q_proj,k_proj,v_proj,o_proj)",
                    t.module()
                )));
            }
        }
        Ok(())
    }

    /// Adapter parameters per decoder layer.
    pub fn params_per_layer(&self, cfg: &ModelConfig) -> usize {
        self.targets.iter().map(|t| t.dims(cfg)).map(|(o, i)| self.rank * (o + i)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Targets not chosen are every linear layer of a dense decoder, the attention of a mixture
    /// of experts (which `check` then accepts); chosen ones stay as they are.
    #[test]
    fn default_targets_follow_the_model() {
        let l = LoraConfig {
            targets: Vec::new(),
            ..LoraConfig::new(4, 8.0, &[LoraTarget::Q], 0.0, false).unwrap()
        };
        let dense = ModelConfig::tiny_llama();
        assert_eq!(l.clone().for_model(&dense).targets, LoraTarget::ALL.to_vec());
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../testkit/fixtures/golden/qwen3_moe.config.json");
        let moe = ModelConfig::from_file(std::path::Path::new(path)).unwrap();
        let m = l.clone().for_model(&moe);
        assert_eq!(m.targets, vec![LoraTarget::Q, LoraTarget::K, LoraTarget::V, LoraTarget::O]);
        m.check(&moe).unwrap();
        let down = LoraConfig::new(4, 8.0, &[LoraTarget::Down], 0.0, false).unwrap();
        assert_eq!(down.clone().for_model(&moe).targets, vec![LoraTarget::Down]);
        assert!(down.for_model(&moe).check(&moe).is_err());
    }

    #[test]
    fn scale_and_target_order() {
        let l =
            LoraConfig::new(16, 32.0, &[LoraTarget::Down, LoraTarget::Q, LoraTarget::Q], 0.0, false).unwrap();
        assert_eq!(l.targets, vec![LoraTarget::Q, LoraTarget::Down]);
        assert_eq!(l.scale(), 2.0);
        let rs = LoraConfig { rslora: true, ..l };
        assert_eq!(rs.scale(), 8.0);
        assert_eq!(LoraTarget::parse("up_proj"), Some(LoraTarget::Up));
        assert_eq!(LoraTarget::parse("lm_head"), None);
    }

    #[test]
    fn bad_values_are_refused_by_a_sentence() {
        assert!(LoraConfig::new(0, 8.0, &LoraTarget::ALL, 0.0, false)
            .unwrap_err()
            .to_string()
            .contains("rank"));
        assert!(LoraConfig::new(4, -1.0, &LoraTarget::ALL, 0.0, false).is_err());
        assert!(LoraConfig::new(4, 8.0, &LoraTarget::ALL, 1.0, false).is_err());
        assert!(LoraConfig::new(4, 8.0, &[], 0.0, false).is_err());
    }
}
