//! Stream scheduler: the layer-major step program and its executor.
#![forbid(unsafe_code)]

pub mod program;
pub mod simulate;

#[cfg(test)]
mod program_tests;
