//! Which buffers share bytes. A buffer's group is the buffers whose bytes its root
//! holds (`root[b]`, `Buffer::alias_of`): [`views`] makes a reshape a view of its
//! input's root, [`in_place`] writes a result over a value that is dead by then, whose
//! deadness is judged by the [`clocks`] of the simulated streams.

use super::schedule::Schedule;
use super::{max3, ELEMENTWISE_IN_PLACE, NS};
use std::collections::BTreeMap;
use weft_ir::plan::*;
use weft_ir::{Graph, Value};

/// The groups of buffers sharing bytes, and the streams' vector clocks.
pub(super) struct Sharing {
    /// `root[b]` is the buffer holding b's bytes.
    pub root: Vec<usize>,
    /// Roots holding several values (an in-place update).
    pub shared_root: Vec<bool>,
    /// `clock[j][t]`: see [`clocks`].
    pub clock: Vec<[i64; NS]>,
}

/// Views, then in-place updates when `views` is set (with neither, every value keeps
/// bytes of its own); records each alias in `Buffer::alias_of`.
pub(super) fn share(
    g: &Graph,
    buffers: &mut [Buffer],
    buf_of: &BTreeMap<Value, u32>,
    output_names: &BTreeMap<Value, Vec<String>>,
    sched: &Schedule,
    views: bool,
) -> Sharing {
    let mut root = if views {
        self::views(buffers, &sched.instructions)
    } else {
        (0..buffers.len()).collect()
    };
    let clock = clocks(&sched.instructions);
    let shared_root = if views {
        in_place(g, buffers, buf_of, output_names, sched, &clock, &mut root)
    } else {
        vec![false; buffers.len()]
    };
    Sharing {
        root,
        shared_root,
        clock,
    }
}

/// Views: a reshape on the compute stream whose output has its input's bytes on
/// every rank, both on the device, and whose output is not itself resident (a
/// resident output keeps its own bytes in the resident region) shares its input's
/// root buffer. Returns `root`: `root[b]` is the buffer holding b's bytes.
pub(super) fn views(buffers: &mut [Buffer], instructions: &[Instruction]) -> Vec<usize> {
    let mut root: Vec<usize> = (0..buffers.len()).collect();
    // The stream that wrote each buffer: a reshape on another stream than the compute
    // one is a view only after a writer on its own stream (in order there).
    let mut writer_stream: Vec<Option<u32>> = vec![None; buffers.len()];
    for ins in instructions.iter() {
        let same_stream = |b: u32| writer_stream[b as usize] == Some(ins.stream);
        let viewable = ins.op == "reshape"
            && ins.inputs.len() == 1
            && ins.outputs.len() == 1
            && (ins.stream == 0 || same_stream(ins.inputs[0]));
        for &o in &ins.outputs {
            writer_stream[o as usize].get_or_insert(ins.stream);
        }
        if !viewable {
            continue;
        }
        let (r, o) = (root[ins.inputs[0] as usize], ins.outputs[0] as usize);
        let (rb, ob) = (&buffers[r], &buffers[o]);
        if r == o
            || ob.resident
            || rb.category == Category::Host
            || ob.category == Category::Host
            || rb.bytes != ob.bytes
            || rb.per_rank_bytes != ob.per_rank_bytes
        {
            continue;
        }
        root[o] = r;
        buffers[o].alias_of = Some(r as u32);
    }
    root
}

/// Vector clocks: `clock[j][t]` is the last instruction of stream t known to have
/// finished when instruction j starts (in-order streams plus the events it waits for,
/// transitively). -1: none.
pub(super) fn clocks(instructions: &[Instruction]) -> Vec<[i64; NS]> {
    let mut clock: Vec<[i64; NS]> = Vec::with_capacity(instructions.len());
    let mut event_source: BTreeMap<u32, u32> = BTreeMap::new();
    let mut prev_on: [i64; NS] = [-1; NS];
    for ins in instructions.iter() {
        let s = ins.stream as usize;
        let mut c = [-1i64; NS];
        if prev_on[s] >= 0 {
            let p = prev_on[s] as usize;
            c = max3(c, clock[p]);
            c[s] = c[s].max(p as i64);
        }
        for e in &ins.wait {
            let p = event_source[e] as usize;
            c = max3(c, clock[p]);
            let t = instructions[p].stream as usize;
            c[t] = c[t].max(p as i64);
        }
        clock.push(c);
        if let Some(e) = ins.signal {
            event_source.insert(e, ins.id);
        }
        prev_on[s] = ins.id as i64;
    }
    clock
}

/// In place: a result takes over the bytes of a value that is dead when it is
/// written (the rule and what the checker accepts are under `Buffer::alias_of`):
/// - updates: `param.<name>` / `optim.*` / `state.*` outputs (fed back into the
///   inputs of those names) over the input they replace, same bytes and dtype, once
///   every other read of the old value is ordered before the writer; the writer may
///   read it only at an elementwise pair (`adamw`, `sgd`) or not at all (the `cast`
///   back to bf16 after the f32 master's update);
/// - the ops of `ELEMENTWISE_IN_PLACE` over the operand of their pair, in the
///   arena, when that operand (and its views) die at the op and is not returned.
///
/// The result and its views join the group: one root, the union live range.
/// Returns which roots hold several values.
pub(super) fn in_place(
    g: &Graph,
    buffers: &mut [Buffer],
    buf_of: &BTreeMap<Value, u32>,
    output_names: &BTreeMap<Value, Vec<String>>,
    sched: &Schedule,
    clock: &[[i64; NS]],
    root: &mut [usize],
) -> Vec<bool> {
    let (instructions, producer_instr) = (&sched.instructions, &sched.producer_instr);
    let mut shared_root = vec![false; buffers.len()]; // roots holding several values
    let nb = buffers.len();
    let mut readers: Vec<Vec<u32>> = vec![Vec::new(); nb];
    for ins in instructions.iter() {
        for &i in &ins.inputs {
            readers[i as usize].push(ins.id);
        }
    }
    let params: BTreeMap<String, Value> = g.params().into_iter().collect();
    let mut cands: Vec<(u32, usize, usize)> = Vec::new(); // (writer, result, operand replaced)
    for (name, v) in g.outputs() {
        let target = fed_back_param(name, |n| params.contains_key(n)).map(|n| &params[n]);
        let o = buf_of[v];
        if let (Some(t), Some(&w)) = (target, producer_instr.get(&o)) {
            cands.push((w, o as usize, buf_of[t] as usize));
        }
    }
    for ins in instructions
        .iter()
        .filter(|i| ELEMENTWISE_IN_PLACE.contains(&i.op.as_str()))
    {
        for &(i, o) in in_place_pairs(&ins.op) {
            if let (Some(&x), Some(&y)) = (ins.inputs.get(i), ins.outputs.get(o)) {
                if !buffers[x as usize].resident {
                    cands.push((ins.id, y as usize, x as usize));
                }
            }
        }
    }
    cands.sort();
    cands.dedup();
    for (w, o, x) in cands {
        let r = root[x];
        if root[o] != o || r == o || shared_root[r] {
            continue;
        }
        let (ob, rb) = (&buffers[o], &buffers[r]);
        if ob.bytes != rb.bytes
            || ob.per_rank_bytes != rb.per_rank_bytes
            || ob.dtype != rb.dtype
            || ob.resident != rb.resident
            || ob.category == Category::Host
            || rb.category == Category::Host
        {
            continue;
        }
        // Updates replace values the step starts with (nothing writes them).
        if rb.resident && producer_instr.contains_key(&(r as u32)) {
            continue;
        }
        let members: Vec<usize> = (0..nb).filter(|&b| root[b] == r).collect();
        if members
            .iter()
            .any(|&b| output_names.contains_key(&Value(buffers[b].value)))
        {
            continue; // the old value is returned
        }
        let ins = &instructions[w as usize];
        let pos = ins
            .outputs
            .iter()
            .position(|&b| b as usize == o)
            .unwrap_or(usize::MAX);
        let reads: Vec<usize> = ins
            .inputs
            .iter()
            .enumerate()
            .filter(|(_, &b)| root[b as usize] == r)
            .map(|(k, _)| k)
            .collect();
        let reads_ok = match reads.as_slice() {
            [] => rb.resident,
            [k] => in_place_pairs(&ins.op).contains(&(*k, pos)),
            _ => false,
        };
        let c = &clock[w as usize];
        let dead = members.iter().all(|&b| {
            readers[b]
                .iter()
                .all(|&i| i == w || i as i64 <= c[instructions[i as usize].stream as usize])
        });
        if !reads_ok || !dead {
            continue;
        }
        for b in 0..nb {
            if root[b] == o {
                root[b] = r;
                buffers[b].alias_of = Some(r as u32);
            }
        }
        shared_root[r] = true;
    }
    shared_root
}
