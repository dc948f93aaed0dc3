//! `simplify`: equality saturation (egg) over layout and collective sequences.
//!
//! Every single-result op of the program becomes an e-node (`o<k>` names the k-th
//! distinct op with its attributes); everything else (params, inputs, multi-result ops)
//! is a leaf `v<N>` standing for value `%N`. Rules are generated from the ops the graph
//! actually contains, so their attributes are concrete:
//!
//! - `cancel-all-to-all`: an all_to_all followed by its inverse is the identity;
//! - `transpose-involution`, `permute-compose`, `reshape-chain`, `reshape-identity`;
//! - `gather-then-local-slice`: slicing this rank's block out of an all_gather along
//!   the same dim is the rank's own shard;
//! - `cast-across-collective`, `unary-across-collective`: elementwise ops commute with
//!   data-movement collectives (all_gather, all_to_all), in both directions — the
//!   extractor keeps the side that moves fewer bytes and computes on fewer elements.
//!
//! The e-graph's analysis is the tensor type of each class (the IR's own shape rules),
//! which guards the conditional rules and prices extraction: collectives by the bytes
//! they move over NVLink, other ops by the bytes they touch in HBM. Limits are on
//! iterations and e-nodes, never wall-clock. The result is rebuilt keeping every
//! unchanged node (and its id); new nodes carry `simplify` provenance.

use crate::pass::{Pass, PassContext, PassError, PassResult};
use egg::{
    define_language, Analysis, CostFunction, DidMerge, EGraph, Extractor, Id, Language, Pattern,
    RecExpr, Rewrite, Runner, Symbol,
};
use std::collections::{BTreeMap, HashMap};
use weft_ir::{At, Bindings, Dim, Graph, NodeMeta, Op, Provenance, TensorType, Value};

define_language! {
    /// A program term: leaves are values outside the e-graph, other nodes are ops.
    pub enum Term {
        Leaf(Symbol),
        Apply(Symbol, Vec<Id>),
    }
}

/// The ops and leaf types the e-graph refers to by index.
#[derive(Default)]
pub struct Table {
    ops: Vec<Op>,
    op_index: HashMap<Op, usize>,
    leaf_types: BTreeMap<u32, TensorType>,
}

impl Table {
    fn intern(&mut self, op: &Op) -> Symbol {
        let k = match self.op_index.get(op) {
            Some(&k) => k,
            None => {
                self.ops.push(op.clone());
                self.op_index.insert(op.clone(), self.ops.len() - 1);
                self.ops.len() - 1
            }
        };
        Symbol::from(format!("o{k}"))
    }
    fn op(&self, s: Symbol) -> &Op {
        &self.ops[s.as_str()[1..].parse::<usize>().expect("op symbol")]
    }
}

/// Type of each e-class (None when the shape rules reject an e-node, which a sound
/// rule never produces).
impl Analysis<Term> for Table {
    type Data = Option<TensorType>;
    fn make(eg: &mut EGraph<Term, Self>, n: &Term) -> Self::Data {
        match n {
            Term::Leaf(s) => eg
                .analysis
                .leaf_types
                .get(&s.as_str()[1..].parse::<u32>().ok()?)
                .cloned(),
            Term::Apply(s, kids) => {
                let tys: Option<Vec<TensorType>> =
                    kids.iter().map(|k| eg[*k].data.clone()).collect();
                let tys = tys?;
                let refs: Vec<&TensorType> = tys.iter().collect();
                eg.analysis.op(*s).infer(&refs).ok()?.into_iter().next()
            }
        }
    }
    fn merge(&mut self, a: &mut Self::Data, b: Self::Data) -> DidMerge {
        if a.is_none() && b.is_some() {
            *a = b;
            DidMerge(true, false)
        } else {
            DidMerge(false, a.is_some() && b.is_none())
        }
    }
}

type EG = EGraph<Term, Table>;

fn numel(t: &TensorType, b: &Bindings) -> f64 {
    t.shape
        .iter()
        .map(|d| d.bind(b).as_const().map(|v| v as f64).unwrap_or(4096.0))
        .product()
}

/// Estimated nanoseconds of an e-node: collectives by bytes moved over NVLink (about
/// 370 GB/s), everything else by bytes touched in HBM (about 4.3 TB/s); reshapes free.
struct Price<'a> {
    eg: &'a EG,
    bindings: Bindings,
}

impl CostFunction<Term> for Price<'_> {
    type Cost = f64;
    fn cost<C: FnMut(Id) -> f64>(&mut self, n: &Term, mut costs: C) -> f64 {
        let kids: f64 = n.children().iter().map(|&k| costs(k)).sum();
        let Term::Apply(s, ch) = n else { return 0.0 };
        let op = self.eg.analysis.op(*s);
        let ins: Vec<&TensorType> = ch
            .iter()
            .filter_map(|k| self.eg[*k].data.as_ref())
            .collect();
        let in_bytes: f64 = ins
            .iter()
            .map(|t| numel(t, &self.bindings) * t.dtype.size_bytes() as f64)
            .sum();
        let own = match op {
            Op::Reshape { .. } => 0.0,
            _ if op.is_collective() => 1.0e3 + in_bytes / 370.0,
            _ => 1.0 + 2.0 * in_bytes / 4300.0,
        };
        kids + own
    }
}

fn rule(name: &str, lhs: &str, rhs: &str) -> Rewrite<Term, Table> {
    let l: Pattern<Term> = lhs.parse().expect("generated pattern");
    let r: Pattern<Term> = rhs.parse().expect("generated pattern");
    Rewrite::new(name.to_string(), l, r).expect("generated rule")
}

fn is_movement(op: &Op) -> bool {
    matches!(op, Op::AllGather { .. } | Op::AllToAll { .. })
}

/// A one-operand elementwise op (the op table's class): it commutes with any
/// data-movement collective.
fn is_unary_elementwise(op: &Op) -> bool {
    op.elementwise() == Some(weft_ir::Elementwise::Unary)
}

/// Rules for the ops present (rule names are stable; one name may cover many rules).
fn rules(t: &mut Table) -> Vec<Rewrite<Term, Table>> {
    let ops = t.ops.clone();
    let sym = |t: &mut Table, o: &Op| t.intern(o).to_string();
    let mut out = Vec::new();
    let mut n = 0usize;
    let mut name = |base: &str| {
        n += 1;
        format!("{base}#{n}")
    };
    for a in &ops {
        match a {
            Op::AllToAll {
                axis,
                scatter_dim,
                gather_dim,
            } => {
                let inv = Op::AllToAll {
                    axis: axis.clone(),
                    scatter_dim: *gather_dim,
                    gather_dim: *scatter_dim,
                };
                if ops.contains(&inv) {
                    let (sa, si) = (sym(t, a), sym(t, &inv));
                    out.push(rule(
                        &name("cancel-all-to-all"),
                        &format!("({si} ({sa} ?x))"),
                        "?x",
                    ));
                }
            }
            Op::Transpose { .. } => {
                let s = sym(t, a);
                out.push(rule(
                    &name("transpose-involution"),
                    &format!("({s} ({s} ?x))"),
                    "?x",
                ));
            }
            Op::Permute { perm: p1 } => {
                for b in &ops {
                    if let Op::Permute { perm: p2 } = b {
                        if p1.len() == p2.len()
                            && p1.iter().all(|&d| d >= 0 && (d as usize) < p1.len())
                        {
                            let composed: Vec<i64> = p2.iter().map(|&i| p1[i as usize]).collect();
                            let (s1, s2) = (sym(t, a), sym(t, b));
                            let identity = composed.iter().enumerate().all(|(i, &d)| d == i as i64);
                            let rhs = if identity {
                                "?x".to_string()
                            } else {
                                format!("({} ?x)", sym(t, &Op::Permute { perm: composed }))
                            };
                            out.push(rule(
                                &name("permute-compose"),
                                &format!("({s2} ({s1} ?x))"),
                                &rhs,
                            ));
                        }
                    }
                }
            }
            Op::Reshape { .. } => {
                for b in &ops {
                    if matches!(b, Op::Reshape { .. }) {
                        let (s1, s2) = (sym(t, a), sym(t, b));
                        out.push(rule(
                            &name("reshape-chain"),
                            &format!("({s2} ({s1} ?x))"),
                            &format!("({s2} ?x)"),
                        ));
                    }
                }
                let Op::Reshape { shape } = a.clone() else {
                    unreachable!()
                };
                let s = sym(t, a);
                let lhs: Pattern<Term> = format!("({s} ?x)").parse().expect("pattern");
                let rhs: Pattern<Term> = "?x".parse().expect("pattern");
                let x: egg::Var = "?x".parse().expect("var");
                let cond = move |eg: &mut EG, _: Id, subst: &egg::Subst| {
                    eg[subst[x]]
                        .data
                        .as_ref()
                        .is_some_and(|ty| ty.shape == shape)
                };
                out.push(
                    Rewrite::new(
                        name("reshape-identity"),
                        lhs,
                        egg::ConditionalApplier {
                            condition: cond,
                            applier: rhs,
                        },
                    )
                    .expect("rule"),
                );
            }
            Op::Slice { dim, start, len } => {
                for g in &ops {
                    let Op::AllGather { axis, dim: gd } = g else {
                        continue;
                    };
                    if gd != dim || *start != Dim::coord(axis) * len.clone() {
                        continue;
                    }
                    let (ss, sg) = (sym(t, a), sym(t, g));
                    let lhs: Pattern<Term> = format!("({ss} ({sg} ?x))").parse().expect("pattern");
                    let rhs: Pattern<Term> = "?x".parse().expect("pattern");
                    let x: egg::Var = "?x".parse().expect("var");
                    let (d, len) = (*dim, len.clone());
                    let cond = move |eg: &mut EG, _: Id, subst: &egg::Subst| {
                        eg[subst[x]].data.as_ref().is_some_and(|ty| {
                            weft_ir::shape::norm_dim(d, ty.rank())
                                .ok()
                                .is_some_and(|k| ty.shape[k] == len)
                        })
                    };
                    out.push(
                        Rewrite::new(
                            name("gather-then-local-slice"),
                            lhs,
                            egg::ConditionalApplier {
                                condition: cond,
                                applier: rhs,
                            },
                        )
                        .expect("rule"),
                    );
                }
            }
            _ => {}
        }
        if is_unary_elementwise(a) {
            for g in ops.iter().filter(|g| is_movement(g)) {
                let (su, sg) = (sym(t, a), sym(t, g));
                let base = if matches!(a, Op::Cast { .. }) {
                    "cast-across-collective"
                } else {
                    "unary-across-collective"
                };
                out.push(rule(
                    &name(base),
                    &format!("({su} ({sg} ?x))"),
                    &format!("({sg} ({su} ?x))"),
                ));
                out.push(rule(
                    &name(base),
                    &format!("({sg} ({su} ?x))"),
                    &format!("({su} ({sg} ?x))"),
                ));
            }
        }
    }
    out
}

pub struct Simplify;

/// E-graph limits: deterministic, never wall-clock.
pub const ITER_LIMIT: usize = 8;
pub const NODE_LIMIT: usize = 200_000;

impl Pass for Simplify {
    fn name(&self) -> &'static str {
        "simplify"
    }
    fn summary(&self) -> &'static str {
        "equality saturation (egg) over layout and collective sequences, extracted by bytes moved and touched"
    }
    fn run(&self, g: &mut Graph, _cx: &PassContext) -> Result<PassResult, PassError> {
        let mut table = Table::default();
        // Which nodes enter the e-graph: single-result ops that are not sources.
        let inside = |op: &Op, results: usize| {
            results == 1
                && !op.is_source()
                && !matches!(op, Op::MoeDispatch { .. } | Op::Topk { .. })
        };
        let mut expr: RecExpr<Term> = RecExpr::default();
        let mut id_of: HashMap<Value, Id> = HashMap::new();
        for &n in g.nodes() {
            let d = g.node(n);
            if inside(&d.op, d.results.len()) {
                let kids: Vec<Id> = d
                    .operands
                    .iter()
                    .map(|v| leaf_or_id(*v, g, &mut table, &mut expr, &mut id_of))
                    .collect();
                let s = table.intern(&d.op);
                let id = expr.add(Term::Apply(s, kids));
                id_of.insert(d.results[0], id);
            }
        }
        // Roots: values used outside the e-graph, and outputs.
        let mut roots: Vec<Value> = Vec::new();
        for &n in g.nodes() {
            let d = g.node(n);
            if !inside(&d.op, d.results.len()) {
                roots.extend(d.operands.iter().filter(|v| id_of.contains_key(v)));
            }
        }
        roots.extend(
            g.outputs()
                .iter()
                .map(|(_, v)| *v)
                .filter(|v| id_of.contains_key(v)),
        );
        roots.sort();
        roots.dedup();
        if roots.is_empty() {
            return Ok(PassResult::unchanged());
        }
        let rules = rules(&mut table);
        let mut eg = EG::new(table);
        let root_ids: Vec<(Value, Id)> = {
            let ids: Vec<Id> = add_all(&mut eg, &expr);
            roots
                .iter()
                .map(|v| (*v, ids[usize::from(id_of[v])]))
                .collect()
        };
        eg.rebuild();
        let runner = Runner::default()
            .with_egraph(eg)
            .with_iter_limit(ITER_LIMIT)
            .with_node_limit(NODE_LIMIT)
            .run(&rules);
        let mut hits: BTreeMap<String, u64> = BTreeMap::new();
        for it in &runner.iterations {
            for (r, k) in &it.applied {
                let base = r
                    .as_str()
                    .split('#')
                    .next()
                    .unwrap_or(r.as_str())
                    .to_string();
                *hits.entry(base).or_default() += *k as u64;
            }
        }
        let eg = &runner.egraph;
        let bindings = default_bindings(g);
        let extractor = Extractor::new(
            eg,
            Price {
                eg,
                bindings: bindings.clone(),
            },
        );
        let mut price_before = 0.0;
        let mut price_after = 0.0;
        let mut best: Vec<(Value, RecExpr<Term>)> = Vec::new();
        for (v, id) in &root_ids {
            let (c, e) = extractor.find_best(*id);
            price_after += c;
            let mut p = Price {
                eg,
                bindings: bindings.clone(),
            };
            let original = original_expr(g, *v, &id_of, &expr);
            price_before += p.cost_rec(&original);
            best.push((*v, e));
        }
        let mut result = PassResult::changed(false);
        for (k, v) in &hits {
            result.count(&format!("rule.{k}"), *v);
        }
        result.count("egraph_nodes", eg.total_number_of_nodes() as u64);
        result.count("iterations", runner.iterations.len() as u64);
        if price_after + 1e-9 >= price_before {
            return Ok(result);
        }
        // Rebuild: materialize the extracted terms, reusing original nodes where equal.
        let mut originals: HashMap<(Op, Vec<Value>), Value> = HashMap::new();
        for &n in g.nodes() {
            let d = g.node(n);
            if inside(&d.op, d.results.len()) {
                originals.insert((d.op.clone(), d.operands.clone()), d.results[0]);
            }
        }
        let mut new_values: BTreeMap<Value, Value> = BTreeMap::new();
        let table = &eg.analysis;
        for (root, e) in &best {
            let mut vals: Vec<Value> = Vec::with_capacity(e.as_ref().len());
            let anchor = g.def(*root);
            for node in e.as_ref() {
                let v = match node {
                    Term::Leaf(s) => Value(s.as_str()[1..].parse().expect("leaf symbol")),
                    Term::Apply(s, kids) => {
                        let op = table.op(*s).clone();
                        let operands: Vec<Value> =
                            kids.iter().map(|k| vals[usize::from(*k)]).collect();
                        match originals.get(&(op.clone(), operands.clone())) {
                            Some(&v) => v,
                            None => {
                                let meta = NodeMeta {
                                    source: g.node(anchor).meta.source.clone(),
                                    provenance: Some(Provenance { pass: "simplify".into(), reason: "rewritten by equality saturation (fewer bytes moved or touched)".into() }),
                                    ..Default::default()
                                };
                                let v = g
                                    .insert_with(At::Before(anchor), op.clone(), &operands, meta)
                                    .map_err(|e| {
                                        PassError::rewrite(
                                            "simplify",
                                            "rebuilding the extracted program",
                                            e.location.clone(),
                                            e.message,
                                        )
                                    })?[0];
                                originals.insert((op, operands), v);
                                v
                            }
                        }
                    }
                };
                vals.push(v);
            }
            let v = *vals.last().expect("non-empty term");
            if v != *root {
                new_values.insert(*root, v);
            }
        }
        for (old, new) in &new_values {
            // Replace uses by nodes outside the e-graph and outputs; dead ones go below.
            g.replace_all_uses(*old, *new);
        }
        crate::canonicalize::dce(g);
        result.changed = !new_values.is_empty();
        result.count("roots_rewritten", new_values.len() as u64);
        Ok(result)
    }
}

fn leaf_or_id(
    v: Value,
    g: &Graph,
    t: &mut Table,
    expr: &mut RecExpr<Term>,
    id_of: &mut HashMap<Value, Id>,
) -> Id {
    if let Some(&id) = id_of.get(&v) {
        return id;
    }
    t.leaf_types.insert(v.0, g.ty(v).clone());
    let id = expr.add(Term::Leaf(Symbol::from(format!("v{}", v.0))));
    id_of.insert(v, id);
    id
}

fn add_all(eg: &mut EG, expr: &RecExpr<Term>) -> Vec<Id> {
    let mut ids: Vec<Id> = Vec::with_capacity(expr.as_ref().len());
    for n in expr.as_ref() {
        let n = n.clone().map_children(|c| ids[usize::from(c)]);
        ids.push(eg.add(n));
    }
    ids
}

/// The original term of a root, for pricing the unsimplified program the same way.
fn original_expr(
    g: &Graph,
    v: Value,
    id_of: &HashMap<Value, Id>,
    expr: &RecExpr<Term>,
) -> RecExpr<Term> {
    let _ = g;
    let mut out = RecExpr::default();
    let mut memo: HashMap<Id, Id> = HashMap::new();
    fn go(id: Id, expr: &RecExpr<Term>, out: &mut RecExpr<Term>, memo: &mut HashMap<Id, Id>) -> Id {
        if let Some(&m) = memo.get(&id) {
            return m;
        }
        let n = expr[id].clone().map_children(|c| go(c, expr, out, memo));
        let new = out.add(n);
        memo.insert(id, new);
        new
    }
    go(id_of[&v], expr, &mut out, &mut memo);
    out
}

fn default_bindings(g: &Graph) -> Bindings {
    let mut b = Bindings::new().with("B", 1).with("S", 4096);
    for (a, n) in &g.mesh.axes {
        b = b.with(a, *n as i64).with_coord(a, 0);
    }
    b
}
