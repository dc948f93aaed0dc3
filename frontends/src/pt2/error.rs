//! The errors of the `.pt2` importer. Each names where it happened: the archive entry
//! (`llama/models/model.json`), the JSON path inside it, the tensor, or the exported
//! node with its op and HF layer. [`Pt2Error::help`] says how to fix it where known.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Pt2Error {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The file is not a readable zip (truncated, not a zip, corrupt directory).
    #[error("{archive} is not a readable .pt2 archive: {message}")]
    Zip { archive: String, message: String },

    /// A required entry is absent.
    #[error("{archive} has no entry `{entry}`")]
    MissingEntry { archive: String, entry: String },

    /// An entry exists but could not be read (bad compression, CRC, not UTF-8).
    #[error("cannot read entry `{entry}` of {archive}: {message}")]
    Entry {
        archive: String,
        entry: String,
        message: String,
    },

    /// An archive layout of torch 2.6-2.8 (pickled weights) or another program kind.
    #[error("{archive} was written by {writer}, whose .pt2 layout is not supported: {message}")]
    OldArchive {
        archive: String,
        writer: String,
        message: String,
    },

    /// The serialized ExportedProgram has a schema major this importer does not read.
    #[error("`{entry}` has export schema {major}.{minor} (written by torch {torch}); this importer reads schema 8")]
    SchemaVersion {
        entry: String,
        major: i64,
        minor: i64,
        torch: String,
    },

    /// Text that is not JSON.
    #[error("invalid JSON in `{entry}` at line {line}, column {column}: {message}")]
    Json {
        entry: String,
        line: usize,
        column: usize,
        message: String,
    },

    /// JSON that does not follow the export schema.
    #[error("unexpected content in `{entry}` at {path}: {message}")]
    Schema {
        entry: String,
        path: String,
        message: String,
    },

    /// A tensor's dtype code is not one the importer reads.
    #[error(
        "tensor `{tensor}` in `{entry}` has dtype code {code} ({name}), which Weft cannot hold"
    )]
    DType {
        entry: String,
        tensor: String,
        code: i64,
        name: String,
    },

    /// A tensor's sizes, strides and offset do not fit its bytes.
    #[error("tensor `{tensor}` in `{entry}`: {message}")]
    TensorData {
        entry: String,
        tensor: String,
        message: String,
    },

    /// Weights are missing (the program was exported without them) or do not fit.
    #[error("weights of {archive}: {message}")]
    Weights { archive: String, message: String },

    /// An exported op the importer cannot translate.
    #[error("unsupported op `{op}` in node `{node}`{}: {message}", layer_text(.layer))]
    UnsupportedOp {
        op: String,
        node: String,
        layer: Option<String>,
        message: String,
    },

    /// A node whose arguments or types do not make sense.
    #[error("cannot import node `{node}` (`{op}`){}: {message}", layer_text(.layer))]
    Node {
        op: String,
        node: String,
        layer: Option<String>,
        message: String,
    },

    /// A symbolic size the importer cannot express as a Weft dim.
    #[error("symbolic size `{expr}` in {place}: {message}")]
    SymExpr {
        expr: String,
        place: String,
        message: String,
    },

    /// The program's signature is not a causal LM's forward.
    #[error("unsupported program signature: {message}")]
    Signature { message: String },

    /// The imported graph failed Weft's verifier (an importer bug, reported with the graph).
    #[error("the imported graph does not verify:\n{report}")]
    Verify { report: String },
}

fn layer_text(layer: &Option<String>) -> String {
    match layer {
        Some(l) if !l.is_empty() => format!(" ({l})"),
        _ => String::new(),
    }
}

impl Pt2Error {
    /// How to fix the error, where that is known.
    pub fn help(&self) -> Option<String> {
        match self {
            Pt2Error::Zip { .. } | Pt2Error::MissingEntry { .. } => Some(
                "write the archive with `torch.export.save(ep, \"model.pt2\")` (torch 2.9 or later) and copy it whole"
                    .into(),
            ),
            Pt2Error::OldArchive { .. } | Pt2Error::SchemaVersion { .. } => Some(
                "re-export with torch 2.9 or later: `ep = torch.export.export(model, (), kwargs={\"input_ids\": ids}, strict=False)` then `torch.export.save(ep, \"model.pt2\")`"
                    .into(),
            ),
            Pt2Error::Weights { .. } => {
                Some("pass the model's weights with `--weights model.safetensors` (HF state_dict names)".into())
            }
            Pt2Error::UnsupportedOp { .. } => Some(
                "export with `strict=False` from a supported HF family (llama, mistral, qwen2, qwen3, phi3, mixtral, qwen3_moe, gemma2, gemma3, gpt_oss, deepseek_v3), or open an issue with the op name"
                    .into(),
            ),
            Pt2Error::SymExpr { .. } => Some(
                "export with `dynamic_shapes={\"input_ids\": {1: torch.export.Dim.AUTO}}` so the sequence length is the only symbol"
                    .into(),
            ),
            _ => None,
        }
    }

    pub(crate) fn schema(
        entry: &str,
        path: impl Into<String>,
        message: impl Into<String>,
    ) -> Pt2Error {
        Pt2Error::Schema {
            entry: entry.to_string(),
            path: path.into(),
            message: message.into(),
        }
    }
}
