//! Lowering of rotary position embeddings: `rope_table` (cos/sin from positions, with
//! the inverse frequencies as a device constant) and `rope` (a 3-D grid kernel where the
//! head dim fits one block, each block over several heads of its positions, else a flat
//! one).

use super::*;
use weft_ir::HeadLayout;

/// About how many blocks a `rope2` launch is cut into (a few per SM of an H100/H200).
const ROPE_BLOCKS: usize = 1024;

/// `rope_table`: (cos, sin) for each position.
pub(super) fn rope_table(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    theta: &Float,
    dim: &i64,
    scaling: &RopeScaling,
) -> CudaResult<()> {
    let o = &outs[0];
    let inv = rope_inv_freq(theta.0, *dim as usize, scaling);
    let bytes: Vec<u8> = inv.iter().flat_map(|x| x.to_le_bytes()).collect();
    let invp = lw.ex.constant(&bytes);
    let pos = &ins[0];
    let half = (*dim / 2) as i32;
    let k = kernels::RopeTable {
        cosv: outs[0].ptr,
        sinv: outs[1].ptr,
        ocode: o.dtype,
        pos: pos.ptr,
        pcode: pos.dtype,
        npos: pos.numel() as i64,
        half,
        inv: invp,
        scale: scaling.attention_factor() as f32,
    };
    lw.run("rope_table", o.numel(), k)
}

/// `rope`: rotates x [B, N, S, D] (`layout=bshd`: [B, S, N, D]) by cos/sin [B|1, S, r].
pub(super) fn rope(
    lw: &mut Lower,
    ins: &[DevT],
    outs: &[DevT],
    layout: HeadLayout,
) -> CudaResult<()> {
    let o = &outs[0];
    let (x, c, s) = (&ins[0], &ins[1], &ins[2]);
    if x.rank() != 4 || c.rank() != 3 || c.dtype != s.dtype {
        return Err(lw.unsup(
            "rope",
            "x must be [B, N, S, D] (or [B, S, N, D]) and cos/sin [B|1, S, r] of one dtype",
        ));
    }
    let (nh, sq) = (x.shape[layout.heads_dim()], x.shape[layout.seq_dim()]);
    let (b, d) = (x.shape[0], x.shape[3]);
    let bshd = (layout == HeadLayout::Bshd) as i32;
    let r = c.shape[2];
    let cbs = if c.shape[0] == 1 {
        0
    } else {
        (c.shape[1] * r) as i64
    };
    let fits = d / 2 <= 512
        && d % 2 == 0
        && r % 2 == 0
        && r <= d
        && sq <= i32::MAX as usize
        && nh <= 65535
        && b <= 65535;
    if fits && d >= 2 {
        let tx = (d / 2) as u32;
        let ty = (256 / tx).max(1);
        // Each block covers `hp` heads of its positions (reading cos/sin once for them),
        // with enough blocks to fill the device: about ROPE_BLOCKS in all.
        let position_blocks = sq.div_ceil(ty as usize) * b;
        let groups = ROPE_BLOCKS
            .div_ceil(position_blocks.max(1))
            .clamp(1, nh.max(1));
        let hp = nh.div_ceil(groups).max(1);
        let name = kname("rope2", x.dtype)?;
        let k = kernels::Rope2 {
            out: o.ptr,
            x: x.ptr,
            cosv: c.ptr,
            sinv: s.ptr,
            ccode: c.dtype,
            n: nh as i32,
            s: sq as i32,
            d: d as i32,
            r: r as i32,
            cbs,
            bshd,
            hp: hp as i32,
        };
        let grid = (
            sq.div_ceil(ty as usize) as u32,
            nh.div_ceil(hp) as u32,
            b as u32,
        );
        return lw.run_at(name, grid, (tx, ty, 1), 0, k);
    }
    let name = kname("rope", x.dtype)?;
    let k = kernels::Rope {
        out: o.ptr,
        x: x.ptr,
        cosv: c.ptr,
        sinv: s.ptr,
        ccode: c.dtype,
        b: b as i64,
        n: nh as i64,
        s: sq as i64,
        d: d as i64,
        r: r as i64,
        cbs,
        bshd,
    };
    lw.run(name, x.numel(), k)
}
