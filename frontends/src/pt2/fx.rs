//! The exported graph in a form the lowering can walk: higher-order ops
//! (`wrap_with_set_grad_enabled`) inlined, in-place ops (`div_`, `index_put_`,
//! `masked_fill_`) made functional with later uses redirected to their results,
//! `_assert_*` nodes dropped, every argument matched to the op's schema with defaults
//! filled in, multi-output ops given one name per output, and each node's HF module
//! path taken from its `nn_module_stack`.

use super::error::Pt2Error;
use super::opschema;
use super::schema::{Arg, Graph, Node, SymInt, TensorMeta};
use std::collections::BTreeMap;

#[derive(Clone, Debug)]
pub struct FxNode {
    /// `aten.add.Tensor`, `_operator.mul.default`, `transformers.grouped_mm_fallback.default`.
    pub op: String,
    /// The node's name in the export (for messages).
    pub name: String,
    /// Arguments in schema order, defaults filled in.
    pub args: Vec<(String, Arg)>,
    /// One entry per output value: its name, or `None` for an unused/`None` output.
    pub outputs: Vec<Option<String>>,
    /// HF module path (`model.layers.0.self_attn`), from `nn_module_stack`.
    pub scope: Option<String>,
}

#[cfg(test)]
impl FxNode {
    /// A node for unit tests: `op` with positional arguments `a0, a1, ...` and one
    /// output named `out`.
    pub(crate) fn for_test(op: &str, out: &str, args: Vec<super::schema::Arg>) -> FxNode {
        FxNode {
            op: op.into(),
            name: out.into(),
            args: args
                .into_iter()
                .enumerate()
                .map(|(i, a)| (format!("a{i}"), a))
                .collect(),
            outputs: vec![Some(out.into())],
            scope: None,
        }
    }
}

#[cfg(test)]
impl FxNode {
    /// A node as [`build`] makes it from an export: `args` (named, or positional
    /// where the name is empty) matched to the op's schema with defaults filled in;
    /// one output per name in `outs`.
    pub(crate) fn exported(
        op: &str,
        outs: &[&str],
        args: Vec<(&str, super::schema::Arg)>,
    ) -> Result<FxNode, Pt2Error> {
        let n = Node {
            target: format!("torch.ops.{op}"),
            inputs: args
                .into_iter()
                .map(|(name, arg)| super::schema::NamedArg {
                    name: name.into(),
                    arg,
                    kind: Some(if name.is_empty() { 1 } else { 2 }),
                })
                .collect(),
            outputs: vec![],
            metadata: Default::default(),
            name: Some(outs[0].into()),
        };
        let key = op_key(&n.target);
        Ok(FxNode {
            args: normalize("test.pt2", &n, &key, outs[0], "test", None)?,
            op: key,
            name: outs[0].into(),
            outputs: outs.iter().map(|o| Some(o.to_string())).collect(),
            scope: None,
        })
    }
}

impl FxNode {
    pub fn arg(&self, name: &str) -> &Arg {
        self.args
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| a)
            .unwrap_or(&Arg::None)
    }

    pub fn arg_at(&self, i: usize) -> &Arg {
        self.args.get(i).map(|(_, a)| a).unwrap_or(&Arg::None)
    }

    /// The op without namespace and overload: `add` for `aten.add.Tensor`.
    pub fn base(&self) -> &str {
        self.op.split('.').nth(1).unwrap_or(&self.op)
    }

    pub fn out(&self) -> Option<&str> {
        self.outputs.first().and_then(|o| o.as_deref())
    }

    /// Names of every tensor argument, in order.
    pub fn tensor_args(&self) -> Vec<&str> {
        let mut out = Vec::new();
        for (_, a) in &self.args {
            match a {
                Arg::Tensor(t) => out.push(t.as_str()),
                Arg::Tensors(ts) => out.extend(ts.iter().map(String::as_str)),
                Arg::OptionalTensors(ts) => out.extend(ts.iter().flatten().map(String::as_str)),
                Arg::OptionalTensor(Some(t)) => out.push(t.as_str()),
                _ => {}
            }
        }
        out
    }
}

#[derive(Clone, Debug, Default)]
pub struct FxGraph {
    pub nodes: Vec<FxNode>,
    pub outputs: Vec<Arg>,
    pub tensor_meta: BTreeMap<String, TensorMeta>,
    pub sym_values: BTreeMap<String, SymInt>,
    /// Output name → index of the node that defines it.
    pub producer: BTreeMap<String, usize>,
    /// Nodes dropped as no-ops (`_assert_tensor_metadata` ...), counted for the report.
    pub dropped: usize,
    /// In-place ops made functional, counted for the report.
    pub functionalized: Vec<String>,
    /// Empty tensors filled by `copy_` into slices, read as `cat` (filled.rs).
    pub assembled: Vec<String>,
}

impl FxGraph {
    pub fn node_of(&self, value: &str) -> Option<&FxNode> {
        self.producer.get(value).map(|&i| &self.nodes[i])
    }
}

/// The HF module path of the deepest module in an `nn_module_stack` string
/// (`key,path,class;key,path,class;...`).
pub fn module_path(stack: &str) -> Option<String> {
    let last = stack.split(';').filter(|e| !e.is_empty()).last()?;
    let mut parts = last.splitn(3, ',');
    let _key = parts.next()?;
    let path = parts.next()?;
    if path.is_empty() || path.contains("nn_module_stack") {
        return None;
    }
    Some(path.to_string())
}

/// The importer's op key of an export target (`torch.ops.aten.add.Tensor` → `aten.add.Tensor`).
pub fn op_key(target: &str) -> String {
    if let Some(rest) = target.strip_prefix("torch.ops.") {
        let n = rest.split('.').count();
        if n == 2 {
            return format!("{rest}.default");
        }
        return rest.to_string();
    }
    if let Some(op) = target.strip_prefix("_operator.") {
        return format!("_operator.{op}.default");
    }
    target.to_string()
}

const SKIPPED: &[&str] = &[
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
    "aten.sym_constrain_range.default",
    "aten._assert_async.msg",
];

pub fn build(entry: &str, g: &Graph) -> Result<FxGraph, Pt2Error> {
    let mut fx = FxGraph {
        outputs: g.outputs.clone(),
        ..Default::default()
    };
    fx.tensor_meta = g.tensor_values.clone();
    fx.sym_values = g.sym_int_values.clone();
    let mut renames: BTreeMap<String, String> = BTreeMap::new();
    add_nodes(entry, g, &mut fx, &mut renames, "graph_module.graph", None)?;
    for o in fx.outputs.iter_mut() {
        rename_arg(o, &renames);
    }
    fx.assembled = super::filled::fold(&mut fx);
    for (i, n) in fx.nodes.iter().enumerate() {
        for o in n.outputs.iter().flatten() {
            fx.producer.insert(o.clone(), i);
        }
    }
    check_inplace_aliases(&fx)?;
    Ok(fx)
}

/// Ops whose outputs may share their first input's storage (views), by base name.
const VIEW_OPS: &[&str] = &[
    "view",
    "_unsafe_view",
    "reshape",
    "flatten",
    "slice",
    "select",
    "narrow",
    "transpose",
    "swapaxes",
    "movedim",
    "permute",
    "t",
    "expand",
    "expand_as",
    "view_as",
    "unsqueeze",
    "squeeze",
    "alias",
    "detach",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "as_strided",
    "diagonal",
    "unfold",
];

/// An in-place op is read as its functional form, its later uses redirected to the
/// result. That loses the write wherever the mutated tensor shares storage with
/// another value (a view of it, or the tensor it is a view of) that is read after the
/// write: such a read sees the write in torch. Refused, naming both.
fn check_inplace_aliases(fx: &FxGraph) -> Result<(), Pt2Error> {
    if fx.functionalized.is_empty() {
        return Ok(());
    }
    // Storage groups: each view output joined to its input.
    let mut parent: BTreeMap<&str, &str> = BTreeMap::new();
    fn root<'a>(parent: &BTreeMap<&'a str, &'a str>, mut x: &'a str) -> &'a str {
        while let Some(&p) = parent.get(x) {
            if p == x {
                break;
            }
            x = p;
        }
        x
    }
    for n in &fx.nodes {
        if !VIEW_OPS.contains(&n.base()) {
            continue;
        }
        let Some((_, Arg::Tensor(src))) = n.args.first() else {
            continue;
        };
        let r = root(&parent, src);
        for o in n.outputs.iter().flatten() {
            let ro = root(&parent, o);
            if ro != r {
                parent.insert(ro, r);
            }
        }
    }
    let inplace: std::collections::BTreeSet<&str> =
        fx.functionalized.iter().map(String::as_str).collect();
    let before = |v: &str, i: usize| fx.producer.get(v).is_none_or(|&p| p < i);
    for (i, n) in fx.nodes.iter().enumerate() {
        // `detach_` writes no values.
        if !inplace.contains(n.name.as_str()) || n.base() == "detach" {
            continue;
        }
        let Some((_, Arg::Tensor(target))) = n.args.first() else {
            continue;
        };
        let r = root(&parent, target);
        // Writes into an unfolded `new_empty` (filled.rs folds the ones that tile
        // it): it has no lowering, so every read of it is refused by its node name.
        if fx
            .node_of(r)
            .is_some_and(|m| m.op == "aten.new_empty.default")
        {
            continue;
        }
        let stale = |v: &str| v != target.as_str() && before(v, i) && root(&parent, v) == r;
        let later = fx.nodes[i + 1..]
            .iter()
            .find_map(|m| {
                m.tensor_args()
                    .into_iter()
                    .find(|v| stale(v))
                    .map(|v| (v.to_string(), format!("node `{}`", m.name)))
            })
            .or_else(|| {
                fx.outputs.iter().find_map(|o| match o {
                    Arg::Tensor(v) if stale(v) => Some((v.clone(), "the program's output".into())),
                    _ => None,
                })
            });
        if let Some((alias, reader)) = later {
            let inplace_op = match n.op.split('.').collect::<Vec<_>>()[..] {
                [ns, name, ov] => format!("{ns}.{name}_.{ov}"),
                _ => n.op.clone(),
            };
            return Err(Pt2Error::UnsupportedOp {
                op: inplace_op,
                node: n.name.clone(),
                layer: n.scope.clone(),
                message: format!(
                    "writes `{target}` in place, which shares storage with `{alias}` (through view ops); {reader} reads `{alias}` after the write and would see it in torch, but the importer reads in-place ops functionally (export with run_decompositions(), or write the op out of place)"
                ),
            });
        }
    }
    Ok(())
}

fn rename_arg(a: &mut Arg, renames: &BTreeMap<String, String>) {
    let r = |s: &mut String| {
        // Follow chains: a value renamed twice (two in-place ops in a row).
        let mut guard = 0;
        while let Some(n) = renames.get(s.as_str()) {
            *s = n.clone();
            guard += 1;
            if guard > 1000 {
                break;
            }
        }
    };
    match a {
        Arg::Tensor(t) => r(t),
        Arg::Tensors(ts) => ts.iter_mut().for_each(r),
        Arg::OptionalTensors(ts) => ts.iter_mut().flatten().for_each(r),
        Arg::OptionalTensor(Some(t)) => r(t),
        Arg::SymInt(super::schema::SymArg::Name(t)) => r(t),
        Arg::SymInts(v) => v.iter_mut().for_each(|s| {
            if let super::schema::SymArg::Name(t) = s {
                r(t)
            }
        }),
        _ => {}
    }
}

fn add_nodes(
    entry: &str,
    g: &Graph,
    fx: &mut FxGraph,
    renames: &mut BTreeMap<String, String>,
    path: &str,
    outer_scope: Option<&str>,
) -> Result<(), Pt2Error> {
    for (ni, n) in g.nodes.iter().enumerate() {
        let npath = format!("{path}.nodes[{ni}]");
        let key = op_key(&n.target);
        let scope = n
            .metadata
            .get("nn_module_stack")
            .and_then(|s| module_path(s))
            .or(outer_scope.map(str::to_string));
        let name = n
            .name
            .clone()
            .or_else(|| first_output_name(n))
            .unwrap_or_else(|| format!("node{ni}"));
        if SKIPPED.contains(&key.as_str()) {
            fx.dropped += 1;
            continue;
        }
        if key.starts_with("higher_order.") {
            inline_hop(entry, n, &key, &name, fx, renames, &npath, scope.as_deref())?;
            continue;
        }
        // In-place ops: the functional op, with later uses of the mutated input redirected.
        let (key, was_inplace) = functional_key(&key);
        let mut args = normalize(entry, n, &key, &name, &npath, scope.as_deref())?;
        for (_, a) in args.iter_mut() {
            rename_arg(a, renames);
        }
        let outputs = flatten_outputs(n);
        if was_inplace {
            if let (Some((_, Arg::Tensor(target))), Some(Some(out))) =
                (args.first(), outputs.first())
            {
                if target != out {
                    renames.insert(target.clone(), out.clone());
                }
            }
            fx.functionalized.push(name.clone());
        }
        fx.nodes.push(FxNode {
            op: key,
            name,
            args,
            outputs,
            scope,
        });
    }
    Ok(())
}

fn first_output_name(n: &Node) -> Option<String> {
    flatten_outputs(n).into_iter().flatten().next()
}

fn flatten_outputs(n: &Node) -> Vec<Option<String>> {
    let mut out = Vec::new();
    for o in &n.outputs {
        match o {
            Arg::Tensor(t) => out.push(Some(t.clone())),
            Arg::Tensors(ts) => out.extend(ts.iter().map(|t| Some(t.clone()))),
            Arg::OptionalTensors(ts) => out.extend(ts.iter().cloned()),
            Arg::SymInt(super::schema::SymArg::Name(s)) => out.push(Some(s.clone())),
            Arg::SymBool(s) => out.push(Some(s.clone())),
            Arg::SymFloat(super::schema::SymFloatArg::Name(s)) => out.push(Some(s.clone())),
            _ => out.push(None),
        }
    }
    out
}

fn functional_key(key: &str) -> (String, bool) {
    let parts: Vec<&str> = key.split('.').collect();
    if parts.len() == 3
        && parts[1].ends_with('_')
        && !parts[1].starts_with('_')
        && !parts[1].ends_with("__")
    {
        return (
            format!(
                "{}.{}.{}",
                parts[0],
                parts[1].trim_end_matches('_'),
                parts[2]
            ),
            true,
        );
    }
    (key.to_string(), false)
}

fn normalize(
    entry: &str,
    n: &Node,
    key: &str,
    name: &str,
    path: &str,
    scope: Option<&str>,
) -> Result<Vec<(String, Arg)>, Pt2Error> {
    let Some(params) = opschema::lookup(key) else {
        // Unknown ops keep their arguments as given; lowering reports them if needed.
        return Ok(n
            .inputs
            .iter()
            .map(|a| (a.name.clone(), a.arg.clone()))
            .collect());
    };
    let mut out: Vec<(String, Option<Arg>)> =
        params.iter().map(|p| (p.name.clone(), None)).collect();
    let mut next_positional = 0usize;
    for a in &n.inputs {
        let slot = if !a.name.is_empty() {
            params.iter().position(|p| p.name == a.name)
        } else {
            Some(next_positional)
        };
        let Some(slot) = slot.filter(|&s| s < params.len()) else {
            return Err(Pt2Error::Node {
                op: key.to_string(),
                node: name.to_string(),
                layer: scope.map(str::to_string),
                message: format!(
                    "argument `{}` is not in the op's schema ({}) [{entry} {path}]",
                    a.name,
                    params
                        .iter()
                        .map(|p| p.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        };
        out[slot].1 = Some(a.arg.clone());
        next_positional = slot + 1;
    }
    out.into_iter()
        .zip(&params)
        .map(|((nm, a), p)| match a.or_else(|| p.default.clone()) {
            Some(a) => Ok((nm, a)),
            None if p.ty.ends_with('?') => Ok((nm, Arg::None)),
            None => Err(Pt2Error::Node {
                op: key.to_string(),
                node: name.to_string(),
                layer: scope.map(str::to_string),
                message: format!(
                    "required argument `{}` ({}) is missing [{entry} {path}]",
                    p.name, p.ty
                ),
            }),
        })
        .collect()
}

/// Inlines `wrap_with_set_grad_enabled(enabled, graph, *args)` (and the other
/// single-subgraph wrappers that do not change numerics).
#[allow(clippy::too_many_arguments)]
fn inline_hop(
    entry: &str,
    n: &Node,
    key: &str,
    name: &str,
    fx: &mut FxGraph,
    renames: &mut BTreeMap<String, String>,
    path: &str,
    scope: Option<&str>,
) -> Result<(), Pt2Error> {
    let unsupported = |msg: &str| Pt2Error::UnsupportedOp {
        op: key.to_string(),
        node: name.to_string(),
        layer: scope.map(str::to_string),
        message: msg.to_string(),
    };
    let hop = key
        .trim_start_matches("higher_order.")
        .trim_end_matches(".default");
    let gi = n
        .inputs
        .iter()
        .position(|a| matches!(a.arg, Arg::Graph(..)))
        .ok_or_else(|| unsupported("no subgraph argument"))?;
    match hop {
        "wrap_with_set_grad_enabled" => {}
        "wrap_with_autocast" => {
            // (device_type, dtype, enabled, cache_enabled, graph, *args): only a disabled autocast is a no-op.
            if !matches!(n.inputs.get(2).map(|a| &a.arg), Some(Arg::Bool(false))) {
                return Err(unsupported(
                    "autocast regions change dtypes; export without torch.autocast",
                ));
            }
        }
        _ => {
            return Err(unsupported(
                "only wrap_with_set_grad_enabled and disabled autocast regions are inlined",
            ))
        }
    }
    let Arg::Graph(sub_name, sub) = &n.inputs[gi].arg else {
        unreachable!()
    };
    let actual: Vec<&Arg> = n.inputs[gi + 1..].iter().map(|a| &a.arg).collect();
    if actual.len() != sub.inputs.len() {
        return Err(unsupported(&format!(
            "subgraph `{sub_name}` takes {} inputs, got {}",
            sub.inputs.len(),
            actual.len()
        )));
    }
    // Subgraph placeholders alias the actual arguments.
    for (formal, act) in sub.inputs.iter().zip(actual) {
        if let (Arg::Tensor(f), Arg::Tensor(a)) = (formal, act) {
            let mut a = a.clone();
            while let Some(r) = renames.get(&a) {
                a = r.clone();
            }
            if *f != a {
                renames.insert(f.clone(), a);
            }
        }
    }
    for (k, v) in &sub.tensor_values {
        fx.tensor_meta.entry(k.clone()).or_insert_with(|| v.clone());
    }
    for (k, v) in &sub.sym_int_values {
        fx.sym_values.entry(k.clone()).or_insert_with(|| v.clone());
    }
    add_nodes(
        entry,
        sub,
        fx,
        renames,
        &format!("{path}.{sub_name}"),
        scope,
    )?;
    // The wrapper's outputs alias the subgraph's outputs.
    let outs = flatten_outputs(n);
    for (o, so) in outs.iter().zip(&sub.outputs) {
        if let (Some(o), Arg::Tensor(s)) = (o, so) {
            let mut s = s.clone();
            while let Some(r) = renames.get(&s) {
                s = r.clone();
            }
            if *o != s {
                renames.insert(o.clone(), s);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_paths() {
        let s = "L__self__,,transformers.X;L__self__model,model,transformers.M;L__self__model.layers.0.self_attn,model.layers.0.self_attn,transformers.A";
        assert_eq!(module_path(s).as_deref(), Some("model.layers.0.self_attn"));
        assert_eq!(module_path("_empty_nn_module_stack_from_metadata_hook,_empty_nn_module_stack_from_metadata_hook,x"), None);
        assert_eq!(module_path("L__self__,,X"), None);
    }

    fn exported(target: &str, out: &str, inputs: Vec<Arg>) -> Node {
        Node {
            target: format!("torch.ops.{target}"),
            inputs: inputs
                .into_iter()
                .map(|arg| super::super::schema::NamedArg {
                    name: String::new(),
                    arg,
                    kind: Some(1),
                })
                .collect(),
            outputs: vec![Arg::Tensor(out.into())],
            metadata: Default::default(),
            name: Some(out.into()),
        }
    }

    /// `v = squeeze(x); v.add_(y); relu(<read>)`.
    fn write_through_view(read: &str) -> Graph {
        let t = |s: &str| Arg::Tensor(s.into());
        Graph {
            inputs: vec![t("x"), t("y")],
            outputs: vec![t("r")],
            nodes: vec![
                exported("aten.squeeze.dim", "v", vec![t("x"), Arg::Int(0)]),
                exported("aten.add_.Tensor", "w", vec![t("v"), t("y")]),
                exported("aten.relu.default", "r", vec![t(read)]),
            ],
            ..Default::default()
        }
    }

    #[test]
    fn an_in_place_write_seen_through_a_view_is_refused() {
        // Reading the view written: its later uses are the write's result.
        let fx = build("m", &write_through_view("v")).unwrap();
        assert_eq!(fx.nodes[2].args[0].1, Arg::Tensor("w".into()));
        // Reading the tensor it is a view of: torch sees the write there too.
        let e = build("m", &write_through_view("x")).unwrap_err();
        match &e {
            Pt2Error::UnsupportedOp { op, node, .. } => {
                assert_eq!((op.as_str(), node.as_str()), ("aten.add_.Tensor", "w"))
            }
            _ => panic!("{e}"),
        }
        let s = e.to_string();
        assert!(
            s.contains("writes `v` in place, which shares storage with `x`")
                && s.contains("node `r` reads `x` after the write"),
            "{s}"
        );
    }

    #[test]
    fn keys() {
        assert_eq!(op_key("torch.ops.aten.add.Tensor"), "aten.add.Tensor");
        assert_eq!(op_key("torch.ops.aten.embedding"), "aten.embedding.default");
        assert_eq!(op_key("_operator.mul"), "_operator.mul.default");
        assert_eq!(
            functional_key("aten.div_.Tensor"),
            ("aten.div.Tensor".to_string(), true)
        );
        assert_eq!(
            functional_key("aten.__and__.Tensor"),
            ("aten.__and__.Tensor".to_string(), false)
        );
        assert_eq!(
            functional_key("aten._softmax.default"),
            ("aten._softmax.default".to_string(), false)
        );
    }
}
