//! `expert-parallel`: the experts of every MoE block split over the mesh axis `ep`
//! (DeepSpeed-MoE / Megatron's all-to-all token dispatcher, dropless, in SPMD form).
//!
//! A MoE block is what the frontends build (mixtral, qwen3_moe; any router: softmax or
//! sigmoid, top-k, `norm_topk_prob`, shared experts beside it):
//!
//! ```text
//! rows, counts, order = moe_dispatch x, index {num_experts=E}   # rows sorted by expert
//! h = grouped_matmul rows, gate_up, counts                      # [E, 2I, H]
//! ...row-local ops (split, silu, mul)...
//! y = grouped_matmul h', down, counts                           # [E, H, I]
//! out = moe_combine y, order, weights
//! ```
//!
//! Rank `@ep` keeps experts `[@ep*E/ep, (@ep+1)*E/ep)`: the expert weights become
//! `[E/ep, .., ..]` with an `expert` partition over `ep` on dim 0 (replicated over
//! `edp`). The router and `moe_dispatch` run on every rank for its own tokens (whatever
//! `shard-seq` left it: `B*S/dp/sp` rows). Because dispatch sorts rows by expert, the
//! rows for each ep rank are consecutive. Then
//!
//! ```text
//! recv_counts = all_to_all counts {axis=ep}             # [E] = [ep, E/ep]: rows from rank i for local expert l
//! send = sum(reshape(counts, [ep, E/ep]), [1])          # rows to each rank
//! grid = reshape(recv_counts, [ep, E/ep])
//! recv = sum(grid, [1])                                 # rows from each rank
//! x = all_to_all_v rows, send {axis=ep, rows=R57}       # R57: data-dependent, bound at run time
//! h = grouped_matmul x, gate_up_local, grid             # one grouped matmul over the local experts
//! ...
//! y = grouped_matmul h', down_local, grid
//! back = all_to_all_v y, recv {axis=ep, rows=<k*T>}     # the inverse exchange: each row back home
//! out = moe_combine back, order, weights
//! ```
//!
//! The received rows come grouped by source rank, then by local expert; the grouped
//! matmul takes the `[ep, E/ep]` count grid, so they need no regrouping copy, and the
//! return exchange sends them back in the order they came. No capacity factor: every
//! row is computed (dropless), and the row count a rank receives is a fresh symbol
//! (`R<id>`, after the value) that the runtime binds from the tensor it got.
//!
//! Between dispatch and combine only row-local ops may appear (each output row depends
//! on the same input row): the grouped matmuls (with expert biases [E, N], split with
//! their weights), elementwise ops, splits, slices and concats of other dims, and
//! reshapes that keep the row dim (gpt-oss's gate/up de-interleave; they take the
//! received row count). Anything else is an error naming the node.

use crate::pass::{MeshAxes, Pass, PassContext, PassError, PassResult};
use crate::util::{build_error, divisors, made_by, meta_for};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use weft_ir::shape::norm_dim;
use weft_ir::{At, Dim, Elementwise, Graph, Node, Op, Partition, TensorType, Value};

pub use weft_ir::mesh::{EDP, EP};

pub struct ExpertParallel;

pub const NAME: &str = "expert-parallel";

impl Pass for ExpertParallel {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "split MoE experts over ep: exchange expert counts, all_to_all_v the dispatched rows to their experts' ranks, one grouped matmul over the local experts, all_to_all_v the results back"
    }
    fn mesh_axes(&self) -> MeshAxes {
        MeshAxes::All(&[EP])
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let ep = cx.axis_size(NAME, EP)? as i64;
        let mut res = PassResult::unchanged();
        for k in [
            "moe_blocks",
            "already_parallel",
            "all_to_all",
            "all_to_all_v",
            "expert_params_split",
        ] {
            res.count(k, 0);
        }
        let dispatches: Vec<Node> = g
            .nodes()
            .iter()
            .copied()
            .filter(|&n| matches!(g.node(n).op, Op::MoeDispatch { .. }))
            .collect();
        let uses = g.uses();
        let mut blocks = Vec::new();
        for d in dispatches {
            match match_block(g, d, &uses, ep)? {
                Some(b) => blocks.push(b),
                None => {
                    res.count("already_parallel", 1);
                }
            }
        }
        check_params_only_in_blocks(g, &blocks, &uses)?;
        drop(uses);
        let mut split: BTreeSet<String> = BTreeSet::new();
        for b in &blocks {
            rewrite_block(g, b, ep, &mut split, &mut res)?;
            res.count("moe_blocks", 1);
            res.changed = true;
        }
        res.count("expert_params_split", split.len() as u64);
        Ok(res)
    }
}

/// One MoE block: the dispatch, the row-local nodes up to the combines, the grouped
/// matmuls and their expert weights.
struct Block {
    dispatch: Node,
    experts: i64,
    /// Row-local nodes between dispatch and combine, in program order.
    region: Vec<Node>,
    /// Nodes of `region` that read the dispatched rows, with the operand index.
    readers: Vec<(Node, usize)>,
    matmuls: Vec<Node>,
    combines: Vec<Node>,
    /// Expert weight params (their `param` nodes).
    weights: Vec<Node>,
}

fn error(g: &Graph, n: Node, why: impl Into<String>) -> PassError {
    PassError::rewrite(
        NAME,
        format!("`{NAME}` cannot split the experts of this MoE block"),
        g.describe(n),
        why,
    )
}

fn is_unary_rowwise(op: &Op) -> bool {
    op.elementwise() == Some(Elementwise::Unary)
}

fn is_binary_rowwise(op: &Op) -> bool {
    matches!(
        op.elementwise(),
        Some(Elementwise::Binary | Elementwise::Select)
    )
}

/// Matches the block of dispatch `d`; `None` when it was already made expert-parallel.
fn match_block(
    g: &Graph,
    d: Node,
    uses: &[Vec<(Node, usize)>],
    ep: i64,
) -> Result<Option<Block>, PassError> {
    let Op::MoeDispatch { num_experts } = g.node(d).op else {
        unreachable!()
    };
    let [rows, counts, order] = g.node(d).results[..] else {
        unreachable!()
    };
    let counts_uses = &uses[counts.0 as usize];
    if counts_uses.iter().any(|&(n, _)| made_by(g, n, NAME)) {
        return Ok(None);
    }
    if num_experts % ep != 0 {
        let valid: Vec<String> = divisors(num_experts)
            .iter()
            .map(|x| x.to_string())
            .collect();
        let help = if valid.is_empty() {
            format!("a block with {num_experts} expert cannot be split; drop `ep` from the mesh")
        } else {
            format!(
                "use an ep that divides the {num_experts} experts: {}",
                valid.join(", ")
            )
        };
        return Err(PassError::rewrite(
            NAME,
            format!("`{NAME}` cannot split {num_experts} experts over ep={ep}"),
            g.describe(d),
            format!("ep={ep} does not divide the expert count {num_experts}: every rank of ep must hold the same number of experts"),
        )
        .with_help(help));
    }
    // The region: every node reached from the rows before a combine (found first, so
    // that each node is then judged knowing all of it).
    let outputs: HashSet<Value> = g.outputs().iter().map(|(_, v)| *v).collect();
    let mut in_region: HashSet<Value> = HashSet::from([rows]);
    let mut region: BTreeSet<(usize, Node)> = BTreeSet::new();
    let mut combines = Vec::new();
    let mut stack = vec![rows];
    let pos = |n: Node| g.position(n).unwrap_or(usize::MAX);
    while let Some(v) = stack.pop() {
        if outputs.contains(&v) {
            return Err(error(
                g,
                g.def(v),
                format!(
                    "{v} holds expert rows and is a graph output; only moe_combine may read them"
                ),
            ));
        }
        for &(n, i) in &uses[v.0 as usize] {
            if matches!(g.node(n).op, Op::MoeCombine {}) && i == 0 {
                if !combines.contains(&n) {
                    combines.push(n);
                }
            } else if region.insert((pos(n), n)) {
                for &r in &g.node(n).results {
                    in_region.insert(r);
                    stack.push(r);
                }
            }
        }
    }
    let readers: Vec<(Node, usize)> = uses[rows.0 as usize].clone();
    let mut matmuls = Vec::new();
    let mut weights = Vec::new();
    for &(_, n) in &region {
        let nd = g.node(n);
        let reads = |i: usize| in_region.contains(&nd.operands[i]);
        match &nd.op {
            Op::GroupedMatmul { .. } if reads(0) && (1..nd.operands.len()).all(|i| !reads(i)) => {
                if nd.operands[2] != counts {
                    return Err(error(
                        g,
                        n,
                        format!("its counts are not those of {}", g.describe(d)),
                    ));
                }
                let w = g.def(nd.operands[1]);
                let ok = matches!(&g.node(w).op, Op::Param { ty, .. } if ty.rank() == 3 && ty.shape[0] == Dim::from(num_experts));
                if !ok {
                    return Err(error(
                        g,
                        n,
                        format!(
                            "its weight {} is not an expert parameter [{num_experts}, N, K]",
                            nd.operands[1]
                        ),
                    )
                    .with_help(
                        "expert weights must be parameters read directly by the grouped matmul",
                    ));
                }
                if !weights.contains(&w) {
                    weights.push(w);
                }
                if let Some(&bias) = nd.operands.get(3) {
                    let bn = g.def(bias);
                    let ok = matches!(&g.node(bn).op, Op::Param { ty, .. } if ty.rank() == 2 && ty.shape[0] == Dim::from(num_experts));
                    if !ok {
                        return Err(error(
                            g,
                            n,
                            format!(
                                "its bias {bias} is not an expert parameter [{num_experts}, N]"
                            ),
                        )
                        .with_help(
                            "expert biases must be parameters read directly by the grouped matmul",
                        ));
                    }
                    if !weights.contains(&bn) {
                        weights.push(bn);
                    }
                }
                matmuls.push(n);
            }
            op if is_unary_rowwise(op) => {}
            // A view that keeps the row dim (gpt-oss's gate/up de-interleave).
            Op::Reshape { shape }
                if g.ty(nd.operands[0]).rank() >= 1
                    && shape.first() == g.ty(nd.operands[0]).shape.first() => {}
            op if is_binary_rowwise(op) => {
                let out = g.ty(nd.results[0]);
                for &o in &nd.operands {
                    // An operand from outside must not carry the row dim (a broadcast is fine).
                    let t = g.ty(o);
                    if !in_region.contains(&o)
                        && t.rank() == out.rank()
                        && t.shape[0] != Dim::from(1)
                    {
                        return Err(error(
                            g,
                            n,
                            format!("`{}` combines expert rows with {o} ({t}), which is indexed by the rows on the token's rank", op.name()),
                        ));
                    }
                }
            }
            Op::Split { dim, .. } | Op::Slice { dim, .. } | Op::Concat { dim }
                if norm_dim(*dim, g.ty(nd.operands[0]).rank()) != Ok(0) =>
            {
                if let Some(o) = nd.operands.iter().find(|o| !in_region.contains(o)) {
                    return Err(error(
                        g,
                        n,
                        format!(
                            "`{}` joins expert rows with {o}, which is not an expert-row value",
                            nd.op.name()
                        ),
                    ));
                }
            }
            op => {
                return Err(error(
                    g,
                    n,
                    format!(
                        "`{}` reads expert rows but is not row-local; between moe_dispatch and moe_combine only grouped matmuls, elementwise ops and splits of other dims can move to the experts' ranks",
                        op.name()
                    ),
                ));
            }
        }
    }
    for &c in &combines {
        if g.node(c).operands[1] != order {
            return Err(error(
                g,
                c,
                format!(
                    "it combines rows of {} with the order of another dispatch",
                    g.describe(d)
                ),
            ));
        }
    }
    // Counts feed only the grouped matmuls; the order only the combines.
    for &(n, i) in counts_uses {
        if !(matches!(g.node(n).op, Op::GroupedMatmul { .. }) && i == 2 && matmuls.contains(&n)) {
            return Err(error(
                g,
                n,
                format!(
                    "it reads the expert counts of {} (only the block's grouped matmuls may)",
                    g.describe(d)
                ),
            ));
        }
    }
    for &(n, _) in &uses[order.0 as usize] {
        if !combines.contains(&n) {
            return Err(error(
                g,
                n,
                format!(
                    "it reads the row order of {} (only moe_combine may)",
                    g.describe(d)
                ),
            ));
        }
    }
    if combines.is_empty() {
        return Err(error(g, d, "its rows never reach a moe_combine"));
    }
    Ok(Some(Block {
        dispatch: d,
        experts: num_experts,
        region: region.into_iter().map(|(_, n)| n).collect(),
        readers,
        matmuls,
        combines,
        weights,
    }))
}

/// An expert weight split here must not be read anywhere else (it would get the local
/// experts where it expects all of them).
fn check_params_only_in_blocks(
    g: &Graph,
    blocks: &[Block],
    uses: &[Vec<(Node, usize)>],
) -> Result<(), PassError> {
    let matmuls: HashSet<Node> = blocks
        .iter()
        .flat_map(|b| b.matmuls.iter().copied())
        .collect();
    for b in blocks {
        for &w in &b.weights {
            let v = g.node(w).results[0];
            if let Some(&(n, _)) = uses[v.0 as usize]
                .iter()
                .find(|(n, i)| !(matmuls.contains(n) && (*i == 1 || *i == 3)))
            {
                let Op::Param { name, .. } = &g.node(w).op else {
                    unreachable!()
                };
                return Err(error(
                    g,
                    n,
                    format!(
                        "it reads expert weight `{name}`, which is split over ep for {}",
                        g.describe(b.dispatch)
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn bytes(t: &TensorType) -> Dim {
    t.numel() * t.dtype.size_bytes() as i64
}

fn rewrite_block(
    g: &mut Graph,
    b: &Block,
    ep: i64,
    split: &mut BTreeSet<String>,
    res: &mut PassResult,
) -> Result<(), PassError> {
    let d = b.dispatch;
    let [rows, counts, _] = g.node(d).results[..] else {
        unreachable!()
    };
    let (e, local) = (b.experts, Dim::from(b.experts) / Dim::sym(EP));
    let grid_shape = vec![Dim::sym(EP), local.clone()];
    let rows_ty = g.ty(rows).clone();
    let mut at = d;
    let mut add =
        |g: &mut Graph, op: Op, operands: &[Value], reason: String| -> Result<Value, PassError> {
            let meta = meta_for(g, d, NAME, reason);
            let v = g
                .insert_with(At::After(at), op, operands, meta)
                .map_err(|e| build_error(NAME, e))?[0];
            at = g.def(v);
            Ok(v)
        };
    let a2a = Op::AllToAll {
        axis: EP.into(),
        scatter_dim: 0,
        gather_dim: 0,
    };
    let recv_counts = add(
        g,
        a2a,
        &[counts],
        format!(
            "expert counts: rank i learns how many rows each rank sends to its {local} experts"
        ),
    )?;
    let grid_send = add(
        g,
        Op::Reshape {
            shape: grid_shape.clone(),
        },
        &[counts],
        "this rank's rows per (ep rank, local expert)".into(),
    )?;
    let send = add(
        g,
        Op::Sum {
            dims: vec![1],
            keepdim: false,
        },
        &[grid_send],
        "rows to each rank of ep".into(),
    )?;
    let grid = add(
        g,
        Op::Reshape { shape: grid_shape },
        &[recv_counts],
        "rows received per (source rank, local expert)".into(),
    )?;
    let recv = add(
        g,
        Op::Sum {
            dims: vec![1],
            keepdim: false,
        },
        &[grid],
        "rows from each rank of ep, sent back by the return exchange".into(),
    )?;
    res.count("all_to_all", 1);
    // The data-dependent row count gets its name from the value once it exists.
    let a2av = Op::AllToAllV {
        axis: EP.into(),
        rows: Dim::sym("R"),
    };
    let reason = format!(
        "dispatch: rows to the ranks of their experts ({} bytes sent per rank), dropless",
        bytes(&rows_ty)
    );
    let x = add(g, a2av, &[rows, send], reason)?;
    let sym = fresh_symbol(g, x);
    g.node_mut(g.def(x)).op = Op::AllToAllV {
        axis: EP.into(),
        rows: Dim::sym(&sym),
    };
    g.reinfer(g.def(x)).map_err(|e| build_error(NAME, e))?;
    res.count("all_to_all_v", 1);

    // Local expert weights.
    for &w in &b.weights {
        let Op::Param { name, ty } = g.node(w).op.clone() else {
            unreachable!()
        };
        if split.contains(&name) {
            continue; // shared with a block rewritten before
        }
        let mut shape = ty.shape.clone();
        shape[0] = local.clone();
        g.node_mut(w).op = Op::Param {
            name: name.clone(),
            ty: ty.with_shape(shape),
        };
        g.reinfer(w).map_err(|e| build_error(NAME, e))?;
        g.add_param_partition(
            &name,
            Partition::simple("expert", EP, 0, vec![e / ep; ep as usize]),
        );
        split.insert(name);
    }
    // The rows and counts the region reads, then every region node re-typed in order.
    for &(n, i) in &b.readers {
        g.node_mut(n).operands[i] = x;
    }
    for &n in &b.matmuls {
        g.node_mut(n).operands[2] = grid;
    }
    for &n in &b.region {
        // A row-keeping reshape takes the received row count.
        let rows_in = g
            .node(n)
            .operands
            .first()
            .and_then(|&v| g.ty(v).shape.first().cloned());
        if let (Op::Reshape { shape }, Some(r)) = (&mut g.node_mut(n).op, rows_in) {
            shape[0] = r;
        }
        g.reinfer(n).map_err(|e| build_error(NAME, e))?;
    }
    // The inverse exchange before every combine.
    for &c in &b.combines {
        let y = g.node(c).operands[0];
        let reason = format!(
            "combine: expert outputs back to their tokens' ranks ({} bytes received per rank)",
            bytes(&rows_ty.with_dtype(g.ty(y).dtype))
        );
        let meta = meta_for(g, c, NAME, reason);
        let op = Op::AllToAllV {
            axis: EP.into(),
            rows: rows_ty.shape[0].clone(),
        };
        let back = g
            .insert_with(At::Before(c), op, &[y, recv], meta)
            .map_err(|e| build_error(NAME, e))?[0];
        g.node_mut(c).operands[0] = back;
        g.reinfer(c).map_err(|e| build_error(NAME, e))?;
        res.count("all_to_all_v", 1);
    }
    Ok(())
}

/// `R<id>` after the value, unless an input or the mesh already uses that name.
fn fresh_symbol(g: &Graph, v: Value) -> String {
    let mut taken: BTreeMap<String, ()> =
        g.mesh.axes.iter().map(|(a, _)| (a.clone(), ())).collect();
    for (_, _, i) in g.inputs() {
        for s in g.ty(i).shape.iter().flat_map(|d| d.symbols()) {
            taken.insert(s, ());
        }
    }
    let mut name = format!("R{}", v.0);
    while taken.contains_key(&name) {
        name.push('_');
    }
    name
}
