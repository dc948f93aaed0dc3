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
