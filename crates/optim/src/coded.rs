//! The fused AdamW pass over moments held in bf16 or 8 bits ([`crate::moments`]): each
//! L1-sized block's moments decoded into f32, updated by exactly the fp32 pass's arithmetic
//! (`adamw::update_block`), and encoded back, in the same pass that widens the gradient and
//! writes the upload copy. Whole vectors (bf16) and whole 8-bit blocks run in the vector kernels
//! of [`crate::simd`] where the CPU has them; the rest, and every element on other CPUs, in the
//! scalar definitions, bit for bit the same. fp32 moments take `adamw`'s own loop.

use mt_core::Q8_BLOCK;
use rayon::prelude::*;

use crate::adamw::{update_block, update_chunk, Coeffs, GradElem, UploadElem, BLOCK, CHUNK};
use crate::moments::{bf16_sr, decode_m, decode_v, encode_m, encode_v, mix32, rounding_keys, widen, Moments};
use crate::simd::{self, streaming::Writer, Isa};

const _: () =
    assert!(CHUNK.is_multiple_of(Q8_BLOCK) && BLOCK.is_multiple_of(Q8_BLOCK), "8-bit blocks tile the chunks");

/// One [`CHUNK`] of a range's moments.
pub(crate) enum MomChunk<'a> {
    F32(&'a mut [f32], &'a mut [f32]),
    Bf16(&'a mut [u16], &'a mut [u16]),
    Int8 { mc: &'a mut [u8], ms: &'a mut [f32], vc: &'a mut [u8], vs: &'a mut [f32] },
}

/// The moments cut into [`CHUNK`]s, in order, and the stochastic rounding's keys for `step`.
pub(crate) fn mom_chunks(mom: Moments<'_>, step: u64) -> (Vec<MomChunk<'_>>, [u32; 2]) {
    match mom {
        Moments::F32 { m, v } => {
            (m.chunks_mut(CHUNK).zip(v.chunks_mut(CHUNK)).map(|(m, v)| MomChunk::F32(m, v)).collect(), [0; 2])
        }
        Moments::Bf16 { m, v, stream } => (
            m.chunks_mut(CHUNK).zip(v.chunks_mut(CHUNK)).map(|(m, v)| MomChunk::Bf16(m, v)).collect(),
            rounding_keys(step, stream),
        ),
        Moments::Int8 { m, v, stream } => {
            let per = CHUNK / Q8_BLOCK;
            let chunks = m
                .codes
                .chunks_mut(CHUNK)
                .zip(m.scales.chunks_mut(per))
                .zip(v.codes.chunks_mut(CHUNK).zip(v.scales.chunks_mut(per)))
                .map(|((mc, ms), (vc, vs))| MomChunk::Int8 { mc, ms, vc, vs })
                .collect();
            (chunks, rounding_keys(step, stream))
        }
    }
}

/// One rayon task over coded moments: the chunk in L1-sized blocks, each widened (bf16 grads),
/// decoded, updated, encoded (stochastic draws of elements `base..`) and cast.
#[allow(clippy::too_many_arguments)]
pub(crate) fn update_coded<G: GradElem, U: UploadElem>(
    isa: Isa,
    c: &Coeffs,
    keys: [u32; 2],
    base: usize,
    g: &[G],
    p: &mut [f32],
    mom: MomChunk<'_>,
    mut up: Option<&mut [U]>,
) {
    let mut mom = match mom {
        MomChunk::F32(m, v) => return update_chunk(c, g, p, m, v, up),
        coded => coded,
    };
    let mut gbuf = [0.0f32; BLOCK];
    let mut w = up.is_some().then(Writer::new);
    for (i, (p, g)) in p.chunks_mut(BLOCK).zip(g.chunks(BLOCK)).enumerate() {
        let (lo, n) = (i * BLOCK, p.len());
        let g = G::widen(g, &mut gbuf);
        match &mut mom {
            MomChunk::Bf16(mm, vv) => {
                bf16_block(isa, c, keys, base + lo, g, p, &mut mm[lo..lo + n], &mut vv[lo..lo + n])
            }
            MomChunk::Int8 { mc, ms, vc, vs } => {
                for (k, (p, g)) in p.chunks_mut(Q8_BLOCK).zip(g.chunks(Q8_BLOCK)).enumerate() {
                    let (at, b, len) = (lo + k * Q8_BLOCK, lo / Q8_BLOCK + k, p.len());
                    let m = (&mut mc[at..at + len], &mut ms[b]);
                    let v = (&mut vc[at..at + len], &mut vs[b]);
                    q8_block(isa, c, keys, base + at, g, p, m, v);
                }
            }
            MomChunk::F32(..) => unreachable!("fp32 moments take update_chunk"),
        }
        if let (Some(up), Some(w)) = (up.as_deref_mut(), w.as_mut()) {
            U::narrow_streaming(p, &mut up[lo..lo + n], w);
        }
    }
}

/// The update over bf16 moments of at most [`BLOCK`] elements (`base` the first one's index in
/// the unit): the vector kernel's whole vectors, then the rest element by element.
#[allow(clippy::too_many_arguments)]
fn bf16_block(
    isa: Isa,
    c: &Coeffs,
    keys: [u32; 2],
    base: usize,
    g: &[f32],
    p: &mut [f32],
    mm: &mut [u16],
    vv: &mut [u16],
) {
    let done = simd::bf16_span(isa, c, keys, base as u32, g, p, mm, vv);
    let (g, p, mm, vv) = (&g[done..], &mut p[done..], &mut mm[done..], &mut vv[done..]);
    let (mut mbuf, mut vbuf) = ([0.0f32; BLOCK], [0.0f32; BLOCK]);
    let (m, v) = (&mut mbuf[..p.len()], &mut vbuf[..p.len()]);
    for ((m, v), (&a, &b)) in m.iter_mut().zip(v.iter_mut()).zip(mm.iter().zip(vv.iter())) {
        (*m, *v) = (widen(a), widen(b));
    }
    update_block(c, g, p, m, v);
    let at = base + done;
    for (j, (d, &x)) in mm.iter_mut().zip(m.iter()).enumerate() {
        *d = bf16_sr(x, mix32((at + j) as u32 ^ keys[0]));
    }
    for (j, (d, &x)) in vv.iter_mut().zip(v.iter()).enumerate() {
        *d = bf16_sr(x, mix32((at + j) as u32 ^ keys[1]));
    }
}

/// The update over one 8-bit block (`base` its first element's index in the unit): the vector
/// kernel for a whole block, else (the last, partial block of a unit, or no vector kernel)
/// decoded, updated and encoded element by element.
#[allow(clippy::too_many_arguments)]
fn q8_block(
    isa: Isa,
    c: &Coeffs,
    keys: [u32; 2],
    base: usize,
    g: &[f32],
    p: &mut [f32],
    (mc, ms): (&mut [u8], &mut f32),
    (vc, vs): (&mut [u8], &mut f32),
) {
    if simd::q8_block(isa, c, keys, base as u32, g, p, (mc, ms), (vc, vs)) {
        return;
    }
    let (mut mbuf, mut vbuf) = ([0.0f32; Q8_BLOCK], [0.0f32; Q8_BLOCK]);
    let (m, v) = (&mut mbuf[..p.len()], &mut vbuf[..p.len()]);
    decode_m(mc, *ms, m);
    decode_v(vc, *vs, v);
    update_block(c, g, p, m, v);
    *ms = encode_m(m, mc, keys[0], base);
    *vs = encode_v(v, vc, keys[1], base);
}

/// Splits the (length-checked) slices into [`CHUNK`]s and runs them on the rayon pool.
pub(crate) fn run_coded<G: GradElem, U: UploadElem>(
    isa: Isa,
    c: &Coeffs,
    step: u64,
    g: &[G],
    p: &mut [f32],
    mom: Moments<'_>,
    up: Option<&mut [U]>,
) {
    let (chunks, keys) = mom_chunks(mom, step);
    let (p, g, mom) = (p.par_chunks_mut(CHUNK), g.par_chunks(CHUNK), chunks.into_par_iter());
    match up {
        Some(up) => (p, g, mom, up.par_chunks_mut(CHUNK))
            .into_par_iter()
            .enumerate()
            .for_each(|(k, (p, g, mom, u))| update_coded(isa, c, keys, k * CHUNK, g, p, mom, Some(u))),
        None => (p, g, mom)
            .into_par_iter()
            .enumerate()
            .for_each(|(k, (p, g, mom))| update_coded::<G, U>(isa, c, keys, k * CHUNK, g, p, mom, None)),
    }
}
