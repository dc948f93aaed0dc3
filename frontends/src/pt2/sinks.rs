//! gpt-oss's attention sinks as eager attention exports them (`GptOssAttention`'s
//! `eager_attention_forward`): a learned per-head logit joins each row's softmax and its
//! probability is dropped after it,
//!
//! ```text
//! col  = expand(reshape(sinks, [1, N, 1, 1]), [B, N, Sq, 1])
//! cat  = cat([scores + mask, col], -1)
//! p    = softmax(cat - max(cat, -1, keepdim), -1)[.., :Sk]
//! ```
//!
//! which is Weft's `attention` with `sinks=true` and the parameter as its last operand
//! (the max subtraction does not change a softmax). Only this exact shape is taken: a
//! concatenated column that is not a rank-1 parameter, a slice that keeps anything
//! but the score columns, or a max over something else is left to the generic lowering.

use weft_ir::{Dim, Graph, Op, Value};

fn def(g: &Graph, v: Value) -> (&Op, &[Value]) {
    let n = g.node(g.def(v));
    (&n.op, &n.operands)
}

fn is_last(d: i64, rank: usize) -> bool {
    d == -1 || d == rank as i64 - 1
}

/// `(masked scores, sinks parameter)` when `p` is the sliced sink softmax above.
pub fn sink_softmax(g: &Graph, p: Value) -> Option<(Value, Value)> {
    let (Op::Slice { dim, start, len }, [sm]) = def(g, p) else {
        return None;
    };
    let rank = g.ty(p).rank();
    if rank != 4 || !is_last(*dim, rank) || *start != Dim::from(0) {
        return None;
    }
    let len = len.clone();
    let (Op::Softmax { dim }, [y]) = def(g, *sm) else {
        return None;
    };
    if !is_last(*dim, rank) {
        return None;
    }
    let cat = match def(g, *y) {
        (Op::Sub {}, [c, m]) => {
            let (
                Op::Max {
                    dims,
                    keepdim: true,
                },
                [src],
            ) = def(g, *m)
            else {
                return None;
            };
            if *src != *c || !matches!(dims.as_slice(), [d] if is_last(*d, rank)) {
                return None;
            }
            *c
        }
        (Op::Concat { .. }, _) => *y,
        _ => return None,
    };
    let (Op::Concat { dim }, [scores, col]) = def(g, cat) else {
        return None;
    };
    if !is_last(*dim, rank) || g.ty(*scores).shape[3] != len || g.ty(*col).shape[3] != Dim::from(1)
    {
        return None;
    }
    let mut sinks = *col;
    for _ in 0..4 {
        match def(g, sinks) {
            (Op::Reshape { .. } | Op::Expand { .. }, [x]) => sinks = *x,
            _ => break,
        }
    }
    let heads = &g.ty(*scores).shape[1];
    let st = g.ty(sinks);
    let is_param = matches!(def(g, sinks).0, Op::Param { .. });
    (is_param && st.rank() == 1 && &st.shape[0] == heads).then_some((*scores, sinks))
}

#[cfg(test)]
mod tests {
    use super::sink_softmax;
    use weft_ir::{DType, Dim, Graph, Op, Role, TensorType, Value};

    /// `softmax(cat([scores, expand(reshape(sinks))]) - max)[.., :S]` over [B, 4, S, S]
    /// scores, with `sinks` a [4] parameter (or input when `as_param` is false), sliced
    /// to `keep` columns.
    fn sink_program(as_param: bool, keep: Dim) -> (Graph, Value, Value, Value) {
        let (b, s) = (Dim::sym("B"), Dim::sym("S"));
        let d = Dim::from;
        let mut g = Graph::new("sinks");
        let f32 = |shape: Vec<Dim>| TensorType::new(DType::F32, shape);
        let scores = g
            .add(
                Op::Input {
                    name: "scores".into(),
                    role: Role::Other,
                    ty: f32(vec![b.clone(), d(4), s.clone(), s.clone()]),
                },
                &[],
            )
            .unwrap();
        let ty = f32(vec![d(4)]);
        let source = if as_param {
            Op::Param {
                name: "sinks".into(),
                ty,
            }
        } else {
            Op::Input {
                name: "sinks".into(),
                role: Role::Other,
                ty,
            }
        };
        let sinks = g.add(source, &[]).unwrap();
        let r = g
            .add(
                Op::Reshape {
                    shape: vec![d(1), d(4), d(1), d(1)],
                },
                &[sinks],
            )
            .unwrap();
        let col = g
            .add(
                Op::Expand {
                    shape: vec![b, d(4), s.clone(), d(1)],
                },
                &[r],
            )
            .unwrap();
        let cat = g.add(Op::Concat { dim: -1 }, &[scores, col]).unwrap();
        let max = g
            .add(
                Op::Max {
                    dims: vec![-1],
                    keepdim: true,
                },
                &[cat],
            )
            .unwrap();
        let shifted = g.add(Op::Sub {}, &[cat, max]).unwrap();
        let sm = g.add(Op::Softmax { dim: -1 }, &[shifted]).unwrap();
        let p = g
            .add(
                Op::Slice {
                    dim: 3,
                    start: d(0),
                    len: keep,
                },
                &[sm],
            )
            .unwrap();
        (g, p, scores, sinks)
    }

    #[test]
    fn the_sink_column_is_recognised() {
        let (g, p, scores, sinks) = sink_program(true, Dim::sym("S"));
        assert_eq!(sink_softmax(&g, p), Some((scores, sinks)));
    }

    #[test]
    fn anything_else_is_left_alone() {
        // a column that is not a parameter (data-dependent)
        let (g, p, _, _) = sink_program(false, Dim::sym("S"));
        assert_eq!(sink_softmax(&g, p), None);
        // a slice that keeps fewer columns than the scores have
        let (g, p, _, _) = sink_program(true, Dim::sym("S") - Dim::from(1));
        assert_eq!(sink_softmax(&g, p), None);
    }
}
