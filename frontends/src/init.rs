//! Seeded random weights at HF's init scale: normal(0, `initializer_range`) for linear,
//! embedding, router and expert weights, ones for norm weights, zeros for biases. Each
//! parameter has its own stream (seed and name hashed), so adding a layer does not
//! change the others. Only IEEE-exact arithmetic is used (splitmix64, the polar
//! Box-Muller method, a series logarithm), so values are identical on every platform;
//! each is rounded to the parameter's dtype. An embedding's `padding_idx` row is zero,
//! as HF's `_init_weights` leaves it.

use crate::model::Model;
use crate::weights::floats::round_to;
use std::collections::BTreeMap;
use weft_ir::HostTensor;

/// Random weights for every parameter of `model`, keyed by parameter name.
pub fn random_weights(model: &Model, seed: u64) -> BTreeMap<String, HostTensor> {
    random_weights_observed(model, seed, &mut |_| {})
}

/// [`random_weights`], calling `drawn` with the number of elements drawn so far after
/// each parameter (for a progress display; the total is [`Model::param_count`]).
pub fn random_weights_observed(
    model: &Model,
    seed: u64,
    drawn: &mut dyn FnMut(u64),
) -> BTreeMap<String, HostTensor> {
    let mut done = 0u64;
    let std = model.initializer_range();
    let padding_rows = padding_rows(&model.graph);
    let mut out = BTreeMap::new();
    for (name, ty) in model.params() {
        // `Model` guarantees constant parameter shapes. A parameter a compiled program
        // holds split (`partition`) is drawn at its full size: weights are full
        // tensors, which the runtime cuts per rank.
        let mut shape: Vec<usize> = ty
            .shape
            .iter()
            .map(|d| d.as_const().unwrap_or(0).max(0) as usize)
            .collect();
        for p in model.graph.param_partition(&name) {
            if let Some(d) = shape.get_mut(p.dim) {
                *d = p.full_size().max(0) as usize;
            }
        }
        let n: usize = shape.iter().product();
        if !ty.dtype.is_float() {
            out.insert(name, HostTensor::ints(ty.dtype, shape, vec![0; n]));
            continue;
        }
        let mut data = match init_kind(&name) {
            Kind::Zeros => vec![0.0; n],
            Kind::Ones => vec![1.0; n],
            Kind::Normal => {
                let mut rng = Normal::new(seed ^ fnv1a(&name));
                (0..n)
                    .map(|_| round_to(ty.dtype, std * rng.next()))
                    .collect()
            }
        };
        if let (Some(&row), [_, h]) = (padding_rows.get(&name), shape.as_slice()) {
            if let Some(r) = data.get_mut(row * h..(row + 1) * h) {
                r.fill(0.0);
            }
        }
        out.insert(name, HostTensor::floats(ty.dtype, shape, data));
        done += n as u64;
        drawn(done);
    }
    // Checkpoint buffers start as HF initialises them: deepseek_v3's correction bias is zero.
    for (name, ty) in model.buffers() {
        let shape: Vec<usize> = ty
            .shape
            .iter()
            .map(|d| d.as_const().unwrap_or(0).max(0) as usize)
            .collect();
        let n = shape.iter().product();
        out.insert(name, HostTensor::floats(ty.dtype, shape, vec![0.0; n]));
    }
    out
}

/// The `padding_idx` row of each embedding table parameter.
fn padding_rows(g: &weft_ir::Graph) -> BTreeMap<String, usize> {
    let mut rows = BTreeMap::new();
    for &n in g.nodes() {
        let node = g.node(n);
        let weft_ir::Op::Embedding {
            padding_idx: Some(p),
        } = &node.op
        else {
            continue;
        };
        if let (Some(p), Some(weft_ir::Op::Param { name, .. })) = (
            p.as_const().and_then(|p| usize::try_from(p).ok()),
            node.operands.get(1).map(|&w| g.op_of(w)),
        ) {
            rows.insert(name.clone(), p);
        }
    }
    rows
}

enum Kind {
    Zeros,
    Ones,
    Normal,
}

/// Biases are zero; the weights of `*norm` modules one; everything else normal.
fn init_kind(name: &str) -> Kind {
    if name.ends_with(".bias") {
        return Kind::Zeros;
    }
    let module = crate::build::params::module_of(name);
    let last = module.rsplit('.').next().unwrap_or(module);
    if name.ends_with(".weight") && last.ends_with("norm") {
        Kind::Ones
    } else {
        Kind::Normal
    }
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Standard normal deviates from splitmix64 by the polar method.
struct Normal {
    state: u64,
    spare: Option<f64>,
}

impl Normal {
    fn new(seed: u64) -> Normal {
        Normal {
            state: seed,
            spare: None,
        }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (-1, 1) on a 2^-52 grid.
    fn symmetric(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 52) as f64) - 1.0
    }

    fn next(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        loop {
            let (u, v) = (self.symmetric(), self.symmetric());
            let s = u * u + v * v;
            if s > 0.0 && s < 1.0 {
                let f = (-2.0 * ln(s) / s).sqrt();
                self.spare = Some(v * f);
                return u * f;
            }
        }
    }
}

/// Natural log of a positive normal `x` by `2 atanh((m-1)/(m+1))` on the mantissa.
fn ln(x: f64) -> f64 {
    const LN_2: f64 = std::f64::consts::LN_2;
    let bits = x.to_bits();
    let mut e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & 0x000f_ffff_ffff_ffff) | 0x3ff0_0000_0000_0000);
    if m > std::f64::consts::SQRT_2 {
        m /= 2.0;
        e += 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let (mut term, mut sum, mut k) = (s, 0.0, 1.0);
    for _ in 0..24 {
        sum += term / k;
        term *= s2;
        k += 2.0;
    }
    2.0 * sum + e as f64 * LN_2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_log_matches_std() {
        for x in [1e-12, 0.001, 0.3, 0.5, 0.7, 0.9, 0.999999, 1.0] {
            let (a, b) = (ln(x), x.ln());
            assert!(
                (a - b).abs() <= 4.0 * f64::EPSILON * b.abs().max(1.0),
                "ln({x}): {a} vs {b}"
            );
        }
    }

    #[test]
    fn normal_has_unit_moments_and_fixed_values() {
        let mut r = Normal::new(42);
        let xs: Vec<f64> = (0..200_000).map(|_| r.next()).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / xs.len() as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "var {var}");
        // Pinned: the stream must not change across platforms or versions.
        let mut r = Normal::new(7);
        let first: Vec<String> = (0..3).map(|_| format!("{:.12}", r.next())).collect();
        assert_eq!(
            first.join(" "),
            "-0.041741523381 -0.183080209109 0.876481469099"
        );
    }
}
