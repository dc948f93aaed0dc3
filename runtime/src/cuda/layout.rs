//! Host-side layout logic (no GPU needed, unit-tested on the CPU): row-major strides,
//! broadcast strides, merging dims a strided copy can treat as one, the by-value
//! parameter structs the kernels take, and host <-> device element conversion.

use weft_ir::{DType, HostData, HostTensor};

pub const MAXR: usize = 8;

/// `Strided` of kernels.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Strided {
    pub rank: i32,
    pub shape: [i64; MAXR],
    pub ss: [i64; MAXR],
    pub ds: [i64; MAXR],
}

/// `Bcast` of kernels.cu (up to three operand strides).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bcast {
    pub rank: i32,
    pub shape: [i64; MAXR],
    pub sa: [i64; MAXR],
    pub sb: [i64; MAXR],
    pub sc: [i64; MAXR],
}

/// `Red` of kernels.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Red {
    pub ro: i32,
    pub rr: i32,
    pub oshape: [i64; MAXR],
    pub ostride: [i64; MAXR],
    pub rshape: [i64; MAXR],
    pub rstride: [i64; MAXR],
}

/// Row-major strides (elements).
pub fn strides(shape: &[usize]) -> Vec<i64> {
    let mut s = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1] as i64;
    }
    s
}

/// Strides of `in_shape` broadcast (numpy, right-aligned) to `out_shape`: 0 where the
/// input has size 1 or lacks the dim.
pub fn broadcast_strides(in_shape: &[usize], out_shape: &[usize]) -> Result<Vec<i64>, String> {
    if in_shape.len() > out_shape.len() {
        return Err(format!("cannot broadcast {in_shape:?} to {out_shape:?}"));
    }
    let st = strides(in_shape);
    let off = out_shape.len() - in_shape.len();
    let mut r = vec![0i64; out_shape.len()];
    for (i, &d) in in_shape.iter().enumerate() {
        let o = out_shape[off + i];
        if d == o {
            r[off + i] = if d == 1 { 0 } else { st[i] };
        } else if d == 1 {
            r[off + i] = 0;
        } else {
            return Err(format!("cannot broadcast {in_shape:?} to {out_shape:?}"));
        }
    }
    Ok(r)
}

/// Drops size-1 dims and merges neighbours that every operand walks contiguously
/// (`stride[k] == stride[k+1] * shape[k+1]` for each stride list). Keeps at least one dim.
pub fn collapse(shape: &[usize], stride_lists: &[Vec<i64>]) -> (Vec<usize>, Vec<Vec<i64>>) {
    let mut sh: Vec<usize> = Vec::new();
    let mut sts: Vec<Vec<i64>> = vec![Vec::new(); stride_lists.len()];
    for k in 0..shape.len() {
        if shape[k] == 1 {
            continue;
        }
        let can_merge = !sh.is_empty()
            && stride_lists
                .iter()
                .enumerate()
                .all(|(j, s)| *sts[j].last().unwrap() == s[k] * shape[k] as i64);
        if can_merge {
            *sh.last_mut().unwrap() *= shape[k];
            for (j, s) in stride_lists.iter().enumerate() {
                *sts[j].last_mut().unwrap() = s[k];
            }
        } else {
            sh.push(shape[k]);
            for (j, s) in stride_lists.iter().enumerate() {
                sts[j].push(s[k]);
            }
        }
    }
    if sh.is_empty() {
        sh.push(1);
        for s in &mut sts {
            s.push(0);
        }
    }
    (sh, sts)
}

fn fill8(v: &[i64]) -> [i64; MAXR] {
    let mut a = [0i64; MAXR];
    a[..v.len()].copy_from_slice(v);
    a
}

/// A strided copy `dst[ds . idx] = src[ss . idx]` over `shape`, collapsed, with the
/// widest element size (bytes) that keeps it exact: returns (struct, element bytes,
/// element count). `esz` is the dtype's size; offsets are applied by the caller.
pub fn strided_copy(
    shape: &[usize],
    ss: &[i64],
    ds: &[i64],
    esz: usize,
    src_align: u64,
    dst_align: u64,
) -> Result<(Strided, usize, u64), String> {
    let (mut sh, sts) = collapse(shape, &[ss.to_vec(), ds.to_vec()]);
    let (mut s, mut d) = (sts[0].clone(), sts[1].clone());
    if sh.len() > MAXR {
        return Err(format!(
            "a copy over {} dims after merging (at most {MAXR})",
            sh.len()
        ));
    }
    // Widen the element when the innermost dim is contiguous on both sides.
    let mut w = esz;
    let last = sh.len() - 1;
    if s[last] == 1 && d[last] == 1 {
        for cand in [16usize, 8, 4, 2] {
            if cand <= esz {
                break;
            }
            let bytes = sh[last] * esz;
            let other_ok = (0..last).all(|k| {
                (s[k] as usize * esz).is_multiple_of(cand)
                    && (d[k] as usize * esz).is_multiple_of(cand)
            });
            if bytes.is_multiple_of(cand)
                && other_ok
                && src_align.is_multiple_of(cand as u64)
                && dst_align.is_multiple_of(cand as u64)
            {
                w = cand;
                break;
            }
        }
    }
    if w != esz {
        let f = (w / esz) as i64;
        sh[last] /= f as usize;
        for k in 0..last {
            s[k] /= f;
            d[k] /= f;
        }
        // The widened inner dim may now be 1 (or merge with its neighbour).
        let (sh2, st2) = collapse(&sh, &[s.clone(), d.clone()]);
        sh = sh2;
        s = st2[0].clone();
        d = st2[1].clone();
    }
    let n: u64 = sh.iter().map(|&x| x as u64).product();
    Ok((
        Strided {
            rank: sh.len() as i32,
            shape: fill8(&sh.iter().map(|&x| x as i64).collect::<Vec<_>>()),
            ss: fill8(&s),
            ds: fill8(&d),
        },
        w,
        n,
    ))
}

/// Broadcast parameters for up to three operands against `out`.
pub fn bcast(out: &[usize], ins: &[&[usize]]) -> Result<Bcast, String> {
    let mut lists = Vec::new();
    for s in ins {
        lists.push(broadcast_strides(s, out)?);
    }
    while lists.len() < 3 {
        lists.push(vec![0; out.len()]);
    }
    let (sh, sts) = collapse(out, &lists);
    if sh.len() > MAXR {
        return Err(format!("broadcast over {} dims (at most {MAXR})", sh.len()));
    }
    Ok(Bcast {
        rank: sh.len() as i32,
        shape: fill8(&sh.iter().map(|&x| x as i64).collect::<Vec<_>>()),
        sa: fill8(&sts[0]),
        sb: fill8(&sts[1]),
        sc: fill8(&sts[2]),
    })
}

/// Reduction parameters: `dims` of `shape` reduced, the rest kept (in order).
pub fn red(shape: &[usize], dims: &[usize]) -> Result<(Red, u64, u64), String> {
    let st = strides(shape);
    let (mut os, mut ost, mut rs, mut rst) = (vec![], vec![], vec![], vec![]);
    for (k, &d) in shape.iter().enumerate() {
        if dims.contains(&k) {
            rs.push(d as i64);
            rst.push(st[k]);
        } else {
            os.push(d as i64);
            ost.push(st[k]);
        }
    }
    if os.len() > MAXR || rs.len() > MAXR {
        return Err("too many dims for a reduction".into());
    }
    let nout: i64 = os.iter().product();
    let nred: i64 = rs.iter().product();
    Ok((
        Red {
            ro: os.len() as i32,
            rr: rs.len() as i32,
            oshape: fill8(&os),
            ostride: fill8(&ost),
            rshape: fill8(&rs),
            rstride: fill8(&rst),
        },
        nout as u64,
        nred as u64,
    ))
}

/// Dtype code of kernels.cu (0 f32, 1 bf16, 2 f16, 3 i64, 4 i32, 5 bool, 6 f64).
pub fn code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
        DType::I64 => 3,
        DType::I32 => 4,
        DType::Bool => 5,
        DType::F64 => 6,
    }
}

/// Suffix of templated float kernels, or None for non-float storage.
pub fn fsuffix(d: DType) -> Option<&'static str> {
    match d {
        DType::F32 => Some("f32"),
        DType::BF16 => Some("bf16"),
        DType::F16 => Some("f16"),
        _ => None,
    }
}

/// A host tensor's bytes in device storage of `dtype` (floats rounded to nearest even).
pub fn to_device_bytes(t: &HostTensor, dtype: DType) -> Vec<u8> {
    // Raw bytes already in the device dtype go as they are; others are decoded first.
    if let HostData::Raw(b) = &t.data {
        if t.dtype == dtype {
            return b.bytes().to_vec();
        }
        return to_device_bytes(&t.widened(), dtype);
    }
    let n = t.numel();
    let mut out = Vec::with_capacity(n * dtype.size_bytes() as usize);
    match (&t.data, dtype) {
        (HostData::F64(v), DType::F32) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&(*x as f32).to_le_bytes())),
        (HostData::F64(v), DType::BF16) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&half::bf16::from_f64(*x).to_le_bytes())),
        (HostData::F64(v), DType::F16) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&half::f16::from_f64(*x).to_le_bytes())),
        (HostData::F64(v), DType::F64) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        (d, DType::I64) => ints(d).for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        (d, DType::I32) => ints(d).for_each(|x| out.extend_from_slice(&(x as i32).to_le_bytes())),
        (d, DType::Bool) => ints(d).for_each(|x| out.push((x != 0) as u8)),
        (HostData::I64(v), f) => {
            let ft = HostTensor::floats(f, t.shape.clone(), v.iter().map(|&x| x as f64).collect());
            return to_device_bytes(&ft, f);
        }
        (HostData::Raw(_), _) => unreachable!("raw bytes are handled above"),
    }
    out
}

fn ints(d: &HostData) -> Box<dyn Iterator<Item = i64> + '_> {
    match d {
        HostData::I64(v) => Box::new(v.iter().copied()),
        HostData::F64(v) => Box::new(v.iter().map(|&x| x as i64)),
        HostData::Raw(_) => unreachable!("raw bytes are widened before"),
    }
}

/// Device bytes of `dtype` back to a host tensor.
pub fn from_device_bytes(b: &[u8], dtype: DType, shape: Vec<usize>) -> HostTensor {
    match dtype {
        DType::F32 => HostTensor::floats(
            dtype,
            shape,
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect(),
        ),
        DType::BF16 => HostTensor::floats(
            dtype,
            shape,
            b.chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64())
                .collect(),
        ),
        DType::F16 => HostTensor::floats(
            dtype,
            shape,
            b.chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
                .collect(),
        ),
        DType::F64 => HostTensor::floats(
            dtype,
            shape,
            b.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ),
        DType::I64 => HostTensor::ints(
            dtype,
            shape,
            b.chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ),
        DType::I32 => HostTensor::ints(
            dtype,
            shape,
            b.chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64)
                .collect(),
        ),
        DType::Bool => HostTensor::ints(dtype, shape, b.iter().map(|&x| x as i64).collect()),
    }
}

/// The bit pattern of `value` in `dtype`, for the fill kernels.
pub fn fill_pattern(value: f64, dtype: DType) -> u64 {
    match dtype {
        DType::F32 => (value as f32).to_bits() as u64,
        DType::BF16 => half::bf16::from_f64(value).to_bits() as u64,
        DType::F16 => half::f16::from_f64(value).to_bits() as u64,
        DType::F64 => value.to_bits(),
        DType::I64 => value as i64 as u64,
        DType::I32 => value as i64 as i32 as u32 as u64,
        DType::Bool => (value != 0.0) as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_and_broadcast() {
        assert_eq!(strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(
            broadcast_strides(&[3, 1], &[2, 3, 4]).unwrap(),
            vec![0, 1, 0]
        );
        assert_eq!(broadcast_strides(&[4], &[2, 3, 4]).unwrap(), vec![0, 0, 1]);
        assert!(broadcast_strides(&[5], &[2, 3, 4]).is_err());
    }

    #[test]
    fn collapse_merges_contiguous_dims() {
        let (sh, st) = collapse(&[2, 3, 4], &[strides(&[2, 3, 4])]);
        assert_eq!(sh, vec![24]);
        assert_eq!(st, vec![vec![1]]);
        // transpose of the last two dims: nothing merges but the batch
        let (sh, st) = collapse(&[2, 4, 3], &[vec![12, 1, 4], strides(&[2, 4, 3])]);
        assert_eq!(sh, vec![2, 4, 3]);
        assert_eq!(st[0], vec![12, 1, 4]);
        // size-1 dims vanish
        let (sh, _) = collapse(&[1, 5, 1], &[strides(&[1, 5, 1])]);
        assert_eq!(sh, vec![5]);
        let (sh, st) = collapse(&[1, 1], &[strides(&[1, 1])]);
        assert_eq!((sh, st), (vec![1], vec![vec![0]]));
    }

    #[test]
    fn strided_copy_widens_inner_runs() {
        // [B=2, S=3, N=4, D=8] -> [B, N, S, D] in bf16: D runs of 16 bytes become one uint4.
        let shape = [2usize, 4, 3, 8];
        let src = strides(&[2, 3, 4, 8]);
        let ss = vec![src[0], src[2], src[1], src[3]];
        let ds = strides(&shape);
        let (st, w, n) = strided_copy(&shape, &ss, &ds, 2, 256, 256).unwrap();
        assert_eq!(w, 16);
        assert_eq!(n, 2 * 4 * 3);
        assert_eq!(st.rank, 3);
        assert_eq!(&st.shape[..3], &[2, 4, 3]);
        assert_eq!(&st.ss[..3], &[12, 1, 4]);
        // misaligned pointer: no widening
        let (_, w, n) = strided_copy(&shape, &ss, &ds, 2, 2, 256).unwrap();
        assert_eq!((w, n), (2, 2 * 4 * 3 * 8));
    }

    #[test]
    fn bcast_and_red() {
        let b = bcast(&[4, 2], &[&[4, 2], &[4, 1]]).unwrap();
        assert_eq!(b.rank, 2);
        assert_eq!(&b.sa[..2], &[2, 1]);
        assert_eq!(&b.sb[..2], &[1, 0]);
        let (r, nout, nred) = red(&[2, 3, 4], &[1]).unwrap();
        assert_eq!((nout, nred), (8, 3));
        assert_eq!(&r.ostride[..2], &[12, 1]);
        assert_eq!(&r.rstride[..1], &[4]);
    }

    #[test]
    fn host_device_round_trip() {
        let t = HostTensor::floats(DType::BF16, vec![3], vec![1.0, -2.5, 0.1]);
        let b = to_device_bytes(&t, DType::BF16);
        assert_eq!(b.len(), 6);
        let back = from_device_bytes(&b, DType::BF16, vec![3]);
        let v = back.to_f64();
        assert_eq!(v[0], 1.0);
        assert_eq!(v[1], -2.5);
        assert!((v[2] - 0.1).abs() < 1e-3);
        let i = HostTensor::ints(DType::I64, vec![2], vec![7, -1]);
        assert_eq!(
            from_device_bytes(&to_device_bytes(&i, DType::I64), DType::I64, vec![2]),
            i
        );
        assert_eq!(fill_pattern(1.0, DType::BF16), 0x3f80);
        assert_eq!(fill_pattern(-1.0, DType::I32), 0xffff_ffff);
    }

    #[test]
    fn struct_layouts_match_the_kernels() {
        // int + pad + 3 arrays of 8 i64
        assert_eq!(std::mem::size_of::<Strided>(), 8 + 3 * 64);
        assert_eq!(std::mem::size_of::<Bcast>(), 8 + 4 * 64);
        assert_eq!(std::mem::size_of::<Red>(), 8 + 4 * 64);
    }
}
