//! Memory: each buffer's live range, then its bytes. Arena buffers are placed
//! first-fit, a buffer reusing another's bytes only once that one's last touch is
//! ordered before it (the streams' vector clocks); host values get one slot each in the
//! pinned host pool, resident values one each in the resident region, and views their
//! root's bytes. The live bytes over time give the peak, its breakdown and the refusal
//! of plans over `--device-memory`.

// `LowerError` is large, as it is for `lower` itself (its public signature).
#![allow(clippy::result_large_err)]

use super::alias::Sharing;
use super::schedule::Schedule;
use super::{LowerError, NS};
use std::collections::BTreeMap;
use weft_ir::plan::*;
use weft_ir::{Graph, Op, Value};

const ALIGN: u64 = 256;

fn align(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// Live ranges, then offsets in the arena, host pool and resident region, then the
/// peak; refuses a plan whose peak exceeds `device_memory`.
pub(super) fn plan_memory(
    g: &Graph,
    buffers: &mut [Buffer],
    buf_of: &BTreeMap<Value, u32>,
    output_names: &BTreeMap<Value, Vec<String>>,
    sched: &Schedule,
    sharing: &Sharing,
    device_memory: u64,
) -> Result<MemoryReport, LowerError> {
    liveness(
        g,
        buffers,
        buf_of,
        output_names,
        &sched.instructions,
        sharing,
    );
    let arena_bytes = place_arena(buffers, output_names, sched, sharing);
    let host_bytes = place_host(g, buffers, output_names);
    let resident_bytes = place_resident(buffers);
    place_views(buffers, &sharing.root);
    memory_report(
        g,
        buffers,
        sched.instructions.len(),
        arena_bytes,
        resident_bytes,
        host_bytes,
        device_memory,
    )
}

/// Liveness: first and last instruction touching each buffer. Outputs and resident
/// values are held to the end (resident ones from the start, unless their bytes hold
/// several values), inputs from the start, and a root over its whole group's range.
pub(super) fn liveness(
    g: &Graph,
    buffers: &mut [Buffer],
    buf_of: &BTreeMap<Value, u32>,
    output_names: &BTreeMap<Value, Vec<String>>,
    instructions: &[Instruction],
    sharing: &Sharing,
) {
    let (root, shared_root) = (&sharing.root, &sharing.shared_root);
    let last = instructions.len().saturating_sub(1) as u32;
    let mut uses: Vec<Vec<u32>> = vec![Vec::new(); buffers.len()];
    for ins in instructions.iter() {
        for &i in &ins.inputs {
            uses[i as usize].push(ins.id);
        }
        for &o in &ins.outputs {
            buffers[o as usize].live.0 = ins.id;
        }
    }
    for (bi, buf) in buffers.iter_mut().enumerate() {
        let end = uses[bi].iter().copied().max().unwrap_or(buf.live.0);
        buf.live.1 = end.max(buf.live.0);
        // Resident values are held for the whole step, unless their bytes hold several
        // (an in-place update): then each value over its own range, the root over all.
        let whole_step = buf.resident && !shared_root[root[bi]];
        if output_names.contains_key(&Value(buf.value)) || whole_step {
            buf.live = (if whole_step { 0 } else { buf.live.0 }, last);
        }
    }
    // Inputs are filled before the first instruction.
    for (name, _, v) in g.inputs() {
        let _ = name;
        buffers[buf_of[&v] as usize].live.0 = 0;
    }
    // A root holds its bytes while it or any of its views is live (outputs pinned to
    // the end included).
    for bi in 0..buffers.len() {
        let r = root[bi];
        if r != bi {
            let l = buffers[bi].live;
            buffers[r].live = (buffers[r].live.0.min(l.0), buffers[r].live.1.max(l.1));
        }
    }
}

/// First-fit arena placement of the roots of arena buffers in allocation order; a
/// buffer may take bytes of a placed one once that one is free under the clock of
/// the new buffer's producer and not held to the end by an output. Returns the
/// arena's size.
pub(super) fn place_arena(
    buffers: &mut [Buffer],
    output_names: &BTreeMap<Value, Vec<String>>,
    sched: &Schedule,
    sharing: &Sharing,
) -> u64 {
    let (instructions, producer_instr) = (&sched.instructions, &sched.producer_instr);
    let (root, clock) = (&sharing.root, &sharing.clock);
    // Last touch of each root on each stream (producer and views included), and the
    // roots whose bytes a graph output holds to the end.
    let mut last_touch: Vec<[i64; NS]> = vec![[-1; NS]; buffers.len()];
    for ins in instructions.iter() {
        for &bi in ins.inputs.iter().chain(&ins.outputs) {
            let t = &mut last_touch[root[bi as usize]][ins.stream as usize];
            *t = (*t).max(ins.id as i64);
        }
    }
    let mut pinned_root = vec![false; buffers.len()];
    for (bi, buf) in buffers.iter().enumerate() {
        if output_names.contains_key(&Value(buf.value)) {
            pinned_root[root[bi]] = true;
        }
    }
    let pinned = |bi: usize| pinned_root[bi];
    let free_under = |bi: usize, c: &[i64; NS]| (0..NS).all(|t| last_touch[bi][t] <= c[t]);

    // First-fit arena placement of the roots in allocation order.
    let mut order: Vec<usize> = (0..buffers.len())
        .filter(|&i| !buffers[i].resident && root[i] == i && buffers[i].category != Category::Host)
        .collect();
    order.sort_by_key(|&i| (buffers[i].live.0, i));
    let mut arena_bytes = 0u64;
    let producer = |c: usize| match producer_instr.get(&(c as u32)) {
        Some(&p) => (clock[p as usize], instructions[p as usize].stream as usize),
        None => ([-1; NS], 0),
    };
    let future = FutureClocks::new(order.iter().map(|&c| producer(c)));
    // Placed buffers by (offset, index). A placed buffer is forgotten once no buffer
    // still to place can take its bytes' turn from it: its live range ended before the
    // next buffer's begins and it is free under the clock of every producer still to
    // come (a lower bound per stream), so `placed` holds what is live, not everything
    // placed so far (quadratic on long programs). Forgetting only saves time, so it
    // runs when `placed` has doubled since the last time.
    let mut placed: Vec<(u64, usize)> = Vec::new();
    let mut kept = 0usize;
    for (k, &c) in order.iter().enumerate() {
        let size = align(buffers[c].bytes);
        let (clk, _) = producer(c);
        if placed.len() >= 2 * kept.max(64) {
            let bounds = future.from(k);
            placed.retain(|&(_, b)| {
                pinned(b)
                    || buffers[b].live.1 >= buffers[c].live.0
                    || !bounds.iter().all(|lb| free_under(b, lb))
            });
            kept = placed.len();
        }
        // First fit, up from offset 0 over the buffers whose bytes c cannot take (an
        // input nothing reads is free under any clock, but holds its bytes from before
        // the first instruction: only a buffer written later may take them). Past the
        // first gap that fits, no placed buffer can move c.
        let mut off = 0u64;
        for &(o, b) in &placed {
            if off + size <= o {
                break;
            }
            let sz = align(buffers[b].bytes);
            let conflict =
                pinned(b) || !free_under(b, &clk) || buffers[b].live.1 >= buffers[c].live.0;
            if conflict && sz > 0 {
                off = off.max(o + sz);
            }
        }
        buffers[c].offset = off;
        arena_bytes = arena_bytes.max(off + size);
        let at = placed.partition_point(|&p| p < (off, c));
        placed.insert(at, (off, c));
    }
    arena_bytes
}

/// Lower bounds of the producer clocks still to come, per stream: for position `k` of
/// the placement order, the element-wise minimum of the clocks of the producers at
/// `k..` on each stream that has one.
struct FutureClocks {
    /// Per stream: (position in the order, the minimum clock from there on).
    suffix_min: Vec<Vec<(usize, [i64; NS])>>,
}

impl FutureClocks {
    fn new(producers: impl Iterator<Item = ([i64; NS], usize)>) -> FutureClocks {
        let mut suffix_min: Vec<Vec<(usize, [i64; NS])>> = vec![Vec::new(); NS];
        for (k, (clk, s)) in producers.enumerate() {
            suffix_min[s].push((k, clk));
        }
        for per_stream in &mut suffix_min {
            for i in (0..per_stream.len().saturating_sub(1)).rev() {
                let next = per_stream[i + 1].1;
                let m = &mut per_stream[i].1;
                for t in 0..NS {
                    m[t] = m[t].min(next[t]);
                }
            }
        }
        FutureClocks { suffix_min }
    }

    /// The bounds of the streams with a producer at `k` or later.
    fn from(&self, k: usize) -> Vec<[i64; NS]> {
        self.suffix_min
            .iter()
            .filter_map(|per_stream| {
                let i = per_stream.partition_point(|&(at, _)| at < k);
                per_stream.get(i).map(|&(_, m)| m)
            })
            .collect()
    }
}

/// Host pool: one slot per host value, in program order; an updated host state
/// (an `optim.*` output) is written over the state param of its name, which the
/// host update reads last (the host stream runs in order). Returns the pool's size.
pub(super) fn place_host(
    g: &Graph,
    buffers: &mut [Buffer],
    output_names: &BTreeMap<Value, Vec<String>>,
) -> u64 {
    let mut host_bytes = 0u64;
    let mut host_param_offset: BTreeMap<String, u64> = BTreeMap::new();
    for buf in buffers.iter_mut() {
        if buf.category != Category::Host || buf.alias_of.is_some() {
            continue;
        }
        let v = Value(buf.value);
        let replaces = output_names
            .get(&v)
            .and_then(|names| names.iter().find_map(|n| host_param_offset.get(n).copied()));
        let offset = match replaces {
            Some(o) => o,
            None => {
                let o = host_bytes;
                host_bytes += align(buf.bytes);
                if let Op::Param { name, .. } = g.op_of(v) {
                    host_param_offset.insert(name.clone(), o);
                }
                o
            }
        };
        buf.offset = offset;
    }
    host_bytes
}

/// Resident region: one slot per resident root, in program order. Returns its size.
pub(super) fn place_resident(buffers: &mut [Buffer]) -> u64 {
    let mut resident_bytes = 0u64;
    for buf in buffers
        .iter_mut()
        .filter(|b| b.resident && b.alias_of.is_none())
    {
        buf.offset = resident_bytes;
        resident_bytes += align(buf.bytes);
    }
    resident_bytes
}

/// Views sit on their root's bytes (a view of a param in the resident region).
pub(super) fn place_views(buffers: &mut [Buffer], root: &[usize]) {
    for bi in 0..buffers.len() {
        let r = root[bi];
        if r != bi {
            buffers[bi].offset = buffers[r].offset;
            buffers[bi].resident = buffers[r].resident;
        }
    }
}

/// Live bytes over time, for the peak and its breakdown: a group's bytes once, under
/// its root's category and over the root's (union) range. Refuses a peak over
/// `device_memory`.
pub(super) fn memory_report(
    g: &Graph,
    buffers: &[Buffer],
    n_instructions: usize,
    arena_bytes: u64,
    resident_bytes: u64,
    host_bytes: u64,
    device_memory: u64,
) -> Result<MemoryReport, LowerError> {
    let mut live_at = vec![BTreeMap::<Category, u64>::new(); n_instructions.max(1)];
    for buf in buffers
        .iter()
        .filter(|b| !b.resident && b.alias_of.is_none() && b.category != Category::Host)
    {
        for t in buf.live.0..=buf.live.1 {
            *live_at[t as usize].entry(buf.category).or_default() += buf.bytes;
        }
    }
    let (peak_at, peak_live) = live_at
        .iter()
        .enumerate()
        .map(|(i, m)| (i, m.values().sum::<u64>()))
        .max_by_key(|(i, s)| (*s, std::cmp::Reverse(*i)))
        .unwrap_or((0, 0));
    let mut breakdown: BTreeMap<String, u64> = BTreeMap::new();
    for c in [
        Category::Param,
        Category::Grad,
        Category::OptimizerState,
        Category::Activation,
        Category::Comm,
        Category::Workspace,
    ] {
        breakdown.insert(c.name().to_string(), 0);
    }
    for buf in buffers
        .iter()
        .filter(|b| b.resident && b.alias_of.is_none())
    {
        *breakdown.get_mut(buf.category.name()).unwrap() += buf.bytes;
    }
    for (c, v) in &live_at[peak_at] {
        *breakdown.entry(c.name().to_string()).or_default() += v;
    }
    // Arena bytes not live at the peak instant: fragmentation held as workspace.
    *breakdown.get_mut("workspace").unwrap() += arena_bytes.saturating_sub(peak_live);
    let peak_bytes = resident_bytes + arena_bytes;
    if peak_bytes > device_memory {
        return Err(LowerError::OutOfMemory {
            peak: peak_bytes,
            limit: device_memory,
            help: memory_help(&breakdown, &g.mesh),
            breakdown,
        });
    }
    Ok(MemoryReport {
        peak_bytes,
        breakdown,
        arena_bytes,
        resident_bytes,
        host_bytes,
        peak_at: peak_at as u32,
    })
}

/// Which option would bring the plan under the limit, from what dominates the peak.
fn memory_help(breakdown: &BTreeMap<String, u64>, mesh: &weft_ir::Mesh) -> String {
    let get = |k: &str| breakdown.get(k).copied().unwrap_or(0);
    let states = get("params") + get("grads") + get("optimizer_state");
    let acts = get("activations") + get("comm_buffers") + get("workspace");
    if acts >= states {
        let sp = mesh.size_or_one("sp");
        format!(
            "activations dominate: raise sequence parallelism (e.g. --mesh sp={}), use --checkpoint selective or full, or --offload",
            (sp * 2).max(2)
        )
    } else {
        let tp = mesh.size_or_one("tp");
        format!("parameters, gradients and optimizer state dominate: raise tensor parallelism (e.g. tp={}) or shard optimizer state over dp (ZeRO)", (tp * 2).max(2))
    }
}
