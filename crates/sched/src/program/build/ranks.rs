//! Data-parallel ranks (`ProgramSpec::rank`): every gradient is summed over the ranks on the
//! device ([`Op::AllReduce`]) right after its backward, before it is narrowed or downloaded, and
//! only its store's rank 0 downloads and lands it (so only it writes gradients into the store its
//! ranks share and takes the exact global norm, of the summed gradient). Every rank stages and
//! uploads every streamed layer from its store.

use mt_core::Unit;

use super::Builder;
use crate::program::{Op, Stream};

impl Builder {
    /// The sum over the ranks of `unit`'s gradient (in ring buffer `grad_buf`, else its own), if
    /// this engine is one of several ranks.
    pub(super) fn all_reduce(&mut self, unit: Unit, grad_buf: Option<usize>) -> Option<usize> {
        self.spec.rank?;
        Some(self.push(Stream::Compute, Op::AllReduce { unit, grad_buf }, vec![]))
    }

    /// Whether this engine downloads and lands gradients: it trains alone, or it is its store's
    /// rank 0.
    pub(super) fn lands(&self) -> bool {
        self.spec.rank.is_none_or(|r| r == 0)
    }
}
