//! Conversions between [`HostTensor`] (the crates' neutral form) and candle tensors in
//! the executor's storage dtypes: floats in the compute dtype, integers as i64, bools as u8.

use super::Precision;
use candle_core::{DType as C, Device, Tensor};
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
pub(crate) fn to_candle(t: &HostTensor, want: DType, p: Precision) -> Result<Tensor, String> {
    let n: usize = t.shape.iter().product();
    let len = match &t.data {
        HostData::F64(v) => v.len(),
        HostData::I64(v) => v.len(),
    };
    if len != n {
        return Err(format!("has {len} elements but its shape {:?} needs {n}", t.shape));
    }
    let have = kind(t.dtype);
    let wk = kind(want);
    let dev = &Device::Cpu;
    let shape = t.shape.as_slice();
    match wk {
        Kind::Float => {
            if have != Kind::Float {
                return Err(format!("is {} but the graph wants {want}", t.dtype));
            }
            let data = t.to_f64();
            let x = Tensor::from_vec(data, shape, dev).map_err(|e| e.to_string())?;
            x.to_dtype(p.float_dtype()).map_err(|e| e.to_string())
        }
        Kind::Int | Kind::Bool => {
            if have == Kind::Float {
                return Err(format!("is {} but the graph wants {want}", t.dtype));
            }
            let data = t.to_i64();
            if wk == Kind::Bool {
                let b: Vec<u8> = data.iter().map(|&v| (v != 0) as u8).collect();
                Tensor::from_vec(b, shape, dev).map_err(|e| e.to_string())
            } else {
                Tensor::from_vec(data, shape, dev).map_err(|e| e.to_string())
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

/// The values of a tensor as f64, row-major (for comparisons and host-side work).
pub(crate) fn values_f64(t: &Tensor) -> Result<Vec<f64>, String> {
    let err = |e: candle_core::Error| e.to_string();
    let flat = t.flatten_all().map_err(err)?;
    Ok(match flat.dtype() {
        C::F64 => flat.to_vec1::<f64>().map_err(err)?,
        C::F32 => flat.to_vec1::<f32>().map_err(err)?.into_iter().map(f64::from).collect(),
        _ => flat.to_dtype(C::F64).and_then(|f| f.to_vec1::<f64>()).map_err(err)?,
    })
}

/// The values of an integer (or bool) tensor, row-major.
pub(crate) fn values_i64(t: &Tensor) -> Result<Vec<i64>, String> {
    let err = |e: candle_core::Error| e.to_string();
    let flat = t.flatten_all().map_err(err)?;
    Ok(match flat.dtype() {
        C::I64 => flat.to_vec1::<i64>().map_err(err)?,
        C::U8 => flat.to_vec1::<u8>().map_err(err)?.into_iter().map(i64::from).collect(),
        _ => flat.to_dtype(C::I64).and_then(|f| f.to_vec1::<i64>()).map_err(err)?,
    })
}
