//! `convert-dtype`: run the model in another float dtype. Every float parameter, input
//! (but buffers, which HF keeps in f32) and fill becomes the dtype `PassOptions::dtype`
//! names; ops whose rules fix their own
//! output dtype (rope tables, losses in f32) keep it, because every node's type is
//! re-inferred in program order from the converted leaves.

use crate::pass::{Pass, PassContext, PassError, PassResult};
use weft_ir::{Graph, Op, Role};

pub const NAME: &str = "convert-dtype";

pub struct ConvertDtype;

impl Pass for ConvertDtype {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "convert float params, inputs and fills to the requested dtype (bf16, f32) and re-infer every type"
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let Some(dtype) = cx.options.dtype else {
            return Ok(PassResult::unchanged().with("converted", 0));
        };
        let mut converted = 0u64;
        let nodes: Vec<_> = g.nodes().to_vec();
        for n in nodes {
            let new = match g.node(n).op.clone() {
                Op::Param { name, ty } if ty.dtype.is_float() && ty.dtype != dtype => {
                    Some(Op::Param {
                        name,
                        ty: ty.with_dtype(dtype),
                    })
                }
                // Buffers keep their dtype: HF keeps them in f32 (DeepSeek-V3's
                // `e_score_correction_bias` is in `_keep_in_fp32_modules_strict`).
                Op::Input { name, role, ty }
                    if ty.dtype.is_float() && ty.dtype != dtype && role != Role::Buffer =>
                {
                    Some(Op::Input {
                        name,
                        role,
                        ty: ty.with_dtype(dtype),
                    })
                }
                Op::Full { value, ty } if ty.dtype.is_float() && ty.dtype != dtype => {
                    Some(Op::Full {
                        value,
                        ty: ty.with_dtype(dtype),
                    })
                }
                _ => None,
            };
            if let Some(op) = new {
                g.node_mut(n).op = op;
                converted += 1;
            }
            g.reinfer(n).map_err(|e| {
                PassError::rewrite(
                    NAME,
                    format!("cannot convert to {dtype}"),
                    g.describe(n),
                    e.to_string(),
                )
            })?;
        }
        Ok(PassResult::changed(converted > 0).with("converted", converted))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_ir::DType;

    #[test]
    fn converts_params_and_keeps_f32_losses() {
        let mut g = weft_frontends::load("llama-tiny").unwrap().graph;
        let mut cx = PassContext::default();
        cx.options.dtype = Some(DType::BF16);
        let r = ConvertDtype.run(&mut g, &cx).unwrap();
        assert!(r.changed && r.counters["converted"] > 0);
        for (name, v) in g.params() {
            assert_eq!(g.ty(v).dtype, DType::BF16, "{name}");
        }
        let loss = g.outputs().iter().find(|(n, _)| n == "loss").unwrap().1;
        assert_eq!(g.ty(loss).dtype, DType::F32, "the loss keeps its f32 rule");
        weft_ir::verify(&g).unwrap();
        // Converting again changes nothing.
        assert!(!ConvertDtype.run(&mut g, &cx).unwrap().changed);
    }
}
