//! Lowering of the optimizer updates: AdamW (plain, 16-byte-vector bf16, or fused with
//! the mixed-precision cast the executor found around it) and SGD with momentum.

use super::*;

/// `adamw`; `hyper` is (lr, beta1, beta2, eps, weight_decay).
pub(super) fn adamw(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    hyper: [&Float; 5],
) -> CudaResult<()> {
    let (p, g, m, v, step) = (&ins[0], &ins[1], &ins[2], &ins[3], &ins[4]);
    let n = p.numel();
    let aligned = |ps: &[u64]| n % 8 == 0 && ps.iter().all(|x| x % 16 == 0);
    let [lr, b1, b2, eps, wd] = hyper.map(|x| x.0 as f32);
    if let Some((glow, pout, low)) = lw.fused_adamw {
        let ptrs = [
            pout,
            outs[0].ptr,
            outs[1].ptr,
            outs[2].ptr,
            p.ptr,
            glow,
            m.ptr,
            v.ptr,
        ];
        let (name, items) = if low == DType::BF16 && aligned(&ptrs) {
            ("adamw_master8_bf16", n / 8)
        } else {
            (kname("adamw_master", low)?, n)
        };
        let k = kernels::AdamWMaster {
            pout,
            wo: outs[0].ptr,
            mo: outs[1].ptr,
            vo: outs[2].ptr,
            w: p.ptr,
            g: glow,
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
        };
        return lw.run(name, items, k);
    }
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
