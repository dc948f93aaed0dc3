//! Layer specs: which parameters `tensor-parallel` splits and how, from regex patterns
//! over HF parameter names. Three sources, in priority order:
//!
//! 1. an explicit spec: DeepSpeed's `tensor_parallel.partition_config` JSON as it is
//!    (`layer_specs` with `patterns`, `partition_type` column|row|skip, `shape`,
//!    `partition_dim`, `gather_output`, `grad_allreduce`, `model_types`;
//!    `use_default_specs`, `strict_mode`), or the whole DeepSpeed config around it
//!    (`tp_grain_size` is read from there too);
//! 2. HF's `base_model_tp_plan` from config.json (`colwise`, `rowwise`,
//!    `colwise_rep`/`colwise_gather_output`, `replicated_with_grad_allreduce`; any other
//!    style is an error naming it);
//! 3. the built-in preset, which covers every family the frontends build.
//!
//! The first matching spec wins. An explicit spec with `use_default_specs` (DeepSpeed's
//! default: true) falls back to the HF plan and the preset for what it does not match.

use regex::Regex;
use std::fmt;

/// DeepSpeed's `partition_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PartitionType {
    /// Split the output features; no forward collective.
    Column,
    /// Split the input features; all_reduce the output.
    Row,
    /// Keep whole on every rank.
    Skip,
}

impl PartitionType {
    pub fn as_str(self) -> &'static str {
        match self {
            PartitionType::Column => "column",
            PartitionType::Row => "row",
            PartitionType::Skip => "skip",
        }
    }
}

/// One entry of a spec's `shape`: a size (`-1`: inferred) or, at the partition dim
/// only, the sizes of unequal sub-parameters.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ShapeEntry {
    Size(i64),
    Sub(Vec<i64>),
}

/// One layer spec.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LayerSpec {
    pub patterns: Vec<String>,
    pub partition_type: PartitionType,
    pub gather_output: bool,
    pub shape: Option<Vec<ShapeEntry>>,
    pub partition_dim: Option<usize>,
    pub grad_allreduce: bool,
    pub model_types: Option<Vec<String>>,
    /// Where the spec came from, for messages: `spec.json: layer_specs[2]`.
    pub origin: String,
}

impl LayerSpec {
    pub fn new(patterns: &[&str], partition_type: PartitionType, origin: &str) -> LayerSpec {
        LayerSpec {
            patterns: patterns.iter().map(|p| p.to_string()).collect(),
            partition_type,
            gather_output: false,
            shape: None,
            partition_dim: None,
            grad_allreduce: false,
            model_types: None,
            origin: origin.to_string(),
        }
    }
    fn grad_allreduce(mut self) -> Self {
        self.grad_allreduce = true;
        self
    }

    /// The sub-parameter spec at the partition dim: `Some(Ok(n))` n equal parts,
    /// `Some(Err(sizes))` unequal parts, `None` no sub-parameters given.
    pub fn sub_params(&self, dim: usize) -> Option<Result<i64, Vec<i64>>> {
        match self.shape.as_ref()?.get(dim)? {
            ShapeEntry::Size(n) if *n > 1 => Some(Ok(*n)),
            ShapeEntry::Size(_) => None,
            ShapeEntry::Sub(v) => Some(Err(v.clone())),
        }
    }
}

/// The parsed explicit spec (`--tp-spec FILE`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TpSpec {
    pub layer_specs: Vec<LayerSpec>,
    pub use_default_specs: bool,
    /// An unmatched linear is an error.
    pub strict: bool,
    /// DeepSpeed `tp_grain_size`, when the file gives it.
    pub grain: Option<i64>,
    /// Megatron-style sequence parallelism inside tp (weft's `sequence_parallel` key
    /// beside `tp_grain_size`).
    pub sequence_parallel: bool,
    /// The file, for messages.
    pub source: String,
}

/// A spec that cannot be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid tensor-parallel spec in {location}: {why}{}", .help.as_ref().map(|h| format!("\nhelp: {h}")).unwrap_or_default())]
pub struct SpecError {
    pub location: String,
    pub why: String,
    pub help: Option<String>,
}

fn err(location: impl Into<String>, why: impl Into<String>) -> SpecError {
    SpecError {
        location: location.into(),
        why: why.into(),
        help: None,
    }
}

impl SpecError {
    fn help(mut self, h: impl Into<String>) -> Self {
        self.help = Some(h.into());
        self
    }
}

impl TpSpec {
    /// Parses DeepSpeed JSON: a whole config (`tensor_parallel.partition_config`), a
    /// `tensor_parallel` object, or the `partition_config` object itself.
    pub fn from_deepspeed_json(text: &str, source: &str) -> Result<TpSpec, SpecError> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| err(source, format!("not JSON: {e}")))?;
        let mut grain = None;
        let mut sequence_parallel = false;
        let mut pc = &v;
        let mut at = String::new();
        if let Some(tp) = v.get("tensor_parallel") {
            at.push_str("tensor_parallel.");
            grain = tp.get("tp_grain_size").and_then(|g| g.as_i64());
            pc = tp;
        }
        if let Some(g) = pc.get("tp_grain_size").and_then(|g| g.as_i64()) {
            grain = Some(g);
        }
        if let Some(b) = pc.get("sequence_parallel") {
            sequence_parallel = b.as_bool().ok_or_else(|| {
                err(
                    format!("{source}: sequence_parallel"),
                    format!("must be true or false, got {b}"),
                )
            })?;
        }
        if let Some(p) = pc.get("partition_config") {
            at.push_str("partition_config.");
            pc = p;
        }
        let obj = pc
            .as_object()
            .ok_or_else(|| err(source, format!("`{at}` is not an object")))?;
        if !obj.contains_key("layer_specs") {
            return Err(err(source, format!("no `{at}layer_specs`")).help(
                "give DeepSpeed's `tensor_parallel.partition_config` with a `layer_specs` list",
            ));
        }
        if let Some(g) = grain {
            if g < 1 {
                return Err(err(
                    format!("{source}: tp_grain_size"),
                    format!("must be a positive integer, got {g}"),
                ));
            }
        }
        let boolean = |key: &str, default: bool| -> Result<bool, SpecError> {
            match obj.get(key) {
                None | Some(serde_json::Value::Null) => Ok(default),
                Some(serde_json::Value::Bool(b)) => Ok(*b),
                Some(other) => Err(err(
                    format!("{source}: {at}{key}"),
                    format!("must be true or false, got {other}"),
                )),
            }
        };
        let use_default_specs = boolean("use_default_specs", true)?;
        let strict = boolean("strict_mode", false)? || boolean("strict", false)?;
        let list = obj["layer_specs"]
            .as_array()
            .ok_or_else(|| err(format!("{source}: {at}layer_specs"), "must be a list"))?;
        let mut layer_specs = Vec::new();
        for (i, s) in list.iter().enumerate() {
            let origin = format!("{source}: {at}layer_specs[{i}]");
            layer_specs.push(parse_layer_spec(s, &origin)?);
        }
        Ok(TpSpec {
            layer_specs,
            use_default_specs,
            strict,
            grain,
            sequence_parallel,
            source: source.to_string(),
        })
    }
}

fn parse_layer_spec(s: &serde_json::Value, origin: &str) -> Result<LayerSpec, SpecError> {
    let o = s
        .as_object()
        .ok_or_else(|| err(origin, "must be an object"))?;
    for k in o.keys() {
        if ![
            "patterns",
            "partition_type",
            "gather_output",
            "shape",
            "partition_dim",
            "grad_allreduce",
            "model_types",
        ]
        .contains(&k.as_str())
        {
            return Err(err(origin, format!("unknown key `{k}`"))
                .help("keys are patterns, partition_type, shape, partition_dim, gather_output, grad_allreduce, model_types"));
        }
    }
    let patterns: Vec<String> = match o.get("patterns") {
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|p| {
                p.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| err(origin, format!("pattern {p} is not a string")))
            })
            .collect::<Result<_, _>>()?,
        Some(serde_json::Value::String(p)) => vec![p.clone()],
        _ => {
            return Err(err(
                origin,
                "needs `patterns`, a list of regular expressions",
            ))
        }
    };
    for p in &patterns {
        compile(p).map_err(|e| err(origin, format!("pattern `{p}` does not compile: {e}")))?;
    }
    let partition_type = match o.get("partition_type").map(|t| t.as_str()) {
        None => PartitionType::Column,
        Some(Some(t)) => match t.to_ascii_lowercase().as_str() {
            "column" => PartitionType::Column,
            "row" => PartitionType::Row,
            "skip" => PartitionType::Skip,
            _ => {
                return Err(err(origin, format!("unknown partition_type `{t}`"))
                    .help("use column, row or skip"))
            }
        },
        Some(None) => return Err(err(origin, "partition_type must be a string")),
    };
    let flag = |k: &str| -> Result<bool, SpecError> {
        match o.get(k) {
            None | Some(serde_json::Value::Null) => Ok(false),
            Some(serde_json::Value::Bool(b)) => Ok(*b),
            Some(v) => Err(err(origin, format!("`{k}` must be true or false, got {v}"))),
        }
    };
    let partition_dim = match o.get("partition_dim") {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| {
            err(
                origin,
                format!("partition_dim must be a non-negative integer, got {v}"),
            )
        })? as usize),
    };
    let shape = match o.get("shape") {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => Some(parse_shape(v, origin, partition_dim, partition_type)?),
    };
    let model_types = match o.get("model_types") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::Array(a)) => Some(
            a.iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect(),
        ),
        Some(v) => {
            return Err(err(
                origin,
                format!("model_types must be a list of strings, got {v}"),
            ))
        }
    };
    let spec = LayerSpec {
        patterns,
        partition_type,
        gather_output: flag("gather_output")?,
        shape,
        partition_dim,
        grad_allreduce: flag("grad_allreduce")?,
        model_types,
        origin: origin.to_string(),
    };
    if spec.gather_output && spec.partition_type != PartitionType::Column {
        return Err(err(
            origin,
            "gather_output applies to column-parallel layers only",
        ));
    }
    if spec.grad_allreduce && spec.partition_type != PartitionType::Skip {
        return Err(err(
            origin,
            "grad_allreduce applies to skip (replicated) layers only",
        ));
    }
    Ok(spec)
}

fn parse_shape(
    v: &serde_json::Value,
    origin: &str,
    pdim: Option<usize>,
    pt: PartitionType,
) -> Result<Vec<ShapeEntry>, SpecError> {
    let a = v
        .as_array()
        .ok_or_else(|| err(origin, format!("shape must be a list, got {v}")))?;
    let pdim = pdim.unwrap_or(if pt == PartitionType::Row { 1 } else { 0 });
    let mut out = Vec::new();
    for (i, x) in a.iter().enumerate() {
        match x {
            serde_json::Value::Number(n) => {
                let n = n.as_i64().filter(|&n| n == -1 || n > 0).ok_or_else(|| {
                    err(
                        origin,
                        format!("shape[{i}] must be a positive integer or -1, got {x}"),
                    )
                })?;
                out.push(ShapeEntry::Size(n));
            }
            serde_json::Value::Array(sub) => {
                if i != pdim {
                    return Err(err(origin, format!("shape[{i}] is a list, but sub-parameter sizes are only allowed at the partition dim ({pdim})")));
                }
                let sizes: Vec<i64> = sub
                    .iter()
                    .map(|s| s.as_i64().filter(|&s| s > 0).ok_or_else(|| err(origin, format!("sub-parameter size {s} in shape[{i}] must be a positive integer"))))
                    .collect::<Result<_, _>>()?;
                if sizes.is_empty() {
                    return Err(err(
                        origin,
                        format!("shape[{i}] lists no sub-parameter sizes"),
                    ));
                }
                out.push(ShapeEntry::Sub(sizes));
            }
            _ => {
                return Err(err(
                    origin,
                    format!("shape[{i}] must be an integer or a list of integers, got {x}"),
                ))
            }
        }
    }
    if pdim >= out.len() {
        return Err(err(
            origin,
            format!(
                "partition_dim {pdim} is out of range for shape of {} dims",
                out.len()
            ),
        ));
    }
    Ok(out)
}

fn compile(p: &str) -> Result<Regex, regex::Error> {
    // Python's re.match: anchored at the start only.
    Regex::new(&format!("^(?:{p})"))
}

/// HF `base_model_tp_plan` entries (`(module pattern, style)`, in file order) as specs.
pub fn from_hf_plan(plan: &[(String, String)], source: &str) -> Result<Vec<LayerSpec>, SpecError> {
    let mut out = Vec::new();
    for (key, style) in plan {
        let origin = format!("{source}: base_model_tp_plan[\"{key}\"]");
        let mut pat = String::new();
        for c in key.chars() {
            match c {
                '*' => pat.push_str(r"\d+"),
                c if c.is_ascii_alphanumeric() || c == '_' => pat.push(c),
                c => {
                    pat.push('\\');
                    pat.push(c);
                }
            }
        }
        let pattern = format!(r"(?:model\.)?{pat}(?:\.weight|\.bias)?$");
        let (pt, gather, grad) = match style.as_str() {
            "colwise" => (PartitionType::Column, false, false),
            "rowwise" => (PartitionType::Row, false, false),
            "colwise_rep" | "colwise_gather_output" => (PartitionType::Column, true, false),
            "replicated_with_grad_allreduce" => (PartitionType::Skip, false, true),
            other => {
                return Err(err(origin, format!("unsupported tensor-parallel style `{other}`"))
                    .help("supported styles: colwise, rowwise, colwise_rep, colwise_gather_output, replicated_with_grad_allreduce; give a DeepSpeed spec with --tp-spec to override the plan"))
            }
        };
        let mut s = LayerSpec::new(&[&pattern], pt, &origin);
        s.gather_output = gather;
        s.grad_allreduce = grad;
        out.push(s);
    }
    Ok(out)
}

/// The built-in preset: attention q/k/v column and o row, MLP gate/up column and down
/// row (fused phi3 projections by the sub-parameters of the split that follows), MoE
/// experts split on their intermediate dim, routers whole, qk-norms whole with their
/// gradients summed, vocabulary-parallel embedding and head.
pub fn preset() -> Vec<LayerSpec> {
    use PartitionType::*;
    let o = "built-in preset";
    vec![
        LayerSpec::new(&[r".*\.self_attn\.o_proj\.weight$"], Row, o),
        LayerSpec::new(&[r".*\.self_attn\.(q|k|v|qkv)_proj\.weight$"], Column, o),
        LayerSpec::new(&[r".*\.self_attn\.(q|k)_norm\.weight$"], Skip, o).grad_allreduce(),
        // Multi-head latent attention: the latent projections stay whole (every rank
        // computes the same latent), the expansions to heads split by heads.
        LayerSpec::new(&[r".*\.self_attn\.(q_b|kv_b)_proj\.weight$"], Column, o),
        LayerSpec::new(&[r".*\.mlp\.shared_experts\.down_proj\.weight$"], Row, o),
        LayerSpec::new(
            &[r".*\.mlp\.shared_experts\.(gate|up)_proj\.weight$"],
            Column,
            o,
        ),
        // Experts: the out dim of [E, out, in] (transposed gpt-oss [E, in, out]: dim 2)
        LayerSpec::new(&[r".*\.mlp\.experts\.gate_up_proj$"], Column, o),
        LayerSpec::new(&[r".*\.mlp\.experts\.down_proj$"], Row, o),
        LayerSpec::new(&[r".*\.mlp\.(gate|router)\.weight$"], Skip, o),
        LayerSpec::new(&[r".*\.mlp\.down_proj\.weight$"], Row, o),
        LayerSpec::new(&[r".*\.mlp\.(gate|up|gate_up)_proj\.weight$"], Column, o),
        LayerSpec::new(&[r".*embed_tokens\.weight$"], Column, o),
        LayerSpec::new(&[r"(.*\.)?lm_head\.weight$"], Column, o),
    ]
}

/// Specs with their regexes compiled, in match order.
pub struct Rules {
    rules: Vec<(LayerSpec, Vec<Regex>)>,
    pub strict: bool,
}

impl Rules {
    /// explicit (then, with `use_default_specs`, HF plan and preset) > HF plan > preset.
    pub fn new(explicit: Option<&TpSpec>, hf: &[LayerSpec]) -> Result<Rules, SpecError> {
        let mut all: Vec<LayerSpec> = Vec::new();
        let mut strict = false;
        let defaults = match explicit {
            Some(s) => {
                all.extend(s.layer_specs.iter().cloned());
                strict = s.strict;
                s.use_default_specs
            }
            None => true,
        };
        if defaults {
            all.extend(hf.iter().cloned());
            all.extend(preset());
        }
        let mut rules = Vec::new();
        for s in all {
            let mut rs = Vec::new();
            for p in &s.patterns {
                rs.push(
                    compile(p).map_err(|e| {
                        err(&s.origin, format!("pattern `{p}` does not compile: {e}"))
                    })?,
                );
            }
            rules.push((s, rs));
        }
        Ok(Rules { rules, strict })
    }

    /// The first spec matching parameter `name` (or its module, the name without
    /// `.weight`/`.bias`).
    pub fn find(&self, name: &str, model_type: Option<&str>) -> Option<&LayerSpec> {
        self.find_how(name, model_type).map(|(s, _)| s)
    }

    /// Like [`Rules::find`], and whether a pattern matched the full parameter name
    /// (`true`) or only its module (`false`).
    pub fn find_how(&self, name: &str, model_type: Option<&str>) -> Option<(&LayerSpec, bool)> {
        let module = name
            .strip_suffix(".weight")
            .or_else(|| name.strip_suffix(".bias"));
        self.rules.iter().find_map(|(s, rs)| {
            let type_ok = match (&s.model_types, model_type) {
                (None, _) => true,
                (Some(ts), Some(t)) => ts.iter().any(|x| x.eq_ignore_ascii_case(t)),
                (Some(_), None) => false,
            };
            if !type_ok {
                return None;
            }
            if rs.iter().any(|r| r.is_match(name)) {
                Some((s, true))
            } else if module.is_some_and(|m| rs.iter().any(|r| r.is_match(m))) {
                Some((s, false))
            } else {
                None
            }
        })
    }
}

impl fmt::Display for LayerSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}",
            self.partition_type.as_str(),
            self.patterns.join(" | ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deepspeed_json_as_it_is() {
        let text = r#"{"train_batch_size": 8, "tensor_parallel": {"autotp_size": 4, "tp_grain_size": 64, "partition_config": {
            "use_default_specs": false,
            "layer_specs": [
              {"patterns": [".*\\.o_proj\\.weight$", ".*\\.down_proj\\.weight$"], "partition_type": "row"},
              {"patterns": [".*\\.qkv_proj\\.weight$"], "partition_type": "column", "shape": [[4096, 1024, 1024], -1], "partition_dim": 0},
              {"patterns": [".*\\.gate_up_proj\\.weight$"], "partition_type": "column", "shape": [2, -1], "partition_dim": 0},
              {"patterns": [".*\\.q_norm\\.weight$"], "partition_type": "skip", "grad_allreduce": true}
            ]}}}"#;
        let s = TpSpec::from_deepspeed_json(text, "ds.json").unwrap();
        assert_eq!(s.grain, Some(64));
        assert!(!s.use_default_specs);
        assert_eq!(s.layer_specs.len(), 4);
        assert_eq!(
            s.layer_specs[1].sub_params(0),
            Some(Err(vec![4096, 1024, 1024]))
        );
        assert_eq!(s.layer_specs[2].sub_params(0), Some(Ok(2)));
        let r = Rules::new(Some(&s), &[]).unwrap();
        assert_eq!(
            r.find("model.layers.3.self_attn.o_proj.weight", None)
                .unwrap()
                .partition_type,
            PartitionType::Row
        );
        assert!(r
            .find("model.layers.3.self_attn.q_proj.weight", None)
            .is_none());
        assert!(
            r.find("model.layers.3.self_attn.q_norm.weight", None)
                .unwrap()
                .grad_allreduce
        );
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        let e = TpSpec::from_deepspeed_json(
            r#"{"layer_specs": [{"patterns": ["(.*"], "partition_type": "row"}]}"#,
            "s.json",
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("pattern `(.*` does not compile"),
            "{e}"
        );
        assert!(e.to_string().contains("s.json: layer_specs[0]"), "{e}");
        let e = TpSpec::from_deepspeed_json(
            r#"{"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]}"#,
            "s.json",
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("unknown partition_type `diagonal`"),
            "{e}"
        );
        let e = TpSpec::from_deepspeed_json(
            r#"{"layer_specs": [{"patterns": ["x"], "shape": [-1, [1, 2]]}]}"#,
            "s.json",
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("only allowed at the partition dim"),
            "{e}"
        );
        let e = from_hf_plan(
            &[("layers.*.mlp.experts".into(), "local_packed_rowwise".into())],
            "config.json",
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("unsupported tensor-parallel style `local_packed_rowwise`"),
            "{e}"
        );
    }

    #[test]
    fn hf_plan_and_priority() {
        let plan = vec![
            (
                "layers.*.self_attn.q_proj".to_string(),
                "colwise".to_string(),
            ),
            (
                "layers.*.self_attn.q_norm".to_string(),
                "replicated_with_grad_allreduce".to_string(),
            ),
            ("lm_head".to_string(), "colwise_rep".to_string()),
        ];
        let hf = from_hf_plan(&plan, "config.json").unwrap();
        let r = Rules::new(None, &hf).unwrap();
        let q = r
            .find("model.layers.12.self_attn.q_proj.weight", None)
            .unwrap();
        assert!(q.origin.contains("base_model_tp_plan"));
        assert!(
            r.find("model.layers.1.self_attn.q_norm.weight", None)
                .unwrap()
                .grad_allreduce
        );
        assert!(r.find("lm_head.weight", None).unwrap().gather_output);
        // Not in the plan: the preset.
        assert_eq!(
            r.find("model.layers.1.mlp.down_proj.weight", None)
                .unwrap()
                .origin,
            "built-in preset"
        );
        // An explicit spec comes first.
        let s = TpSpec::from_deepspeed_json(
            r#"{"layer_specs": [{"patterns": [".*q_proj.*"], "partition_type": "skip"}]}"#,
            "s.json",
        )
        .unwrap();
        let r = Rules::new(Some(&s), &hf).unwrap();
        assert_eq!(
            r.find("model.layers.12.self_attn.q_proj.weight", None)
                .unwrap()
                .partition_type,
            PartitionType::Skip
        );
    }
}
