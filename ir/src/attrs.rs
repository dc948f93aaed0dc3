//! Attribute value types of ops and their text forms. Every attribute type prints to a
//! string the parser reads back exactly (`f64` uses Rust's shortest round-trip form).

use crate::dim::Dim;
use crate::types::{DType, TensorType};
use std::fmt;

/// An `f64` attribute compared and hashed by its bits, so ops can derive `Eq`/`Hash`.
#[derive(Clone, Copy, Debug)]
pub struct Float(pub f64);

impl PartialEq for Float {
    fn eq(&self, o: &Float) -> bool {
        self.0.to_bits() == o.0.to_bits()
    }
}
impl Eq for Float {}
impl std::hash::Hash for Float {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.0.to_bits().hash(h)
    }
}
impl fmt::Display for Float {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}
impl From<f64> for Float {
    fn from(v: f64) -> Float {
        Float(v)
    }
}

/// What an input tensor of the model is; passes find inputs by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    InputIds,
    Labels,
    PositionIds,
    AttentionMask,
    Other,
    /// A fixed tensor of the checkpoint that is no parameter (an HF persistent buffer,
    /// e.g. DeepSeek-V3's `e_score_correction_bias`): read with the weights, the same on
    /// every rank, never differentiated or updated.
    Buffer,
}

/// How `cross_entropy` reduces the per-token losses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reduction {
    None,
    Sum,
    Mean,
}

/// The reduction a collective applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
    Min,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

/// Frequency scaling of rotary embeddings (HF `rope_scaling` / `rope_parameters`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeScaling {
    None,
    /// Position interpolation: positions divided by `factor`.
    Linear {
        factor: Float,
    },
    /// Llama 3.1's wavelength-dependent scaling.
    Llama3 {
        factor: Float,
        low_freq_factor: Float,
        high_freq_factor: Float,
        original_max_position_embeddings: i64,
    },
    /// YaRN (transformers `_compute_yarn_parameters`): each frequency blends its
    /// interpolated (`/factor`) and original values by a linear ramp over the rotary
    /// dims between the correction dims of `beta_fast` and `beta_slow` rotations in
    /// `original_max_position_embeddings` positions (floored/ceiled when `truncate`), and
    /// the cos/sin tables are multiplied by `attention_factor` (already resolved from
    /// `mscale` / `mscale_all_dim` by [`yarn_attention_factor`] when the config has none).
    Yarn {
        factor: Float,
        beta_fast: Float,
        beta_slow: Float,
        original_max_position_embeddings: i64,
        attention_factor: Float,
        truncate: bool,
    },
}

impl RopeScaling {
    /// The factor HF multiplies the cos/sin tables by (`attention_scaling`): 1 except
    /// for YaRN.
    pub fn attention_factor(&self) -> f64 {
        match self {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor.0,
            _ => 1.0,
        }
    }
}

/// YaRN's default `attention_factor` (HF `get_mscale`): with both `mscale` and
/// `mscale_all_dim` set and non-zero (DeepSeek-V3), `get_mscale(factor, mscale) /
/// get_mscale(factor, mscale_all_dim)`, else `get_mscale(factor)`, where
/// `get_mscale(s, m) = 0.1 * m * ln(s) + 1` for `s > 1` and 1 otherwise.
pub fn yarn_attention_factor(factor: f64, mscale: Option<f64>, mscale_all_dim: Option<f64>) -> f64 {
    let get = |s: f64, m: f64| {
        if s <= 1.0 {
            1.0
        } else {
            0.1 * m * s.ln() + 1.0
        }
    };
    match (mscale, mscale_all_dim) {
        (Some(m), Some(a)) if m != 0.0 && a != 0.0 => get(factor, m) / get(factor, a),
        _ => get(factor, 1.0),
    }
}

macro_rules! keyword_enum {
    ($t:ident { $($v:ident = $s:literal),* $(,)? }) => {
        impl $t {
            pub fn keyword(self) -> &'static str { match self { $($t::$v => $s),* } }
            pub fn from_keyword(s: &str) -> Option<$t> { match s { $($s => Some($t::$v),)* _ => None } }
            pub const KEYWORDS: &'static [&'static str] = &[$($s),*];
        }
        impl AttrValue for $t {
            fn fmt_attr(&self) -> Option<String> { Some(self.keyword().to_string()) }
            fn parse_attr(s: &str) -> Result<Self, String> {
                $t::from_keyword(s).ok_or_else(|| format!("expected one of {}, found `{s}`", $t::KEYWORDS.join(", ")))
            }
        }
    };
}

keyword_enum!(Role { InputIds = "input_ids", Labels = "labels", PositionIds = "position_ids", AttentionMask = "attention_mask", Other = "other", Buffer = "buffer" });
keyword_enum!(Reduction { None = "none", Sum = "sum", Mean = "mean" });
keyword_enum!(ReduceOp { Sum = "sum", Avg = "avg", Max = "max", Min = "min" });
/// The activation of a gated unit (`glu`): `act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GateAct {
    /// SiLU: SwiGLU (Llama, Qwen, Mistral, the MoE experts).
    Silu,
    /// Exact (erf) GELU.
    Gelu,
    /// GELU with the tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

keyword_enum!(GateAct { Silu = "silu", Gelu = "gelu", GeluTanh = "gelu_tanh" });
keyword_enum!(CmpOp { Eq = "eq", Ne = "ne", Lt = "lt", Le = "le", Gt = "gt", Ge = "ge" });

/// Where `attention`, `attention_grad` and `rope` find the heads and the sequence in
/// their per-head operands (q, k, v, out, dout, dq, dk, dv, rope's x and result):
/// `[B, H, S, D]` (the default, not printed) or `[B, S, H, D]` (`layout=bshd`, what the
/// q/k/v projections produce, so no transposes are needed around attention). Masks,
/// sinks and the log-sum-exp statistics keep their shapes in either layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HeadLayout {
    #[default]
    Bhsd,
    Bshd,
}

impl HeadLayout {
    pub fn keyword(self) -> &'static str {
        match self {
            HeadLayout::Bhsd => "bhsd",
            HeadLayout::Bshd => "bshd",
        }
    }
    /// The dim of the heads (1 or 2).
    pub fn heads_dim(self) -> usize {
        match self {
            HeadLayout::Bhsd => 1,
            HeadLayout::Bshd => 2,
        }
    }
    /// The dim of the sequence (2 or 1).
    pub fn seq_dim(self) -> usize {
        3 - self.heads_dim()
    }
    /// A per-head tensor of this layout seen as `[B, H, S, D]` (its dims 1 and 2 swapped
    /// for `bshd`); the swap is its own inverse, so this also turns a `[B, H, S, D]` type
    /// into this layout's. Tensors of rank below 3 are returned as they are.
    pub fn swap_to_bhsd(self, t: &TensorType) -> TensorType {
        let mut t = t.clone();
        if self == HeadLayout::Bshd && t.rank() >= 3 {
            t.shape.swap(1, 2);
        }
        t
    }
}

impl AttrValue for HeadLayout {
    fn fmt_attr(&self) -> Option<String> {
        (*self != HeadLayout::Bhsd).then(|| self.keyword().to_string())
    }
    fn parse_attr(s: &str) -> Result<Self, String> {
        match s {
            "bhsd" => Ok(HeadLayout::Bhsd),
            "bshd" => Ok(HeadLayout::Bshd),
            _ => Err(format!("expected bhsd or bshd, found `{s}`")),
        }
    }
    fn absent() -> Option<Self> {
        Some(HeadLayout::Bhsd)
    }
}

/// A value that can appear as `key=value` in an op's attribute list.
pub trait AttrValue: Sized {
    /// The text form, or `None` to omit the attribute (absent optional values).
    fn fmt_attr(&self) -> Option<String>;
    fn parse_attr(s: &str) -> Result<Self, String>;
    /// The value of an attribute missing from the text, if it may be missing.
    fn absent() -> Option<Self> {
        None
    }
}

impl AttrValue for i64 {
    fn fmt_attr(&self) -> Option<String> {
        Some(self.to_string())
    }
    fn parse_attr(s: &str) -> Result<Self, String> {
        s.parse()
            .map_err(|_| format!("expected an integer, found `{s}`"))
    }
}

impl AttrValue for Float {
    fn fmt_attr(&self) -> Option<String> {
        Some(self.to_string())
    }
    fn parse_attr(s: &str) -> Result<Self, String> {
        s.parse::<f64>()
            .map(Float)
            .map_err(|_| format!("expected a number, found `{s}`"))
    }
}

impl AttrValue for bool {
    fn fmt_attr(&self) -> Option<String> {
        Some(self.to_string())
    }
    fn parse_attr(s: &str) -> Result<Self, String> {
        match s {
            "true" => Ok(true),
            "false" => Ok(false),
            _ => Err(format!("expected true or false, found `{s}`")),
        }
    }
}

impl AttrValue for String {
    fn fmt_attr(&self) -> Option<String> {
        Some(quote(self))
    }
    fn parse_attr(s: &str) -> Result<Self, String> {
        unquote(s)
    }
}

impl AttrValue for DType {
    fn fmt_attr(&self) -> Option<String> {
        Some(self.name().to_string())
    }
    fn parse_attr(s: &str) -> Result<Self, String> {
        DType::from_name(s).ok_or_else(|| {
            format!("unknown dtype `{s}` (expected f64, f32, bf16, f16, i64, i32, bool)")
        })
    }
}

impl AttrValue for Dim {
    fn fmt_attr(&self) -> Option<String> {
        Some(self.to_string())
    }
    fn parse_attr(s: &str) -> Result<Self, String> {
        crate::parse::parse_dim(s).map_err(|e| e.to_string())
    }
}

/// The result type of source ops; never printed (the line's result type carries it).
impl AttrValue for TensorType {
    fn fmt_attr(&self) -> Option<String> {
        None
    }
    fn parse_attr(s: &str) -> Result<Self, String> {
        crate::parse::parse_type(s).map_err(|e| e.to_string())
    }
}

/// A boolean attribute that is off unless written: printed only when true (`sinks=true`),
/// absent from the text when false, so adding one leaves existing programs' text alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Flag(pub bool);

impl From<bool> for Flag {
    fn from(b: bool) -> Flag {
        Flag(b)
    }
}

impl AttrValue for Flag {
    fn fmt_attr(&self) -> Option<String> {
        self.0.then(|| "true".to_string())
    }
    fn parse_attr(s: &str) -> Result<Self, String> {
        bool::parse_attr(s).map(Flag)
    }
    fn absent() -> Option<Self> {
        Some(Flag(false))
    }
}

impl<T: AttrValue> AttrValue for Option<T> {
    fn fmt_attr(&self) -> Option<String> {
        self.as_ref().and_then(|v| v.fmt_attr())
    }
    fn parse_attr(s: &str) -> Result<Self, String> {
        T::parse_attr(s).map(Some)
    }
    fn absent() -> Option<Self> {
        Some(None)
    }
}

impl<T: AttrValue> AttrValue for Vec<T> {
    fn fmt_attr(&self) -> Option<String> {
        let items: Vec<String> = self
            .iter()
            .map(|v| v.fmt_attr().unwrap_or_default())
            .collect();
        Some(format!("[{}]", items.join(", ")))
    }
    fn parse_attr(s: &str) -> Result<Self, String> {
        let inner = s
            .strip_prefix('[')
            .and_then(|r| r.strip_suffix(']'))
            .ok_or_else(|| format!("expected a list in brackets, found `{s}`"))?;
        split_top_level(inner, ',')?
            .into_iter()
            .filter(|p| !p.is_empty())
            .map(|p| T::parse_attr(p))
            .collect()
    }
}

impl AttrValue for RopeScaling {
    fn fmt_attr(&self) -> Option<String> {
        Some(match self {
            RopeScaling::None => "none".to_string(),
            RopeScaling::Linear { factor } => format!("linear({factor})"),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                format!("llama3({factor}, {low_freq_factor}, {high_freq_factor}, {original_max_position_embeddings})")
            }
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings,
                attention_factor,
                truncate,
            } => format!("yarn({factor}, {beta_fast}, {beta_slow}, {original_max_position_embeddings}, {attention_factor}, {truncate})"),
        })
    }
    fn parse_attr(s: &str) -> Result<Self, String> {
        if s == "none" {
            return Ok(RopeScaling::None);
        }
        let (head, args) = s
            .split_once('(')
            .and_then(|(h, r)| r.strip_suffix(')').map(|a| (h, a)))
            .ok_or_else(|| {
                format!("expected none, linear(f), llama3(f, lo, hi, orig) or yarn(f, beta_fast, beta_slow, orig, attention_factor, truncate), found `{s}`")
            })?;
        let parts = split_top_level(args, ',')?;
        let num = |i: usize| -> Result<Float, String> {
            parts
                .get(i)
                .ok_or_else(|| format!("missing argument {i} in `{s}`"))
                .and_then(|p| Float::parse_attr(p))
        };
        match (head, parts.len()) {
            ("linear", 1) => Ok(RopeScaling::Linear { factor: num(0)? }),
            ("llama3", 4) => Ok(RopeScaling::Llama3 {
                factor: num(0)?,
                low_freq_factor: num(1)?,
                high_freq_factor: num(2)?,
                original_max_position_embeddings: i64::parse_attr(parts[3])?,
            }),
            ("yarn", 6) => Ok(RopeScaling::Yarn {
                factor: num(0)?,
                beta_fast: num(1)?,
                beta_slow: num(2)?,
                original_max_position_embeddings: i64::parse_attr(parts[3])?,
                attention_factor: num(4)?,
                truncate: bool::parse_attr(parts[5])?,
            }),
            _ => Err(format!(
                "unknown rope scaling `{s}` (expected none, linear(f), llama3(f, lo, hi, orig) or yarn(f, beta_fast, beta_slow, orig, attention_factor, truncate))"
            )),
        }
    }
}

pub fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

pub fn unquote(s: &str) -> Result<String, String> {
    let inner = s
        .strip_prefix('"')
        .and_then(|r| r.strip_suffix('"'))
        .ok_or_else(|| format!("expected a quoted string, found `{s}`"))?;
    let mut out = String::new();
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('n') => out.push('\n'),
                Some(c) => out.push(c),
                None => return Err("dangling escape at end of string".into()),
            }
        } else {
            out.push(c);
        }
    }
    Ok(out)
}

/// Splits at `sep` outside brackets, parentheses and quotes; trims the parts.
pub fn split_top_level(s: &str, sep: char) -> Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let (mut depth, mut in_str, mut escaped, mut start) = (0i32, false, false, 0usize);
    for (i, c) in s.char_indices() {
        if in_str {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_str = true,
            '[' | '(' | '{' => depth += 1,
            ']' | ')' | '}' => {
                depth -= 1;
                if depth < 0 {
                    return Err(format!("unbalanced `{c}` in `{s}`"));
                }
            }
            c if c == sep && depth == 0 => {
                parts.push(s[start..i].trim());
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    if in_str {
        return Err(format!("unterminated string in `{s}`"));
    }
    if depth != 0 {
        return Err(format!("unbalanced brackets in `{s}`"));
    }
    let last = s[start..].trim();
    if !last.is_empty() || !parts.is_empty() {
        parts.push(last);
    }
    Ok(parts)
}

/// HF `rope_init_fn` results: the inverse frequencies of a rotary table, in f64 (in
/// f32 precision they are rounded to f32 at each step where HF computes in f32).
pub fn rope_inv_freq(theta: f64, dim: usize, scaling: &RopeScaling, f32_steps: bool) -> Vec<f64> {
    let r = |v: f64| if f32_steps { v as f32 as f64 } else { v };
    // inv_freq = 1 / base ** (arange(0, dim, 2).float() / dim)
    let mut inv: Vec<f64> = (0..dim)
        .step_by(2)
        .map(|i| {
            if f32_steps {
                let e = i as f32 / dim as f32;
                (1.0f32 / (theta as f32).powf(e)) as f64
            } else {
                1.0 / theta.powf(i as f64 / dim as f64)
            }
        })
        .collect();
    match scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => {
            for v in &mut inv {
                *v = r(*v / factor.0);
            }
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            // transformers `_compute_llama3_parameters`.
            let (factor, lo, hi) = (factor.0, low_freq_factor.0, high_freq_factor.0);
            let old = *original_max_position_embeddings as f64;
            let low_freq_wavelen = old / lo;
            let high_freq_wavelen = old / hi;
            for v in &mut inv {
                let f = *v;
                let wavelen = r(2.0 * std::f64::consts::PI / f);
                let llama = if wavelen > low_freq_wavelen {
                    r(f / factor)
                } else {
                    f
                };
                let smooth = r((r(old / wavelen) - lo) / (hi - lo));
                let smoothed = r(r(r((1.0 - smooth) * llama) / factor) + r(smooth * llama));
                // HF's `~(wavelen < high) * ~(wavelen > low)`, NaN included
                #[allow(clippy::neg_cmp_op_on_partial_ord)]
                let medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
                *v = if medium { smoothed } else { llama };
            }
        }
        RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position_embeddings,
            truncate,
            ..
        } => {
            // transformers `_compute_yarn_parameters`: the correction range in f64 (Python
            // floats), the blend in f32 tensors when `f32_steps`.
            let d = dim as f64;
            let orig = *original_max_position_embeddings as f64;
            let correction_dim = |rotations: f64| {
                d * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (correction_dim(beta_fast.0), correction_dim(beta_slow.0));
            if *truncate {
                low = low.floor();
                high = high.ceil();
            }
            let low = low.max(0.0);
            let mut high = high.min(d - 1.0);
            if low == high {
                high += 0.001; // HF: "prevent singularity"
            }
            for (i, v) in inv.iter_mut().enumerate() {
                let extrapolation = *v;
                let e = (2 * i) as f64 / d;
                let ramp = if f32_steps {
                    let x = (i as f32 - low as f32) / (high - low) as f32;
                    x.clamp(0.0, 1.0) as f64
                } else {
                    ((i as f64 - low) / (high - low)).clamp(0.0, 1.0)
                };
                let extrapolation_factor = r(1.0 - ramp);
                // 1 / (factor * pos_freq), pos_freq = 1 / extrapolation
                let interpolation = if f32_steps {
                    let pos_freq = (theta as f32).powf((2 * i) as f32 / dim as f32);
                    (1.0f32 / (factor.0 as f32 * pos_freq)) as f64
                } else {
                    1.0 / (factor.0 * theta.powf(e))
                };
                *v = r(r(interpolation * r(1.0 - extrapolation_factor))
                    + r(extrapolation * extrapolation_factor));
            }
        }
    }
    inv
}
