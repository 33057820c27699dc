//! Named tolerances and tensor-by-tensor comparison reports.
//!
//! The one error measure used everywhere, computed in f64 over a whole tensor:
//!
//! ```text
//! rel_err(actual, expected) = max_i |actual_i - expected_i| / max(max_i |expected_i|, 1e-30)
//! ```
//!
//! It is relative to the largest entry of the expected tensor, so tiny entries of a gradient do
//! not dominate, and a tensor passes a [`Tolerance`] when `rel_err <= tol.rel`. A non-finite value
//! in either tensor makes the error NaN, which fails every tolerance.
//!
//! Against a reference implementation's own error (PyTorch float32 against float64), the measure
//! is the relative L2 distance [`rel_l2`] and the bound a [`VsReference`].

use std::collections::BTreeMap;
use std::fmt;

use candle_core::{DType, Tensor};

use crate::{Error, Result};

/// A relative tolerance for [`rel_err`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Largest accepted [`rel_err`].
    pub rel: f64,
}

impl Tolerance {
    /// f64 against f64 where only summation order differs.
    pub const F64_STRICT: Tolerance = Tolerance { rel: 1e-10 };
    /// f32 (or f64) against PyTorch fp32 golden fixtures.
    pub const F32_GOLDEN: Tolerance = Tolerance { rel: 1e-5 };
    /// f32 against f32 where only summation order or chunking differs.
    pub const F32_TIGHT: Tolerance = Tolerance { rel: 1e-6 };
    /// bf16 compute against an f32 reference.
    pub const BF16: Tolerance = Tolerance { rel: 2e-2 };

    /// Whether an error is within the tolerance (NaN never is).
    pub fn accepts(&self, rel_err: f64) -> bool {
        rel_err <= self.rel
    }
}

/// A bound set by a reference implementation's own error: `max(floor, factor × reference)`,
/// where `reference` is the reference's distance from the exact answer and the bounded value ours,
/// measured the same way (here: `||a - exact||₂ / ||exact||₂` per tensor, [`rel_l2`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VsReference {
    /// Accepted whatever the reference's distance.
    pub floor: f64,
    /// Multiple of the reference's distance accepted above the floor.
    pub factor: f64,
}

impl VsReference {
    /// fp32 training, every tensor after a few AdamW steps, against PyTorch's own float32 run of
    /// the same training, both measured from float64 (issue NUMERICS). Not tighter: AdamW turns
    /// the float32 noise of a gradient element near its `eps` into an update-sized difference, so
    /// this distance is decided by a few elements and varies by 10x between equally exact
    /// implementations (PyTorch float32 against float64 over 20 random tiny models: 0.4e-6 to
    /// 1.7e-5 on the worst tensor).
    pub const FP32_TRAINING: VsReference = VsReference { floor: 1e-5, factor: 2.0 };
    /// fp32 gradients of one step, every tensor: no farther from float64 than PyTorch float32's
    /// own gradient (the engine's f64-accumulating CPU path measured at most 0.65 of it over 22
    /// models; PyTorch's op order, f32 accumulation, up to 1.55).
    pub const FP32_GRADIENTS: VsReference = VsReference { floor: 0.0, factor: 1.0 };
    /// fp32 losses of the steps of a short training: within PyTorch float32's own distance, or
    /// 1e-7 (2 ulp of f32) of the exact loss.
    pub const FP32_LOSSES: VsReference = VsReference { floor: 1e-7, factor: 1.0 };

    /// The largest accepted distance given the reference's.
    pub fn bound(&self, reference: f64) -> f64 {
        self.floor.max(self.factor * reference)
    }

    /// Whether `distance` is within [`VsReference::bound`] (NaN never is).
    pub fn accepts(&self, distance: f64, reference: f64) -> bool {
        distance <= self.bound(reference)
    }
}

/// `||a - b||₂ / ||b||₂` in f64 over two equally long slices (NaN if either holds a NaN): the
/// distance of a tensor from its reference as a whole, which tiny entries do not dominate.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "rel_l2 of slices of different lengths");
    let d: f64 = a.iter().zip(b).map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2)).sum();
    let m: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (d / m.max(1e-60)).sqrt()
}

/// Alias of [`Tolerance::F64_STRICT`].
pub const F64_STRICT: Tolerance = Tolerance::F64_STRICT;
/// Alias of [`Tolerance::F32_GOLDEN`].
pub const F32_GOLDEN: Tolerance = Tolerance::F32_GOLDEN;
/// Alias of [`Tolerance::F32_TIGHT`].
pub const F32_TIGHT: Tolerance = Tolerance::F32_TIGHT;
/// Alias of [`Tolerance::BF16`].
pub const BF16: Tolerance = Tolerance::BF16;

/// All elements of a tensor as f64, row-major.
pub fn to_f64_vec(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

/// Error measures of one tensor pair.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Diff {
    /// `max |actual - expected|` (NaN if any value is non-finite).
    pub max_abs_diff: f64,
    /// `max |expected|`.
    pub max_abs_expected: f64,
    /// The module's `rel_err`.
    pub rel_err: f64,
}

/// [`Diff`] of two tensors of the same shape (any dtypes).
pub fn diff(actual: &Tensor, expected: &Tensor) -> Result<Diff> {
    if actual.dims() != expected.dims() {
        return Err(Error::Shape {
            what: "compared tensor".into(),
            expected: expected.dims().to_vec(),
            found: actual.dims().to_vec(),
        });
    }
    let (a, b) = (to_f64_vec(actual)?, to_f64_vec(expected)?);
    let mut max_abs_diff = 0.0f64;
    let mut max_abs_expected = 0.0f64;
    let mut finite = true;
    for (x, y) in a.iter().zip(&b) {
        finite &= x.is_finite() && y.is_finite();
        max_abs_diff = max_abs_diff.max((x - y).abs());
        max_abs_expected = max_abs_expected.max(y.abs());
    }
    if !finite {
        max_abs_diff = f64::NAN;
    }
    let rel_err = max_abs_diff / max_abs_expected.max(1e-30);
    Ok(Diff { max_abs_diff, max_abs_expected, rel_err })
}

/// The module's relative error of `actual` against `expected` (same shape).
pub fn rel_err(actual: &Tensor, expected: &Tensor) -> Result<f64> {
    Ok(diff(actual, expected)?.rel_err)
}

/// Panics unless `rel_err(actual, expected) <= tol.rel`; the message names `what`.
pub fn assert_close(actual: &Tensor, expected: &Tensor, tol: Tolerance, what: &str) {
    match diff(actual, expected) {
        Ok(d) if tol.accepts(d.rel_err) => {}
        Ok(d) => panic!(
            "{what}: rel_err {:.3e} > {:.1e} (max|diff| {:.3e}, max|expected| {:.3e})",
            d.rel_err, tol.rel, d.max_abs_diff, d.max_abs_expected
        ),
        Err(e) => panic!("{what}: cannot compare: {e}"),
    }
}

/// Euclidean norm of all tensors of a map taken together (computed in f64), as
/// `torch.nn.utils.clip_grad_norm_` reports it.
pub fn global_norm(tensors: &BTreeMap<String, Tensor>) -> Result<f64> {
    let mut sum = 0.0;
    for t in tensors.values() {
        sum += to_f64_vec(t)?.iter().map(|x| x * x).sum::<f64>();
    }
    Ok(sum.sqrt())
}

/// One row of a [`Report`].
#[derive(Debug, Clone, PartialEq)]
pub struct TensorReport {
    /// Name of the tensor.
    pub name: String,
    /// Error measures; `None` when the pair could not be compared (see `problem`).
    pub diff: Option<Diff>,
    /// Why the pair could not be compared (shape mismatch, ...).
    pub problem: Option<String>,
    /// Whether the tensor passes the tolerance.
    pub ok: bool,
}

impl TensorReport {
    /// The relative error, NaN when the pair could not be compared.
    pub fn rel_err(&self) -> f64 {
        self.diff.map_or(f64::NAN, |d| d.rel_err)
    }
}

/// The outcome of [`compare_maps`]: every tensor's error, and names present on one side only.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// The tolerance applied.
    pub tol: Tolerance,
    /// One row per name present in both maps, in name order.
    pub tensors: Vec<TensorReport>,
    /// Names expected but absent from the actual map.
    pub missing: Vec<String>,
    /// Names in the actual map that were not expected.
    pub extra: Vec<String>,
}

impl Report {
    /// Whether every tensor passes and the name sets agree.
    pub fn is_ok(&self) -> bool {
        self.missing.is_empty() && self.extra.is_empty() && self.tensors.iter().all(|t| t.ok)
    }

    /// The row with the largest relative error (NaN counts as the largest).
    pub fn worst(&self) -> Option<&TensorReport> {
        self.tensors.iter().max_by(|a, b| {
            let key = |t: &TensorReport| if t.rel_err().is_nan() { f64::INFINITY } else { t.rel_err() };
            key(a).total_cmp(&key(b))
        })
    }

    /// Rows that fail the tolerance.
    pub fn failures(&self) -> impl Iterator<Item = &TensorReport> {
        self.tensors.iter().filter(|t| !t.ok)
    }

    /// Panics with the full table unless [`Report::is_ok`]; `what` names the comparison.
    pub fn assert_ok(&self, what: &str) {
        if !self.is_ok() {
            panic!("{what}: tensors differ beyond tolerance\n{self}");
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "tolerance: rel_err <= {:.1e}", self.tol.rel)?;
        writeln!(f, "{:<4} {:>11} {:>11} {:>11}  name", "", "rel_err", "max|diff|", "max|exp|")?;
        for t in &self.tensors {
            let mark = if t.ok { "ok" } else { "FAIL" };
            match (&t.diff, &t.problem) {
                (Some(d), _) => writeln!(
                    f,
                    "{mark:<4} {:>11.3e} {:>11.3e} {:>11.3e}  {}",
                    d.rel_err, d.max_abs_diff, d.max_abs_expected, t.name
                )?,
                (None, p) => writeln!(
                    f,
                    "{mark:<4} {:>11} {:>11} {:>11}  {}: {}",
                    "-",
                    "-",
                    "-",
                    t.name,
                    p.as_deref().unwrap_or("?")
                )?,
            }
        }
        for m in &self.missing {
            writeln!(f, "MISSING  {m}")?;
        }
        for e in &self.extra {
            writeln!(f, "EXTRA    {e}")?;
        }
        if let Some(w) = self.worst() {
            writeln!(f, "worst: {} (rel_err {:.3e})", w.name, w.rel_err())?;
        }
        Ok(())
    }
}

/// Compares two maps tensor by tensor under one tolerance. Never panics: problems are rows of
/// the report (see [`Report::assert_ok`]).
pub fn compare_maps(
    actual: &BTreeMap<String, Tensor>,
    expected: &BTreeMap<String, Tensor>,
    tol: Tolerance,
) -> Report {
    let mut tensors = Vec::new();
    let mut missing = Vec::new();
    for (name, e) in expected {
        let Some(a) = actual.get(name) else {
            missing.push(name.clone());
            continue;
        };
        let row = match diff(a, e) {
            Ok(d) => {
                TensorReport { name: name.clone(), diff: Some(d), problem: None, ok: tol.accepts(d.rel_err) }
            }
            Err(err) => {
                TensorReport { name: name.clone(), diff: None, problem: Some(err.to_string()), ok: false }
            }
        };
        tensors.push(row);
    }
    let extra = actual.keys().filter(|k| !expected.contains_key(*k)).cloned().collect();
    Report { tol, tensors, missing, extra }
}

/// Bit patterns of every element (dtype-exact), for bitwise comparison.
fn bits(t: &Tensor) -> Result<Vec<u64>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F64 => t.to_vec1::<f64>()?.into_iter().map(f64::to_bits).collect(),
        // bf16 and f16 widen to f32 exactly and injectively (NaN payloads aside).
        DType::F32 | DType::BF16 | DType::F16 => {
            t.to_dtype(DType::F32)?.to_vec1::<f32>()?.into_iter().map(|x| u64::from(x.to_bits())).collect()
        }
        DType::U32 => t.to_vec1::<u32>()?.into_iter().map(u64::from).collect(),
        DType::U8 => t.to_vec1::<u8>()?.into_iter().map(u64::from).collect(),
        DType::I64 => t.to_vec1::<i64>()?.into_iter().map(|x| x as u64).collect(),
        other => return Err(Error::Unsupported(format!("bitwise comparison of {other:?} tensors"))),
    })
}

/// Panics unless both maps hold the same names and every pair has the same dtype, shape and
/// bit pattern; the message lists every differing tensor with its first differing element.
pub fn assert_bitwise_eq(actual: &BTreeMap<String, Tensor>, expected: &BTreeMap<String, Tensor>, what: &str) {
    let mut problems = Vec::new();
    for name in expected.keys().filter(|k| !actual.contains_key(*k)) {
        problems.push(format!("MISSING {name}"));
    }
    for name in actual.keys().filter(|k| !expected.contains_key(*k)) {
        problems.push(format!("EXTRA   {name}"));
    }
    for (name, e) in expected {
        let Some(a) = actual.get(name) else { continue };
        if a.dtype() != e.dtype() || a.dims() != e.dims() {
            problems.push(format!(
                "DIFF    {name}: {:?}{:?} vs expected {:?}{:?}",
                a.dtype(),
                a.dims(),
                e.dtype(),
                e.dims()
            ));
            continue;
        }
        match (bits(a), bits(e)) {
            (Ok(x), Ok(y)) => {
                let n_diff = x.iter().zip(&y).filter(|(p, q)| p != q).count();
                if let Some(i) = x.iter().zip(&y).position(|(p, q)| p != q) {
                    let (va, ve) = (to_f64_vec(a), to_f64_vec(e));
                    let show = |v: &Result<Vec<f64>>| v.as_ref().map_or(f64::NAN, |v| v[i]);
                    problems.push(format!(
                        "DIFF    {name}: {n_diff} of {} elements differ; first at flat index {i}: {:e} vs expected {:e}",
                        x.len(),
                        show(&va),
                        show(&ve)
                    ));
                }
            }
            (Err(err), _) | (_, Err(err)) => problems.push(format!("ERROR   {name}: {err}")),
        }
    }
    if !problems.is_empty() {
        panic!("{what}: maps are not bitwise equal\n{}", problems.join("\n"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn t(v: &[f32]) -> Tensor {
        Tensor::new(v, &Device::Cpu).unwrap()
    }

    #[test]
    fn rel_err_is_relative_to_the_largest_expected_entry() {
        let e = rel_err(&t(&[1.0, -4.0, 0.0]), &t(&[1.0, -2.0, 0.5])).unwrap();
        assert_eq!(e, 2.0 / 2.0);
        assert_eq!(rel_err(&t(&[0.0]), &t(&[0.0])).unwrap(), 0.0);
        let tiny = Tensor::new(&[1e-40f64], &Device::Cpu).unwrap();
        assert_eq!(rel_err(&tiny, &tiny.zeros_like().unwrap()).unwrap(), 1e-40 / 1e-30);
        assert!(rel_err(&t(&[f32::NAN]), &t(&[1.0])).unwrap().is_nan());
        assert!(rel_err(&t(&[1.0, f32::INFINITY]), &t(&[1.0, f32::INFINITY])).unwrap().is_nan());
        assert!(!Tolerance::BF16.accepts(f64::NAN));
        assert!(matches!(rel_err(&t(&[1.0]), &t(&[1.0, 2.0])), Err(Error::Shape { .. })));
    }

    #[test]
    fn report_lists_failures_missing_and_extra_and_names_the_worst() {
        let exp: BTreeMap<String, Tensor> = [
            ("a".to_owned(), t(&[1.0, 2.0])),
            ("b".to_owned(), t(&[1.0])),
            ("gone".to_owned(), t(&[1.0])),
            ("shape".to_owned(), t(&[1.0])),
        ]
        .into();
        let act: BTreeMap<String, Tensor> = [
            ("a".to_owned(), t(&[1.0, 2.0 + 1e-6])),
            ("b".to_owned(), t(&[1.1])),
            ("new".to_owned(), t(&[1.0])),
            ("shape".to_owned(), t(&[1.0, 1.0])),
        ]
        .into();
        let r = compare_maps(&act, &exp, Tolerance::F32_GOLDEN);
        assert!(!r.is_ok());
        assert_eq!(r.missing, vec!["gone".to_owned()]);
        assert_eq!(r.extra, vec!["new".to_owned()]);
        assert_eq!(r.failures().map(|f| f.name.as_str()).collect::<Vec<_>>(), vec!["b", "shape"]);
        assert_eq!(r.worst().unwrap().name, "shape");
        let table = r.to_string();
        for needle in ["FAIL", "MISSING  gone", "EXTRA    new", "shape mismatch"] {
            assert!(table.contains(needle), "{needle:?} not in\n{table}");
        }
        let ok = compare_maps(&act, &act, Tolerance::F64_STRICT);
        assert!(ok.is_ok());
        ok.assert_ok("self");
    }

    #[test]
    #[should_panic(expected = "grads: tensors differ beyond tolerance")]
    fn assert_ok_panics_with_the_table() {
        let a: BTreeMap<String, Tensor> = [("w".to_owned(), t(&[1.0]))].into();
        let b: BTreeMap<String, Tensor> = [("w".to_owned(), t(&[2.0]))].into();
        compare_maps(&a, &b, Tolerance::F32_TIGHT).assert_ok("grads");
    }

    #[test]
    #[should_panic(expected = "DIFF    w: 1 of 2 elements differ; first at flat index 1")]
    fn bitwise_comparison_sees_one_ulp() {
        let a: BTreeMap<String, Tensor> = [("w".to_owned(), t(&[1.0, 1.0]))].into();
        let b: BTreeMap<String, Tensor> =
            [("w".to_owned(), t(&[1.0, f32::from_bits(1.0f32.to_bits() + 1)]))].into();
        assert_bitwise_eq(&a, &a, "same");
        assert_bitwise_eq(&a, &b, "ulp");
    }

    #[test]
    #[should_panic(expected = "DIFF    w: F64[1] vs expected F32[1]")]
    fn bitwise_comparison_checks_dtype() {
        let a: BTreeMap<String, Tensor> = [("w".to_owned(), t(&[1.0]).to_dtype(DType::F64).unwrap())].into();
        let b: BTreeMap<String, Tensor> = [("w".to_owned(), t(&[1.0]))].into();
        assert_bitwise_eq(&a, &b, "dtype");
    }

    #[test]
    fn global_norm_is_euclidean_over_all_tensors() {
        let m: BTreeMap<String, Tensor> =
            [("a".to_owned(), t(&[3.0])), ("b".to_owned(), t(&[0.0, 4.0]))].into();
        assert_eq!(global_norm(&m).unwrap(), 5.0);
    }

    #[test]
    fn vs_reference_bounds_by_the_floor_or_the_reference_and_refuses_nan() {
        let t = VsReference::FP32_TRAINING;
        assert_eq!(t.bound(1e-6), 1e-5);
        assert_eq!(t.bound(1e-5), 2e-5);
        assert!(t.accepts(2e-5, 1e-5) && !t.accepts(2.1e-5, 1e-5));
        assert!(!t.accepts(f64::NAN, 1e-5));
        assert!(!VsReference::FP32_GRADIENTS.accepts(1e-7, 0.9e-7));
        assert_eq!(rel_l2(&[3.0, 4.0], &[3.0, 4.0]), 0.0);
        assert!((rel_l2(&[3.0, 4.5], &[3.0, 4.0]) - 0.1).abs() < 1e-15);
        assert!(rel_l2(&[f32::NAN, 4.0], &[3.0, 4.0]).is_nan());
    }
}
