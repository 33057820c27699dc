//! The LoRA options of `megatrain train` and `megatrain estimate`: the adapters `--lora-rank`
//! asks for, and the refusal of an option that shapes adapters when no LoRA run is asked for
//! (it would otherwise be silently ignored).

use clap::Args;

use super::values::{at_least_one, fraction, lora_target, positive_f64, BaseDtypeArg};

/// The `--help` heading of the LoRA options.
pub(super) const LORA: &str = "LoRA";

/// The adapters' options (`--lora-from` and `--merge` are `train`'s own).
#[derive(Debug, Clone, Args)]
pub struct LoraArgs {
    /// Train LoRA adapters of rank R on a frozen base (--model DIR): the base gets no gradient,
    /// no optimizer state and no update; checkpoints hold the adapters; --out gets peft's format.
    #[arg(long, value_name = "R", value_parser = at_least_one, help_heading = LORA)]
    pub lora_rank: Option<usize>,

    /// lora_alpha: the adapters' output is scaled by alpha / R [default: R].
    #[arg(long, value_name = "A", value_parser = positive_f64, help_heading = LORA)]
    pub lora_alpha: Option<f64>,

    /// The adapted linear layers, comma-separated [default: every one of the decoder; the
    /// attention's on a mixture of experts].
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = lora_target, help_heading = LORA)]
    pub lora_targets: Vec<mt_core::LoraTarget>,

    /// Dropout probability on the adapters' input (only 0 is implemented yet) [default: 0].
    #[arg(long, value_name = "P", value_parser = fraction, help_heading = LORA)]
    pub lora_dropout: Option<f64>,

    /// rsLoRA: scale by alpha / sqrt(R) instead of alpha / R.
    #[arg(long, help_heading = LORA)]
    pub rslora: bool,

    /// The frozen base in host RAM: bf16 (2 B/param), int8 or nf4 (blockwise, 1.06 or 0.56
    /// B/param, dequantised on the GPU; norms, embedding and LM head stay bf16), or fp32
    /// [default: as --precision].
    #[arg(long, value_enum, value_name = "bf16|int8|nf4|fp32", hide_possible_values = true, help_heading = LORA)]
    pub base_dtype: Option<BaseDtypeArg>,
}

impl LoraArgs {
    /// The adapters `--lora-rank` and its options describe (each value checked by its parser).
    pub fn config(&self) -> Option<mt_core::LoraConfig> {
        let rank = self.lora_rank?;
        let given = &self.lora_targets;
        Some(mt_core::LoraConfig {
            rank,
            alpha: self.lora_alpha.unwrap_or(rank as f64),
            // None given: the model's default (`LoraConfig::for_model`).
            targets: mt_core::LoraTarget::ALL.into_iter().filter(|t| given.contains(t)).collect(),
            dropout: self.lora_dropout.unwrap_or(0.0),
            rslora: self.rslora,
            // The run's (`--base-dtype`, else as `--precision`): `TrainConfig::base_dtype`.
            base: mt_core::BaseDtype::default(),
        })
    }

    /// The first option given that shapes adapters (`--lora-alpha`, `--lora-targets`,
    /// `--lora-dropout`, `--rslora`) or holds their base (`--base-dtype`), and `others` given (`train`'s `--merge`), when no adapters
    /// are asked for: neither `--lora-rank` nor a `source` of them (`train`'s `--lora-from`,
    /// named in the refusal as `source.0`). The refusal, a sentence naming the option.
    pub fn refuse_without_adapters(
        &self,
        source: Option<(&str, bool)>,
        others: &[(&str, bool)],
    ) -> Result<(), String> {
        if self.lora_rank.is_some() || source.is_some_and(|(_, given)| given) {
            return Ok(());
        }
        let given = [
            ("--lora-alpha", self.lora_alpha.is_some()),
            ("--lora-targets", !self.lora_targets.is_empty()),
            ("--lora-dropout", self.lora_dropout.is_some()),
            ("--rslora", self.rslora),
            ("--base-dtype", self.base_dtype.is_some()),
        ];
        let Some((flag, _)) = given.iter().chain(others).find(|(_, on)| *on) else { return Ok(()) };
        let ask = match source {
            Some((from, _)) => format!("--lora-rank R (or {from} DIR)"),
            None => "--lora-rank R".to_owned(),
        };
        Err(format!("{flag} applies to LoRA adapters, but this is not a LoRA run: give {ask} with it, or leave {flag} out"))
    }
}
