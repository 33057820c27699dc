//! The body of the coded kernels, expanded once per instruction set (`avx2.rs`, `avx512.rs`)
//! over that module's lane types (`F`: f32 lanes, `I`: i32 lanes, `M`: a lane mask) and
//! operations, all compiled with its `#[target_feature]`. Every operation is the scalar
//! definition's (`coded::update_block_coded`, [`crate::moments`]) in its order, lane by lane,
//! except where a comment says why another one gives the same bits.

/// Expands the kernels for one instruction set; `$features` is its `#[target_feature]` list.
macro_rules! coded_kernels {
    ($features:literal) => {
        use mt_core::Q8_BLOCK;

        use super::{Q8Encode, Q8Update};
        use crate::adamw::Coeffs;
        use crate::moments::{block_inverse, M_TOP, V_TOP};

        /// `1 − 2⁻⁹`: scales the estimate of a code below the exact root (see `code_m`).
        const EST_LOW: f32 = 1.0 - 1.0 / 512.0;
        /// `2⁻¹⁶`: 16 bits of a draw as a fraction of 1 (`moments::unit16`).
        const TWO_M16: f32 = 1.0 / 65_536.0;
        /// Vectors in an 8-bit block.
        const VB: usize = Q8_BLOCK / L;

        /// [`Coeffs`] in every lane, and `1 / bc2_sqrt` (`coded::update_block_coded`).
        #[derive(Clone, Copy)]
        struct Lanes {
            grad_scale: F,
            decay: F,
            lerp_small: bool,
            lerp_coeff: F,
            beta2: F,
            one_minus_beta2: F,
            inv_bc2: F,
            eps: F,
            step_size: F,
        }

        #[inline]
        #[target_feature(enable = $features)]
        fn lanes(c: &Coeffs) -> Lanes {
            Lanes {
                grad_scale: splat(c.grad_scale),
                decay: splat(c.decay),
                lerp_small: c.lerp_small,
                lerp_coeff: splat(c.lerp_coeff),
                beta2: splat(c.beta2),
                one_minus_beta2: splat(c.one_minus_beta2),
                inv_bc2: splat(1.0 / c.bc2_sqrt),
                eps: splat(c.eps),
                step_size: splat(c.step_size),
            }
        }

        /// `coded::update_block_coded` on one vector: returns the new master, `m` and `v`.
        #[inline]
        #[target_feature(enable = $features)]
        fn adam(c: &Lanes, g: F, p: F, m: F, v: F) -> (F, F, F) {
            let g = mul(g, c.grad_scale);
            let base = if c.lerp_small { m } else { g };
            let m_new = add(base, mul(c.lerp_coeff, sub(g, m)));
            let v_new = add(mul(v, c.beta2), mul(mul(c.one_minus_beta2, g), g));
            let denom = add(mul(sqrt(v_new), c.inv_bc2), c.eps);
            let p_new = sub(mul(p, c.decay), div(mul(c.step_size, m_new), denom));
            (p_new, m_new, v_new)
        }

        /// `moments::draw` in every lane: `mix32(idx ^ key)`.
        #[inline]
        #[target_feature(enable = $features)]
        fn draw(idx: I, key: I) -> I {
            let h = xor(idx, key);
            let h = xor(h, srl::<16>(h));
            let h = mullo(h, splat_i(0x85eb_ca6b));
            let h = xor(h, srl::<13>(h));
            let h = mullo(h, splat_i(0xc2b2_ae35));
            xor(h, srl::<16>(h))
        }

        /// `moments::bf16_sr` in every lane, rounding with the low 16 bits of `r`: the bf16 bits
        /// in the low half of each lane.
        #[inline]
        #[target_feature(enable = $features)]
        fn bf16_sr(x: F, r: I) -> I {
            let b = bits(x);
            let rounded = srl::<16>(add_i(b, and(r, splat_i(0xFFFF))));
            let quiet = or(srl::<16>(b), splat_i(0x40));
            // After the mask the lane is below 2³¹, so the signed comparison is the unsigned one.
            let nan = gt_i(and(b, splat_i(0x7FFF_FFFF)), splat_i(0x7F80_0000));
            select_i(nan, quiet, rounded)
        }

        /// `moments::code_m` in every lane, with the draw's low 16 bits (`moments::m_bits`).
        /// `lo` is found from below: the estimate `e = 1/rsqrt(y)·(1 − 2⁻⁹)` (each
        /// approximation within `1.5·2⁻¹²` relative, the instruction sets' bound) lies in
        /// `[√y − 0.35, √y)` for every `y <= 127²(1 + 2⁻²³)`, so `floor(e)` is the exact `lo` or
        /// one less, and one comparison with `(k+1)²` (exact) settles it. `0 <= y`:
        /// `rsqrt(0) = ∞` and `1/∞ = 0`. `u·(2lo + 1)` is computed as `r·((2lo + 1)·2⁻¹⁶)`:
        /// the same real product (both factors exact, and it is below 2⁸ with 24 bits: exact).
        #[inline]
        #[target_feature(enable = $features)]
        fn code_m(x: F, inv: F, h: I) -> I {
            let (zero, one) = (splat(0.0), splat(1.0));
            // max(NaN, 0) is the second operand: a NaN scales to 0, as f32::max gives.
            let y = max(mul(abs(x), inv), zero);
            let e = mul(rcp_est(rsqrt_est(y)), splat(EST_LOW));
            let k = min(floor(e), splat(125.0));
            let k1 = add(k, one);
            let lo = select(le(mul(k1, k1), y), k1, k);
            let t = sub(y, mul(lo, lo));
            let d = add(mul(lo, splat(2.0 * TWO_M16)), splat(TWO_M16));
            let u_d = mul(to_f(and(h, splat_i(0xFFFF))), d);
            // The code's magnitude, one more where the draw says up; then `x`'s sign (`q` is 0
            // wherever `x` is ±0 or NaN, so the sign bit and `x < 0` agree on every other lane).
            negate_where_negative(inc_where(lt(u_d, t), to_i(lo)), x)
        }

        /// `moments::fourth` in every lane.
        #[inline]
        #[target_feature(enable = $features)]
        fn fourth(k: F) -> F {
            let k2 = mul(k, k);
            mul(k2, k2)
        }

        /// `moments::code_v` in every lane, with the draw's high 16 bits (`moments::v_bits`). As
        /// in `code_m`, `lo` is found from below: `e = rsqrt(rsqrt(y))·(1 − 2⁻⁹)` lies in
        /// `[y^¼ − 0.65, y^¼)` for every `y <= 255⁴(1 + 2⁻²³)`, so `floor(e)` is `lo` or one
        /// less: `lo` exceeds `floor(y^¼)` only where `fourth` rounded `k⁴` down to an f32
        /// `y < k⁴`, and then `e >= k − 1`.
        #[inline]
        #[target_feature(enable = $features)]
        fn code_v(x: F, inv: F, h: I) -> I {
            let (zero, one) = (splat(0.0), splat(1.0));
            let y = max(mul(x, inv), zero);
            let e = mul(rsqrt_est(rsqrt_est(y)), splat(EST_LOW));
            let k = min(floor(e), splat(253.0));
            let k1 = add(k, one);
            let lo = select(le(fourth(k1), y), k1, k);
            let (t_lo, t_hi) = (fourth(lo), fourth(add(lo, one)));
            let u = mul(to_f(srl::<16>(h)), splat(TWO_M16));
            inc_where(lt(mul(u, sub(t_hi, t_lo)), sub(y, t_lo)), to_i(lo))
        }

        /// See [`super::bf16_span`].
        #[target_feature(enable = $features)]
        pub(super) fn bf16_span(
            (c, key, base): (&Coeffs, u32, u32),
            g: &[f32],
            p: &mut [f32],
            (m, v): (&mut [u16], &mut [u16]),
        ) -> usize {
            let c = lanes(c);
            let key = splat_i(key);
            let (g, _) = g.as_chunks::<L>();
            let (p, _) = p.as_chunks_mut::<L>();
            let (m, _) = m.as_chunks_mut::<L>();
            let (v, _) = v.as_chunks_mut::<L>();
            let mut idx = add_i(splat_i(base), iota());
            let mut done = 0;
            for (((g, p), m), v) in g.iter().zip(p.iter_mut()).zip(m.iter_mut()).zip(v.iter_mut()) {
                let m0 = from_bits(sll::<16>(load_u16(m)));
                let v0 = from_bits(sll::<16>(load_u16(v)));
                let (p1, m1, v1) = adam(&c, load(g), load(p), m0, v0);
                store(p, p1);
                let h = draw(idx, key);
                store_u16(m, bf16_sr(m1, h));
                store_u16(v, bf16_sr(v1, srl::<16>(h)));
                idx = add_i(idx, splat_i(L as u32));
                done += L;
            }
            done
        }

        /// An update's decoding steps and running maxima.
        struct Dec {
            sm: F,
            sv: F,
            am: F,
            vm: F,
        }

        /// Vector `k` of an 8-bit block's update: decoded (`moments::decode_m`, `decode_v`),
        /// updated, the new moments kept for the encoding and folded into the block's maxima.
        #[inline]
        #[target_feature(enable = $features)]
        fn update_vector(c: &Lanes, u: &mut Q8Update<'_>, d: &mut Dec, k: usize) {
            let a = to_f(load_i8(&u.m.0.as_chunks::<L>().0[k]));
            let m0 = mul(mul(a, abs(a)), d.sm);
            let a = to_f(load_u8(&u.v.0.as_chunks::<L>().0[k]));
            let a2 = mul(a, a);
            let v0 = mul(mul(a2, a2), d.sv);
            let p = &mut u.p.as_chunks_mut::<L>().0[k];
            let (p1, m1, v1) = adam(c, load(&u.g.as_chunks::<L>().0[k]), load(p), m0, v0);
            store(p, p1);
            store(&mut u.out.m.as_chunks_mut::<L>().0[k], m1);
            store(&mut u.out.v.as_chunks_mut::<L>().0[k], v1);
            // max(x, acc) keeps acc where x is NaN: moments::block_max ignores NaNs too.
            d.am = max(abs(m1), d.am);
            d.vm = max(v1, d.vm);
        }

        /// An encoding's inverse steps, key and element indices.
        struct Enc {
            inv_m: F,
            inv_v: F,
            key: I,
            idx: I,
        }

        /// Vector `k` of an 8-bit block's encoding.
        #[inline]
        #[target_feature(enable = $features)]
        fn encode_vector(e: &mut Q8Encode<'_>, s: &mut Enc, k: usize) {
            let h = draw(s.idx, s.key);
            let m = load(&e.new.m.as_chunks::<L>().0[k]);
            let v = load(&e.new.v.as_chunks::<L>().0[k]);
            store_u8(&mut e.m.0.as_chunks_mut::<L>().0[k], code_m(m, s.inv_m, h));
            store_u8(&mut e.v.0.as_chunks_mut::<L>().0[k], code_v(v, s.inv_v, h));
            s.idx = add_i(s.idx, splat_i(L as u32));
        }

        /// See [`super::q8_step`]. With both an update and an encoding, one loop interleaves
        /// them vector by vector: the update waits on its division and square root, the encoding
        /// on everything else, and out-of-order execution overlaps the two.
        #[target_feature(enable = $features)]
        pub(super) fn q8_step(key: u32, upd: Option<(&Coeffs, Q8Update<'_>)>, enc: Option<Q8Encode<'_>>) {
            let mut upd = upd.map(|(c, u)| {
                let d = Dec { sm: splat(u.m.1), sv: splat(u.v.1), am: splat(0.0), vm: splat(0.0) };
                (lanes(c), u, d)
            });
            let mut enc = enc.map(|e| {
                let (sm, sv) = (e.new.am / M_TOP, e.new.vm / V_TOP);
                let s = Enc {
                    inv_m: splat(block_inverse(sm, e.new.am, M_TOP)),
                    inv_v: splat(block_inverse(sv, e.new.vm, V_TOP)),
                    key: splat_i(key),
                    idx: add_i(splat_i(e.base), iota()),
                };
                (*e.m.1, *e.v.1) = (sm, sv);
                (e, s)
            });
            match (&mut upd, &mut enc) {
                (Some((c, u, d)), Some((e, s))) => {
                    for k in 0..VB {
                        update_vector(c, u, d, k);
                        encode_vector(e, s, k);
                    }
                }
                (Some((c, u, d)), None) => {
                    for k in 0..VB {
                        update_vector(c, u, d, k);
                    }
                }
                (None, Some((e, s))) => {
                    for k in 0..VB {
                        encode_vector(e, s, k);
                    }
                }
                (None, None) => {}
            }
            if let Some((_, u, d)) = upd {
                (u.out.am, u.out.vm) = (hmax(d.am), hmax(d.vm));
            }
        }

        /// See [`super::codes`].
        #[cfg(test)]
        #[target_feature(enable = $features)]
        pub(super) fn codes(x: &[f32], inv: f32, h: &[u32], m: &mut [u8], v: &mut [u8]) -> usize {
            let inv = splat(inv);
            let (x, _) = x.as_chunks::<L>();
            let (h, _) = h.as_chunks::<L>();
            let (m, _) = m.as_chunks_mut::<L>();
            let (v, _) = v.as_chunks_mut::<L>();
            let mut done = 0;
            for (((x, h), m), v) in x.iter().zip(h).zip(m.iter_mut()).zip(v.iter_mut()) {
                store_u8(m, code_m(load(x), inv, load_u32(h)));
                store_u8(v, code_v(load(x), inv, load_u32(h)));
                done += L;
            }
            done
        }
    };
}

pub(super) use coded_kernels;
