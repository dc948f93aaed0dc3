//! Tensor types: an element dtype and a shape of symbolic dims, printed `bf16[B, S/4, 4096]`.

use crate::dim::{Bindings, Dim, DimError};
use std::fmt;

#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F64,
    F32,
    BF16,
    F16,
    I64,
    I32,
    Bool,
}

impl DType {
    pub const ALL: [DType; 7] = [
        DType::F64,
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::I64,
        DType::I32,
        DType::Bool,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::Bool => "bool",
        }
    }

    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }

    pub fn size_bytes(self) -> u64 {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::Bool => 1,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::BF16 | DType::F16)
    }

    pub fn is_int(self) -> bool {
        matches!(self, DType::I64 | DType::I32)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Vec<Dim>,
}

impl TensorType {
    pub fn new(dtype: DType, shape: Vec<Dim>) -> Self {
        TensorType { dtype, shape }
    }

    pub fn scalar(dtype: DType) -> Self {
        TensorType {
            dtype,
            shape: vec![],
        }
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    pub fn with_dtype(&self, dtype: DType) -> Self {
        TensorType {
            dtype,
            shape: self.shape.clone(),
        }
    }

    pub fn with_shape(&self, shape: Vec<Dim>) -> Self {
        TensorType {
            dtype: self.dtype,
            shape,
        }
    }

    /// Number of elements, symbolically.
    pub fn numel(&self) -> Dim {
        self.shape.iter().fold(Dim::from(1), |a, d| a * d.clone())
    }

    /// Concrete shape under the given bindings.
    /// Concrete shape under the given bindings; a negative size is an error.
    pub fn concrete_shape(&self, b: &Bindings) -> Result<Vec<usize>, DimError> {
        self.shape
            .iter()
            .map(|d| {
                let v = d.eval(b)?;
                usize::try_from(v).map_err(|_| DimError::Negative {
                    dim: d.to_string(),
                    value: v,
                })
            })
            .collect()
    }

    /// Bytes under the given bindings, counted with checked arithmetic.
    pub fn size_bytes(&self, b: &Bindings) -> Result<u64, DimError> {
        let overflow = || DimError::Overflow(format!("the bytes of {self}"));
        self.concrete_shape(b)?
            .iter()
            .try_fold(self.dtype.size_bytes(), |acc, &n| acc.checked_mul(n as u64))
            .ok_or_else(overflow)
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.shape.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, "]")
    }
}

impl fmt::Debug for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}
