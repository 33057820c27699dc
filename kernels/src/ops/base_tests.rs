//! The base dequantisation kernels bitwise against mt-store's reference decoding, on a CUDA
//! device (run on the GPU machine: `cargo test -p mt-kernels --features cuda --lib`; not part of
//! the CPU suite, which checks the kernels' logic on the emulator: `kernels/emu/run_base.sh`).

use candle_core::{DType, Device, Tensor};
use half::bf16;
use mt_core::{BaseDtype, ModelConfig, ModelLayout, Unit, BASE_BLOCK};
use mt_store::base_codec::{decode, encode, Decoded};
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::decode_base;

/// Every base dtype's decoder layer (int8 and NF4 matrices with bf16 norms whose padding is
/// encoded with them; fp32; bf16) and outer unit, random weights of several magnitudes, decoded
/// into a bf16 and an f32 slot by the kernels: bitwise the reference, padding included.
#[test]
fn base_dequantisation_is_bitwise_the_reference() {
    let dev = Device::new_cuda(0).expect("this test needs a CUDA device");
    let Device::Cuda(cuda) = &dev else { unreachable!("a CUDA device") };
    let stream = cuda.cuda_stream();
    // Norms 96 wide: padded to 128, so a bf16 segment carries padding.
    let cfg =
        ModelConfig { hidden_size: 96, intermediate_size: 200, head_dim: 24, ..ModelConfig::tiny_llama() };
    let layout = ModelLayout::new(&cfg);
    let mut rng = StdRng::seed_from_u64(35);
    for dtype in BaseDtype::ALL {
        for u in [Unit::Outer, Unit::Layer(1)] {
            let n = layout.unit(u).len;
            // Each tensor's values (its padding zero) at a random magnitude, encoded segment by
            // segment.
            let mut values = vec![0f32; n];
            for t in &layout.unit(u).tensors {
                let scale = 10f32.powi(rng.random_range(-3..=2));
                values[t.offset..t.offset + t.numel()]
                    .iter_mut()
                    .for_each(|x| *x = rng.random_range(-1.0f32..1.0) * scale);
            }
            let enc = dtype.encoding(layout.unit(u), u);
            let mut bytes = vec![0u8; enc.bytes];
            let (mut want_f, mut want_b) = (vec![0f32; n], vec![bf16::ZERO; n]);
            for s in &enc.segments {
                let (elems, at) = (s.start..s.start + s.len, s.byte_range());
                assert_eq!(s.len % BASE_BLOCK, 0);
                encode(s.code, &values[elems.clone()], &mut bytes[at.clone()]);
                decode(s.code, &bytes[at.clone()], Decoded::F32(&mut want_f[elems.clone()]));
                decode(s.code, &bytes[at], Decoded::Bf16(&mut want_b[elems]));
            }
            let src = Tensor::from_slice(&bytes, bytes.len(), &dev).unwrap();
            for out in [DType::BF16, DType::F32] {
                // A slot with adapters after the base: left as they were.
                let dst = Tensor::ones(n + 100, out, &dev).unwrap();
                decode_base(&stream, &src, &dst, &enc.segments).unwrap();
                stream.synchronize().unwrap();
                let got = dst.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
                let want: Vec<f32> = match out {
                    DType::BF16 => want_b.iter().map(|x| x.to_f32()).collect(),
                    _ => want_f.clone(),
                };
                let diff = got[..n].iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits());
                assert_eq!(diff, None, "{dtype} {u:?} into {out:?}: element {diff:?} differs");
                assert!(got[n..].iter().all(|x| *x == 1.0), "{dtype} {u:?}: wrote past the base");
            }
        }
    }
}
