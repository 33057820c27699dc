//! [`Fault`]: a NaN or infinity injected into a step, to test that it is skipped (tests only;
//! what a skipped step does: `commit.rs`).

use candle_core::Tensor;
use mt_core::Unit;

use super::Engine;
use crate::backend::Backend;
use crate::Result;

/// A NaN or infinity injected into the next step, to test the skip: not for production use.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    /// `value` written into the first element of `unit`'s device gradient right after its
    /// backward (before narrowing, download and land).
    Gradient {
        /// The unit.
        unit: Unit,
        /// The value (NaN or an infinity).
        value: f32,
    },
    /// `value` added to the step's loss (its gradients stay as they are).
    Loss(f64),
}

impl<B: Backend> Engine<B> {
    /// Injects `fault` into the next step (tests only; see [`Fault`]).
    #[doc(hidden)]
    pub fn inject(&mut self, fault: Fault) {
        self.faults.push(fault);
    }

    /// Writes an injected gradient fault of `unit` into its device gradient buffer `gbuf`.
    pub(super) fn inject_gradient(&self, unit: Unit, gbuf: &Tensor) -> Result<()> {
        for f in &self.step_faults {
            if let Fault::Gradient { unit: u, value } = *f {
                if u == unit {
                    let v = Tensor::new(&[value], gbuf.device())?.to_dtype(gbuf.dtype())?;
                    gbuf.slice_set(&v, 0, 0)?;
                }
            }
        }
        Ok(())
    }

    /// The loss with the injected loss faults added.
    pub(super) fn inject_loss(&self, loss: f64) -> f64 {
        self.step_faults.iter().fold(loss, |l, f| if let Fault::Loss(x) = f { l + x } else { l })
    }
}
