//! The fused AdamW pass over moments held in bf16 or 8 bits ([`crate::moments`]): each
//! L1-sized block's moments decoded into f32, updated (`adamw::update_block_coded`), and encoded
//! back, in the same pass that widens the gradient and writes the upload copy. Whole vectors
//! (bf16) and whole 8-bit blocks run in the vector kernels of [`crate::simd`] where the CPU has
//! them; the rest, and every element on other CPUs, in the scalar definitions, bit for bit the
//! same. An 8-bit block is encoded while the next one is updated (see [`simd::q8_step`]). fp32
//! moments take `adamw`'s own loop.

use mt_core::Q8_BLOCK;
use rayon::prelude::*;

use crate::adamw::{update_block_coded, update_chunk, Coeffs, GradElem, UploadElem, BLOCK, CHUNK};
use crate::moments::{
    bf16_sr, decode_m, decode_v, draw, encode_m, encode_v, m_bits, rounding_key, v_bits, widen, Moments,
};
use crate::simd::{self, streaming::Writer, Isa, Pass, Pending, Q8Encode, Q8Update};

const _: () =
    assert!(CHUNK.is_multiple_of(Q8_BLOCK) && BLOCK.is_multiple_of(Q8_BLOCK), "8-bit blocks tile the chunks");

/// One [`CHUNK`] of a range's moments.
pub(crate) enum MomChunk<'a> {
    F32(&'a mut [f32], &'a mut [f32]),
    Bf16(&'a mut [u16], &'a mut [u16]),
    Int8 { mc: &'a mut [u8], ms: &'a mut [f32], vc: &'a mut [u8], vs: &'a mut [f32] },
}

/// The moments cut into [`CHUNK`]s, in order, and the stochastic rounding's key for `step`.
pub(crate) fn mom_chunks(mom: Moments<'_>, step: u64) -> (Vec<MomChunk<'_>>, u32) {
    match mom {
        Moments::F32 { m, v } => {
            (m.chunks_mut(CHUNK).zip(v.chunks_mut(CHUNK)).map(|(m, v)| MomChunk::F32(m, v)).collect(), 0)
        }
        Moments::Bf16 { m, v, stream } => (
            m.chunks_mut(CHUNK).zip(v.chunks_mut(CHUNK)).map(|(m, v)| MomChunk::Bf16(m, v)).collect(),
            rounding_key(step, stream),
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
            (chunks, rounding_key(step, stream))
        }
    }
}

/// One rayon task over coded moments: the chunk in L1-sized blocks, each widened (bf16 grads),
/// decoded, updated, encoded (stochastic draws of elements `base..`) and cast.
pub(crate) fn update_coded<G: GradElem, U: UploadElem>(
    pass: Pass<'_>,
    base: usize,
    g: &[G],
    p: &mut [f32],
    mom: MomChunk<'_>,
    up: Option<&mut [U]>,
) {
    match mom {
        MomChunk::F32(m, v) => update_chunk(pass.c, g, p, m, v, up),
        MomChunk::Bf16(m, v) => bf16_chunk(pass, base, g, p, (m, v), up),
        MomChunk::Int8 { mc, ms, vc, vs } => q8_chunk(pass, base, g, p, ((mc, ms), (vc, vs)), up),
    }
}

/// [`update_coded`] over bf16 moments.
fn bf16_chunk<G: GradElem, U: UploadElem>(
    pass: Pass<'_>,
    base: usize,
    g: &[G],
    p: &mut [f32],
    (m, v): (&mut [u16], &mut [u16]),
    mut up: Option<&mut [U]>,
) {
    let mut gbuf = [0.0f32; BLOCK];
    let mut w = up.is_some().then(Writer::new);
    for (i, (p, g)) in p.chunks_mut(BLOCK).zip(g.chunks(BLOCK)).enumerate() {
        let (lo, n) = (i * BLOCK, p.len());
        let g = G::widen(g, &mut gbuf);
        bf16_block(pass, base + lo, g, p, (&mut m[lo..lo + n], &mut v[lo..lo + n]));
        if let (Some(up), Some(w)) = (up.as_deref_mut(), w.as_mut()) {
            U::narrow_streaming(p, &mut up[lo..lo + n], w);
        }
    }
}

/// The update over bf16 moments of at most [`BLOCK`] elements (`base` the first one's index in
/// the unit): the vector kernel's whole vectors, then the rest element by element.
fn bf16_block(pass: Pass<'_>, base: usize, g: &[f32], p: &mut [f32], (mm, vv): (&mut [u16], &mut [u16])) {
    let Pass { c, key, .. } = pass;
    let done = simd::bf16_span(pass, base as u32, g, p, (&mut *mm, &mut *vv));
    if done == p.len() {
        return;
    }
    let (g, p, mm, vv) = (&g[done..], &mut p[done..], &mut mm[done..], &mut vv[done..]);
    let (mut mbuf, mut vbuf) = ([0.0f32; BLOCK], [0.0f32; BLOCK]);
    let (m, v) = (&mut mbuf[..p.len()], &mut vbuf[..p.len()]);
    for ((m, v), (&a, &b)) in m.iter_mut().zip(v.iter_mut()).zip(mm.iter().zip(vv.iter())) {
        (*m, *v) = (widen(a), widen(b));
    }
    update_block_coded(c, g, p, m, v);
    let at = base + done;
    for (j, ((dm, dv), (&m, &v))) in mm.iter_mut().zip(vv.iter_mut()).zip(m.iter().zip(v.iter())).enumerate()
    {
        let h = draw((at + j) as u32, key);
        (*dm, *dv) = (bf16_sr(m, m_bits(h)), bf16_sr(v, v_bits(h)));
    }
}

/// [`update_coded`] over 8-bit moments: every whole 8-bit block through [`simd::q8_step`],
/// updated in one step and encoded in the next (the new moments wait in one of two
/// [`Pending`]s); a partial block (only ever a unit's last) after the one before it is encoded,
/// element by element.
fn q8_chunk<G: GradElem, U: UploadElem>(
    pass: Pass<'_>,
    base: usize,
    g: &[G],
    p: &mut [f32],
    ((mc, ms), (vc, vs)): Q8Pair<'_, [u8], [f32]>,
    mut up: Option<&mut [U]>,
) {
    let Pass { isa, c, key } = pass;
    let (mut gbuf, mut pend) = ([0.0f32; BLOCK], [Pending::new(), Pending::new()]);
    let mut w = up.is_some().then(Writer::new);
    let (mcb, mc_rest) = mc.as_chunks_mut::<Q8_BLOCK>();
    let (vcb, vc_rest) = vc.as_chunks_mut::<Q8_BLOCK>();
    // Whole blocks updated so far (the last of them still to be encoded).
    let mut updated = 0;
    for (i, (p, g)) in p.chunks_mut(BLOCK).zip(g.chunks(BLOCK)).enumerate() {
        let (lo, n) = (i * BLOCK, p.len());
        let g = G::widen(g, &mut gbuf);
        let (pb, p_rest) = p.as_chunks_mut::<Q8_BLOCK>();
        let (gb, g_rest) = g.as_chunks::<Q8_BLOCK>();
        for (p, g) in pb.iter_mut().zip(gb) {
            let b = updated;
            let (done_m, todo_m) = mcb.split_at_mut(b);
            let (done_v, todo_v) = vcb.split_at_mut(b);
            let (done_ms, todo_ms) = ms.split_at_mut(b);
            let (done_vs, todo_vs) = vs.split_at_mut(b);
            let [even, odd] = &mut pend;
            let (out, prev) = if b % 2 == 0 { (even, &*odd) } else { (odd, &*even) };
            let upd = Q8Update { g, p, m: (&todo_m[0], todo_ms[0]), v: (&todo_v[0], todo_vs[0]), out };
            let enc = b.checked_sub(1).map(|a| Q8Encode {
                new: prev,
                base: (base + a * Q8_BLOCK) as u32,
                m: (&mut done_m[a], &mut done_ms[a]),
                v: (&mut done_v[a], &mut done_vs[a]),
            });
            simd::q8_step(isa, key, Some((c, upd)), enc);
            updated += 1;
        }
        if !p_rest.is_empty() {
            // A partial block: the unit's last, so the chunk's last too.
            flush(pass, base, updated, &pend, ((mcb, ms), (vcb, vs)));
            let (at, b) = (updated * Q8_BLOCK, updated);
            let m = (&mut mc_rest[..p_rest.len()], &mut ms[b]);
            let v = (&mut vc_rest[..p_rest.len()], &mut vs[b]);
            q8_partial(pass, base + at, g_rest, p_rest, (m, v));
            updated = 0;
        }
        if let (Some(up), Some(w)) = (up.as_deref_mut(), w.as_mut()) {
            U::narrow_streaming(p, &mut up[lo..lo + n], w);
        }
    }
    flush(pass, base, updated, &pend, ((mcb, ms), (vcb, vs)));
}

/// `m`'s and `v`'s codes and steps (8-bit moments).
type Q8Pair<'a, C, S> = ((&'a mut C, &'a mut S), (&'a mut C, &'a mut S));

/// Encodes the last of `updated` whole blocks (none if 0), whose new moments wait in `pend`.
fn flush(
    pass: Pass<'_>,
    base: usize,
    updated: usize,
    pend: &[Pending; 2],
    ((mc, ms), (vc, vs)): Q8Pair<'_, [[u8; Q8_BLOCK]], [f32]>,
) {
    let Some(a) = updated.checked_sub(1) else { return };
    let enc = Q8Encode {
        new: &pend[a % 2],
        base: (base + a * Q8_BLOCK) as u32,
        m: (&mut mc[a], &mut ms[a]),
        v: (&mut vc[a], &mut vs[a]),
    };
    simd::q8_step(pass.isa, pass.key, None, Some(enc));
}

/// The update over a partial 8-bit block (`base` its first element's index in the unit): the
/// scalar definitions.
fn q8_partial(
    Pass { c, key, .. }: Pass<'_>,
    base: usize,
    g: &[f32],
    p: &mut [f32],
    ((mc, ms), (vc, vs)): Q8Pair<'_, [u8], f32>,
) {
    let (mut mbuf, mut vbuf) = ([0.0f32; Q8_BLOCK], [0.0f32; Q8_BLOCK]);
    let (m, v) = (&mut mbuf[..p.len()], &mut vbuf[..p.len()]);
    decode_m(mc, *ms, m);
    decode_v(vc, *vs, v);
    update_block_coded(c, g, p, m, v);
    *ms = encode_m(m, mc, key, base);
    *vs = encode_v(v, vc, key, base);
}

/// Splits the (length-checked) slices into [`CHUNK`]s and runs them on the rayon pool, on `isa`
/// ([`Isa::detect`]'s, but in tests).
pub(crate) fn run_coded<G: GradElem, U: UploadElem>(
    isa: Isa,
    c: &Coeffs,
    step: u64,
    g: &[G],
    p: &mut [f32],
    mom: Moments<'_>,
    up: Option<&mut [U]>,
) {
    let (chunks, key) = mom_chunks(mom, step);
    let pass = Pass { isa, c, key };
    let (p, g, mom) = (p.par_chunks_mut(CHUNK), g.par_chunks(CHUNK), chunks.into_par_iter());
    match up {
        Some(up) => (p, g, mom, up.par_chunks_mut(CHUNK))
            .into_par_iter()
            .enumerate()
            .for_each(|(k, (p, g, mom, u))| update_coded(pass, k * CHUNK, g, p, mom, Some(u))),
        None => (p, g, mom)
            .into_par_iter()
            .enumerate()
            .for_each(|(k, (p, g, mom))| update_coded::<G, U>(pass, k * CHUNK, g, p, mom, None)),
    }
}
