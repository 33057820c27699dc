//! Gradient accumulation straight into a unit's flat gradient buffer (f32 or f64), laid out by
//! the same `UnitLayout` as the weight slot. The sink only ever adds: a second backward over
//! the same buffer accumulates, which is how chunks and micro-batches sum to the step gradient.

use candle_core::{DType, Tensor};
use mt_core::UnitLayout;

use crate::{Error, Result};

/// Adds gradients into `buf[offset .. offset + numel]` of each named tensor, in place (the
/// write goes through the buffer's storage, so every view of it sees the new values).
#[derive(Debug, Clone, Copy)]
pub struct GradSink<'a> {
    layout: &'a UnitLayout,
    buf: &'a Tensor,
    /// Names the layout lacks are frozen parameters ([`GradSink::trainable`]), not mistakes.
    frozen_absent: bool,
}

impl<'a> GradSink<'a> {
    /// Wraps `buf`: a contiguous 1-D f32 or f64 tensor of at least `layout.len` elements.
    pub fn new(layout: &'a UnitLayout, buf: &'a Tensor) -> Result<Self> {
        if !matches!(buf.dtype(), DType::F32 | DType::F64) {
            return Err(Error::dtype("gradient buffer", "f32 or f64", buf.dtype()));
        }
        let found = match buf.dims() {
            [n] => *n,
            dims => return Err(Error::shape("gradient buffer", "1-D", dims)),
        };
        if !buf.is_contiguous() {
            return Err(Error::shape("gradient buffer", "a contiguous tensor", buf.dims()));
        }
        if found < layout.len {
            return Err(Error::SlotTooShort { what: "gradient buffer", expected: layout.len, found });
        }
        Ok(GradSink { layout, buf, frozen_absent: false })
    }

    /// A sink over the layout of what trains (`ModelLayout::trainable`: a LoRA layer's
    /// adapters): a parameter it does not hold is frozen, and accumulating its gradient does
    /// nothing — the gradient is not even formed (no `dyᵀ x` product for a frozen weight).
    pub fn trainable(layout: &'a UnitLayout, buf: &'a Tensor) -> Result<Self> {
        Ok(GradSink { frozen_absent: true, ..Self::new(layout, buf)? })
    }

    /// `name`'s place in the layout; `None` for a frozen parameter of a [`GradSink::trainable`]
    /// sink; an unknown name is an error otherwise.
    fn spec(&self, name: &str) -> Result<Option<&'a mt_core::TensorSpec>> {
        match self.layout.get(name) {
            Ok(s) => Ok(Some(s)),
            Err(_) if self.frozen_absent => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The buffer's dtype (gradients are converted to it before they are added).
    pub fn dtype(&self) -> DType {
        self.buf.dtype()
    }

    /// `buf[name] += g`, with `g` of exactly the tensor's shape in the layout (any float dtype;
    /// an f64 `g` into an f32 buffer is added in f64, so the sum is rounded once).
    pub fn accumulate(&self, name: &str, g: &Tensor) -> Result<()> {
        let Some(spec) = self.spec(name)? else { return Ok(()) };
        if g.dims() != spec.shape.as_slice() {
            return Err(Error::shape(format!("gradient of {name}"), format!("{:?}", spec.shape), g.dims()));
        }
        self.add_at(spec.offset, spec.numel(), g)
    }

    /// `buf[offset .. offset + n] += g` (`g` of `n` elements, any float dtype).
    fn add_at(&self, offset: usize, n: usize, g: &Tensor) -> Result<()> {
        let dst = self.buf.narrow(0, offset, n)?;
        let sum = if g.dtype() == DType::F64 && dst.dtype() == DType::F32 {
            // An f64 gradient (f32 layers on the CPU) is added in f64 and rounded once.
            (dst.to_dtype(DType::F64)? + g.flatten_all()?)?.to_dtype(DType::F32)?
        } else {
            (dst + g.to_dtype(self.buf.dtype())?.flatten_all()?)?.contiguous()?
        };
        self.buf.slice_set(&sum, 0, offset)?;
        Ok(())
    }

    /// `buf[name] += dyᵀ x` for a projection `name` of shape `[out, in]`, `dy: [N, out]`,
    /// `x: [N, in]`: the weight gradient of `y = x Wᵀ`. On CUDA with bf16 operands and an f32
    /// buffer this is one GEMM whose f32 accumulators are added into the buffer (no bf16
    /// rounding of the gradient, no extra pass); f32 operands on the CPU form `dyᵀ x` in f64 and
    /// add it as by [`GradSink::accumulate`] (one rounding); elsewhere `dyᵀ x` is formed in the
    /// operands' dtype and added likewise.
    pub fn accumulate_matmul(&self, name: &str, dy: &Tensor, x: &Tensor) -> Result<()> {
        let Some(spec) = self.spec(name)? else { return Ok(()) };
        let (out, inp) = match spec.shape.as_slice() {
            [o, i] => (*o, *i),
            s => return Err(Error::shape(format!("layout entry {name}"), "a matrix", s)),
        };
        self.matmul_at(name, spec.offset, out, inp, dy, x)
    }

    /// `buf[name][e] += dyᵀ x` for expert `e` of a packed `[E, out, in]` tensor `name` (a mixture
    /// of experts' `mlp.experts.*`), `dy: [N, out]`, `x: [N, in]`: as
    /// [`GradSink::accumulate_matmul`] on that expert's matrix.
    pub fn accumulate_matmul_expert(&self, name: &str, e: usize, dy: &Tensor, x: &Tensor) -> Result<()> {
        let Some(spec) = self.spec(name)? else { return Ok(()) };
        let (n_e, out, inp) = match spec.shape.as_slice() {
            [n_e, o, i] => (*n_e, *o, *i),
            s => return Err(Error::shape(format!("layout entry {name}"), "[experts, out, in]", s)),
        };
        if e >= n_e {
            return Err(Error::shape(format!("expert {e} of {name}"), format!("< {n_e}"), &[e]));
        }
        self.matmul_at(name, spec.offset + e * out * inp, out, inp, dy, x)
    }

    /// `buf[name] += g` for a gradient `add` forms in place: `add` is given an f32 tensor of
    /// `name`'s shape and adds its product into it (the MoE kernels' expert weight gradients,
    /// `mt_kernels::MoeRouting::weight_grad`). An f32 buffer hands it its own view (no copy,
    /// nothing read back); any other a tensor of zeros, then added as by
    /// [`GradSink::accumulate`]. A frozen parameter's `add` is not called.
    pub fn accumulate_in_place(&self, name: &str, add: impl FnOnce(&Tensor) -> Result<()>) -> Result<()> {
        let Some(spec) = self.spec(name)? else { return Ok(()) };
        let shape = spec.shape.as_slice();
        if self.buf.dtype() == DType::F32 {
            return add(&self.buf.narrow(0, spec.offset, spec.numel())?.reshape(shape)?);
        }
        let g = Tensor::zeros(shape, DType::F32, self.buf.device())?;
        add(&g)?;
        self.add_at(spec.offset, spec.numel(), &g)
    }

    /// `buf[offset ..][out × inp] += dyᵀ x`, checked against the shapes.
    fn matmul_at(
        &self,
        name: &str,
        offset: usize,
        out: usize,
        inp: usize,
        dy: &Tensor,
        x: &Tensor,
    ) -> Result<()> {
        if !matches!((dy.dims(), x.dims()), ([n, o], [nx, i]) if n == nx && *o == out && *i == inp) {
            return Err(Error::shape(
                format!("dy of the gradient of {name} (with x {:?})", x.dims()),
                format!("[N, {out}], x [N, {inp}]"),
                dy.dims(),
            ));
        }
        #[cfg(feature = "cuda")]
        {
            let dst = self.buf.narrow(0, offset, out * inp)?;
            if mt_kernels::gemm_applies(&dst, dy, x) {
                return Ok(mt_kernels::accumulate_matmul_t(&dst, dy, x)?);
            }
        }
        if crate::ops::is_wide(dy) {
            return self.add_at(offset, out * inp, &crate::ops::matmul_wide(&dy.t()?, x)?);
        }
        self.add_at(offset, out * inp, &dy.t()?.matmul(x)?)
    }

    /// `buf[name] += Σ_rows dy` (in the statistics dtype) for a bias `name` of shape `[out]` and
    /// `dy: [N, out]`: the bias gradient of `y = x Wᵀ + b`. On CUDA with bf16 `dy` and an f32
    /// buffer one deterministic column-sum kernel; elsewhere `dy` is cast (f32 on the CPU to f64)
    /// and summed, then added as by [`GradSink::accumulate`].
    pub fn accumulate_col_sums(&self, name: &str, dy: &Tensor) -> Result<()> {
        let Some(spec) = self.spec(name)? else { return Ok(()) };
        if !matches!((spec.shape.as_slice(), dy.dims()), ([o], [_, o2]) if o == o2) {
            return Err(Error::shape(
                format!("dy of the gradient of {name}"),
                format!("[N, {:?}]", spec.shape),
                dy.dims(),
            ));
        }
        #[cfg(feature = "cuda")]
        if dy.device().is_cuda() && dy.dtype() == DType::BF16 && self.buf.dtype() == DType::F32 {
            let dst = self.buf.narrow(0, spec.offset, spec.numel())?;
            return Ok(mt_kernels::col_sums_add(&dst, dy)?);
        }
        self.accumulate(name, &dy.to_dtype(crate::ops::wide_dtype(dy))?.sum(0)?)
    }

    /// `buf[name][e] += Σ_rows dy` for expert `e` of a packed `[E, out]` bias `name` (GPT-OSS's
    /// `mlp.experts.*_bias`), `dy: [N, out]`: as [`GradSink::accumulate_col_sums`] on that row.
    pub fn accumulate_expert_col_sums(&self, name: &str, e: usize, dy: &Tensor) -> Result<()> {
        let Some(spec) = self.spec(name)? else { return Ok(()) };
        let (n_e, out) = match spec.shape.as_slice() {
            [n_e, o] => (*n_e, *o),
            s => return Err(Error::shape(format!("layout entry {name}"), "[experts, out]", s)),
        };
        if e >= n_e || !matches!(dy.dims(), [_, o] if *o == out) {
            return Err(Error::shape(
                format!("dy of the gradient of expert {e} of {name}"),
                format!("[N, {out}] for an expert < {n_e}"),
                dy.dims(),
            ));
        }
        let sums = dy.to_dtype(crate::ops::wide_dtype(dy))?.sum(0)?;
        self.add_at(spec.offset + e * out, out, &sums)
    }

    /// `buf[name][rows[i], :] += src[i, :]` for every `i` (repeated rows add up): the backward of
    /// an embedding lookup. Only the addressed rows are touched. `name` must be a matrix
    /// `[n_rows, width]`, `rows` a 1-D u32 tensor of length `k` (on any device: the CUDA kernel
    /// orders them on the host, so host rows save it a read off the GPU), `src` `[k, width]`.
    pub fn index_add_rows(&self, name: &str, rows: &Tensor, src: &Tensor) -> Result<()> {
        let Some(spec) = self.spec(name)? else { return Ok(()) };
        let width = match spec.shape.as_slice() {
            [_, w] => *w,
            s => return Err(Error::shape(format!("layout entry {name}"), "a matrix", s)),
        };
        if rows.dtype() != DType::U32 {
            return Err(Error::dtype("row indices", "u32", rows.dtype()));
        }
        let k = rows.dims1()?;
        if src.dims() != [k, width] {
            return Err(Error::shape(
                format!("row gradients of {name}"),
                format!("[{k}, {width}]"),
                src.dims(),
            ));
        }
        let view = self.buf.narrow(0, spec.offset, spec.numel())?.reshape(spec.shape.as_slice())?;
        #[cfg(feature = "cuda")]
        if view.device().is_cuda()
            && view.dtype() == DType::F32
            && matches!(src.dtype(), DType::BF16 | DType::F32)
        {
            mt_kernels::rows_add(&view, rows, src)?;
            return Ok(());
        }
        let src = src.to_dtype(self.buf.dtype())?.contiguous()?;
        let idx = rows.to_device(view.device())?.unsqueeze(1)?.broadcast_as((k, width))?.contiguous()?;
        view.scatter_add_set(&idx, &src, 0)?;
        Ok(())
    }
}
