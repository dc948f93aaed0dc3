//! Host tensors: the neutral in-memory form weights, inputs and results take between
//! crates (frontends load them, runtimes consume and produce them, the CLI writes them).
//! Floats of any dtype are held as f64, integers and bools as i64.

use crate::types::DType;

#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    F64(Vec<f64>),
    I64(Vec<i64>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// The dtype the tensor has in its file or graph (data is widened as above).
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: HostData,
}

impl HostTensor {
    /// SHA-256 (hex) of the dtype, shape and values: equal exactly when the tensors are.
    pub fn digest(&self) -> String {
        let mut bytes = format!("{}{:?}", self.dtype, self.shape).into_bytes();
        match &self.data {
            HostData::F64(v) => v.iter().for_each(|x| bytes.extend(x.to_le_bytes())),
            HostData::I64(v) => v.iter().for_each(|x| bytes.extend(x.to_le_bytes())),
        }
        crate::plan::digest(&bytes)
    }

    pub fn floats(dtype: DType, shape: Vec<usize>, data: Vec<f64>) -> HostTensor {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        HostTensor {
            dtype,
            shape,
            data: HostData::F64(data),
        }
    }

    pub fn ints(dtype: DType, shape: Vec<usize>, data: Vec<i64>) -> HostTensor {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        HostTensor {
            dtype,
            shape,
            data: HostData::I64(data),
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The values as f64 (integers converted).
    pub fn to_f64(&self) -> Vec<f64> {
        match &self.data {
            HostData::F64(v) => v.clone(),
            HostData::I64(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }

    /// The values as i64 (floats truncated).
    pub fn to_i64(&self) -> Vec<i64> {
        match &self.data {
            HostData::F64(v) => v.iter().map(|&x| x as i64).collect(),
            HostData::I64(v) => v.clone(),
        }
    }
}

/// `max |a - b| / max |b|`, `b` the reference: 0 when equal; infinite when the lengths
/// differ, `a` has a NaN, or `b` is all zero while `a` is not.
pub fn max_rel_err(a: &[f64], b: &[f64]) -> f64 {
    if a.len() != b.len() || a.iter().any(|x| x.is_nan()) {
        return f64::INFINITY;
    }
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    let scale = b.iter().map(|y| y.abs()).fold(0.0, f64::max);
    ratio(diff, scale)
}

/// `||a - b|| / ||b||` (Euclidean), `b` the reference, with the edge cases of
/// [`max_rel_err`]: the measure for low-precision results, where single elements round
/// far more than the whole.
pub fn l2_rel_err(a: &[f64], b: &[f64]) -> f64 {
    if a.len() != b.len() || a.iter().any(|x| x.is_nan()) {
        return f64::INFINITY;
    }
    let num = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f64>()
        .sqrt();
    let den = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    ratio(num, den)
}

/// `err / scale`: 0 for no error, infinite for an error against an all-zero reference.
fn ratio(err: f64, scale: f64) -> f64 {
    if err == 0.0 {
        0.0
    } else if scale == 0.0 {
        f64::INFINITY
    } else {
        err / scale
    }
}

impl HostTensor {
    /// [`max_rel_err`] of this tensor against `reference` (infinite when the shapes
    /// differ).
    pub fn max_rel_err(&self, reference: &HostTensor) -> f64 {
        if self.shape != reference.shape {
            return f64::INFINITY;
        }
        max_rel_err(&self.to_f64(), &reference.to_f64())
    }

    /// [`l2_rel_err`] of this tensor against `reference` (infinite when the shapes differ).
    pub fn l2_rel_err(&self, reference: &HostTensor) -> f64 {
        if self.shape != reference.shape {
            return f64::INFINITY;
        }
        l2_rel_err(&self.to_f64(), &reference.to_f64())
    }
}
