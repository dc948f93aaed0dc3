//! Unit tests of the CPU executor: each op against naive hand-written loops, the
//! collectives on a `dp=2,sp=2` mesh, failure handling, gradients against finite
//! differences and across data/sequence parallelism, and HF fixtures.

use super::*;
use weft_ir::{DType, Dim, Graph, HostTensor, Op, Role, TensorType, Value};

mod collectives;
mod grads;
mod llama;
mod ops;

pub(super) fn dims(d: &[i64]) -> Vec<Dim> {
    d.iter().map(|&x| Dim::from(x)).collect()
}

pub(super) fn fty(d: &[i64]) -> TensorType {
    TensorType::new(DType::F32, dims(d))
}

pub(super) fn ity(d: &[i64]) -> TensorType {
    TensorType::new(DType::I64, dims(d))
}

pub(super) fn input(g: &mut Graph, name: &str, ty: TensorType) -> Value {
    g.add(
        Op::Input {
            name: name.into(),
            role: Role::Other,
            ty,
        },
        &[],
    )
    .unwrap()
}

pub(super) fn input_role(g: &mut Graph, name: &str, role: Role, ty: TensorType) -> Value {
    g.add(
        Op::Input {
            name: name.into(),
            role,
            ty,
        },
        &[],
    )
    .unwrap()
}

pub(super) fn param(g: &mut Graph, name: &str, ty: TensorType) -> Value {
    g.add(
        Op::Param {
            name: name.into(),
            ty,
        },
        &[],
    )
    .unwrap()
}

pub(super) fn hf(shape: &[usize], data: Vec<f64>) -> HostTensor {
    HostTensor::floats(DType::F32, shape.to_vec(), data)
}

pub(super) fn hi(shape: &[usize], data: Vec<i64>) -> HostTensor {
    HostTensor::ints(DType::I64, shape.to_vec(), data)
}

pub(super) fn map(items: Vec<(&str, HostTensor)>) -> BTreeMap<String, HostTensor> {
    items.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

pub(super) fn run64(
    g: &Graph,
    w: &BTreeMap<String, HostTensor>,
    i: &BTreeMap<String, HostTensor>,
) -> RunResult {
    run(g, w, i, &RunOptions::new(Precision::F64)).unwrap_or_else(|e| panic!("run failed: {e}"))
}

pub(super) fn out(r: &RunResult, name: &str) -> Vec<f64> {
    r.outputs
        .get(name)
        .unwrap_or_else(|| panic!("no output {name}"))
        .to_f64()
}

#[track_caller]
pub(super) fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "lengths differ");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let ok = (a - b).abs() <= tol * (1.0 + b.abs()) || (a.is_nan() && b.is_nan());
        assert!(
            ok,
            "at {i}: got {a}, want {b} (tol {tol})\n got: {got:?}\nwant: {want:?}"
        );
    }
}

/// A small deterministic generator (tests must not depend on a crate's random stream).
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub(super) fn next_u64(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    pub(super) fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
    pub(super) fn vec(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
    pub(super) fn below(&mut self, n: u64) -> i64 {
        (self.next_u64() % n) as i64
    }
}
