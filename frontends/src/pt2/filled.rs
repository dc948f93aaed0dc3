//! A tensor allocated empty and filled through `copy_` into slices that tile it, as
//! transformers' DeepSeek-V3 assembles MLA's key:
//!
//! ```text
//! k = k_pass.new_empty([B, N, S, nope + rope])
//! k[..., :nope] = k_pass;  k[..., nope:] = k_rot.expand(...)
//! ```
//!
//! (exported as `new_empty`, `slice`, `copy_`). Once in-place ops are functional the
//! writes would be lost, so the whole pattern is read as `cat(sources, dim)`, placed at
//! the last write. It is recognised only exactly: every use of the empty tensor before
//! its first read is a step-1 `slice` on one dim whose single use is a `copy_` of a
//! source of the slice's recorded shape, the slices tile the dim without gap or
//! overlap, and no slice or copy result is read elsewhere. Anything else is left as is,
//! and the lowering refuses `new_empty` by its node name. After `run_decompositions()`
//! the writes are functional (`empty`, `slice_scatter`): scatter.rs lowers those.

use super::fx::{FxGraph, FxNode};
use super::schema::{Arg, SymInt};
use std::collections::{BTreeMap, BTreeSet};

/// One `copy_` into a slice of the empty tensor.
struct Write {
    start: i64,
    end: i64,
    source: String,
    /// Indices of the slice and copy nodes.
    nodes: [usize; 2],
}

/// Rewrites every recognised fill of an empty tensor into a `cat`; returns the names of
/// the tensors so assembled.
pub fn fold(fx: &mut FxGraph) -> Vec<String> {
    let mut folded = Vec::new();
    let empties: Vec<usize> = (0..fx.nodes.len())
        .filter(|&i| fx.nodes[i].op == "aten.new_empty.default")
        .collect();
    if empties.is_empty() {
        return folded;
    }
    // Value name -> the nodes reading it, in program order.
    let mut users: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (j, n) in fx.nodes.iter().enumerate() {
        for a in n.tensor_args() {
            let at = users.entry(a.to_string()).or_default();
            if at.last() != Some(&j) {
                at.push(j);
            }
        }
    }
    let mut cats: BTreeMap<usize, Vec<FxNode>> = BTreeMap::new();
    let mut removed: BTreeSet<usize> = BTreeSet::new();
    for e in empties {
        let Some(name) = fx.nodes[e].out().map(str::to_string) else {
            continue;
        };
        if let Some((dim, writes)) = writes_tiling(fx, &users, &name) {
            let last = writes.iter().map(|w| w.nodes[1]).max().unwrap_or(e);
            let n = &fx.nodes[e];
            cats.entry(last).or_default().push(FxNode {
                op: "aten.cat.default".into(),
                name: n.name.clone(),
                args: vec![
                    (
                        "tensors".into(),
                        Arg::Tensors(writes.iter().map(|w| w.source.clone()).collect()),
                    ),
                    ("dim".into(), Arg::Int(dim)),
                ],
                outputs: vec![Some(name.clone())],
                scope: n.scope.clone(),
            });
            removed.insert(e);
            removed.extend(writes.iter().flat_map(|w| w.nodes));
            folded.push(name);
        }
    }
    if folded.is_empty() {
        return folded;
    }
    let old = std::mem::take(&mut fx.nodes);
    for (i, n) in old.into_iter().enumerate() {
        if !removed.contains(&i) {
            fx.nodes.push(n);
        }
        fx.nodes.extend(cats.remove(&i).unwrap_or_default());
    }
    folded
}

/// `(dim, writes in order)` when the uses of the empty tensor `name` (node `e`) before
/// its first read are slice-and-copy writes tiling one dim.
fn writes_tiling(
    fx: &FxGraph,
    readers: &BTreeMap<String, Vec<usize>>,
    name: &str,
) -> Option<(i64, Vec<Write>)> {
    let meta = fx.tensor_meta.get(name)?;
    let rank = meta.sizes.len() as i64;
    let users = |v: &str| -> Vec<usize> { readers.get(v).cloned().unwrap_or_default() };
    let mut writes = Vec::new();
    let mut dim = None;
    let mut first_read = usize::MAX;
    for j in users(name) {
        let s = &fx.nodes[j];
        let is_write = s.op == "aten.slice.Tensor" && s.arg_at(0) == &Arg::Tensor(name.into());
        if !is_write {
            first_read = first_read.min(j);
            continue;
        }
        let int = |a: &Arg, none: i64| match a {
            Arg::Int(i) => Some(*i),
            Arg::None => Some(none),
            _ => None,
        };
        let d = int(s.arg_at(1), 0)?;
        let d = if d < 0 { d + rank } else { d };
        let size = match meta.sizes.get(usize::try_from(d).ok()?)? {
            SymInt::Int(i) => *i,
            SymInt::Expr { .. } => return None,
        };
        let (start, end, step) = (
            int(s.arg_at(2), 0)?,
            int(s.arg_at(3), i64::MAX)?,
            int(s.arg_at(4), 1)?,
        );
        if step != 1 || !(0..size).contains(&start) || *dim.get_or_insert(d) != d {
            return None;
        }
        let slice = s.out()?;
        let [c] = users(slice)[..] else {
            return None;
        };
        let copy = &fx.nodes[c];
        if copy.op != "aten.copy.default" || copy.arg_at(0) != &Arg::Tensor(slice.into()) {
            return None;
        }
        let Arg::Tensor(source) = copy.arg_at(1) else {
            return None;
        };
        let same_shape = fx.tensor_meta.get(source).map(|m| &m.sizes)
            == fx.tensor_meta.get(slice).map(|m| &m.sizes);
        if !same_shape || copy.out().is_some_and(|o| !users(o).is_empty()) {
            return None;
        }
        writes.push(Write {
            start,
            end: end.min(size),
            source: source.clone(),
            nodes: [j, c],
        });
    }
    let dim = dim?;
    let size = match &meta.sizes[dim as usize] {
        SymInt::Int(i) => *i,
        SymInt::Expr { .. } => return None,
    };
    writes.sort_by_key(|w| w.start);
    let mut at = 0;
    for w in &writes {
        if w.start != at || w.end <= w.start || w.nodes[1] > first_read {
            return None;
        }
        at = w.end;
    }
    (at == size).then_some((dim, writes))
}

#[cfg(test)]
mod tests {
    use super::fold;
    use crate::pt2::fx::{FxGraph, FxNode};
    use crate::pt2::schema::{Arg, SymInt, TensorMeta};

    fn node(op: &str, out: &str, args: Vec<Arg>) -> FxNode {
        FxNode::for_test(op, out, args)
    }

    fn meta(cols: i64) -> TensorMeta {
        TensorMeta {
            dtype: 7,
            sizes: vec![SymInt::Int(2), SymInt::Int(cols)],
            strides: vec![SymInt::Int(cols), SymInt::Int(1)],
            storage_offset: SymInt::Int(0),
            requires_grad: false,
        }
    }

    /// `e = new_empty([2, 12])`, written as columns `[0, split)` from `a` and
    /// `[split, 12)` from `b`, then read by `use`; `late` moves the second write after
    /// the read.
    fn program(split: i64, late: bool) -> FxGraph {
        let t = |s: &str| Arg::Tensor(s.into());
        let slice = |out: &str, start: i64, end: i64| {
            node(
                "aten.slice.Tensor",
                out,
                vec![
                    t("e"),
                    Arg::Int(1),
                    Arg::Int(start),
                    Arg::Int(end),
                    Arg::Int(1),
                ],
            )
        };
        let mut nodes = vec![
            node("aten.new_empty.default", "e", vec![t("a"), Arg::None]),
            slice("s0", 0, split),
            node("aten.copy.default", "c0", vec![t("s0"), t("a")]),
            slice("s1", split, i64::MAX),
            node("aten.copy.default", "c1", vec![t("s1"), t("b")]),
            node("aten.relu.default", "use", vec![t("e")]),
        ];
        if late {
            let read = nodes.pop().unwrap();
            nodes.insert(3, read);
        }
        let mut fx = FxGraph {
            nodes,
            ..Default::default()
        };
        for (name, cols) in [
            ("a", 8),
            ("b", 4),
            ("e", 12),
            ("s0", split),
            ("c0", split),
            ("s1", 12 - split),
            ("c1", 12 - split),
            ("use", 12),
        ] {
            fx.tensor_meta.insert(name.into(), meta(cols));
        }
        fx
    }

    fn ops(fx: &FxGraph) -> Vec<String> {
        fx.nodes.iter().map(|n| n.base().to_string()).collect()
    }

    #[test]
    fn writes_tiling_the_dim_become_a_cat_before_the_read() {
        let mut fx = program(8, false);
        assert_eq!(fold(&mut fx), ["e"]);
        assert_eq!(ops(&fx), ["cat", "relu"]);
        let cat = &fx.nodes[0];
        assert_eq!(cat.out(), Some("e"));
        assert_eq!(cat.arg_at(0), &Arg::Tensors(vec!["a".into(), "b".into()]));
        assert_eq!(cat.arg_at(1), &Arg::Int(1));
    }

    #[test]
    fn a_source_of_another_shape_is_left_alone() {
        // Columns [0, 9) from the 8 columns of `a`: copy_ would broadcast, not a cat part.
        let mut fx = program(9, false);
        assert!(fold(&mut fx).is_empty());
        assert_eq!(ops(&fx).len(), 6);
    }

    #[test]
    fn a_write_after_a_read_is_left_alone() {
        let mut fx = program(8, true);
        assert!(fold(&mut fx).is_empty());
        assert_eq!(ops(&fx)[0], "new_empty");
    }
}
