//! Conversions between [`HostTensor`] (the crates' neutral form) and candle tensors in
//! the executor's storage dtypes: floats in the compute dtype, integers as i64, bools as u8.

use super::Precision;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType as C, Device, Storage, Tensor, Var};
use weft_ir::{DType, HostData, HostTensor};

/// What a value is at run time, whatever its width in the graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Float,
    Int,
    Bool,
}

pub(crate) fn kind(d: DType) -> Kind {
    if d.is_float() {
        Kind::Float
    } else if d == DType::Bool {
        Kind::Bool
    } else {
        Kind::Int
    }
}

pub(crate) fn kind_of(c: C) -> Kind {
    match c {
        C::U8 => Kind::Bool,
        C::I64 | C::U32 => Kind::Int,
        _ => Kind::Float,
    }
}

impl Precision {
    /// The candle dtype every float tensor is computed in.
    pub fn float_dtype(self) -> C {
        match self {
            Precision::F32 => C::F32,
            Precision::F64 => C::F64,
        }
    }
}

/// A host tensor as a candle tensor of graph dtype `want`; checks the dtype kind
/// (integers and bools convert into each other, floats do not) and nothing else.
/// With `var`, the float tensor is made a candle variable (without another copy).
pub(crate) fn to_candle(
    t: &HostTensor,
    want: DType,
    p: Precision,
    var: bool,
) -> Result<Tensor, String> {
    // Raw bytes (a checkpoint's own dtype) are decoded here, one tensor at a time.
    let widened = t.widened();
    let t = widened.as_ref();
    let n: usize = t.shape.iter().product();
    let len = t.data_len();
    if len != n {
        return Err(format!(
            "has {len} elements but its shape {:?} needs {n}",
            t.shape
        ));
    }
    let have = kind(t.dtype);
    let wk = kind(want);
    let dev = &Device::Cpu;
    let shape = t.shape.as_slice();
    let err = |e: candle_core::Error| e.to_string();
    if (wk == Kind::Float) != (have == Kind::Float) {
        return Err(format!("is {} but the graph wants {want}", t.dtype));
    }
    match (&t.data, wk, p) {
        (HostData::F64(v), Kind::Float, Precision::F64) if var => Var::from_slice(v, shape, dev)
            .map(|v| v.as_tensor().clone())
            .map_err(err),
        (HostData::F64(v), Kind::Float, Precision::F32) if var => {
            Var::from_vec(convert(v, |x| x as f32), shape, dev)
                .map(|v| v.as_tensor().clone())
                .map_err(err)
        }
        (HostData::F64(v), Kind::Float, Precision::F64) => {
            Tensor::from_slice(v, shape, dev).map_err(err)
        }
        (HostData::F64(v), Kind::Float, Precision::F32) => {
            Tensor::from_vec(convert(v, |x| x as f32), shape, dev).map_err(err)
        }
        (HostData::I64(v), Kind::Int, _) => Tensor::from_slice(v, shape, dev).map_err(err),
        (HostData::I64(v), Kind::Bool, _) => Tensor::from_vec(
            v.iter().map(|&x| (x != 0) as u8).collect::<Vec<u8>>(),
            shape,
            dev,
        )
        .map_err(err),
        (HostData::I64(v), Kind::Float, _) => {
            let x = Tensor::from_vec(
                v.iter().map(|&x| x as f64).collect::<Vec<f64>>(),
                shape,
                dev,
            )
            .and_then(|x| x.to_dtype(p.float_dtype()))
            .map_err(err)?;
            if var {
                Var::from_tensor(&x)
                    .map(|v| v.as_tensor().clone())
                    .map_err(err)
            } else {
                Ok(x)
            }
        }
        (HostData::Raw(_), _, _) => Err("raw bytes after widening".to_string()),
        (HostData::F64(v), _, _) => {
            let ints: Vec<i64> = v.iter().map(|&x| x as i64).collect();
            let x = Tensor::from_vec(ints, shape, dev).map_err(err)?;
            if wk == Kind::Bool {
                x.ne(0i64).map_err(err)
            } else {
                Ok(x)
            }
        }
    }
}

/// A candle tensor back as a host tensor that says it is of graph dtype `dtype`.
pub(crate) fn to_host(t: &Tensor, dtype: DType) -> Result<HostTensor, String> {
    let shape = t.dims().to_vec();
    Ok(match kind_of(t.dtype()) {
        Kind::Float => HostTensor::floats(dtype, shape, values_f64(t)?),
        Kind::Int | Kind::Bool => HostTensor::ints(dtype, shape, values_i64(t)?),
    })
}

/// `src` mapped elementwise, in parallel when large (the fresh output's page faults
/// dominate the cost of converting big tensors).
fn convert<A: Copy + Sync, B: Send>(src: &[A], f: impl Fn(A) -> B + Sync + Send) -> Vec<B> {
    use rayon::prelude::*;
    if src.len() >= 1 << 16 {
        src.par_iter().map(|&x| f(x)).collect()
    } else {
        src.iter().map(|&x| f(x)).collect()
    }
}

/// The row-major values of a (CPU) tensor, converted by `f` from its storage slice.
fn with_slice<R>(t: &Tensor, f: impl FnOnce(&CpuStorage, usize, usize) -> R) -> Result<R, String> {
    let t = t.contiguous().map_err(|e| e.to_string())?;
    let (st, layout) = t.storage_and_layout();
    let (a, b) = layout
        .contiguous_offsets()
        .ok_or("internal: not contiguous after contiguous()")?;
    match &*st {
        Storage::Cpu(cs) => Ok(f(cs, a, b)),
        _ => Err("internal: not a CPU tensor".into()),
    }
}

/// The values of a tensor as f64, row-major (for comparisons and host-side work).
pub(crate) fn values_f64(t: &Tensor) -> Result<Vec<f64>, String> {
    with_slice(t, |cs, a, b| match cs {
        CpuStorage::F64(v) => Ok(v[a..b].to_vec()),
        CpuStorage::F32(v) => Ok(convert(&v[a..b], |x| x as f64)),
        CpuStorage::I64(v) => Ok(v[a..b].iter().map(|&x| x as f64).collect()),
        CpuStorage::U8(v) => Ok(v[a..b].iter().map(|&x| x as f64).collect()),
        other => Err(format!("internal: unexpected storage {:?}", other.dtype())),
    })?
}

/// The values of an integer (or bool) tensor, row-major.
pub(crate) fn values_i64(t: &Tensor) -> Result<Vec<i64>, String> {
    with_slice(t, |cs, a, b| match cs {
        CpuStorage::I64(v) => Ok(v[a..b].to_vec()),
        CpuStorage::U8(v) => Ok(v[a..b].iter().map(|&x| x as i64).collect()),
        CpuStorage::F32(v) => Ok(v[a..b].iter().map(|&x| x as i64).collect()),
        CpuStorage::F64(v) => Ok(v[a..b].iter().map(|&x| x as i64).collect()),
        other => Err(format!("internal: unexpected storage {:?}", other.dtype())),
    })?
}
