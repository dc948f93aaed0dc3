//! Config → forward + loss graph. The graph follows HF's modeling code op for op, with
//! HF's parameter names, and these conventions shared with the passes and runtime:
//!
//! - inputs `input_ids` and `labels`, i64[B, S] (B, S symbolic; causal, no mask input);
//! - every parameter first, in HF `named_parameters()` order, scoped to its module;
//! - positions `arange` → [1, S] → `rope_table` (in `model.rotary_emb`);
//! - per layer: pre-norm (olmo2: post-norm; gemma: both) attention and MLP with residual
//!   adds (see [`attention`], [`mlp`]); granite's multipliers and gemma's embedding
//!   scale as `scale` ops; gemma's `(1 + w)` norms as `add_scalar` on the weight;
//!   gemma3's sliding layers with their own rope table;
//! - `model.norm`, `lm_head` (the embedding parameter when tied), gemma's final soft-cap
//!   (`scale`, `tanh`, `scale`) → output `logits`;
//! - loss: `shift_labels` → `cross_entropy` (sum) / `count_valid` → output `loss`;
//!   with `output_router_logits` (MoE), `loss = ce + router_aux_loss_coef * aux` and the
//!   parts as outputs `ce_loss` and `aux_loss` (see [`aux_loss`]).
//!
//! Every node carries its HF module path as source (`g.set_scope`).

mod attention;
pub(crate) mod aux_loss;
mod mla;
mod mlp;
pub mod params;

use crate::config::{ModelConfig, NormPlacement};
use crate::error::FrontendError;
use std::collections::BTreeMap;
use weft_ir::{DType, Dim, Float, Graph, Op, Reduction, Role, TensorType, Value};

/// Labels equal to this take no part in the loss (HF's `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// Builds the forward + loss graph of `cfg`, named `name`.
pub fn build_graph(name: &str, cfg: &ModelConfig) -> Result<Graph, FrontendError> {
    let mut b = Builder {
        g: Graph::new(name),
        cfg,
        params: BTreeMap::new(),
        model: name.to_string(),
        routers: Vec::new(),
    };
    b.model_body()?;
    Ok(b.g)
}

/// Total parameter count of `cfg` (tied weights counted once).
pub fn param_count(cfg: &ModelConfig) -> u64 {
    params::param_specs(cfg)
        .iter()
        .map(|(_, s)| s.iter().map(|&d| d as u64).product::<u64>())
        .sum()
}

/// Graph under construction, with the parameters made so far by name.
pub(crate) struct Builder<'c> {
    pub g: Graph,
    pub cfg: &'c ModelConfig,
    params: BTreeMap<String, Value>,
    model: String,
    /// Each MoE layer's router probabilities [B*S, E] (f32) and top-k indices [B*S, k].
    routers: Vec<(Value, Value)>,
}

impl<'c> Builder<'c> {
    pub fn scope(&mut self, s: &str) {
        self.g.set_scope(Some(s));
    }

    pub fn op(&mut self, op: Op, args: &[Value]) -> Result<Value, FrontendError> {
        self.g.add(op, args).map_err(|source| FrontendError::Build {
            model: self.model.clone(),
            source,
        })
    }

    pub fn ops(&mut self, op: Op, args: &[Value]) -> Result<Vec<Value>, FrontendError> {
        self.g
            .add_multi(op, args)
            .map_err(|source| FrontendError::Build {
                model: self.model.clone(),
                source,
            })
    }

    /// A parameter made by `declare_params`.
    pub fn param(&self, name: &str) -> Value {
        *self
            .params
            .get(name)
            .unwrap_or_else(|| panic!("param_specs has no `{name}` (builder bug)"))
    }

    /// `param(name)` if the config has it (optional biases).
    pub fn opt_param(&self, name: &str) -> Option<Value> {
        self.params.get(name).copied()
    }

    pub fn dtype(&self) -> DType {
        self.cfg.dtype
    }

    /// `linear` in scope `module` with `module.weight` and, if present, `module.bias`.
    pub fn linear(&mut self, module: &str, x: Value) -> Result<Value, FrontendError> {
        let w = self.param(&format!("{module}.weight"));
        let mut args = vec![x, w];
        args.extend(self.opt_param(&format!("{module}.bias")));
        self.scope(module);
        self.op(Op::Linear {}, &args)
    }

    /// `rms_norm` in scope `module` with `module.weight`. Gemma's norm
    /// (`norm_unit_offset`) is HF's `(norm(x.float()) * (1 + w.float())).type_as(x)`:
    /// `rms_norm(x, add_scalar(w, 1))` with both operands cast to f32 when the model
    /// dtype is not f32 (so `1 + w` is not rounded to bf16, and the product is rounded once).
    pub fn rms_norm(&mut self, module: &str, x: Value) -> Result<Value, FrontendError> {
        let mut w = self.param(&format!("{module}.weight"));
        self.scope(module);
        let eps = Float(self.cfg.rms_norm_eps);
        if !self.cfg.norm_unit_offset {
            return self.op(Op::RmsNorm { eps }, &[x, w]);
        }
        let x_dtype = self.g.ty(x).dtype;
        let mut x = x;
        if x_dtype != DType::F32 {
            x = self.op(Op::Cast { dtype: DType::F32 }, &[x])?;
        }
        if self.g.ty(w).dtype != DType::F32 {
            w = self.op(Op::Cast { dtype: DType::F32 }, &[w])?;
        }
        let w1 = self.op(Op::AddScalar { value: Float(1.0) }, &[w])?;
        let y = self.op(Op::RmsNorm { eps }, &[x, w1])?;
        if x_dtype != DType::F32 {
            return self.op(Op::Cast { dtype: x_dtype }, &[y]);
        }
        Ok(y)
    }

    pub fn reshape(&mut self, x: Value, shape: Vec<Dim>) -> Result<Value, FrontendError> {
        self.op(Op::Reshape { shape }, &[x])
    }

    pub fn transpose(&mut self, x: Value, dim0: i64, dim1: i64) -> Result<Value, FrontendError> {
        self.op(Op::Transpose { dim0, dim1 }, &[x])
    }

    /// `x * factor`, or `x` itself when the factor is 1 (granite's multipliers).
    fn scaled(&mut self, x: Value, factor: f64) -> Result<Value, FrontendError> {
        if factor == 1.0 {
            return Ok(x);
        }
        self.op(
            Op::Scale {
                factor: Float(factor),
            },
            &[x],
        )
    }

    fn declare_params(&mut self) -> Result<(), FrontendError> {
        for (name, shape) in params::param_specs(self.cfg) {
            self.scope(params::module_of(&name));
            let ty = TensorType::new(self.dtype(), shape.into_iter().map(Dim::from).collect());
            let v = self.op(
                Op::Param {
                    name: name.clone(),
                    ty,
                },
                &[],
            )?;
            self.params.insert(name, v);
        }
        for (name, shape) in params::buffer_specs(self.cfg) {
            self.scope(params::module_of(&name));
            let ty = TensorType::new(DType::F32, shape.into_iter().map(Dim::from).collect());
            let v = self.op(
                Op::Input {
                    name: name.clone(),
                    role: Role::Buffer,
                    ty,
                },
                &[],
            )?;
            self.params.insert(name, v);
        }
        Ok(())
    }

    fn model_body(&mut self) -> Result<(), FrontendError> {
        let (b, s) = (Dim::sym("B"), Dim::sym("S"));
        let ids_ty = TensorType::new(DType::I64, vec![b.clone(), s.clone()]);
        self.scope("model");
        let ids = self.op(
            Op::Input {
                name: "input_ids".into(),
                role: Role::InputIds,
                ty: ids_ty.clone(),
            },
            &[],
        )?;
        self.scope("loss");
        let labels = self.op(
            Op::Input {
                name: "labels".into(),
                role: Role::Labels,
                ty: ids_ty,
            },
            &[],
        )?;
        self.declare_params()?;

        self.scope("model.embed_tokens");
        let embed = self.param(params::EMBED);
        let padding_idx = self.cfg.padding_idx.map(|p| Dim::from(p as i64));
        let mut x = self.op(Op::Embedding { padding_idx }, &[ids, embed])?;
        x = self.scaled(x, self.cfg.multipliers.embedding)?;

        self.scope("model.rotary_emb");
        let pos = self.op(
            Op::Arange {
                start: Dim::from(0),
                ty: TensorType::new(DType::I64, vec![s.clone()]),
            },
            &[],
        )?;
        let pos = self.reshape(pos, vec![Dim::from(1), s.clone()])?;
        let table = |rope: &crate::config::RopeConfig| Op::RopeTable {
            theta: Float(rope.theta),
            dim: rope.rotary_dim as i64,
            scaling: rope.scaling,
        };
        // gemma3: sliding-window layers rotate with their own base; each table is built
        // only if a layer reads it.
        let windows = &self.cfg.layer_windows;
        let local_rope = self
            .cfg
            .local_rope
            .as_ref()
            .filter(|r| **r != self.cfg.rope && windows.iter().any(Option::is_some));
        let all_local = local_rope.is_some() && windows.iter().all(Option::is_some);
        let global = match all_local {
            true => None,
            false => {
                let cs = self.ops(table(&self.cfg.rope), &[pos])?;
                Some((cs[0], cs[1]))
            }
        };
        let local = match local_rope {
            Some(r) => {
                let cs = self.ops(table(r), &[pos])?;
                Some((cs[0], cs[1]))
            }
            None => None,
        };

        for i in 0..self.cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let sliding = self.cfg.layer_windows.get(i).copied().flatten().is_some();
            let (cos, sin) = match (local, global) {
                (Some(l), _) if sliding => l,
                (_, Some(g)) => g,
                (Some(l), None) => l,
                (None, None) => unreachable!("the global table is built when no local one is"),
            };
            let residual = self.cfg.multipliers.residual;
            let a = match self.cfg.norm_placement {
                NormPlacement::Pre => {
                    let h = self.rms_norm(&format!("{p}.input_layernorm"), x)?;
                    self.attention(i, h, cos, sin)?
                }
                NormPlacement::Sandwich => {
                    let h = self.rms_norm(&format!("{p}.input_layernorm"), x)?;
                    let a = self.attention(i, h, cos, sin)?;
                    self.rms_norm(&format!("{p}.post_attention_layernorm"), a)?
                }
                NormPlacement::Post => {
                    let a = self.attention(i, x, cos, sin)?;
                    self.rms_norm(&format!("{p}.post_attention_layernorm"), a)?
                }
            };
            self.scope(&p);
            let a = self.scaled(a, residual)?;
            x = self.op(Op::Add {}, &[x, a])?;
            let m = match self.cfg.norm_placement {
                NormPlacement::Pre => {
                    let h = self.rms_norm(&format!("{p}.post_attention_layernorm"), x)?;
                    self.mlp(i, h)?
                }
                NormPlacement::Post => {
                    let m = self.mlp(i, x)?;
                    self.rms_norm(&format!("{p}.post_feedforward_layernorm"), m)?
                }
                NormPlacement::Sandwich => {
                    let h = self.rms_norm(&format!("{p}.pre_feedforward_layernorm"), x)?;
                    let m = self.mlp(i, h)?;
                    self.rms_norm(&format!("{p}.post_feedforward_layernorm"), m)?
                }
            };
            self.scope(&p);
            let m = self.scaled(m, residual)?;
            x = self.op(Op::Add {}, &[x, m])?;
        }

        let x = self.rms_norm("model.norm", x)?;
        let head = self.opt_param(params::LM_HEAD).unwrap_or(embed);
        self.scope("lm_head");
        let mut logits = self.op(Op::Linear {}, &[x, head])?;
        let divisor = self.cfg.multipliers.logits_divisor;
        if divisor != 1.0 {
            logits = self.op(
                Op::Scale {
                    factor: Float(1.0 / divisor),
                },
                &[logits],
            )?;
        }
        if let Some(cap) = self.cfg.final_softcap {
            // HF: `logits / cap`, `tanh`, `* cap` (gemma2, gemma3 `final_logit_softcapping`).
            let t = self.op(
                Op::Scale {
                    factor: Float(1.0 / cap),
                },
                &[logits],
            )?;
            let t = self.op(Op::Tanh {}, &[t])?;
            logits = self.op(Op::Scale { factor: Float(cap) }, &[t])?;
        }

        self.scope("loss");
        let shifted = self.op(
            Op::ShiftLabels {
                ignore_index: IGNORE_INDEX,
            },
            &[labels],
        )?;
        let total = self.op(
            Op::CrossEntropy {
                ignore_index: IGNORE_INDEX,
                reduction: Reduction::Sum,
            },
            &[logits, shifted],
        )?;
        let count = self.op(
            Op::CountValid {
                ignore_index: IGNORE_INDEX,
            },
            &[shifted],
        )?;
        let ce = self.op(Op::Div {}, &[total, count])?;
        let aux = match self
            .cfg
            .moe
            .as_ref()
            .and_then(|m| m.aux_loss_coef.map(|c| (m, c)))
        {
            Some((moe, coef)) => Some((self.aux_loss(moe)?, coef)),
            None => None,
        };
        let loss = match aux {
            Some((aux, coef)) => {
                self.scope("loss");
                let weighted = self.op(
                    Op::Scale {
                        factor: Float(coef),
                    },
                    &[aux],
                )?;
                self.op(Op::Add {}, &[ce, weighted])?
            }
            None => ce,
        };
        self.g.set_scope(None);
        self.g.set_output("loss", loss);
        self.g.set_output("logits", logits);
        if let Some((aux, _)) = aux {
            self.g.set_output("ce_loss", ce);
            self.g.set_output("aux_loss", aux);
        }
        Ok(())
    }
}
