//! The frozen base of a LoRA run: each unit's base weights, written once (the import) and then
//! only read (staged into a unit's upload copy, ahead of its adapters). Not training state: no
//! moments, no gradient, never in a checkpoint (those hold the adapters: the `HostStore`).
//!
//! Held in its encoding ([`mt_core::BaseDtype`], `--base-dtype`): fp32, bf16, or a decoder
//! layer's matrices in int8 or NF4 blocks (`codec.rs`), each unit's record as the bytes of its
//! [`mt_core::BaseEncoding`] (4, 2, ~1.06 or ~0.56 bytes a parameter). An int8 or NF4 unit goes
//! up as those bytes and is dequantised on the device ([`uploads_encoded`]); `codec::decode` is
//! the reference its kernel is held to.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use mt_core::{BaseDtype, BaseEncoding, Error, ModelLayout, Result, Unit, BASE_BLOCK};

use crate::TransferDtype;

pub mod codec;
pub use codec::Decoded;

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

/// A LoRA run's frozen base weights, per unit, each unit's record (laid out as a device slot's
/// base part) in the base's encoding.
#[derive(Debug)]
pub struct FrozenBase {
    layout: ModelLayout,
    dtype: BaseDtype,
    /// The outer unit's encoding and every decoder layer's (they share one layout).
    outer: BaseEncoding,
    layer: BaseEncoding,
    /// Each unit's encoded record, as 4-byte words (every block is whole words, so its scale and
    /// f32 values are aligned).
    units: Vec<Mutex<Vec<u32>>>,
    /// Quantised blocks written in part so far, by (unit, block): a parameter filled piece by
    /// piece (a mixture of experts' experts) whose pieces do not end on block boundaries. A
    /// block is encoded once each of its elements has come (its scale needs them all).
    pending: Mutex<BTreeMap<(usize, usize), Pending>>,
}

/// A quantised block's values so far, and which have come (bit `j`: element `j`).
#[derive(Debug)]
struct Pending {
    values: [f32; BASE_BLOCK],
    have: u64,
}

/// The bits of elements `r` of a block.
fn mask(r: std::ops::Range<usize>) -> u64 {
    let bits = |n: usize| if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
    bits(r.end) & !bits(r.start)
}

/// Whether a unit whose base is encoded as `enc` goes up as those bytes, to be dequantised on
/// the device into a slot of `dtype`: an int8 or NF4 decoder layer, into bf16 or f32 (what the
/// dequantisation kernels write). Otherwise its upload copy holds the weights in `dtype`.
pub fn uploads_encoded(enc: &BaseEncoding, dtype: TransferDtype) -> bool {
    enc.is_quantised() && matches!(dtype, TransferDtype::Bf16 | TransferDtype::F32)
}

/// Decodes a unit's base record (`bytes`, encoded as `enc`) into `out` (its elements; the
/// adapters that follow in a slot are not touched): the reference dequantisation.
pub fn decode_unit(enc: &BaseEncoding, bytes: &[u8], out: Decoded<'_>) {
    match out {
        Decoded::F32(o) => {
            for s in &enc.segments {
                codec::decode(s.code, &bytes[s.byte_range()], Decoded::F32(&mut o[s.start..s.start + s.len]));
            }
        }
        Decoded::Bf16(o) => {
            for s in &enc.segments {
                codec::decode(
                    s.code,
                    &bytes[s.byte_range()],
                    Decoded::Bf16(&mut o[s.start..s.start + s.len]),
                );
            }
        }
    }
}

impl FrozenBase {
    /// Zeroed weights for `layout` (the base model's, without adapters), held as `dtype`.
    pub fn zeroed(layout: &ModelLayout, dtype: BaseDtype) -> Self {
        let outer = dtype.encoding(&layout.outer, Unit::Outer);
        let layer = dtype.encoding(&layout.layer, Unit::Layer(0));
        // Zero bytes are zero weights in every encoding (an NF4 block's are absmax 0 times code
        // -1: -0).
        let units = layout
            .units()
            .map(|u| Mutex::new(vec![0u32; if u == Unit::Outer { &outer } else { &layer }.bytes / 4]))
            .collect();
        FrozenBase { layout: layout.clone(), dtype, outer, layer, units, pending: Mutex::default() }
    }

    /// The base model's layout.
    pub fn layout(&self) -> &ModelLayout {
        &self.layout
    }

    /// How the base is held.
    pub fn dtype(&self) -> BaseDtype {
        self.dtype
    }

    /// `u`'s encoding.
    pub fn encoding(&self, u: Unit) -> &BaseEncoding {
        match u {
            Unit::Outer => &self.outer,
            Unit::Layer(_) => &self.layer,
        }
    }

    /// `u`'s encoded record, locked for reading.
    pub fn unit(&self, u: Unit) -> BaseUnit<'_> {
        BaseUnit(self.units[u.index()].lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Reads a parameter (by HF name) as the values its encoding holds.
    pub fn read_param(&self, hf_name: &str) -> Result<Vec<f32>> {
        let (u, spec) = self.layout.resolve(hf_name)?;
        let enc = self.encoding(u);
        let s = *enc.segment_of(spec.offset).ok_or_else(|| Error::UnknownParam(hf_name.to_owned()))?;
        // Whole blocks: a tensor starts on one, and its span ends on one.
        let (first, end) = (spec.offset / BASE_BLOCK, (spec.offset + spec.numel()).div_ceil(BASE_BLOCK));
        let bb = s.code.block_bytes();
        let at = s.byte_offset + (first * BASE_BLOCK - s.start) / BASE_BLOCK * bb;
        let mut v = vec![0f32; (end - first) * BASE_BLOCK];
        codec::decode(s.code, &self.unit(u)[at..at + (end - first) * bb], Decoded::F32(&mut v));
        v.truncate(spec.numel());
        Ok(v)
    }

    /// Bytes of RAM the weights take (their encoding's).
    pub fn bytes(&self) -> usize {
        self.outer.bytes + self.layout.n_layers * self.layer.bytes
    }

    /// Encodes `data` into elements `at..` of `u`'s record, all within one tensor.
    fn write_elems(&self, u: Unit, at: usize, data: &[f32]) -> Result<()> {
        let end = at + data.len();
        let enc = self.encoding(u);
        let (Some(&s), false) = (enc.segment_of(at), data.is_empty()) else { return Ok(()) };
        let bb = s.code.block_bytes();
        let block_at = |b: usize| s.byte_offset + (b * BASE_BLOCK - s.start) / BASE_BLOCK * bb;
        let tensors = &self.layout.unit(u).tensors;
        let t = &tensors[tensors.partition_point(|t| t.offset <= at) - 1];
        let t_end = t.offset + t.numel();
        let mut guard = self.units[u.index()].lock().unwrap_or_else(|p| p.into_inner());
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut guard[..]);
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        // The blocks the write covers whole, on every core; then the one or two at its ends.
        let (mid0, mid1) = (at.div_ceil(BASE_BLOCK), end / BASE_BLOCK);
        if mid0 < mid1 {
            let vals = &data[mid0 * BASE_BLOCK - at..mid1 * BASE_BLOCK - at];
            codec::encode(s.code, vals, &mut bytes[block_at(mid0)..block_at(mid1)]);
            pending.retain(|&(unit, b), _| unit != u.index() || !(mid0..mid1).contains(&b));
        }
        let (b0, b1) = (at / BASE_BLOCK, (end - 1) / BASE_BLOCK);
        for (k, b) in [b0, b1].into_iter().enumerate() {
            if (mid0..mid1).contains(&b) || (k == 1 && b1 == b0) {
                continue;
            }
            let bs = b * BASE_BLOCK;
            // The block's elements of the tensor (its last block may end in padding, which stays
            // zero), and those this write brings.
            let valid = 0..t_end.min(bs + BASE_BLOCK) - bs;
            let written = at.max(bs) - bs..end.min(bs + BASE_BLOCK) - bs;
            let new = &data[bs + written.start - at..bs + written.end - at];
            let out = &mut bytes[block_at(b)..block_at(b) + bb];
            let mut vals = [0f32; BASE_BLOCK];
            if written == valid || !s.code.is_quantised() {
                // The whole block, or an fp32 or bf16 one, whose other elements decode exactly.
                if written != valid {
                    codec::decode_block(s.code, out, &mut vals);
                }
                vals[written].copy_from_slice(new);
                codec::encode_block(s.code, &vals, out);
                pending.remove(&(u.index(), b));
                continue;
            }
            let p = pending.entry((u.index(), b)).or_insert(Pending { values: [0.0; BASE_BLOCK], have: 0 });
            p.values[written.clone()].copy_from_slice(new);
            p.have |= mask(written);
            if p.have & mask(valid.clone()) == mask(valid) {
                codec::encode_block(s.code, &p.values, out);
                pending.remove(&(u.index(), b));
            }
        }
        Ok(())
    }
}

/// A unit's encoded base record, locked for reading ([`FrozenBase::unit`]): its bytes.
#[derive(Debug)]
pub struct BaseUnit<'a>(MutexGuard<'a, Vec<u32>>);

impl std::ops::Deref for BaseUnit<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0[..])
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
        if let Some(i) = data.iter().position(|x| !x.is_finite()) {
            return Err(Error::Data(format!(
                "{hf_name}[{}] is {}: a frozen base holds finite weights only (an {} block's scale \
                 would not be finite); the weights are corrupt",
                start + i,
                data[i],
                self.dtype
            )));
        }
        self.write_elems(spec.unit, spec.offset + start, data)
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;

    const UP: &str = "model.layers.2.mlp.up_proj.weight";
    const NORM: &str = "model.layers.1.input_layernorm.weight";

    fn tiny() -> ModelLayout {
        ModelLayout::new(&mt_core::ModelConfig::tiny_llama())
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
            .collect()
    }

    /// Each encoding keeps what it says it keeps: fp32 every bit, bf16 the nearest-even
    /// rounding, int8 and NF4 a layer's matrices within their bounds but its norms in bf16; its
    /// bytes are its encodings'. A write of the wrong length or to no parameter is refused.
    #[test]
    fn writes_and_reads_by_name() {
        let layout = tiny();
        let n = layout.resolve(UP).unwrap().1.numel();
        let (v, norm) = (values(n, 1), values(layout.resolve(NORM).unwrap().1.numel(), 2));
        let bf = |v: &[f32]| v.iter().map(|x| bf16::from_f32(*x).to_f32()).collect::<Vec<_>>();
        for dtype in BaseDtype::ALL {
            let base = FrozenBase::zeroed(&layout, dtype);
            ParamSink::write_param(&base, UP, &v).unwrap();
            ParamSink::write_param(&base, NORM, &norm).unwrap();
            let (got, got_norm) = (base.read_param(UP).unwrap(), base.read_param(NORM).unwrap());
            let err = v.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            match dtype {
                BaseDtype::F32 => assert_eq!((&got, &got_norm), (&v, &norm)),
                BaseDtype::Bf16 => assert_eq!((got, got_norm), (bf(&v), bf(&norm))),
                // |v| < 0.5: int8 within 0.5 / 254, NF4 within 0.152 · 0.5.
                BaseDtype::Int8 => assert!(err <= 0.5 / 254.0 && err > 0.0 && got_norm == bf(&norm), "{err}"),
                BaseDtype::Nf4 => assert!(err <= 0.0760 && err > 0.002 && got_norm == bf(&norm), "{err}"),
            }
            assert!(ParamSink::write_param(&base, UP, &v[1..]).is_err());
            assert!(ParamSink::write_param(&base, "model.layers.9.mlp.up_proj.weight", &v).is_err());
            let (o, l) = (
                dtype.encoding(&layout.outer, Unit::Outer).bytes,
                dtype.encoding(&layout.layer, Unit::Layer(0)).bytes,
            );
            assert_eq!(base.bytes(), o + 4 * l, "{dtype}");
        }
        let b = |d: BaseDtype| FrozenBase::zeroed(&layout, d).bytes();
        assert_eq!(b(BaseDtype::F32), 4 * (layout.outer.len + 4 * layout.layer.len));
        assert_eq!(b(BaseDtype::Bf16), 2 * (layout.outer.len + 4 * layout.layer.len));
        assert!(b(BaseDtype::Nf4) < b(BaseDtype::Int8) && b(BaseDtype::Int8) < b(BaseDtype::Bf16));
    }

    /// A NaN or an infinity is refused by a sentence naming the tensor and the element, and
    /// nothing is written.
    #[test]
    fn non_finite_weights_are_refused_naming_the_tensor() {
        let layout = tiny();
        let n = layout.resolve(UP).unwrap().1.numel();
        for dtype in BaseDtype::ALL {
            let base = FrozenBase::zeroed(&layout, dtype);
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut v = values(n, 3);
                v[77] = bad;
                let e = ParamSink::write_param(&base, UP, &v).unwrap_err().to_string();
                assert!(e.contains(&format!("{UP}[77] is {bad}")) && e.contains("finite"), "{e}");
                let e = ParamSink::write_param_part(&base, UP, 100, &v[77..80]).unwrap_err().to_string();
                assert!(e.contains(&format!("{UP}[100] is {bad}")), "{e}");
            }
            assert!(base.read_param(UP).unwrap().iter().all(|x| *x == 0.0), "{dtype}: nothing written");
        }
    }

    /// A parameter written in pieces that do not end on block boundaries, in any order, holds
    /// the bytes of the same values written whole: a quantised block waits for all its elements.
    #[test]
    fn pieces_encode_as_the_whole() {
        let layout = tiny();
        let n = layout.resolve(UP).unwrap().1.numel();
        let v = values(n, 4);
        let cuts = [0, 13, 64, 100, 191, 1000, 1001, 4000, n - 70, n - 1, n];
        for dtype in BaseDtype::ALL {
            let whole = FrozenBase::zeroed(&layout, dtype);
            ParamSink::write_param(&whole, UP, &v).unwrap();
            let parts = FrozenBase::zeroed(&layout, dtype);
            // Backwards, so a block's later elements come first.
            for w in cuts.windows(2).rev() {
                ParamSink::write_param_part(&parts, UP, w[0], &v[w[0]..w[1]]).unwrap();
            }
            assert!(*parts.unit(Unit::Layer(2)) == *whole.unit(Unit::Layer(2)), "{dtype}");
            assert!(parts.pending.lock().unwrap().is_empty(), "{dtype}");
            // Half a block alone stays pending (its bytes zero) until the rest comes.
            let half = FrozenBase::zeroed(&layout, dtype);
            ParamSink::write_param_part(&half, UP, 0, &v[..32]).unwrap();
            let pending = !half.pending.lock().unwrap().is_empty();
            assert_eq!(pending, matches!(dtype, BaseDtype::Int8 | BaseDtype::Nf4), "{dtype}");
        }
    }

    /// The reference decoding of a whole unit is each parameter's values, in the slot's dtype.
    #[test]
    fn a_unit_decodes_to_its_parameters() {
        let layout = tiny();
        for dtype in BaseDtype::ALL {
            let base = FrozenBase::zeroed(&layout, dtype);
            for (k, (name, _, spec)) in layout.all_params().into_iter().enumerate() {
                ParamSink::write_param(&base, &name, &values(spec.numel(), k as u32)).unwrap();
            }
            for u in [Unit::Outer, Unit::Layer(3)] {
                let n = layout.unit(u).len;
                let (mut f, mut b) = (vec![0f32; n], vec![bf16::ZERO; n]);
                decode_unit(base.encoding(u), &base.unit(u), Decoded::F32(&mut f));
                decode_unit(base.encoding(u), &base.unit(u), Decoded::Bf16(&mut b));
                for t in &layout.unit(u).tensors {
                    let name = match u {
                        Unit::Outer => t.name.clone(),
                        Unit::Layer(l) => format!("model.layers.{l}.{}", t.name),
                    };
                    let want = base.read_param(&name).unwrap();
                    assert_eq!(&f[t.offset..t.offset + t.numel()], &want[..], "{dtype} {name}");
                }
                assert!(f.iter().zip(&b).all(|(x, y)| bf16::from_f32(*x) == *y), "{dtype}");
            }
        }
    }
}
