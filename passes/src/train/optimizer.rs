//! `optimizer`: the parameter update as graph ops, after `grad-sync`.
//!
//! For every parameter with a `grad.<name>` output: `adamw` (torch.optim.AdamW) or
//! `sgd` on an f32 copy: the parameter itself when it is f32, else an f32 master
//! weight `optim.master.<name>` (mixed precision: the bf16 parameter is the master
//! rounded). Without master weights (`master_weights` off) a low-precision parameter is
//! updated in its own dtype with states in that dtype, as `torch.optim.AdamW` runs on a
//! bf16 model. Optimizer state are parameters of the step program, `optim.m.<name>`,
//! `optim.v.<name>` (AdamW) or `optim.buf.<name>` (SGD with momentum), zero before the
//! first step; the 1-based step number is the input `optim.step`. The step returns
//! `param.<name>` (the updated parameter, in its dtype) and every updated state under
//! its own name, so a driver feeds them back (see `weft run`).
//!
//! ZeRO-1 (`zero1`): the state and master weights are sharded over the parameter's
//! data-parallel group (`zero::ZeroGroup`: dp x sp for dense parameters, edp for
//! experts, of `Z` ranks), also for a parameter tp or ep split first (its local shard
//! is what is sharded). Each rank flattens the parameter and its gradient, updates its
//! piece (`crate::zero_split`: near-even over the group's flattened ranks, no padding
//! in stored state) and the pieces are `all_gather`ed back into the parameter; the
//! state is flat, partitioned (the parameter's own split axes as blocks of the flat
//! tensor, then `zero <axis> dim=0` per group axis where the split is even, or one
//! group partition `zero dp*sp dim=0 [..]` over all of them where it is not) and
//! returned per rank, split the same way. After `grad-sync`'s ZeRO-2 `reduce_scatter`
//! the piece of the gradient is the `grad_shard.<name>` it returns (no gather, no
//! slice). A parameter whose local size differs per tp rank (an uneven tp split) is
//! sharded too, each tp rank its own size over the group (its flat state one group
//! partition over tp and the group, `crate::zero_split`; at stage 3 its rows where
//! tp split another dim). A parameter with fewer
//! elements than ranks keeps its state whole (`unsharded_uneven`).
//!
//! Optimizer offload (`offload_optimizer`, ZeRO-Offload): every float parameter gets
//! an f32 master weight, and the master weights and moments (sharded as above) live in
//! pinned host memory. The gradient chunk, in the parameter's dtype, is copied to the
//! host (`offload`), `host_adamw` updates it on the host stream and rounds the new
//! master to the parameter's dtype, and `reload` brings that back for the gather (or,
//! at stage 3, as the rank's rows). The values are those of the device update: the
//! host widens the gradient exactly as the device `cast` does.
//!
//! Placement: each parameter's update runs inside the backward, right after its
//! gradient is final (its grad-sync bucket reduced) and the old weight's last read, as
//! DeepSpeed's overlapped reduction and PyTorch's optimizer-in-backward do; AdamW and
//! SGD are per parameter (there is no global gradient-norm clipping to wait for). A
//! step compiled with `grad_outputs` off no longer returns `grad.*`, so each gradient
//! is freed once its update has read it instead of living to the end of the step.

use crate::pass::{Pass, PassContext, PassError, PassResult};
use crate::training::Optimizer;
use crate::util::build_error;
use crate::zero::{ZeroGroup, ZeroSplit};
use weft_ir::{
    role, At, DType, Graph, Node, NodeMeta, Op, Partition, Provenance, Role, TensorType, Value,
    ValueName, ValueRole,
};

pub struct OptimizerPass;

pub const NAME: &str = "optimizer";

/// The step-number input.
pub const STEP_INPUT: &str = weft_ir::role::STEP_NAME;

impl Pass for OptimizerPass {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "AdamW or SGD update of every parameter after grad-sync, f32 master weights and states for low-precision params, ZeRO-1 sharding over dp"
    }
    fn requires(&self) -> &'static [&'static str] {
        &[crate::autodiff::NAME]
    }
    fn run(&self, g: &mut Graph, cx: &PassContext) -> Result<PassResult, PassError> {
        let mut res = PassResult::unchanged();
        for k in [
            "params",
            "master_weights",
            "state_tensors",
            "sharded",
            "unsharded_uneven",
            "stage3_params",
            "stage3_whole",
            "dead_nodes",
            "updates_deferred",
            "deferred_held_bytes",
        ] {
            res.count(k, 0);
        }
        let Some(opt) = cx.options.train.optimizer else {
            return Ok(res);
        };
        if g.outputs()
            .iter()
            .any(|(n, _)| ValueRole::of(n) == Some(ValueRole::UpdatedParam))
        {
            return Ok(res); // already has an update
        }
        let zero = cx.options.train.zero1;
        let offload = cx.options.train.offload_optimizer;
        if offload {
            let why = match opt {
                Optimizer::Sgd { .. } => Some("the host update is AdamW; SGD runs on the device"),
                _ if !cx.options.train.master_weights => {
                    Some("the host keeps f32 master weights; drop --no-master-weights")
                }
                _ => None,
            };
            if let Some(why) = why {
                return Err(PassError::rewrite(
                    NAME,
                    "`--offload-optimizer` cannot be applied".to_string(),
                    "the training options".to_string(),
                    why.to_string(),
                ));
            }
        }
        let warmup = cx.options.train.warmup_steps.map(i64::from);
        if warmup.is_some() && matches!(opt, Optimizer::Sgd { .. }) {
            return Err(PassError::rewrite(
                NAME,
                "`--warmup-steps` cannot be applied".to_string(),
                "the training options".to_string(),
                "the learning-rate warmup is implemented for AdamW; SGD has none".to_string(),
            ));
        }
        let stream = cx.options.train.stream_optimizer_state;
        if stream && offload {
            return Err(PassError::rewrite(
                NAME,
                "`--stream-optimizer-state` cannot be applied".to_string(),
                "the training options".to_string(),
                "`--offload-optimizer` already keeps the state in host memory (and updates it there); give one of the two".to_string(),
            ));
        }
        let mut w = Writer {
            g: &mut *g,
            meta: NodeMeta::default(),
            warmup,
            stream,
            state_reloads: Vec::new(),
        };
        w.meta.provenance = Some(Provenance {
            pass: NAME.into(),
            reason: "the step number (1-based)".into(),
        });
        let step = w.op(
            Op::Input {
                name: STEP_INPUT.into(),
                role: Role::Other,
                ty: TensorType::scalar(DType::F32),
            },
            &[],
        )?;
        let step_node = w.g.def(step);
        let mut done = std::collections::BTreeSet::new();
        let mut groups: Vec<(Value, Vec<Node>)> = Vec::new();
        let mut updated = Vec::new();
        let mut gather_chains = Vec::new();
        let mut param_uses = if cx.options.train.zero3 {
            Some(crate::zero::ParamUses::of(w.g))
        } else {
            None
        };
        for (name, pv) in w.g.params() {
            if !done.insert(name.clone()) {
                continue;
            }
            let Some(gv) = w.g.output(&role::grad_name(&name)) else {
                continue;
            };
            let pty = w.g.ty(pv).clone();
            if !pty.dtype.is_float() {
                continue;
            }
            // ZeRO-1 shards the (local) parameter over its data-parallel group, by one
            // split computed here and by grad-sync alike (rows when ZeRO-3 shards it).
            let group = ZeroGroup::of_param(w.g, &name);
            let split = if zero {
                crate::zero::param_split(&w.g.mesh, &pty, &group, cx.options.train.zero3)
            } else {
                None
            };
            if zero && split.is_none() && !group.is_empty() {
                res.count("unsharded_uneven", 1);
            }
            w.meta.source = w.g.node(w.g.def(pv)).meta.source.clone();
            // ZeRO-3: the parameter itself becomes this rank's rows, gathered per use.
            let mut pv = pv;
            let mut stage3 = false;
            if cx.options.train.zero3 {
                match &split {
                    Some(s) if s.rows => {
                        let uses = param_uses
                            .as_mut()
                            .and_then(|u| u.take(&name))
                            .unwrap_or_default();
                        pv = crate::zero::shard_param(
                            w.g,
                            NAME,
                            &name,
                            s,
                            uses,
                            &mut gather_chains,
                        )?;
                        stage3 = true;
                        res.count("stage3_params", 1);
                    }
                    Some(_) => {
                        res.count("stage3_whole", 1);
                    }
                    None => {}
                }
            }
            let first = w.g.nodes().len();
            let master = cx.options.train.master_weights;
            let new = w.update(
                &name,
                pv,
                &pty,
                stage3,
                gv,
                step,
                &opt,
                split.as_ref(),
                master,
                offload,
                &mut res,
            )?;
            groups.push((pv, w.g.nodes()[first..].to_vec()));
            w.g.set_output(&role::updated_name(&name), new);
            updated.push(name);
            res.count("params", 1);
        }
        let state_reloads = std::mem::take(&mut w.state_reloads);
        if !cx.options.train.grad_outputs {
            for name in &updated {
                g.remove_output(&role::grad_name(name));
            }
            // What only fed those outputs (grad-sync's gather of ZeRO shards).
            res.count("dead_nodes", remove_dead(g, crate::grad_sync::NAME) as u64);
        }
        crate::zero::prefetch_gathers(g, &gather_chains);
        place_in_backward(g, step_node, &groups, cx.options.train.reduce_scatter);
        if g.mesh.world_size() > 1 {
            let b = crate::memory::bindings(g, &cx.options.train);
            let d = crate::train::update_timing::defer_waiting_updates(
                g,
                &b,
                &cx.options.train.device.0,
                cx.options.train.defer_updates,
            );
            res.count("updates_deferred", d.moved as u64);
            res.count("deferred_held_bytes", d.held_peak_bytes);
        }
        if !state_reloads.is_empty() {
            let b = crate::memory::bindings(g, &cx.options.train);
            let s =
                crate::stream_state::schedule(g, &state_reloads, &b, &cx.options.train.device.0);
            res.count("prefetched_states", s.prefetched as u64);
            res.count("states_kept_on_device", s.kept_on_device as u64);
        }
        res.changed = true;
        Ok(res)
    }
}

/// Moves each parameter's update (its `groups` entry, appended at the end) to right
/// after the last node it waits for: its reduced gradient (the end of its grad-sync
/// bucket, or the backward node that finishes it) and the last read of the old
/// parameter (so a runtime may update in place). Updates then run inside the backward
/// as their buckets complete, as DeepSpeed's overlapped reduction and PyTorch's
/// optimizer-in-backward do, and a gradient the step does not return dies there. With
/// micro-batches the gradients are complete only in the last micro-batch's backward,
/// which is where their reductions and so the updates are. The step number input
/// moves to the start. Values are unchanged: only the program order moves.
fn place_in_backward(g: &mut Graph, step: Node, groups: &[(Value, Vec<Node>)], late: bool) {
    let order = g.nodes().to_vec();
    let pos: std::collections::HashMap<Node, usize> =
        order.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut group_of: std::collections::HashMap<Node, usize> = std::collections::HashMap::new();
    for (i, (_, ns)) in groups.iter().enumerate() {
        for n in ns {
            group_of.insert(*n, i);
        }
    }
    // The last reader of each old parameter outside the updates.
    let mut last_read: std::collections::HashMap<Value, usize> = std::collections::HashMap::new();
    for (i, &n) in order.iter().enumerate() {
        if group_of.contains_key(&n) {
            continue;
        }
        for v in &g.node(n).operands {
            last_read.insert(*v, i);
        }
    }
    let mut after: std::collections::BTreeMap<usize, Vec<usize>> =
        std::collections::BTreeMap::new();
    for (i, (pv, ns)) in groups.iter().enumerate() {
        let mut at = last_read.get(pv).copied().unwrap_or(0);
        for &n in ns {
            for v in &g.node(n).operands {
                let d = g.def(*v);
                if d != step && group_of.get(&d) != Some(&i) {
                    at = at.max(pos[&d]);
                }
            }
        }
        after.entry(at).or_default().push(i);
    }
    // With reduce-scattered gradients (ZeRO-2/3) each update runs one bucket late:
    // right after the bucket that completes after its own. Placed right after its own
    // reduction, the compute stream would wait for that collective, and with ZeRO-3 the
    // next layer's gathers queue before it on the communication stream (a 405B step on
    // dp=32,cp=8,sp=4: 5.5 s of stalls). What waits longer is a gradient shard; a
    // whole all-reduced gradient would be held a bucket longer, so those stay put.
    let after = if late {
        let ats: Vec<usize> = after.keys().copied().collect();
        let mut deferred: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
        for (k, (_, gs)) in after.into_iter().enumerate() {
            let at = ats.get(k + 1).copied().unwrap_or(ats[k]);
            deferred.entry(at).or_default().extend(gs);
        }
        deferred
    } else {
        after
    };
    let mut new = Vec::with_capacity(order.len());
    new.push(step);
    for (i, &n) in order.iter().enumerate() {
        if n == step || group_of.contains_key(&n) {
            continue;
        }
        new.push(n);
        for &gi in after.get(&i).map(Vec::as_slice).unwrap_or(&[]) {
            new.extend_from_slice(&groups[gi].1);
        }
    }
    debug_assert_eq!(new.len(), order.len());
    g.set_order(new);
}

/// Removes the nodes made by `pass` whose results nothing reads and no output names.
fn remove_dead(g: &mut Graph, pass: &str) -> usize {
    let mut needed = vec![false; g.value_capacity()];
    for (_, v) in g.outputs() {
        needed[v.0 as usize] = true;
    }
    let mut dead = Vec::new();
    for &n in g.nodes().iter().rev() {
        let d = g.node(n);
        if crate::util::made_by(g, n, pass) && !d.results.iter().any(|v| needed[v.0 as usize]) {
            dead.push(n);
        } else {
            for v in &d.operands {
                needed[v.0 as usize] = true;
            }
        }
    }
    g.remove_nodes(&dead);
    dead.len()
}

struct Writer<'g> {
    g: &'g mut Graph,
    meta: NodeMeta,
    /// AdamW's linear learning-rate warmup, in steps.
    warmup: Option<i64>,
    /// `stream_optimizer_state`: states live in host memory, reloaded for the update.
    stream: bool,
    /// The `reload` of every streamed state, for [`prefetch_states`].
    state_reloads: Vec<Node>,
}

impl Writer<'_> {
    fn op(&mut self, op: Op, xs: &[Value]) -> Result<Value, PassError> {
        Ok(self.ops(op, xs)?[0])
    }
    fn ops(&mut self, op: Op, xs: &[Value]) -> Result<Vec<Value>, PassError> {
        self.g
            .insert_with(At::End, op, xs, self.meta.clone())
            .map_err(|e| build_error(NAME, e))
    }
    fn why(&mut self, reason: String) {
        self.meta.provenance = Some(Provenance {
            pass: NAME.into(),
            reason,
        });
    }

    /// A state parameter `optim.<kind>.<name>` of type `ty`: partitioned like the
    /// parameter, or flat and sharded by `shard` (each rank exactly its piece).
    fn state(
        &mut self,
        kind: &str,
        name: &str,
        ty: &TensorType,
        shard: Option<&ZeroSplit>,
        res: &mut PassResult,
    ) -> Result<Value, PassError> {
        let sname = role::optimizer_state_name(kind, name);
        let v = self.op(
            Op::Param {
                name: sname.clone(),
                ty: ty.clone(),
            },
            &[],
        )?;
        let own = own_partitions(self.g, name);
        if let Some(split) = shard {
            for p in split.state_partitions(&self.g.mesh, &own) {
                self.g.add_param_partition(&sname, p);
            }
        } else {
            for p in own {
                self.g.add_param_partition(&sname, p);
            }
        }
        res.count("state_tensors", 1);
        if !self.stream {
            return Ok(v);
        }
        res.count("streamed_state_tensors", 1);
        self.why(format!(
            "streamed optimizer state: `{sname}` from host memory for the update (prefetched)"
        ));
        let r = self.op(
            Op::Reload {
                stream: "h2d".into(),
            },
            &[v],
        )?;
        self.state_reloads.push(self.g.def(r));
        Ok(r)
    }

    /// The updated state `v` as the step's output `optim.<kind>.<name>`; streamed, its
    /// copy back into the state's host memory.
    fn state_out(
        &mut self,
        kind: &str,
        name: &str,
        v: Value,
        shard: Option<&ZeroSplit>,
    ) -> Result<(), PassError> {
        let out = role::optimizer_state_name(kind, name);
        let v = if self.stream {
            self.why(format!(
                "streamed optimizer state: `{out}` back to host memory after the update"
            ));
            self.op(
                Op::Offload {
                    stream: "d2h".into(),
                },
                &[v],
            )?
        } else {
            v
        };
        self.g.set_output(&out, v);
        if let Some(split) = shard {
            let own = own_partitions(self.g, name);
            crate::zero::split_output(self.g, &out, &split.output_axes(&own));
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn update(
        &mut self,
        name: &str,
        p: Value,
        pty: &TensorType,
        stage3: bool,
        grad: Value,
        step: Value,
        opt: &Optimizer,
        split: Option<&ZeroSplit>,
        master_weights: bool,
        offload: bool,
        res: &mut PassResult,
    ) -> Result<Value, PassError> {
        let pty = pty.clone();
        let low = pty.dtype != DType::F32 && pty.dtype != DType::F64;
        // The dtype the update and its states work in.
        let fdt = if pty.dtype == DType::F64 || (low && !master_weights) {
            pty.dtype
        } else {
            DType::F32
        };
        // What the update works on: the whole tensor, or this rank's piece of it flattened.
        let (work_ty, gname) = match split {
            Some(s) => (TensorType::new(fdt, vec![s.width()]), s.group.name()),
            None => (pty.with_dtype(fdt), String::new()),
        };
        let chunk_of = |w: &mut Self, v: Value, what: &str| -> Result<Value, PassError> {
            let Some(split) = split else {
                return Ok(v);
            };
            let reason = if split.is_even() {
                format!(
                    "ZeRO-1: this rank's 1/{} of `{name}`'s {what} (group {gname})",
                    split.ranks()
                )
            } else {
                format!(
                    "ZeRO-1: this rank's piece of `{name}`'s {what} (group {gname}, uneven: {:?} per rank)",
                    split.widths()
                )
            };
            w.why(reason.clone());
            let mut em = crate::zero::Emitter {
                pass: NAME,
                at: At::End,
                meta: w.meta.clone(),
                g: &mut *w.g,
            };
            // In the split's flat layout (dims 0 and 1 swapped where ZeRO-3 cuts dim 1).
            let v = em.rows_layout(split, v, &format!("ZeRO-1: `{name}`'s {what}"))?;
            let flat =
                em.flat_const(v, split.numel_dim(), &format!("ZeRO-1: `{name}`'s {what}"))?;
            em.piece_of(split, flat, &reason)
        };
        let sh = split;
        // The f32 weights the update reads: the param, or its master copy.
        let master = if (low && master_weights) || offload {
            res.count("master_weights", 1);
            self.why(format!(
                "{fdt} master weight of the {} param `{name}`{}",
                pty.dtype,
                if offload { ", in host memory" } else { "" }
            ));
            Some(self.state("master", name, &work_ty, sh, res)?)
        } else {
            None
        };
        let w32 = match master {
            Some(m) => m,
            None if stage3 => {
                // The parameter is already this rank's rows: its piece, flat.
                let split = split.expect("stage 3 shards");
                let mut em = crate::zero::Emitter {
                    pass: NAME,
                    at: At::End,
                    meta: self.meta.clone(),
                    g: &mut *self.g,
                };
                let v = if split.is_per_outer() {
                    em.flat_const(p, split.width(), &format!("ZeRO-3: `{name}`'s rows"))?
                } else {
                    let rows = em.rows_layout(split, p, &format!("ZeRO-3: `{name}`'s rows"))?;
                    em.flat_const(rows, split.width(), &format!("ZeRO-3: `{name}`'s rows"))?
                };
                if self.g.ty(v).dtype == fdt {
                    v
                } else {
                    self.why(format!("`{name}` in {fdt}"));
                    self.op(Op::Cast { dtype: fdt }, &[v])?
                }
            }
            None => chunk_of(self, p, "weights")?,
        };
        // Under ZeRO-2, grad-sync left this rank's chunk of the reduced gradient.
        let shard_out = role::grad_shard_name(name);
        let (grad, chunked) = match (split, self.g.output(&shard_out)) {
            (Some(s), Some(v)) if self.g.ty(v).shape == [s.width()] => (v, true),
            _ => (grad, false),
        };
        self.g.remove_output(&shard_out);
        // This rank's piece first, so only the piece is widened (and `fuse` finds the
        // widening cast right before the update). Offloaded, the gradient crosses the
        // host link in its own dtype.
        let g = if chunked {
            grad
        } else {
            chunk_of(self, grad, "gradient")?
        };
        let g = if self.g.ty(g).dtype == fdt || offload {
            g
        } else {
            self.why(format!("the gradient of `{name}` in {fdt}"));
            self.op(Op::Cast { dtype: fdt }, &[g])?
        };
        let mut host_param = None;
        let new32 = match *opt {
            Optimizer::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } if offload => {
                self.why(format!(
                    "optimizer offload: `{name}`'s gradient chunk to the host, {} bytes",
                    crate::grad_sync::value_bytes(self.g, g)
                ));
                let g_host = self.op(
                    Op::Offload {
                        stream: "d2h".into(),
                    },
                    &[g],
                )?;
                self.why(format!("first moment of `{name}`, in host memory"));
                let m = self.state("m", name, &work_ty, sh, res)?;
                self.why(format!("second moment of `{name}`, in host memory"));
                let v = self.state("v", name, &work_ty, sh, res)?;
                self.why(format!(
                    "host AdamW step of `{name}` (lr {}, betas {}/{}, eps {}, weight decay {}), rounded to {}",
                    lr.0, beta1.0, beta2.0, eps.0, weight_decay.0, pty.dtype
                ));
                let r = self.ops(
                    Op::HostAdamW {
                        lr,
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                        dtype: pty.dtype,
                        warmup: self.warmup,
                    },
                    &[w32, g_host, m, v, step],
                )?;
                self.state_out("m", name, r[1], sh)?;
                self.state_out("v", name, r[2], sh)?;
                host_param = Some(r[3]);
                r[0]
            }
            Optimizer::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                self.why(format!("first moment of `{name}`"));
                let m = self.state("m", name, &work_ty, sh, res)?;
                self.why(format!("second moment of `{name}`"));
                let v = self.state("v", name, &work_ty, sh, res)?;
                self.why(format!(
                    "AdamW step of `{name}` (lr {}, betas {}/{}, eps {}, weight decay {})",
                    lr.0, beta1.0, beta2.0, eps.0, weight_decay.0
                ));
                let r = self.ops(
                    Op::AdamW {
                        lr,
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                        warmup: self.warmup,
                    },
                    &[w32, g, m, v, step],
                )?;
                self.state_out("m", name, r[1], sh)?;
                self.state_out("v", name, r[2], sh)?;
                r[0]
            }
            Optimizer::Sgd {
                lr,
                momentum,
                weight_decay,
            } => {
                self.why(format!(
                    "SGD step of `{name}` (lr {}, momentum {}, weight decay {})",
                    lr.0, momentum.0, weight_decay.0
                ));
                if momentum.0 != 0.0 {
                    let b = self.state("buf", name, &work_ty, sh, res)?;
                    let r = self.ops(
                        Op::Sgd {
                            lr,
                            momentum,
                            weight_decay,
                        },
                        &[w32, g, b],
                    )?;
                    self.state_out("buf", name, r[1], sh)?;
                    r[0]
                } else {
                    self.op(
                        Op::Sgd {
                            lr,
                            momentum,
                            weight_decay,
                        },
                        &[w32, g],
                    )?
                }
            }
        };
        if master.is_some() {
            self.state_out("master", name, new32, sh)?;
        }
        // Back to the whole parameter in its dtype (cast first: the gather moves the
        // parameter's dtype, bf16 under mixed precision, not the f32 master).
        let mut whole = new32;
        if let Some(hp) = host_param {
            self.why(format!(
                "optimizer offload: `{name}`'s updated {} back to the device",
                pty.dtype
            ));
            whole = self.op(
                Op::Reload {
                    stream: "h2d".into(),
                },
                &[hp],
            )?;
        } else if pty.dtype != fdt {
            self.why(format!("`{name}` back in {}", pty.dtype));
            whole = self.op(Op::Cast { dtype: pty.dtype }, &[whole])?;
        }
        if stage3 {
            // ZeRO-3: the updated rows are the new parameter (no gather).
            res.count("sharded", 1);
            let split = split.expect("stage 3 shards");
            let shard_shape = split.rows_view(&self.g.ty(p).shape);
            let mut em = crate::zero::Emitter {
                pass: NAME,
                at: At::End,
                meta: self.meta.clone(),
                g: &mut *self.g,
            };
            let what = format!("ZeRO-3: `{name}`'s updated rows");
            let rows = em.unflat(whole, &shard_shape, &what)?;
            return em.rows_layout(split, rows, &what);
        }
        if let Some(split) = split {
            res.count("sharded", 1);
            let what = format!("ZeRO-1: every rank's updated chunk of `{name}`");
            let mut em = crate::zero::Emitter {
                pass: NAME,
                at: At::End,
                meta: self.meta.clone(),
                g: &mut *self.g,
            };
            whole = em.gather_pieces(split, whole, &what)?;
            whole = em.unflat(whole, &pty.shape, &format!("ZeRO-1: `{name}`"))?;
        }
        Ok(whole)
    }
}

/// The optimizer state a step program starts from: zero moments and buffers, and master
/// weights copied from the (low-precision) parameters, each as the full tensor the
/// runtime expects (a state sharded over dp: the flattened whole, every rank's piece).
/// Entries already in `weights` are kept.
pub fn initial_state(
    g: &Graph,
    weights: &std::collections::BTreeMap<String, weft_ir::HostTensor>,
) -> Result<std::collections::BTreeMap<String, weft_ir::HostTensor>, String> {
    use weft_ir::HostTensor;
    let mut out = std::collections::BTreeMap::new();
    for (sname, v) in g.params() {
        let role = ValueName::parse(&sname);
        if !matches!(
            role,
            ValueName::MasterWeight(_) | ValueName::OptimizerState { .. }
        ) {
            continue;
        }
        if weights.contains_key(&sname) || out.contains_key(&sname) {
            continue;
        }
        let ty = g.ty(v);
        let mut shape = Vec::new();
        for (i, d) in ty.shape.iter().enumerate() {
            let full = g
                .param_partition(&sname)
                .iter()
                .filter(|p| p.dim == i)
                .map(|p| p.full_size())
                .next();
            match full.or_else(|| d.as_const()) {
                Some(x) => shape.push(x as usize),
                None => return Err(format!("state `{sname}` has a symbolic size `{d}`")),
            }
        }
        let n: usize = shape.iter().product();
        let data = match role {
            ValueName::MasterWeight(param) => {
                let w = weights.get(param).ok_or_else(|| {
                    format!("no weight for `{param}`, whose master copy `{sname}` starts from it")
                })?;
                let flat_sharded = g.param_partition(&sname).iter().any(|p| p.kind == "zero");
                let own_v = own_partitions(g, param);
                let own = own_v.as_slice();
                let swap = rows_of_dim1(g, param);
                let d = if flat_sharded && (!own.is_empty() || swap) {
                    // One block per shard of the parameter, in its split order.
                    flat_blocks(w, own, &g.mesh, swap)?
                } else {
                    w.to_f64()
                };
                if d.len() != n {
                    return Err(format!(
                        "`{param}` has {} elements but its master copy {n}",
                        d.len()
                    ));
                }
                d
            }
            _ => vec![0.0; n],
        };
        out.insert(sname.clone(), HostTensor::floats(ty.dtype, shape, data));
    }
    Ok(out)
}

/// The flat state layout of a split parameter: for every combination of coordinates on
/// its split axes (row-major, in the partitions' order), that shard of `w` flattened
/// (each exactly its shard's elements, which differ per rank for an uneven tp split:
/// ZeRO stores no padding).
fn flat_blocks(
    w: &weft_ir::HostTensor,
    parts: &[Partition],
    mesh: &weft_ir::Mesh,
    swap_leading: bool,
) -> Result<Vec<f64>, String> {
    let data = w.to_f64();
    let mut out = Vec::new();
    for idx in block_indices(&w.shape, parts, mesh, swap_leading)? {
        out.extend(idx.iter().map(|&i| data[i]));
    }
    Ok(out)
}

/// For each block of the flat state layout of a parameter of `shape` split by `parts`
/// (see [`flat_blocks`]), the flat index in the whole parameter of each of its
/// elements (its shard's, no padding).
fn block_indices(
    shape: &[usize],
    parts: &[Partition],
    mesh: &weft_ir::Mesh,
    swap_leading: bool,
) -> Result<Vec<Vec<usize>>, String> {
    let mut axes: Vec<(String, u32)> = Vec::new();
    for a in parts.iter().flat_map(|p| &p.axes) {
        if !axes.iter().any(|(x, _)| x == a) {
            axes.push((a.clone(), mesh.size_or_one(a)));
        }
    }
    // The axes whose shards differ in size come last, in mesh order: ZeRO splits each
    // of their shards on its own, inside the blocks of the others
    // (`ZeroSplit::state_partitions`).
    let uneven = |a: &str| {
        parts
            .iter()
            .any(|p| p.splits_over(a) && p.shard_sizes().iter().any(|&n| n != p.shard_size(0)))
    };
    let (mut even, mut odd): (Vec<_>, Vec<_>) = axes.into_iter().partition(|(a, _)| !uneven(a));
    odd.sort_by_key(|(a, _)| mesh.axes.iter().position(|(x, _)| x == a));
    even.extend(odd);
    let axes = even;
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    let count: u32 = axes.iter().map(|(_, n)| n).product();
    let mut out = Vec::with_capacity(count as usize);
    for k in 0..count {
        // Coordinates of combination k, row-major.
        let mut coords = vec![0u32; axes.len()];
        let mut r = k;
        for (i, (_, n)) in axes.iter().enumerate().rev() {
            coords[i] = r % n;
            r /= n;
        }
        let mut maps: Vec<Vec<usize>> = shape.iter().map(|&n| (0..n).collect()).collect();
        for p in parts {
            let c = p.coord_with(|a| {
                let i = axes.iter().position(|(x, _)| x == a)?;
                Some((coords[i], axes[i].1))
            })?;
            let cur = maps
                .get(p.dim)
                .ok_or_else(|| format!("partition `{p}` splits dim {} of {shape:?}", p.dim))?;
            if p.full_size() as usize != cur.len() {
                return Err(format!(
                    "partition `{p}` does not fit dim {} of {shape:?}",
                    p.dim
                ));
            }
            let mut next = Vec::new();
            for (s, e) in p.ranges(c) {
                next.extend_from_slice(&cur[s as usize..e as usize]);
            }
            maps[p.dim] = next;
        }
        let local: usize = maps.iter().map(Vec::len).product();
        let mut one = Vec::with_capacity(local);
        let mut idx = vec![0usize; shape.len()];
        // The block's elements in its flat order: row-major, dims 0 and 1 swapped where
        // ZeRO-3 splits dim 1 (the rows of dim 1 outermost).
        let mut order: Vec<usize> = (0..shape.len()).collect();
        if swap_leading && shape.len() > 1 {
            order.swap(0, 1);
        }
        for _ in 0..local {
            one.push(
                idx.iter()
                    .enumerate()
                    .map(|(d, &c)| maps[d][c] * strides[d])
                    .sum(),
            );
            for &d in order.iter().rev() {
                idx[d] += 1;
                if idx[d] < maps[d].len() {
                    break;
                }
                idx[d] = 0;
            }
        }
        out.push(one);
    }
    Ok(out)
}

/// A whole state tensor (as a step returns it, `optim.<kind>.<param>`) in the layout of
/// its parameter (`shape`): a ZeRO-sharded state is flat (every rank's piece, no
/// padding) and, for a split parameter, blocked by shard; others are returned unchanged. For comparing states
/// across meshes and resharding them.
pub fn state_as_param(
    g: &Graph,
    state: &str,
    t: &weft_ir::HostTensor,
    shape: &[usize],
) -> Result<weft_ir::HostTensor, String> {
    let sharded = g.param_partition(state).iter().any(|p| p.kind == "zero");
    let param = match ValueName::parse(state) {
        ValueName::MasterWeight(p) | ValueName::OptimizerState { param: p, .. } => p,
        _ => return Err(format!("`{state}` is not an optimizer state")),
    };
    if !sharded {
        return Ok(t.clone());
    }
    let own_v = own_partitions(g, param);
    let own = own_v.as_slice();
    let swap = rows_of_dim1(g, param);
    let data = t.to_f64();
    let n: usize = shape.iter().product();
    let mut out = vec![0.0; n];
    if data.len() != n {
        return Err(format!(
            "`{state}` has {} elements, not its parameter's {n}",
            data.len()
        ));
    }
    if own.is_empty() && !swap {
        out.copy_from_slice(&data);
    } else {
        let mut at = 0;
        for idx in block_indices(shape, own, &g.mesh, swap)? {
            for i in idx {
                out[i] = data[at];
                at += 1;
            }
        }
    }
    Ok(weft_ir::HostTensor::floats(t.dtype, shape.to_vec(), out))
}

/// The inverse of [`state_as_param`]: a state in the layout of its parameter (as a
/// universal training checkpoint stores it) as the whole tensor the step program's
/// state param `state` holds (flat and blocked by shard when ZeRO shards it, no
/// padding; unchanged otherwise), in the state's dtype.
pub fn state_from_param(
    g: &Graph,
    state: &str,
    t: &weft_ir::HostTensor,
) -> Result<weft_ir::HostTensor, String> {
    let v = g
        .params()
        .into_iter()
        .find(|(n, _)| n == state)
        .map(|(_, v)| v)
        .ok_or_else(|| format!("the step has no optimizer state `{state}`"))?;
    let ty = g.ty(v);
    let parts = g.param_partition(state);
    let mut shape = Vec::new();
    for (i, d) in ty.shape.iter().enumerate() {
        let full = parts.iter().find(|p| p.dim == i).map(|p| p.full_size());
        match full.or_else(|| d.as_const()) {
            Some(x) => shape.push(x as usize),
            None => return Err(format!("state `{state}` has a symbolic size `{d}`")),
        }
    }
    let n: usize = shape.iter().product();
    if !parts.iter().any(|p| p.kind == "zero") {
        if t.shape != shape {
            return Err(format!(
                "`{state}` has shape {:?} where the step holds {shape:?}",
                t.shape
            ));
        }
        return Ok(weft_ir::HostTensor::floats(ty.dtype, shape, t.to_f64()));
    }
    let param = match weft_ir::ValueName::parse(state) {
        weft_ir::ValueName::MasterWeight(p)
        | weft_ir::ValueName::OptimizerState { param: p, .. } => p,
        _ => return Err(format!("`{state}` is not an optimizer state")),
    };
    let own_v = own_partitions(g, param);
    let own = own_v.as_slice();
    let swap = rows_of_dim1(g, param);
    let d = if own.is_empty() && !swap {
        t.to_f64()
    } else {
        flat_blocks(t, own, &g.mesh, swap)?
    };
    if d.len() != n {
        return Err(format!(
            "`{state}` has {} elements but the step holds {n}",
            d.len()
        ));
    }
    Ok(weft_ir::HostTensor::floats(ty.dtype, shape, d))
}

/// Whether ZeRO-3 splits parameter `name` by the rows of its dim 1 (fewer rows of dim 0
/// than ranks): its flat states then hold each shard with dims 0 and 1 swapped.
fn rows_of_dim1(g: &Graph, name: &str) -> bool {
    g.param_partition(name)
        .iter()
        .any(|p| p.kind == "zero" && p.dim == 1)
}

/// A parameter's own partitions (tensor, expert), without the ZeRO-3 split of its rows.
fn own_partitions(g: &Graph, name: &str) -> Vec<Partition> {
    g.param_partition(name)
        .iter()
        .filter(|p| p.kind != "zero")
        .cloned()
        .collect()
}
