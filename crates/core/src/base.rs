//! A LoRA run's frozen base in host memory (`--base-dtype`): the encodings it may be held in, and
//! how each lays out a unit's flat record as byte ranges ([`BaseEncoding`]: the segments the
//! staging copy, the upload and the dequantisation walk). Arithmetic only: the encoders and the
//! CPU decoding are mt-store's (`FrozenBase`), the GPU's decoding mt-kernels'.
//!
//! int8 and NF4 quantise a decoder layer's matrices (every tensor of two or more dimensions: the
//! linear layers, a router, packed experts) in blocks of [`BASE_BLOCK`] consecutive elements of
//! the record, each with one f32 scale; every other tensor (norms, biases, attention sinks) and
//! the whole outer unit (embedding, final norm, LM head) stay bf16, as QLoRA keeps them
//! (decision 0048).

use crate::{TensorSpec, Unit, UnitLayout, TENSOR_ALIGN_ELEMS};

/// Elements of one block of an int8 or NF4 base (one f32 scale each). The layout's tensor
/// alignment, so a block never straddles two tensors and a tensor's span (its elements and the
/// padding after them, which is zero) is whole blocks.
pub const BASE_BLOCK: usize = 64;
const _: () = assert!(BASE_BLOCK == TENSOR_ALIGN_ELEMS);

/// How a LoRA run's frozen base is held in host memory (`--base-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BaseDtype {
    /// fp32, as imported (4 B/param).
    #[default]
    F32,
    /// bf16, rounded to nearest even (2 B/param).
    Bf16,
    /// A decoder layer's matrices int8 with an f32 absmax scale per block of 64 (1.0625
    /// B/param), the rest bf16.
    Int8,
    /// A decoder layer's matrices in QLoRA's 4-bit NormalFloat with an f32 absmax per block of
    /// 64 (0.5625 B/param), the rest bf16.
    Nf4,
}

impl BaseDtype {
    /// Every choice, in the order the flag lists them.
    pub const ALL: [BaseDtype; 4] = [BaseDtype::F32, BaseDtype::Bf16, BaseDtype::Int8, BaseDtype::Nf4];

    /// The flag's spelling: `fp32`, `bf16`, `int8` or `nf4`.
    pub fn name(self) -> &'static str {
        match self {
            BaseDtype::F32 => "fp32",
            BaseDtype::Bf16 => "bf16",
            BaseDtype::Int8 => "int8",
            BaseDtype::Nf4 => "nf4",
        }
    }

    /// The choice the flag spells `s`.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == s)
    }

    /// How `spec`, a tensor of `unit`, is held.
    pub fn code_of(self, unit: Unit, spec: &TensorSpec) -> BaseCode {
        let quantised = matches!(unit, Unit::Layer(_)) && spec.shape.len() >= 2;
        match self {
            BaseDtype::F32 => BaseCode::F32,
            BaseDtype::Bf16 => BaseCode::Bf16,
            BaseDtype::Int8 if quantised => BaseCode::Int8,
            BaseDtype::Nf4 if quantised => BaseCode::Nf4,
            BaseDtype::Int8 | BaseDtype::Nf4 => BaseCode::Bf16,
        }
    }

    /// The encoding of `unit`, laid out as `layout`.
    pub fn encoding(self, layout: &UnitLayout, unit: Unit) -> BaseEncoding {
        let mut segments: Vec<BaseSegment> = Vec::new();
        let mut bytes = 0;
        for (i, t) in layout.tensors.iter().enumerate() {
            // A tensor's span runs to the next one's start: its padding is encoded with it.
            let end = layout.tensors.get(i + 1).map_or(layout.len, |n| n.offset);
            let code = self.code_of(unit, t);
            let len = end - t.offset;
            match segments.last_mut() {
                Some(s) if s.code == code => s.len += len,
                _ => segments.push(BaseSegment { start: t.offset, len, byte_offset: bytes, code }),
            }
            bytes += len / BASE_BLOCK * code.block_bytes();
        }
        BaseEncoding { segments, bytes }
    }
}

impl std::fmt::Display for BaseDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How one segment of a base record is encoded, block by block ([`BASE_BLOCK`] elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BaseCode {
    /// Each element's f32 bytes.
    F32,
    /// Each element's bf16 bytes (rounded to nearest even).
    Bf16,
    /// The block's scale (f32, `absmax / 127`), then 64 signed bytes `q`: value `q · scale`.
    Int8,
    /// The block's absmax (f32), then 32 bytes of 4-bit indices into the NF4 code (element `2i`
    /// in the low nibble of byte `i`, `2i + 1` in the high one): value `code[idx] · absmax`.
    Nf4,
}

impl BaseCode {
    /// Bytes of one block of [`BASE_BLOCK`] elements (a multiple of 4, so every scale is
    /// aligned).
    pub fn block_bytes(self) -> usize {
        match self {
            BaseCode::F32 => 4 * BASE_BLOCK,
            BaseCode::Bf16 => 2 * BASE_BLOCK,
            BaseCode::Int8 => 4 + BASE_BLOCK,
            BaseCode::Nf4 => 4 + BASE_BLOCK / 2,
        }
    }

    /// Whether the code quantises (blocks with a scale) rather than rounds each element alone.
    pub fn is_quantised(self) -> bool {
        matches!(self, BaseCode::Int8 | BaseCode::Nf4)
    }
}

/// A run of a base record in one code: elements `start..start + len` (whole blocks) of the
/// record, held in bytes `byte_offset..byte_offset + bytes()` of the unit's encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BaseSegment {
    /// First element (a multiple of [`BASE_BLOCK`]).
    pub start: usize,
    /// Elements (a multiple of [`BASE_BLOCK`]).
    pub len: usize,
    /// Where its bytes start in the unit's encoding (a multiple of 4).
    pub byte_offset: usize,
    /// Its code.
    pub code: BaseCode,
}

impl BaseSegment {
    /// Bytes of its encoding.
    pub fn bytes(&self) -> usize {
        self.len / BASE_BLOCK * self.code.block_bytes()
    }

    /// Its byte range in the unit's encoding.
    pub fn byte_range(&self) -> std::ops::Range<usize> {
        self.byte_offset..self.byte_offset + self.bytes()
    }
}

/// A unit's base record as encoded: its segments in record order, tiling it, and their bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseEncoding {
    /// The segments, consecutive ones in different codes.
    pub segments: Vec<BaseSegment>,
    /// Bytes of the whole encoding.
    pub bytes: usize,
}

impl BaseEncoding {
    /// Whether any segment is quantised (int8 or NF4): a decoder layer of such a base.
    pub fn is_quantised(&self) -> bool {
        self.segments.iter().any(|s| s.code.is_quantised())
    }

    /// Elements of the record the segments tile.
    pub fn elems(&self) -> usize {
        self.segments.last().map_or(0, |s| s.start + s.len)
    }

    /// The segment holding element `i` of the record.
    pub fn segment_of(&self, i: usize) -> Option<&BaseSegment> {
        let k = self.segments.partition_point(|s| s.start + s.len <= i);
        self.segments.get(k).filter(|s| s.start <= i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ModelConfig, ModelLayout};

    /// Each encoding tiles the record with whole blocks in record order; int8 and NF4 quantise a
    /// decoder layer's matrices alone (not its norms, nor anything of the outer unit), and their
    /// bytes are what the formats say: 1 + 4/64 and 1/2 + 4/64 a quantised element, 2 a bf16 one.
    #[test]
    fn encodings_tile_the_record_and_quantise_the_layer_matrices() {
        let layout = ModelLayout::new(&ModelConfig::tiny_llama());
        for dtype in BaseDtype::ALL {
            for unit in [Unit::Outer, Unit::Layer(0)] {
                let u = layout.unit(unit);
                let e = dtype.encoding(u, unit);
                let (mut at, mut bytes) = (0, 0);
                for s in &e.segments {
                    assert_eq!((s.start, s.byte_offset), (at, bytes), "{dtype} {unit:?}: {s:?}");
                    assert!(s.len > 0 && s.len % BASE_BLOCK == 0, "{s:?}");
                    assert_eq!(s.byte_offset % 4, 0);
                    (at, bytes) = (at + s.len, bytes + s.bytes());
                }
                assert!(e.segments.windows(2).all(|w| w[0].code != w[1].code), "{e:?}");
                assert_eq!((at, bytes), (u.len, e.bytes), "{dtype} {unit:?}");
                for t in &u.tensors {
                    let s = e.segment_of(t.offset).unwrap();
                    let quantised = matches!(dtype, BaseDtype::Int8 | BaseDtype::Nf4)
                        && unit != Unit::Outer
                        && t.shape.len() >= 2;
                    assert_eq!(s.code.is_quantised(), quantised, "{dtype} {}", t.name);
                    assert_eq!(e.segment_of(t.offset + t.numel() - 1), Some(s), "{}", t.name);
                }
                assert_eq!(e.segment_of(u.len), None);
            }
        }
        let l = &layout.layer;
        // The tiny Llama's norms are whole blocks wide: no padding after them.
        let norms = l.tensors.iter().filter(|t| t.shape.len() == 1).map(|t| t.numel());
        assert!(norms.clone().all(|n| n % BASE_BLOCK == 0));
        let norms: usize = norms.sum();
        let mats = l.len - norms;
        let int8 = BaseDtype::Int8.encoding(l, Unit::Layer(1));
        let nf4 = BaseDtype::Nf4.encoding(l, Unit::Layer(1));
        assert_eq!(int8.bytes, mats + mats / 16 + 2 * norms);
        assert_eq!(nf4.bytes, mats / 2 + mats / 16 + 2 * norms);
        assert_eq!(BaseDtype::Bf16.encoding(l, Unit::Layer(0)).bytes, 2 * l.len);
        assert_eq!(BaseDtype::F32.encoding(&layout.outer, Unit::Outer).bytes, 4 * layout.outer.len);
        assert!(int8.is_quantised() && !BaseDtype::Int8.encoding(&layout.outer, Unit::Outer).is_quantised());
        for d in BaseDtype::ALL {
            assert_eq!(BaseDtype::parse(d.name()), Some(d));
        }
    }
}
