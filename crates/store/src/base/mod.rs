//! The frozen base of a LoRA run: each unit's base weights, written once (the import) and then
//! only read (cast into a unit's upload copy, ahead of its adapters). Not training state: no
//! moments, no gradient, never in a checkpoint (those hold the adapters: the `HostStore`).
//!
//! fp32 for now (4 B/param); the base's own encodings (bf16, int8, NF4) are its to add: their
//! block codes and reference decoding are in `codec.rs`.

use std::sync::{Mutex, MutexGuard};

use mt_core::{Error, ModelLayout, Result, Unit};

pub mod codec;

/// Writing whole parameters by their Hugging Face name: what an import fills (the host store,
/// or a LoRA run's frozen base).
pub trait ParamSink: Sync {
    /// The layout the parameters are written into.
    fn layout(&self) -> &ModelLayout;
    /// Writes a parameter's whole value (by HF name: a layout tensor, or one expert's matrix
    /// under its checkpoint name, [`mt_core::ModelLayout::resolve_piece`]).
    fn write_param(&self, hf_name: &str, data: &[f32]) -> Result<()> {
        let spec = self.layout().resolve_piece(hf_name)?;
        if data.len() != spec.numel() {
            return Err(Error::Shape {
                what: hf_name.to_owned(),
                expected: spec.shape.clone(),
                found: vec![data.len()],
            });
        }
        self.write_param_part(hf_name, 0, data)
    }
    /// Writes `data` from element `start` of a parameter on ([`crate::HostStore::write_param_part`]).
    fn write_param_part(&self, hf_name: &str, start: usize, data: &[f32]) -> Result<()>;
}

impl ParamSink for crate::HostStore {
    fn layout(&self) -> &ModelLayout {
        crate::HostStore::layout(self)
    }
    fn write_param_part(&self, hf_name: &str, start: usize, data: &[f32]) -> Result<()> {
        crate::HostStore::write_param_part(self, hf_name, start, data)
    }
}

/// A LoRA run's frozen base weights, per unit, laid out as a device slot's base part.
#[derive(Debug)]
pub struct FrozenBase {
    layout: ModelLayout,
    units: Vec<Mutex<Vec<f32>>>,
}

impl FrozenBase {
    /// Zeroed weights for `layout` (the base model's, without adapters).
    pub fn zeroed(layout: &ModelLayout) -> Self {
        let units = layout.units().map(|u| Mutex::new(vec![0.0; layout.unit(u).len])).collect();
        FrozenBase { layout: layout.clone(), units }
    }

    /// The base model's layout.
    pub fn layout(&self) -> &ModelLayout {
        &self.layout
    }

    /// `u`'s weights (the unit's flat record, padding included), locked for reading.
    pub fn unit(&self, u: Unit) -> MutexGuard<'_, Vec<f32>> {
        self.units[u.index()].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads a parameter (by HF name).
    pub fn read_param(&self, hf_name: &str) -> Result<Vec<f32>> {
        let (u, spec) = self.layout.resolve(hf_name)?;
        Ok(self.unit(u)[spec.offset..spec.offset + spec.numel()].to_vec())
    }

    /// Bytes of RAM the weights take.
    pub fn bytes(&self) -> usize {
        self.layout.units().map(|u| self.layout.unit(u).len * 4).sum()
    }
}

impl ParamSink for FrozenBase {
    fn layout(&self) -> &ModelLayout {
        FrozenBase::layout(self)
    }

    fn write_param_part(&self, hf_name: &str, start: usize, data: &[f32]) -> Result<()> {
        let spec = self.layout.resolve_piece(hf_name)?;
        if start.checked_add(data.len()).is_none_or(|end| end > spec.numel()) {
            return Err(Error::Shape {
                what: format!("{hf_name}[{start}..{start} + {}]", data.len()),
                expected: spec.shape.clone(),
                found: vec![start.saturating_add(data.len())],
            });
        }
        let at = spec.offset + start;
        self.unit(spec.unit)[at..at + data.len()].copy_from_slice(data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_and_reads_by_name() {
        let layout = ModelLayout::new(&mt_core::ModelConfig::tiny_llama());
        let base = FrozenBase::zeroed(&layout);
        let n = layout.resolve("model.layers.2.mlp.up_proj.weight").unwrap().1.numel();
        let v: Vec<f32> = (0..n).map(|i| i as f32).collect();
        ParamSink::write_param(&base, "model.layers.2.mlp.up_proj.weight", &v).unwrap();
        assert_eq!(base.read_param("model.layers.2.mlp.up_proj.weight").unwrap(), v);
        assert!(ParamSink::write_param(&base, "model.layers.2.mlp.up_proj.weight", &v[1..]).is_err());
        assert!(ParamSink::write_param(&base, "model.layers.9.mlp.up_proj.weight", &v).is_err());
        assert_eq!(base.bytes(), 4 * (layout.outer.len + 4 * layout.layer.len));
    }
}
