//! The backward rule of every non-collective op: given the gradients of its results,
//! the gradient of each operand that needs one. Broadcasting is undone by summing
//! (`unbroadcast`), layout ops by their inverses, `slice` by a zero-padded `concat`,
//! `split` and `concat` by each other, index ops by `scatter_add` into zeros, the
//! top-k values likewise, `moe_dispatch` by a `moe_combine` with unit weights, and
//! `rope` by `rope` with the sine negated (cos and sin are symmetric in their halves).
//!
//! This file holds the shared helpers and [`Ad::vjp`], which sends ops with several
//! results to their own rules and tries the family rules of the sibling files in turn
//! for the rest (each answers `None` for an op not its own):
//!
//! - `elementwise.rs`: unary elementwise ops (`exp`, `silu`, `gelu`, `cast`, ...);
//! - `binary.rs`: broadcasting binary ops (`add`, `mul`, `maximum`, `where`, ...);
//! - `reductions.rs`: `sum`, `mean`, `max`, `softmax`, `log_softmax`, `topk`;
//! - `layout.rs`: layout and index ops (`reshape`, `slice`, `split`, `gather`, ...);
//! - `blocks.rs`: transformer blocks (`linear`, `matmul`, `rms_norm`, `rope`, the losses);
//! - `attention.rs`: `attention` and `ring_attention`;
//! - `moe.rs`: `grouped_matmul`, `moe_dispatch`, `moe_combine`;
//! - `fused.rs`: `add_rms_norm`.

use super::{err, Ad};
use crate::pass::PassError;
use weft_ir::{DType, Dim, Float, Node, NodeData, Op, TensorType, Value};

mod attention;
mod binary;
mod blocks;
mod elementwise;
mod fused;
mod layout;
mod moe;
mod reductions;

impl Ad<'_> {
    fn zeros(&mut self, ty: &TensorType) -> Result<Value, PassError> {
        self.op(
            Op::Full {
                value: Float(0.0),
                ty: ty.clone(),
            },
            &[],
        )
    }

    fn scalar(&mut self, value: f64, dtype: DType) -> Result<Value, PassError> {
        self.op(
            Op::Full {
                value: Float(value),
                ty: TensorType::scalar(dtype),
            },
            &[],
        )
    }

    fn mul(&mut self, a: Value, b: Value) -> Result<Value, PassError> {
        self.op(Op::Mul {}, &[a, b])
    }

    fn reshape(&mut self, x: Value, shape: &[Dim]) -> Result<Value, PassError> {
        if self.g.ty(x).shape == shape {
            return Ok(x);
        }
        self.op(
            Op::Reshape {
                shape: shape.to_vec(),
            },
            &[x],
        )
    }

    fn mask_of(&mut self, cond: Value, dtype: DType) -> Result<Value, PassError> {
        self.op(Op::Cast { dtype }, &[cond])
    }

    /// Sums `g` (the gradient of a broadcast result) down to `target`'s shape: over the
    /// leading dims `target` lacks and the dims where `target` has size 1.
    pub(crate) fn unbroadcast(
        &mut self,
        g: Value,
        target: &TensorType,
    ) -> Result<Value, PassError> {
        let gt = self.ty(g);
        if gt.shape == target.shape {
            return Ok(g);
        }
        let (n, m) = (gt.rank(), target.rank());
        if m > n {
            return Err(err(
                "`autodiff` cannot undo a broadcast",
                self.g.describe(self.g.def(g)),
                format!("{gt} is not a broadcast of {target}"),
            ));
        }
        let lead = n - m;
        let one = Dim::from(1);
        let dims: Vec<i64> = (0..n)
            .filter(|&i| i < lead || (target.shape[i - lead] == one && gt.shape[i] != one))
            .map(|i| i as i64)
            .collect();
        let s = if dims.is_empty() {
            g
        } else {
            self.op(
                Op::Sum {
                    dims,
                    keepdim: false,
                },
                &[g],
            )?
        };
        self.reshape(s, &target.shape)
    }

    /// `reshape(dy)` to `x_ty` with the reduced dims kept as size 1, then expanded.
    fn expand_back(
        &mut self,
        dy: Value,
        x_ty: &TensorType,
        dims: &[usize],
        keepdim: bool,
    ) -> Result<Value, PassError> {
        let kept: Vec<Dim> = x_ty
            .shape
            .iter()
            .enumerate()
            .map(|(i, d)| {
                if dims.contains(&i) {
                    Dim::from(1)
                } else {
                    d.clone()
                }
            })
            .collect();
        let dk = if keepdim {
            dy
        } else {
            self.reshape(dy, &kept)?
        };
        self.op(
            Op::Expand {
                shape: x_ty.shape.clone(),
            },
            &[dk],
        )
    }

    fn norm_dims(&self, n: Node, dims: &[i64], rank: usize) -> Result<Vec<usize>, PassError> {
        dims.iter()
            .map(|&d| {
                weft_ir::shape::norm_dim(d, rank)
                    .map_err(|m| err("`autodiff`: bad dim", self.g.describe(n), m))
            })
            .collect()
    }
    /// The error for an op without a backward rule (a backward or optimizer op, or new).
    fn no_rule(&self, n: Node, op: &Op) -> PassError {
        err(
            format!("`autodiff` has no backward rule for `{}`", op.name()),
            self.g.describe(n),
            "it is a backward or optimizer op, or new",
        )
        .with_help("run autodiff on the forward graph, before grad-sync and the optimizer")
    }

    /// The gradient of each operand (`None`: not wanted or zero) of non-collective node
    /// `n` from its results' gradients `dy` (`None`: zero): dispatches to the rule of
    /// the op's family.
    pub(crate) fn vjp(
        &mut self,
        n: Node,
        d: &NodeData,
        dy: &[Option<Value>],
        want: &[bool],
    ) -> Result<Vec<Option<Value>>, PassError> {
        let none = || vec![None; d.operands.len()];
        // Ops with several results (or whose rule takes several results' gradients)
        // first; the rest have one result and need its gradient.
        match &d.op {
            Op::Split { .. } => return self.vjp_split(n, d, dy),
            Op::Topk { .. } => return self.vjp_topk(n, d, dy),
            Op::MoeDispatch { .. } => return self.vjp_moe_dispatch(n, d, dy),
            Op::LinearCrossEntropy { .. } => return self.vjp_linear_cross_entropy(n, d, dy, want),
            Op::RopeTable { .. } => return Ok(none()),
            Op::AddRmsNorm { .. } => return self.vjp_add_rms_norm(n, d, dy, want),
            Op::Attention { .. } => return self.vjp_attention(n, d, dy, want),
            Op::RingAttention { .. } => return self.vjp_ring_attention(n, d, dy, want),
            _ => {}
        }
        if d.results.len() != 1 {
            return Err(err(
                format!("`autodiff` has no backward rule for `{}`", d.op.name()),
                self.g.describe(n),
                "it has several results",
            ));
        }
        let Some(g) = dy[0] else { return Ok(none()) };
        // Sources and integer-valued ops: no gradient.
        if matches!(
            d.op,
            Op::Param { .. }
                | Op::Input { .. }
                | Op::Full { .. }
                | Op::Arange { .. }
                | Op::Compare { .. }
                | Op::ShiftLabels { .. }
                | Op::CountValid { .. }
                | Op::OneHot { .. }
        ) {
            return Ok(none());
        }
        let families: [Rule<'_>; 6] = [
            Self::vjp_elementwise,
            Self::vjp_binary,
            |ad, n, d, g, _| ad.vjp_reduction(n, d, g),
            Self::vjp_block,
            Self::vjp_layout,
            Self::vjp_moe,
        ];
        for family in families {
            if let Some(grads) = family(self, n, d, g, want)? {
                return Ok(grads);
            }
        }
        Err(self.no_rule(n, &d.op))
    }
}

/// The backward rule of a family of single-result ops: the operands' gradients given
/// the result's, or `None` for an op not of the family.
type Rule<'a> = fn(
    &mut Ad<'a>,
    Node,
    &NodeData,
    Value,
    &[bool],
) -> Result<Option<Vec<Option<Value>>>, PassError>;

#[cfg(test)]
mod tests {
    //! Each family's rule called directly on a one-node graph (and on another family's
    //! op), and the dispatcher's error for an op without a rule.
    use super::*;
    use weft_ir::{Graph, NodeMeta};

    fn param(g: &mut Graph, name: &str, shape: &[i64]) -> Value {
        let ty = TensorType::new(DType::F32, shape.iter().map(|&d| Dim::from(d)).collect());
        let op = Op::Param {
            name: name.into(),
            ty,
        };
        g.add(op, &[]).unwrap()
    }

    /// The node defining `y`, a seed gradient of its type, and a differentiation.
    fn setup(g: &mut Graph, y: Value) -> (Node, NodeData, Value) {
        let ty = g.ty(y).clone();
        let seed = g
            .add(
                Op::Param {
                    name: "dy".into(),
                    ty,
                },
                &[],
            )
            .unwrap();
        let n = g.def(y);
        (n, g.node(n).clone(), seed)
    }

    fn ad(g: &mut Graph) -> Ad<'_> {
        Ad {
            g,
            varying: vec![],
            meta: NodeMeta::default(),
            collectives: 0,
            memo: Default::default(),
        }
    }

    /// The name of the op defining each gradient.
    fn ops_of(g: &Graph, out: &[Option<Value>]) -> Vec<Option<&'static str>> {
        out.iter().map(|o| o.map(|v| g.op_of(v).name())).collect()
    }

    #[test]
    fn elementwise_exp_is_the_gradient_times_the_result() {
        let mut g = Graph::new("t");
        let x = param(&mut g, "x", &[4]);
        let y = g.add(Op::Exp {}, &[x]).unwrap();
        let (n, d, dy) = setup(&mut g, y);
        let out = ad(&mut g)
            .vjp_elementwise(n, &d, dy, &[true])
            .unwrap()
            .unwrap();
        assert_eq!(ops_of(&g, &out), [Some("mul")]);
        assert_eq!(g.node(g.def(out[0].unwrap())).operands, [dy, y]);
    }

    #[test]
    fn binary_add_sums_the_broadcast_operand() {
        let mut g = Graph::new("t");
        let a = param(&mut g, "a", &[4]);
        let b = param(&mut g, "b", &[2, 4]);
        let y = g.add(Op::Add {}, &[a, b]).unwrap();
        let (n, d, dy) = setup(&mut g, y);
        let out = ad(&mut g)
            .vjp_binary(n, &d, dy, &[true, true])
            .unwrap()
            .unwrap();
        assert_eq!(out[1], Some(dy));
        assert_eq!(ops_of(&g, &out[..1]), [Some("sum")]);
        assert_eq!(g.ty(out[0].unwrap()), g.ty(a));
    }

    #[test]
    fn reduction_sum_expands_back() {
        let mut g = Graph::new("t");
        let x = param(&mut g, "x", &[2, 4]);
        let sum = Op::Sum {
            dims: vec![1],
            keepdim: false,
        };
        let y = g.add(sum, &[x]).unwrap();
        let (n, d, dy) = setup(&mut g, y);
        let out = ad(&mut g).vjp_reduction(n, &d, dy).unwrap().unwrap();
        assert_eq!(ops_of(&g, &out), [Some("expand")]);
        assert_eq!(g.ty(out[0].unwrap()), g.ty(x));
    }

    #[test]
    fn layout_transpose_is_its_own_inverse() {
        let mut g = Graph::new("t");
        let x = param(&mut g, "x", &[2, 4]);
        let y = g.add(Op::Transpose { dim0: 0, dim1: 1 }, &[x]).unwrap();
        let (n, d, dy) = setup(&mut g, y);
        let out = ad(&mut g).vjp_layout(n, &d, dy, &[true]).unwrap().unwrap();
        assert_eq!(ops_of(&g, &out), [Some("transpose")]);
        assert_eq!(g.ty(out[0].unwrap()), g.ty(x));
    }

    #[test]
    fn block_matmul_gives_both_operands_their_types() {
        let mut g = Graph::new("t");
        let a = param(&mut g, "a", &[2, 3]);
        let b = param(&mut g, "b", &[3, 4]);
        let mm = Op::Matmul {
            transpose_a: false,
            transpose_b: false,
        };
        let y = g.add(mm, &[a, b]).unwrap();
        let (n, d, dy) = setup(&mut g, y);
        let out = ad(&mut g)
            .vjp_block(n, &d, dy, &[true, true])
            .unwrap()
            .unwrap();
        assert_eq!(ops_of(&g, &out), [Some("matmul"), Some("matmul")]);
        assert_eq!(g.ty(out[0].unwrap()), g.ty(a));
        assert_eq!(g.ty(out[1].unwrap()), g.ty(b));
    }

    #[test]
    fn a_family_rule_leaves_another_familys_op_alone() {
        let mut g = Graph::new("t");
        let x = param(&mut g, "x", &[4]);
        let y = g.add(Op::Exp {}, &[x]).unwrap();
        let (n, d, dy) = setup(&mut g, y);
        let nodes = g.node_count();
        let out = ad(&mut g).vjp_layout(n, &d, dy, &[true]).unwrap();
        assert_eq!(out, None);
        assert_eq!(g.node_count(), nodes);
    }

    #[test]
    fn the_dispatcher_has_no_rule_for_a_backward_op() {
        let mut g = Graph::new("t");
        let x = param(&mut g, "x", &[4]);
        let dx = param(&mut g, "dx", &[4]);
        let y = g.add(Op::SiluGrad {}, &[x, dx]).unwrap();
        let (n, d, dy) = setup(&mut g, y);
        let e = ad(&mut g)
            .vjp(n, &d, &[Some(dy)], &[true, true])
            .unwrap_err();
        assert!(
            e.to_string().contains("no backward rule for `silu_grad`"),
            "{e}"
        );
    }
}
