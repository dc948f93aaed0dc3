//! The schemas of the ops the importer reads, in torch's own schema syntax. Export
//! omits arguments left at their defaults and may pass any argument by name, so each
//! node's arguments are matched to these parameter lists and defaults filled in. An op
//! absent from this table is reported as unsupported (naming the node and layer).

use super::schema::Arg;

/// One parameter: name, torch type text, default.
#[derive(Clone, Debug)]
pub struct Param {
    pub name: String,
    pub ty: String,
    pub default: Option<Arg>,
}

const SCHEMAS: &[&str] = &[
    // sizes and python arithmetic on sizes
    "aten::sym_size.int(Tensor self, int dim) -> SymInt",
    "aten::sym_numel(Tensor self) -> SymInt",
    "_operator::add(SymInt a, SymInt b) -> SymInt",
    "_operator::sub(SymInt a, SymInt b) -> SymInt",
    "_operator::mul(SymInt a, SymInt b) -> SymInt",
    "_operator::floordiv(SymInt a, SymInt b) -> SymInt",
    "_operator::neg(SymInt a) -> SymInt",
    "_operator::getitem(Any a, int b) -> Any",
    "aten::_assert_tensor_metadata(Tensor a, SymInt[]? size=None, SymInt[]? stride=None, ScalarType? dtype=None, *, Device? device=None, Layout? layout=None) -> ()",
    "aten::_assert_scalar(Scalar self, str assert_msg) -> ()",
    "aten::sym_constrain_range_for_size(Scalar size, *, int? min=None, int? max=None) -> ()",
    // sources
    "aten::embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1, bool scale_grad_by_freq=False, bool sparse=False) -> Tensor",
    "aten::arange(Scalar end, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor",
    "aten::arange.start(Scalar start, Scalar end, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor",
    "aten::arange.start_step(Scalar start, Scalar end, Scalar step=1, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor",
    "aten::full(SymInt[] size, Scalar fill_value, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor",
    "aten::full_like(Tensor self, Scalar fill_value, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None, MemoryFormat? memory_format=None) -> Tensor",
    "aten::zeros(SymInt[] size, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor",
    "aten::ones(SymInt[] size, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor",
    "aten::zeros_like(Tensor self, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None, MemoryFormat? memory_format=None) -> Tensor",
    "aten::ones_like(Tensor self, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None, MemoryFormat? memory_format=None) -> Tensor",
    "aten::empty_like(Tensor self, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None, MemoryFormat? memory_format=None) -> Tensor",
    "aten::empty.memory_format(SymInt[] size, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None, MemoryFormat? memory_format=None) -> Tensor",
    "aten::empty_permuted(SymInt[] size, int[] physical_layout, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor",
    "aten::new_ones(Tensor self, SymInt[] size, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor",
    "aten::new_zeros(Tensor self, SymInt[] size, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor",
    "aten::scalar_tensor(Scalar s, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor",
    "aten::lift_fresh_copy(Tensor self) -> Tensor",
    // elementwise
    "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor",
    "aten::add.Scalar(Tensor self, Scalar other, Scalar alpha=1) -> Tensor",
    "aten::sub.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor",
    "aten::sub.Scalar(Tensor self, Scalar other, Scalar alpha=1) -> Tensor",
    "aten::rsub.Scalar(Tensor self, Scalar other, Scalar alpha=1) -> Tensor",
    "aten::mul.Tensor(Tensor self, Tensor other) -> Tensor",
    "aten::mul.Scalar(Tensor self, Scalar other) -> Tensor",
    "aten::div.Tensor(Tensor self, Tensor other) -> Tensor",
    "aten::div.Scalar(Tensor self, Scalar other) -> Tensor",
    "aten::div.Tensor_mode(Tensor self, Tensor other, *, str? rounding_mode) -> Tensor",
    "aten::floor_divide(Tensor self, Tensor other) -> Tensor",
    "aten::pow.Tensor_Scalar(Tensor self, Scalar exponent) -> Tensor",
    "aten::pow.Tensor_Tensor(Tensor self, Tensor exponent) -> Tensor",
    "aten::neg(Tensor self) -> Tensor",
    "aten::exp(Tensor self) -> Tensor",
    "aten::log(Tensor self) -> Tensor",
    "aten::sqrt(Tensor self) -> Tensor",
    "aten::rsqrt(Tensor self) -> Tensor",
    "aten::tanh(Tensor self) -> Tensor",
    "aten::sigmoid(Tensor self) -> Tensor",
    "aten::silu(Tensor self) -> Tensor",
    "aten::relu(Tensor self) -> Tensor",
    "aten::gelu(Tensor self, *, str approximate='none') -> Tensor",
    "aten::cos(Tensor self) -> Tensor",
    "aten::sin(Tensor self) -> Tensor",
    "aten::maximum(Tensor self, Tensor other) -> Tensor",
    "aten::minimum(Tensor self, Tensor other) -> Tensor",
    "aten::clamp(Tensor self, Scalar? min=None, Scalar? max=None) -> Tensor",
    "aten::clamp_min(Tensor self, Scalar min) -> Tensor",
    "aten::clamp_max(Tensor self, Scalar max) -> Tensor",
    "aten::eq.Tensor(Tensor self, Tensor other) -> Tensor",
    "aten::eq.Scalar(Tensor self, Scalar other) -> Tensor",
    "aten::ne.Tensor(Tensor self, Tensor other) -> Tensor",
    "aten::ne.Scalar(Tensor self, Scalar other) -> Tensor",
    "aten::lt.Tensor(Tensor self, Tensor other) -> Tensor",
    "aten::lt.Scalar(Tensor self, Scalar other) -> Tensor",
    "aten::le.Tensor(Tensor self, Tensor other) -> Tensor",
    "aten::le.Scalar(Tensor self, Scalar other) -> Tensor",
    "aten::gt.Tensor(Tensor self, Tensor other) -> Tensor",
    "aten::gt.Scalar(Tensor self, Scalar other) -> Tensor",
    "aten::ge.Tensor(Tensor self, Tensor other) -> Tensor",
    "aten::ge.Scalar(Tensor self, Scalar other) -> Tensor",
    "aten::__and__.Tensor(Tensor self, Tensor other) -> Tensor",
    "aten::bitwise_and.Tensor(Tensor self, Tensor other) -> Tensor",
    "aten::logical_and(Tensor self, Tensor other) -> Tensor",
    "aten::__or__.Tensor(Tensor self, Tensor other) -> Tensor",
    "aten::bitwise_or.Tensor(Tensor self, Tensor other) -> Tensor",
    "aten::logical_or(Tensor self, Tensor other) -> Tensor",
    "aten::logical_not(Tensor self) -> Tensor",
    "aten::bitwise_not(Tensor self) -> Tensor",
    "aten::where.self(Tensor condition, Tensor self, Tensor other) -> Tensor",
    "aten::where.ScalarOther(Tensor condition, Tensor self, Scalar other) -> Tensor",
    "aten::where.ScalarSelf(Tensor condition, Scalar self, Tensor other) -> Tensor",
    "aten::masked_fill.Scalar(Tensor self, Tensor mask, Scalar value) -> Tensor",
    "aten::masked_fill.Tensor(Tensor self, Tensor mask, Tensor value) -> Tensor",
    // dtype and copies
    "aten::to.dtype(Tensor self, ScalarType dtype, bool non_blocking=False, bool copy=False, MemoryFormat? memory_format=None) -> Tensor",
    "aten::to.dtype_layout(Tensor self, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None, bool non_blocking=False, bool copy=False, MemoryFormat? memory_format=None) -> Tensor",
    "aten::to.device(Tensor self, Device device, ScalarType dtype, bool non_blocking=False, bool copy=False, MemoryFormat? memory_format=None) -> Tensor",
    "aten::_to_copy(Tensor self, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, bool? pin_memory=None, bool non_blocking=False, MemoryFormat? memory_format=None) -> Tensor",
    "aten::type_as(Tensor self, Tensor other) -> Tensor",
    "aten::clone(Tensor self, *, MemoryFormat? memory_format=None) -> Tensor",
    "aten::contiguous(Tensor self, *, MemoryFormat memory_format=contiguous_format) -> Tensor",
    "aten::alias(Tensor self) -> Tensor",
    "aten::detach(Tensor self) -> Tensor",
    "aten::dropout(Tensor input, float p, bool train) -> Tensor",
    "aten::copy(Tensor self, Tensor src, bool non_blocking=False) -> Tensor",
    // reductions
    "aten::mean.dim(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor",
    "aten::sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor",
    "aten::amax(Tensor self, int[1] dim=[], bool keepdim=False) -> Tensor",
    "aten::any.dim(Tensor self, int dim, bool keepdim=False) -> Tensor",
    "aten::max.dim(Tensor self, int dim, bool keepdim=False) -> (Tensor values, Tensor indices)",
    "aten::softmax.int(Tensor self, int dim, ScalarType? dtype=None) -> Tensor",
    "aten::_softmax(Tensor self, int dim, bool half_to_float) -> Tensor",
    "aten::log_softmax.int(Tensor self, int dim, ScalarType? dtype=None) -> Tensor",
    "aten::_log_softmax(Tensor self, int dim, bool half_to_float) -> Tensor",
    "aten::cumsum(Tensor self, int dim, *, ScalarType? dtype=None) -> Tensor",
    "aten::diff(Tensor self, int n=1, int dim=-1, Tensor? prepend=None, Tensor? append=None) -> Tensor",
    "aten::topk(Tensor self, SymInt k, int dim=-1, bool largest=True, bool sorted=True) -> (Tensor values, Tensor indices)",
    "aten::sort(Tensor self, int dim=-1, bool descending=False) -> (Tensor values, Tensor indices)",
    "aten::histc(Tensor self, int bins=100, Scalar min=0, Scalar max=0) -> Tensor",
    // matmuls
    "aten::linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
    "aten::mm(Tensor self, Tensor mat2) -> Tensor",
    "aten::addmm(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1, Scalar alpha=1) -> Tensor",
    "aten::bmm(Tensor self, Tensor mat2) -> Tensor",
    "aten::matmul(Tensor self, Tensor other) -> Tensor",
    "aten::scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float dropout_p=0.0, bool is_causal=False, *, float? scale=None, bool enable_gqa=False) -> Tensor",
    "transformers::grouped_mm_fallback(Tensor input, Tensor weight, Tensor offs) -> Tensor",
    // layout
    "aten::view(Tensor self, SymInt[] size) -> Tensor",
    "aten::reshape(Tensor self, SymInt[] shape) -> Tensor",
    "aten::_unsafe_view(Tensor self, SymInt[] size) -> Tensor",
    "aten::flatten.using_ints(Tensor self, int start_dim=0, int end_dim=-1) -> Tensor",
    "aten::unsqueeze(Tensor self, int dim) -> Tensor",
    "aten::squeeze.dim(Tensor self, int dim) -> Tensor",
    "aten::squeeze.dims(Tensor self, int[] dim) -> Tensor",
    "aten::squeeze(Tensor self) -> Tensor",
    "aten::transpose.int(Tensor self, int dim0, int dim1) -> Tensor",
    "aten::t(Tensor self) -> Tensor",
    "aten::permute(Tensor self, int[] dims) -> Tensor",
    "aten::expand(Tensor self, SymInt[] size, *, bool implicit=False) -> Tensor",
    "aten::expand_as(Tensor self, Tensor other) -> Tensor",
    "aten::slice.Tensor(Tensor self, int dim=0, SymInt? start=None, SymInt? end=None, SymInt step=1) -> Tensor",
    "aten::select.int(Tensor self, int dim, SymInt index) -> Tensor",
    "aten::slice_scatter(Tensor self, Tensor src, int dim=0, SymInt? start=None, SymInt? end=None, SymInt step=1) -> Tensor",
    "aten::cat(Tensor[] tensors, int dim=0) -> Tensor",
    "aten::split_with_sizes(Tensor self, SymInt[] split_sizes, int dim=0) -> Tensor[]",
    "aten::split.Tensor(Tensor self, SymInt split_size, int dim=0) -> Tensor[]",
    "aten::chunk(Tensor self, int chunks, int dim=0) -> Tensor[]",
    "aten::unbind.int(Tensor self, int dim=0) -> Tensor[]",
    "aten::index.Tensor(Tensor self, Tensor?[] indices) -> Tensor",
    "aten::index_select(Tensor self, int dim, Tensor index) -> Tensor",
    "aten::index_put(Tensor self, Tensor?[] indices, Tensor values, bool accumulate=False) -> Tensor",
    "aten::gather(Tensor self, int dim, Tensor index, *, bool sparse_grad=False) -> Tensor",
    "aten::scatter_add(Tensor self, int dim, Tensor index, Tensor src) -> Tensor",
    "aten::scatter.value(Tensor self, int dim, Tensor index, Scalar value) -> Tensor",
    "aten::one_hot(Tensor self, int num_classes=-1) -> Tensor",
    "aten::repeat_interleave.self_int(Tensor self, SymInt repeats, int? dim=None, *, SymInt? output_size=None) -> Tensor",
];

/// The op's key as the importer names it: `aten.add.Tensor`, `transformers.grouped_mm_fallback.default`.
fn key_of_schema(head: &str) -> String {
    let (ns, rest) = head.split_once("::").unwrap();
    let (name, overload) = rest.split_once('.').unwrap_or((rest, "default"));
    format!("{ns}.{name}.{overload}")
}

/// The schema of `key` (`aten.add.Tensor`), parsed.
pub fn lookup(key: &str) -> Option<Vec<Param>> {
    let table = table();
    table.iter().find(|(k, _)| k == key).map(|(_, p)| p.clone())
}

fn table() -> &'static Vec<(String, Vec<Param>)> {
    static T: std::sync::OnceLock<Vec<(String, Vec<Param>)>> = std::sync::OnceLock::new();
    T.get_or_init(|| SCHEMAS.iter().map(|s| parse_schema(s)).collect())
}

/// Every op key in the table (for docs and tests).
#[cfg(test)]
pub fn supported() -> Vec<&'static str> {
    table().iter().map(|(k, _)| k.as_str()).collect()
}

fn parse_schema(s: &str) -> (String, Vec<Param>) {
    let open = s.find('(').expect("schema has (");
    let close = s.rfind(") ->").expect("schema has ) ->");
    let key = key_of_schema(&s[..open]);
    let mut params = Vec::new();
    for part in split_top(&s[open + 1..close]) {
        let part = part.trim();
        if part.is_empty() || part == "*" {
            continue;
        }
        let (decl, default) = match part.split_once('=') {
            Some((d, v)) => (d.trim(), Some(parse_default(v.trim()))),
            None => (part, None),
        };
        let (ty, name) = decl.rsplit_once(' ').expect("param has a type and a name");
        params.push(Param {
            name: name.to_string(),
            ty: ty.to_string(),
            default,
        });
    }
    (key, params)
}

fn split_top(s: &str) -> Vec<&str> {
    let (mut depth, mut start, mut out) = (0, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '[' | '(' => depth += 1,
            ']' | ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn parse_default(v: &str) -> Arg {
    match v {
        "None" => Arg::None,
        "True" => Arg::Bool(true),
        "False" => Arg::Bool(false),
        "contiguous_format" => Arg::MemoryFormat(1),
        _ if v.starts_with('[') => {
            let inner = &v[1..v.len() - 1];
            Arg::Ints(
                inner
                    .split(',')
                    .filter(|x| !x.trim().is_empty())
                    .map(|x| x.trim().parse().unwrap())
                    .collect(),
            )
        }
        _ if v.starts_with('\'') => Arg::Str(v.trim_matches('\'').to_string()),
        _ => match v.parse::<i64>() {
            Ok(i) => Arg::Int(i),
            Err(_) => Arg::Float(v.parse().expect("numeric default")),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_parses_with_defaults() {
        let p = lookup("aten.slice.Tensor").unwrap();
        let names: Vec<&str> = p.iter().map(|x| x.name.as_str()).collect();
        assert_eq!(names, ["self", "dim", "start", "end", "step"]);
        assert_eq!(p[1].default, Some(Arg::Int(0)));
        assert_eq!(p[4].default, Some(Arg::Int(1)));
        let p = lookup("aten.scaled_dot_product_attention.default").unwrap();
        assert_eq!(p[4].default, Some(Arg::Float(0.0)));
        assert_eq!(p[7].default, Some(Arg::Bool(false)));
        assert!(lookup("aten.gelu.default").unwrap()[1].default == Some(Arg::Str("none".into())));
        assert!(lookup("aten.nonexistent.default").is_none());
        assert!(supported().len() > 100);
    }
}
