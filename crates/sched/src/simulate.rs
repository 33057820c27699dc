//! A discrete-event model of a step program: given a duration per instruction, when does each
//! stream run what? Used to test that the schedule overlaps what it claims to (and, later, by the
//! planner to predict step time from measured per-op costs).

use std::collections::HashMap;

use crate::program::{Instr, Program, Stream};

/// Start/end time of every instruction and the busy time of every stream.
#[derive(Debug, Clone)]
pub struct Timeline {
    /// `(start, end)` per instruction, in program order.
    pub spans: Vec<(f64, f64)>,
    /// End of the last instruction.
    pub makespan: f64,
    /// Sum of instruction durations per stream.
    pub busy: HashMap<Stream, f64>,
}

/// Simulates `program` with in-order streams: an instruction starts when its stream is free and
/// every instruction it waits for has ended.
pub fn simulate(program: &Program, cost: impl Fn(&Instr) -> f64) -> Timeline {
    let mut free: HashMap<Stream, f64> = HashMap::new();
    let mut busy: HashMap<Stream, f64> = HashMap::new();
    let mut spans = Vec::with_capacity(program.instrs.len());
    for ins in &program.instrs {
        let ready = ins.waits.iter().map(|&w| spans[w]).map(|(_, e): (f64, f64)| e).fold(0.0, f64::max);
        let start = ready.max(*free.get(&ins.stream).unwrap_or(&0.0));
        let d = cost(ins);
        spans.push((start, start + d));
        free.insert(ins.stream, start + d);
        *busy.entry(ins.stream).or_default() += d;
    }
    let makespan = spans.iter().map(|s| s.1).fold(0.0, f64::max);
    Timeline { spans, makespan, busy }
}
