//! Lowering of the optimizer updates: AdamW (plain or 16-byte-vector bf16), the
//! mixed-precision AdamW that `fuse` made of the casts around it (`adamw_master`), SGD
//! with momentum, and the host AdamW update (`--offload-optimizer`) as a host function
//! on the host stream.

use super::*;

/// `adamw`; `hyper` is (lr, beta1, beta2, eps, weight_decay).
pub(super) fn adamw(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    hyper: [&Float; 5],
    warmup: Option<i64>,
) -> CudaResult<()> {
    // 0: none; the kernels scale lr by min(1, step / warmup).
    let warmup = warmup.filter(|&w| w > 0).map_or(0.0, |w| w as f32);
    let (p, g, m, v, step) = (&ins[0], &ins[1], &ins[2], &ins[3], &ins[4]);
    let n = p.numel();
    let aligned = |ps: &[u64]| n % 8 == 0 && ps.iter().all(|x| x % 16 == 0);
    let [lr, b1, b2, eps, wd] = hyper.map(|x| x.0 as f32);
    if g.dtype != p.dtype || m.dtype != v.dtype {
        return Err(lw.unsup(
            "adamw",
            "grad must have the param's dtype and m, v one dtype",
        ));
    }
    let ptrs = [
        outs[0].ptr,
        outs[1].ptr,
        outs[2].ptr,
        p.ptr,
        g.ptr,
        m.ptr,
        v.ptr,
    ];
    let (name, items) = if p.dtype == DType::BF16 && m.dtype == DType::BF16 && aligned(&ptrs) {
        ("adamw8_bf16_bf16", n / 8)
    } else {
        let name = format!(
            "adamw_{}_{}",
            fsuffix(p.dtype).unwrap_or("?"),
            fsuffix(m.dtype).unwrap_or("?")
        );
        (intern(&name), n)
    };
    let k = kernels::AdamW {
        po: outs[0].ptr,
        mo: outs[1].ptr,
        vo: outs[2].ptr,
        p: p.ptr,
        g: g.ptr,
        m: m.ptr,
        v: v.ptr,
        step: step.ptr,
        scode: step.dtype,
        n: items as i64,
        lr,
        b1,
        b2,
        eps,
        wd,
        warmup,
    };
    lw.run(name, items, k)
}

/// `adamw_master`: the f32 master, moments and step with a gradient in `low` (bf16 or
/// f16); writes the new master, moments and the new master rounded to `low`.
pub(super) fn adamw_master(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    hyper: [&Float; 5],
    low: DType,
    warmup: Option<i64>,
) -> CudaResult<()> {
    let warmup = warmup.filter(|&w| w > 0).map_or(0.0, |w| w as f32);
    let (w, g, m, v, step) = (&ins[0], &ins[1], &ins[2], &ins[3], &ins[4]);
    let pout = &outs[3];
    if [w, m, v].iter().any(|t| t.dtype != DType::F32) || g.dtype != low || pout.dtype != low {
        return Err(lw.unsup(
            "adamw_master",
            &format!(
                "master, m and v must be f32 and the gradient and result {low}: master {}, grad {}, m {}, v {}",
                w.dtype, g.dtype, m.dtype, v.dtype
            ),
        ));
    }
    let n = w.numel();
    let [lr, b1, b2, eps, wd] = hyper.map(|x| x.0 as f32);
    let ptrs = [
        pout.ptr,
        outs[0].ptr,
        outs[1].ptr,
        outs[2].ptr,
        w.ptr,
        g.ptr,
        m.ptr,
        v.ptr,
    ];
    let aligned = n.is_multiple_of(8) && ptrs.iter().all(|x| x.is_multiple_of(16));
    let (name, items) = if low == DType::BF16 && aligned {
        ("adamw_master8_bf16", n / 8)
    } else {
        (kname("adamw_master", low)?, n)
    };
    let k = kernels::AdamWMaster {
        pout: pout.ptr,
        wo: outs[0].ptr,
        mo: outs[1].ptr,
        vo: outs[2].ptr,
        w: w.ptr,
        g: g.ptr,
        m: m.ptr,
        v: v.ptr,
        step: step.ptr,
        scode: step.dtype,
        n: items as i64,
        lr,
        b1,
        b2,
        eps,
        wd,
        warmup,
    };
    lw.run(name, items, k)
}

/// `sgd` (momentum buffer optional).
pub(super) fn sgd(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    lr: &Float,
    momentum: &Float,
    weight_decay: &Float,
) -> CudaResult<()> {
    let (p, g) = (&ins[0], &ins[1]);
    let name = kname("sgd", p.dtype)?;
    let (buf, bo) = match ins.get(2) {
        Some(b) => (b.ptr, outs[1].ptr),
        None => (0, 0),
    };
    let k = kernels::Sgd {
        po: outs[0].ptr,
        bo,
        p: p.ptr,
        g: g.ptr,
        buf,
        n: p.numel() as i64,
        lr: lr.0 as f32,
        mu: momentum.0 as f32,
        wd: weight_decay.0 as f32,
    };
    lw.run(name, p.numel(), k)
}

/// `host_adamw`: the step counter copied into the job's pinned scalar, then the update
/// as a host function, both on the instruction's stream (the host stream), after the
/// gradient's `offload` by the plan's events.
pub(super) fn host_adamw(lw: &mut Lower, op: &Op, ins: &[DevT], outs: &[DevT]) -> CudaResult<()> {
    let Op::HostAdamW {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        warmup,
        ..
    } = op
    else {
        return Err(CudaError::Plan("internal: not a host_adamw".into()));
    };
    if ins.len() != 5 || outs.len() != 4 {
        return Err(CudaError::Plan(format!(
            "host_adamw at {} has {} operands and {} results, not 5 and 4",
            lw.location,
            ins.len(),
            outs.len()
        )));
    }
    let n = outs[0].numel();
    for t in ins[..4].iter().chain(outs) {
        if t.numel() != n {
            return Err(CudaError::Plan(format!(
                "host_adamw at {}: operand shapes {:?} and {:?} differ",
                lw.location, t.shape, outs[0].shape
            )));
        }
    }
    if ins[4].numel() != 1 {
        return Err(CudaError::Plan(format!(
            "host_adamw at {}: the step is not a scalar",
            lw.location
        )));
    }
    let span = |t: &DevT| crate::cuda::host_adamw::HostSpan {
        ptr: t.ptr,
        dtype: t.dtype,
    };
    let mut job = crate::cuda::host_adamw::HostAdamW::new(
        lw.gpu,
        [
            span(&ins[0]),
            span(&ins[1]),
            span(&ins[2]),
            span(&ins[3]),
            span(&outs[0]),
            span(&outs[1]),
            span(&outs[2]),
            span(&outs[3]),
        ],
        n as usize,
        ins[4].dtype,
        [lr.0, beta1.0, beta2.0, eps.0, weight_decay.0],
        lw.location.clone(),
    )?;
    job.warmup = *warmup;
    lw.push(StepKind::Copy {
        dst: job.step_ptr(),
        src: ins[4].ptr,
        bytes: ins[4].bytes(),
        kind: CopyKind::D2H,
    });
    lw.push(StepKind::HostAdamW(Arc::new(job)));
    Ok(())
}
