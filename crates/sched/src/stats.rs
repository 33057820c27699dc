//! Per-stream busy time and idle gaps of a step, from the spans the backend recorded.

use crate::backend::Span;
use crate::program::Stream;

/// Busy time and idleness of one stream during one step.
#[derive(Debug, Clone)]
pub struct StreamStats {
    /// Stream.
    pub stream: Stream,
    /// Operations run.
    pub n_ops: usize,
    /// Sum of operation durations.
    pub busy_s: f64,
    /// `busy_s / step_s`.
    pub busy_frac: f64,
    /// Longest idle gap between two consecutive operations of the stream.
    pub max_gap_s: f64,
}

/// Computes per-stream statistics.
pub fn stream_stats(spans: &[Span], step_s: f64) -> Vec<StreamStats> {
    [Stream::Host, Stream::H2D, Stream::Compute, Stream::D2H]
        .into_iter()
        .map(|stream| {
            let mut s: Vec<&Span> = spans.iter().filter(|x| x.stream == stream).collect();
            s.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
            let busy_s: f64 = s.iter().map(|x| x.end_s - x.start_s).sum();
            let max_gap_s = s.windows(2).map(|w| (w[1].start_s - w[0].end_s).max(0.0)).fold(0.0, f64::max);
            StreamStats {
                stream,
                n_ops: s.len(),
                busy_s,
                busy_frac: if step_s > 0.0 { busy_s / step_s } else { 0.0 },
                max_gap_s,
            }
        })
        .collect()
}
