//! The error type of `mt-optim`: argument checks done once, up front, before any element is touched.

/// What an optimizer call can reject. Every check runs before the first write, so a call that
/// returns an error has left every buffer as it was.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A slice does not cover the same number of parameters as `master`.
    #[error(
        "length mismatch: `{slice}` has {found} elements but `master` has {expected}; every slice passed \
         to one optimizer call must cover the same parameters"
    )]
    LengthMismatch {
        /// Which slice is wrong: `grad`, `m`, `v` or `upload`.
        slice: &'static str,
        /// The length of `master`.
        expected: usize,
        /// The length of the offending slice.
        found: usize,
    },
    /// A moment buffer is too short or misaligned for its encoding.
    #[error(
        "the {moment} buffer holds {found} bytes where {dtype} moments of {n} parameters need {needed} \
         (4-byte aligned)"
    )]
    MomentBytes {
        /// Which buffer: `m`, `v` or `state slot`.
        moment: &'static str,
        /// The encoding (`fp32`, `bf16`, `int8`).
        dtype: &'static str,
        /// Parameters covered.
        n: usize,
        /// Bytes needed.
        needed: usize,
        /// Bytes found.
        found: usize,
    },
    /// `StepArgs::step` was 0; AdamW steps are 1-based.
    #[error(
        "AdamW step must be 1-based (t >= 1) but got 0: the bias correction 1 - beta^0 is zero; \
         increment the step counter before calling, as torch does"
    )]
    ZeroStep,
    /// A hyperparameter is outside the range `torch.optim.AdamW` accepts.
    #[error("invalid AdamW hyperparameter `{name}` = {value}: expected {expected}")]
    Hyperparameter {
        /// The field (`lr`, `beta1`, `beta2`, `eps` or `weight_decay`).
        name: &'static str,
        /// The value found.
        value: f64,
        /// The accepted range, in words.
        expected: &'static str,
    },
}

/// `Ok` when `found == expected`, else a [`Error::LengthMismatch`] naming `slice`.
pub(crate) fn check_len(slice: &'static str, expected: usize, found: usize) -> Result<(), Error> {
    if expected == found {
        Ok(())
    } else {
        Err(Error::LengthMismatch { slice, expected, found })
    }
}
