//! Shape rules of the fused ops `fuse` makes (`glu`, `glu_grad`, `add_rms_norm`,
//! `add_rms_norm_grad`, `matmul_add`). Each takes exactly the types of the unfused ops it replaces:
//! no broadcasting, one dtype for the elementwise operands. Re-exported by
//! [`crate::shape`], which the op table reads.

use crate::ops::Op;
use crate::types::TensorType;

type Out = Result<Vec<TensorType>, String>;

fn float(t: &TensorType, what: &str) -> Result<(), String> {
    if !t.dtype.is_float() {
        return Err(format!("{what} must be a float tensor, got {t}"));
    }
    Ok(())
}

fn same(a: &TensorType, b: &TensorType, what: &str) -> Result<(), String> {
    if a != b {
        return Err(format!("{what} must have the same type, got {a} and {b}"));
    }
    Ok(())
}

/// `w` must be a float vector of `x`'s last dim (its dtype may differ: an f32 norm
/// weight on a bf16 stream, as `rms_norm` allows).
fn norm_weight(x: &TensorType, w: &TensorType, op: &str) -> Result<(), String> {
    float(w, "w")?;
    if x.rank() == 0 || w.shape != [x.shape.last().unwrap().clone()] {
        return Err(format!(
            "{op} weight must match the last dim of x: x {x}, w {w}"
        ));
    }
    Ok(())
}

/// `glu(gate, up)`: like gate.
pub fn glu(_: &Op, ins: &[&TensorType]) -> Out {
    float(ins[0], "gate")?;
    same(ins[0], ins[1], "gate and up")?;
    Ok(vec![ins[0].clone()])
}

/// `glu_grad(gate, up, dy)`: dgate, dup like gate.
pub fn glu_grad(_: &Op, ins: &[&TensorType]) -> Out {
    float(ins[0], "gate")?;
    same(ins[0], ins[1], "gate and up")?;
    same(ins[0], ins[2], "gate and dy")?;
    Ok(vec![ins[0].clone(), ins[0].clone()])
}

/// `add_rms_norm(x, y, w)`: sum and normed, both like x.
pub fn add_rms_norm(_: &Op, ins: &[&TensorType]) -> Out {
    let (x, y, w) = (ins[0], ins[1], ins[2]);
    float(x, "x")?;
    same(x, y, "x and y")?;
    norm_weight(x, w, "add_rms_norm")?;
    Ok(vec![x.clone(), x.clone()])
}

/// `add_rms_norm_grad(sum, w, dnorm, dsum)`: dsum like sum, dw like w.
pub fn add_rms_norm_grad(_: &Op, ins: &[&TensorType]) -> Out {
    let (s, w) = (ins[0], ins[1]);
    float(s, "sum")?;
    norm_weight(s, w, "add_rms_norm_grad")?;
    same(s, ins[2], "sum and dnorm")?;
    same(s, ins[3], "sum and dsum")?;
    Ok(vec![s.clone(), w.clone()])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attrs::{Float, GateAct};
    use crate::dim::Dim;
    use crate::types::DType;

    fn t(dtype: DType, shape: &[i64]) -> TensorType {
        TensorType::new(dtype, shape.iter().map(|&d| Dim::from(d)).collect())
    }

    #[test]
    fn fused_ops_take_the_unfused_types_and_refuse_the_rest() {
        let x = t(DType::BF16, &[2, 3, 8]);
        let w = t(DType::F32, &[8]);
        let glu = Op::Glu { act: GateAct::Silu };
        assert_eq!(glu.infer(&[&x, &x]).unwrap(), vec![x.clone()]);
        let e = glu.infer(&[&x, &t(DType::BF16, &[1, 3, 8])]).unwrap_err();
        assert!(e.contains("gate and up"), "{e}");
        let grad = Op::GluGrad {
            act: GateAct::GeluTanh,
        };
        assert_eq!(grad.infer(&[&x, &x, &x]).unwrap().len(), 2);
        let norm = Op::AddRmsNorm { eps: Float(1e-6) };
        assert_eq!(
            norm.infer(&[&x, &x, &w]).unwrap(),
            vec![x.clone(), x.clone()]
        );
        let e = norm.infer(&[&x, &x, &t(DType::F32, &[4])]).unwrap_err();
        assert!(e.contains("last dim"), "{e}");
        let ng = Op::AddRmsNormGrad { eps: Float(1e-6) };
        assert_eq!(ng.infer(&[&x, &w, &x, &x]).unwrap(), vec![x.clone(), w]);
        let e = ng.infer(&[&x, &t(DType::F32, &[8]), &x, &t(DType::F32, &[2, 3, 8])]);
        assert!(e.unwrap_err().contains("dsum"));
    }
}

/// `matmul_add(a, b, c)`: the product's type, which `c` must have exactly.
pub fn matmul_add(op: &Op, ins: &[&TensorType]) -> Out {
    let Op::MatmulAdd {
        transpose_a,
        transpose_b,
    } = op
    else {
        unreachable!()
    };
    let product = crate::shape::matmul(
        &Op::Matmul {
            transpose_a: *transpose_a,
            transpose_b: *transpose_b,
        },
        &ins[..2],
    )?;
    same(&product[0], ins[2], "the product and c")?;
    Ok(product)
}
