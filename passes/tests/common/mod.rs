//! A hand-built llama-style graph following the frontends' conventions, for tests and
//! the benchmark (until `weft_frontends::load` has presets).
#![allow(dead_code)]

use weft_ir::*;

#[derive(Clone, Debug)]
pub struct Config {
    pub name: String,
    pub layers: usize,
    pub hidden: i64,
    pub heads: i64,
    pub kv_heads: i64,
    pub head_dim: i64,
    pub intermediate: i64,
    pub vocab: i64,
    /// qwen3-style rms_norm of q and k per head, before the transpose.
    pub qk_norm: bool,
    /// An `attention_mask` input (bool [B, 1, S, S]) fed to every attention.
    pub mask: bool,
    /// `cross_entropy {reduction=mean}` instead of sum / count_valid.
    pub mean_loss: bool,
    /// Positions from a `position_ids` input (i64[B, S]) instead of an `arange`.
    pub position_ids: bool,
    pub dtype: DType,
}

impl Config {
    /// 2 layers, hidden 32, 4 q heads, 2 kv heads of dim 8, vocab 128.
    pub fn llama_tiny() -> Config {
        Config {
            name: "llama-tiny".into(),
            layers: 2,
            hidden: 32,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            intermediate: 64,
            vocab: 128,
            qk_norm: false,
            mask: false,
            mean_loss: false,
            position_ids: false,
            dtype: DType::F32,
        }
    }

    /// Llama 3.1 405B: 126 layers, hidden 16384, 128 q heads, 8 kv heads.
    pub fn llama_405b() -> Config {
        Config {
            name: "llama3.1-405b".into(),
            layers: 126,
            hidden: 16384,
            heads: 128,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 53248,
            vocab: 128256,
            qk_norm: false,
            mask: false,
            mean_loss: false,
            position_ids: false,
            dtype: DType::BF16,
        }
    }
}

fn t(dtype: DType, shape: Vec<Dim>) -> TensorType {
    TensorType::new(dtype, shape)
}

pub fn build(c: &Config) -> Graph {
    let (b, s) = (Dim::sym("B"), Dim::sym("S"));
    let d = |n: i64| Dim::from(n);
    let mut g = Graph::new(&c.name);
    let param = |g: &mut Graph, name: &str, shape: Vec<Dim>| {
        g.add(
            Op::Param {
                name: name.into(),
                ty: t(c.dtype, shape),
            },
            &[],
        )
        .unwrap()
    };
    g.set_scope(Some("model.embed_tokens"));
    let ids = g
        .add(
            Op::Input {
                name: "input_ids".into(),
                role: Role::InputIds,
                ty: t(DType::I64, vec![b.clone(), s.clone()]),
            },
            &[],
        )
        .unwrap();
    let labels = g
        .add(
            Op::Input {
                name: "labels".into(),
                role: Role::Labels,
                ty: t(DType::I64, vec![b.clone(), s.clone()]),
            },
            &[],
        )
        .unwrap();
    let mask = if c.mask {
        let ty = t(DType::Bool, vec![b.clone(), d(1), s.clone(), s.clone()]);
        Some(
            g.add(
                Op::Input {
                    name: "attention_mask".into(),
                    role: Role::AttentionMask,
                    ty,
                },
                &[],
            )
            .unwrap(),
        )
    } else {
        None
    };
    let embed = param(
        &mut g,
        "model.embed_tokens.weight",
        vec![d(c.vocab), d(c.hidden)],
    );
    let mut x = g
        .add(Op::Embedding { padding_idx: None }, &[ids, embed])
        .unwrap();
    g.set_scope(Some("model.rotary_emb"));
    let pos = if c.position_ids {
        let ty = t(DType::I64, vec![b.clone(), s.clone()]);
        g.add(
            Op::Input {
                name: "position_ids".into(),
                role: Role::PositionIds,
                ty,
            },
            &[],
        )
        .unwrap()
    } else {
        let pos = g
            .add(
                Op::Arange {
                    start: Dim::from(0),
                    ty: t(DType::I64, vec![s.clone()]),
                },
                &[],
            )
            .unwrap();
        g.add(
            Op::Reshape {
                shape: vec![d(1), s.clone()],
            },
            &[pos],
        )
        .unwrap()
    };
    let cs = g
        .add_multi(
            Op::RopeTable {
                theta: Float(10000.0),
                dim: c.head_dim,
                scaling: RopeScaling::None,
            },
            &[pos],
        )
        .unwrap();
    let (cos, sin) = (cs[0], cs[1]);
    let eps = Float(1e-6);
    for l in 0..c.layers {
        let p = format!("model.layers.{l}");
        g.set_scope(Some(&format!("{p}.input_layernorm")));
        let w = param(
            &mut g,
            &format!("{p}.input_layernorm.weight"),
            vec![d(c.hidden)],
        );
        let h = g.add(Op::RmsNorm { eps }, &[x, w]).unwrap();
        g.set_scope(Some(&format!("{p}.self_attn")));
        let proj = |g: &mut Graph, name: &str, heads: i64, rope: bool| {
            let w = param(
                g,
                &format!("{p}.self_attn.{name}_proj.weight"),
                vec![d(heads * c.head_dim), d(c.hidden)],
            );
            let y = g.add(Op::Linear {}, &[h, w]).unwrap();
            let mut y = g
                .add(
                    Op::Reshape {
                        shape: vec![b.clone(), s.clone(), d(heads), d(c.head_dim)],
                    },
                    &[y],
                )
                .unwrap();
            if c.qk_norm && rope {
                let nw = param(
                    g,
                    &format!("{p}.self_attn.{name}_norm.weight"),
                    vec![d(c.head_dim)],
                );
                y = g.add(Op::RmsNorm { eps }, &[y, nw]).unwrap();
            }
            let y = g.add(Op::Transpose { dim0: 1, dim1: 2 }, &[y]).unwrap();
            if rope {
                g.add(
                    Op::Rope {
                        layout: weft_ir::HeadLayout::Bhsd,
                    },
                    &[y, cos, sin],
                )
                .unwrap()
            } else {
                y
            }
        };
        let q = proj(&mut g, "q", c.heads, true);
        let k = proj(&mut g, "k", c.kv_heads, true);
        let v = proj(&mut g, "v", c.kv_heads, false);
        let mut operands = vec![q, k, v];
        operands.extend(mask);
        let a = g
            .add(
                Op::Attention {
                    layout: weft_ir::HeadLayout::Bhsd,
                    causal: true,
                    scale: Float(1.0 / (c.head_dim as f64).sqrt()),
                    window: None,
                    softcap: None,
                    sinks: Default::default(),
                    lse: Default::default(),
                },
                &operands,
            )
            .unwrap();
        let a = g.add(Op::Transpose { dim0: 1, dim1: 2 }, &[a]).unwrap();
        let a = g
            .add(
                Op::Reshape {
                    shape: vec![b.clone(), s.clone(), d(c.heads * c.head_dim)],
                },
                &[a],
            )
            .unwrap();
        let wo = param(
            &mut g,
            &format!("{p}.self_attn.o_proj.weight"),
            vec![d(c.hidden), d(c.heads * c.head_dim)],
        );
        let o = g.add(Op::Linear {}, &[a, wo]).unwrap();
        x = g.add(Op::Add {}, &[x, o]).unwrap();
        g.set_scope(Some(&format!("{p}.post_attention_layernorm")));
        let w = param(
            &mut g,
            &format!("{p}.post_attention_layernorm.weight"),
            vec![d(c.hidden)],
        );
        let h = g.add(Op::RmsNorm { eps }, &[x, w]).unwrap();
        g.set_scope(Some(&format!("{p}.mlp")));
        let wg = param(
            &mut g,
            &format!("{p}.mlp.gate_proj.weight"),
            vec![d(c.intermediate), d(c.hidden)],
        );
        let wu = param(
            &mut g,
            &format!("{p}.mlp.up_proj.weight"),
            vec![d(c.intermediate), d(c.hidden)],
        );
        let wd = param(
            &mut g,
            &format!("{p}.mlp.down_proj.weight"),
            vec![d(c.hidden), d(c.intermediate)],
        );
        let gate = g.add(Op::Linear {}, &[h, wg]).unwrap();
        let gate = g.add(Op::Silu {}, &[gate]).unwrap();
        let up = g.add(Op::Linear {}, &[h, wu]).unwrap();
        let m = g.add(Op::Mul {}, &[gate, up]).unwrap();
        let down = g.add(Op::Linear {}, &[m, wd]).unwrap();
        x = g.add(Op::Add {}, &[x, down]).unwrap();
    }
    g.set_scope(Some("model.norm"));
    let w = param(&mut g, "model.norm.weight", vec![d(c.hidden)]);
    let h = g.add(Op::RmsNorm { eps }, &[x, w]).unwrap();
    g.set_scope(Some("lm_head"));
    let wl = param(&mut g, "lm_head.weight", vec![d(c.vocab), d(c.hidden)]);
    let logits = g.add(Op::Linear {}, &[h, wl]).unwrap();
    g.set_scope(Some("loss"));
    let shifted = g
        .add(Op::ShiftLabels { ignore_index: -100 }, &[labels])
        .unwrap();
    let loss = if c.mean_loss {
        g.add(
            Op::CrossEntropy {
                ignore_index: -100,
                reduction: Reduction::Mean,
            },
            &[logits, shifted],
        )
        .unwrap()
    } else {
        let ce = g
            .add(
                Op::CrossEntropy {
                    ignore_index: -100,
                    reduction: Reduction::Sum,
                },
                &[logits, shifted],
            )
            .unwrap();
        let n = g
            .add(Op::CountValid { ignore_index: -100 }, &[shifted])
            .unwrap();
        g.add(Op::Div {}, &[ce, n]).unwrap()
    };
    g.set_scope(None);
    g.set_output("loss", loss);
    g.set_output("logits", logits);
    g
}

pub fn llama_tiny() -> Graph {
    build(&Config::llama_tiny())
}
