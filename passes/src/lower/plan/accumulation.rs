//! The step time of `N` micro-batches from the plan of one: a step with gradient
//! accumulation (`micro-batches`) runs every micro-batch's forward and backward, but
//! reduces the accumulated gradients (`grad-sync`) and updates the parameters
//! (`optimizer`: the update, the host AdamW of `--offload-optimizer`, ZeRO's gathers of
//! the updated chunks) once. So the step is the plan of one micro-batch (whose backward
//! overlaps the once-a-step work, as the last micro-batch's does) plus `N - 1` times
//! the same plan with the once-a-step instructions taking no time, both found by
//! simulating the plan's streams again.

use std::collections::BTreeMap;
use weft_ir::plan::{ExecutionPlan, Instruction};

/// Passes whose instructions run once a step whatever the micro-batch count.
const ONCE_A_STEP: &[&str] = &["optimizer:", "grad-sync:"];

/// Whether `ins` runs once a step (from its provenance, `pass: reason`).
pub fn once_a_step(ins: &Instruction) -> bool {
    ins.provenance
        .as_deref()
        .is_some_and(|p| ONCE_A_STEP.iter().any(|pass| p.starts_with(pass)))
}

/// Seconds from the step's start to the last instruction's end, simulating the
/// streams as the plan orders them (program order on each stream, waits on the events
/// of other streams) with each instruction's time given by `time`.
pub fn simulate(instructions: &[Instruction], time: impl Fn(&Instruction) -> f64) -> f64 {
    let mut stream_free: BTreeMap<u32, f64> = BTreeMap::new();
    let mut event_at: BTreeMap<u32, f64> = BTreeMap::new();
    let mut step = 0.0f64;
    for ins in instructions {
        let free = stream_free.get(&ins.stream).copied().unwrap_or(0.0);
        let start = ins
            .wait
            .iter()
            .filter_map(|e| event_at.get(e))
            .fold(free, |t, &e| t.max(e));
        let end = start + time(ins);
        stream_free.insert(ins.stream, end);
        if let Some(e) = ins.signal {
            event_at.insert(e, end);
        }
        step = step.max(end);
    }
    step
}

/// Predicted seconds of a step of `micro_batches` micro-batches, from the plan of one.
pub fn micro_batched_step_time(plan: &ExecutionPlan, micro_batches: u32) -> f64 {
    step_time_of(plan.cost.step_time_s, &plan.instructions, micro_batches)
}

/// [`micro_batched_step_time`] of a one-micro-batch step taking `one` seconds.
fn step_time_of(one: f64, instructions: &[Instruction], micro_batches: u32) -> f64 {
    if micro_batches <= 1 {
        return one;
    }
    let accumulate_only = simulate(
        instructions,
        |i| {
            if once_a_step(i) {
                0.0
            } else {
                i.time_s
            }
        },
    );
    one + (micro_batches - 1) as f64 * accumulate_only
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ins(id: u32, stream: u32, time_s: f64, pass: &str, wait: Option<u32>) -> Instruction {
        Instruction {
            id,
            stream,
            node: id,
            op: "op".into(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            wait: wait.into_iter().collect(),
            signal: Some(id),
            flops: 0.0,
            bytes: 0.0,
            start_s: 0.0,
            time_s,
            axis: None,
            provenance: Some(format!("{pass}: why")),
            source: None,
        }
    }

    /// A backward (compute, 2 s), its gradient's reduce-scatter (comm, 1 s, after it),
    /// the host update (host, 3 s, after that) and a compute op waiting for the update
    /// (1 s): one micro-batch takes 2 + 1 + 3 + 1 = 7 s. Without the once-a-step work the
    /// compute stream runs 2 s, then the op that waited, 1 s: 3 s. Four micro-batches:
    /// 7 + 3 x 3 = 16 s, not 4 x 7 = 28 s.
    #[test]
    fn the_update_is_paid_once_and_each_micro_batch_pays_its_compute() {
        let step = vec![
            ins(0, 0, 2.0, "autodiff", None),
            ins(1, 1, 1.0, "grad-sync", Some(0)),
            ins(2, 4, 3.0, "optimizer", Some(1)),
            ins(3, 0, 1.0, "model", Some(2)),
        ];
        assert_eq!(simulate(&step, |i| i.time_s), 7.0);
        assert!(once_a_step(&step[1]) && once_a_step(&step[2]) && !once_a_step(&step[3]));
        assert_eq!(step_time_of(7.0, &step, 4), 16.0);
        assert_eq!(step_time_of(7.0, &step, 1), 7.0);
    }
}
