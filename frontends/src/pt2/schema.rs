//! The serialized ExportedProgram (`models/model.json`, export schema major 8) as Rust
//! types. The JSON writes unions as objects with a single key (`{"as_int": 3}`), enums
//! as integers (export's own numbering, see [`ScalarType`]), floats that JSON cannot
//! hold as strings (`"-Infinity"`), and omits arguments left at their defaults. This
//! module only reads what is there; `fx.rs` fills in defaults from the op table.
//! Every error names the entry and the JSON path (`graph.nodes[12].inputs[3]`).

use super::error::Pt2Error;
use serde_json::Value as J;
use std::collections::BTreeMap;

/// A size: a constant or a sympy expression (`srepr` text) with its example value.
#[derive(Clone, Debug, PartialEq)]
pub enum SymInt {
    Int(i64),
    Expr { expr: String, hint: Option<i64> },
}

#[derive(Clone, Debug, PartialEq)]
pub struct TensorMeta {
    /// Export's ScalarType code.
    pub dtype: i64,
    pub sizes: Vec<SymInt>,
    pub strides: Vec<SymInt>,
    pub storage_offset: SymInt,
    pub requires_grad: bool,
}

/// A size argument: the name of a symbolic int value or a constant.
#[derive(Clone, Debug, PartialEq)]
pub enum SymArg {
    Name(String),
    Int(i64),
}

/// A float argument: a symbolic float's name or a constant.
#[derive(Clone, Debug, PartialEq)]
pub enum SymFloatArg {
    Name(String),
    Float(f64),
}

/// One argument of a node (the `Argument` union).
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    None,
    Tensor(String),
    Tensors(Vec<String>),
    OptionalTensors(Vec<Option<String>>),
    OptionalTensor(Option<String>),
    Int(i64),
    Ints(Vec<i64>),
    Float(f64),
    Floats(Vec<f64>),
    Str(String),
    Strs(Vec<String>),
    Bool(bool),
    Bools(Vec<bool>),
    SymInt(SymArg),
    SymInts(Vec<SymArg>),
    SymFloat(SymFloatArg),
    SymBool(String),
    ScalarType(i64),
    MemoryFormat(i64),
    Layout(i64),
    Device(String),
    Graph(String, Box<Graph>),
    /// A union member the importer does not read (its key), kept so that an op that
    /// never needs it still imports.
    Other(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct NamedArg {
    pub name: String,
    pub arg: Arg,
    /// 1 positional, 2 keyword.
    pub kind: Option<i64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub target: String,
    pub inputs: Vec<NamedArg>,
    pub outputs: Vec<Arg>,
    pub metadata: BTreeMap<String, String>,
    pub name: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Default)]
pub struct Graph {
    pub inputs: Vec<Arg>,
    pub outputs: Vec<Arg>,
    pub nodes: Vec<Node>,
    pub tensor_values: BTreeMap<String, TensorMeta>,
    pub sym_int_values: BTreeMap<String, SymInt>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum InputSpec {
    User {
        arg: Arg,
    },
    Parameter {
        name: String,
        target: String,
    },
    /// `persistent`: in the module's state_dict (a checkpoint tensor such as DeepSeek-V3's
    /// `e_score_correction_bias`), not a derived one (rotary `inv_freq`).
    Buffer {
        name: String,
        target: String,
        persistent: bool,
    },
    Constant {
        name: String,
        target: String,
    },
    ConstantInput {
        name: String,
    },
    Other {
        kind: String,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub enum OutputSpec {
    User { arg: Arg },
    Other { kind: String, name: String },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Program {
    pub graph: Graph,
    pub inputs: Vec<InputSpec>,
    pub outputs: Vec<OutputSpec>,
    pub schema: (i64, i64),
    pub torch_version: String,
    /// `forward_arg_names` of the root call, when recorded.
    pub forward_arg_names: Vec<String>,
    /// The fields of the root call's output (its `out_spec`), when it returns a named
    /// structure: each field's name and how many output tensors it holds, in output
    /// order (`aux_loss` 1, `logits` 1, `router_logits` one per MoE layer).
    pub output_fields: Vec<(String, usize)>,
    pub range_constraints: BTreeMap<String, (Option<i64>, Option<i64>)>,
}

/// One entry of `model_weights_config.json` / `model_constants_config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct PayloadMeta {
    pub path_name: String,
    pub is_param: bool,
    pub use_pickle: bool,
    pub meta: Option<TensorMeta>,
}

/// Export's ScalarType numbering (not c10's): `(code, name, weft dtype, bytes)`.
pub struct ScalarType;

impl ScalarType {
    const TABLE: &'static [(i64, &'static str, Option<weft_ir::DType>, usize)] = &[
        (0, "unknown", None, 0),
        (1, "uint8", None, 1),
        (2, "int8", None, 1),
        (3, "int16", None, 2),
        (4, "int32", Some(weft_ir::DType::I32), 4),
        (5, "int64", Some(weft_ir::DType::I64), 8),
        (6, "float16", Some(weft_ir::DType::F16), 2),
        (7, "float32", Some(weft_ir::DType::F32), 4),
        (8, "float64", Some(weft_ir::DType::F64), 8),
        (9, "complex32", None, 4),
        (10, "complex64", None, 8),
        (11, "complex128", None, 16),
        (12, "bool", Some(weft_ir::DType::Bool), 1),
        (13, "bfloat16", Some(weft_ir::DType::BF16), 2),
        (28, "uint16", None, 2),
        (29, "float8_e4m3fn", None, 1),
        (30, "float8_e5m2", None, 1),
        (31, "float8_e4m3fnuz", None, 1),
        (32, "float8_e5m2fnuz", None, 1),
        (33, "float8_e8m0fnu", None, 1),
        (34, "uint32", None, 4),
        (35, "uint64", None, 8),
    ];

    /// The torch name of a code (`"unknown code"` if there is none).
    pub fn name(code: i64) -> &'static str {
        Self::TABLE
            .iter()
            .find(|t| t.0 == code)
            .map(|t| t.1)
            .unwrap_or("unknown code")
    }

    pub fn dtype(code: i64) -> Option<weft_ir::DType> {
        Self::TABLE.iter().find(|t| t.0 == code).and_then(|t| t.2)
    }

    pub fn size_bytes(code: i64) -> Option<usize> {
        Self::TABLE
            .iter()
            .find(|t| t.0 == code)
            .map(|t| t.3)
            .filter(|&b| b > 0)
    }
}

/// Reads `text` as JSON, with the entry name in errors.
pub fn parse_json(entry: &str, text: &str) -> Result<J, Pt2Error> {
    serde_json::from_str(text).map_err(|e| Pt2Error::Json {
        entry: entry.to_string(),
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })
}

fn kind_of(v: &J) -> &'static str {
    match v {
        J::Null => "null",
        J::Bool(_) => "a boolean",
        J::Number(_) => "a number",
        J::String(_) => "a string",
        J::Array(_) => "a list",
        J::Object(_) => "an object",
    }
}

struct Reader<'a> {
    entry: &'a str,
}

impl<'a> Reader<'a> {
    fn err(&self, path: &str, msg: impl Into<String>) -> Pt2Error {
        Pt2Error::schema(
            self.entry,
            if path.is_empty() {
                "the top level"
            } else {
                path
            },
            msg,
        )
    }

    fn obj<'j>(&self, v: &'j J, path: &str) -> Result<&'j serde_json::Map<String, J>, Pt2Error> {
        v.as_object()
            .ok_or_else(|| self.err(path, format!("expected an object, found {}", kind_of(v))))
    }

    fn field<'j>(&self, v: &'j J, key: &str, path: &str) -> Result<&'j J, Pt2Error> {
        self.obj(v, path)?
            .get(key)
            .ok_or_else(|| self.err(path, format!("missing field `{key}`")))
    }

    fn opt_field<'j>(&self, v: &'j J, key: &str, path: &str) -> Result<Option<&'j J>, Pt2Error> {
        Ok(self.obj(v, path)?.get(key).filter(|x| !x.is_null()))
    }

    fn list<'j>(&self, v: &'j J, path: &str) -> Result<&'j Vec<J>, Pt2Error> {
        v.as_array()
            .ok_or_else(|| self.err(path, format!("expected a list, found {}", kind_of(v))))
    }

    fn int(&self, v: &J, path: &str) -> Result<i64, Pt2Error> {
        if let Some(i) = v.as_i64() {
            return Ok(i);
        }
        // Python ints past i64 (rare): saturate u64 like INT64_MAX slice ends.
        if let Some(u) = v.as_u64() {
            return Ok(i64::try_from(u).unwrap_or(i64::MAX));
        }
        Err(self.err(path, format!("expected an integer, found {}", kind_of(v))))
    }

    fn float(&self, v: &J, path: &str) -> Result<f64, Pt2Error> {
        match v {
            J::Number(n) => n
                .as_f64()
                .ok_or_else(|| self.err(path, "number out of range")),
            J::String(s) => match s.as_str() {
                "Infinity" | "inf" => Ok(f64::INFINITY),
                "-Infinity" | "-inf" => Ok(f64::NEG_INFINITY),
                "NaN" | "nan" => Ok(f64::NAN),
                _ => Err(self.err(path, format!("expected a float, found the string `{s}`"))),
            },
            _ => Err(self.err(path, format!("expected a float, found {}", kind_of(v)))),
        }
    }

    fn string(&self, v: &J, path: &str) -> Result<String, Pt2Error> {
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| self.err(path, format!("expected a string, found {}", kind_of(v))))
    }

    fn boolean(&self, v: &J, path: &str) -> Result<bool, Pt2Error> {
        v.as_bool()
            .ok_or_else(|| self.err(path, format!("expected a boolean, found {}", kind_of(v))))
    }

    /// A union: exactly one key.
    fn union<'j>(&self, v: &'j J, path: &str) -> Result<(&'j str, &'j J), Pt2Error> {
        let o = self.obj(v, path)?;
        let mut it = o.iter().filter(|(_, x)| !x.is_null() || o.len() == 1);
        match (it.next(), it.next()) {
            (Some((k, x)), None) => Ok((k.as_str(), x)),
            (None, _) => Err(self.err(
                path,
                "expected a union object with one key, found an empty object",
            )),
            _ => Err(self.err(
                path,
                format!(
                    "expected a union object with one key, found keys {:?}",
                    o.keys().collect::<Vec<_>>()
                ),
            )),
        }
    }

    fn sym_int(&self, v: &J, path: &str) -> Result<SymInt, Pt2Error> {
        let (k, x) = self.union(v, path)?;
        let p = format!("{path}.{k}");
        match k {
            "as_int" => Ok(SymInt::Int(self.int(x, &p)?)),
            "as_expr" => {
                let expr = self.string(self.field(x, "expr_str", &p)?, &format!("{p}.expr_str"))?;
                let hint = match self.opt_field(x, "hint", &p)? {
                    Some(h) => {
                        let (hk, hv) = self.union(h, &format!("{p}.hint"))?;
                        if hk == "as_int" {
                            Some(self.int(hv, &format!("{p}.hint.as_int"))?)
                        } else {
                            None
                        }
                    }
                    None => None,
                };
                Ok(SymInt::Expr { expr, hint })
            }
            _ => Err(self.err(path, format!("unknown SymInt kind `{k}`"))),
        }
    }

    fn tensor_meta(&self, v: &J, path: &str) -> Result<TensorMeta, Pt2Error> {
        let dtype = self.int(self.field(v, "dtype", path)?, &format!("{path}.dtype"))?;
        let list = |key: &str| -> Result<Vec<SymInt>, Pt2Error> {
            let p = format!("{path}.{key}");
            self.list(self.field(v, key, path)?, &p)?
                .iter()
                .enumerate()
                .map(|(i, x)| self.sym_int(x, &format!("{p}[{i}]")))
                .collect()
        };
        let sizes = list("sizes")?;
        let strides = match self.opt_field(v, "strides", path)? {
            Some(_) => list("strides")?,
            None => Vec::new(),
        };
        let storage_offset = match self.opt_field(v, "storage_offset", path)? {
            Some(x) => self.sym_int(x, &format!("{path}.storage_offset"))?,
            None => SymInt::Int(0),
        };
        let requires_grad = match self.opt_field(v, "requires_grad", path)? {
            Some(x) => self.boolean(x, &format!("{path}.requires_grad"))?,
            None => false,
        };
        Ok(TensorMeta {
            dtype,
            sizes,
            strides,
            storage_offset,
            requires_grad,
        })
    }

    fn tensor_name(&self, v: &J, path: &str) -> Result<String, Pt2Error> {
        self.string(self.field(v, "name", path)?, &format!("{path}.name"))
    }

    fn sym_arg(&self, v: &J, path: &str) -> Result<SymArg, Pt2Error> {
        let (k, x) = self.union(v, path)?;
        match k {
            "as_name" => Ok(SymArg::Name(self.string(x, &format!("{path}.as_name"))?)),
            "as_int" => Ok(SymArg::Int(self.int(x, &format!("{path}.as_int"))?)),
            _ => Err(self.err(path, format!("unknown SymIntArgument kind `{k}`"))),
        }
    }

    fn arg(&self, v: &J, path: &str) -> Result<Arg, Pt2Error> {
        let (k, x) = self.union(v, path)?;
        let p = format!("{path}.{k}");
        let each = |f: &dyn Fn(&J, &str) -> Result<(), Pt2Error>| -> Result<(), Pt2Error> {
            for (i, e) in self.list(x, &p)?.iter().enumerate() {
                f(e, &format!("{p}[{i}]"))?;
            }
            Ok(())
        };
        Ok(match k {
            "as_none" => Arg::None,
            "as_tensor" => Arg::Tensor(self.tensor_name(x, &p)?),
            "as_tensors" => {
                let mut out = Vec::new();
                for (i, e) in self.list(x, &p)?.iter().enumerate() {
                    out.push(self.tensor_name(e, &format!("{p}[{i}]"))?);
                }
                Arg::Tensors(out)
            }
            "as_optional_tensors" => {
                let mut out = Vec::new();
                for (i, e) in self.list(x, &p)?.iter().enumerate() {
                    out.push(self.optional_tensor(e, &format!("{p}[{i}]"))?);
                }
                Arg::OptionalTensors(out)
            }
            "as_optional_tensor" => Arg::OptionalTensor(self.optional_tensor(x, &p)?),
            "as_int" => Arg::Int(self.int(x, &p)?),
            "as_ints" => {
                let out = std::cell::RefCell::new(Vec::new());
                each(&|e, pp| {
                    out.borrow_mut().push(self.int(e, pp)?);
                    Ok(())
                })?;
                Arg::Ints(out.into_inner())
            }
            "as_float" => Arg::Float(self.float(x, &p)?),
            "as_floats" => {
                let out = std::cell::RefCell::new(Vec::new());
                each(&|e, pp| {
                    out.borrow_mut().push(self.float(e, pp)?);
                    Ok(())
                })?;
                Arg::Floats(out.into_inner())
            }
            "as_string" => Arg::Str(self.string(x, &p)?),
            "as_strings" => {
                let out = std::cell::RefCell::new(Vec::new());
                each(&|e, pp| {
                    out.borrow_mut().push(self.string(e, pp)?);
                    Ok(())
                })?;
                Arg::Strs(out.into_inner())
            }
            "as_bool" => Arg::Bool(self.boolean(x, &p)?),
            "as_bools" => {
                let out = std::cell::RefCell::new(Vec::new());
                each(&|e, pp| {
                    out.borrow_mut().push(self.boolean(e, pp)?);
                    Ok(())
                })?;
                Arg::Bools(out.into_inner())
            }
            "as_sym_int" => Arg::SymInt(self.sym_arg(x, &p)?),
            "as_sym_ints" => {
                let out = std::cell::RefCell::new(Vec::new());
                each(&|e, pp| {
                    out.borrow_mut().push(self.sym_arg(e, pp)?);
                    Ok(())
                })?;
                Arg::SymInts(out.into_inner())
            }
            "as_sym_float" => {
                let (fk, fx) = self.union(x, &p)?;
                match fk {
                    "as_name" => Arg::SymFloat(SymFloatArg::Name(self.string(fx, &p)?)),
                    "as_float" => Arg::SymFloat(SymFloatArg::Float(self.float(fx, &p)?)),
                    _ => return Err(self.err(&p, format!("unknown SymFloatArgument kind `{fk}`"))),
                }
            }
            "as_sym_bool" => {
                let (bk, bx) = self.union(x, &p)?;
                match bk {
                    "as_name" => Arg::SymBool(self.string(bx, &p)?),
                    "as_bool" => Arg::Bool(self.boolean(bx, &p)?),
                    _ => return Err(self.err(&p, format!("unknown SymBoolArgument kind `{bk}`"))),
                }
            }
            "as_scalar_type" => Arg::ScalarType(self.int(x, &p)?),
            "as_memory_format" => Arg::MemoryFormat(self.int(x, &p)?),
            "as_layout" => Arg::Layout(self.int(x, &p)?),
            "as_device" => {
                Arg::Device(self.string(self.field(x, "type", &p)?, &format!("{p}.type"))?)
            }
            "as_graph" => {
                let name = self.string(self.field(x, "name", &p)?, &format!("{p}.name"))?;
                let g = self.graph(self.field(x, "graph", &p)?, &format!("{p}.graph"))?;
                Arg::Graph(name, Box::new(g))
            }
            other => Arg::Other(other.to_string()),
        })
    }

    fn optional_tensor(&self, v: &J, path: &str) -> Result<Option<String>, Pt2Error> {
        let (k, x) = self.union(v, path)?;
        match k {
            "as_tensor" => Ok(Some(self.tensor_name(x, &format!("{path}.as_tensor"))?)),
            "as_none" => Ok(None),
            _ => Err(self.err(path, format!("unknown OptionalTensorArgument kind `{k}`"))),
        }
    }

    fn node(&self, v: &J, path: &str) -> Result<Node, Pt2Error> {
        let target = self.string(self.field(v, "target", path)?, &format!("{path}.target"))?;
        let mut inputs = Vec::new();
        let ip = format!("{path}.inputs");
        for (i, a) in self
            .list(self.field(v, "inputs", path)?, &ip)?
            .iter()
            .enumerate()
        {
            let p = format!("{ip}[{i}]");
            let name = match self.opt_field(a, "name", &p)? {
                Some(n) => self.string(n, &format!("{p}.name"))?,
                None => String::new(),
            };
            let arg = self.arg(self.field(a, "arg", &p)?, &format!("{p}.arg"))?;
            let kind = match self.opt_field(a, "kind", &p)? {
                Some(k) => Some(self.int(k, &format!("{p}.kind"))?),
                None => None,
            };
            inputs.push(NamedArg { name, arg, kind });
        }
        let op = format!("{path}.outputs");
        let mut outputs = Vec::new();
        for (i, a) in self
            .list(self.field(v, "outputs", path)?, &op)?
            .iter()
            .enumerate()
        {
            outputs.push(self.arg(a, &format!("{op}[{i}]"))?);
        }
        let mut metadata = BTreeMap::new();
        if let Some(m) = self.opt_field(v, "metadata", path)? {
            for (k, x) in self.obj(m, &format!("{path}.metadata"))? {
                if let Some(s) = x.as_str() {
                    metadata.insert(k.clone(), s.to_string());
                }
            }
        }
        let name = match self.opt_field(v, "name", path)? {
            Some(n) => Some(self.string(n, &format!("{path}.name"))?),
            None => None,
        };
        Ok(Node {
            target,
            inputs,
            outputs,
            metadata,
            name,
        })
    }

    fn graph(&self, v: &J, path: &str) -> Result<Graph, Pt2Error> {
        let mut g = Graph::default();
        let p = format!("{path}.inputs");
        for (i, a) in self
            .list(self.field(v, "inputs", path)?, &p)?
            .iter()
            .enumerate()
        {
            g.inputs.push(self.arg(a, &format!("{p}[{i}]"))?);
        }
        let p = format!("{path}.outputs");
        for (i, a) in self
            .list(self.field(v, "outputs", path)?, &p)?
            .iter()
            .enumerate()
        {
            g.outputs.push(self.arg(a, &format!("{p}[{i}]"))?);
        }
        let p = format!("{path}.nodes");
        for (i, n) in self
            .list(self.field(v, "nodes", path)?, &p)?
            .iter()
            .enumerate()
        {
            g.nodes.push(self.node(n, &format!("{p}[{i}]"))?);
        }
        if let Some(tv) = self.opt_field(v, "tensor_values", path)? {
            let p = format!("{path}.tensor_values");
            for (k, m) in self.obj(tv, &p)? {
                g.tensor_values
                    .insert(k.clone(), self.tensor_meta(m, &format!("{p}.{k}"))?);
            }
        }
        if let Some(sv) = self.opt_field(v, "sym_int_values", path)? {
            let p = format!("{path}.sym_int_values");
            for (k, m) in self.obj(sv, &p)? {
                g.sym_int_values
                    .insert(k.clone(), self.sym_int(m, &format!("{p}.{k}"))?);
            }
        }
        Ok(g)
    }

    fn input_spec(&self, v: &J, path: &str) -> Result<InputSpec, Pt2Error> {
        let (k, x) = self.union(v, path)?;
        let p = format!("{path}.{k}");
        let arg_name = |x: &J| -> Result<String, Pt2Error> {
            let a = self.field(x, "arg", &p)?;
            self.tensor_name(a, &format!("{p}.arg"))
        };
        Ok(match k {
            "user_input" => InputSpec::User {
                arg: self.arg(self.field(x, "arg", &p)?, &format!("{p}.arg"))?,
            },
            "parameter" => InputSpec::Parameter {
                name: arg_name(x)?,
                target: self.string(self.field(x, "parameter_name", &p)?, &p)?,
            },
            "buffer" => InputSpec::Buffer {
                name: arg_name(x)?,
                target: self.string(self.field(x, "buffer_name", &p)?, &p)?,
                persistent: match self.opt_field(x, "persistent", &p)? {
                    Some(v) => self.boolean(v, &format!("{p}.persistent"))?,
                    None => false,
                },
            },
            "tensor_constant" => InputSpec::Constant {
                name: arg_name(x)?,
                target: self.string(self.field(x, "tensor_constant_name", &p)?, &p)?,
            },
            "constant_input" => InputSpec::ConstantInput {
                name: self.string(self.field(x, "name", &p)?, &format!("{p}.name"))?,
            },
            other => InputSpec::Other {
                kind: other.to_string(),
            },
        })
    }

    fn output_spec(&self, v: &J, path: &str) -> Result<OutputSpec, Pt2Error> {
        let (k, x) = self.union(v, path)?;
        let p = format!("{path}.{k}");
        let a = self.arg(self.field(x, "arg", &p)?, &format!("{p}.arg"))?;
        Ok(match k {
            "user_output" => OutputSpec::User { arg: a },
            other => OutputSpec::Other {
                kind: other.to_string(),
                name: match &a {
                    Arg::Tensor(n) => n.clone(),
                    _ => String::new(),
                },
            },
        })
    }
}

/// Reads the schema version without reading the rest (so an unknown major gets its own
/// error before any structural one).
pub fn schema_version(entry: &str, v: &J) -> Result<(i64, i64, String), Pt2Error> {
    let r = Reader { entry };
    let sv = r.field(v, "schema_version", "")?;
    let major = r.int(
        r.field(sv, "major", "schema_version")?,
        "schema_version.major",
    )?;
    let minor = match r.opt_field(sv, "minor", "schema_version")? {
        Some(m) => r.int(m, "schema_version.minor")?,
        None => 0,
    };
    let torch = match r.opt_field(v, "torch_version", "")? {
        Some(t) => r.string(t, "torch_version")?,
        None => "<= 2.4".to_string(),
    };
    Ok((major, minor, torch))
}

/// Reads a whole ExportedProgram.
pub fn read_program(entry: &str, v: &J) -> Result<Program, Pt2Error> {
    let r = Reader { entry };
    let (major, minor, torch_version) = schema_version(entry, v)?;
    let gm = r.field(v, "graph_module", "")?;
    let graph = r.graph(r.field(gm, "graph", "graph_module")?, "graph_module.graph")?;
    let sig = r.field(gm, "signature", "graph_module")?;
    let mut inputs = Vec::new();
    let p = "graph_module.signature.input_specs";
    for (i, s) in r
        .list(r.field(sig, "input_specs", "graph_module.signature")?, p)?
        .iter()
        .enumerate()
    {
        inputs.push(r.input_spec(s, &format!("{p}[{i}]"))?);
    }
    let mut outputs = Vec::new();
    let p = "graph_module.signature.output_specs";
    for (i, s) in r
        .list(r.field(sig, "output_specs", "graph_module.signature")?, p)?
        .iter()
        .enumerate()
    {
        outputs.push(r.output_spec(s, &format!("{p}[{i}]"))?);
    }
    let mut forward_arg_names = Vec::new();
    let mut output_fields = Vec::new();
    if let Some(mcg) = r.opt_field(gm, "module_call_graph", "graph_module")? {
        if let Some(root) = mcg.as_array().and_then(|l| {
            l.iter()
                .find(|e| e.get("fqn").and_then(J::as_str) == Some(""))
        }) {
            output_fields = root
                .get("signature")
                .and_then(|s| s.get("out_spec"))
                .and_then(J::as_str)
                .map(out_spec_fields)
                .unwrap_or_default();
            if let Some(names) = root
                .get("signature")
                .and_then(|s| s.get("forward_arg_names"))
                .and_then(J::as_array)
            {
                forward_arg_names = names
                    .iter()
                    .filter_map(|n| n.as_str().map(str::to_string))
                    .collect();
            }
        }
    }
    let mut range_constraints = BTreeMap::new();
    if let Some(rc) = r.opt_field(v, "range_constraints", "")? {
        for (k, c) in r.obj(rc, "range_constraints")? {
            let p = format!("range_constraints.{k}");
            let get = |key: &str| -> Result<Option<i64>, Pt2Error> {
                match r.opt_field(c, key, &p)? {
                    Some(x) => Ok(Some(r.int(x, &p)?)),
                    None => Ok(None),
                }
            };
            range_constraints.insert(k.clone(), (get("min_val")?, get("max_val")?));
        }
    }
    Ok(Program {
        graph,
        inputs,
        outputs,
        schema: (major, minor),
        torch_version,
        forward_arg_names,
        output_fields,
        range_constraints,
    })
}

/// The fields of a serialized pytree spec's root (`[1, {"type": ..., "context":
/// "[\"aux_loss\", \"logits\"]", "children_spec": [...]}]`) with their leaf counts;
/// empty when it has none or does not parse.
fn out_spec_fields(spec: &str) -> Vec<(String, usize)> {
    fn leaves(node: &J) -> usize {
        match node.get("children_spec").and_then(J::as_array) {
            Some(children) if !children.is_empty() => children.iter().map(leaves).sum(),
            _ if node.get("type").is_some_and(|t| !t.is_null()) => 0, // an empty container
            _ => 1,
        }
    }
    let Ok(v) = serde_json::from_str::<J>(spec) else {
        return vec![];
    };
    let Some(root) = v.get(1) else {
        return vec![];
    };
    let names: Vec<String> = root
        .get("context")
        .and_then(J::as_str)
        .and_then(|c| serde_json::from_str::<J>(c).ok())
        .and_then(|c| {
            c.as_array().map(|l| {
                l.iter()
                    .filter_map(|x| x.as_str().map(str::to_string))
                    .collect()
            })
        })
        .unwrap_or_default();
    let children = root
        .get("children_spec")
        .and_then(J::as_array)
        .cloned()
        .unwrap_or_default();
    if names.len() != children.len() {
        return vec![];
    }
    names.into_iter().zip(children.iter().map(leaves)).collect()
}

/// Reads `model_weights_config.json` or `model_constants_config.json`.
pub fn read_payload_config(entry: &str, v: &J) -> Result<BTreeMap<String, PayloadMeta>, Pt2Error> {
    let r = Reader { entry };
    let mut out = BTreeMap::new();
    let cfg = r.field(v, "config", "")?;
    for (name, m) in r.obj(cfg, "config")? {
        let p = format!("config.{name}");
        let path_name = r.string(r.field(m, "path_name", &p)?, &format!("{p}.path_name"))?;
        let is_param = match r.opt_field(m, "is_param", &p)? {
            Some(x) => r.boolean(x, &p)?,
            None => false,
        };
        let use_pickle = match r.opt_field(m, "use_pickle", &p)? {
            Some(x) => r.boolean(x, &p)?,
            None => false,
        };
        let meta = match r.opt_field(m, "tensor_meta", &p)? {
            Some(x) => Some(r.tensor_meta(x, &format!("{p}.tensor_meta"))?),
            None => None,
        };
        out.insert(
            name.clone(),
            PayloadMeta {
                path_name,
                is_param,
                use_pickle,
                meta,
            },
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_single_key_unions() {
        let r = Reader { entry: "m.json" };
        let j: J = serde_json::from_str(r#"{"as_float": "-Infinity"}"#).unwrap();
        assert_eq!(r.arg(&j, "x").unwrap(), Arg::Float(f64::NEG_INFINITY));
        let j: J =
            serde_json::from_str(r#"{"as_sym_ints": [{"as_name": "s0"}, {"as_int": 8}]}"#).unwrap();
        assert_eq!(
            r.arg(&j, "x").unwrap(),
            Arg::SymInts(vec![SymArg::Name("s0".into()), SymArg::Int(8)])
        );
        let j: J = serde_json::from_str(r#"{"as_int": 9223372036854775807}"#).unwrap();
        assert_eq!(r.arg(&j, "x").unwrap(), Arg::Int(i64::MAX));
        let j: J = serde_json::from_str(r#"{"as_int": 1, "as_bool": true}"#).unwrap();
        let e = r
            .arg(&j, "graph.nodes[3].inputs[1].arg")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("graph.nodes[3].inputs[1].arg") && e.contains("one key"),
            "{e}"
        );
    }

    #[test]
    fn dtype_codes_are_exports_numbering() {
        assert_eq!(ScalarType::dtype(7), Some(weft_ir::DType::F32));
        assert_eq!(ScalarType::dtype(13), Some(weft_ir::DType::BF16));
        assert_eq!(ScalarType::dtype(12), Some(weft_ir::DType::Bool));
        assert_eq!(ScalarType::dtype(1), None);
        assert_eq!(ScalarType::name(99), "unknown code");
    }
}
