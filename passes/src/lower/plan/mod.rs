//! Lowering a program to an [`ExecutionPlan`]: schedule, memory plan and costs.
//!
//! - Streams: collectives run on a communication stream, host copies on two copy
//!   streams (device to host, host to device: the link is full duplex), the host CPU's
//!   optimizer update (`host_adamw`, `--offload-optimizer`) on a host stream present
//!   only when the program has one, everything else on the compute stream. Each stream keeps program order (a topological order the
//!   passes keep memory-friendly); a collective starts as soon as its operands exist,
//!   so it overlaps the compute that does not need it. A consumer on another stream
//!   waits for its producer's event. The compute stream also waits for each offload at
//!   the first instruction starting half a copy's duration after its predicted end, so
//!   the offloaded value's bytes return to the arena there.
//! - Memory: one buffer per value; params, gradients and optimizer state are resident;
//!   everything else lives in one arena, placed first-fit, where a buffer may reuse the
//!   bytes of another only once that one's last use is ordered before it on the new
//!   buffer's stream (same stream, or an event the stream waits for).
//! - Views: every value is contiguous, so a `reshape` moves no bytes. Its output is a
//!   view of its input's root buffer (`Buffer::alias_of`, as XLA's buffer assignment
//!   shares a bitcast's buffer): no storage of its own, the root's offset, and the
//!   root holds its bytes over the union of the group's live ranges. Only roots are
//!   placed and counted.
//! - In place: a training step's updated parameters and optimizer state (`param.*`,
//!   `optim.*`, `state.*` outputs fed back into the inputs of those names) are written
//!   over the inputs they replace once the old values are dead, and the ops of
//!   [`ELEMENTWISE_IN_PLACE`] over an operand that dies at the op (XLA's
//!   `CanShareOperandBufferWithUser`, input/output aliasing of donated buffers): the
//!   result joins its operand's group (`Buffer::alias_of`), so an updated weight is held
//!   once and nothing is copied back after the step.
//! - Costs: [`cost`]'s roofline and alpha-beta models give each instruction a duration;
//!   simulating the streams gives start times, step time and exposed communication.

pub mod accumulation;
pub mod cost;
pub mod profile;

mod alias;
mod buffers;
mod memory;
mod report;
mod schedule;
#[cfg(test)]
mod tests;

use crate::bindings::BindingError;
use buffers::{BufferTable, StepBindings};
use std::collections::BTreeMap;
use weft_ir::plan::*;
use weft_ir::{Bindings, Graph};

/// What to lower for.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    pub device: DeviceProfile,
    /// Refuse plans whose peak exceeds this many bytes per rank.
    pub device_memory: u64,
    /// Values of `B` and `S` (mesh axis sizes are added from the graph's mesh).
    pub bindings: Bindings,
    /// The MODEL argument the program was compiled from, recorded in the plan.
    pub source: String,
    /// Run the device's optimizer updates (`adamw`, `adamw_master`, `sgd`) on a stream
    /// of their own at low priority, each once the compute stream reaches its place in
    /// the program: the bandwidth-bound updates then fill the SMs that the backward's
    /// kernels leave idle instead of taking the compute stream's time. Ignored where
    /// the host runs the update.
    pub update_stream: bool,
}

impl PlanOptions {
    pub fn new(batch: i64, seq: i64) -> PlanOptions {
        PlanOptions {
            device: profile::preset("h200").expect("built-in profile"),
            device_memory: 80 << 30,
            bindings: Bindings::new().with("B", batch).with("S", seq),
            source: String::new(),
            update_stream: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum LowerError {
    #[error("{0}")]
    Bindings(#[from] BindingError),
    #[error("the plan needs {} per rank but the device has {} (--device-memory)\n{}help: {help}", gib(*.peak), gib(*.limit), breakdown_text(.breakdown))]
    OutOfMemory {
        peak: u64,
        limit: u64,
        breakdown: BTreeMap<String, u64>,
        help: String,
    },
    #[error("cannot size {what} in {location}: {why}")]
    Size {
        what: String,
        location: String,
        why: String,
    },
}

pub fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

fn breakdown_text(b: &BTreeMap<String, u64>) -> String {
    b.iter()
        .map(|(k, v)| format!("  {k:<16} {}\n", gib(*v)))
        .collect()
}

/// The most bytes all of a step's buffers may hold on one rank (2^60).
pub const MAX_PLAN_BYTES: u64 = 1 << 60;
/// Ops whose result the planner writes over an operand that dies at the op (the pairs
/// are [`in_place_pairs`]). Only ops whose kernels are verified safe in place on every
/// runtime: `cross_entropy_grad` (the CPU reference runs on values, not buffers; the
/// CUDA `ce_bwd_*` and `ce_bwd_lse8_bf16` kernels read each logit of a row before, or
/// at the index of, the gradient element they write). Its logits gradient takes the
/// logits' bytes when the logits die there (not when the step returns them); and
/// `matmul_add` (cuBLASLt accumulates into C = D), whose sum takes its addend's bytes;
/// `embedding_grad` with an `init` (one block reads and writes each touched row).
pub const ELEMENTWISE_IN_PLACE: &[&str] = &["cross_entropy_grad", "matmul_add", "embedding_grad"];

/// The plan's streams: compute, communication, device-to-host and host-to-device copies
/// (a PCIe link is full duplex: offloads and prefetches move at the same time), and
/// a fifth for the host CPU or for the device's optimizer updates.
const NS: usize = 5;
/// The host CPU's stream.
const HOST_STREAM: u32 = 4;
/// The device optimizer updates' own stream ([`PlanOptions::update_stream`]). It takes
/// the host stream's slot: a plan with a host update has no device update to move.
const UPDATE_STREAM: u32 = 4;
/// Lowers `g` (a verified program) to a plan.
pub fn lower(g: &Graph, opts: &PlanOptions) -> Result<ExecutionPlan, LowerError> {
    lower_with_views(g, opts, true)
}

/// [`lower`], choosing whether reshapes become views of their input's bytes; without
/// views every value has bytes of its own (for comparison and debugging).
pub fn lower_with_views(
    g: &Graph,
    opts: &PlanOptions,
    views: bool,
) -> Result<ExecutionPlan, LowerError> {
    let StepBindings {
        sized,
        expected,
        exact,
    } = buffers::step_bindings(g, opts)?;
    let output_names = buffers::output_names(g);
    let host = buffers::host_values(g)?;
    let BufferTable {
        mut buffers,
        buf_of,
    } = buffers::buffer_table(g, &sized, &output_names, &host)?;
    let update_stream = opts.update_stream && !has_host_update(g);
    let sched = schedule::schedule(g, &expected, &opts.device, &buffers, &buf_of, update_stream)?;
    let sharing = alias::share(g, &mut buffers, &buf_of, &output_names, &sched, views);
    let memory = memory::plan_memory(
        g,
        &mut buffers,
        &buf_of,
        &output_names,
        &sched,
        &sharing,
        opts.device_memory,
    )?;
    Ok(report::assemble(
        g, opts, &exact, buffers, &buf_of, sched, memory,
    ))
}

/// Whether the host CPU runs the optimizer update (`--offload-optimizer`).
fn has_host_update(g: &Graph) -> bool {
    g.nodes()
        .iter()
        .any(|&n| matches!(g.node(n).op, weft_ir::Op::HostAdamW { .. }))
}

fn max3(a: [i64; NS], b: [i64; NS]) -> [i64; NS] {
    std::array::from_fn(|t| a[t].max(b[t]))
}
