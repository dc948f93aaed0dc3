//! Unit tests calling the sections of [`lower_with_views`] directly.

use super::*;
use crate::{default_pipeline, run_pipeline, PassContext};
use weft_ir::{DType, Mesh, Op};

fn compiled(preset: &str, mesh: &str) -> Graph {
    let mut g = weft_frontends::load(preset).unwrap().graph;
    let mesh = Mesh::parse(mesh).unwrap();
    run_pipeline(
        &mut g,
        &PassContext::new(mesh.clone()),
        &default_pipeline(&mesh),
    )
    .unwrap();
    g
}

/// The sections up to the schedule, as `lower_with_views` runs them.
fn scheduled(
    g: &Graph,
    opts: &PlanOptions,
) -> (
    StepBindings,
    BufferTable,
    BTreeMap<weft_ir::Value, Vec<String>>,
    schedule::Schedule,
) {
    let bindings = buffers::step_bindings(g, opts).unwrap();
    let output_names = buffers::output_names(g);
    let host = buffers::host_values(g).unwrap();
    let table = buffers::buffer_table(g, &bindings.sized, &output_names, &host).unwrap();
    let sched = schedule::schedule(
        g,
        &bindings.expected,
        &opts.device,
        &table.buffers,
        &table.buf_of,
        opts.update_stream,
    )
    .unwrap();
    (bindings, table, output_names, sched)
}

#[test]
fn the_sections_compose_to_lower() {
    let g = compiled("llama-tiny", "dp=2,sp=2");
    let opts = PlanOptions::new(4, 64);
    for views in [true, false] {
        let (bindings, mut table, output_names, sched) = scheduled(&g, &opts);
        let sharing = alias::share(
            &g,
            &mut table.buffers,
            &table.buf_of,
            &output_names,
            &sched,
            views,
        );
        let memory = memory::plan_memory(
            &g,
            &mut table.buffers,
            &table.buf_of,
            &output_names,
            &sched,
            &sharing,
            opts.device_memory,
        )
        .unwrap();
        let plan = report::assemble(
            &g,
            &opts,
            &bindings.exact,
            table.buffers,
            &table.buf_of,
            sched,
            memory,
        );
        plan.check().unwrap();
        assert_eq!(
            plan.to_json(),
            lower_with_views(&g, &opts, views).unwrap().to_json()
        );
    }
}

#[test]
fn bindings_add_the_mesh_axes_and_buffers_cover_every_value() {
    let g = compiled("llama-tiny", "dp=2");
    let opts = PlanOptions::new(4, 64);
    let (bindings, table, _, _) = scheduled(&g, &opts);
    assert_eq!(bindings.sized.symbols.get("dp"), Some(&2));
    assert_eq!(bindings.exact.symbols.get("B"), Some(&4));
    let values: usize = g.nodes().iter().map(|&n| g.node(n).results.len()).sum();
    assert_eq!(table.buffers.len(), values);
    for (v, &b) in &table.buf_of {
        let buf = &table.buffers[b as usize];
        assert_eq!((buf.id, buf.value), (b, v.0));
        assert_eq!(buf.alias_of, None);
    }
    for (_, v) in g.params() {
        assert!(table.buffers[table.buf_of[&v] as usize].resident);
    }
}

/// mixtral-tiny on dp=2,ep=2 at B=4, S=64: each rank's 2 sequences x 64 tokens x top-2
/// = 256 rows go to the experts' ranks. The receive buffer is sized for every rank's
/// rows (2 x 256 = 512), but balanced routing brings 256 on average, which the grouped
/// GEMMs are priced at: half the FLOPs of the bound.
#[test]
fn expert_rows_are_sized_at_their_bound_and_priced_at_their_balanced_count() {
    let g = compiled("mixtral-tiny", "dp=2,ep=2");
    let opts = PlanOptions::new(4, 64);
    let bindings = buffers::step_bindings(&g, &opts).unwrap();
    let (symbol, _) = g.runtime_symbols().into_iter().next().unwrap();
    assert_eq!(bindings.sized.symbols.get(&symbol), Some(&512));
    assert_eq!(bindings.expected.symbols.get(&symbol), Some(&256));
    assert_eq!(bindings.exact.symbols.get(&symbol), None);
    let grouped = g
        .nodes()
        .iter()
        .copied()
        .find(|&n| matches!(g.node(n).op, Op::GroupedMatmul { .. }))
        .unwrap();
    let rows = |b: &Bindings| schedule_rows(&g, grouped, b);
    assert_eq!(rows(&bindings.sized), 512.0);
    assert_eq!(rows(&bindings.expected), 256.0);
}

fn schedule_rows(g: &Graph, n: weft_ir::Node, b: &Bindings) -> f64 {
    let x = g.node(n).operands[0];
    g.ty(x).shape[0].eval_f64(b).unwrap()
}

#[test]
fn the_schedule_keeps_each_stream_in_order() {
    let g = compiled("llama-tiny", "dp=2,sp=2");
    let (_, table, _, sched) = scheduled(&g, &PlanOptions::new(4, 64));
    let mut free = [0.0f64; NS];
    let mut flops = 0.0;
    for (k, ins) in sched.instructions.iter().enumerate() {
        assert_eq!(ins.id as usize, k);
        assert_eq!(
            ins.stream == 1,
            g.op_of(weft_ir::Value(ins.node)).is_collective()
        );
        assert!(
            ins.start_s >= free[ins.stream as usize],
            "%{} starts early",
            ins.node
        );
        free[ins.stream as usize] = ins.start_s + ins.time_s;
        for &o in &ins.outputs {
            assert_eq!(sched.producer_instr[&o], ins.id);
        }
        flops += ins.flops;
    }
    assert_eq!(sched.costs.flops, flops);
    assert!(sched.costs.comm_s > 0.0 && sched.costs.compute_s > 0.0);
    let signalled = sched
        .instructions
        .iter()
        .filter(|i| i.signal.is_some())
        .count();
    assert_eq!(sched.events as usize, signalled);
    assert!(table.buffers.len() >= sched.producer_instr.len());
}

#[test]
fn views_alias_roots_and_clocks_only_look_back() {
    let g = compiled("llama-tiny", "dp=2,sp=2");
    let (_, mut table, _, sched) = scheduled(&g, &PlanOptions::new(4, 64));
    let root = alias::views(&mut table.buffers, &sched.instructions);
    assert!(
        root.iter().enumerate().any(|(b, &r)| b != r),
        "no reshape became a view"
    );
    for (b, &r) in root.iter().enumerate() {
        assert_eq!(root[r], r, "a root is its own root");
        let buf = &table.buffers[b];
        assert_eq!(buf.alias_of, (b != r).then_some(r as u32));
        assert_eq!(buf.bytes, table.buffers[r].bytes);
    }
    let clock = alias::clocks(&sched.instructions);
    assert_eq!(clock.len(), sched.instructions.len());
    for (j, c) in clock.iter().enumerate() {
        assert!(
            c.iter().all(|&t| t < j as i64),
            "instruction {j} sees {c:?}"
        );
    }
}

fn buffer(id: u32, bytes: u64, category: Category, resident: bool) -> Buffer {
    Buffer {
        id,
        value: id,
        dtype: DType::F32,
        bytes,
        per_rank_bytes: None,
        category,
        offset: 0,
        resident,
        live: (0, 0),
        alias_of: None,
    }
}

#[test]
fn resident_roots_get_aligned_slots_and_views_their_roots_bytes() {
    let mut buffers = vec![
        buffer(0, 10, Category::Param, true),
        buffer(1, 300, Category::Grad, true),
        buffer(2, 10, Category::Activation, false),
        buffer(3, 4, Category::OptimizerState, true),
    ];
    buffers[2].alias_of = Some(0);
    assert_eq!(memory::place_resident(&mut buffers), 256 + 512 + 256);
    let offsets: Vec<u64> = buffers.iter().map(|b| b.offset).collect();
    assert_eq!(offsets, [0, 256, 0, 768]);
    memory::place_views(&mut buffers, &[0, 1, 0, 3]);
    assert!(buffers[2].resident);
    assert_eq!(buffers[2].offset, 0);
}

#[test]
fn the_fifth_stream_is_listed_only_for_a_host_or_side_update() {
    let kinds = |s: Vec<Stream>| s.iter().map(|s| (s.id, s.kind)).collect::<Vec<_>>();
    let four = kinds(report::streams(None));
    assert_eq!(four.iter().map(|s| s.0).collect::<Vec<_>>(), [0, 1, 2, 3]);
    for side in [StreamKind::Host, StreamKind::Update] {
        let five = kinds(report::streams(Some(side)));
        assert_eq!(five[..4], four[..]);
        assert_eq!(five[4], (HOST_STREAM, side));
    }
    assert_eq!(HOST_STREAM, UPDATE_STREAM);
}
