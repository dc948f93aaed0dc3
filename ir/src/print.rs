//! The text printer: one line per node in program order, deterministic, and read back
//! by `parse` to an equal graph. Format:
//!
//! ```text
//! graph "llama"
//! mesh sp=4
//! %0: i64[B, S] = input {name="input_ids", role=input_ids}
//! %7: f32[B, S, 64] = linear %5, %6  # model.layers.0.mlp.up_proj
//! %9: f32[B, 2, S, 8] = all_to_all %8 {axis="sp", scatter_dim=1, gather_dim=2}  # model.layers.0.self_attn <- ulysses-attention: heads to sequence
//! %31: f32[B, S, 64] = silu_grad %46, %30  # model.layers.0.mlp [backward of %48] <- autodiff: silu
//! partition "model.layers.0.mlp.up_proj.weight" column tp dim=0 [32 32]
//! split logits 1:sp
//! return loss=%20, logits=%19
//! ```

use crate::graph::{Graph, Node};
use std::fmt::Write;

/// Prints one node's line (without newline).
pub fn node_line(g: &Graph, n: Node) -> String {
    let d = g.node(n);
    let mut s = String::new();
    for (i, v) in d.results.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{v}: {}", g.ty(*v));
    }
    let _ = write!(s, " = {}", d.op.name());
    for (i, v) in d.operands.iter().enumerate() {
        s.push_str(if i == 0 { " " } else { ", " });
        let _ = write!(s, "{v}");
    }
    let attrs = d.op.attrs_text();
    if !attrs.is_empty() {
        let parts: Vec<String> = attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = write!(s, " {{{}}}", parts.join(", "));
    }
    let m = &d.meta;
    if m.source.is_some()
        || m.provenance.is_some()
        || m.derived.is_some()
        || m.micro_batch.is_some()
    {
        s.push_str("  #");
        if let Some(src) = &m.source {
            let _ = write!(s, " {src}");
        }
        if let Some(d) = &m.derived {
            let _ = write!(s, " [{} of {}]", d.kind.keyword(), d.of);
        }
        if let Some(mb) = m.micro_batch {
            let _ = write!(s, " [micro-batch {mb}]");
        }
        if let Some(p) = &m.provenance {
            let _ = write!(s, " <- {}: {}", p.pass, p.reason.replace('\n', " "));
        }
    }
    s
}

/// The whole graph as text.
pub fn print(g: &Graph) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "graph {}", crate::attrs::quote(&g.name));
    if !g.mesh.axes.is_empty() {
        let _ = writeln!(s, "mesh {}", g.mesh);
    }
    for &n in g.nodes() {
        s.push_str(&node_line(g, n));
        s.push('\n');
    }
    let outs: Vec<String> = g
        .outputs()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for (name, parts) in g.param_partitions() {
        for p in parts {
            let _ = writeln!(s, "partition {} {p}", crate::attrs::quote(name));
        }
    }
    for (name, splits) in g.output_splits() {
        let parts: Vec<String> = splits.iter().map(|(d, a)| format!("{d}:{a}")).collect();
        let _ = writeln!(s, "split {name} {}", parts.join(" "));
    }
    let _ = writeln!(s, "return {}", outs.join(", "));
    s
}

impl std::fmt::Display for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&print(self))
    }
}
