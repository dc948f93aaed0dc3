//! Nodes meant to go before or after others, spliced into the program order at once.
//!
//! `Graph::insert_with(At::Before(n), ..)` finds `n` in the order and shifts everything
//! after it: linear in the step's size for each node, quadratic for a pass that lowers
//! thousands of ops into 100k nodes (`ring-lower` on a 405B step). A pass that does not
//! read the order while it rewrites appends its nodes instead ([`At::End`]), records
//! where each belongs, and calls [`Placement::finish`] once: the order it makes is the
//! one the same inserts at `At::Before` / `At::After` would have made. Nodes already in
//! the order move the same way (`zero::prefetch_gathers`).

use crate::readers::Readers;
use weft_ir::{At, BuildError, Graph, Node, NodeMeta, Op, Value};

#[derive(Default)]
pub struct Placement {
    /// Per node id: the nodes recorded before it, in the order they were made.
    before: Vec<Vec<Node>>,
    /// Per node id: the nodes recorded after it, in the order they were made.
    after: Vec<Vec<Node>>,
    /// Per node id: whether it was recorded (it waits at the end of the order).
    pending: Vec<bool>,
}

impl Placement {
    pub fn new() -> Placement {
        Placement::default()
    }

    /// Records that `n` (just appended to `g`'s order, or a node already in it that
    /// moves) belongs at `at`. `At::End` leaves it where it is.
    pub fn record(&mut self, n: Node, at: At) {
        let (list, anchor) = match at {
            At::End => return,
            At::Before(a) => (&mut self.before, a),
            At::After(a) => (&mut self.after, a),
        };
        let i = anchor.0 as usize;
        if list.len() <= i {
            list.resize_with(i + 1, Vec::new);
        }
        list[i].push(n);
        let j = n.0 as usize;
        if self.pending.len() <= j {
            self.pending.resize(j + 1, false);
        }
        self.pending[j] = true;
    }

    /// `rd.insert` at the end of the order, recording that the new node belongs at `at`.
    pub fn insert(
        &mut self,
        g: &mut Graph,
        rd: &mut Readers,
        at: At,
        op: Op,
        operands: &[Value],
        meta: NodeMeta,
    ) -> Result<Vec<Value>, BuildError> {
        let results = rd.insert(g, At::End, op, operands, meta)?;
        let made = *g.nodes().last().expect("a node was just made");
        self.record(made, at);
        Ok(results)
    }

    /// Moves every recorded node to its place (linear in the order's length). Nodes
    /// recorded before one anchor keep the order they were made in; those recorded
    /// after one go in the reverse order (each `At::After` goes right after the anchor).
    /// An anchor may itself be a recorded node. Recorded nodes removed meanwhile are
    /// dropped, as are those whose anchor left the order.
    pub fn finish(self, g: &mut Graph) {
        if !self.pending.iter().any(|&p| p) {
            return;
        }
        let pending = |n: Node| self.pending.get(n.0 as usize).copied().unwrap_or(false);
        let mut order = Vec::with_capacity(g.node_count());
        // (node, whether its `before` list was emitted): an explicit stack, as chains of
        // `At::After` can be long.
        let mut stack: Vec<(Node, bool)> = Vec::new();
        for &n in g.nodes().iter().filter(|&&n| !pending(n)) {
            stack.push((n, false));
            while let Some((m, expanded)) = stack.pop() {
                let i = m.0 as usize;
                if expanded {
                    order.push(m);
                    continue;
                }
                // Emitted in this sequence: before[m] (made order), m, after[m] (reverse).
                if let Some(a) = self.after.get(i) {
                    stack.extend(a.iter().map(|&x| (x, false)));
                }
                stack.push((m, true));
                if let Some(b) = self.before.get(i) {
                    stack.extend(b.iter().rev().map(|&x| (x, false)));
                }
            }
        }
        order.retain(|&n| g.try_node(n).is_some());
        g.set_order(order);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_ir::{DType, TensorType};

    fn param(g: &mut Graph, at: At, name: &str) -> Node {
        let ty = TensorType::new(DType::F32, vec![weft_ir::Dim::from(4)]);
        let op = Op::Param {
            name: name.into(),
            ty,
        };
        let v = g.insert_with(at, op, &[], NodeMeta::default()).unwrap()[0];
        g.def(v)
    }

    fn names(g: &Graph) -> Vec<String> {
        g.nodes()
            .iter()
            .map(|&n| match &g.node(n).op {
                Op::Param { name, .. } => name.clone(),
                _ => unreachable!(),
            })
            .collect()
    }

    /// Recorded inserts give the order that inserting at each place at once gives.
    #[test]
    fn finish_gives_the_order_of_inserting_in_place() {
        let mut direct = Graph::new("direct");
        let mut deferred = Graph::new("deferred");
        let a = param(&mut direct, At::End, "a");
        let b = param(&mut direct, At::End, "b");
        assert_eq!(param(&mut deferred, At::End, "a"), a);
        assert_eq!(param(&mut deferred, At::End, "b"), b);
        let mut place = Placement::new();
        let mut made = Vec::new();
        // (name, anchor: an earlier node by index into `made` or a/b, before?)
        let steps: [(&str, Option<usize>, Node, bool); 7] = [
            ("x1", None, b, true),
            ("x2", None, b, true),
            ("y1", None, a, false),
            ("y2", None, a, false),
            ("z1", Some(0), a, false),
            ("z2", Some(0), a, true),
            ("w", Some(4), a, false),
        ];
        for (name, earlier, anchor, before) in steps {
            let anchor = earlier.map_or(anchor, |i| made[i]);
            let at = if before {
                At::Before(anchor)
            } else {
                At::After(anchor)
            };
            let n = param(&mut direct, at, name);
            assert_eq!(param(&mut deferred, At::End, name), n);
            place.record(n, at);
            made.push(n);
        }
        place.finish(&mut deferred);
        assert_eq!(names(&deferred), names(&direct));
        assert_eq!(
            names(&direct),
            ["a", "y2", "y1", "z2", "x1", "z1", "w", "x2", "b"]
        );
    }
}
