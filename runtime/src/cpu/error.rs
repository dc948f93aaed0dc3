//! Errors of the CPU executor. Each names what failed (a node with its rank, a param,
//! an input or an output) and why, in the `<what failed> in <where>: <why>` form of
//! the rest of Weft.

/// An error running a graph on the CPU reference executor.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RuntimeError {
    /// An op failed, or computed a tensor that does not match its node's type.
    #[error("`{op}` failed in {node} on rank {rank}: {message}")]
    Node {
        rank: u32,
        /// `g.describe(node)`, e.g. `node %12 (model.layers.3.mlp)`.
        node: String,
        op: &'static str,
        message: String,
    },
    #[error("missing weight for param `{name}`\nhelp: pass a tensor for every param of the graph (full, unsharded), keyed by its name")]
    MissingWeight { name: String },
    #[error("missing input `{name}`\nhelp: pass a tensor for every input of the graph (full, unsharded), keyed by its name")]
    MissingInput { name: String },
    /// A weight or input tensor that does not fit its node (shape or dtype kind).
    #[error("{kind} `{name}`: {message}")]
    BadTensor {
        kind: &'static str,
        name: String,
        message: String,
    },
    /// The symbol bindings are inconsistent (e.g. `S` bound twice to different values).
    #[error("bindings: {0}")]
    Bindings(String),
    /// An output cannot be assembled from the ranks' pieces.
    #[error("output `{name}`: {message}")]
    Output { name: String, message: String },
    /// Gradients were asked for but could not be computed.
    #[error("gradients of `{loss}`: {message}")]
    Backward { loss: String, message: String },
    /// A rank's worker thread panicked (a bug in the executor).
    #[error("rank {rank} panicked: {message}")]
    Panic { rank: u32, message: String },
}

impl RuntimeError {
    /// The rank the error happened on, when it is a rank's error.
    pub fn rank(&self) -> Option<u32> {
        match self {
            RuntimeError::Node { rank, .. } | RuntimeError::Panic { rank, .. } => Some(*rank),
            _ => None,
        }
    }
}
