//! The fused AdamW pass over moments held in bf16 or 8 bits ([`crate::moments`]): each
//! L1-sized block's moments decoded into f32, updated by exactly the fp32 pass's arithmetic
//! (`adamw::update_block`), and encoded back, in the same pass that widens the gradient and
//! writes the upload copy. fp32 moments take `adamw`'s own loop.

use mt_core::Q8_BLOCK;
use rayon::prelude::*;

use crate::adamw::{update_block, update_chunk, Coeffs, GradElem, UploadElem, BLOCK, CHUNK};
use crate::moments::{bf16_sr, decode_m, decode_v, encode_m, encode_v, mix32, rounding_keys, widen, Moments};
use crate::streaming::Writer;

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
pub(crate) fn update_coded<G: GradElem, U: UploadElem>(
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
    let (mut gbuf, mut mbuf, mut vbuf) = ([0.0f32; BLOCK], [0.0f32; BLOCK], [0.0f32; BLOCK]);
    let mut w = up.is_some().then(Writer::new);
    for (i, (p, g)) in p.chunks_mut(BLOCK).zip(g.chunks(BLOCK)).enumerate() {
        let (lo, n) = (i * BLOCK, p.len());
        let g = G::widen(g, &mut gbuf);
        let (m, v) = (&mut mbuf[..n], &mut vbuf[..n]);
        match &mut mom {
            MomChunk::Bf16(mm, vv) => {
                for ((m, v), (&a, &b)) in
                    m.iter_mut().zip(v.iter_mut()).zip(mm[lo..lo + n].iter().zip(&vv[lo..lo + n]))
                {
                    (*m, *v) = (widen(a), widen(b));
                }
            }
            MomChunk::Int8 { mc, ms, vc, vs } => {
                for (k, (m, v)) in m.chunks_mut(Q8_BLOCK).zip(v.chunks_mut(Q8_BLOCK)).enumerate() {
                    let (at, b) = (lo + k * Q8_BLOCK, lo / Q8_BLOCK + k);
                    decode_m(&mc[at..at + m.len()], ms[b], m);
                    decode_v(&vc[at..at + v.len()], vs[b], v);
                }
            }
            MomChunk::F32(..) => unreachable!("fp32 moments take update_chunk"),
        }
        update_block(c, g, p, m, v);
        match &mut mom {
            MomChunk::Bf16(mm, vv) => {
                let at = base + lo;
                for (j, (d, &x)) in mm[lo..lo + n].iter_mut().zip(m.iter()).enumerate() {
                    *d = bf16_sr(x, mix32((at + j) as u32 ^ keys[0]));
                }
                for (j, (d, &x)) in vv[lo..lo + n].iter_mut().zip(v.iter()).enumerate() {
                    *d = bf16_sr(x, mix32((at + j) as u32 ^ keys[1]));
                }
            }
            MomChunk::Int8 { mc, ms, vc, vs } => {
                for (k, (m, v)) in m.chunks(Q8_BLOCK).zip(v.chunks(Q8_BLOCK)).enumerate() {
                    let (at, b) = (lo + k * Q8_BLOCK, lo / Q8_BLOCK + k);
                    ms[b] = encode_m(m, &mut mc[at..at + m.len()], keys[0], base + at);
                    vs[b] = encode_v(v, &mut vc[at..at + v.len()], keys[1], base + at);
                }
            }
            MomChunk::F32(..) => unreachable!("fp32 moments take update_chunk"),
        }
        if let (Some(up), Some(w)) = (up.as_deref_mut(), w.as_mut()) {
            U::narrow_streaming(p, &mut up[lo..lo + n], w);
        }
    }
}

/// Splits the (length-checked) slices into [`CHUNK`]s and runs them on the rayon pool.
pub(crate) fn run_coded<G: GradElem, U: UploadElem>(
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
            .for_each(|(k, (p, g, mom, u))| update_coded(c, keys, k * CHUNK, g, p, mom, Some(u))),
        None => (p, g, mom)
            .into_par_iter()
            .enumerate()
            .for_each(|(k, (p, g, mom))| update_coded::<G, U>(c, keys, k * CHUNK, g, p, mom, None)),
    }
}
