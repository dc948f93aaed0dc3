//! `weft plan`'s search: every mesh (dp, cp, sp, tp, ep), ZeRO stage, checkpoint policy,
//! activation offload, optimizer offload and micro-batch count for a model on `N` GPUs, priced by an
//! analytic model of memory and step time so that thousands of candidates take
//! milliseconds; the CLI compiles only the finalists (the plan's own estimate then
//! decides). Deterministic: candidates are enumerated in a fixed order and ties broken
//! by their text.
//!
//! The analytic model, per rank:
//! - memory: parameters (sharded by tp/ep, and by the ZeRO group at stage 3, plus two
//!   layers of gathered parameters in flight), gradients at the activations' peak (the
//!   backward's start): whole (sharded at stage 2/3) where the step returns them or
//!   accumulates them over micro-batches, else only a tied vocabulary's (each other
//!   gradient dies at its update in the backward), plus two buckets in flight where a
//!   data-parallel group reduces them; optimizer state (f32 master + AdamW moments,
//!   sharded from stage 1), saved activations per token and layer by checkpoint policy
//!   (Korthikanti et al.'s accounting for SwiGLU attention blocks with flash attention:
//!   no S^2 term; with `--offload`, one layer's on the device, but selective +
//!   offload keeps the residual stream of every layer there; dense single-norm layers
//!   as `fuse` leaves them), the logits (in the parameters' dtype with their gradient
//!   written over them; f32 and a gradient beside them for the vocabulary-parallel loss
//!   over tp and for soft-capped logits), one layer's working set;
//! - time: matmul and attention FLOPs at the profile's rates (recompute adds the
//!   forward again for `full`), tp and sp (Ulysses) and ep collectives on the critical
//!   path, gradient reduction and ZeRO-3 gathers overlapped with the backward (only
//!   what exceeds it is exposed; ZeRO-1/2's gather of the updated chunks, after the
//!   last update, exposed whole), offload copies over the host link hidden under
//!   compute; optimizer offload's gradient and parameter copies and host AdamW
//!   (the profile's `host_adam_params_per_s`) hidden under the backward but the last
//!   layer's share. Each collective is priced on NVLink or on the network by where its
//!   axis lands: ranks are row-major over `dp, cp, sp, tp` (tp innermost), so an axis
//!   crosses nodes when its stride times its size exceeds the GPUs of a node;
//! - context parallelism (`cp`, ring attention): each of the `cp-1` ring steps (fewer for a
//!   layer with a sliding window: [`window_ring_steps`]) sends
//!   this rank's k/v block forward (and the dk/dv block back in the backward) while
//!   the previous block's attention runs, so only what a step's transfer takes beyond
//!   its block's attention is exposed ([`ring_step`]); the received blocks are saved
//!   for the backward unless the layer is recomputed. Ulysses past the kv heads
//!   repeats them (`sp / gcd(kv, sp)`), which the all_to_all bytes count. The
//!   all-gather variant (`--cp-kv allgather`, searched beside the ring on a cp mesh)
//!   gathers k/v once forward and once backward and reduce-scatters dk/dv, all exposed,
//!   holds the whole sequence's k/v and dk/dv, computes the masked half of the
//!   attention too, and copies k/v and dk/dv to and from the sequence-first layout of
//!   its collectives at HBM bandwidth;

use crate::ring_allgather::CpKv;
use weft_ir::plan::DeviceProfile;

/// What the search needs to know about a model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelShape {
    pub name: String,
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    /// Dense MLP intermediate size.
    pub ffn: u64,
    pub vocab: u64,
    /// Sparse layers and their experts (0 experts: dense).
    pub moe_layers: u64,
    pub experts: u64,
    pub top_k: u64,
    pub expert_ffn: u64,
    pub tied: bool,
    /// Bytes of a parameter (2 for bf16).
    pub param_bytes: u64,
    /// Each layer's causal attention window (none: full attention); empty when no
    /// layer has one. A windowed layer's ring stops early ([`window_ring_steps`]).
    pub layer_windows: Vec<Option<u64>>,
    /// Norms before (or after) the attention and the MLP, not both (gemma2/3's sandwich
    /// norms save more than [`score`]'s `fuse`-based count).
    pub single_norms: bool,
    /// The logits are soft-capped (`c * tanh(logits / c)`): the unfused loss holds the
    /// capped chain beside the logits.
    pub logit_softcap: bool,
    /// Expert-wide ([rows, expert_ffn]) tensors a MoE layer's experts keep per routed
    /// row without checkpointing: 3 for SwiGLU (gate, up and their product, `glu`
    /// fused); gpt-oss's clamped SwiGLU on interleaved gate/up keeps 8 (its compiled
    /// plans).
    pub expert_saved: u64,
}

impl ModelShape {
    fn attn_params(&self) -> u64 {
        let q = self.heads * self.head_dim;
        let kv = self.kv_heads * self.head_dim;
        self.hidden * (2 * q + 2 * kv)
    }
    /// Parameters outside the experts (all layers' attention, dense MLPs, norms,
    /// embeddings, routers).
    pub fn dense_params(&self) -> u64 {
        let dense_layers = self.layers - self.moe_layers;
        let emb = self.vocab * self.hidden * if self.tied { 1 } else { 2 };
        self.layers * (self.attn_params() + 2 * self.hidden)
            + dense_layers * 3 * self.hidden * self.ffn
            + self.moe_layers * self.hidden * self.experts
            + emb
            + self.hidden
    }
    pub fn expert_params(&self) -> u64 {
        self.moe_layers * self.experts * 3 * self.hidden * self.expert_ffn
    }
    pub fn params(&self) -> u64 {
        self.dense_params() + self.expert_params()
    }
    /// Parameters a token passes through (matmul FLOPs are 2 per parameter and token).
    pub fn active_params(&self) -> u64 {
        let emb = if self.tied {
            0
        } else {
            self.vocab * self.hidden
        };
        self.dense_params() - self.vocab * self.hidden * if self.tied { 1 } else { 2 }
            + emb
            + self.moe_layers * self.top_k * 3 * self.hidden * self.expert_ffn
    }
    /// MLP intermediate width a token's activations span in an average layer.
    fn ffn_per_token(&self) -> f64 {
        let dense = (self.layers - self.moe_layers) as f64 * self.ffn as f64;
        let sparse = self.moe_layers as f64 * (self.top_k * self.expert_ffn) as f64;
        (dense + sparse) / self.layers as f64
    }
}

/// Time the experts' grouped GEMMs take beyond their FLOPs: the runtime issues one GEMM
/// per expert from the host (2 a layer forward, 4 backward, the forward again under full
/// checkpointing), each at least `grouped_gemm_issue_us`, after a host sync per grouped
/// matmul (see `plan::cost::grouped_matmul_time`, which prices compiled plans).
fn expert_issue_floor(
    m: &ModelShape,
    c: &Candidate,
    tokens_per_rank: f64,
    recompute: f64,
    d: &DeviceProfile,
) -> f64 {
    if m.moe_layers == 0 || m.experts == 0 {
        return 0.0;
    }
    let redo = if c.checkpoint == "full" { 1.0 } else { 0.0 };
    let gemms = (6.0 + 2.0 * redo) * m.experts as f64;
    let issue = m.moe_layers as f64
        * c.micro_batches as f64
        * (gemms * d.grouped_gemm_issue_us + (6.0 + 2.0 * redo) / 2.0 * d.host_sync_us)
        * 1e-6;
    let flops = 6.0
        * (m.moe_layers * m.top_k * 3 * m.hidden * m.expert_ffn) as f64
        * tokens_per_rank
        * (1.0 + recompute);
    (issue - flops / (d.matmul_tflops * 1e12)).max(0.0)
}

/// The search's input besides the model.
#[derive(Clone, Debug, PartialEq)]
pub struct SearchSpec {
    pub gpus: u32,
    pub gpus_per_node: u32,
    pub seq: u64,
    /// Global batch in sequences.
    pub batch: u64,
    pub device: DeviceProfile,
    /// Per-rank memory the plan must fit, bytes.
    pub device_memory: u64,
    /// Per-rank pinned host memory the plan may hold (`--host-memory`), bytes; `None`
    /// leaves the host unbounded.
    pub host_memory: Option<u64>,
    /// Datasheet dense bf16 peak per GPU for MFU, FLOP/s.
    pub peak_flops: f64,
    /// The step returns its parameter gradients (`--keep-grads`, `weft check`): they
    /// live to its end instead of dying at their updates.
    pub grad_outputs: bool,
}

/// One point of the search space.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Candidate {
    pub dp: u32,
    /// Context parallelism (ring attention), outside sp.
    pub cp: u32,
    pub sp: u32,
    pub tp: u32,
    pub ep: u32,
    pub zero: u8,
    /// `none`, `selective` or `full`.
    pub checkpoint: &'static str,
    pub offload: bool,
    /// Optimizer state and its update on the host (`--offload-optimizer`).
    pub offload_optimizer: bool,
    /// lm_head + cross-entropy without a logits tensor (with its gradient in one op over
    /// token chunks, or over tp in vocabulary chunks whose GEMM the backward recomputes).
    pub fused_loss: bool,
    pub micro_batches: u32,
    /// How cp moves k/v (`--cp-kv`): ring steps overlapped with attention, or one
    /// all-gather (not overlapped, the whole sequence's k/v held). Ring when `cp` is 1.
    pub cp_kv: CpKv,
}

/// One rank, no ZeRO, no checkpointing or offload, the fused loss, one micro-batch.
impl Default for Candidate {
    fn default() -> Candidate {
        Candidate {
            dp: 1,
            cp: 1,
            sp: 1,
            tp: 1,
            ep: 1,
            zero: 0,
            checkpoint: "none",
            offload: false,
            offload_optimizer: false,
            fused_loss: true,
            micro_batches: 1,
            cp_kv: CpKv::Ring,
        }
    }
}

impl Candidate {
    /// The ZeRO groups on `world` ranks: the dense parameters' (dp x cp x sp) and the
    /// experts' (`edp`: the ranks holding the same experts, split over tp too when there
    /// is no ep).
    pub fn zero_groups(&self, world: u64) -> (u64, u64) {
        let dense = (self.dp * self.cp.max(1) * self.sp) as u64;
        let expert = world / self.ep as u64 / if self.ep > 1 { 1 } else { self.tp as u64 };
        (dense, expert)
    }
    /// The mesh text (`dp=8,sp=8,tp=8`, `ep` last), axes of size 1 left out (`dp=1` for
    /// one rank).
    pub fn mesh(&self) -> String {
        let mut parts = Vec::new();
        for (a, n) in [
            ("dp", self.dp),
            ("cp", self.cp),
            ("sp", self.sp),
            ("tp", self.tp),
        ] {
            if n > 1 {
                parts.push(format!("{a}={n}"));
            }
        }
        if self.ep > 1 {
            if parts.is_empty() {
                parts.push(format!("dp={}", self.dp));
            }
            parts.push(format!("ep={}", self.ep));
        }
        if parts.is_empty() {
            // One rank: still a mesh `--mesh` takes.
            parts.push("dp=1".into());
        }
        parts.join(",")
    }
    /// The options as `weft compile` flags.
    pub fn flags(&self) -> String {
        let mut f = format!(
            "--zero {} --checkpoint {} --micro-batches {}",
            self.zero, self.checkpoint, self.micro_batches
        );
        if self.offload {
            f.push_str(" --offload");
        }
        if self.offload_optimizer {
            f.push_str(" --offload-optimizer");
        }
        if self.cp_kv != CpKv::Ring {
            f.push_str(&format!(" --cp-kv {}", self.cp_kv.name()));
        }
        f
    }
}

/// Per-rank memory of a candidate, bytes.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct MemoryBreakdown {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    pub activations: u64,
    pub transient: u64,
    /// Device bytes: the sum of the above.
    pub total: u64,
    /// Pinned host bytes (not in `total`): offloaded activations, and with optimizer
    /// offload the master weights, moments and the gradient and parameter chunks.
    pub host: u64,
}

/// Predicted step of a candidate, seconds.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct TimeBreakdown {
    pub compute: f64,
    /// Collectives on the critical path (tp, sp, ep) and what of the gradient
    /// reduction and ZeRO gathers the backward does not hide.
    pub exposed_comm: f64,
    /// All communication time, hidden or not.
    pub comm: f64,
    pub step: f64,
    pub tokens_per_s_per_gpu: f64,
    pub mfu: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    pub candidate: Candidate,
    pub memory: MemoryBreakdown,
    pub time: TimeBreakdown,
    pub fits: bool,
}

/// Datasheet dense bf16 peak of a device, FLOP/s, for MFU (a profile file: its
/// matmul rate).
pub fn peak_flops(d: &DeviceProfile) -> f64 {
    match d.name.as_str() {
        "h100" | "h200" => 989e12,
        "a100" => 312e12,
        _ => d.matmul_tflops * 1e12,
    }
}

/// The divisors of `n`, ascending (trial division up to its square root).
fn divisors(n: u64) -> Vec<u64> {
    let (mut low, mut high) = (Vec::new(), Vec::new());
    let mut d = 1u64;
    while d.saturating_mul(d) <= n {
        if n.is_multiple_of(d) {
            low.push(d);
            if d != n / d {
                high.push(n / d);
            }
        }
        d += 1;
    }
    low.extend(high.into_iter().rev());
    low
}

/// Whether ranks `stride` apart, `size` of them, span more than one node.
fn crosses(stride: u64, size: u64, gpus_per_node: u64) -> bool {
    size > 1 && stride * size > gpus_per_node
}

/// Ring time of a collective moving `bytes` per rank (already scaled by `(p-1)/p`)
/// in `steps` latency hops.
fn link_time(d: &DeviceProfile, inter: bool, bytes: f64, steps: f64) -> f64 {
    let (bw, lat) = if inter {
        (d.inter_node_gbps * 1e9, d.inter_node_latency_us * 1e-6)
    } else {
        (d.intra_node_gbps * 1e9, d.intra_node_latency_us * 1e-6)
    };
    bytes / bw + lat * steps
}

/// Every candidate, in a fixed order.
pub fn enumerate(m: &ModelShape, s: &SearchSpec) -> Vec<Candidate> {
    let world = s.gpus as u64;
    let mut out = Vec::new();
    for tp in divisors(world) {
        if tp > s.gpus_per_node as u64
            || !m.heads.is_multiple_of(tp)
            || (!m.kv_heads.is_multiple_of(tp) && !tp.is_multiple_of(m.kv_heads))
            || !m.vocab.is_multiple_of(tp)
        {
            continue;
        }
        for (sp, cp) in divisors(world / tp).into_iter().flat_map(|sp| {
            divisors(world / tp / sp)
                .into_iter()
                .map(move |cp| (sp, cp))
        }) {
            let heads = m.heads / tp;
            // cp splits the sequence into 2*cp zigzag chunks, each split over sp.
            let chunks = if cp > 1 { 2 * cp * sp } else { sp };
            if !heads.is_multiple_of(sp) || !s.seq.is_multiple_of(chunks) {
                continue;
            }
            let dp = world / tp / sp / cp;
            if !s.batch.is_multiple_of(dp) {
                continue;
            }
            let eps: Vec<u64> = if m.experts > 0 {
                divisors(m.experts)
                    .into_iter()
                    .filter(|e| {
                        world.is_multiple_of(*e)
                            && weft_ir::Mesh::parse(&layout(dp, cp, sp, tp, *e).mesh()).is_ok()
                    })
                    .collect()
            } else {
                vec![1]
            };
            let per_rank = s.batch / dp;
            for ep in eps {
                let layout = layout(dp, cp, sp, tp, ep);
                // Without a group to shard over every ZeRO stage is stage 0's plan.
                let (dense_group, expert_group) = layout.zero_groups(world);
                let zero_max = if dense_group > 1 || (m.experts > 0 && expert_group > 1) {
                    3
                } else {
                    0
                };
                for zero in 0..=zero_max {
                    for checkpoint in ["none", "selective", "full"] {
                        for (offload, offload_optimizer) in
                            [(false, false), (true, false), (false, true), (true, true)]
                        {
                            let mut mb = 1;
                            while mb <= per_rank {
                                if per_rank.is_multiple_of(mb) {
                                    for &cp_kv in kv_exchanges(cp) {
                                        out.push(Candidate {
                                            zero,
                                            checkpoint,
                                            offload,
                                            offload_optimizer,
                                            // what `weft plan` compiles (the default)
                                            fused_loss: true,
                                            micro_batches: mb as u32,
                                            cp_kv,
                                            ..layout.clone()
                                        });
                                    }
                                }
                                mb *= 2;
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// The k/v exchanges a cp of `cp` ranks can use: both with a ring, none to choose
/// without one.
fn kv_exchanges(cp: u64) -> &'static [CpKv] {
    if cp > 1 {
        &[CpKv::Ring, CpKv::AllGather]
    } else {
        &[CpKv::Ring]
    }
}

/// The candidate of one parallel layout, its other options at their defaults.
fn layout(dp: u64, cp: u64, sp: u64, tp: u64, ep: u64) -> Candidate {
    Candidate {
        dp: dp as u32,
        cp: cp as u32,
        sp: sp as u32,
        tp: tp as u32,
        ep: ep as u32,
        ..Default::default()
    }
}

/// The ring steps a windowed layer takes over `cp` ranks at `seq` tokens (the
/// lowering's own rule, `ring_steps::window_ring`); `cp - 1` for full attention or where
/// the window leaves no shorter ring.
pub fn window_ring_steps(window: Option<u64>, seq: u64, cp: u64) -> u64 {
    let full = cp.saturating_sub(1);
    match window {
        Some(w) if cp > 1 => {
            crate::parallel::ring_steps::window_ring(seq as i64, cp as i64, w as i64)
                .map(|r| (r.steps() as u64).min(full))
                .unwrap_or(full)
        }
        _ => full,
    }
}

/// Ring steps, summed over layers, that sliding windows save against `cp - 1` a layer.
fn window_ring_saved_steps(m: &ModelShape, seq: u64, cp: u64) -> f64 {
    m.layer_windows
        .iter()
        .map(|&w| (cp.saturating_sub(1) - window_ring_steps(w, seq, cp)) as f64)
        .sum()
}

/// The step's model FLOPs on all ranks: matmuls (6 per active parameter and token; the
/// lm_head's GEMM runs whether or not it shares the embedding's weight, which
/// `active_params` leaves out when tied) and causal attention.
fn model_flops(m: &ModelShape, s: &SearchSpec) -> (f64, f64) {
    let all_tokens = s.batch as f64 * s.seq as f64;
    let head = if m.tied { m.vocab * m.hidden } else { 0 };
    let matmul = 6.0 * (m.active_params() + head) as f64 * all_tokens;
    let q = (m.heads * m.head_dim) as f64;
    let attention = 6.0 * 2.0 * m.layers as f64 * q * s.seq as f64 * all_tokens / 2.0;
    (matmul, attention)
}

/// Seconds one layer's forward takes on one rank over the whole step (every
/// micro-batch): a third of its matmul and attention time.
fn forward_layer_s(m: &ModelShape, s: &SearchSpec, d: &DeviceProfile) -> f64 {
    let (matmul, attention) = model_flops(m, s);
    let world = s.gpus as f64;
    (matmul / world / (d.matmul_tflops * 1e12)
        + attention * ATTENTION_HARDWARE_RATIO / world / (attention_tflops(s, 1, d) * 1e12))
        / 3.0
        / m.layers as f64
}

/// Seconds `--offload-optimizer` adds to a step updating `updated` parameters on this
/// rank: each bucket's gradient chunk goes to the host, the host AdamW updates it and
/// the parameters come back, once a step (after the last micro-batch's backward has
/// accumulated the gradients). The compiled plan puts each bucket's updated chunk back
/// on the compute stream in program order, right after that bucket's backward, so
/// the backward waits for every bucket's host update: none of it is hidden (a
/// mixtral-8x7b plan at dp=4,cp=8,ep=2: 5.84 s of host AdamW, its compute stream idle
/// 7.2 s of a 10.1 s step).
fn host_update_exposed(param_bytes: f64, d: &DeviceProfile, updated: f64) -> f64 {
    let link = 2.0 * updated * param_bytes / (d.host_gbps * 1e9);
    link + updated / d.host_adam_params_per_s
}

/// Attention FLOPs the kernels run over those the model counts: the model counts the
/// backward as twice the forward (6x the forward matmul pair in all), the flash
/// backward recomputes the scores and runs five matmuls (`weft_ir::flops`:
/// `attention_grad` is 2.5x the forward), so 3.5x in all.
const ATTENTION_HARDWARE_RATIO: f64 = 3.5 / 3.0;

/// The fused attention's forward + backward rate (TFLOP/s) for causal rows of the
/// sequence, visited in `cp` blocks (each block visit pays the rows' fixed work).
fn attention_tflops(s: &SearchSpec, cp: u32, d: &DeviceProfile) -> f64 {
    super::plan::cost::attention_step_tflops(d, s.seq as f64 / 2.0 / cp.max(1) as f64)
}

/// Kernels a ring step of one layer launches, forward and backward together.
const RING_STEP_KERNELS: f64 = 100.0;

/// Prices one candidate.
pub fn score(m: &ModelShape, s: &SearchSpec, c: &Candidate) -> Scored {
    let d = &s.device;
    let (dp, sp, tp, ep) = (c.dp as f64, c.sp as f64, c.tp as f64, c.ep as f64);
    let cp = c.cp.max(1) as f64;
    let world = s.gpus as f64;
    let pb = m.param_bytes as f64;
    let h = m.hidden as f64;
    let layers = m.layers as f64;
    let gpn = s.gpus_per_node as u64;
    // Where the axes land: row-major dp, cp, sp, tp.
    let tp_inter = crosses(1, c.tp as u64, gpn);
    let sp_inter = crosses(c.tp as u64, c.sp as u64, gpn);
    let cp_inter = crosses((c.tp * c.sp) as u64, c.cp.max(1) as u64, gpn);
    let dp_inter = crosses((c.tp * c.sp * c.cp.max(1)) as u64, c.dp as u64, gpn);
    let ep_inter = c.ep as u64 > gpn;
    // ZeRO groups: dense dp x cp x sp, experts edp (world / ep, split over tp too when no ep).
    let (zd, ze) = c.zero_groups(s.gpus as u64);
    let (zd, ze) = (zd as f64, ze as f64);
    let dense = m.dense_params() as f64 / tp;
    let expert = m.expert_params() as f64 / ep / if c.ep > 1 { 1.0 } else { tp };
    let local = dense + expert;
    let z3 = |n: f64, z: f64| if c.zero >= 3 { n / z } else { n };
    let z2 = |n: f64, z: f64| if c.zero >= 2 { n / z } else { n };
    let z1 = |n: f64, z: f64| if c.zero >= 1 { n / z } else { n };
    let per_layer_params = local / layers;
    let (matmul_model, attn_model) = model_flops(m, s);
    let forward_layer = forward_layer_s(m, s, d);
    // ZeRO-3 splits a parameter by the rows of its dim 0, or of dim 1 where dim 0 has
    // fewer rows than ranks (the stacked expert weights of fewer local experts than
    // ranks in the group): every parameter is sharded.
    let params = pb * (z3(dense, zd) + z3(expert, ze));
    let bucket = 500e6_f64.min(local * pb);
    // A tied vocabulary's gradient takes the lm_head's part at the backward's start and
    // the embedding's at its end, so it lives through the backward; every other one dies
    // at its update (the `optimizer` pass places each right after its gradient is final)
    // unless the step returns it or micro-batches accumulate it.
    let whole_grads = pb * (z2(dense, zd) + z2(expert, ze));
    let grads = if s.grad_outputs || c.micro_batches > 1 {
        whole_grads
    } else if m.tied {
        pb * (m.vocab * m.hidden) as f64 / tp
    } else {
        0.0
    };
    let opt_per_param = if m.param_bytes < 4 { 12.0 } else { 8.0 };
    // Optimizer offload keeps the master weights and moments in host memory.
    let optimizer = if c.offload_optimizer {
        0.0
    } else {
        opt_per_param * (z1(dense, zd) + z1(expert, ze))
    };
    // Activations: tokens per rank per micro-batch.
    let tokens = s.batch as f64 * s.seq as f64 / (dp * cp * sp) / c.micro_batches as f64;
    // Expert parallelism's buffers are sized for the most rows a rank can receive, every
    // rank's routed rows (`ep` times what balanced routing brings), as the plan allocates
    // its data-dependent sizes: the experts' gate, up and product and the received and
    // returned rows of each MoE layer (mixtral-8x7b at dp=16,sp=2,ep=8, 4096 tokens a
    // rank: three [65536, 14336] buffers a layer, 228 GiB compiled where balanced rows
    // priced 69). Selective keeps the rows the exchanges brought (collective results,
    // as many as the bound going, as balanced routing sends coming back), not the
    // experts' intermediates.
    let ep_bound = if c.ep > 1 { ep } else { 1.0 };
    let moe_share = m.moe_layers as f64 / layers;
    let routed_ffn = moe_share * (m.top_k * m.expert_ffn) as f64;
    let ffn = m.ffn_per_token();
    let dense_ffn = ffn - routed_ffn;
    let routed_rows = moe_share * m.top_k as f64 * h;
    let kv = (m.kv_heads * m.head_dim) as f64;
    let q = (m.heads * m.head_dim) as f64;
    // Bytes saved per token and layer (bf16), tp shards everything but the norms' inputs.
    // A dense layer as `fuse` leaves it keeps the two norms' inputs and outputs, q, k
    // and v after rope, the attention's output, and the MLP's gate, up and product
    // (`glu` keeps nothing of its own); under selective, the layer's input and the
    // attention's output (the 1.24B's plans: 76 and 8 KB a token and layer), and in a
    // MoE layer over ep the rows the exchanges brought. Without checkpointing a MoE layer
    // and any layer with sandwich norms keep Korthikanti et al.'s accounting, with the
    // experts' buffers as above; under selective sandwich norms keep what single ones
    // do (they kept more while a layer's recompute chained back through the previous
    // layers', gemma2-9b's plan 145 KB a token and layer).
    let exchanged_rows = routed_rows * (ep_bound + 1.0);
    let routed_kept = if c.ep > 1 { exchanged_rows } else { 0.0 };
    let selective = 2.0 * (q / tp + h + routed_kept);
    let full_layer = if m.moe_layers == 0 && m.single_norms {
        2.0 * ((2.0 * h + 2.0 * q + 2.0 * kv) / tp + 3.0 * ffn / tp + 2.0 * h)
    } else {
        2.0 * ((4.0 * h + 2.0 * q + 2.0 * kv) / tp
            + (4.0 * dense_ffn + m.expert_saved as f64 * routed_ffn * ep_bound) / tp
            + 2.0 * h
            + exchanged_rows)
    };
    // Under Ulysses the all_to_all results q, k and v are kept besides what the counts
    // above hold in the sequence layout (collective results are neither recomputed nor
    // offloaded), and under selective also the attention's output before its all_to_all
    // back, in every layer (llama3-70b at dp=32,sp=2, 16384 tokens a rank: selective 0.5
    // GiB a layer, 114 GiB compiled where cp=2 takes 71; none 0.31 GiB a layer more
    // than dp=64 with as many tokens a rank).
    let kv_rep = kv_repeat(m.kv_heads / c.tp as u64, c.sp as u64) as f64;
    let ulysses_none = if c.sp > 1 {
        2.0 * (q + 2.0 * kv * kv_rep) / tp
    } else {
        0.0
    };
    let ulysses_kept = if c.sp > 1 && c.checkpoint == "selective" {
        ulysses_none + 2.0 * q / tp
    } else {
        0.0
    };
    let saved_per_layer = match c.checkpoint {
        "none" => full_layer + ulysses_none,
        "selective" => selective + ulysses_kept,
        _ => 2.0 * h,
    };
    let kept_layers = if c.offload {
        1.0_f64.min(layers)
    } else {
        layers
    };
    // Selective + offload sends to the host only what selective would recompute
    // (`checkpoint::host::offload_instead`: the compute-bound matmul outputs); what
    // selective keeps, the residual stream and the norms' inputs (2 x hidden per token
    // and layer), stays on the device in every layer.
    let resident_saved = if c.offload && c.checkpoint == "selective" {
        (2.0 * 2.0 * h + ulysses_kept) * (layers - kept_layers)
    } else {
        0.0
    };
    // Ulysses past the kv heads repeats them. Ring attention saves only q, k, v and
    // out (counted per token above) and its f32 log-sum-exp; its backward re-sends k/v
    // (docs/ring.md), so what the ring adds is in flight during one layer: two k/v
    // blocks forward (double buffering), two k/v blocks and two dk/dv accumulators
    // backward.
    let ring_kv = tokens * sp * 2.0 * 2.0 * kv * kv_rep / tp / sp;
    let ring_lse = if c.cp > 1 {
        tokens * 4.0 * m.heads as f64 / tp
    } else {
        0.0
    };
    let ring_saved = if c.checkpoint == "full" {
        0.0
    } else {
        ring_lse
    };
    // The all-gather variant holds the whole sequence's k/v (cp blocks) and, in the
    // backward, the whole sequence's dk/dv besides.
    let ring_in_flight = match (c.cp > 1, c.cp_kv) {
        (false, _) => 0.0,
        (true, CpKv::Ring) => 4.0 * ring_kv,
        (true, CpKv::AllGather) => 2.0 * cp * ring_kv,
    };
    // `none` and `full` with `--offload` send every layer's saved values to the host as
    // soon as the forward is done with them; what the link has not carried by the time
    // the next layer's are made waits on the device (`offload`'s plan holds each buffer
    // until its copy is done), so the backlog grows by the excess every layer (the
    // 1.24B at 16384 on an H100: 1.2 GB a layer made in 5 ms, 0.3 GB carried). Selective
    // + offload sends only what the link carries in time (`checkpoint::host`).
    // What the host link carries during one layer's forward, per micro-batch.
    let carried_per_layer = d.host_gbps * 1e9 * forward_layer / c.micro_batches as f64;
    let backlog = if c.offload && c.checkpoint != "selective" {
        (tokens * saved_per_layer - carried_per_layer).max(0.0) * (layers - kept_layers)
    } else {
        0.0
    };
    let activations = tokens * (saved_per_layer * kept_layers + full_layer + resident_saved)
        + backlog
        + ring_saved * kept_layers
        + ring_in_flight;
    // The f32 logits and their gradient, or with the fused loss one vocabulary chunk's
    // scratch (the pass bounds it to 256 MiB).
    let logits = if c.fused_loss {
        (tokens * m.vocab as f64 / tp * 4.0).min(256.0 * 1024.0 * 1024.0)
    } else if c.tp == 1 && !m.logit_softcap {
        // `cross_entropy_grad` writes the gradient over the logits (ELEMENTWISE_IN_PLACE).
        tokens * m.vocab as f64 * pb
    } else {
        tokens * m.vocab as f64 / tp * 4.0 * 2.0
    };
    let gathered = if c.zero >= 3 {
        2.0 * per_layer_params * pb
    } else {
        0.0
    };
    // Gradient buckets are reduced (two in flight) only over a data-parallel group.
    let buckets = if zd * ze > 1.0 {
        2.0 * bucket.min(whole_grads.max(pb * local / zd))
    } else {
        0.0
    };
    let transient = logits + buckets + gathered;
    // Pinned host memory. Optimizer offload: master weights and moments, and a chunk of
    // each gradient and parameter in their dtype (the 1.24B in bf16: 16 bytes a
    // parameter, 18.4 GiB planned). Activation offload: what leaves the device, one
    // micro-batch's worth (the host buffers are reused): every layer's saved values but
    // the last's under `none` and `full`, under selective what the link carries of what
    // it would recompute.
    let host_optimizer = if c.offload_optimizer {
        (opt_per_param + 2.0 * pb) * (z1(dense, zd) + z1(expert, ze))
    } else {
        0.0
    };
    let host_activations = match (c.offload, c.checkpoint) {
        (false, _) => 0.0,
        (true, "selective") => {
            let recomputed = tokens * (full_layer - saved_per_layer).max(0.0);
            recomputed.min(carried_per_layer) * (layers - kept_layers)
        }
        _ => tokens * saved_per_layer * (layers - kept_layers),
    };
    let memory = MemoryBreakdown {
        params: params as u64,
        grads: grads as u64,
        optimizer: optimizer as u64,
        activations: activations as u64,
        transient: transient as u64,
        total: (params + grads + optimizer + activations + transient) as u64,
        host: (host_optimizer + host_activations) as u64,
    };
    // Compute.
    let all_tokens = s.batch as f64 * s.seq as f64;
    // Recompute as a share of the matmul FLOPs: `full` the whole forward again;
    // `selective` every layer's projections and MLP (a third of their FLOPs; the lm_head
    // is not recomputed: +16% on the 1.24B's plan at 4096). With `--offload` the host
    // takes instead what the link carries during the layer's forward (`checkpoint`'s
    // `host.rs` plans it on the same clock); the rest is recomputed.
    let layer_share = 1.0 - 6.0 * (m.vocab * m.hidden) as f64 * all_tokens / matmul_model;
    let recompute = match (c.checkpoint, c.offload) {
        ("full", _) => 1.0 / 3.0,
        ("selective", false) => layer_share / 3.0,
        ("selective", true) => {
            // A layer's forward over the whole step, against one micro-batch's bytes:
            // with micro-batches this overstates what the link carries, but dividing by
            // their count (with `none` + offload priced as the link carries it) moved
            // llama3-70b's winner to a slower plan (PLAN_SEARCH.md).
            let recomputed_bytes = tokens * (full_layer - saved_per_layer);
            let carried = if recomputed_bytes > 0.0 {
                (d.host_gbps * 1e9 * forward_layer / recomputed_bytes).min(1.0)
            } else {
                1.0
            };
            layer_share / 3.0 * (1.0 - carried)
        }
        _ => 0.0,
    };
    // The fused loss costs about one more lm_head GEMM: over tp its backward recomputes
    // the logits chunk by chunk; on one rank, with its gradient in one op, its row kernel
    // (measured on an H100: +6 ms at 16384 tokens on the 1.24B step, where the GEMM takes
    // 11 ms). The plan's cost model prices the kernel itself (`cost::LCE_ROW_PASSES`).
    let loss_recompute = if c.fused_loss {
        2.0 * all_tokens * m.vocab as f64 * h
    } else {
        0.0
    };
    let compute = ((matmul_model * (1.0 + recompute) + loss_recompute) / world)
        / (d.matmul_tflops * 1e12)
        + (attn_model
            * ATTENTION_HARDWARE_RATIO
            * (1.0
                + if c.checkpoint == "full" {
                    1.0 / 3.0
                } else {
                    0.0
                })
            / world)
            / (attention_tflops(s, c.cp, d) * 1e12)
        + layers * 40.0 * c.micro_batches as f64 * d.kernel_overhead_us * 1e-6
        + expert_issue_floor(m, c, all_tokens / world, recompute, d);
    // Critical-path collectives, per micro-batch then times the count.
    let mb = c.micro_batches as f64;
    let mut exposed = 0.0;
    let mut comm = 0.0;
    let act = tokens * h * 2.0; // one activation per rank, bf16
    if c.tp > 1 {
        // Sequence-parallel tp: 2 all_gathers and 2 reduce_scatters a layer forward, as
        // many backward, each moving the activation of the tp group's tokens.
        let one = link_time(d, tp_inter, act * tp * (tp - 1.0) / tp, tp - 1.0);
        let t = 8.0 * layers * one * mb * (1.0 + recompute);
        exposed += t;
        comm += t;
    }
    if c.sp > 1 {
        // Ulysses: q, k, v and the output through all_to_all, forward and backward.
        let bytes = tokens * 2.0 * (2.0 * q + 2.0 * kv * kv_rep) / tp;
        let t = 2.0
            * layers
            * link_time(d, sp_inter, bytes * (sp - 1.0) / sp, sp - 1.0)
            * mb
            * (1.0 + if c.checkpoint == "full" { 0.5 } else { 0.0 });
        exposed += t;
        comm += t;
    }
    let mut compute = compute;
    if c.cp > 1 && c.cp_kv == CpKv::AllGather {
        // One all_gather of k/v forward (again to recompute under full checkpointing),
        // one backward and a reduce_scatter of dk/dv, each moving `cp - 1` blocks and
        // hidden behind nothing; a sliding window does not shorten them.
        let redo = if c.checkpoint == "full" { 1.0 } else { 0.0 };
        let one = link_time(d, cp_inter, ring_kv * (cp - 1.0), cp - 1.0);
        let t = layers * mb * (3.0 + redo) * one;
        exposed += t;
        comm += t;
        // The masked attention against the whole sequence computes the blocks above
        // the diagonal too: the causal half again.
        compute += (attn_model * ATTENTION_HARDWARE_RATIO * (1.0 + redo / 3.0) / world)
            / (attention_tflops(s, c.cp, d) * 1e12);
        // Its collectives run along a sequence-first copy (`ring_allgather.rs`): each of
        // k and v is permuted there (one block) and the gathered whole back (`cp` blocks)
        // in the forward, again for the backward's gather (and the recompute's), and dk
        // and dv are permuted whole (`cp` blocks) before their reduce_scatter and their
        // own block back after it: `(3 + redo) (cp + 1)` k/v blocks copied, each byte
        // read and written once, at HBM bandwidth.
        let copies = 2.0 * (3.0 + redo) * (cp + 1.0) * ring_kv;
        compute += layers * mb * copies / (d.hbm_gbps * 1e9);
    } else if c.cp > 1 {
        // Ring attention: forward k/v and backward dk/dv blocks, one step each per
        // ring step, each hidden behind that step's block attention.
        let local = tokens * sp;
        let heads_local = m.heads as f64 / tp / sp;
        let step = ring_step(d, cp_inter, ring_kv, local, heads_local, m.head_dim as f64);
        let redo = if c.checkpoint == "full" { 1.0 } else { 0.0 };
        // A sliding window's ring takes only the steps whose blocks meet its band.
        let saved = window_ring_saved_steps(m, s.seq, c.cp as u64);
        // Each ring step of a layer runs about a hundred small kernels forward and
        // backward (the log-sum-exp merges, the chunk selects, the dk/dv accumulation:
        // 104 instructions a step in a compiled 405B dp=32,cp=8,sp=4 step), whose
        // launch cost grows with the steps while the work per step shrinks.
        compute += (layers * (cp - 1.0) - saved)
            * mb
            * (RING_STEP_KERNELS * (1.0 + redo / 2.0))
            * d.kernel_overhead_us
            * 1e-6;
        let t_exposed = layers
            * (cp - 1.0)
            * mb
            * ((1.0 + redo) * step.exposed_forward + step.exposed_backward);
        exposed += t_exposed;
        // Per step: k/v forward, k/v again and dk/dv backward, k/v again to recompute.
        comm += layers * (cp - 1.0) * mb * (3.0 + redo) * step.transfer;
        if saved > 0.0 {
            exposed -= saved * mb * ((1.0 + redo) * step.exposed_forward + step.exposed_backward);
            comm -= saved * mb * (3.0 + redo) * step.transfer;
        }
    }
    if c.ep > 1 && m.moe_layers > 0 {
        let bytes = tokens * m.top_k as f64 * h * 2.0;
        let t = 4.0
            * m.moe_layers as f64
            * link_time(d, ep_inter, bytes * (ep - 1.0) / ep, ep - 1.0)
            * mb;
        exposed += t;
        comm += t;
    }
    // Gradient reduction and ZeRO gathers, hierarchical over sp (inner), cp, then dp.
    let group_time = |bytes: f64| -> f64 {
        let mut t = 0.0;
        if c.sp > 1 {
            t += link_time(d, sp_inter, bytes * (sp - 1.0) / sp, sp - 1.0);
        }
        if c.cp > 1 {
            t += link_time(d, cp_inter, bytes / sp * (cp - 1.0) / cp, cp - 1.0);
        }
        if c.dp > 1 {
            t += link_time(d, dp_inter, bytes / sp / cp * (dp - 1.0) / dp, dp - 1.0);
        }
        t
    };
    // Split over ep, the experts are reduced over their own group, `edp`: one flat axis
    // of the ranks `ep` apart (so it crosses nodes as soon as the world does), not the
    // dense group's hierarchy.
    let edp_inter = crosses(c.ep as u64, ze as u64, gpn);
    let sync_time = |bytes: f64| -> f64 {
        if c.ep <= 1 {
            return group_time(bytes);
        }
        let share = expert / local;
        let experts = if ze > 1.0 {
            link_time(d, edp_inter, bytes * share * (ze - 1.0) / ze, ze - 1.0)
        } else {
            0.0
        };
        group_time(bytes * (1.0 - share)) + experts
    };
    let g = local * pb;
    // What overlaps compute (the reductions in the backward; at stage 3 the gathers
    // too) and what cannot: ZeRO-1/2's gather of the updated chunks runs after the last
    // update, with nothing left of the step to hide it.
    let (overlapped, after_updates) = if zd * ze <= 1.0 {
        (0.0, 0.0)
    } else {
        match c.zero {
            0 => (2.0 * sync_time(g), 0.0),
            1 => (2.0 * sync_time(g), sync_time(g)),
            2 => (sync_time(g) * mb, sync_time(g)),
            _ => (sync_time(g) * mb * 3.0, 0.0),
        }
    };
    comm += overlapped + after_updates;
    let backward = compute * 2.0 / 3.0;
    // What hides the reductions: at stage 3 the whole step (gathers and reductions run
    // beside every layer); at stage 2 each micro-batch's backward (its reduce_scatter);
    // below it the last micro-batch's backward, where the gradients are final.
    let hide = match c.zero {
        3.. => compute,
        2 => backward,
        _ => backward / mb,
    };
    exposed += (overlapped - 0.9 * hide).max(0.0)
        + after_updates
        + group_time(bucket.min(g)) * (zd > 1.0) as u8 as f64;
    if c.offload {
        let moved = tokens * saved_per_layer * (layers - 1.0) * 2.0 * mb;
        let t = moved / (d.host_gbps * 1e9);
        exposed += (t - 0.9 * compute).max(0.0);
    }
    if c.offload_optimizer {
        let updated = z1(dense, zd) + z1(expert, ze);
        exposed += host_update_exposed(pb, d, updated);
        comm += 2.0 * updated * pb / (d.host_gbps * 1e9);
    }
    let step = compute + exposed;
    let model_flops = matmul_model + attn_model;
    let time = TimeBreakdown {
        compute,
        exposed_comm: exposed,
        comm,
        step,
        tokens_per_s_per_gpu: all_tokens / step / world,
        mfu: model_flops / (step * world * s.peak_flops),
    };
    Scored {
        fits: memory.total <= s.device_memory && s.host_memory.is_none_or(|h| memory.host <= h),
        candidate: c.clone(),
        memory,
        time,
    }
}

/// How many times Ulysses repeats each of `kv` kv heads over `sp` ranks (1 when they split).
pub fn kv_repeat(kv: u64, sp: u64) -> u64 {
    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    if kv == 0 || kv.is_multiple_of(sp) {
        1
    } else {
        sp / gcd(kv, sp)
    }
}

/// One ring step of ring attention: the k/v block transfer and what of it the step's
/// block attention does not hide.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RingStep {
    /// Seconds to send one k/v (or dk/dv) block to the next rank.
    pub transfer: f64,
    /// Seconds of one step's block attention, forward (two c x c blocks of the zigzag
    /// layout: half the local square).
    pub block_forward: f64,
    pub exposed_forward: f64,
    pub exposed_backward: f64,
}

/// Prices one ring step: `kv_bytes` per rank per step (k and v of this rank's cp
/// portion), `local` query tokens and `heads` heads of `head_dim` per rank. The
/// backward's block costs 2.5x the forward's FLOPs (flash attention's backward), at the
/// backward's rate.
pub fn ring_step(
    d: &DeviceProfile,
    inter: bool,
    kv_bytes: f64,
    local: f64,
    heads: f64,
    head_dim: f64,
) -> RingStep {
    let transfer = link_time(d, inter, kv_bytes, 1.0);
    let flops = 4.0 * local * local * head_dim * heads / 2.0;
    // each of the local rows visits half the block's keys, paying its fixed work per block
    let rate =
        |backward| super::plan::cost::attention_tflops(d, backward, Some(local / 2.0)) * 1e12;
    let block_forward = flops / rate(false);
    let block_backward = 2.5 * flops / rate(true);
    RingStep {
        transfer,
        block_forward,
        exposed_forward: (transfer - block_forward).max(0.0),
        // the backward sends k/v and dk/dv: two transfers under the block's backward
        exposed_backward: (2.0 * transfer - block_backward).max(0.0),
    }
}

/// Every candidate scored: those that fit first by step time, then the rest by memory;
/// ties by the candidate's order.
pub fn search(m: &ModelShape, s: &SearchSpec) -> Vec<Scored> {
    let mut all: Vec<Scored> = enumerate(m, s).iter().map(|c| score(m, s, c)).collect();
    all.sort_by(|a, b| {
        b.fits
            .cmp(&a.fits)
            .then(if a.fits {
                a.time.step.total_cmp(&b.time.step)
            } else {
                a.memory.total.cmp(&b.memory.total)
            })
            .then(a.candidate.cmp(&b.candidate))
    });
    all
}

/// Whether a candidate fits `limit` bytes per rank once its analytic peak is scaled by
/// `calibration` (the compiled/analytic peak ratio `weft plan` has seen for its mesh).
pub fn fits_calibrated(s: &Scored, calibration: f64, limit: u64) -> bool {
    s.fits && s.memory.total as f64 * calibration.max(1.0) <= limit as f64
}

/// What the winner `best` is compared against in `weft plan`'s why line: the first
/// candidate of `ranked` (best first) on another mesh for which `fits` holds (compiled
/// and fitting, or not compiled and fitting as calibrated); none when no other mesh
/// fits, so the winner is never said to beat a plan that cannot run.
pub fn rival<'a>(
    ranked: &'a [Scored],
    best: &Candidate,
    fits: impl Fn(&Scored) -> bool,
) -> Option<&'a Scored> {
    let mesh = best.mesh();
    ranked
        .iter()
        .find(|s| s.candidate.mesh() != mesh && fits(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A search on H100s (80 GiB, 8 a node): `gpus`, `seq` tokens, global `batch`.
    fn h100_spec(gpus: u32, seq: u64, batch: u64) -> SearchSpec {
        SearchSpec {
            gpus,
            gpus_per_node: 8,
            seq,
            batch,
            device: crate::plan::profile::preset("h100").unwrap(),
            device_memory: 80 << 30,
            host_memory: None,
            peak_flops: 989e12,
            grad_outputs: false,
        }
    }

    /// One rank, no ZeRO, one micro-batch: `checkpoint` and `offload` as given.
    fn one_rank(checkpoint: &'static str, offload: bool, fused_loss: bool) -> Candidate {
        Candidate {
            checkpoint,
            offload,
            fused_loss,
            ..Default::default()
        }
    }

    fn llama8b() -> ModelShape {
        ModelShape {
            name: "llama3-8b".into(),
            layers: 32,
            hidden: 4096,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            ffn: 14336,
            vocab: 128256,
            moe_layers: 0,
            experts: 0,
            top_k: 0,
            expert_ffn: 0,
            tied: false,
            param_bytes: 2,
            layer_windows: Vec::new(),
            single_norms: true,
            logit_softcap: false,
            expert_saved: 3,
        }
    }

    /// Gradients at the activations' peak: a tied vocabulary's only where each other one
    /// dies at its update; whole where the step returns them or micro-batches accumulate
    /// them. Gradient buckets are in flight only over a data-parallel group, and the
    /// unfused loss on one tp rank holds one bf16 logits tensor (its gradient in place).
    #[test]
    fn gradients_and_logits_are_priced_as_the_step_holds_them() {
        let mut tied = llama8b();
        tied.tied = true;
        let one = h100_spec(1, 4096, 1);
        let c = one_rank("none", false, false);
        let vocab_rows = (tied.vocab * tied.hidden * 2) as u64;
        let logits = 4096 * tied.vocab * 2;
        let s = score(&tied, &one, &c);
        assert_eq!(s.memory.grads, vocab_rows);
        assert_eq!(s.memory.transient, logits, "{s:?}");
        assert_eq!(score(&llama8b(), &one, &c).memory.grads, 0);
        let whole = (tied.params() * 2) as u64;
        let returned = SearchSpec {
            grad_outputs: true,
            ..one.clone()
        };
        assert_eq!(score(&tied, &returned, &c).memory.grads, whole);
        let accumulated = Candidate {
            micro_batches: 2,
            ..c.clone()
        };
        assert_eq!(score(&tied, &one, &accumulated).memory.grads, whole);
        // Over dp=2 two buckets are in flight besides the logits (half the tokens).
        let dp2 = Candidate { dp: 2, ..c.clone() };
        let s2 = score(&tied, &h100_spec(2, 4096, 2), &dp2);
        assert_eq!(s2.memory.transient, logits + 2 * 500_000_000);
        // Over tp the vocabulary-parallel loss keeps f32 logits and their gradient.
        let tp2 = Candidate { tp: 2, ..c };
        let s3 = score(&tied, &h100_spec(2, 4096, 1), &tp2);
        assert!(s3.memory.transient >= 4096 * tied.vocab / 2 * 8, "{s3:?}");
    }

    /// Selective checkpointing recomputes every layer's projections and MLP: a third of
    /// the layers' matmul FLOPs on top of the step (the lm_head is not recomputed).
    #[test]
    fn selective_recompute_is_priced_as_the_layers_forward() {
        let m = llama8b();
        let spec = h100_spec(1, 4096, 1);
        let c = |checkpoint, offload| one_rank(checkpoint, offload, true);
        let none = score(&m, &spec, &c("none", false));
        let sel = score(&m, &spec, &c("selective", false));
        let tokens = 4096.0;
        let layers_matmul = 6.0 * (m.active_params() - m.vocab * m.hidden) as f64 * tokens;
        let expected = layers_matmul / 3.0 / (spec.device.matmul_tflops * 1e12);
        let extra = sel.time.compute - none.time.compute;
        assert!((extra / expected - 1.0).abs() < 1e-9, "{extra} {expected}");
        assert!(score(&m, &spec, &c("selective", true)).time.compute < sel.time.compute);
    }

    /// The lm_head's GEMM is priced whether or not it shares the embedding's weight.
    #[test]
    fn a_tied_head_costs_its_gemm() {
        let mut tied = llama8b();
        tied.tied = true;
        let spec = h100_spec(1, 4096, 1);
        let c = one_rank("none", false, false);
        let (a, b) = (score(&tied, &spec, &c), score(&llama8b(), &spec, &c));
        assert!(
            (a.time.compute - b.time.compute).abs() < 1e-12,
            "{a:?} {b:?}"
        );
        assert!(a.memory.params < b.memory.params);
    }

    #[test]
    fn a_sliding_window_shortens_the_ring_in_the_price() {
        let spec = h100_spec(16, 262144, 1);
        let c = Candidate {
            cp: 16,
            dp: 1,
            sp: 1,
            tp: 1,
            ep: 1,
            zero: 3,
            checkpoint: "full",
            offload: false,
            offload_optimizer: false,
            fused_loss: true,
            micro_batches: 1,
            cp_kv: CpKv::Ring,
        };
        let full = llama8b();
        // Every other layer windowed to 4096 keys (chunks of 8192 tokens): its ring takes
        // 1 step forward and 1 backward instead of 15.
        let mut windowed = llama8b();
        windowed.layer_windows = (0..32).map(|i| (i % 2 == 0).then_some(4096)).collect();
        assert_eq!(window_ring_steps(Some(4096), 262144, 16), 2);
        assert_eq!(window_ring_steps(None, 262144, 16), 15);
        // A window as long as the sequence needs every step.
        assert_eq!(window_ring_steps(Some(262144), 262144, 16), 15);
        let mut all = llama8b();
        all.layer_windows = vec![Some(4096); 32];
        let (a, b) = (score(&full, &spec, &c), score(&windowed, &spec, &c));
        let every = score(&all, &spec, &c);
        assert!(b.time.comm < a.time.comm, "{a:?} {b:?}");
        assert!(b.time.exposed_comm <= a.time.exposed_comm);
        // What a windowed layer saves is the same for each: twice the layers, twice the
        // saving.
        let (half, whole) = (a.time.comm - b.time.comm, a.time.comm - every.time.comm);
        assert!((whole - 2.0 * half).abs() <= 1e-9 * whole, "{half} {whole}");
        assert_eq!(b.memory.total, a.memory.total);
    }

    /// cp=8 alone with ZeRO-3, one micro-batch, the fused loss.
    fn cp8(cp_kv: CpKv, checkpoint: &'static str) -> Candidate {
        Candidate {
            cp: 8,
            dp: 1,
            sp: 1,
            tp: 1,
            ep: 1,
            zero: 3,
            checkpoint,
            offload: false,
            offload_optimizer: false,
            fused_loss: true,
            micro_batches: 1,
            cp_kv,
        }
    }

    /// Every ring step of a layer pays its kernel launches: on 8 GPUs, cp=8 and
    /// dp=2,cp=4 do the same work per rank, and cp=8's compute is longer by exactly
    /// the launches of its 4 more steps in every layer (with the attention rows' fixed
    /// work, which cp=8's shorter blocks pay more often, priced at 0; with it, cp=8
    /// pays more again).
    #[test]
    fn ring_steps_pay_their_kernel_launches() {
        let mut spec = h100_spec(8, 131072, 2);
        let with_rows = spec.clone();
        spec.device.attention_row_keys = 0.0;
        let m = llama8b();
        let cp8 = cp8(CpKv::Ring, "none");
        let cp4 = Candidate {
            dp: 2,
            cp: 4,
            ..cp8.clone()
        };
        let (a, b) = (score(&m, &spec, &cp8), score(&m, &spec, &cp4));
        let launches =
            m.layers as f64 * 4.0 * RING_STEP_KERNELS * spec.device.kernel_overhead_us * 1e-6;
        let extra = a.time.compute - b.time.compute;
        assert!(
            (extra - launches).abs() < 1e-9 * launches.max(1.0),
            "{extra} vs {launches}"
        );
        let (a, b) = (score(&m, &with_rows, &cp8), score(&m, &with_rows, &cp4));
        assert!(
            a.time.compute - b.time.compute > launches * 1.01,
            "{} vs {launches}",
            a.time.compute - b.time.compute
        );
    }

    /// The all-gather variant is priced as what it is: the whole sequence's k/v and
    /// dk/dv held (`2 cp` blocks against the ring's 4), its collectives exposed, and the
    /// attention's masked half computed; both variants are searched on a cp mesh and
    /// only the ring without one.
    #[test]
    fn the_allgather_variant_is_priced_unoverlapped_with_the_whole_kv() {
        let spec = h100_spec(8, 131072, 1);
        let m = llama8b();
        let c = |cp_kv| cp8(cp_kv, "none");
        let (ring, gather) = (
            score(&m, &spec, &c(CpKv::Ring)),
            score(&m, &spec, &c(CpKv::AllGather)),
        );
        // ring_kv: this rank's 16384 tokens x (k, v) x bf16 x 8 kv heads x 128.
        let block = 16384.0 * 2.0 * 2.0 * 1024.0;
        let extra = (2.0 * 8.0 - 4.0) * block;
        assert_eq!(
            gather.memory.activations - ring.memory.activations,
            extra as u64
        );
        assert!(
            gather.time.compute > ring.time.compute,
            "{ring:?} {gather:?}"
        );
        // Every all-gather byte is exposed.
        assert!(gather.time.exposed_comm > ring.time.exposed_comm);
        assert_eq!(
            gather.candidate.flags(),
            format!("{} --cp-kv allgather", ring.candidate.flags())
        );
        let all = enumerate(&m, &spec);
        assert!(all.iter().any(|c| c.cp > 1 && c.cp_kv == CpKv::AllGather));
        assert!(all.iter().all(|c| c.cp > 1 || c.cp_kv == CpKv::Ring));
    }

    /// The all-gather variant's copies (k/v to and from the sequence-first layout its
    /// collectives use, the gathered k/v and the dk/dv before the reduce_scatter) are
    /// priced at HBM bandwidth, forward, backward and in full checkpointing's
    /// recompute: halving the bandwidth adds exactly their time to the variant's
    /// compute, and nothing to the ring's.
    #[test]
    fn the_allgather_copies_are_priced_at_hbm_bandwidth() {
        let spec = h100_spec(8, 131072, 1);
        let mut slow = spec.clone();
        slow.device.hbm_gbps /= 2.0;
        let m = llama8b();
        for (checkpoint, redo) in [("none", 0.0), ("full", 1.0)] {
            let c = |cp_kv| cp8(cp_kv, checkpoint);
            // This rank's 16384 tokens x (k, v) x bf16 x 8 kv heads x 128, over 32 layers:
            // k/v forward, again backward (and to recompute), dk/dv, each cp + 1 blocks
            // read and written.
            let kv = 16384.0 * 2.0 * 2.0 * 1024.0;
            let copies = 32.0 * 2.0 * (3.0 + redo) * (8.0 + 1.0) * kv;
            let t = copies / (spec.device.hbm_gbps * 1e9);
            let grow = |cp_kv| {
                score(&m, &slow, &c(cp_kv)).time.compute - score(&m, &spec, &c(cp_kv)).time.compute
            };
            let (gather, ring) = (grow(CpKv::AllGather), grow(CpKv::Ring));
            assert!(
                (gather - t).abs() <= 1e-9 * t,
                "{checkpoint}: {gather} vs {t}"
            );
            assert_eq!(ring, 0.0, "{checkpoint}");
            assert!(t > 0.0);
        }
    }

    #[test]
    fn parameter_counts_match_the_published_sizes() {
        let p = llama8b().params() as f64 / 1e9;
        assert!((p - 8.03).abs() < 0.02, "{p}");
    }

    #[test]
    fn zero_over_dp_x_sp_shrinks_the_state_and_the_search_is_deterministic() {
        let spec = h100_spec(8, 131072, 8);
        let m = llama8b();
        let c = |zero| Candidate {
            cp: 1,
            dp: 1,
            sp: 8,
            tp: 1,
            ep: 1,
            zero,
            checkpoint: "full",
            offload: false,
            offload_optimizer: false,
            fused_loss: true,
            micro_batches: 8,
            cp_kv: CpKv::Ring,
        };
        let (a, b) = (score(&m, &spec, &c(0)), score(&m, &spec, &c(3)));
        assert!(b.memory.optimizer * 7 < a.memory.optimizer, "{a:?} {b:?}");
        assert!(b.memory.params * 7 < a.memory.params);
        let r1 = search(&m, &spec);
        let r2 = search(&m, &spec);
        assert!(r1[0].fits);
        assert_eq!(r1[0].candidate, r2[0].candidate);
    }

    /// `--offload` under full or no checkpointing sends every layer's saved values but
    /// the last to the host; under selective it sends only what selective would
    /// recompute, so the residual stream (2 x hidden a token, bf16) of every layer stays
    /// on the device (what the compiled llama3-70b plans hold: 166 GiB of it at 65536
    /// tokens a rank, where the model once said 32 GiB in all).
    #[test]
    fn selective_offload_keeps_every_layers_residual_stream_on_the_device() {
        let spec = h100_spec(8, 32768, 8);
        let m = llama8b();
        let c = |checkpoint, offload| Candidate {
            cp: 1,
            dp: 8,
            sp: 1,
            tp: 1,
            ep: 1,
            zero: 3,
            checkpoint,
            offload,
            offload_optimizer: false,
            fused_loss: true,
            micro_batches: 1,
            cp_kv: CpKv::Ring,
        };
        let act = |ck, off| score(&m, &spec, &c(ck, off)).memory.activations as f64;
        let tokens = 32768.0;
        let residuals = tokens * 2.0 * 2.0 * m.hidden as f64 * (m.layers - 1) as f64;
        let (sel_off, full_off) = (act("selective", true), act("full", true));
        assert!(
            sel_off - full_off >= residuals,
            "{sel_off} {full_off} {residuals}"
        );
        // What offload takes under selective is what selective would recompute: it saves
        // recompute, not device memory (the 1.24B's plans at 16384: 14.16 GiB with
        // offload, 13.58 without).
        assert!(sel_off >= act("selective", false));
    }

    /// Below ZeRO-3 the gradients are final, and their reductions run, only in the last
    /// micro-batch's backward: with more micro-batches less of the backward hides them
    /// (at stage 2 each micro-batch reduce-scatters in its own backward).
    #[test]
    fn reductions_hide_under_the_last_micro_batch_only() {
        let m = llama8b();
        // 64 GPUs over 8 nodes, short sequences: the gradient traffic rivals the backward.
        let spec = h100_spec(64, 1024, 256);
        let exposed = |zero: u8, micro: u32| {
            let c = Candidate {
                dp: 64,
                zero,
                micro_batches: micro,
                ..Default::default()
            };
            let s = score(&m, &spec, &c);
            s.time.exposed_comm
        };
        assert!(
            exposed(0, 4) > exposed(0, 1),
            "{} vs {}",
            exposed(0, 4),
            exposed(0, 1)
        );
        assert!(exposed(1, 4) > exposed(1, 1));
    }

    /// The 1.24B Llama-3-style model (`llama3.2-1b`).
    fn llama1b() -> ModelShape {
        ModelShape {
            name: "llama3.2-1b".into(),
            layers: 16,
            hidden: 2048,
            heads: 32,
            kv_heads: 8,
            head_dim: 64,
            ffn: 8192,
            tied: true,
            ..llama8b()
        }
    }

    /// `none` with `--offload` sends every layer's saved values to the host, and what the
    /// link has not carried by the time the next layer's are made waits on the device:
    /// the backlog grows by the excess every layer, and vanishes on a link fast enough.
    #[test]
    fn offload_without_recompute_holds_what_the_link_has_not_carried() {
        let m = llama1b();
        let spec = h100_spec(1, 16384, 1);
        let act = |spec: &SearchSpec, ck| {
            score(&m, spec, &one_rank(ck, true, true))
                .memory
                .activations as f64
        };
        let fast = SearchSpec {
            device: DeviceProfile {
                host_gbps: 1e6,
                ..spec.device.clone()
            },
            ..spec.clone()
        };
        let per_layer = score(&m, &spec, &one_rank("none", false, true))
            .memory
            .activations as f64
            / (m.layers + 1) as f64;
        let carried = spec.device.host_gbps * 1e9 * forward_layer_s(&m, &spec, &spec.device);
        assert!(
            carried > 0.0 && carried < per_layer,
            "{carried} {per_layer}"
        );
        let backlog = (per_layer - carried) * (m.layers - 1) as f64;
        let (slow, quick) = (act(&spec, "none"), act(&fast, "none"));
        assert!(
            ((slow - quick) / backlog - 1.0).abs() < 1e-9,
            "{slow} {quick} {backlog}"
        );
        assert!(
            (quick / per_layer - 2.0).abs() < 1e-9,
            "{quick} {per_layer}"
        );
        // Selective + offload sends only what the link carries in time: no backlog.
        assert_eq!(act(&spec, "selective"), act(&fast, "selective"));
    }

    /// Under Ulysses selective checkpointing also keeps what attention's backward reads
    /// in the head-sharded layout (q, k and v after their all_to_all, the output before
    /// its all_to_all back), in every layer, with or without `--offload`; without
    /// checkpointing, q, k and v after their all_to_all. Both on top of what a
    /// data-parallel rank with as many tokens keeps.
    #[test]
    fn ulysses_keeps_the_head_sharded_attention_operands() {
        let m = llama8b();
        let spec = h100_spec(8, 32768, 4);
        let c = |dp, sp, checkpoint, offload| Candidate {
            dp,
            sp,
            zero: 3,
            checkpoint,
            offload,
            ..Default::default()
        };
        let act = |dp, sp, ck, offload| {
            score(&m, &spec, &c(dp, sp, ck, offload)).memory.activations as f64
        };
        let tokens = 4.0 * 32768.0 / 8.0;
        let (q, kv) = (
            (m.heads * m.head_dim) as f64,
            (m.kv_heads * m.head_dim) as f64,
        );
        for (checkpoint, offload, per_token) in [
            ("selective", false, 2.0 * q + 2.0 * kv),
            ("selective", true, 2.0 * q + 2.0 * kv),
            ("none", false, q + 2.0 * kv),
        ] {
            let kept = tokens * 2.0 * per_token * m.layers as f64;
            let extra = act(2, 4, checkpoint, offload) - act(8, 1, checkpoint, offload);
            assert!(
                (extra / kept - 1.0).abs() < 1e-9,
                "{checkpoint} offload {offload}: {extra} against {kept}"
            );
        }
    }

    fn mixtral() -> ModelShape {
        ModelShape {
            name: "mixtral-8x7b".into(),
            vocab: 32000,
            moe_layers: 32,
            experts: 8,
            top_k: 2,
            expert_ffn: 14336,
            ..llama8b()
        }
    }

    /// Mixtral over dp (ep as given), no checkpointing, ZeRO `zero`.
    fn moe_rank(dp: u32, ep: u32, zero: u8) -> Candidate {
        Candidate {
            dp,
            ep,
            zero,
            ..Default::default()
        }
    }

    /// ZeRO-3 shards the stacked expert weights over their group whatever the number of
    /// local experts: by the experts where there are as many as ranks, else by the rows
    /// of dim 1 (mixtral on 32 GPUs without ep kept 84 GiB of experts a rank before).
    #[test]
    fn stacked_experts_are_sharded_under_zero3_past_one_expert_a_rank() {
        let m = mixtral();
        let spec = h100_spec(32, 4096, 32);
        let params = |dp, ep| score(&m, &spec, &moe_rank(dp, ep, 3)).memory.params as f64;
        let (dense, expert) = (m.dense_params() as f64, m.expert_params() as f64);
        let sharded = 2.0 * (dense + expert) / 32.0;
        assert!(
            (params(32, 1) / sharded - 1.0).abs() < 1e-9,
            "{}",
            params(32, 1)
        );
        // ep=4: two experts a rank, over an expert-data-parallel group of 8.
        let sharded = 2.0 * (dense / 32.0 + expert / 4.0 / 8.0);
        assert!((params(32, 4) / sharded - 1.0).abs() < 1e-9);
        // On 4 ranks each takes two of the eight.
        let spec4 = h100_spec(4, 4096, 4);
        let p4 = score(&m, &spec4, &moe_rank(4, 1, 3)).memory.params as f64;
        assert!(
            (p4 / (2.0 * (dense + expert) / 4.0) - 1.0).abs() < 1e-9,
            "{p4}"
        );
    }

    /// Split over ep, the experts' gradients and ZeRO gathers go over `edp`, one flat
    /// axis of ranks `ep` apart that crosses nodes here, not over the dense group's
    /// hierarchy (sp inside a node, then dp): at dp=8,sp=4,ep=2 on nodes of 8, ZeRO-2's
    /// reduce_scatter and gather each move 15/16 of the local experts over the
    /// inter-node link (the compiled plan: 3.0 s a step, of which 2.0 s exposed
    /// communication; priced 0.96 s when the experts took the dense hierarchy).
    #[test]
    fn expert_gradients_cross_nodes_over_their_own_group() {
        let m = mixtral();
        let spec = h100_spec(32, 4096, 32);
        let c = Candidate {
            dp: 8,
            sp: 4,
            ep: 2,
            zero: 2,
            checkpoint: "full",
            ..Default::default()
        };
        let t = score(&m, &spec, &c).time;
        let d = &spec.device;
        let experts = 2.0 * m.expert_params() as f64 / 2.0 * 15.0 / 16.0;
        let floor = 2.0 * experts / (d.inter_node_gbps * 1e9);
        assert!(t.comm >= floor, "{} < {floor}", t.comm);
        assert!(t.exposed_comm >= floor - 0.9 * t.compute * 2.0 / 3.0);
    }

    /// ZeRO-1's gather of the updated chunks runs after the last update: where the
    /// backward hides the all-reduce, none of the gather hides (on one node, a batch
    /// large enough that the link keeps up).
    #[test]
    fn the_gather_after_the_updates_is_exposed() {
        let m = llama8b();
        let spec = h100_spec(8, 4096, 64);
        let time = |zero| {
            let c = Candidate {
                dp: 8,
                zero,
                checkpoint: "full",
                ..Default::default()
            };
            score(&m, &spec, &c).time
        };
        let (t0, t1) = (time(0), time(1));
        let gather = t1.comm - t0.comm;
        assert!(
            gather > 0.0 && t0.exposed_comm < 0.5 * gather,
            "{t0:?} {t1:?}"
        );
        assert!(
            (t1.exposed_comm - t0.exposed_comm - gather).abs() < 1e-9,
            "{t0:?} {t1:?}"
        );
    }

    /// Expert parallelism's received rows are sized at their bound, every rank's routed
    /// rows: the experts' gate, up and product and the received rows grow with `ep` in
    /// every layer a step without checkpointing keeps, and in the one it works on.
    #[test]
    fn expert_parallel_buffers_are_sized_for_every_ranks_rows() {
        let m = mixtral();
        let spec = h100_spec(32, 4096, 32);
        let act = |ep| score(&m, &spec, &moe_rank(32, ep, 1)).memory.activations as f64;
        let tokens = 4096.0;
        let k = m.top_k as f64;
        let per_ep = 2.0 * (3.0 * k * m.expert_ffn as f64 + k * m.hidden as f64);
        let want = tokens * (m.layers + 1) as f64 * per_ep * (8.0 - 2.0);
        assert!(((act(8) - act(2)) / want - 1.0).abs() < 1e-9);
    }

    fn scored(dp: u32, cp: u32, total: u64, fits: bool, step: f64) -> Scored {
        Scored {
            candidate: Candidate {
                dp,
                cp,
                sp: 1,
                tp: 1,
                ep: 1,
                zero: 3,
                checkpoint: "selective",
                offload: false,
                offload_optimizer: false,
                fused_loss: true,
                micro_batches: 1,
                cp_kv: CpKv::Ring,
            },
            memory: MemoryBreakdown {
                total,
                ..Default::default()
            },
            time: TimeBreakdown {
                step,
                ..Default::default()
            },
            fits,
        }
    }

    /// The why line's rival fits: a faster mesh whose analytic 60 GiB comes out at 1.5x
    /// compiled (90 GiB > 80) is passed over for the next mesh that fits; with none
    /// left, there is no rival.
    #[test]
    fn the_rival_of_the_winner_is_a_mesh_that_fits() {
        let gib = 1u64 << 30;
        let limit = 80 * gib;
        let best = scored(8, 4, 50 * gib, true, 1.0);
        let ranked = vec![
            best.clone(),
            // same mesh as the winner, other options: not a rival
            scored(8, 4, 40 * gib, true, 1.1),
            scored(4, 8, 60 * gib, true, 1.2),
            scored(16, 2, 70 * gib, true, 1.3),
            scored(32, 1, 90 * gib, false, 1.4),
        ];
        let calibration = |s: &Scored| if s.candidate.cp == 8 { 1.5 } else { 1.0 };
        assert!(!fits_calibrated(&ranked[2], 1.5, limit));
        assert!(fits_calibrated(&ranked[2], 1.0, limit));
        assert!(!fits_calibrated(&ranked[4], 1.0, limit));
        let r = rival(&ranked, &best.candidate, |s| {
            fits_calibrated(s, calibration(s), limit)
        });
        assert_eq!(
            r.map(|s| s.candidate.mesh()),
            Some("dp=16,cp=2".to_string())
        );
        let none = rival(&ranked[..3], &best.candidate, |s| {
            fits_calibrated(s, calibration(s), limit)
        });
        assert_eq!(none, None);
    }

    /// `--offload-optimizer` on llama3-8b over 8 GPUs at ZeRO-1 (dp=8): each rank updates
    /// 8.03e9 / 8 = 1.004e9 parameters a step. Host AdamW at 0.25e9 params/s: 4.015 s;
    /// the chunks out and back, 2 x 1.004e9 x 2 B over the h100 profile's 50 GB/s: 0.080 s. All of it is
    /// exposed (the plan's backward waits for each bucket's update), once a step
    /// whatever the micro-batch count.
    #[test]
    fn the_host_update_is_exposed_once_a_step() {
        let spec = h100_spec(8, 4096, 64);
        let m = llama8b();
        let c = |offload_optimizer, micro_batches| Candidate {
            cp: 1,
            dp: 8,
            sp: 1,
            tp: 1,
            ep: 1,
            zero: 1,
            checkpoint: "full",
            offload: false,
            offload_optimizer,
            fused_loss: true,
            micro_batches,
            cp_kv: CpKv::Ring,
        };
        let updated = m.params() as f64 / 8.0;
        let by_hand = updated / 2.0e9 + 2.0 * updated * 2.0 / 50e9;
        assert_eq!(spec.device.host_adam_params_per_s, 2.0e9);
        assert!((by_hand - 0.582).abs() < 0.01, "{by_hand}");
        for mb in [1, 4] {
            let (on, off) = (
                score(&m, &spec, &c(true, mb)),
                score(&m, &spec, &c(false, mb)),
            );
            // Only the host term differs between the two.
            let added = on.time.exposed_comm - off.time.exposed_comm;
            assert!(
                (added - by_hand).abs() < 1e-6 * by_hand,
                "mb {mb}: {added} vs {by_hand}"
            );
        }
    }
}
