//! The `Pass` trait and what a pass receives and returns.
//!
//! A pass is a small named rewrite of a [`Graph`]. It does not print, time or verify
//! itself: the [`PassManager`](crate::PassManager) does that around every pass.

use std::collections::BTreeMap;
use std::fmt;
use weft_ir::{Graph, Mesh, VerifyReport};

/// The mesh axis sequence parallelism runs over.
pub const SP: &str = "sp";
/// The mesh axis context parallelism (ring attention) runs over.
pub const CP: &str = "cp";
/// The mesh axis data parallelism runs over.
pub const DP: &str = "dp";
/// The mesh axis tensor parallelism runs over.
pub const TP: &str = crate::tp::TP;

/// A named, ordered rewrite of the graph.
pub trait Pass: Sync {
    /// Stable kebab-case name used by pipelines, the CLI, snapshots and provenance.
    fn name(&self) -> &'static str;
    /// One line saying what the pass does.
    fn summary(&self) -> &'static str;
    /// Passes that must run earlier in the same pipeline.
    fn requires(&self) -> &'static [&'static str] {
        &[]
    }
    /// The mesh axes the pass needs.
    fn mesh_axes(&self) -> MeshAxes {
        MeshAxes::None
    }
    /// Rewrites `g` in place. On error the graph may be partly rewritten; callers that
    /// need the original keep a clone.
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError>;
}

/// Which mesh axes a pass needs to be meaningful.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MeshAxes {
    /// Runs on any mesh.
    None,
    /// Needs every listed axis.
    All(&'static [&'static str]),
    /// Needs at least one of the listed axes.
    AnyOf(&'static [&'static str]),
}

impl MeshAxes {
    /// `Err` with the missing axes when `mesh` does not satisfy the requirement.
    pub fn check(&self, mesh: &Mesh) -> Result<(), Vec<String>> {
        match self {
            MeshAxes::None => Ok(()),
            MeshAxes::All(axes) => {
                let missing: Vec<String> = axes
                    .iter()
                    .filter(|a| !mesh.has(a))
                    .map(|a| a.to_string())
                    .collect();
                if missing.is_empty() {
                    Ok(())
                } else {
                    Err(missing)
                }
            }
            MeshAxes::AnyOf(axes) => {
                if axes.iter().any(|a| mesh.has(a)) {
                    Ok(())
                } else {
                    Err(axes.iter().map(|a| a.to_string()).collect())
                }
            }
        }
    }
}

impl fmt::Display for MeshAxes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MeshAxes::None => write!(f, "any mesh"),
            MeshAxes::All(a) => write!(f, "{}", a.join(" and ")),
            MeshAxes::AnyOf(a) => write!(f, "{}", a.join(" or ")),
        }
    }
}

/// Options passes read. Instrumentation options live in the manager, not here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassOptions {
    /// `ulysses-attention`: replicate kv heads when they cannot be split over `sp`
    /// (GQA with fewer kv heads than ranks). Off: such a layer is an error.
    pub replicate_kv_heads: bool,
    /// `canonicalize`: the most fold/CSE/DCE rounds before giving up on a fixpoint.
    pub canonicalize_max_rounds: usize,
    /// `tensor-parallel`: layer specs, HF plan and grain.
    pub tp: crate::tp::TpOptions,
    /// The training passes: micro-batches, checkpoint, offload, grad-sync, optimizer.
    pub train: crate::training::TrainOptions,
    /// `convert-dtype`: the float dtype to run the model in (`None`: the model's own).
    pub dtype: Option<weft_ir::DType>,
}

impl Default for PassOptions {
    fn default() -> Self {
        PassOptions {
            replicate_kv_heads: true,
            canonicalize_max_rounds: 16,
            tp: Default::default(),
            train: Default::default(),
            dtype: None,
        }
    }
}

/// What every pass of a pipeline sees: the mesh being compiled for and the options.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassContext {
    pub mesh: Mesh,
    pub options: PassOptions,
}

impl PassContext {
    pub fn new(mesh: Mesh) -> Self {
        PassContext {
            mesh,
            options: PassOptions::default(),
        }
    }

    /// The size of `axis`, or a [`PassError::MissingAxis`] naming `pass`.
    pub fn axis_size(&self, pass: &str, axis: &str) -> Result<u32, PassError> {
        self.mesh.size(axis).ok_or_else(|| PassError::MissingAxis {
            pass: pass.to_string(),
            axes: vec![axis.to_string()],
            mesh: self.mesh.clone(),
        })
    }
}

/// What a pass did: whether it changed the graph and its own counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassResult {
    pub changed: bool,
    /// Pass-specific counters (`all_to_all`, `inputs_sliced`), deterministic order.
    pub counters: BTreeMap<String, u64>,
}

impl PassResult {
    pub fn unchanged() -> Self {
        PassResult::default()
    }

    pub fn changed(changed: bool) -> Self {
        PassResult {
            changed,
            counters: BTreeMap::new(),
        }
    }

    /// Adds `n` to counter `key` (creating it, even at 0, so tables are stable).
    pub fn count(&mut self, key: &str, n: u64) -> &mut Self {
        *self.counters.entry(key.to_string()).or_insert(0) += n;
        self
    }

    pub fn with(mut self, key: &str, n: u64) -> Self {
        self.count(key, n);
        self
    }
}

fn help_suffix(help: &Option<String>) -> String {
    match help {
        Some(h) => format!("\nhelp: {h}"),
        None => String::new(),
    }
}

fn mesh_text(m: &Mesh) -> String {
    if m.axes.is_empty() {
        "empty (one rank)".to_string()
    } else {
        format!("`{m}`")
    }
}

fn quoted_list(items: &[String]) -> String {
    items
        .iter()
        .map(|s| format!("`{s}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Everything that can go wrong running passes. `Display` is the message after
/// `error: `, with a `help:` line where a fix is known.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PassError {
    #[error("unknown pass `{name}`\nhelp: the passes are: {}", .valid.join(", "))]
    UnknownPass { name: String, valid: Vec<String> },

    #[error("pass `{pass}` needs mesh axis {} but the mesh is {}\nhelp: add {} to the mesh (e.g. `--mesh {}`)",
        quoted_list(.axes), mesh_text(.mesh), .axes.join(" or "), example_mesh(.mesh, .axes))]
    MissingAxis {
        pass: String,
        axes: Vec<String>,
        mesh: Mesh,
    },

    #[error("pass `{pass}` must run after `{required}`, which does not come earlier in the pipeline [{}]\nhelp: put `{required}` before `{pass}`", .pipeline.join(", "))]
    Prerequisite {
        pass: String,
        required: String,
        pipeline: Vec<String>,
    },

    #[error("`{option} {pass}` names a pass that is not in the pipeline [{}]", .pipeline.join(", "))]
    NotInPipeline {
        option: String,
        pass: String,
        pipeline: Vec<String>,
    },

    #[error("the graph's mesh `{graph}` differs from the mesh being compiled for `{context}`")]
    MeshMismatch { graph: Mesh, context: Mesh },

    #[error("the graph is invalid {}: {report}", if .pass.is_empty() { "before the first pass".to_string() } else { format!("after pass `{}`", .pass) })]
    Verify {
        pass: String,
        report: Box<VerifyReport>,
    },

    /// A pass cannot rewrite part of the graph: `what failed in location: why`.
    #[error("{what} in {location}: {why}{}", help_suffix(.help))]
    Rewrite {
        pass: String,
        what: String,
        location: String,
        why: String,
        help: Option<String>,
    },
}

fn example_mesh(mesh: &Mesh, axes: &[String]) -> String {
    let mut m = mesh.clone();
    if let Some(a) = axes.first() {
        m.axes.push((a.clone(), 2));
    }
    m.to_string()
}

impl PassError {
    /// A located rewrite error.
    pub fn rewrite(
        pass: &str,
        what: impl Into<String>,
        location: impl Into<String>,
        why: impl Into<String>,
    ) -> PassError {
        PassError::Rewrite {
            pass: pass.into(),
            what: what.into(),
            location: location.into(),
            why: why.into(),
            help: None,
        }
    }

    pub fn with_help(mut self, text: impl Into<String>) -> PassError {
        if let PassError::Rewrite { help, .. } = &mut self {
            *help = Some(text.into());
        }
        self
    }

    /// The pass the error belongs to, if any.
    pub fn pass(&self) -> Option<&str> {
        match self {
            PassError::MissingAxis { pass, .. }
            | PassError::Prerequisite { pass, .. }
            | PassError::Verify { pass, .. }
            | PassError::Rewrite { pass, .. } => Some(pass),
            _ => None,
        }
    }
}
