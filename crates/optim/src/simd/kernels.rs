//! The body of the coded kernels, expanded once per instruction set (`avx2.rs`, `avx512.rs`)
//! over that module's lane types (`F`: f32 lanes, `I`: i32 lanes, `M`: a lane mask) and
//! operations, all compiled with its `#[target_feature]`. Every operation is the scalar
//! definition's (`adamw::update_block`, [`crate::moments`]) in its order, lane by lane, except
//! where a comment says why another one gives the same bits.

/// Expands the kernels for one instruction set; `$features` is its `#[target_feature]` list.
macro_rules! coded_kernels {
    ($features:literal) => {
        use mt_core::Q8_BLOCK;

        use crate::adamw::Coeffs;
        use crate::moments::{block_inverse, M_TOP, V_TOP};

        /// `1 − 2⁻⁹`: scales the estimate of a code below the exact root (see `code_m`).
        const EST_LOW: f32 = 1.0 - 1.0 / 512.0;
        /// `2⁻²⁴`: a draw's top 24 bits as a fraction of 1 (`moments::unit_float`).
        const TWO_M24: f32 = 1.0 / 16_777_216.0;

        /// [`Coeffs`] in every lane.
        #[derive(Clone, Copy)]
        struct Lanes {
            grad_scale: F,
            decay: F,
            lerp_small: bool,
            lerp_coeff: F,
            beta2: F,
            one_minus_beta2: F,
            bc2_sqrt: F,
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
                bc2_sqrt: splat(c.bc2_sqrt),
                eps: splat(c.eps),
                step_size: splat(c.step_size),
            }
        }

        /// `adamw::update_block` on one vector: returns the new master, `m` and `v`.
        #[inline]
        #[target_feature(enable = $features)]
        fn adam(c: &Lanes, g: F, p: F, m: F, v: F) -> (F, F, F) {
            let g = mul(g, c.grad_scale);
            let base = if c.lerp_small { m } else { g };
            let m_new = add(base, mul(c.lerp_coeff, sub(g, m)));
            let v_new = add(mul(v, c.beta2), mul(mul(c.one_minus_beta2, g), g));
            let denom = add(div(sqrt(v_new), c.bc2_sqrt), c.eps);
            let p_new = sub(mul(p, c.decay), div(mul(c.step_size, m_new), denom));
            (p_new, m_new, v_new)
        }

        /// `moments::mix32` in every lane.
        #[inline]
        #[target_feature(enable = $features)]
        fn mix32(h: I) -> I {
            let h = xor(h, srl::<16>(h));
            let h = mullo(h, splat_i(0x85eb_ca6b));
            let h = xor(h, srl::<13>(h));
            let h = mullo(h, splat_i(0xc2b2_ae35));
            xor(h, srl::<16>(h))
        }

        /// `moments::bf16_sr` in every lane: the bf16 bits in the low half of each lane.
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

        /// `moments::code_m` in every lane. `lo` is found from below: the estimate
        /// `e = 1/rsqrt(y)·(1 − 2⁻⁹)` (each approximation within `1.5·2⁻¹²` relative, the
        /// instruction sets' bound) lies in `[√y − 0.35, √y)` for every `y <= 127²(1 + 2⁻²³)`,
        /// so `floor(e)` is the exact `lo` or one less, and one comparison with `(k+1)²` (exact)
        /// settles it. `0 <= y`: `rsqrt(0) = ∞` and `1/∞ = 0`. `u·(2lo + 1)` is computed as
        /// `(h >> 8)·((2lo + 1)·2⁻²⁴)`: the same real product (both factors exact), so the
        /// same rounding.
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
            let d = add(mul(lo, splat(2.0 * TWO_M24)), splat(TWO_M24));
            let u_d = mul(to_f(srl::<8>(h)), d);
            let q = to_i(select(lt(u_d, t), add(lo, one), lo));
            select_i(lt(x, zero), sub_i(splat_i(0), q), q)
        }

        /// `moments::fourth` in every lane.
        #[inline]
        #[target_feature(enable = $features)]
        fn fourth(k: F) -> F {
            let k2 = mul(k, k);
            mul(k2, k2)
        }

        /// `moments::code_v` in every lane. As in `code_m`, `lo` is found from below:
        /// `e = rsqrt(rsqrt(y))·(1 − 2⁻⁹)` lies in `[y^¼ − 0.65, y^¼)` for every
        /// `y <= 255⁴(1 + 2⁻²³)`, so `floor(e)` is `lo` or one less: `lo` exceeds `floor(y^¼)`
        /// only where `fourth` rounded `k⁴` down to an f32 `y < k⁴`, and then `e >= k − 1`.
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
            let u = mul(to_f(srl::<8>(h)), splat(TWO_M24));
            let up = lt(mul(u, sub(t_hi, t_lo)), sub(y, t_lo));
            to_i(select(up, add(lo, one), lo))
        }

        /// See [`super::bf16_span`].
        #[target_feature(enable = $features)]
        pub(super) fn bf16_span(
            c: &Coeffs,
            keys: [u32; 2],
            base: u32,
            g: &[f32],
            p: &mut [f32],
            m: &mut [u16],
            v: &mut [u16],
        ) -> usize {
            let c = lanes(c);
            let (km, kv) = (splat_i(keys[0]), splat_i(keys[1]));
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
                store_u16(m, bf16_sr(m1, mix32(xor(idx, km))));
                store_u16(v, bf16_sr(v1, mix32(xor(idx, kv))));
                idx = add_i(idx, splat_i(L as u32));
                done += L;
            }
            done
        }

        /// See [`super::q8_block`]. Two passes over the block: decode, update and the block's
        /// largest `|m|` and `v` (the new moments kept in L1), then the codes.
        #[target_feature(enable = $features)]
        pub(super) fn q8_block(
            c: &Coeffs,
            keys: [u32; 2],
            base: u32,
            g: &[f32; Q8_BLOCK],
            p: &mut [f32; Q8_BLOCK],
            (mc, ms): (&mut [u8; Q8_BLOCK], &mut f32),
            (vc, vs): (&mut [u8; Q8_BLOCK], &mut f32),
        ) {
            let c = lanes(c);
            let (g, _) = g.as_chunks::<L>();
            let (p, _) = p.as_chunks_mut::<L>();
            let (mc, _) = mc.as_chunks_mut::<L>();
            let (vc, _) = vc.as_chunks_mut::<L>();
            let mut mn = [[0.0f32; L]; Q8_BLOCK / L];
            let mut vn = [[0.0f32; L]; Q8_BLOCK / L];
            let (sm, sv) = (splat(*ms), splat(*vs));
            let (mut am, mut vm) = (splat(0.0), splat(0.0));
            for k in 0..Q8_BLOCK / L {
                // moments::decode_m and decode_v.
                let a = to_f(load_i8(&mc[k]));
                let m0 = mul(mul(a, abs(a)), sm);
                let a = to_f(load_u8(&vc[k]));
                let a2 = mul(a, a);
                let v0 = mul(mul(a2, a2), sv);
                let (p1, m1, v1) = adam(&c, load(&g[k]), load(&p[k]), m0, v0);
                store(&mut p[k], p1);
                store(&mut mn[k], m1);
                store(&mut vn[k], v1);
                // max(x, acc) keeps acc where x is NaN: moments::block_max ignores NaNs too.
                am = max(abs(m1), am);
                vm = max(v1, vm);
            }
            let (am, vm) = (hmax(am), hmax(vm));
            (*ms, *vs) = (am / M_TOP, vm / V_TOP);
            let inv_m = splat(block_inverse(*ms, am, M_TOP));
            let inv_v = splat(block_inverse(*vs, vm, V_TOP));
            let (km, kv) = (splat_i(keys[0]), splat_i(keys[1]));
            let mut idx = add_i(splat_i(base), iota());
            for k in 0..Q8_BLOCK / L {
                store_u8(&mut mc[k], code_m(load(&mn[k]), inv_m, mix32(xor(idx, km))));
                store_u8(&mut vc[k], code_v(load(&vn[k]), inv_v, mix32(xor(idx, kv))));
                idx = add_i(idx, splat_i(L as u32));
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
