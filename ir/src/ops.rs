//! The closed set of ops, generated from one declarative table: for each op its text
//! name, operand names (`?` marks optional, `..` variadic), attributes, shape rule and
//! one-line doc. The text printer, parser, verifier and `weft ops` all read this table.

use crate::attrs::*;
use crate::dim::Dim;
use crate::fp8::Fp8Format;
use crate::shape as rule;
use crate::types::{DType, TensorType};

/// Static description of one op, for documentation and arity checks.
#[derive(Clone, Copy, Debug)]
pub struct OpInfo {
    pub name: &'static str,
    /// Operand names, e.g. `"x, w, bias?"`; `..` marks a variadic last operand.
    pub operands: &'static str,
    pub attrs: &'static [&'static str],
    pub doc: &'static str,
    pub min_operands: usize,
    pub max_operands: usize,
    /// Communicates across ranks (has an `axis` attribute).
    pub collective: bool,
    /// For an elementwise op: its class and FLOPs per output element.
    pub elementwise: Option<ElementwiseInfo>,
}

/// How an elementwise op reads its operands: every output element depends only on the
/// operand elements at the same index (after broadcasting), so it keeps any split of
/// its operands (rows, sequence, heads) and commutes with data movement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elementwise {
    /// One operand (`neg`, `exp`, `silu`, `cast`, ...).
    Unary,
    /// Two operands, broadcasting (`add`, `mul`, `maximum`, `compare`, ...).
    Binary,
    /// `where`: a condition and two values, broadcasting.
    Select,
}

/// The per-op facts of an elementwise op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ElementwiseInfo {
    pub class: Elementwise,
    /// FLOPs per output element (the cost model's and MFU's count: 4 for the
    /// transcendental activations, 1 otherwise).
    pub flops: u32,
}

macro_rules! define_ops {
    ($(
        $(#[doc = $doc:literal])+
        $variant:ident = $name:literal ($($operands:literal)?) [$min:expr, $max:expr] $({$($field:ident : $fty:ty),* $(,)?})? => $infer:ident $(, $kind:ident $(($($karg:tt)*))?)? ;
    )*) => {
        /// An operation with its attributes. Operands live in the node.
        #[derive(Clone, Debug, PartialEq, Eq, Hash)]
        pub enum Op {
            $( $(#[doc = $doc])+ $variant { $($($field: $fty),*)? } ),*
        }

        pub const OP_TABLE: &[OpInfo] = &[
            $( OpInfo {
                name: $name,
                operands: concat!("" $(, $operands)?),
                attrs: &[$($(stringify!($field)),*)?],
                doc: concat!($($doc),+),
                min_operands: $min,
                max_operands: $max,
                collective: define_ops!(@coll $($kind)?),
                elementwise: define_ops!(@elementwise $($kind $(($($karg)*))?)?),
            } ),*
        ];

        impl Op {
            pub fn name(&self) -> &'static str {
                match self { $( Op::$variant { .. } => $name ),* }
            }

            /// The op's elementwise class, `None` for other ops (the table's fact).
            pub fn elementwise(&self) -> Option<Elementwise> {
                self.info().elementwise.map(|e| e.class)
            }

            pub fn info(&self) -> &'static OpInfo {
                let name = self.name();
                OP_TABLE.iter().find(|i| i.name == name).expect("every op is in OP_TABLE")
            }

            /// Output types from operand types, or why the operands do not fit.
            pub fn infer(&self, ins: &[&TensorType]) -> Result<Vec<TensorType>, String> {
                let (lo, hi) = (self.info().min_operands, self.info().max_operands);
                if ins.len() < lo || ins.len() > hi {
                    return Err(arity_message(self.info(), ins.len()));
                }
                match self {
                    $( Op::$variant { .. } => rule::$infer(self, ins) ),*
                }
            }

            /// `(key, text)` for every attribute that is printed.
            pub fn attrs_text(&self) -> Vec<(&'static str, String)> {
                #[allow(unused_mut)]
                let mut out = Vec::new();
                match self {
                    $( Op::$variant { $($($field),*)? } => {
                        $($( if let Some(t) = AttrValue::fmt_attr($field) { out.push((stringify!($field), t)); } )*)?
                    } ),*
                }
                out
            }

            /// Builds an op from its name and raw attribute texts.
            pub fn from_text(name: &str, attrs: &[(String, String)]) -> Result<Op, String> {
                #[allow(unused)]
                fn get<T: AttrValue>(attrs: &[(String, String)], key: &str, op: &str) -> Result<T, String> {
                    match attrs.iter().find(|(k, _)| k == key) {
                        Some((_, v)) => T::parse_attr(v).map_err(|e| format!("attribute `{key}` of `{op}`: {e}")),
                        None => T::absent().ok_or_else(|| format!("`{op}` needs attribute `{key}`")),
                    }
                }
                // A repeated key would leave one of its values unread.
                let mut seen = std::collections::HashSet::with_capacity(attrs.len());
                for (k, _) in attrs {
                    if !seen.insert(k.as_str()) {
                        return Err(format!("attribute `{k}` of `{name}` is given twice"));
                    }
                }
                match name {
                    $( $name => {
                        let known: &[&str] = &[$($(stringify!($field)),*)?];
                        if let Some((k, _)) = attrs.iter().find(|(k, _)| !known.contains(&k.as_str())) {
                            return Err(format!("`{}` has no attribute `{k}` (it has: {})", $name,
                                if known.is_empty() { "none".to_string() } else { known.join(", ") }));
                        }
                        Ok(Op::$variant { $($($field: get(attrs, stringify!($field), $name)?),*)? })
                    } ),*
                    _ => Err(format!("unknown op `{name}`")),
                }
            }
        }
    };
    (@coll collective) => { true };
    (@coll $($other:tt)*) => { false };
    (@elementwise elementwise($class:ident, $flops:literal)) => {
        Some(ElementwiseInfo { class: Elementwise::$class, flops: $flops })
    };
    (@elementwise $($other:tt)*) => { None };
}

fn arity_message(info: &OpInfo, got: usize) -> String {
    let want = if info.min_operands == info.max_operands {
        format!("{}", info.min_operands)
    } else if info.max_operands == usize::MAX {
        format!("at least {}", info.min_operands)
    } else {
        format!("{} to {}", info.min_operands, info.max_operands)
    };
    format!(
        "`{}` takes {want} operand(s) ({}), got {got}",
        info.name, info.operands
    )
}

const MANY: usize = usize::MAX;

define_ops! {
    // ---- sources ----
    /// A trainable parameter, named as in the HF checkpoint.
    Param = "param" () [0, 0] { name: String, ty: TensorType } => source_type;
    /// A model input; `role` tells passes what it is (input_ids, labels, position_ids, attention_mask, other).
    Input = "input" () [0, 0] { name: String, role: Role, ty: TensorType } => source_type;
    /// A tensor filled with one value.
    Full = "full" () [0, 0] { value: Float, ty: TensorType } => source_type;
    /// `start, start+1, ...` along the single dim of `ty`.
    Arange = "arange" () [0, 0] { start: Dim, ty: TensorType } => arange;

    // ---- elementwise ----
    /// `-x`.
    Neg = "neg" ("x") [1, 1] => same, elementwise(Unary, 1);
    /// `e^x`.
    Exp = "exp" ("x") [1, 1] => same, elementwise(Unary, 1);
    /// Natural logarithm.
    Log = "log" ("x") [1, 1] => same, elementwise(Unary, 1);
    /// Square root.
    Sqrt = "sqrt" ("x") [1, 1] => same, elementwise(Unary, 1);
    /// `1/sqrt(x)`.
    Rsqrt = "rsqrt" ("x") [1, 1] => same, elementwise(Unary, 1);
    /// Hyperbolic tangent.
    Tanh = "tanh" ("x") [1, 1] => same, elementwise(Unary, 4);
    /// `1/(1+e^-x)`.
    Sigmoid = "sigmoid" ("x") [1, 1] => same, elementwise(Unary, 4);
    /// `x*sigmoid(x)`.
    Silu = "silu" ("x") [1, 1] => same, elementwise(Unary, 4);
    /// GELU, exact (erf) or with the tanh approximation.
    Gelu = "gelu" ("x") [1, 1] { tanh_approx: bool } => same, elementwise(Unary, 4);
    /// `max(x, 0)`.
    Relu = "relu" ("x") [1, 1] => same, elementwise(Unary, 1);
    /// `x * factor`.
    Scale = "scale" ("x") [1, 1] { factor: Float } => same, elementwise(Unary, 1);
    /// `x + value`.
    AddScalar = "add_scalar" ("x") [1, 1] { value: Float } => same, elementwise(Unary, 1);
    /// `x ^ exponent`.
    PowScalar = "pow_scalar" ("x") [1, 1] { exponent: Float } => same, elementwise(Unary, 1);
    /// `a + b`, broadcasting.
    Add = "add" ("a, b") [2, 2] => broadcast, elementwise(Binary, 1);
    /// `a - b`, broadcasting.
    Sub = "sub" ("a, b") [2, 2] => broadcast, elementwise(Binary, 1);
    /// `a * b`, broadcasting.
    Mul = "mul" ("a, b") [2, 2] => broadcast, elementwise(Binary, 1);
    /// `a / b`, broadcasting.
    Div = "div" ("a, b") [2, 2] => broadcast, elementwise(Binary, 1);
    /// `a ^ b`, broadcasting.
    Pow = "pow" ("a, b") [2, 2] => broadcast, elementwise(Binary, 1);
    /// Elementwise maximum, broadcasting.
    Maximum = "maximum" ("a, b") [2, 2] => broadcast, elementwise(Binary, 1);
    /// Elementwise minimum, broadcasting.
    Minimum = "minimum" ("a, b") [2, 2] => broadcast, elementwise(Binary, 1);
    /// Elementwise comparison to bool, broadcasting.
    Compare = "compare" ("a, b") [2, 2] { op: CmpOp } => compare, elementwise(Binary, 1);
    /// `cond ? a : b`, broadcasting.
    Where = "where" ("cond, a, b") [3, 3] => select, elementwise(Select, 1);
    /// Converts the element type.
    Cast = "cast" ("x") [1, 1] { dtype: DType } => cast, elementwise(Unary, 1);

    // ---- reductions ----
    /// Sum over `dims`.
    Sum = "sum" ("x") [1, 1] { dims: Vec<i64>, keepdim: bool } => reduce;
    /// Mean over `dims`.
    Mean = "mean" ("x") [1, 1] { dims: Vec<i64>, keepdim: bool } => reduce;
    /// Maximum over `dims`.
    Max = "max" ("x") [1, 1] { dims: Vec<i64>, keepdim: bool } => reduce;
    /// Softmax along `dim`, computed in f32.
    Softmax = "softmax" ("x") [1, 1] { dim: i64 } => same_dim;
    /// Log-softmax along `dim`, computed in f32.
    LogSoftmax = "log_softmax" ("x") [1, 1] { dim: i64 } => same_dim;

    // ---- transformer blocks ----
    /// Token embedding lookup: `weight[ids]`. With `padding_idx=p` (HF's `nn.Embedding(padding_idx=pad_token_id)`) the forward is unchanged and row `p` of the weight gets no gradient: tokens whose id is `p` are skipped by `embedding_grad`. A per-rank `p` (vocab-parallel tp) may lie outside this rank's rows: then no row is skipped here.
    Embedding = "embedding" ("ids, weight") [2, 2] { padding_idx: Option<Dim> } => embedding;
    /// `x @ w^T + bias` with `w` of shape [out, in].
    Linear = "linear" ("x, w, bias?") [2, 3] => linear;
    /// Batched matmul with broadcast batch dims and optional transposes of the last two dims.
    Matmul = "matmul" ("a, b") [2, 2] { transpose_a: bool, transpose_b: bool } => matmul;
    /// `matmul` with each operand quantized to FP8 first (made by `fp8`): per-tensor current scaling by a power of two (`2^floor(log2(max / amax))`, so dequantizing is exact), round to nearest even saturating at the format's largest value, products accumulated in f32, the result rounded to the operands' dtype. Its gradient is the straight-through one, computed by `fp8_matmul`s whose incoming-gradient operand is `e5m2`.
    Fp8Matmul = "fp8_matmul" ("a, b") [2, 2] { transpose_a: bool, transpose_b: bool, format_a: Fp8Format, format_b: Fp8Format } => matmul;
    /// `w * x / sqrt(mean(x^2, last) + eps)`, computed in f32, result in x's dtype.
    RmsNorm = "rms_norm" ("x, w") [2, 2] { eps: Float } => rms_norm;
    /// RoPE cos/sin tables [B, S, dim] (f32) from position ids [B, S].
    RopeTable = "rope_table" ("position_ids") [1, 1] { theta: Float, dim: i64, scaling: RopeScaling } => rope_table;
    /// Rotary embedding `x*cos + rotate_half(x)*sin` on x [B, N, S, D] (`layout=bshd`: [B, S, N, D]) with cos/sin [B|1, S, r]; rotates the first `r` features.
    Rope = "rope" ("x, cos, sin") [3, 3] { layout: HeadLayout } => rope;
    /// Scaled dot-product attention on q [B, Nq, Sq, D], k [B, Nkv, Sk, D], v [B, Nkv, Sk, Dv] (GQA: Nkv divides Nq; Dv may differ from D): out [B, Nq, Sq, Dv].
    /// Query `i` sits at position `p = i + Sk - Sq` (queries aligned with the last keys). Scores are `scale * q.k`, then `softcap * tanh(s / softcap)` when `softcap` is set; key `j` is kept when the bool keep-`mask` [B|1, Nq|1, Sq, Sk] says so, `causal` keeps `j <= p`, and `window=W` (needs causal) also keeps only `j > p - W` (HF's sliding window: W keys, the query's own included).
    /// Masked scores get the dtype's most negative value (a row with nothing kept is uniform, as HF's eager path). With `sinks=true` the last operand is a per-head logit [Nq] that joins each row's softmax and is dropped after it (gpt-oss).
    /// With `lse=true` a second result is the f32 log-sum-exp of each row's scores [B, Nq, Sq] (sink included), for combining partial attentions.
    /// With `layout=bshd` q, k, v and out are [B, S, N, D] instead (mask, sinks and lse unchanged).
    Attention = "attention" ("q, k, v, mask?, sinks?") [3, 5] { causal: bool, scale: Float, window: Option<i64>, softcap: Option<Float>, sinks: Flag, lse: Flag, layout: HeadLayout } => attention;
    /// Ring attention over mesh axis `axis` (context parallelism; made by `ring-attention`, expanded by `ring-lower`): each rank holds q, k, v [B, N, S/cp, D] of its two zigzag chunks of the sequence (see `zigzag`) and gets `attention`'s out and f32 log-sum-exp [B, Nq, S/cp] over the whole sequence, with the attributes of `attention` (no mask, no sinks). One op so that `autodiff` differentiates the ring as a unit (`ring_attention_grad`) and saves only q, k, v, out and lse.
    RingAttention = "ring_attention" ("q, k, v") [3, 3] { axis: String, causal: bool, scale: Float, window: Option<i64>, softcap: Option<Float> } => ring_attention;
    /// HF causal-LM labels: `labels[:, 1:]` padded with `ignore_index` at the end (the shift of ForCausalLMLoss).
    ShiftLabels = "shift_labels" ("labels") [1, 1] { ignore_index: i64 } => same;
    /// Number of labels not equal to `ignore_index`, as f32.
    CountValid = "count_valid" ("labels") [1, 1] { ignore_index: i64 } => count_valid;
    /// Token cross-entropy of logits [.., V] against labels [..] (f32); ignored labels contribute 0.
    CrossEntropy = "cross_entropy" ("logits, labels") [2, 2] { ignore_index: i64, reduction: Reduction } => cross_entropy;

    /// lm_head and cross-entropy fused, chunked over the vocabulary (the logits are never stored): for x [.., H] and w [V, H] the logits `z = x w^T`, times `scale` when set, then `softcap * tanh(z / softcap)` when set, are computed `chunk` rows of w at a time. Results, f32 with the labels' shape: the log-sum-exp of each token's logits and its target logit `z[label]` (0 where the label is `ignore_index`); the token loss is `lse - target`. The statistics are results so a vocabulary split over ranks combines them (max and sum of exp of the lse, sum of the target).
    LinearCrossEntropy = "linear_cross_entropy" ("x, w, labels") [3, 3] { ignore_index: i64, chunk: i64, scale: Option<Float>, softcap: Option<Float> } => linear_cross_entropy;

    // ---- layout ----
    /// Same elements, new shape (element counts must match).
    Reshape = "reshape" ("x") [1, 1] { shape: Vec<Dim> } => reshape;
    /// Reorders dims: output dim i is input dim `perm[i]`.
    Permute = "permute" ("x") [1, 1] { perm: Vec<i64> } => permute;
    /// Swaps two dims.
    Transpose = "transpose" ("x") [1, 1] { dim0: i64, dim1: i64 } => transpose;
    /// `len` elements of `dim` from `start` (narrow).
    Slice = "slice" ("x") [1, 1] { dim: i64, start: Dim, len: Dim } => slice;
    /// Joins tensors along `dim`.
    Concat = "concat" ("xs..") [1, MANY] { dim: i64 } => concat;
    /// Splits along `dim` into parts of `sizes`; one result per part.
    Split = "split" ("x") [1, 1] { dim: i64, sizes: Vec<Dim> } => split;
    /// Broadcasts size-1 (or missing leading) dims to `shape`.
    Expand = "expand" ("x") [1, 1] { shape: Vec<Dim> } => expand;
    /// `out[i][j] = x[i][idx[i][j]]` along `dim` (torch.gather).
    Gather = "gather" ("x, index") [2, 2] { dim: i64 } => gather;
    /// Zigzag order of `dim` viewed as `2*parts` equal chunks (context parallelism's causal load balance): output chunk `2r` is input chunk `r` and output chunk `2r+1` is input chunk `2*parts-1-r`, so rank `r` of `parts` holds one chunk from each end. `inverse=true` undoes it.
    Zigzag = "zigzag" ("x") [1, 1] { dim: i64, parts: i64, inverse: bool } => zigzag;
    /// Selects entries of `dim` by a 1-D index.
    IndexSelect = "index_select" ("x, index") [2, 2] { dim: i64 } => index_select;
    /// Largest `k` along `dim`, sorted: values and i64 indices.
    Topk = "topk" ("x") [1, 1] { k: i64, dim: i64 } => topk;
    /// One-hot encoding of integer indices.
    OneHot = "one_hot" ("index") [1, 1] { num_classes: i64, dtype: DType } => one_hot;
    /// `dst` with `src` added at `index` along `dim` (torch.scatter_add).
    ScatterAdd = "scatter_add" ("dst, index, src") [3, 3] { dim: i64 } => scatter_add;

    // ---- mixture of experts ----
    /// Replicates token rows per selected expert and sorts them by expert: rows [T*k, H], counts i64 [E], order i64 [T*k] (flat t*k+slot of each row).
    MoeDispatch = "moe_dispatch" ("x, expert_index") [2, 2] { num_experts: i64 } => moe_dispatch;
    /// Row groups times per-expert weights: rows of group e (by `counts` [E]) times `w[e]^T`, w [E, N, K]; with `transpose_w=true` times `w[e]`, w [E, K, N] (gpt-oss's layout). With counts [G, E] the rows come in G*E groups in row-major order and group (g, e) uses `w[e]` (rows received from G ranks, each sorted by expert).
    /// With a `bias` [E, N], each row of group e gets `bias[e]` added.
    GroupedMatmul = "grouped_matmul" ("x, w, counts, bias?") [3, 4] { transpose_w: Flag } => grouped_matmul;
    /// Undoes `moe_dispatch`: `out[t] = sum_slot weights[t, slot] * rows[row of (t, slot)]`.
    MoeCombine = "moe_combine" ("rows, order, weights") [3, 3] => moe_combine;

    // ---- backward (made by `autodiff`; the other gradients are written with the ops above) ----
    /// Gradients of `attention` (same attributes) from its operands, output and output gradient: dq, dk, dv (GQA: dk, dv summed over the q heads of each kv head), and with `sinks=true` dsinks [Nq] (f32).
    /// Optional operands in order: the keep-mask, the sinks (`sinks=true`) and, with `lse=true`, the gradient of the log-sum-exp result `dlse` [B, Nq, Sq] (f32).
    /// With `layout=bshd` q, k, v, out, dout and dq, dk, dv are [B, S, N, D].
    AttentionGrad = "attention_grad" ("q, k, v, out, dout, mask?, sinks?, dlse?") [5, 8] { causal: bool, scale: Float, window: Option<i64>, softcap: Option<Float>, sinks: Flag, lse: Flag, layout: HeadLayout } => attention_grad;
    /// Gradients of `ring_attention` (same attributes) from its operands, out, lse and the output gradient: dq, dk, dv. `ring-lower` expands it into the transposed ring: k/v travel the ring again with their dk/dv accumulators.
    RingAttentionGrad = "ring_attention_grad" ("q, k, v, out, lse, dout") [6, 6] { axis: String, causal: bool, scale: Float, window: Option<i64>, softcap: Option<Float> } => ring_attention_grad;
    /// Gradients of one key block of a larger attention whose merged output is `out` and whose whole-row f32 log-sum-exp is `lse` [B, Nq, Sq]: with `P = exp(s - lse)` (the block's scores, soft-capped and masked as `attention` does), `dv = P^T dout`, `dS = P (dout v^T - rowsum(dout out))`, `dq = scale dS k`, `dk = scale dS^T q` (GQA: dk, dv summed over the q heads of each kv head). Summed over the blocks, they are `attention_grad`'s.
    AttentionBlockGrad = "attention_block_grad" ("q, k, v, out, dout, lse, mask?") [6, 7] { causal: bool, scale: Float, softcap: Option<Float> } => attention_block_grad;
    /// Gradients of `rms_norm`: dx, and dw summed over every row.
    RmsNormGrad = "rms_norm_grad" ("x, w, dy") [3, 3] { eps: Float } => rms_norm_grad;
    /// Gradient of `cross_entropy` wrt the logits for loss gradient `dloss` (a scalar for sum/mean, per token for none); 0 for ignored labels.
    CrossEntropyGrad = "cross_entropy_grad" ("logits, labels, dloss") [3, 3] { ignore_index: i64, reduction: Reduction } => cross_entropy_grad;
    /// Gradients of `linear_cross_entropy` (same attributes) from the forward's log-sum-exp `lse` and the gradients `dlse`, `dtarget` of its two results: dx and dw. Each vocabulary chunk's logits are recomputed, `dz = dlse * softmax + dtarget * onehot(label)` formed in place, then `dx += dz w_c` and `dw_c = dz^T x`.
    LinearCrossEntropyGrad = "linear_cross_entropy_grad" ("x, w, labels, lse, dlse, dtarget") [6, 6] { ignore_index: i64, chunk: i64, scale: Option<Float>, softcap: Option<Float> } => linear_cross_entropy_grad;
    /// Gradient of `embedding` wrt its table [num_embeddings, H]: row `ids[i]` gets `dy[i]` added, except for tokens whose id is `padding_idx` (that row stays zero). With `init` (made by `fuse`: a tied lm_head's weight gradient, of the result's type) the rows are added to it instead of to zeros.
    EmbeddingGrad = "embedding_grad" ("ids, dy, init?") [2, 3] { num_embeddings: Dim, padding_idx: Option<Dim> } => embedding_grad;
    /// `dy * silu'(x)`.
    SiluGrad = "silu_grad" ("x, dy") [2, 2] => elementwise_grad;
    /// `dy * gelu'(x)`, exact or with the tanh approximation.
    GeluGrad = "gelu_grad" ("x, dy") [2, 2] { tanh_approx: bool } => elementwise_grad;
    /// Gradient of `softmax` from its output: `y * (dy - sum(dy * y, dim))`.
    SoftmaxGrad = "softmax_grad" ("y, dy") [2, 2] { dim: i64 } => softmax_grad;
    /// Gradients of `grouped_matmul` (same `transpose_w`): dx, and dw per expert (zero for an expert without rows); with `bias=true` also dbias [E, N], each expert's rows of dy summed.
    GroupedMatmulGrad = "grouped_matmul_grad" ("x, w, counts, dy") [4, 4] { transpose_w: Flag, bias: Flag } => grouped_matmul_grad;
    /// Gradients of `moe_combine`: drows, dweights.
    MoeCombineGrad = "moe_combine_grad" ("rows, order, weights, dy") [4, 4] => moe_combine_grad;

    // ---- fused (made by `fuse`; each equals the unfused ops it replaces, roundings included) ----
    /// Gated unit `act(gate) * up` (SwiGLU with `act=silu`, GeGLU with `gelu`/`gelu_tanh`), computed in f32 with `act(gate)` rounded to the dtype before the product, as the unfused ops round it.
    Glu = "glu" ("gate, up") [2, 2] { act: GateAct } => glu;
    /// Gradients of `glu` in one pass: dgate `act'(gate) * (dy * up)` and dup `dy * act(gate)` (each product rounded to the dtype where the unfused ops round it).
    GluGrad = "glu_grad" ("gate, up, dy") [3, 3] { act: GateAct } => glu_grad;
    /// Residual add and `rms_norm` in one pass: the new residual stream `sum = x + y` (rounded to x's dtype) and `rms_norm(sum, w)`.
    AddRmsNorm = "add_rms_norm" ("x, y, w") [3, 3] { eps: Float } => add_rms_norm;
    /// `rms_norm_grad` of the residual stream `sum` plus the gradient `dsum` the stream gets from its other readers, in one pass: the gradient of `sum` (the dx and dy of its add) and dw.
    AddRmsNormGrad = "add_rms_norm_grad" ("sum, w, dnorm, dsum") [4, 4] { eps: Float } => add_rms_norm_grad;
    /// `linear_cross_entropy` and its `linear_cross_entropy_grad` in one pass (made by `fuse` where the gradients `dlse`, `dtarget` of the statistics do not depend on them, as the loss's do): chunked over the tokens, `rows` at a time, each chunk's logits over the whole vocabulary are computed once into scratch, give the chunk's lse and target logit, and are turned in place into `dz` for `dx_c = dz w` and `dw += dz^T x_c`. Results: lse, target (as `linear_cross_entropy`), dx, dw (as its gradient). Nothing is recomputed; `dw` is summed over the chunks in its dtype (one rounding per chunk, as the unfused pair's accumulating GEMMs round).
    LinearCrossEntropyWithGrad = "linear_cross_entropy_with_grad" ("x, w, labels, dlse, dtarget") [5, 5] { ignore_index: i64, rows: i64, scale: Option<Float>, softcap: Option<Float> } => linear_cross_entropy_with_grad;
    /// `matmul(a, b) + c` as one GEMM that accumulates into `c` (cuBLASLt's beta = 1): `c` has the product's type exactly. The sum is rounded once, from the f32 accumulator (the unfused pair rounds the product first, then the sum).
    MatmulAdd = "matmul_add" ("a, b, c") [3, 3] { transpose_a: bool, transpose_b: bool } => matmul_add;

    // ---- optimizer (made by `optimizer`) ----
    /// One AdamW step (torch.optim.AdamW) of `param` with gradient `grad`, moments `m`, `v` and the 1-based step number `step` (float scalar): new param, m, v. With `warmup=w` the learning rate of step t is `lr * min(1, t / w)` (linear warmup).
    AdamW = "adamw" ("param, grad, m, v, step") [5, 5] { lr: Float, beta1: Float, beta2: Float, eps: Float, weight_decay: Float, warmup: Option<i64> } => adamw;
    /// `cast(adamw(master, cast(grad, f32), m, v, step).master, dtype)` in one pass (made by `fuse` from that mixed-precision chain): `grad` of any float dtype widened to the f32 `master`'s; new master, m, v and the new master rounded to `dtype` (the parameter the next step computes with). Bit for bit the unfused casts and `adamw`.
    AdamWMaster = "adamw_master" ("master, grad, m, v, step") [5, 5] { lr: Float, beta1: Float, beta2: Float, eps: Float, weight_decay: Float, dtype: DType, warmup: Option<i64> } => host_adamw;
    /// `adamw` run by the host CPU (`--offload-optimizer`): f32 `master` weights and moments `m`, `v` in pinned host memory, `grad` (any float dtype, copied to the host by `offload`) widened to the master's dtype; new master, m, v and the new master rounded to `dtype` (the parameter `reload` brings back). Bit for bit the device `cast`, `adamw`, `cast`.
    HostAdamW = "host_adamw" ("master, grad, m, v, step") [5, 5] { lr: Float, beta1: Float, beta2: Float, eps: Float, weight_decay: Float, dtype: DType, warmup: Option<i64> } => host_adamw;
    /// One SGD step (torch.optim.SGD): new param and, given a momentum buffer, the new buffer.
    Sgd = "sgd" ("param, grad, buf?") [2, 3] { lr: Float, momentum: Float, weight_decay: Float } => sgd;

    // ---- host offload (made by `offload`) ----
    /// Asynchronous device-to-host copy of a saved activation on copy stream `stream`; operands after `x` only order it.
    Offload = "offload" ("x, after..") [1, MANY] { stream: String } => offload;
    /// Host-to-device copy (prefetch) of an offloaded value on copy stream `stream`, issued once the `after` operands are computed.
    Reload = "reload" ("x, after..") [1, MANY] { stream: String } => offload;

    // ---- collectives (SPMD: every rank of the axis group runs them) ----
    /// Splits `scatter_dim` into one chunk per rank of `axis`, exchanges, concatenates along `gather_dim`.
    AllToAll = "all_to_all" ("x") [1, 1] { axis: String, scatter_dim: i64, gather_dim: i64 } => all_to_all, collective;
    /// Sends `send_counts[j]` consecutive rows (dim 0) of `x` to rank j of `axis` and joins the rows each rank sends here, in rank order: `rows` rows. A `rows` that is a symbol no input or mesh axis defines (`R57`, after the node) is data-dependent: the first such node binds it on each rank from the rows received, later ones are checked against it (see `Graph::runtime_symbols`). Its transpose is `all_to_all_v(dy, all_to_all(send_counts {scatter_dim=0, gather_dim=0})) {rows = x's rows}`.
    AllToAllV = "all_to_all_v" ("x, send_counts") [2, 2] { axis: String, rows: Dim } => all_to_all_v, collective;
    /// Reduces over the ranks of `axis`; every rank gets the result.
    AllReduce = "all_reduce" ("x") [1, 1] { axis: String, op: ReduceOp } => same, collective;
    /// Concatenates every rank's tensor along `dim`.
    AllGather = "all_gather" ("x") [1, 1] { axis: String, dim: i64 } => all_gather, collective;
    /// Reduces over `axis` and keeps this rank's chunk of `dim`.
    ReduceScatter = "reduce_scatter" ("x") [1, 1] { axis: String, dim: i64, op: ReduceOp } => reduce_scatter, collective;
    /// Ring step: each rank of `axis` sends `x` to the rank `shift` places after it (coordinate + shift, mod the axis size) and receives the tensor of the rank `shift` places before it. Its transpose is `ring_shift {shift=-shift}`.
    RingShift = "ring_shift" ("x") [1, 1] { axis: String, shift: i64 } => same, collective;
    /// Every rank of `axis` gets rank `root`'s tensor.
    Broadcast = "broadcast" ("x") [1, 1] { axis: String, root: i64 } => same, collective;
}

/// Where an `attention` or `attention_grad` node's optional operands sit, from its
/// flags and operand count: the flags say which of sinks and dlse are present, the
/// count whether a mask is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AttentionOperands {
    pub mask: Option<usize>,
    pub sinks: Option<usize>,
    pub dlse: Option<usize>,
}

impl Op {
    /// The optional operands of an `attention` (or `attention_grad`) with `n` operands;
    /// `Err` when the count does not fit the flags, `None` for other ops.
    pub fn attention_operands(&self, n: usize) -> Option<Result<AttentionOperands, String>> {
        let (fixed, sinks, lse) = match self {
            // the forward's `lse` is a result, not an operand
            Op::Attention { sinks, .. } => (3, sinks.0, false),
            Op::AttentionGrad { sinks, lse, .. } => (5, sinks.0, lse.0),
            _ => return None,
        };
        let flagged = fixed + sinks as usize + lse as usize;
        if n != flagged && n != flagged + 1 {
            return Some(Err(format!(
                "`{}` with sinks={sinks}{} takes {flagged} or {} operands (the second with a mask), got {n}",
                self.name(),
                if fixed == 5 { format!(", lse={lse}") } else { String::new() },
                flagged + 1
            )));
        }
        let mut next = fixed;
        let mut take = |present: bool| {
            present.then(|| {
                next += 1;
                next - 1
            })
        };
        let mask = take(n == flagged + 1);
        let sinks = take(sinks);
        let dlse = take(lse);
        Some(Ok(AttentionOperands { mask, sinks, dlse }))
    }

    /// The head layout of an `attention`, `attention_grad` or `rope`; `None` for other
    /// ops.
    pub fn head_layout(&self) -> Option<HeadLayout> {
        match self {
            Op::Attention { layout, .. }
            | Op::AttentionGrad { layout, .. }
            | Op::Rope { layout } => Some(*layout),
            _ => None,
        }
    }

    pub fn is_collective(&self) -> bool {
        self.info().collective
    }

    /// The mesh axis a collective runs over.
    pub fn axis(&self) -> Option<&str> {
        match self {
            Op::AllToAll { axis, .. }
            | Op::AllToAllV { axis, .. }
            | Op::AllReduce { axis, .. }
            | Op::AllGather { axis, .. }
            | Op::ReduceScatter { axis, .. }
            | Op::Broadcast { axis, .. }
            | Op::RingShift { axis, .. } => Some(axis),
            _ => None,
        }
    }

    /// The data-dependent size this node may define: the `rows` of an `all_to_all_v`
    /// when it is a single symbol. It is runtime-bound unless the graph's inputs or mesh
    /// already define that symbol ([`crate::Graph::runtime_symbols`] decides).
    pub fn defined_symbol(&self) -> Option<String> {
        match self {
            Op::AllToAllV { rows, .. } => {
                let syms = rows.symbols();
                match syms.as_slice() {
                    [s] if Dim::sym(s) == *rows => Some(s.clone()),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    /// Source ops take their result type from an attribute.
    pub fn is_source(&self) -> bool {
        matches!(
            self,
            Op::Param { .. } | Op::Input { .. } | Op::Full { .. } | Op::Arange { .. }
        )
    }

    pub fn info_by_name(name: &str) -> Option<&'static OpInfo> {
        OP_TABLE.iter().find(|i| i.name == name)
    }
}

/// Every op name, in table order.
pub fn op_names() -> Vec<&'static str> {
    OP_TABLE.iter().map(|i| i.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elementwise_facts_come_from_the_table() {
        assert_eq!(Op::Silu {}.elementwise(), Some(Elementwise::Unary));
        assert_eq!(Op::Where {}.elementwise(), Some(Elementwise::Select));
        assert_eq!(
            Op::Compare { op: CmpOp::Lt }.elementwise(),
            Some(Elementwise::Binary)
        );
        assert_eq!(Op::Linear {}.elementwise(), None);
        let flops = |name: &str| {
            OP_TABLE
                .iter()
                .find(|i| i.name == name)
                .and_then(|i| i.elementwise)
                .map(|e| e.flops)
        };
        assert_eq!(flops("gelu"), Some(4));
        assert_eq!(flops("add"), Some(1));
        assert_eq!(flops("attention"), None);
        // An elementwise op is never a collective, and its operand count is its class's.
        for i in OP_TABLE {
            if let Some(e) = i.elementwise {
                assert!(!i.collective, "{}", i.name);
                let n = match e.class {
                    Elementwise::Unary => 1,
                    Elementwise::Binary => 2,
                    Elementwise::Select => 3,
                };
                assert_eq!((i.min_operands, i.max_operands), (n, n), "{}", i.name);
            }
        }
    }
}
