//! Host tensors: the neutral in-memory form weights, inputs and results take between
//! crates (frontends load them, runtimes consume and produce them, the CLI writes them).
//! Computed floats are held as f64, integers and bools as i64; tensors read from a file
//! keep its bytes in their own dtype ([`HostData::Raw`], often a view of the
//! memory-mapped file), so a bf16 checkpoint takes its own size in memory, not four
//! times it. Readers that want numbers decode with [`HostTensor::to_f64`] or
//! [`HostTensor::widened`].

use crate::types::DType;
use std::borrow::Cow;
use std::sync::Arc;

/// Bytes that several tensors can share: a memory-mapped file or a buffer.
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// A tensor's bytes: little-endian values of its dtype, contiguous, row-major; a range
/// of shared bytes (a view of a mapped file costs no copy).
#[derive(Clone)]
pub struct RawBytes {
    owner: SharedBytes,
    start: usize,
    len: usize,
}

impl RawBytes {
    pub fn owned(bytes: Vec<u8>) -> RawBytes {
        let len = bytes.len();
        RawBytes {
            owner: Arc::new(bytes),
            start: 0,
            len,
        }
    }

    /// The bytes `range` of `owner`; `None` when the range lies outside it.
    pub fn shared(owner: SharedBytes, range: std::ops::Range<usize>) -> Option<RawBytes> {
        let total = (*owner).as_ref().len();
        (range.start <= range.end && range.end <= total).then(|| RawBytes {
            owner,
            start: range.start,
            len: range.end - range.start,
        })
    }

    pub fn bytes(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for RawBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RawBytes({} bytes)", self.len)
    }
}

impl PartialEq for RawBytes {
    fn eq(&self, other: &RawBytes) -> bool {
        self.bytes() == other.bytes()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    F64(Vec<f64>),
    I64(Vec<i64>),
    /// The values in the tensor's own dtype, as a file holds them.
    Raw(RawBytes),
}

#[derive(Clone, Debug)]
pub struct HostTensor {
    /// The dtype the tensor has in its file or graph (F64 / I64 data is widened).
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: HostData,
}

/// Equal dtype, shape and values, however they are held (a raw bf16 tensor equals the
/// same values widened to f64).
impl PartialEq for HostTensor {
    fn eq(&self, other: &HostTensor) -> bool {
        if self.dtype != other.dtype || self.shape != other.shape {
            return false;
        }
        match (&self.data, &other.data) {
            (HostData::F64(a), HostData::F64(b)) => a == b,
            (HostData::I64(a), HostData::I64(b)) => a == b,
            (HostData::Raw(a), HostData::Raw(b)) if a == b => true,
            _ if self.dtype.is_float() => self.to_f64() == other.to_f64(),
            _ => self.to_i64() == other.to_i64(),
        }
    }
}

fn bf16_to_f64(bits: u16) -> f64 {
    f32::from_bits((bits as u32) << 16) as f64
}

fn f16_to_f64(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let man = (h & 0x3ff) as f64;
    match exp {
        0 => sign * man * 2f64.powi(-24),
        0x1f if man == 0.0 => sign * f64::INFINITY,
        0x1f => f64::NAN,
        _ => sign * (1.0 + man / 1024.0) * 2f64.powi(exp - 15),
    }
}

/// Decodes little-endian `dtype` values.
fn decode_f64(dtype: DType, b: &[u8]) -> Vec<f64> {
    match dtype {
        DType::F64 => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        DType::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16_to_f64(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| f16_to_f64(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        _ => decode_i64(dtype, b).into_iter().map(|x| x as f64).collect(),
    }
}

fn decode_i64(dtype: DType, b: &[u8]) -> Vec<i64> {
    match dtype {
        DType::I64 => b
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::I32 => b
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64)
            .collect(),
        DType::Bool => b.iter().map(|&x| (x != 0) as i64).collect(),
        _ => decode_f64(dtype, b).into_iter().map(|x| x as i64).collect(),
    }
}

impl HostTensor {
    /// SHA-256 (hex) of the dtype, shape and values: equal exactly when the tensors are.
    pub fn digest(&self) -> String {
        let mut bytes = format!("{}{:?}", self.dtype, self.shape).into_bytes();
        match &self.data {
            HostData::F64(v) => v.iter().for_each(|x| bytes.extend(x.to_le_bytes())),
            HostData::I64(v) => v.iter().for_each(|x| bytes.extend(x.to_le_bytes())),
            // Raw bytes digest as the values they hold (equality compares values).
            HostData::Raw(_) if self.dtype.is_float() => self
                .to_f64()
                .iter()
                .for_each(|x| bytes.extend(x.to_le_bytes())),
            HostData::Raw(_) => self
                .to_i64()
                .iter()
                .for_each(|x| bytes.extend(x.to_le_bytes())),
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

    /// A tensor holding `bytes` in its own dtype; `Err` when their length is not the
    /// shape's element count times the dtype's size.
    pub fn raw(dtype: DType, shape: Vec<usize>, bytes: RawBytes) -> Result<HostTensor, String> {
        let want = shape
            .iter()
            .try_fold(dtype.size_bytes() as usize, |a, &d| a.checked_mul(d));
        if want != Some(bytes.len()) {
            return Err(format!(
                "{} bytes do not hold a {dtype}{shape:?} tensor ({} bytes)",
                bytes.len(),
                want.map_or("too many".to_string(), |w| w.to_string())
            ));
        }
        Ok(HostTensor {
            dtype,
            shape,
            data: HostData::Raw(bytes),
        })
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// How many values the data holds (the shape's count for a well-formed tensor).
    pub fn data_len(&self) -> usize {
        match &self.data {
            HostData::F64(v) => v.len(),
            HostData::I64(v) => v.len(),
            HostData::Raw(b) => b.len() / (self.dtype.size_bytes() as usize).max(1),
        }
    }

    /// The values as f64 (integers converted).
    pub fn to_f64(&self) -> Vec<f64> {
        match &self.data {
            HostData::F64(v) => v.clone(),
            HostData::I64(v) => v.iter().map(|&x| x as f64).collect(),
            HostData::Raw(b) => decode_f64(self.dtype, b.bytes()),
        }
    }

    /// The values as i64 (floats truncated).
    pub fn to_i64(&self) -> Vec<i64> {
        match &self.data {
            HostData::F64(v) => v.iter().map(|&x| x as i64).collect(),
            HostData::I64(v) => v.clone(),
            HostData::Raw(b) => decode_i64(self.dtype, b.bytes()),
        }
    }

    /// The tensor with its values widened (floats to f64, integers and bools to i64):
    /// itself when they already are, a decoded copy of raw bytes otherwise.
    pub fn widened(&self) -> Cow<'_, HostTensor> {
        match &self.data {
            HostData::Raw(_) => Cow::Owned(HostTensor {
                dtype: self.dtype,
                shape: self.shape.clone(),
                data: if self.dtype.is_float() {
                    HostData::F64(self.to_f64())
                } else {
                    HostData::I64(self.to_i64())
                },
            }),
            _ => Cow::Borrowed(self),
        }
    }

    /// The float values to change in place (raw bytes are widened first).
    pub fn f64_mut(&mut self) -> &mut Vec<f64> {
        if !matches!(self.data, HostData::F64(_)) {
            self.data = HostData::F64(self.to_f64());
        }
        match &mut self.data {
            HostData::F64(v) => v,
            _ => unreachable!("just widened"),
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

/// The floor of the set measures ([`set_rel_errs`]), as a fraction of the set's scale.
///
/// A gradient that is exactly zero in theory (the router of top-1 routing, where the
/// weight p/p = 1 whatever p is; a projection whose only path to the loss is masked) is
/// computed as a cancellation of terms no larger than the other gradients of the set,
/// so both sides hold rounding noise of at most that scale times the unit roundoff, and
/// a purely relative error (noise / noise) is anything from 0 to infinity. Measured
/// against 1e-3 of the set's largest gradient instead, such a tensor passes when its
/// error is below `tolerance x 1e-3` of the set's scale: 1e-11 of it at the f64
/// tolerance 1e-8, 1e-7 at the f32 tolerance 1e-4. Rounding noise is below both even in
/// the worst case of f64 (1.1e-16) and near it in f32 (6e-8); measured on top-1
/// mixtral it is 4e-19 of the set's scale in f64 and 2e-10 in f32. A real error stays
/// visible: 1e-3 relative in a gradient 1000x smaller than the largest still fails both.
/// The floor binds only for tensors whose reference is below it, which the reports
/// name as noise-level.
pub const NOISE_FLOOR: f64 = 1e-3;

/// How one tensor's error is measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Measure {
    /// `max |a - b| / max |b|` ([`max_rel_err`]): f64 and f32 programs.
    MaxAbs,
    /// `rms(a - b) / rms(b)` ([`l2_rel_err`]): low-precision programs, where single
    /// elements round far more than the whole.
    L2,
}

impl Measure {
    /// The tensor's magnitude in this measure: max |x|, or the root mean square.
    fn scale(self, x: &[f64]) -> f64 {
        match self {
            Measure::MaxAbs => x.iter().map(|y| y.abs()).fold(0.0, f64::max),
            Measure::L2 if x.is_empty() => 0.0,
            Measure::L2 => (x.iter().map(|y| y * y).sum::<f64>() / x.len() as f64).sqrt(),
        }
    }
}

/// One tensor's error in a set compared together ([`set_rel_errs`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SetErr {
    pub name: String,
    /// The error over `max(scale of the reference, NOISE_FLOOR x the set's scale)`.
    pub err: f64,
    /// The reference is below the floor: the tensor holds rounding noise of a value that
    /// is zero (or negligible) next to the rest of the set.
    pub noise_level: bool,
}

/// The errors of every tensor of `reference` (a set compared together, such as all the
/// gradients of one step) against `got`, each over the larger of its own scale and
/// [`NOISE_FLOOR`] times the largest scale in the set (see there for why). A tensor
/// missing from `got`, of another shape, or with a NaN has an infinite error. In name
/// order.
pub fn set_rel_errs(
    got: &std::collections::BTreeMap<String, HostTensor>,
    reference: &std::collections::BTreeMap<String, HostTensor>,
    measure: Measure,
) -> Vec<SetErr> {
    let refs: Vec<(&String, Vec<f64>)> = reference.iter().map(|(n, t)| (n, t.to_f64())).collect();
    let set_scale = refs
        .iter()
        .map(|(_, b)| measure.scale(b))
        .fold(0.0, f64::max);
    let floor = NOISE_FLOOR * set_scale;
    refs.into_iter()
        .map(|(name, b)| {
            let own = measure.scale(&b);
            let err = match got.get(name) {
                Some(a) if a.shape == reference[name].shape => {
                    let a = a.to_f64();
                    if a.len() != b.len() || a.iter().any(|x| x.is_nan()) {
                        f64::INFINITY
                    } else {
                        let diff: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
                        ratio(measure.scale(&diff), own.max(floor))
                    }
                }
                _ => f64::INFINITY,
            };
            SetErr {
                name: name.clone(),
                err,
                noise_level: own < floor,
            }
        })
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn t(v: &[f64]) -> HostTensor {
        HostTensor::floats(crate::DType::F64, vec![v.len()], v.to_vec())
    }

    fn set(items: &[(&str, &[f64])]) -> BTreeMap<String, HostTensor> {
        items.iter().map(|(n, v)| (n.to_string(), t(v))).collect()
    }

    #[test]
    fn a_gradient_zero_in_theory_is_measured_against_the_floor() {
        // `router` is zero in theory: both sides hold rounding noise of 1e-17.
        let want = set(&[("big", &[1.0, -2.0]), ("router", &[1e-17, -3e-17])]);
        let got = set(&[("big", &[1.0, -2.0 + 4e-16]), ("router", &[-2e-17, 1e-17])]);
        // Purely relative, the noise is a 100% error.
        assert!(got["router"].max_rel_err(&want["router"]) > 1.0);
        let errs = set_rel_errs(&got, &want, Measure::MaxAbs);
        assert_eq!(errs[0].name, "big");
        assert!(
            !errs[0].noise_level && errs[0].err > 0.0 && errs[0].err < 1e-15,
            "{:?}",
            errs[0]
        );
        // max |diff| 4e-17 over the floor 1e-3 x 2.
        assert_eq!(errs[1].name, "router");
        assert!(errs[1].noise_level);
        assert!((errs[1].err - 2e-14).abs() < 1e-20, "{}", errs[1].err);
    }

    #[test]
    fn real_errors_in_small_gradients_still_show() {
        // A gradient 1e4 below the largest with a 1% error: 1e-2 x 1e-4 / 1e-3 = 1e-3.
        let want = set(&[("big", &[1.0]), ("small", &[1e-4, -1e-4])]);
        let got = set(&[("big", &[1.0]), ("small", &[1.01e-4, -1e-4])]);
        let e = &set_rel_errs(&got, &want, Measure::MaxAbs)[1];
        assert!(e.noise_level && (e.err - 1e-3).abs() < 1e-12, "{e:?}");
        // Above the floor, the measure is the plain relative one.
        let want = set(&[("big", &[1.0]), ("mid", &[1e-2])]);
        let got = set(&[("big", &[1.0]), ("mid", &[1.01e-2])]);
        let e = &set_rel_errs(&got, &want, Measure::MaxAbs)[1];
        assert!(!e.noise_level);
        assert_eq!(e.err, got["mid"].max_rel_err(&want["mid"]));
    }

    #[test]
    fn missing_misshaped_and_nan_are_infinite() {
        let want = set(&[("a", &[1.0, 2.0]), ("b", &[1.0]), ("c", &[0.0])]);
        let got = set(&[("a", &[1.0]), ("c", &[f64::NAN])]);
        let errs = set_rel_errs(&got, &want, Measure::L2);
        assert!(errs.iter().all(|e| e.err == f64::INFINITY), "{errs:?}");
        // All zero on both sides: no error.
        let z = set(&[("z", &[0.0, 0.0])]);
        assert_eq!(set_rel_errs(&z, &z, Measure::MaxAbs)[0].err, 0.0);
    }

    #[test]
    fn the_l2_measure_uses_root_mean_squares() {
        let want = set(&[("big", &[3.0, 4.0]), ("zero", &[0.0, 0.0, 0.0, 0.0])]);
        let got = set(&[("big", &[3.0, 4.0]), ("zero", &[1e-6, 0.0, 0.0, 0.0])]);
        let e = &set_rel_errs(&got, &want, Measure::L2)[1];
        // rms(diff) = 5e-7; floor = 1e-3 x rms(3, 4) = 1e-3 x 3.5355.
        let rms_big = (12.5f64).sqrt();
        assert!(
            e.noise_level && (e.err - 5e-7 / (1e-3 * rms_big)).abs() < 1e-12,
            "{e:?}"
        );
    }
}
