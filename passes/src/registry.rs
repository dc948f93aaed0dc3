//! The registry of every pass, and pipelines: lists of pass names, each with the
//! reason it sits where it does.

use crate::autodiff::Autodiff;
use crate::canonicalize::Canonicalize;
use crate::checkpoint::Checkpoint;
use crate::convert_dtype::ConvertDtype;
use crate::ep::ExpertParallel;
use crate::fp8::Fp8;
use crate::fuse::Fuse;
use crate::grad_sync::GradSync;
use crate::linear_ce::LinearCrossEntropy;
use crate::micro_batches::MicroBatches;
use crate::offload::Offload;
use crate::optimizer::OptimizerPass;
use crate::pass::{Pass, PassError, CP, DP, SP, TP};
use crate::ring::RingAttention;
use crate::ring_lower::RingLower;
use crate::shard_inputs::ShardInputs;
use crate::shard_seq::ShardSeq;
use crate::simplify::Simplify;
use crate::sp_loss::SpLoss;
use crate::tp::TensorParallel;
use crate::ulysses::UlyssesAttention;
use std::fmt;
use weft_ir::Mesh;

/// Every pass, in the order a full pipeline would run them.
pub static PASSES: &[&dyn Pass] = &[
    &ConvertDtype,
    &ShardInputs,
    &ShardSeq,
    &UlyssesAttention,
    &RingAttention,
    &SpLoss,
    &ExpertParallel,
    &TensorParallel,
    &Simplify,
    &Canonicalize,
    &LinearCrossEntropy,
    &Fp8,
    &MicroBatches,
    &Autodiff,
    &Checkpoint,
    &Offload,
    &RingLower,
    &GradSync,
    &OptimizerPass,
    &Fuse,
];

/// Every registered pass.
pub fn passes() -> &'static [&'static dyn Pass] {
    PASSES
}

/// The names of every registered pass, in registry order.
pub fn pass_names() -> Vec<&'static str> {
    PASSES.iter().map(|p| p.name()).collect()
}

/// The pass called `name`, or an error listing the valid names.
pub fn lookup(name: &str) -> Result<&'static dyn Pass, PassError> {
    PASSES
        .iter()
        .copied()
        .find(|p| p.name() == name)
        .ok_or_else(|| PassError::UnknownPass {
            name: name.to_string(),
            valid: pass_names().into_iter().map(String::from).collect(),
        })
}

/// One pipeline entry: the pass and why it runs at this point.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Step {
    pub pass: String,
    pub why: String,
}

/// A pipeline as data: printable (`weft passes --pipeline`) and checkable.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Pipeline {
    pub steps: Vec<Step>,
}

impl Pipeline {
    fn push(&mut self, pass: &str, why: &str) {
        self.steps.push(Step {
            pass: pass.to_string(),
            why: why.to_string(),
        });
    }

    pub fn names(&self) -> Vec<&str> {
        self.steps.iter().map(|s| s.pass.as_str()).collect()
    }

    /// Parses a textual pipeline, `shard-inputs,shard-seq,...` (commas or spaces),
    /// checking every name and every ordering constraint.
    pub fn parse(text: &str) -> Result<Pipeline, PassError> {
        let mut p = Pipeline::default();
        for name in parse_pass_names(text)? {
            p.push(&name, "given on the command line");
        }
        check_pipeline(&p.names())?;
        Ok(p)
    }
}

impl fmt::Display for Pipeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w = self.steps.iter().map(|s| s.pass.len()).max().unwrap_or(0);
        for (i, s) in self.steps.iter().enumerate() {
            writeln!(f, "{:>2}. {:<w$}  {}", i + 1, s.pass, s.why)?;
        }
        Ok(())
    }
}

/// A list of pass names, separated by commas or spaces (the one parser of pass lists:
/// `--passes`, `--print-before`, `--print-after`), each checked against the registry.
pub fn parse_pass_names(text: &str) -> Result<Vec<String>, PassError> {
    let names: Vec<String> = text
        .split([',', ' '])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    for n in &names {
        lookup(n)?;
    }
    Ok(names)
}

/// Checks that every name is a pass and that every pass's prerequisites come earlier.
pub fn check_pipeline(names: &[&str]) -> Result<(), PassError> {
    for (i, name) in names.iter().enumerate() {
        let pass = lookup(name)?;
        for req in pass.requires() {
            if !names[..i].contains(req) {
                return Err(PassError::Prerequisite {
                    pass: name.to_string(),
                    required: req.to_string(),
                    pipeline: names.iter().map(|s| s.to_string()).collect(),
                });
            }
        }
    }
    Ok(())
}

/// The passes a mesh needs, in order (see [`default_pipeline_explained`] for why).
pub fn default_pipeline(mesh: &Mesh) -> Vec<&'static str> {
    let p = default_pipeline_explained(mesh);
    p.names()
        .into_iter()
        .map(|n| {
            lookup(n)
                .expect("default pipelines use registered passes")
                .name()
        })
        .collect()
}

const RING_LOWER_FORWARD: &str = "after ring-attention: expands each ring_attention into its ring steps (a training step moves it after autodiff, checkpoint and offload)";
const RING_LOWER_TRAINING: &str = "after autodiff, checkpoint and offload: they see each ring as one op whose backward saves only q, k, v, out and lse; then the ring steps of the forward and the transposed ring of the backward are written out";

/// Moves `ring-lower` (if the forward pipeline has it) after the training passes that
/// must see each ring as one op: autodiff, checkpoint and offload (before grad-sync).
pub fn place_ring_lower(p: &mut Pipeline) {
    let Some(i) = p
        .steps
        .iter()
        .position(|s| s.pass == crate::ring_lower::NAME)
    else {
        return;
    };
    let Some(last) = p
        .steps
        .iter()
        .rposition(|s| ["autodiff", "checkpoint", "offload"].contains(&s.pass.as_str()))
    else {
        return;
    };
    if last < i {
        return;
    }
    p.steps.remove(i);
    p.steps.insert(
        last,
        Step {
            pass: crate::ring_lower::NAME.to_string(),
            why: RING_LOWER_TRAINING.to_string(),
        },
    );
}

const TP_AFTER_SP: &str = "after sp-loss: the loss is already per-rank sums, which the vocab-parallel cross-entropy keeps; before ulysses-attention: heads are split by tp first";

/// The default pipeline of a mesh with the reason for each position:
/// - `sp`: shard-inputs, shard-seq, ulysses-attention, sp-loss, canonicalize;
/// - `dp` alone: shard-inputs, shard-seq, sp-loss, canonicalize (batch sharding and the
///   loss reduction over dp);
/// - `tp`: tensor-parallel (after sp-loss and before ulysses-attention when the mesh
///   also has sp/dp), canonicalize;
/// - one rank: canonicalize.
pub fn default_pipeline_explained(mesh: &Mesh) -> Pipeline {
    let mut p = Pipeline::default();
    let (sp, dp, tp, cp) = (
        mesh.has(SP),
        mesh.has(DP),
        mesh.has(TP) && mesh.size_or_one(TP) > 1,
        mesh.has(CP),
    );
    if mesh.world_size() > 1 && (sp || dp || cp) {
        let seq = match (cp, sp) {
            (true, true) => Some("sequence block by @cp (zigzag) and @sp"),
            (true, false) => Some("sequence block by @cp (zigzag)"),
            (false, true) => Some("sequence block by @sp"),
            _ => None,
        };
        let what = match (seq, dp) {
            (Some(s), true) => format!("batch block by @dp and {s}"),
            (Some(s), false) => s.to_string(),
            _ => "batch block by @dp".to_string(),
        };
        p.push(
            "shard-inputs",
            &format!("first: every later pass starts from each rank's {what}; labels are sliced after shift_labels"),
        );
        p.push("shard-seq", "after shard-inputs: propagates the per-rank sizes its slices introduce to every consumer");
        let ulysses = "after shard-seq: trades heads for sequence on q/k/v of per-rank sequence S/sp, so attention sees whole sequences";
        let ring = "after shard-seq: replaces the whole-sequence attention of each cp rank with ring steps over cp (and Ulysses all_to_alls over sp inside), merged by log-sum-exp";
        if cp && !tp {
            p.push(crate::ring::NAME, ring);
        } else if sp && !tp {
            p.push("ulysses-attention", ulysses);
        }
        p.push(
            "sp-loss",
            "after shard-seq: all-reduces the per-rank cross-entropy sum and valid count, and records output splits from per-rank types",
        );
        if tp {
            p.push("tensor-parallel", TP_AFTER_SP);
            if cp {
                p.push(crate::ring::NAME, "after tensor-parallel: the ring (and Ulysses inside it) works on this tp rank's heads");
            } else if sp {
                p.push("ulysses-attention", "after tensor-parallel: trades this tp rank's heads (not the model's) for sequence, so kv-head repeats are decided on the local heads");
            }
        }
        if cp && mesh.size_or_one(CP) > 1 {
            p.push(crate::ring_lower::NAME, RING_LOWER_FORWARD);
        }
        p.push("canonicalize", "last: folds and removes what the rewrites leave behind (identity ops, duplicates, dead nodes)");
    } else if tp {
        p.push(
            "tensor-parallel",
            "splits linears, heads and the vocabulary over tp; the loss becomes vocab-parallel",
        );
        p.push("canonicalize", "last: folds and removes what the rewrites leave behind (identity ops, duplicates, dead nodes)");
    } else {
        let why = if mesh.world_size() > 1 {
            "no sp or dp axis, so no sequence or batch sharding; only fold identities, merge duplicates and drop dead nodes"
        } else {
            "a one-rank mesh needs no sharding; only fold identities, merge duplicates and drop dead nodes"
        };
        p.push("canonicalize", why);
    }
    if mesh.has(crate::ep::EP) {
        // Before tensor-parallel (experts stay whole on tp: the ep groups span tp ranks)
        // and canonicalize; after shard-seq, so each rank dispatches only its tokens.
        let at = p
            .steps
            .iter()
            .position(|s| s.pass == "tensor-parallel" || s.pass == "canonicalize")
            .unwrap_or(p.steps.len());
        let why = "after shard-seq: each rank routes its own tokens; splits the experts over ep and trades rows with all_to_all_v (before tensor-parallel, which leaves experts whole)";
        p.steps.insert(
            at,
            Step {
                pass: crate::ep::NAME.to_string(),
                why: why.to_string(),
            },
        );
    }
    p
}

/// The mesh axes some registered pass implements (from each pass's
/// [`Pass::mesh_axes`]), plus `edp`, which `ep` derives. A mesh axis outside this list
/// would replicate the model silently, so [`check_mesh_axes`] refuses it.
pub fn supported_axes() -> Vec<&'static str> {
    let mut out: Vec<&'static str> = PASSES
        .iter()
        .flat_map(|p| match p.mesh_axes() {
            crate::pass::MeshAxes::None => &[][..],
            crate::pass::MeshAxes::All(a) | crate::pass::MeshAxes::AnyOf(a) => a,
        })
        .copied()
        .collect();
    if out.contains(&weft_ir::mesh::EP) {
        out.push(weft_ir::mesh::EDP);
    }
    out.sort();
    out.dedup();
    out
}

/// Refuses a mesh axis no pass implements (`pp`, `DP`, `foo`), naming the axis and the
/// ones that work.
pub fn check_mesh_axes(mesh: &Mesh) -> Result<(), String> {
    let known = supported_axes();
    for (axis, _) in &mesh.axes {
        if !known.contains(&axis.as_str()) {
            let hint = known
                .iter()
                .find(|k| k.eq_ignore_ascii_case(axis))
                .map(|k| format!(" (did you mean `{k}`?)"))
                .unwrap_or_default();
            return Err(format!(
                "mesh `{mesh}`: no pass implements axis `{axis}`{hint}, so it would only replicate the model\nhelp: the axes Weft implements are {}",
                known.join(", ")
            ));
        }
    }
    Ok(())
}
