//! Device buffer pool: every long-lived buffer the step program uses on the compute device.
//!
//! - an N-deep ring of weight slots, each a flat 1-D tensor holding one decoder layer laid out by
//!   the layer [`mt_core::UnitLayout`] (templates bind views into it, no copy), and for a LoRA
//!   run's int8 or NF4 base the buffer its encoded bytes land in before their dequantisation into
//!   a slot;
//! - the outer slot (embedding, final norm, LM head), resident for a whole step;
//! - for each resident decoder layer (the first `resident_layers`, when the planner keeps them
//!   on the GPU): its own weight slot, fp32 gradient buffer and `[master | m | v]` state (fp32
//!   master, the moments as the store encodes them: `mt_core::StateDtype`; f32 words);
//! - a ring of layer gradient buffers (fp32 accumulation; two let one download while the next
//!   layer's backward accumulates) and the outer gradient buffer;
//! - the checkpoint store: the input of every layer for every token chunk (plus the head's
//!   input), the only memory that grows with the batch;
//! - the activation-gradient store: dL/dx at the current layer boundary for every chunk;
//! - state slots for the GPU-updated streamed layers (`ring_depth`, plus one per late state
//!   download; the step program takes them from a free list): a layer's `[master | m | v]`
//!   (as a resident layer's) and its stored gradient, uploaded from the host store, updated on
//!   the device and downloaded again.
//!
//! On the CPU backend all of it is plain memory behind the same interface.
//!
//! Architecture Invariant: the pool allocates and accounts; it knows nothing about streams or
//! about when a buffer may be reused. The step program (mt-sched) owns that ordering.
#![forbid(unsafe_code)]

use candle_core::{DType, Device, Tensor};
use mt_core::{Placement, StateDtype};

/// Errors of the pool.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Allocation or tensor error from candle.
    #[error("device buffer pool: {0}")]
    Candle(#[from] candle_core::Error),
    /// A checkpoint was read before being written (a scheduling bug).
    #[error("checkpoint for boundary {boundary}, chunk {chunk} is missing")]
    MissingCheckpoint {
        /// Layer boundary (input of layer `boundary`; `n_layers` = head input).
        boundary: usize,
        /// Token chunk.
        chunk: usize,
    },
    /// A requested configuration is invalid.
    #[error("invalid pool configuration: {0}")]
    Config(String),
}

/// Result alias.
pub type Result<T> = std::result::Result<T, Error>;

/// What to allocate.
#[derive(Debug, Clone)]
pub struct PoolSpec {
    /// Weight slots in the ring (1 disables overlap; 2 is double buffering).
    pub ring_depth: usize,
    /// Elements of one layer record.
    pub layer_len: usize,
    /// Elements of the outer record.
    pub outer_len: usize,
    /// Elements of a layer's and of the outer unit's gradient buffers: `layer_len` and
    /// `outer_len`, but only the adapters' of a LoRA run (its base is frozen: no gradient).
    pub grad_lens: (usize, usize),
    /// Weight dtype on the device.
    pub weight_dtype: DType,
    /// Gradient accumulation dtype on the device.
    pub grad_dtype: DType,
    /// Layer gradient buffers in their ring.
    pub n_grad_bufs: usize,
    /// Number of decoder layers (checkpoint boundaries = layers + 1).
    pub n_layers: usize,
    /// Token chunks per step.
    pub n_chunks: usize,
    /// Where the step keeps what. The pool reads three of its settings: `resident_outer` (the
    /// outer unit's fp32 master weights and AdamW moments on the device, `outer_state`),
    /// `resident_layers` (layers `0..k` get their own slot, gradient buffer and optimizer state,
    /// [`ResidentLayer`], instead of passing through the ring) and `held_layers` (the last `k`
    /// decoder layers, streamed ones, get their own weight slot, [`DevicePool::held`], from their
    /// forward to their backward); the state slots the GPU-updated layers need are
    /// `state_slots`, and the gradient buffers late downloads need `n_grad_bufs`.
    pub placement: Placement,
    /// Give every layer gradient buffer a bf16 twin ([`DevicePool::grad_narrow`]) that the
    /// gradient is narrowed into before its download (exact mode with bf16 store gradients: the
    /// host keeps bf16 anyway, so half the bytes cross PCIe and land).
    pub land_bf16: bool,
    /// State slots for GPU-updated streamed layers ([`DevicePool::state`]); 0 when none is.
    pub state_slots: usize,
    /// The dtype of the host store's gradient buffers, which a state slot's gradient keeps
    /// ([`DevicePool::state_grad`]; f32 or bf16).
    pub state_grad_dtype: DType,
    /// The moments' encoding, which every `[master | m | v]` keeps (the store's): a unit of `n`
    /// parameters takes [`StateDtype::state_words`]`(n)` f32 words.
    pub state_dtype: StateDtype,
    /// Bytes of a decoder layer's frozen base as uploaded encoded (a LoRA run's int8 or NF4
    /// base, [`DevicePool::base_scratch`]); 0 when nothing is.
    pub base_scratch: usize,
}

/// The device buffers of one resident decoder layer.
#[derive(Debug)]
pub struct ResidentLayer {
    /// Its weights (weight dtype, laid out like a ring slot).
    pub slot: Tensor,
    /// Its fp32 gradient accumulator.
    pub grad: Tensor,
    /// Its `[master | m | v]` (f32 words, [`StateDtype::state_words`] of `layer_len`).
    pub state: Tensor,
}

/// Bytes held by each kind of buffer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolBytes {
    /// Weight ring (with a LoRA run's base scratch, [`DevicePool::base_scratch`]).
    pub weight_ring: usize,
    /// Held layers' slots.
    pub held: usize,
    /// Outer slot.
    pub outer: usize,
    /// Layer and outer gradient buffers.
    pub grads: usize,
    /// Checkpoints currently held, and the reload buffers of spilled ones.
    pub checkpoints: usize,
    /// Activation gradients currently held.
    pub act_grads: usize,
    /// The resident outer unit's optimizer state (0 unless it is resident).
    pub outer_state: usize,
    /// Resident decoder layers: weights, gradients and optimizer state.
    pub resident_layers: usize,
    /// State slots of GPU-updated streamed layers: `[master | m | v]` and a stored gradient.
    pub state_slots: usize,
}

impl PoolBytes {
    /// Sum of all buffers.
    pub fn total(&self) -> usize {
        self.weight_ring
            + self.held
            + self.outer
            + self.grads
            + self.checkpoints
            + self.act_grads
            + self.outer_state
            + self.resident_layers
            + self.state_slots
    }
}

/// The pool. Buffers are public fields: the scheduler indexes them by slot/buffer number.
#[derive(Debug)]
pub struct DevicePool {
    /// Weight slot ring.
    pub slots: Vec<Tensor>,
    /// Outer slot.
    pub outer_slot: Tensor,
    /// Layer gradient buffer ring.
    pub grad_bufs: Vec<Tensor>,
    /// bf16 twins of `grad_bufs` (same index; empty unless [`PoolSpec::land_bf16`]).
    pub grad_narrow: Vec<Tensor>,
    /// Outer gradient buffer.
    pub outer_grad: Tensor,
    /// The resident outer unit's `[master | m | v]` (f32 words, [`StateDtype::state_words`] of
    /// `outer_len`), when the placement's `resident_outer`.
    pub outer_state: Option<Tensor>,
    /// Resident decoder layers `0..spec.placement.resident_layers`.
    pub resident: Vec<ResidentLayer>,
    /// Weight slots of the held layers `n_layers - held_layers..n_layers`, in layer order.
    pub held: Vec<Tensor>,
    /// State slots: a GPU-updated streamed layer's `[master | m | v]` (f32 words,
    /// [`StateDtype::state_words`] of `layer_len`), uploaded from its host record, updated in
    /// place and downloaded back.
    pub state: Vec<Tensor>,
    /// The stored gradient of the layer in `state[k]` (`layer_len`, the store's dtype).
    pub state_grad: Vec<Tensor>,
    /// Where a LoRA run's int8 or NF4 base lands, a layer at a time, encoded (u8), before it is
    /// dequantised into the slot (`PoolSpec::base_scratch` bytes; `None` when 0). One buffer:
    /// the uploads that fill it and the dequantisations that read it run in order on one stream.
    pub base_scratch: Option<Tensor>,
    /// Reload buffers of spilled checkpoints: `reload[slot][chunk]`, flat, in the weight dtype
    /// (allocated by [`DevicePool::ensure_reload`] for a step's chunk sizes).
    pub reload: Vec<Vec<Tensor>>,
    checkpoints: Vec<Vec<Option<Tensor>>>,
    act_grads: Vec<Option<Tensor>>,
    spec: PoolSpec,
}

fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

impl DevicePool {
    /// Allocates every fixed buffer on `device`.
    pub fn new(spec: &PoolSpec, device: &Device) -> Result<Self> {
        let p = &spec.placement;
        if p.resident_layers > spec.n_layers {
            return Err(Error::Config(format!(
                "{} resident layers of a {}-layer model",
                p.resident_layers, spec.n_layers
            )));
        }
        if p.resident_layers + p.held_layers > spec.n_layers {
            return Err(Error::Config(format!(
                "{} held layers beside {} resident ones of a {}-layer model",
                p.held_layers, p.resident_layers, spec.n_layers
            )));
        }
        if spec.ring_depth == 0 || spec.n_grad_bufs == 0 || spec.n_chunks == 0 {
            return Err(Error::Config(format!(
                "ring_depth ({}), n_grad_bufs ({}) and n_chunks ({}) must all be at least 1",
                spec.ring_depth, spec.n_grad_bufs, spec.n_chunks
            )));
        }
        if spec.state_slots > 0 && !matches!(spec.state_grad_dtype, DType::F32 | DType::BF16) {
            return Err(Error::Config(format!(
                "state slots keep the store's gradient in f32 or bf16, not {:?}",
                spec.state_grad_dtype
            )));
        }
        let slots = (0..spec.ring_depth)
            .map(|_| Tensor::zeros(spec.layer_len, spec.weight_dtype, device))
            .collect::<candle_core::Result<_>>()?;
        let grad_bufs = (0..spec.n_grad_bufs)
            .map(|_| Tensor::zeros(spec.grad_lens.0, spec.grad_dtype, device))
            .collect::<candle_core::Result<_>>()?;
        let narrow_bufs = if spec.land_bf16 { spec.n_grad_bufs } else { 0 };
        let grad_narrow = (0..narrow_bufs)
            .map(|_| Tensor::zeros(spec.grad_lens.0, DType::BF16, device))
            .collect::<candle_core::Result<_>>()?;
        Ok(DevicePool {
            slots,
            outer_slot: Tensor::zeros(spec.outer_len, spec.weight_dtype, device)?,
            grad_bufs,
            grad_narrow,
            outer_grad: Tensor::zeros(spec.grad_lens.1, spec.grad_dtype, device)?,
            outer_state: if p.resident_outer {
                Some(Tensor::zeros(spec.state_dtype.state_words(spec.outer_len), DType::F32, device)?)
            } else {
                None
            },
            resident: (0..p.resident_layers)
                .map(|_| -> candle_core::Result<_> {
                    Ok(ResidentLayer {
                        slot: Tensor::zeros(spec.layer_len, spec.weight_dtype, device)?,
                        grad: Tensor::zeros(spec.layer_len, spec.grad_dtype, device)?,
                        state: Tensor::zeros(
                            spec.state_dtype.state_words(spec.layer_len),
                            DType::F32,
                            device,
                        )?,
                    })
                })
                .collect::<candle_core::Result<_>>()?,
            held: (0..p.held_layers)
                .map(|_| Tensor::zeros(spec.layer_len, spec.weight_dtype, device))
                .collect::<candle_core::Result<_>>()?,
            state: (0..spec.state_slots)
                .map(|_| Tensor::zeros(spec.state_dtype.state_words(spec.layer_len), DType::F32, device))
                .collect::<candle_core::Result<_>>()?,
            state_grad: (0..spec.state_slots)
                .map(|_| Tensor::zeros(spec.layer_len, spec.state_grad_dtype, device))
                .collect::<candle_core::Result<_>>()?,
            base_scratch: match spec.base_scratch {
                0 => None,
                n => Some(Tensor::zeros(n, DType::U8, device)?),
            },
            reload: Vec::new(),
            checkpoints: vec![vec![None; spec.n_chunks]; spec.n_layers + 1],
            act_grads: vec![None; spec.n_chunks],
            spec: spec.clone(),
        })
    }

    /// The spec the pool was built from.
    pub fn spec(&self) -> &PoolSpec {
        &self.spec
    }

    /// Stores the input of layer `boundary` (or of the head, at `n_layers`) for `chunk`.
    pub fn put_checkpoint(&mut self, boundary: usize, chunk: usize, x: Tensor) {
        self.checkpoints[boundary][chunk] = Some(x);
    }

    /// The checkpoint of `boundary`/`chunk`.
    pub fn checkpoint(&self, boundary: usize, chunk: usize) -> Result<&Tensor> {
        self.checkpoints[boundary][chunk].as_ref().ok_or(Error::MissingCheckpoint { boundary, chunk })
    }

    /// Makes `slots` reload buffers of one flat tensor per chunk of `chunk_elems` elements (the
    /// weight dtype) on `device`, keeping those already of that shape; returns whether any was
    /// allocated (the caller then synchronises the device before a copy stream writes them).
    pub fn ensure_reload(&mut self, slots: usize, chunk_elems: &[usize], device: &Device) -> Result<bool> {
        let fits = |s: &Vec<Tensor>| s.iter().map(Tensor::elem_count).eq(chunk_elems.iter().copied());
        if self.reload.len() == slots && self.reload.iter().all(fits) {
            return Ok(false);
        }
        self.reload.clear();
        for _ in 0..slots {
            let bufs = chunk_elems
                .iter()
                .map(|&n| Tensor::zeros(n, self.spec.weight_dtype, device))
                .collect::<candle_core::Result<_>>()?;
            self.reload.push(bufs);
        }
        Ok(slots > 0)
    }

    /// Frees every checkpoint of a boundary once backward has consumed it.
    pub fn drop_checkpoints(&mut self, boundary: usize) {
        self.checkpoints[boundary].iter_mut().for_each(|c| *c = None);
    }

    /// Replaces the activation gradient of `chunk`.
    pub fn put_act_grad(&mut self, chunk: usize, g: Tensor) {
        self.act_grads[chunk] = Some(g);
    }

    /// Takes the activation gradient of `chunk`.
    pub fn take_act_grad(&mut self, chunk: usize) -> Option<Tensor> {
        self.act_grads[chunk].take()
    }

    /// Zeroes a gradient buffer in place (views of it stay valid). An empty buffer (a LoRA run's
    /// outer gradient: its embedding and head are frozen) is left alone: candle's CUDA fill
    /// launches one block per 1024 elements, and a launch of no blocks is an invalid argument.
    pub fn zero(buf: &Tensor) -> Result<()> {
        if buf.elem_count() > 0 {
            buf.zero_set()?;
        }
        Ok(())
    }

    /// Bytes currently held, by kind.
    pub fn bytes(&self) -> PoolBytes {
        let live = |v: &[Option<Tensor>]| v.iter().flatten().map(tensor_bytes).sum::<usize>();
        PoolBytes {
            weight_ring: self.slots.iter().chain(&self.base_scratch).map(tensor_bytes).sum(),
            held: self.held.iter().map(tensor_bytes).sum(),
            outer: tensor_bytes(&self.outer_slot),
            grads: self.grad_bufs.iter().chain(&self.grad_narrow).map(tensor_bytes).sum::<usize>()
                + tensor_bytes(&self.outer_grad),
            checkpoints: self.checkpoints.iter().map(|c| live(c)).sum::<usize>()
                + self.reload.iter().flatten().map(tensor_bytes).sum::<usize>(),
            act_grads: live(&self.act_grads),
            outer_state: self.outer_state.as_ref().map_or(0, tensor_bytes),
            resident_layers: self
                .resident
                .iter()
                .map(|r| tensor_bytes(&r.slot) + tensor_bytes(&r.grad) + tensor_bytes(&r.state))
                .sum(),
            state_slots: self.state.iter().chain(&self.state_grad).map(tensor_bytes).sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> PoolSpec {
        PoolSpec {
            ring_depth: 2,
            layer_len: 128,
            outer_len: 64,
            grad_lens: (128, 64),
            weight_dtype: DType::F32,
            grad_dtype: DType::F32,
            n_grad_bufs: 2,
            n_layers: 3,
            n_chunks: 2,
            placement: Placement::default(),
            land_bf16: false,
            state_slots: 0,
            state_grad_dtype: DType::BF16,
            state_dtype: StateDtype::F32,
            base_scratch: 0,
        }
    }

    /// [`spec`] with `resident_layers` resident and `held_layers` held layers.
    fn placed(resident_layers: usize, held_layers: usize) -> PoolSpec {
        PoolSpec { placement: Placement { resident_layers, held_layers, ..Placement::default() }, ..spec() }
    }

    #[test]
    fn allocates_and_accounts() {
        let mut p = DevicePool::new(&spec(), &Device::Cpu).unwrap();
        let b = p.bytes();
        assert_eq!(b.weight_ring, 2 * 128 * 4);
        assert_eq!(b.grads, (2 * 128 + 64) * 4);
        assert_eq!(b.checkpoints, 0);
        p.put_checkpoint(1, 1, Tensor::zeros((2, 3, 4), DType::F32, &Device::Cpu).unwrap());
        assert_eq!(p.bytes().checkpoints, 24 * 4);
        assert!(p.checkpoint(1, 1).is_ok());
        let err = p.checkpoint(1, 0).unwrap_err().to_string();
        assert!(err.contains("boundary 1, chunk 0"), "{err}");
        p.drop_checkpoints(1);
        assert_eq!(p.bytes().checkpoints, 0);
    }

    #[test]
    fn zeroing_is_in_place_and_visible_through_views() {
        let p = DevicePool::new(&spec(), &Device::Cpu).unwrap();
        let buf = &p.grad_bufs[0];
        buf.slice_set(&Tensor::ones(128, DType::F32, &Device::Cpu).unwrap(), 0, 0).unwrap();
        let view = buf.narrow(0, 10, 5).unwrap();
        assert_eq!(view.sum_all().unwrap().to_scalar::<f32>().unwrap(), 5.0);
        DevicePool::zero(buf).unwrap();
        assert_eq!(view.sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    }

    #[test]
    fn resident_layers_get_their_own_buffers() {
        let p = DevicePool::new(&placed(2, 0), &Device::Cpu).unwrap();
        assert_eq!(p.resident.len(), 2);
        assert_eq!(p.resident[1].state.dims(), [3 * 128]);
        assert_eq!(p.bytes().resident_layers, 2 * (128 * 4 + 128 * 4 + 3 * 128 * 4));
        let err = DevicePool::new(&placed(4, 0), &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("4 resident layers of a 3-layer model"), "{err}");
    }

    #[test]
    fn held_layers_get_a_slot_each_and_must_be_streamed_ones() {
        let p = DevicePool::new(&placed(1, 2), &Device::Cpu).unwrap();
        assert_eq!(p.held.len(), 2);
        assert_eq!(p.bytes().held, 2 * 128 * 4);
        let without = DevicePool::new(&placed(1, 0), &Device::Cpu).unwrap();
        assert_eq!(
            p.bytes().total() - without.bytes().total(),
            2 * 128 * 4,
            "held slots counted in the total"
        );
        let err = DevicePool::new(&placed(2, 2), &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("2 held layers beside 2 resident ones of a 3-layer model"), "{err}");
    }

    #[test]
    fn state_slots_hold_master_moments_and_the_stored_gradient() {
        let p = DevicePool::new(&PoolSpec { state_slots: 2, ..spec() }, &Device::Cpu).unwrap();
        assert_eq!(p.state.len(), 2);
        assert_eq!(p.state[1].dims(), [3 * 128]);
        assert_eq!(p.state_grad[0].dtype(), DType::BF16);
        assert_eq!(p.bytes().state_slots, 2 * (3 * 128 * 4 + 128 * 2));
        let err = DevicePool::new(
            &PoolSpec { state_slots: 1, state_grad_dtype: DType::F16, ..spec() },
            &Device::Cpu,
        )
        .unwrap_err();
        assert!(err.to_string().contains("f32 or bf16, not F16"), "{err}");
    }

    #[test]
    fn state_buffers_follow_the_moments_encoding() {
        for (states, bytes) in [(StateDtype::F32, 12), (StateDtype::Bf16, 8)] {
            let spec = PoolSpec {
                state_slots: 1,
                placement: Placement { resident_layers: 1, resident_outer: true, ..Placement::default() },
                state_dtype: states,
                ..spec()
            };
            let p = DevicePool::new(&spec, &Device::Cpu).unwrap();
            assert_eq!(p.state[0].elem_count() * 4, bytes * 128, "{states}");
            assert_eq!(p.resident[0].state.elem_count() * 4, bytes * 128, "{states}");
            assert_eq!(p.outer_state.as_ref().unwrap().elem_count() * 4, bytes * 64, "{states}");
        }
        let spec = PoolSpec { state_slots: 1, state_dtype: StateDtype::Int8, ..spec() };
        let p = DevicePool::new(&spec, &Device::Cpu).unwrap();
        assert_eq!(p.state[0].elem_count() * 4, 4 * 128 + 2 * (128 + 4), "master, codes, one scale each");
    }

    /// A LoRA run's int8 or NF4 base gets one scratch buffer of its encoded layer's bytes,
    /// counted with the weight ring.
    #[test]
    fn an_encoded_base_gets_one_scratch_buffer() {
        let p = DevicePool::new(&PoolSpec { base_scratch: 1000, ..spec() }, &Device::Cpu).unwrap();
        let scratch = p.base_scratch.as_ref().unwrap();
        assert_eq!((scratch.dtype(), scratch.elem_count()), (DType::U8, 1000));
        assert_eq!(p.bytes().weight_ring, 2 * 128 * 4 + 1000);
        assert!(DevicePool::new(&spec(), &Device::Cpu).unwrap().base_scratch.is_none());
    }

    #[test]
    fn zero_depth_ring_is_refused() {
        let err = DevicePool::new(&PoolSpec { ring_depth: 0, ..spec() }, &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("ring_depth (0)"));
    }
}
