//! RoPE frequency scaling in `config.json` (`rope_scaling`, transformers 5's `rope_parameters`):
//! its kinds, their parsing and validation, and the object written back on export.

use serde_json::{json, Map, Value};

use super::{get, opt_bool, opt_f64};
use crate::{Error, Result};

/// RoPE frequency scaling, as `rope_scaling` / `rope_parameters` in config.json.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor` (`rope_type: "linear"`).
    Linear {
        /// Scaling factor.
        factor: f64,
    },
    /// Llama 3.x frequency-dependent scaling (`rope_type: "llama3"`).
    Llama3 {
        /// Overall scaling factor for low frequencies.
        factor: f64,
        /// Wavelength threshold (in units of the original context) below which no scaling applies.
        low_freq_factor: f64,
        /// Wavelength threshold above which full scaling applies.
        high_freq_factor: f64,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: f64,
    },
    /// YaRN (`rope_type: "yarn"`, transformers' `_compute_yarn_parameters`): each inverse
    /// frequency blends the interpolated `inv / factor` and the original `inv` by a linear ramp
    /// over the dimensions between the correction range's bounds, and cos and sin are multiplied
    /// by the attention factor.
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// Rotations that bound the extrapolated (unscaled) dimensions.
        beta_fast: f64,
        /// Rotations that bound the interpolated dimensions.
        beta_slow: f64,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: f64,
        /// Whether the correction range is rounded outwards to whole dimensions.
        truncate: bool,
        /// The factor on cos and sin; `None`: `0.1 ln(factor) + 1` (1 for `factor <= 1`).
        attention_factor: Option<f64>,
    },
}

impl RopeScaling {
    /// The factor that multiplies cos and sin (YaRN's attention factor; 1 otherwise).
    pub fn attention_factor(&self) -> f64 {
        match self {
            RopeScaling::Yarn { attention_factor: Some(a), .. } => *a,
            RopeScaling::Yarn { factor, .. } if *factor > 1.0 => 0.1 * factor.ln() + 1.0,
            _ => 1.0,
        }
    }
}

pub(super) fn parse_rope(
    obj: &Map<String, Value>,
    field: &str,
) -> Result<(Option<f64>, Option<RopeScaling>)> {
    let Some(v) = get(obj, field) else { return Ok((None, None)) };
    let r = v.as_object().ok_or_else(|| Error::config(field, format!("expected an object, found {v}")))?;
    let theta = opt_f64(r, "rope_theta")?;
    let kind = get(r, "rope_type")
        .or_else(|| get(r, "type"))
        .map(|t| t.as_str().ok_or_else(|| Error::config(field, "rope_type must be a string")))
        .transpose()?
        .unwrap_or("default");
    let need = |k: &str| -> Result<f64> {
        opt_f64(r, k)?.ok_or_else(|| Error::config(format!("{field}.{k}"), "missing (required)"))
    };
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: need("factor")? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: {
                // An integer (a length), also written back as one: a fraction or a value past
                // 2^53 would export a config other than the one trained.
                let k = format!("{field}.original_max_position_embeddings");
                let x = need("original_max_position_embeddings")?;
                if x.fract() != 0.0 || x > 9_007_199_254_740_992.0 {
                    return Err(Error::config(k, format!("{x} is not an integer of at most 2^53")));
                }
                x
            },
        }),
        "yarn" => Some(parse_yarn(r, field, &need)?),
        other => {
            return Err(Error::Unsupported(format!(
                "{field}.rope_type = {other:?}; supported: default, linear, llama3, yarn"
            )))
        }
    };
    match &scaling {
        Some(RopeScaling::Linear { factor }) if *factor <= 0.0 => {
            return Err(Error::config(format!("{field}.factor"), "linear rope scaling needs factor > 0"));
        }
        Some(RopeScaling::Llama3 {
            low_freq_factor,
            high_freq_factor,
            factor,
            original_max_position_embeddings,
        }) if high_freq_factor <= low_freq_factor
            || *factor <= 0.0
            || *low_freq_factor <= 0.0
            || *original_max_position_embeddings <= 0.0 =>
        {
            return Err(Error::config(
                field,
                "llama3 rope scaling needs factor > 0, original_max_position_embeddings > 0 and high_freq_factor > low_freq_factor > 0",
            ));
        }
        _ => {}
    }
    Ok((theta, scaling))
}

/// The YaRN parameters of a `rope_scaling` / `rope_parameters` object. DeepSeek's `mscale` /
/// `mscale_all_dim` and a partial rotary dimension are refused.
fn parse_yarn(
    r: &Map<String, Value>,
    field: &str,
    need: &dyn Fn(&str) -> Result<f64>,
) -> Result<RopeScaling> {
    for key in ["mscale", "mscale_all_dim"] {
        if get(r, key).is_some() {
            return Err(Error::Unsupported(format!("{field}.{key} (YaRN's attention factor from mscale)")));
        }
    }
    if opt_f64(r, "partial_rotary_factor")?.is_some_and(|f| f != 1.0) {
        return Err(Error::Unsupported(format!(
            "{field}.partial_rotary_factor != 1 (RoPE on part of a head)"
        )));
    }
    let factor = need("factor")?;
    let original = need("original_max_position_embeddings")?;
    // transformers' `x or default`: a missing or zero beta takes the default.
    let beta = |k: &str, d: f64| -> Result<f64> { Ok(opt_f64(r, k)?.filter(|&b| b != 0.0).unwrap_or(d)) };
    let (beta_fast, beta_slow) = (beta("beta_fast", 32.0)?, beta("beta_slow", 1.0)?);
    if factor <= 0.0 || original.fract() != 0.0 || !(1.0..=9_007_199_254_740_992.0).contains(&original) {
        return Err(Error::config(
            field,
            "yarn rope scaling needs factor > 0 and an integer original_max_position_embeddings >= 1",
        ));
    }
    if beta_fast <= 0.0 || beta_slow <= 0.0 {
        return Err(Error::config(field, "yarn rope scaling needs beta_fast > 0 and beta_slow > 0"));
    }
    Ok(RopeScaling::Yarn {
        factor,
        beta_fast,
        beta_slow,
        original_max_position_embeddings: original,
        truncate: opt_bool(r, "truncate")?.unwrap_or(true),
        attention_factor: opt_f64(r, "attention_factor")?,
    })
}

/// The `rope_parameters` object of `theta` and `scaling` (also written as `rope_scaling` when
/// there is a scaling), as [`parse_rope`] reads it back.
pub(super) fn to_json(theta: f64, scaling: Option<&RopeScaling>) -> Value {
    let mut rope = json!({ "rope_type": "default", "rope_theta": theta });
    match scaling {
        None => {}
        Some(RopeScaling::Linear { factor }) => {
            rope["rope_type"] = "linear".into();
            rope["factor"] = (*factor).into();
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            rope["rope_type"] = "llama3".into();
            rope["factor"] = (*factor).into();
            rope["low_freq_factor"] = (*low_freq_factor).into();
            rope["high_freq_factor"] = (*high_freq_factor).into();
            rope["original_max_position_embeddings"] = (*original_max_position_embeddings as u64).into();
        }
        Some(RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position_embeddings,
            truncate,
            attention_factor,
        }) => {
            rope["rope_type"] = "yarn".into();
            rope["factor"] = (*factor).into();
            rope["beta_fast"] = (*beta_fast).into();
            rope["beta_slow"] = (*beta_slow).into();
            rope["original_max_position_embeddings"] = (*original_max_position_embeddings as u64).into();
            rope["truncate"] = (*truncate).into();
            if let Some(a) = attention_factor {
                rope["attention_factor"] = (*a).into();
            }
        }
    }
    rope
}
