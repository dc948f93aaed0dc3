//! The dataflow graph: typed SSA values produced by nodes, kept in a program order that
//! is always topological. Node and value ids are `u32` newtypes allocated from arenas
//! and never reused, so ids held across a rewrite stay valid or become dangling,
//! never silently pointing at another node.

use crate::mesh::Mesh;
use crate::ops::Op;
use crate::types::TensorType;
use std::fmt;

/// An SSA value; prints as `%12`.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct Value(pub u32);

/// A node (one op application). Prints as `node%12`, after its first result.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, serde::Serialize, serde::Deserialize,
)]
pub struct Node(pub u32);

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}
impl fmt::Debug for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// Which pass made a node and why: what `weft inspect --explain` reports.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Provenance {
    pub pass: String,
    pub reason: String,
}

/// How a node made by a training transform relates to the forward node it comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DerivedKind {
    /// Part of the gradient computation of the forward node (autodiff).
    Backward,
    /// A copy of the forward node recomputed for the backward (activation checkpointing).
    Recompute,
}

impl DerivedKind {
    pub fn keyword(self) -> &'static str {
        match self {
            DerivedKind::Backward => "backward",
            DerivedKind::Recompute => "recompute",
        }
    }
    pub fn from_keyword(s: &str) -> Option<DerivedKind> {
        match s {
            "backward" => Some(DerivedKind::Backward),
            "recompute" => Some(DerivedKind::Recompute),
            _ => None,
        }
    }
}

/// `backward of %12`: what a node is and the forward node (named by its first result) it
/// was made from. Printed in the node's comment, `[backward of %12]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Derived {
    pub kind: DerivedKind,
    pub of: Value,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct NodeMeta {
    /// The model scope the node computes, e.g. `model.layers.3.mlp`.
    pub source: Option<String>,
    pub provenance: Option<Provenance>,
    /// Set on backward nodes (autodiff) and recomputed copies (checkpoint): the forward
    /// node they come from. Printed `[backward of %12]`.
    pub derived: Option<Derived>,
    /// The micro-batch the node computes when a step accumulates gradients over several.
    /// Printed `[micro-batch 2]`.
    pub micro_batch: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeData {
    pub op: Op,
    pub operands: Vec<Value>,
    pub results: Vec<Value>,
    pub meta: NodeMeta,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValueData {
    pub ty: TensorType,
    pub def: Node,
    pub index: u32,
}

/// An error creating a node: the operands do not fit the op.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{op} in {location}: {message}")]
pub struct BuildError {
    pub op: String,
    pub location: String,
    pub message: String,
}

#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub name: String,
    pub mesh: Mesh,
    nodes: Vec<Option<NodeData>>,
    values: Vec<Option<ValueData>>,
    order: Vec<Node>,
    pub(crate) outputs: Vec<(String, Value)>,
    /// How outputs are split across ranks: `(output, [(dim, axis), ...])`. An output
    /// not listed is replicated (every rank holds all of it).
    pub(crate) output_splits: Vec<(String, Vec<(usize, String)>)>,
    /// How sharded parameters are cut from their full tensors, nested outermost first.
    /// A parameter not listed is replicated on every rank.
    pub(crate) param_partitions: Vec<(String, Vec<crate::partition::Partition>)>,
    /// Source name given to nodes created while it is set (builders set it per layer).
    scope: Option<String>,
    /// Provenance given to nodes created while it is set (passes set it).
    provenance: Option<Provenance>,
}

/// Where a new node goes in program order.
#[derive(Clone, Copy, Debug)]
pub enum At {
    End,
    Before(Node),
    After(Node),
}

impl Graph {
    pub fn new(name: &str) -> Graph {
        Graph {
            name: name.to_string(),
            ..Default::default()
        }
    }

    // ---- building ----

    /// Sets the source name of nodes created from now on.
    pub fn set_scope(&mut self, scope: Option<&str>) {
        self.scope = scope.map(str::to_string);
    }

    pub fn scope(&self) -> Option<&str> {
        self.scope.as_deref()
    }

    /// Sets the provenance of nodes created from now on.
    pub fn set_provenance(&mut self, p: Option<Provenance>) {
        self.provenance = p;
    }

    /// Appends a single-result node and returns its value.
    pub fn add(&mut self, op: Op, operands: &[Value]) -> Result<Value, BuildError> {
        let r = self.insert(At::End, op, operands)?;
        Ok(r[0])
    }

    /// Appends a node and returns all its results.
    pub fn add_multi(&mut self, op: Op, operands: &[Value]) -> Result<Vec<Value>, BuildError> {
        self.insert(At::End, op, operands)
    }

    /// Creates a node at `at`, inferring its result types.
    pub fn insert(&mut self, at: At, op: Op, operands: &[Value]) -> Result<Vec<Value>, BuildError> {
        let meta = NodeMeta {
            source: self.scope.clone(),
            provenance: self.provenance.clone(),
            ..Default::default()
        };
        self.insert_with(at, op, operands, meta)
    }

    /// Creates a node with explicit metadata.
    pub fn insert_with(
        &mut self,
        at: At,
        op: Op,
        operands: &[Value],
        meta: NodeMeta,
    ) -> Result<Vec<Value>, BuildError> {
        let tys = {
            let mut ins = Vec::with_capacity(operands.len());
            for v in operands {
                match self.try_ty(*v) {
                    Some(t) => ins.push(t),
                    None => {
                        return Err(BuildError {
                            op: op.name().into(),
                            location: meta.source.clone().unwrap_or_else(|| "graph".into()),
                            message: format!("operand {v} does not exist"),
                        })
                    }
                }
            }
            op.infer(&ins).map_err(|message| BuildError {
                op: op.name().into(),
                location: meta.source.clone().unwrap_or_else(|| "graph".into()),
                message,
            })?
        };
        Ok(self.insert_typed(at, op, operands, tys, meta))
    }

    /// Creates a node with given result types, without checking them (the parser and
    /// rewrites that must build invalid intermediate states use this; the verifier
    /// re-infers every type).
    pub fn insert_typed(
        &mut self,
        at: At,
        op: Op,
        operands: &[Value],
        tys: Vec<TensorType>,
        meta: NodeMeta,
    ) -> Vec<Value> {
        let results: Vec<Value> = tys.iter().map(|_| self.fresh_value_id()).collect();
        self.insert_typed_with_ids(at, op, operands, tys, &results, meta);
        results
    }

    /// Like `insert_typed`, with caller-chosen result ids (the parser keeps ids).
    pub fn insert_typed_with_ids(
        &mut self,
        at: At,
        op: Op,
        operands: &[Value],
        tys: Vec<TensorType>,
        results: &[Value],
        meta: NodeMeta,
    ) -> Node {
        let node = Node(self.nodes.len() as u32);
        for (i, (v, ty)) in results.iter().zip(tys).enumerate() {
            let idx = v.0 as usize;
            if self.values.len() <= idx {
                self.values.resize(idx + 1, None);
            }
            self.values[idx] = Some(ValueData {
                ty,
                def: node,
                index: i as u32,
            });
        }
        self.nodes.push(Some(NodeData {
            op,
            operands: operands.to_vec(),
            results: results.to_vec(),
            meta,
        }));
        match at {
            At::End => self.order.push(node),
            At::Before(n) => {
                let i = self.position(n).unwrap_or(self.order.len());
                self.order.insert(i, node);
            }
            At::After(n) => {
                let i = self.position(n).map(|i| i + 1).unwrap_or(self.order.len());
                self.order.insert(i, node);
            }
        }
        node
    }

    fn fresh_value_id(&mut self) -> Value {
        let v = Value(self.values.len() as u32);
        self.values.push(None);
        v
    }

    /// Names a graph output (`loss`, `logits`, `grad.<param>`); replaces an existing one.
    pub fn set_output(&mut self, name: &str, v: Value) {
        if let Some(o) = self.outputs.iter_mut().find(|(n, _)| n == name) {
            o.1 = v;
        } else {
            self.outputs.push((name.to_string(), v));
        }
    }

    pub fn remove_output(&mut self, name: &str) {
        self.outputs.retain(|(n, _)| n != name);
        self.output_splits.retain(|(n, _)| n != name);
    }

    /// Records that output `name` is split along `dim` over the ranks of `axis`
    /// (contiguous blocks in coordinate order). Several calls nest: the first is outermost.
    pub fn add_output_split(&mut self, name: &str, dim: usize, axis: &str) {
        match self.output_splits.iter_mut().find(|(n, _)| n == name) {
            Some((_, s)) => s.push((dim, axis.to_string())),
            None => self
                .output_splits
                .push((name.to_string(), vec![(dim, axis.to_string())])),
        }
    }

    /// How output `name` is split across ranks (empty: replicated).
    pub fn output_split(&self, name: &str) -> &[(usize, String)] {
        self.output_splits
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s.as_slice())
            .unwrap_or(&[])
    }

    pub fn output_splits(&self) -> &[(String, Vec<(usize, String)>)] {
        &self.output_splits
    }

    /// Records that parameter `name` is split by `p` (after any earlier partitions of it).
    pub fn add_param_partition(&mut self, name: &str, p: crate::partition::Partition) {
        match self.param_partitions.iter_mut().find(|(n, _)| n == name) {
            Some((_, v)) => v.push(p),
            None => self.param_partitions.push((name.to_string(), vec![p])),
        }
    }

    /// How parameter `name` is split (empty: replicated).
    pub fn param_partition(&self, name: &str) -> &[crate::partition::Partition] {
        self.param_partitions
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
            .unwrap_or(&[])
    }

    pub fn param_partitions(&self) -> &[(String, Vec<crate::partition::Partition>)] {
        &self.param_partitions
    }

    pub fn clear_param_partitions(&mut self, name: &str) {
        self.param_partitions.retain(|(n, _)| n != name);
    }

    // ---- queries ----

    pub fn outputs(&self) -> &[(String, Value)] {
        &self.outputs
    }

    pub fn output(&self, name: &str) -> Option<Value> {
        self.outputs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
    }

    /// Live nodes in program order.
    pub fn nodes(&self) -> &[Node] {
        &self.order
    }

    pub fn node_count(&self) -> usize {
        self.order.len()
    }

    pub fn node(&self, n: Node) -> &NodeData {
        self.nodes[n.0 as usize].as_ref().expect("node was removed")
    }

    pub fn try_node(&self, n: Node) -> Option<&NodeData> {
        self.nodes.get(n.0 as usize).and_then(|x| x.as_ref())
    }

    pub fn node_mut(&mut self, n: Node) -> &mut NodeData {
        self.nodes[n.0 as usize].as_mut().expect("node was removed")
    }

    pub fn value(&self, v: Value) -> &ValueData {
        self.values[v.0 as usize]
            .as_ref()
            .expect("value was removed")
    }

    pub fn try_value(&self, v: Value) -> Option<&ValueData> {
        self.values.get(v.0 as usize).and_then(|x| x.as_ref())
    }

    pub fn ty(&self, v: Value) -> &TensorType {
        &self.value(v).ty
    }

    pub fn try_ty(&self, v: Value) -> Option<&TensorType> {
        self.try_value(v).map(|d| &d.ty)
    }

    /// The node that defines `v`.
    pub fn def(&self, v: Value) -> Node {
        self.value(v).def
    }

    pub fn op_of(&self, v: Value) -> &Op {
        &self.node(self.def(v)).op
    }

    pub fn position(&self, n: Node) -> Option<usize> {
        self.order.iter().position(|x| *x == n)
    }

    /// One past the largest value id ever allocated.
    pub fn value_capacity(&self) -> usize {
        self.values.len()
    }

    /// Uses of every value, as `(node, operand index)`, in program order.
    pub fn uses(&self) -> Vec<Vec<(Node, usize)>> {
        let mut uses = vec![Vec::new(); self.values.len()];
        for &n in &self.order {
            for (i, v) in self.node(n).operands.iter().enumerate() {
                if let Some(u) = uses.get_mut(v.0 as usize) {
                    u.push((n, i));
                }
            }
        }
        uses
    }

    /// Uses of one value, as `(node, operand index)`, in program order: one scan of the
    /// operands, without the table of every value's uses that [`Graph::uses`] builds.
    pub fn uses_of(&self, v: Value) -> Vec<(Node, usize)> {
        let mut out = Vec::new();
        for &n in &self.order {
            for (i, x) in self.node(n).operands.iter().enumerate() {
                if *x == v {
                    out.push((n, i));
                }
            }
        }
        out
    }

    /// Parameters as `(name, value)` in program order.
    pub fn params(&self) -> Vec<(String, Value)> {
        self.order
            .iter()
            .filter_map(|&n| match &self.node(n).op {
                Op::Param { name, .. } => Some((name.clone(), self.node(n).results[0])),
                _ => None,
            })
            .collect()
    }

    /// Inputs as `(name, role, value)` in program order.
    pub fn inputs(&self) -> Vec<(String, crate::attrs::Role, Value)> {
        self.order
            .iter()
            .filter_map(|&n| match &self.node(n).op {
                Op::Input { name, role, .. } => {
                    Some((name.clone(), *role, self.node(n).results[0]))
                }
                _ => None,
            })
            .collect()
    }

    /// Data-dependent sizes: symbols that the `rows` of an `all_to_all_v` names (see
    /// [`Op::defined_symbol`]) and no input type and no mesh axis defines, each with the
    /// first such node in program order, which defines it. Later ones naming it (the
    /// transpose of the return exchange receives the dispatched rows again) use it, and
    /// the runtime checks their count. Plan-time checks skip sizes that mention these
    /// symbols, and the runtime binds each on every rank from the tensor its defining
    /// node produced there. The verifier checks that none is used before it is defined.
    pub fn runtime_symbols(&self) -> Vec<(String, Node)> {
        let mut taken: std::collections::BTreeSet<String> =
            self.mesh.axes.iter().map(|(a, _)| a.clone()).collect();
        for (_, _, v) in self.inputs() {
            for d in &self.ty(v).shape {
                taken.extend(d.symbols());
            }
        }
        let mut out = Vec::new();
        for &n in &self.order {
            if let Some(s) = self.node(n).op.defined_symbol() {
                if taken.insert(s.clone()) {
                    out.push((s, n));
                }
            }
        }
        out
    }

    /// An upper bound of the data-dependent size node `n` defines, for sizing buffers
    /// before the run: an `all_to_all_v` receives at most every rank's rows, `rows(x) *
    /// axis` when the ranks of its axis send equally many (as the SPMD programs
    /// `expert-parallel` makes do: each rank's tokens times top-k).
    pub fn runtime_symbol_bound(&self, n: Node) -> Option<crate::dim::Dim> {
        match &self.node(n).op {
            Op::AllToAllV { axis, .. } => Some(
                self.ty(self.node(n).operands[0]).shape[0].clone() * crate::dim::Dim::sym(axis),
            ),
            _ => None,
        }
    }

    /// The text location of a node for messages: `node %12 (model.layers.3.mlp)`.
    pub fn describe(&self, n: Node) -> String {
        let d = self.node(n);
        let id = d
            .results
            .first()
            .map(|v| v.to_string())
            .unwrap_or_else(|| format!("#{}", n.0));
        match &d.meta.source {
            Some(s) => format!("node {id} ({s})"),
            None => format!("node {id}"),
        }
    }

    // ---- rewriting ----

    /// Makes every use of `old` (including outputs) use `new` instead.
    pub fn replace_all_uses(&mut self, old: Value, new: Value) {
        for &n in &self.order {
            for v in self.nodes[n.0 as usize]
                .as_mut()
                .unwrap()
                .operands
                .iter_mut()
            {
                if *v == old {
                    *v = new;
                }
            }
        }
        for o in &mut self.outputs {
            if o.1 == old {
                o.1 = new;
            }
        }
    }

    /// Outputs that name `old` name `new` instead (the operands are left alone).
    pub fn replace_output_uses(&mut self, old: Value, new: Value) {
        for o in &mut self.outputs {
            if o.1 == old {
                o.1 = new;
            }
        }
    }

    /// Like `replace_all_uses`, but leaves the uses by `except` alone.
    pub fn replace_uses_except(&mut self, old: Value, new: Value, except: Node) {
        for &n in &self.order {
            if n == except {
                continue;
            }
            for v in self.nodes[n.0 as usize]
                .as_mut()
                .unwrap()
                .operands
                .iter_mut()
            {
                if *v == old {
                    *v = new;
                }
            }
        }
        for o in &mut self.outputs {
            if o.1 == old {
                o.1 = new;
            }
        }
    }

    /// Removes a node; its results must be unused (the verifier catches dangling uses).
    pub fn remove_node(&mut self, n: Node) {
        if let Some(d) = self.nodes[n.0 as usize].take() {
            for v in d.results {
                self.values[v.0 as usize] = None;
            }
        }
        self.order.retain(|x| *x != n);
    }

    /// Removes many nodes at once (linear time).
    pub fn remove_nodes(&mut self, dead: &[Node]) {
        let mut is_dead = vec![false; self.nodes.len()];
        for &n in dead {
            is_dead[n.0 as usize] = true;
            if let Some(d) = self.nodes[n.0 as usize].take() {
                for v in d.results {
                    self.values[v.0 as usize] = None;
                }
            }
        }
        self.order.retain(|x| !is_dead[x.0 as usize]);
    }

    /// Re-infers the result types of `n` from its operands (after an operand changed).
    pub fn reinfer(&mut self, n: Node) -> Result<(), BuildError> {
        let d = self.node(n);
        let ins: Vec<&TensorType> = d.operands.iter().map(|v| self.ty(*v)).collect();
        let tys = d.op.infer(&ins).map_err(|message| BuildError {
            op: d.op.name().into(),
            location: self.describe(n),
            message,
        })?;
        let results = d.results.clone();
        for (v, t) in results.iter().zip(tys) {
            self.values[v.0 as usize].as_mut().unwrap().ty = t;
        }
        Ok(())
    }

    /// Replaces the program order (a pass that reorders provides a permutation of the
    /// live nodes; the verifier checks it stays topological).
    pub fn set_order(&mut self, order: Vec<Node>) {
        self.order = order;
    }

    /// The graph as a petgraph `DiGraph` (edges def -> use), for algorithms.
    ///
    /// Where petgraph has the algorithm, use it (the checkpoint budget's max-flow is
    /// `petgraph::algo::dinics`). Passes still walk the IR itself (`def`, `uses`) for
    /// reachability that stops at some ops (at resident values, outside a layer, at
    /// a collective) and for the priority toposort of `micro-batches`: petgraph's
    /// `Dfs`/`toposort` would need this copy plus a filter, for no gain; those walks
    /// are iterative (an explicit stack), so their depth does not grow with the graph.
    pub fn to_petgraph(
        &self,
    ) -> (
        petgraph::graph::DiGraph<Node, Value>,
        Vec<Option<petgraph::graph::NodeIndex>>,
    ) {
        let mut pg = petgraph::graph::DiGraph::new();
        let mut index = vec![None; self.nodes.len()];
        for &n in &self.order {
            index[n.0 as usize] = Some(pg.add_node(n));
        }
        for &n in &self.order {
            for v in &self.node(n).operands {
                if let Some(d) = self.try_value(*v) {
                    if let (Some(a), Some(b)) = (index[d.def.0 as usize], index[n.0 as usize]) {
                        pg.add_edge(a, b, *v);
                    }
                }
            }
        }
        (pg, index)
    }
}

/// Graphs are equal when their live nodes, in program order, have equal ops, operands,
/// result ids, types and metadata, and their names, meshes and outputs are equal.
/// Internal node ids (never printed) do not matter.
impl PartialEq for Graph {
    fn eq(&self, o: &Graph) -> bool {
        if self.name != o.name
            || self.mesh != o.mesh
            || self.outputs != o.outputs
            || self.output_splits != o.output_splits
            || self.param_partitions != o.param_partitions
            || self.order.len() != o.order.len()
        {
            return false;
        }
        self.order.iter().zip(&o.order).all(|(&a, &b)| {
            let (x, y) = (self.node(a), o.node(b));
            x.op == y.op
                && x.operands == y.operands
                && x.results == y.results
                && x.meta == y.meta
                && x.results.iter().all(|v| self.ty(*v) == o.ty(*v))
        })
    }
}
