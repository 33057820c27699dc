//! [`HostStore`]'s access to whole parameters by their Hugging Face name: writing a master value
//! (an import or initialisation), reading master values and landed gradients back.

use std::path::PathBuf;

use mt_core::{Error, Result, StateDtype};

use super::HostStore;

impl HostStore {
    /// Writes a parameter's master value (by HF name: a layout tensor, or one expert's matrix
    /// under its checkpoint name, [`mt_core::ModelLayout::resolve_piece`]) and zeroes its moments.
    pub fn write_param(&self, hf_name: &str, data: &[f32]) -> Result<()> {
        crate::ParamSink::write_param(self, hf_name, data)
    }

    /// Writes `data` into a parameter's master value from its element `start` on (row-major,
    /// by HF name as [`HostStore::write_param`]) and zeroes the moments there: a parameter
    /// filled piece by piece, e.g. a dequantised checkpoint tensor expert by expert.
    pub fn write_param_part(&self, hf_name: &str, start: usize, data: &[f32]) -> Result<()> {
        let spec = self.layout.resolve_piece(hf_name)?;
        let u = spec.unit;
        if start.checked_add(data.len()).is_none_or(|end| end > spec.numel()) {
            return Err(Error::Shape {
                what: format!("{hf_name}[{start}..{start} + {}]", data.len()),
                expected: spec.shape.clone(),
                found: vec![start.saturating_add(data.len())],
            });
        }
        use rayon::prelude::*;
        // In blocks on every core: a 14B model writes 59 GB of master weights and reads 118 GB
        // of moments here, which one thread (faulting pages in as it goes) takes minutes over.
        const BLOCK: usize = 1 << 20;
        let mut r = self.record(u);
        let range = spec.offset + start..spec.offset + start + data.len();
        let p = r.parts();
        crate::par_copy(&mut p.master[range.clone()], data);
        // Zero the moments only where they are not zero already: reading a never-written page
        // of an anonymous or sparse mapping maps the shared zero page, writing would allocate
        // it, so importing into a fresh store keeps its moments out of RAM until training. Zero
        // bytes are zero moments in every encoding (an 8-bit block's codes 0 decode to 0
        // whatever its scale).
        let per = match p.states {
            StateDtype::F32 => 4,
            StateDtype::Bf16 => 2,
            StateDtype::Int8 => 1,
        };
        let bytes = per * range.start..per * range.end;
        for region in [&mut p.m[bytes.clone()], &mut p.v[bytes]] {
            region.par_chunks_mut(4 * BLOCK).for_each(|block| {
                if block.iter().any(|&x| x != 0) {
                    block.fill(0);
                }
            });
        }
        Ok(())
    }

    /// Reads a parameter's master value (by HF name).
    pub fn read_param(&self, hf_name: &str) -> Result<Vec<f32>> {
        let spec = self.layout.resolve_piece(hf_name)?;
        let r = self.record(spec.unit);
        Ok(r.master()[spec.offset..spec.offset + spec.numel()].to_vec())
    }

    /// Reads a parameter's landed gradient (by HF name), widened to f32.
    pub fn read_grad(&self, hf_name: &str) -> Result<Vec<f32>> {
        let spec = self.layout.resolve_piece(hf_name)?;
        let r = self.record(spec.unit);
        let g = r.grad().ok_or_else(|| Error::Store {
            path: self.path.clone().unwrap_or_else(|| PathBuf::from("<anonymous store>")),
            msg: "this store keeps no gradient buffers (lean mode, 12 B/param)".into(),
        })?;
        Ok(g.to_f32(spec.offset, spec.numel()))
    }
}
