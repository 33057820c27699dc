//! Lean mode's fused pass: the landed gradient stored, its sum of squares taken and AdamW applied
//! from it, in one pass over memory. It combines [`crate::adamw`]'s update with [`crate::norm`]'s
//! sum of squares, so that neither of those modules needs the other.

use rayon::prelude::*;

use crate::adamw::{checked, update_chunk, AdamW, Coeffs, StepArgs, Upload, UploadElem, CHUNK};
use crate::coded::{mom_chunks, update_coded};
use crate::error::Error;
use crate::moments::Moments;
use crate::norm::chunk_sum_squares;
use crate::simd::{streaming::Writer, Isa, Pass};

/// Lean mode's land and update in one pass over memory: stores the landed f32 gradient into
/// `stored` (rounded to its type; `Upload::None` stores nothing), returns the sum of squares of
/// `landed` (bitwise [`crate::sum_squares`] of it: same chunks, same order) and applies AdamW
/// from `landed` to `master` and the moments (bitwise [`step_fused`] with `Grad::F32(landed)`
/// and no upload). The separate passes read the landed gradient three times; this reads it once.
///
/// # Errors
/// As [`step_fused`]; nothing is written when an error is returned.
pub fn land_and_step(
    h: &AdamW,
    a: &StepArgs,
    landed: &[f32],
    stored: Upload<'_>,
    master: &mut [f32],
    moments: Moments<'_>,
) -> Result<f64, Error> {
    let c = checked(h, a, master.len(), landed.len(), &moments, ("stored gradient", stored.len()))?;
    let (m, v) = match moments {
        Moments::F32 { m, v } => (m, v),
        coded => return Ok(land_coded(&c, a.step, landed, stored, master, coded)),
    };
    fn go<U: UploadElem>(
        c: &Coeffs,
        g: &[f32],
        st: &mut [U],
        p: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
    ) -> Vec<f64> {
        let chunks = (p.par_chunks_mut(CHUNK), m.par_chunks_mut(CHUNK), v.par_chunks_mut(CHUNK));
        (chunks.0, chunks.1, chunks.2, g.par_chunks(CHUNK), st.par_chunks_mut(CHUNK))
            .into_par_iter()
            .map(|(p, m, v, g, st)| {
                U::narrow_streaming(g, st, &mut Writer::new());
                let ss = chunk_sum_squares(g, |x| x);
                update_chunk::<f32, f32>(c, g, p, m, v, None);
                ss
            })
            .collect()
    }
    let partials = match stored {
        Upload::None => (master.par_chunks_mut(CHUNK), m.par_chunks_mut(CHUNK), v.par_chunks_mut(CHUNK))
            .into_par_iter()
            .zip(landed.par_chunks(CHUNK))
            .map(|((p, m, v), g)| {
                let ss = chunk_sum_squares(g, |x| x);
                update_chunk::<f32, f32>(&c, g, p, m, v, None);
                ss
            })
            .collect(),
        Upload::F32(st) => go(&c, landed, st, master, m, v),
        Upload::Bf16(st) => go(&c, landed, st, master, m, v),
        Upload::F16(st) => go(&c, landed, st, master, m, v),
    };
    Ok(partials.iter().fold(0.0, |acc, s| acc + s))
}

/// [`land_and_step`] over bf16 or 8-bit moments: the same chunks and order (so the same sum of
/// squares), the update of [`crate::coded`].
fn land_coded(
    c: &Coeffs,
    step: u64,
    landed: &[f32],
    stored: Upload<'_>,
    master: &mut [f32],
    mom: Moments<'_>,
) -> f64 {
    fn go<U: UploadElem>(
        c: &Coeffs,
        step: u64,
        g: &[f32],
        st: Option<&mut [U]>,
        p: &mut [f32],
        mom: Moments<'_>,
    ) -> Vec<f64> {
        let (chunks, key) = mom_chunks(mom, step);
        let isa = Isa::detect();
        let one = |k: usize, p: &mut [f32], g: &[f32], mom, st: Option<&mut [U]>| {
            if let Some(st) = st {
                U::narrow_streaming(g, st, &mut Writer::new());
            }
            let ss = chunk_sum_squares(g, |x| x);
            update_coded::<f32, f32>(Pass { isa, c, key }, k * CHUNK, g, p, mom, None);
            ss
        };
        let (p, gc, mc) = (p.par_chunks_mut(CHUNK), g.par_chunks(CHUNK), chunks.into_par_iter());
        match st {
            Some(st) => (p, gc, mc, st.par_chunks_mut(CHUNK))
                .into_par_iter()
                .enumerate()
                .map(|(k, (p, g, mom, st))| one(k, p, g, mom, Some(st)))
                .collect(),
            None => (p, gc, mc)
                .into_par_iter()
                .enumerate()
                .map(|(k, (p, g, mom))| one(k, p, g, mom, None))
                .collect(),
        }
    }
    let partials = match stored {
        Upload::None => go::<f32>(c, step, landed, None, master, mom),
        Upload::F32(st) => go(c, step, landed, Some(st), master, mom),
        Upload::Bf16(st) => go(c, step, landed, Some(st), master, mom),
        Upload::F16(st) => go(c, step, landed, Some(st), master, mom),
    };
    partials.iter().fold(0.0, |acc, s| acc + s)
}
