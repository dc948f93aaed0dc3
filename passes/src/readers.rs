//! An index of every value's readers that rewrites keep up to date as they go.
//!
//! A pattern pass scans thousands of candidates (every `add` of a 405B step) and
//! rewrites many of them; rebuilding `Graph::uses` after each rewrite, or scanning the
//! whole program to replace one value, made such passes quadratic in the step's size
//! (70 s for `fuse` on a 130k-node step). Rewrites made through [`Readers`] touch only
//! the nodes involved. Readers of one value are kept in no particular order: callers
//! that choose among several readers sort them by program position.

use weft_ir::{At, BuildError, Graph, Node, NodeMeta, Op, Value};

pub struct Readers {
    uses: Vec<Vec<(Node, usize)>>,
}

impl Readers {
    /// The readers of every value of `g` (outputs not included).
    pub fn of(g: &Graph) -> Readers {
        Readers { uses: g.uses() }
    }

    /// The `(node, operand index)` pairs reading `v`.
    pub fn of_value(&self, v: Value) -> &[(Node, usize)] {
        self.uses.get(v.0 as usize).map_or(&[], Vec::as_slice)
    }

    /// True when `v` is read only by node `n`, once, and is no output of `g`.
    pub fn read_only_by(&self, g: &Graph, v: Value, n: Node) -> bool {
        matches!(self.of_value(v), [(m, _)] if *m == n) && !g.outputs().iter().any(|(_, o)| *o == v)
    }

    /// The first node in program order, other than those in `except`, reading any of
    /// `values`: its position in `g`'s order.
    pub fn first_reader(&self, g: &Graph, values: &[Value], except: &[Node]) -> Option<usize> {
        values
            .iter()
            .flat_map(|&v| self.of_value(v))
            .filter(|(n, _)| !except.contains(n))
            .filter_map(|&(n, _)| g.position(n))
            .min()
    }

    fn add(&mut self, v: Value, reader: (Node, usize)) {
        let i = v.0 as usize;
        if self.uses.len() <= i {
            self.uses.resize_with(i + 1, Vec::new);
        }
        self.uses[i].push(reader);
    }

    fn forget(&mut self, v: Value, reader: (Node, usize)) {
        if let Some(u) = self.uses.get_mut(v.0 as usize) {
            u.retain(|r| *r != reader);
        }
    }

    /// `g.insert_with`, recording the new node's reads.
    pub fn insert(
        &mut self,
        g: &mut Graph,
        at: At,
        op: Op,
        operands: &[Value],
        meta: NodeMeta,
    ) -> Result<Vec<Value>, BuildError> {
        let results = g.insert_with(at, op, operands, meta)?;
        if let Some(&r) = results.first() {
            let n = g.def(r);
            for (i, &v) in operands.iter().enumerate() {
                self.add(v, (n, i));
            }
        }
        Ok(results)
    }

    /// `g.replace_all_uses(old, new)`, visiting only `old`'s readers and the outputs.
    pub fn replace_all_uses(&mut self, g: &mut Graph, old: Value, new: Value) {
        if old == new {
            return;
        }
        let moved = self
            .uses
            .get_mut(old.0 as usize)
            .map(std::mem::take)
            .unwrap_or_default();
        for &(n, i) in &moved {
            g.node_mut(n).operands[i] = new;
            self.add(new, (n, i));
        }
        g.replace_output_uses(old, new);
    }

    /// Operand `i` of node `n` becomes `v`.
    pub fn set_operand(&mut self, g: &mut Graph, n: Node, i: usize, v: Value) {
        let old = g.node(n).operands[i];
        self.forget(old, (n, i));
        g.node_mut(n).operands[i] = v;
        self.add(v, (n, i));
    }

    /// `g.remove_nodes(dead)`, forgetting their reads.
    pub fn remove_nodes(&mut self, g: &mut Graph, dead: &[Node]) {
        for &n in dead {
            let Some(d) = g.try_node(n) else { continue };
            let reads: Vec<(usize, Value)> = d.operands.iter().copied().enumerate().collect();
            for (i, v) in reads {
                self.forget(v, (n, i));
            }
        }
        g.remove_nodes(dead);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_ir::{DType, TensorType};

    fn param(g: &mut Graph, name: &str) -> Value {
        let ty = TensorType::new(DType::F32, vec![weft_ir::Dim::from(4)]);
        g.insert_with(
            At::End,
            Op::Param {
                name: name.into(),
                ty,
            },
            &[],
            NodeMeta::default(),
        )
        .unwrap()[0]
    }

    /// After a sequence of rewrites through the index, it equals a fresh scan (up to
    /// the order of each value's readers).
    #[test]
    fn rewrites_keep_the_index_equal_to_a_fresh_scan() {
        let mut g = Graph::new("readers");
        let a = param(&mut g, "a");
        let b = param(&mut g, "b");
        let mut rd = Readers::of(&g);
        let s = rd
            .insert(&mut g, At::End, Op::Add {}, &[a, b], NodeMeta::default())
            .unwrap()[0];
        let t = rd
            .insert(&mut g, At::End, Op::Mul {}, &[s, a], NodeMeta::default())
            .unwrap()[0];
        g.set_output("t", t);
        let (tn, sn) = (g.def(t), g.def(s));
        let u = rd
            .insert(
                &mut g,
                At::Before(tn),
                Op::Sub {},
                &[b, a],
                NodeMeta::default(),
            )
            .unwrap()[0];
        rd.replace_all_uses(&mut g, s, u);
        rd.set_operand(&mut g, tn, 1, b);
        rd.remove_nodes(&mut g, &[sn]);
        let mut fresh = g.uses();
        let mut kept = rd.uses.clone();
        kept.resize_with(fresh.len().max(kept.len()), Vec::new);
        fresh.resize_with(kept.len(), Vec::new);
        for u in fresh.iter_mut().chain(kept.iter_mut()) {
            u.sort();
        }
        assert_eq!(kept, fresh);
        assert!(rd.read_only_by(&g, u, g.def(t)));
        assert!(
            !rd.read_only_by(&g, t, g.def(t)),
            "an output is never read only by a node"
        );
        assert_eq!(rd.first_reader(&g, &[b], &[]), g.position(g.def(u)));
    }
}
