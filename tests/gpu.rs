//! GPU checks of the CUDA backend (feature `cuda`): every kernel against the CPU reference
//! runtime on random inputs (odd sizes, f32 and bf16), tiny llama / qwen3 / mixtral
//! forwards, and (with autodiff) a joint forward+backward program; prints one table.
//! Each case is a small program in the text IR, lowered to an ExecutionPlan and run by
//! the CUDA executor (arena poisoned with NaN first, so an unwritten output fails) and
//! by the CPU reference in f64.
//!
//! Without a GPU (CI) every case still parses, lowers to a plan and runs on the CPU
//! reference; the GPU half reports "skipped". `WEFT_GPU_BENCH=1` adds timings (GEMM,
//! attention forward/backward, Weft's kernels beside cuDNN's). Run with `--nocapture` to
//! see the table.
//!
//! bf16 attention cases also run cuDNN's fused flash attention (`Attn::Cudnn`). libcudnn
//! is loaded at run time; on the GPU machine it is the pip package in /opt/torch/.venv:
//! `export LD_LIBRARY_PATH=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cudnn/lib)`.
//! Without it the cuDNN rows say "skipped: cuDNN absent" and pass.

use std::collections::BTreeMap;
use weft_ir::{DType, Graph, HostTensor};
use weft_runtime::cpu::{self, Precision, RunOptions};

struct Case {
    name: String,
    text: String,
    tol: f64,
    positive: bool,
    /// Integer inputs: name -> (lo, hi) values drawn uniformly in [lo, hi); `ignore`
    /// replaces about one in five by -100.
    ints: BTreeMap<String, (i64, i64, bool)>,
    /// Float params drawn as one-hot-ish probabilities etc. are not needed; scale of floats.
    scale: f64,
}

impl Case {
    fn new(name: impl Into<String>, text: impl Into<String>) -> Case {
        Case {
            name: name.into(),
            text: text.into(),
            tol: 1e-4,
            positive: false,
            ints: BTreeMap::new(),
            scale: 1.0,
        }
    }
    fn tol(mut self, t: f64) -> Case {
        self.tol = t;
        self
    }
    fn positive(mut self) -> Case {
        self.positive = true;
        self
    }
    fn ints(mut self, name: &str, lo: i64, hi: i64) -> Case {
        self.ints.insert(name.into(), (lo, hi, false));
        self
    }
    fn labels(mut self, name: &str, lo: i64, hi: i64) -> Case {
        self.ints.insert(name.into(), (lo, hi, true));
        self
    }
    #[allow(dead_code)]
    fn scale(mut self, s: f64) -> Case {
        self.scale = s;
        self
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Rounds to the nearest bf16 (ties to even), through f32.
fn bf16(x: f64) -> f64 {
    let b = (x as f32).to_bits();
    if (x as f32).is_nan() {
        return x;
    }
    let r = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
    f32::from_bits(r) as f64
}

fn round(d: DType, x: f64) -> f64 {
    match d {
        DType::BF16 => bf16(x),
        DType::F32 | DType::F16 => x as f32 as f64,
        _ => x,
    }
}

fn draw(
    c: &Case,
    g: &Graph,
    rng: &mut Rng,
) -> (BTreeMap<String, HostTensor>, BTreeMap<String, HostTensor>) {
    let mut w = BTreeMap::new();
    let mut x = BTreeMap::new();
    let shape_of = |v: weft_ir::Value| -> Vec<usize> {
        g.ty(v)
            .shape
            .iter()
            .map(|d| d.as_const().unwrap_or(1) as usize)
            .collect()
    };
    let make = |name: &str, v: weft_ir::Value, rng: &mut Rng| -> HostTensor {
        let ty = g.ty(v);
        let shape = shape_of(v);
        let n: usize = shape.iter().product();
        if let Some(&(lo, hi, ignore)) = c.ints.get(name) {
            let vals: Vec<i64> = (0..n)
                .map(|_| {
                    if ignore && rng.next() % 5 == 0 {
                        -100
                    } else {
                        lo + (rng.next() % (hi - lo) as u64) as i64
                    }
                })
                .collect();
            return HostTensor::ints(ty.dtype, shape, vals);
        }
        if ty.dtype == DType::Bool {
            return HostTensor::ints(
                DType::Bool,
                shape,
                (0..n).map(|_| (rng.next() % 4 != 0) as i64).collect(),
            );
        }
        if !ty.dtype.is_float() {
            return HostTensor::ints(
                ty.dtype,
                shape,
                (0..n).map(|_| (rng.next() % 7) as i64).collect(),
            );
        }
        let vals: Vec<f64> = (0..n)
            .map(|_| {
                let u = rng.unit();
                let v = if c.positive {
                    0.2 + 1.8 * u
                } else {
                    4.0 * u - 2.0
                };
                round(ty.dtype, v * c.scale)
            })
            .collect();
        HostTensor::floats(ty.dtype, shape, vals)
    };
    for (name, v) in g.params() {
        let t = make(&name, v, rng);
        w.insert(name, t);
    }
    for (name, _, v) in g.inputs() {
        let t = make(&name, v, rng);
        x.insert(name, t);
    }
    (w, x)
}

fn plan_of(g: &Graph, b: i64, s: i64) -> Result<weft_ir::ExecutionPlan, String> {
    let mut opts = weft_passes::plan::PlanOptions::new(b, s);
    opts.device_memory = 139 << 30;
    weft_passes::plan::lower(g, &opts).map_err(|e| e.to_string())
}

fn cpu_ref(
    g: &Graph,
    w: &BTreeMap<String, HostTensor>,
    x: &BTreeMap<String, HostTensor>,
    b: i64,
    s: i64,
) -> Result<BTreeMap<String, HostTensor>, String> {
    let opts = RunOptions::new(Precision::F64).bind("B", b).bind("S", s);
    cpu::run(g, w, x, &opts)
        .map(|r| r.outputs)
        .map_err(|e| e.to_string())
}

// ---------------------------------------------------------------- cases

fn op_cases() -> Vec<Case> {
    let mut v = Vec::new();
    for (dt, tol) in [("f32", 1e-5), ("bf16", 1.5e-2)] {
        for (op, pos) in [
            ("neg", false),
            ("exp", false),
            ("log", true),
            ("sqrt", true),
            ("rsqrt", true),
            ("tanh", false),
            ("sigmoid", false),
            ("silu", false),
            ("relu", false),
        ] {
            let mut c = Case::new(format!("{op} {dt}[37, 129]"), format!("graph \"t\"\n%0: {dt}[37, 129] = param {{name=\"x\"}}\n%1: {dt}[37, 129] = {op} %0\nreturn out=%1\n")).tol(tol);
            if pos {
                c = c.positive();
            }
            v.push(c);
        }
        if dt == "bf16" {
            // Large enough that the 8-wide kernel's grid-stride loop runs several rounds.
            v.push(Case::new("silu/exp/sigmoid bf16[4096, 2048] (8-wide, grid-stride)", "graph \"t\"\n%0: bf16[4096, 2048] = param {name=\"x\"}\n%1: bf16[4096, 2048] = silu %0\n%2: bf16[4096, 2048] = exp %0\n%3: bf16[4096, 2048] = sigmoid %0\nreturn a=%1, b=%2, c=%3\n").tol(tol));
        }
        v.push(Case::new(format!("gelu {dt}"), format!("graph \"t\"\n%0: {dt}[7, 33] = param {{name=\"x\"}}\n%1: {dt}[7, 33] = gelu %0 {{tanh_approx=false}}\n%2: {dt}[7, 33] = gelu %0 {{tanh_approx=true}}\nreturn a=%1, b=%2\n")).tol(tol));
        v.push(Case::new(format!("scale/add_scalar/pow_scalar {dt}"), format!("graph \"t\"\n%0: {dt}[5, 17] = param {{name=\"x\"}}\n%1: {dt}[5, 17] = scale %0 {{factor=0.37}}\n%2: {dt}[5, 17] = add_scalar %1 {{value=1.5}}\n%3: {dt}[5, 17] = pow_scalar %0 {{exponent=2.0}}\nreturn a=%2, b=%3\n")).tol(tol));
        for op in ["add", "sub", "mul", "div", "maximum", "minimum"] {
            v.push(
                Case::new(
                    format!("{op} {dt} (same, row and column broadcast)"),
                    format!(
                        "graph \"t\"\n%0: {dt}[3, 5, 7] = param {{name=\"a\"}}\n%1: {dt}[3, 5, 7] = param {{name=\"b\"}}\n%2: {dt}[7] = param {{name=\"r\"}}\n%3: {dt}[3, 5, 1] = param {{name=\"c\"}}\n%4: {dt}[3, 5, 7] = {op} %0, %1\n%5: {dt}[3, 5, 7] = {op} %0, %2\n%6: {dt}[3, 5, 7] = {op} %3, %1\nreturn x=%4, y=%5, z=%6\n"
                    ),
                )
                .positive()
                .tol(tol),
            );
        }
        v.push(Case::new(format!("sum/mean/max {dt}"), format!("graph \"t\"\n%0: {dt}[6, 5, 33] = param {{name=\"x\"}}\n%1: {dt}[6, 5, 1] = sum %0 {{dims=[-1], keepdim=true}}\n%2: {dt}[5] = mean %0 {{dims=[0, 2], keepdim=false}}\n%3: {dt}[6, 33] = max %0 {{dims=[1], keepdim=false}}\nreturn a=%1, b=%2, c=%3\n")).tol(tol));
        v.push(Case::new(format!("sum/mean/max {dt} (few outputs of long reductions: a block per output)"), format!("graph \"t\"\n%0: {dt}[3, 5000] = param {{name=\"x\"}}\n%1: {dt}[3] = sum %0 {{dims=[-1], keepdim=false}}\n%2: {dt}[5000] = param {{name=\"y\"}}\n%3: {dt}[] = mean %2 {{dims=[0], keepdim=false}}\n%4: {dt}[3] = max %0 {{dims=[1], keepdim=false}}\n%5: {dt}[2, 4100, 3] = param {{name=\"z\"}}\n%6: {dt}[3] = sum %5 {{dims=[0, 1], keepdim=false}}\nreturn a=%1, b=%3, c=%4, d=%6\n")).tol(tol));
        v.push(Case::new(format!("softmax/log_softmax {dt}"), format!("graph \"t\"\n%0: {dt}[9, 1001] = param {{name=\"x\"}}\n%1: {dt}[9, 1001] = softmax %0 {{dim=-1}}\n%2: {dt}[9, 1001] = log_softmax %0 {{dim=-1}}\nreturn a=%1, b=%2\n")).tol(tol));
        v.push(Case::new(format!("embedding {dt}"), format!("graph \"t\"\n%0: i64[3, 7] = input {{name=\"ids\", role=other}}\n%1: {dt}[11, 40] = param {{name=\"w\"}}\n%2: {dt}[3, 7, 40] = embedding %0, %1\nreturn a=%2\n")).ints("ids", 0, 11).tol(tol));
        v.push(Case::new(format!("embedding_grad {dt} into an init (the tied lm_head's gradient)"), format!("graph \"t\"\n%0: i64[3, 7] = input {{name=\"ids\", role=other}}\n%1: {dt}[3, 7, 40] = param {{name=\"dy\"}}\n%2: {dt}[11, 40] = param {{name=\"init\"}}\n%3: {dt}[11, 40] = embedding_grad %0, %1, %2 {{num_embeddings=11}}\n%4: {dt}[11, 40] = embedding_grad %0, %1 {{num_embeddings=11}}\n%5: {dt}[11, 40] = add %4, %2\nreturn y=%3, unfused=%5\n")).ints("ids", 0, 11).tol(tol * 2.0));
        v.push(Case::new(format!("linear {dt} (+bias)"), format!("graph \"t\"\n%0: {dt}[3, 13, 72] = param {{name=\"x\"}}\n%1: {dt}[40, 72] = param {{name=\"w\"}}\n%2: {dt}[40] = param {{name=\"b\"}}\n%3: {dt}[3, 13, 40] = linear %0, %1\n%4: {dt}[3, 13, 40] = linear %0, %1, %2\nreturn a=%3, b=%4\n")).tol(tol * 2.0));
        v.push(Case::new(format!("matmul {dt} (batched, transposes, shared b)"), format!("graph \"t\"\n%0: {dt}[4, 9, 24] = param {{name=\"a\"}}\n%1: {dt}[4, 24, 10] = param {{name=\"b\"}}\n%2: {dt}[4, 10, 24] = param {{name=\"bt\"}}\n%3: {dt}[24, 10] = param {{name=\"s\"}}\n%4: {dt}[4, 9, 10] = matmul %0, %1 {{transpose_a=false, transpose_b=false}}\n%5: {dt}[4, 9, 10] = matmul %0, %2 {{transpose_a=false, transpose_b=true}}\n%6: {dt}[4, 9, 10] = matmul %0, %3 {{transpose_a=false, transpose_b=false}}\n%7: {dt}[4, 24, 24] = matmul %0, %0 {{transpose_a=true, transpose_b=false}}\nreturn a=%4, b=%5, c=%6, d=%7\n")).tol(tol * 2.0));
        v.push(Case::new(format!("rms_norm {dt}"), format!("graph \"t\"\n%0: {dt}[5, 3, 257] = param {{name=\"x\"}}\n%1: {dt}[257] = param {{name=\"w\"}}\n%2: {dt}[5, 3, 257] = rms_norm %0, %1 {{eps=1e-5}}\nreturn a=%2\n")).tol(tol));
        v.push(Case::new(format!("rope_table + rope {dt} (partial rotary, llama3 scaling)"), format!("graph \"t\"\n%0: i64[2, 11] = input {{name=\"pos\", role=other}}\n%1: f32[2, 11, 12], %2: f32[2, 11, 12] = rope_table %0 {{theta=10000.0, dim=12, scaling=llama3(8.0, 1.0, 4.0, 16)}}\n%3: {dt}[2, 3, 11, 16] = param {{name=\"x\"}}\n%4: {dt}[2, 3, 11, 16] = rope %3, %1, %2\nreturn a=%4, c=%1, s=%2\n")).ints("pos", 0, 50).tol(tol));
        v.push(Case::new(format!("rope_table + rope {dt} (11 heads: a full and a partial block of heads)"), format!("graph \"t\"\n%0: i64[1, 37] = input {{name=\"pos\", role=other}}\n%1: f32[1, 37, 64], %2: f32[1, 37, 64] = rope_table %0 {{theta=500000.0, dim=64, scaling=none}}\n%3: {dt}[1, 11, 37, 64] = param {{name=\"x\"}}\n%4: {dt}[1, 11, 37, 64] = rope %3, %1, %2\nreturn a=%4\n")).ints("pos", 0, 64).tol(tol));
        v.push(Case::new(format!("rope_table + rope {dt} (7 heads over 2048 positions: several heads per block, the last group partial; partial rotary; both layouts)"), format!("graph \"t\"\n%0: i64[1, 2048] = input {{name=\"pos\", role=other}}\n%1: f32[1, 2048, 48], %2: f32[1, 2048, 48] = rope_table %0 {{theta=10000.0, dim=48, scaling=none}}\n%3: {dt}[1, 7, 2048, 64] = param {{name=\"x\"}}\n%4: {dt}[1, 7, 2048, 64] = rope %3, %1, %2\n%5: {dt}[1, 2048, 7, 64] = param {{name=\"y\"}}\n%6: {dt}[1, 2048, 7, 64] = rope %5, %1, %2 {{layout=bshd}}\nreturn a=%4, b=%6\n")).ints("pos", 0, 64).tol(tol));
        v.push(Case::new(format!("rope_table + rope {dt} layout=bshd (partial rotary; the flat kernel past 512 pairs)"), format!("graph \"t\"\n%0: i64[2, 11] = input {{name=\"pos\", role=other}}\n%1: f32[2, 11, 12], %2: f32[2, 11, 12] = rope_table %0 {{theta=10000.0, dim=12, scaling=none}}\n%3: {dt}[2, 11, 3, 16] = param {{name=\"x\"}}\n%4: {dt}[2, 11, 3, 16] = rope %3, %1, %2 {{layout=bshd}}\n%5: f32[2, 11, 1026], %6: f32[2, 11, 1026] = rope_table %0 {{theta=10000.0, dim=1026, scaling=none}}\n%7: {dt}[2, 11, 2, 1026] = param {{name=\"y\"}}\n%8: {dt}[2, 11, 2, 1026] = rope %7, %5, %6 {{layout=bshd}}\nreturn a=%4, b=%8\n")).ints("pos", 0, 50).tol(tol));
        v.push(Case::new(format!("cross_entropy {dt} none/sum/mean + shift_labels + count_valid"), format!("graph \"t\"\n%0: {dt}[2, 9, 517] = param {{name=\"x\"}}\n%1: i64[2, 9] = input {{name=\"l\", role=labels}}\n%2: i64[2, 9] = shift_labels %1 {{ignore_index=-100}}\n%3: f32[2, 9] = cross_entropy %0, %2 {{ignore_index=-100, reduction=none}}\n%4: f32[] = cross_entropy %0, %2 {{ignore_index=-100, reduction=sum}}\n%5: f32[] = cross_entropy %0, %2 {{ignore_index=-100, reduction=mean}}\n%6: f32[] = count_valid %2 {{ignore_index=-100}}\nreturn a=%3, b=%4, c=%5, d=%6, e=%2\n")).labels("l", 0, 517).tol(tol));
        v.push(Case::new(format!("layout {dt}: transpose, permute, slice, concat, split, expand, reshape"), format!("graph \"t\"\n%0: {dt}[2, 5, 3, 8] = param {{name=\"x\"}}\n%1: {dt}[2, 3, 5, 8] = transpose %0 {{dim0=1, dim1=2}}\n%2: {dt}[8, 2, 3, 5] = permute %0 {{perm=[3, 0, 2, 1]}}\n%3: {dt}[2, 2, 3, 8] = slice %0 {{dim=1, start=2, len=2}}\n%4: {dt}[2, 7, 3, 8] = concat %0, %3 {{dim=1}}\n%5: {dt}[2, 5, 3, 3], %6: {dt}[2, 5, 3, 5] = split %0 {{dim=3, sizes=[3, 5]}}\n%7: {dt}[1, 5, 1] = param {{name=\"e\"}}\n%8: {dt}[4, 5, 6] = expand %7 {{shape=[4, 5, 6]}}\n%9: {dt}[10, 24] = reshape %0 {{shape=[10, 24]}}\nreturn a=%1, b=%2, c=%3, d=%4, e=%5, f=%6, g=%8, h=%9\n")).tol(0.0));
        v.push(Case::new(format!("compare/where/cast {dt}"), format!("graph \"t\"\n%0: {dt}[4, 33] = param {{name=\"a\"}}\n%1: {dt}[4, 33] = param {{name=\"b\"}}\n%2: bool[4, 33] = compare %0, %1 {{op=lt}}\n%3: {dt}[4, 33] = where %2, %0, %1\n%4: f32[4, 33] = cast %0 {{dtype=f32}}\n%5: i64[4, 33] = cast %2 {{dtype=i64}}\nreturn a=%3, b=%4, c=%5, d=%2\n")).tol(tol));
        v.push(Case::new(format!("topk/gather/index_select/one_hot/scatter_add {dt}"), format!("graph \"t\"\n%0: {dt}[13, 8] = param {{name=\"x\"}}\n%1: {dt}[13, 3], %2: i64[13, 3] = topk %0 {{k=3, dim=-1}}\n%3: {dt}[13, 3] = gather %0, %2 {{dim=1}}\n%4: i64[5] = input {{name=\"i\", role=other}}\n%5: {dt}[5, 8] = index_select %0, %4 {{dim=0}}\n%6: f32[13, 3, 8] = one_hot %2 {{num_classes=8, dtype=f32}}\n%7: {dt}[13, 8] = scatter_add %0, %2, %1 {{dim=1}}\nreturn a=%1, b=%2, c=%3, d=%5, e=%6, f=%7\n")).ints("i", 0, 13).tol(tol));
        v.push(Case::new(format!("moe dispatch/grouped_matmul/combine {dt}"), format!("graph \"t\"\n%0: {dt}[19, 24] = param {{name=\"x\"}}\n%1: i64[19, 2] = input {{name=\"e\", role=other}}\n%2: {dt}[19, 2] = param {{name=\"wt\"}}\n%3: {dt}[5, 40, 24] = param {{name=\"w\"}}\n%4: {dt}[38, 24], %5: i64[5], %6: i64[38] = moe_dispatch %0, %1 {{num_experts=5}}\n%7: {dt}[38, 40] = grouped_matmul %4, %3, %5\n%8: {dt}[38, 24] = slice %7 {{dim=1, start=0, len=24}}\n%9: {dt}[19, 24] = moe_combine %8, %6, %2\nreturn a=%4, b=%5, c=%6, d=%7, f=%9\n")).ints("e", 0, 5).tol(tol * 2.0));
        // backward ops
        v.push(Case::new(format!("rms_norm_grad {dt}"), format!("graph \"t\"\n%0: {dt}[5, 3, 257] = param {{name=\"x\"}}\n%1: {dt}[257] = param {{name=\"w\"}}\n%2: {dt}[5, 3, 257] = param {{name=\"dy\"}}\n%3: {dt}[5, 3, 257], %4: {dt}[257] = rms_norm_grad %0, %1, %2 {{eps=1e-5}}\nreturn dx=%3, dw=%4\n")).tol(tol * 2.0));
        // linear_cross_entropy (+ grad): several vocabulary chunks, the last partial; plain,
        // with Granite's scale and Gemma 2's soft-cap, and tied (w also the embedding).
        let lce_tol = if dt == "f32" { 1e-4 } else { 3e-2 };
        for (what, attrs) in [("plain", ""), ("scale+softcap", ", scale=0.5, softcap=3.0")] {
            v.push(Case::new(format!("linear_cross_entropy + grad {dt} {what}"), format!("graph \"t\"\n%0: {dt}[2, 9, 64] = param {{name=\"x\"}}\n%1: {dt}[517, 64] = param {{name=\"w\"}}\n%2: i64[2, 9] = input {{name=\"l\", role=labels}}\n%3: f32[2, 9], %4: f32[2, 9] = linear_cross_entropy %0, %1, %2 {{ignore_index=-100, chunk=200{attrs}}}\n%5: f32[2, 9] = param {{name=\"dl\"}}\n%6: f32[2, 9] = param {{name=\"dt\"}}\n%7: {dt}[2, 9, 64], %8: {dt}[517, 64] = linear_cross_entropy_grad %0, %1, %2, %3, %5, %6 {{ignore_index=-100, chunk=200{attrs}}}\nreturn a=%3, b=%4, c=%7, d=%8\n")).labels("l", 0, 517).tol(lce_tol));
        }
        v.push(Case::new(format!("linear_cross_entropy + grad {dt} tied"), format!("graph \"t\"\n%0: i64[2, 9] = input {{name=\"ids\", role=other}}\n%1: {dt}[300, 48] = param {{name=\"w\"}}\n%2: {dt}[2, 9, 48] = embedding %0, %1\n%3: i64[2, 9] = input {{name=\"l\", role=labels}}\n%4: f32[2, 9], %5: f32[2, 9] = linear_cross_entropy %2, %1, %3 {{ignore_index=-100, chunk=128}}\n%6: f32[2, 9] = param {{name=\"dl\"}}\n%7: f32[2, 9] = param {{name=\"dt\"}}\n%8: {dt}[2, 9, 48], %9: {dt}[300, 48] = linear_cross_entropy_grad %2, %1, %3, %4, %6, %7 {{ignore_index=-100, chunk=128}}\nreturn a=%4, b=%5, c=%8, d=%9\n")).ints("ids", 0, 300).labels("l", 0, 300).tol(lce_tol));
        // linear_cross_entropy_with_grad: token chunks of 4 rows (the last partial), dw
        // summed over them; plain, scale + soft-cap, and tied.
        for (what, attrs) in [("plain", ""), ("scale+softcap", ", scale=0.5, softcap=3.0")] {
            v.push(Case::new(format!("linear_cross_entropy_with_grad {dt} {what}"), format!("graph \"t\"\n%0: {dt}[2, 9, 64] = param {{name=\"x\"}}\n%1: {dt}[517, 64] = param {{name=\"w\"}}\n%2: i64[2, 9] = input {{name=\"l\", role=labels}}\n%3: f32[2, 9] = param {{name=\"dl\"}}\n%4: f32[2, 9] = param {{name=\"dt\"}}\n%5: f32[2, 9], %6: f32[2, 9], %7: {dt}[2, 9, 64], %8: {dt}[517, 64] = linear_cross_entropy_with_grad %0, %1, %2, %3, %4 {{ignore_index=-100, rows=4{attrs}}}\nreturn a=%5, b=%6, c=%7, d=%8\n")).labels("l", 0, 517).tol(lce_tol));
        }
        // 520 classes: 16-bit rows go 16 bytes at a time.
        v.push(Case::new(format!("linear_cross_entropy_with_grad {dt} 520 classes, scale+softcap"), format!("graph \"t\"\n%0: {dt}[2, 9, 64] = param {{name=\"x\"}}\n%1: {dt}[520, 64] = param {{name=\"w\"}}\n%2: i64[2, 9] = input {{name=\"l\", role=labels}}\n%3: f32[2, 9] = param {{name=\"dl\"}}\n%4: f32[2, 9] = param {{name=\"dt\"}}\n%5: f32[2, 9], %6: f32[2, 9], %7: {dt}[2, 9, 64], %8: {dt}[520, 64] = linear_cross_entropy_with_grad %0, %1, %2, %3, %4 {{ignore_index=-100, rows=5, scale=0.5, softcap=3.0}}\nreturn a=%5, b=%6, c=%7, d=%8\n")).labels("l", 0, 520).tol(lce_tol));
        v.push(Case::new(format!("linear_cross_entropy_with_grad {dt} tied, one chunk"), format!("graph \"t\"\n%0: i64[2, 9] = input {{name=\"ids\", role=other}}\n%1: {dt}[300, 48] = param {{name=\"w\"}}\n%2: {dt}[2, 9, 48] = embedding %0, %1\n%3: i64[2, 9] = input {{name=\"l\", role=labels}}\n%4: f32[2, 9] = param {{name=\"dl\"}}\n%5: f32[2, 9] = param {{name=\"dt\"}}\n%6: f32[2, 9], %7: f32[2, 9], %8: {dt}[2, 9, 48], %9: {dt}[300, 48] = linear_cross_entropy_with_grad %2, %1, %3, %4, %5 {{ignore_index=-100, rows=64}}\nreturn a=%6, b=%7, c=%8, d=%9\n")).ints("ids", 0, 300).labels("l", 0, 300).tol(lce_tol));
        v.push(Case::new(format!("cross_entropy_grad {dt} none/sum/mean"), format!("graph \"t\"\n%0: {dt}[2, 9, 517] = param {{name=\"x\"}}\n%1: i64[2, 9] = input {{name=\"l\", role=labels}}\n%2: f32[2, 9] = param {{name=\"dn\"}}\n%3: f32[] = param {{name=\"ds\"}}\n%4: {dt}[2, 9, 517] = cross_entropy_grad %0, %1, %2 {{ignore_index=-100, reduction=none}}\n%5: {dt}[2, 9, 517] = cross_entropy_grad %0, %1, %3 {{ignore_index=-100, reduction=sum}}\n%6: {dt}[2, 9, 517] = cross_entropy_grad %0, %1, %3 {{ignore_index=-100, reduction=mean}}\nreturn a=%4, b=%5, c=%6\n")).labels("l", 0, 517).tol(tol));
        v.push(Case::new(format!("embedding_grad {dt} (repeated ids)"), format!("graph \"t\"\n%0: i64[3, 7] = input {{name=\"ids\", role=other}}\n%1: {dt}[3, 7, 40] = param {{name=\"dy\"}}\n%2: {dt}[11, 40] = embedding_grad %0, %1 {{num_embeddings=11}}\nreturn a=%2\n")).ints("ids", 0, 11).tol(tol));
        v.push(Case::new(format!("embedding_grad {dt} (padding_idx)"), format!("graph \"t\"\n%0: i64[3, 7] = input {{name=\"ids\", role=other}}\n%1: {dt}[3, 7, 40] = param {{name=\"dy\"}}\n%2: {dt}[11, 40] = embedding_grad %0, %1 {{num_embeddings=11, padding_idx=3}}\nreturn a=%2\n")).ints("ids", 0, 11).tol(tol));
        v.push(Case::new(format!("silu_grad/gelu_grad/softmax_grad {dt}"), format!("graph \"t\"\n%0: {dt}[7, 65] = param {{name=\"x\"}}\n%1: {dt}[7, 65] = param {{name=\"dy\"}}\n%2: {dt}[7, 65] = silu_grad %0, %1\n%3: {dt}[7, 65] = gelu_grad %0, %1 {{tanh_approx=false}}\n%4: {dt}[7, 65] = gelu_grad %0, %1 {{tanh_approx=true}}\n%5: {dt}[7, 65] = softmax %0 {{dim=-1}}\n%6: {dt}[7, 65] = softmax_grad %5, %1 {{dim=-1}}\nreturn a=%2, b=%3, c=%4, d=%6\n")).tol(tol * 2.0));
        // gpt-oss's experts: transposed weights [E, in, out] and a per-expert bias
        v.push(Case::new(format!("grouped_matmul transpose_w + bias, and its grad {dt}"), format!("graph \"t\"\n%0: {dt}[19, 24] = param {{name=\"x\"}}\n%1: i64[19, 2] = input {{name=\"e\", role=other}}\n%3: {dt}[5, 24, 40] = param {{name=\"w\"}}\n%2: {dt}[5, 40] = param {{name=\"b\"}}\n%4: {dt}[38, 24], %5: i64[5], %6: i64[38] = moe_dispatch %0, %1 {{num_experts=5}}\n%7: {dt}[38, 40] = grouped_matmul %4, %3, %5, %2 {{transpose_w=true}}\n%8: {dt}[38, 40] = param {{name=\"dy\"}}\n%9: {dt}[38, 24], %10: {dt}[5, 24, 40], %11: {dt}[5, 40] = grouped_matmul_grad %4, %3, %5, %8 {{transpose_w=true, bias=true}}\nreturn y=%7, dx=%9, dw=%10, db=%11\n")).ints("e", 0, 5).tol(tol * 2.0));
        v.push(Case::new(format!("grouped_matmul_grad/moe_combine_grad {dt}"), format!("graph \"t\"\n%0: {dt}[19, 24] = param {{name=\"x\"}}\n%1: i64[19, 2] = input {{name=\"e\", role=other}}\n%2: {dt}[19, 2] = param {{name=\"wt\"}}\n%3: {dt}[5, 40, 24] = param {{name=\"w\"}}\n%4: {dt}[38, 24], %5: i64[5], %6: i64[38] = moe_dispatch %0, %1 {{num_experts=5}}\n%7: {dt}[38, 40] = param {{name=\"dy\"}}\n%8: {dt}[38, 24], %9: {dt}[5, 40, 24] = grouped_matmul_grad %4, %3, %5, %7\n%10: {dt}[19, 24] = param {{name=\"dc\"}}\n%11: {dt}[38, 24], %12: {dt}[19, 2] = moe_combine_grad %4, %6, %2, %10\nreturn a=%8, b=%9, c=%11, d=%12\n")).ints("e", 0, 5).tol(tol * 2.0));
        v.push(Case::new(format!("adamw/sgd {dt} params, f32 state"), format!("graph \"t\"\n%0: {dt}[33, 7] = param {{name=\"p\"}}\n%1: {dt}[33, 7] = param {{name=\"g\"}}\n%2: f32[33, 7] = param {{name=\"m\"}}\n%3: f32[33, 7] = param {{name=\"v\"}}\n%4: f32[] = full {{value=3.0}}\n%5: {dt}[33, 7], %6: f32[33, 7], %7: f32[33, 7] = adamw %0, %1, %2, %3, %4 {{lr=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1}}\n%8: {dt}[33, 7] = param {{name=\"b\"}}\n%9: {dt}[33, 7], %10: {dt}[33, 7] = sgd %0, %1, %8 {{lr=0.1, momentum=0.9, weight_decay=0.01}}\nreturn p=%5, m=%6, v=%7, q=%9, r=%10\n")).positive().tol(tol));
        if dt != "f32" {
            // the fused mixed-precision update: generic (odd size) and 16-byte bf16 paths
            for shape in ["33, 7", "16, 64"] {
                v.push(Case::new(format!("adamw_master {dt} [{shape}]"), format!("graph \"t\"\n%0: f32[{shape}] = param {{name=\"w\"}}\n%1: {dt}[{shape}] = param {{name=\"g\"}}\n%2: f32[{shape}] = param {{name=\"m\"}}\n%3: f32[{shape}] = param {{name=\"v\"}}\n%4: f32[] = full {{value=3.0}}\n%5: f32[{shape}], %6: f32[{shape}], %7: f32[{shape}], %8: {dt}[{shape}] = adamw_master %0, %1, %2, %3, %4 {{lr=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, dtype={dt}}}\nreturn w=%5, m=%6, v=%7, p=%8\n")).positive().tol(tol));
            }
        }
    }
    // bf16 fast paths: 16-byte rows for rms_norm (1, 3 and 4 chunks per thread, f32 and bf16
    // weights), cross-entropy backward from the forward's saved log-sum-exp (V a multiple of 8)
    for (rows, h, wdt) in [
        (7usize, 2048usize, "bf16"),
        (3, 4104, "f32"),
        (2, 8192, "bf16"),
        (5, 24, "f32"),
    ] {
        v.push(Case::new(format!("rms_norm + rms_norm_grad bf16 [{rows}, {h}], {wdt} weight"), format!("graph \"t\"\n%0: bf16[{rows}, {h}] = param {{name=\"x\"}}\n%1: {wdt}[{h}] = param {{name=\"w\"}}\n%2: bf16[{rows}, {h}] = rms_norm %0, %1 {{eps=1e-5}}\n%3: bf16[{rows}, {h}] = param {{name=\"dy\"}}\n%4: bf16[{rows}, {h}], %5: {wdt}[{h}] = rms_norm_grad %0, %1, %3 {{eps=1e-5}}\nreturn y=%2, dx=%4, dw=%5\n")).tol(4e-2));
    }
    v.push(Case::new("cross_entropy + cross_entropy_grad bf16, V=520 (one-pass backward)", "graph \"t\"\n%0: bf16[2, 9, 520] = param {name=\"x\"}\n%1: i64[2, 9] = input {name=\"l\", role=labels}\n%2: i64[2, 9] = shift_labels %1 {ignore_index=-100}\n%3: f32[] = cross_entropy %0, %2 {ignore_index=-100, reduction=mean}\n%4: f32[] = param {name=\"ds\"}\n%5: bf16[2, 9, 520] = cross_entropy_grad %0, %2, %4 {ignore_index=-100, reduction=mean}\nreturn a=%3, b=%5\n").labels("l", 0, 520).tol(2e-2));
    // attention: generic (f32, masks, GQA, Sq != Sk) and tensor-core (bf16, d 64/128)
    for (dt, d, nq, nkv, sq, sk, causal, tol) in [
        ("f32", 8, 4, 2, 13, 13, true, 1e-5),
        ("f32", 40, 3, 1, 9, 21, true, 1e-5),
        ("f32", 16, 2, 2, 17, 17, false, 1e-5),
        ("bf16", 64, 4, 2, 100, 100, true, 2e-2),
        ("bf16", 64, 2, 1, 70, 130, true, 2e-2),
        ("bf16", 64, 2, 2, 129, 129, false, 2e-2),
        ("bf16", 128, 4, 1, 77, 77, true, 2e-2),
        ("bf16", 24, 2, 1, 33, 33, true, 2e-2),
        // edges of the 128-key backward tiles
        ("bf16", 64, 4, 1, 257, 257, true, 2e-2),
        ("bf16", 64, 2, 1, 200, 300, true, 2e-2),
        ("bf16", 128, 2, 2, 190, 190, true, 2e-2),
        // odd lengths, GQA and MHA, d 64/128 (also the cuDNN path's cases)
        ("bf16", 64, 4, 2, 1, 1, true, 2e-2),
        ("bf16", 64, 4, 2, 63, 63, true, 2e-2),
        ("bf16", 128, 4, 4, 200, 200, true, 2e-2),
        ("bf16", 64, 8, 2, 1000, 1000, true, 2e-2),
        ("bf16", 128, 2, 2, 1000, 1000, true, 2e-2),
        ("bf16", 128, 4, 1, 63, 63, false, 2e-2),
    ] {
        // With one key every softmax weight is exactly 1, so dq and dk are exactly zero
        // (a relative error against zero means nothing): check o and dv there.
        let ret = if sk == 1 {
            "o=%3, dv=%7"
        } else {
            "o=%3, dq=%5, dk=%6, dv=%7"
        };
        let text = format!(
            "graph \"t\"\n%0: {dt}[2, {nq}, {sq}, {d}] = param {{name=\"q\"}}\n%1: {dt}[2, {nkv}, {sk}, {d}] = param {{name=\"k\"}}\n%2: {dt}[2, {nkv}, {sk}, {d}] = param {{name=\"v\"}}\n%3: {dt}[2, {nq}, {sq}, {d}] = attention %0, %1, %2 {{causal={causal}, scale={}}}\n%4: {dt}[2, {nq}, {sq}, {d}] = param {{name=\"do\"}}\n%5: {dt}[2, {nq}, {sq}, {d}], %6: {dt}[2, {nkv}, {sk}, {d}], %7: {dt}[2, {nkv}, {sk}, {d}] = attention_grad %0, %1, %2, %3, %4 {{causal={causal}, scale={}}}\nreturn {ret}\n",
            1.0 / (d as f64).sqrt(),
            1.0 / (d as f64).sqrt()
        );
        v.push(
            Case::new(
                format!("attention fwd+bwd {dt} d{d} q{nq}/kv{nkv} S{sq}x{sk} causal={causal}"),
                text,
            )
            .tol(tol),
        );
    }
    // sliding windows (HF: keys i - W < j <= i): the generic kernels (f32, mask too) and
    // the tensor-core ones (bf16 d 64/128) across tile edges, Sq != Sk and GQA
    for (dt, d, nq, nkv, sq, sk, w, tol) in [
        ("f32", 8, 4, 2, 13, 13, 4, 1e-5),
        ("f32", 40, 3, 1, 9, 21, 5, 1e-5),
        ("bf16", 64, 4, 2, 300, 300, 100, 2e-2),
        ("bf16", 64, 2, 1, 200, 330, 64, 2e-2),
        ("bf16", 64, 2, 1, 257, 257, 1, 2e-2),
        ("bf16", 128, 4, 1, 300, 300, 129, 2e-2),
        ("bf16", 128, 2, 2, 1000, 1000, 200, 2e-2),
        ("bf16", 64, 8, 2, 1000, 1000, 127, 2e-2),
    ] {
        let sc = 1.0 / (d as f64).sqrt();
        let text = format!(
            "graph \"t\"\n%0: {dt}[2, {nq}, {sq}, {d}] = param {{name=\"q\"}}\n%1: {dt}[2, {nkv}, {sk}, {d}] = param {{name=\"k\"}}\n%2: {dt}[2, {nkv}, {sk}, {d}] = param {{name=\"v\"}}\n%3: {dt}[2, {nq}, {sq}, {d}] = attention %0, %1, %2 {{causal=true, scale={sc}, window={w}}}\n%4: {dt}[2, {nq}, {sq}, {d}] = param {{name=\"do\"}}\n%5: {dt}[2, {nq}, {sq}, {d}], %6: {dt}[2, {nkv}, {sk}, {d}], %7: {dt}[2, {nkv}, {sk}, {d}] = attention_grad %0, %1, %2, %3, %4 {{causal=true, scale={sc}, window={w}}}\nreturn o=%3, dq=%5, dk=%6, dv=%7\n"
        );
        v.push(
            Case::new(
                format!("attention window={w} fwd+bwd {dt} d{d} q{nq}/kv{nkv} S{sq}x{sk}"),
                text,
            )
            .tol(tol),
        );
    }
    // layout=bshd (q, k, v, out and their gradients [B, S, H, D], as `fuse` leaves the
    // models' attention): cuDNN through permuted strides, Weft's kernels through scratch
    // transposes; causal or not, windows, GQA and MHA, f32 and bf16
    for (dt, d, nq, nkv, s_, causal, w, tol) in [
        ("f32", 8, 4, 2, 13, true, None, 1e-5),
        ("f32", 16, 2, 2, 17, false, None, 1e-5),
        ("f32", 8, 4, 2, 13, true, Some(4), 1e-5),
        ("bf16", 64, 4, 2, 100, true, None, 2e-2),
        ("bf16", 128, 4, 1, 77, true, None, 2e-2),
        ("bf16", 64, 2, 2, 129, false, None, 2e-2),
        ("bf16", 64, 8, 2, 300, true, Some(100), 2e-2),
        ("bf16", 64, 2, 1, 257, true, Some(1), 2e-2),
    ] {
        let sc = 1.0 / (d as f64).sqrt();
        let window = w.map(|w| format!(", window={w}")).unwrap_or_default();
        let attrs = format!("causal={causal}, scale={sc}{window}, layout=bshd");
        let text = format!(
            "graph \"t\"\n%0: {dt}[2, {s_}, {nq}, {d}] = param {{name=\"q\"}}\n%1: {dt}[2, {s_}, {nkv}, {d}] = param {{name=\"k\"}}\n%2: {dt}[2, {s_}, {nkv}, {d}] = param {{name=\"v\"}}\n%3: {dt}[2, {s_}, {nq}, {d}] = attention %0, %1, %2 {{{attrs}}}\n%4: {dt}[2, {s_}, {nq}, {d}] = param {{name=\"do\"}}\n%5: {dt}[2, {s_}, {nq}, {d}], %6: {dt}[2, {s_}, {nkv}, {d}], %7: {dt}[2, {s_}, {nkv}, {d}] = attention_grad %0, %1, %2, %3, %4 {{{attrs}}}\nreturn o=%3, dq=%5, dk=%6, dv=%7\n"
        );
        let window = w.map(|w| format!(" window={w}")).unwrap_or_default();
        v.push(
            Case::new(
                format!("attention layout=bshd fwd+bwd {dt} d{d} q{nq}/kv{nkv} S{s_}x{s_} causal={causal}{window}"),
                text,
            )
            .tol(tol),
        );
    }
    // The op's other attributes (docs/attention.md), on the generic kernels: soft-capping,
    // a value head dim != the query/key one, sinks (in f32 and in q's dtype), and the
    // log-sum-exp as a result with its gradient; with windows, masks and GQA.
    for (dt, d, dvd, nq, nkv, s_, w, cap, sinks, lse, mask, tol) in [
        ("f32", 16, 16, 4, 2, 13, 0, 5.0, "", false, false, 1e-5),
        ("bf16", 64, 64, 4, 2, 100, 8, 50.0, "", false, false, 2e-2),
        ("f32", 24, 16, 4, 2, 19, 0, 0.0, "", false, false, 1e-5),
        ("bf16", 192, 128, 2, 2, 70, 0, 0.0, "", false, false, 2e-2),
        ("bf16", 192, 128, 4, 2, 128, 0, 0.0, "", false, false, 2e-2),
        ("bf16", 192, 128, 4, 2, 256, 64, 0.0, "", false, false, 2e-2),
        ("f32", 16, 16, 4, 1, 21, 5, 0.0, "f32", false, false, 1e-5),
        (
            "bf16", 64, 64, 8, 2, 90, 16, 0.0, "bf16", false, false, 2e-2,
        ),
        ("bf16", 64, 64, 4, 2, 33, 0, 0.0, "f32", false, false, 2e-2),
        ("f32", 16, 8, 2, 1, 12, 0, 3.0, "f32", false, true, 1e-5),
        ("f32", 16, 16, 4, 2, 17, 0, 0.0, "f32", true, false, 1e-5),
        ("f32", 32, 16, 2, 2, 15, 4, 2.0, "", true, false, 1e-5),
    ] {
        let sc = 1.0 / (d as f64).sqrt();
        let mut attrs = format!("causal=true, scale={sc}");
        if w > 0 {
            attrs += &format!(", window={w}");
        }
        if cap > 0.0 {
            attrs += &format!(", softcap={cap}");
        }
        if !sinks.is_empty() {
            attrs += ", sinks=true";
        }
        if lse {
            attrs += ", lse=true";
        }
        let mut t = format!(
            "graph \"t\"\n%0: {dt}[2, {nq}, {s_}, {d}] = param {{name=\"q\"}}\n%1: {dt}[2, {nkv}, {s_}, {d}] = param {{name=\"k\"}}\n%2: {dt}[2, {nkv}, {s_}, {dvd}] = param {{name=\"v\"}}\n"
        );
        let mut extra = String::new();
        let mut n = 3;
        if mask {
            t += &format!("%{n}: bool[2, 1, {s_}, {s_}] = input {{name=\"m\", role=other}}\n");
            extra += &format!(", %{n}");
            n += 1;
        }
        if !sinks.is_empty() {
            t += &format!("%{n}: {sinks}[{nq}] = param {{name=\"sinks\"}}\n");
            extra += &format!(", %{n}");
            n += 1;
        }
        let (o, l) = (n, n + 1);
        if lse {
            t += &format!("%{o}: {dt}[2, {nq}, {s_}, {dvd}], %{l}: f32[2, {nq}, {s_}] = attention %0, %1, %2{extra} {{{attrs}}}\n");
            n += 2;
        } else {
            t += &format!(
                "%{o}: {dt}[2, {nq}, {s_}, {dvd}] = attention %0, %1, %2{extra} {{{attrs}}}\n"
            );
            n += 1;
        }
        let dout = n;
        t += &format!("%{dout}: {dt}[2, {nq}, {s_}, {dvd}] = param {{name=\"do\"}}\n");
        n += 1;
        let mut gextra = extra.clone();
        if lse {
            t += &format!("%{n}: f32[2, {nq}, {s_}] = param {{name=\"dlse\"}}\n");
            gextra += &format!(", %{n}");
            n += 1;
        }
        let (dq, dk, dv, ds) = (n, n + 1, n + 2, n + 3);
        let sinks_out = if sinks.is_empty() {
            String::new()
        } else {
            format!(", %{ds}: f32[{nq}]")
        };
        t += &format!("%{dq}: {dt}[2, {nq}, {s_}, {d}], %{dk}: {dt}[2, {nkv}, {s_}, {d}], %{dv}: {dt}[2, {nkv}, {s_}, {dvd}]{sinks_out} = attention_grad %0, %1, %2, %{o}, %{dout}{gextra} {{{attrs}}}\n");
        t += &format!("return o=%{o}, dq=%{dq}, dk=%{dk}, dv=%{dv}");
        if lse {
            t += &format!(", lse=%{l}");
        }
        if !sinks.is_empty() {
            t += &format!(", dsinks=%{ds}");
        }
        t += "\n";
        v.push(
            Case::new(
                // only the value head dim differs: cuDNN runs it too ("S{n}x{n}")
                if cap == 0.0 && sinks.is_empty() && !lse && !mask {
                    format!("attention extras {dt} d{d}/dv{dvd} q{nq}/kv{nkv} S{s_}x{s_} window={w}")
                } else {
                    format!("attention extras {dt} d{d}/dv{dvd} q{nq}/kv{nkv} S{s_} window={w} softcap={cap} sinks={sinks:?} lse={lse} mask={mask}")
                },
                t,
            )
            .tol(tol),
        );
    }
    v.extend(fused_op_cases());
    v.push(Case::new("attention window=3 with bool mask (f32)", "graph \"t\"\n%0: f32[2, 2, 9, 8] = param {name=\"q\"}\n%1: f32[2, 1, 9, 8] = param {name=\"k\"}\n%2: f32[2, 1, 9, 8] = param {name=\"v\"}\n%3: bool[2, 1, 9, 9] = input {name=\"m\", role=other}\n%4: f32[2, 2, 9, 8] = attention %0, %1, %2, %3 {causal=true, scale=0.35, window=3}\n%5: f32[2, 2, 9, 8] = param {name=\"do\"}\n%6: f32[2, 2, 9, 8], %7: f32[2, 1, 9, 8], %8: f32[2, 1, 9, 8] = attention_grad %0, %1, %2, %4, %5, %3 {causal=true, scale=0.35, window=3}\nreturn o=%4, dq=%6, dk=%7, dv=%8\n").tol(1e-5));
    v.push(Case::new("attention with bool mask (f32, causal)", "graph \"t\"\n%0: f32[2, 2, 9, 8] = param {name=\"q\"}\n%1: f32[2, 1, 9, 8] = param {name=\"k\"}\n%2: f32[2, 1, 9, 8] = param {name=\"v\"}\n%3: bool[2, 1, 9, 9] = input {name=\"m\", role=other}\n%4: f32[2, 2, 9, 8] = attention %0, %1, %2, %3 {causal=true, scale=0.35}\n%5: f32[2, 2, 9, 8] = param {name=\"do\"}\n%6: f32[2, 2, 9, 8], %7: f32[2, 1, 9, 8], %8: f32[2, 1, 9, 8] = attention_grad %0, %1, %2, %4, %5, %3 {causal=true, scale=0.35}\nreturn o=%4, dq=%6, dk=%7, dv=%8\n").tol(1e-5));
    v
}

/// The ops `fuse` makes (`glu`, `glu_grad`, `add_rms_norm`, `add_rms_norm_grad`): generic
/// kernels (f32, bf16 with odd sizes) and the 8-wide bf16 ones (glu's over several grid
/// strides; norm rows of 1, 3 and 4 chunks per thread, several rows a block, f32 and bf16
/// norm weights), each beside the unfused ops it replaces.
fn fused_op_cases() -> Vec<Case> {
    let mut v = Vec::new();
    for (dt, shape, tol) in [
        ("f32", "7, 65", 1e-5),
        ("bf16", "7, 65", 3e-2),
        ("bf16", "64, 2048", 3e-2),
        // 1,127,500 8-wide vectors: more than one grid stride (SMs x 16 blocks x 256
        // threads, 540,672 on 132 SMs) on any current GPU, and not a multiple of one:
        // glu_bwd8's two-vectors-an-iteration loop and its one-vector tail.
        ("bf16", "4100, 2200", 3e-2),
    ] {
        for act in ["silu", "gelu", "gelu_tanh"] {
            let unfused = match act {
                "silu" => "silu %0".to_string(),
                "gelu" => "gelu %0 {tanh_approx=false}".to_string(),
                _ => "gelu %0 {tanh_approx=true}".to_string(),
            };
            v.push(Case::new(format!("glu + glu_grad {act} {dt}[{shape}]"), format!("graph \"t\"\n%0: {dt}[{shape}] = param {{name=\"g\"}}\n%1: {dt}[{shape}] = param {{name=\"u\"}}\n%2: {dt}[{shape}] = param {{name=\"dy\"}}\n%3: {dt}[{shape}] = glu %0, %1 {{act={act}}}\n%4: {dt}[{shape}], %5: {dt}[{shape}] = glu_grad %0, %1, %2 {{act={act}}}\n%6: {dt}[{shape}] = {unfused}\n%7: {dt}[{shape}] = mul %6, %1\nreturn y=%3, dg=%4, du=%5, unfused=%7\n")).tol(tol));
        }
    }
    for (dt, rows, h, wdt, tol) in [
        ("f32", 5usize, 257usize, "f32", 1e-4),
        ("bf16", 5, 257, "bf16", 4e-2),
        ("bf16", 7, 2048, "bf16", 4e-2),
        ("bf16", 3, 4104, "f32", 4e-2),
        ("bf16", 2, 8192, "bf16", 4e-2),
        // Several rows per block (dw from per-block partials), the last block short.
        ("bf16", 1100, 2048, "bf16", 4e-2),
        ("bf16", 1030, 4104, "f32", 4e-2),
    ] {
        v.push(Case::new(format!("add_rms_norm + add_rms_norm_grad {dt}[{rows}, {h}], {wdt} weight"), format!("graph \"t\"\n%0: {dt}[{rows}, {h}] = param {{name=\"x\"}}\n%1: {dt}[{rows}, {h}] = param {{name=\"y\"}}\n%2: {wdt}[{h}] = param {{name=\"w\"}}\n%3: {dt}[{rows}, {h}], %4: {dt}[{rows}, {h}] = add_rms_norm %0, %1, %2 {{eps=1e-5}}\n%5: {dt}[{rows}, {h}] = param {{name=\"dn\"}}\n%6: {dt}[{rows}, {h}] = param {{name=\"ds\"}}\n%7: {dt}[{rows}, {h}], %8: {wdt}[{h}] = add_rms_norm_grad %3, %2, %5, %6 {{eps=1e-5}}\n%9: {dt}[{rows}, {h}] = add %0, %1\n%10: {dt}[{rows}, {h}] = rms_norm %9, %2 {{eps=1e-5}}\nreturn s=%3, n=%4, dsum=%7, dw=%8, unfused=%10\n")).tol(tol));
    }
    // matmul_add: the GEMM accumulates into the addend (beta = 1); the unfused pair too.
    for (dt, a, b, c, ta, tb, tol) in [
        ("f32", "5, 7", "7, 9", "5, 9", false, false, 2e-5),
        ("f32", "2, 5, 7", "9, 7", "2, 5, 9", false, true, 2e-5),
        ("f32", "2, 7, 5", "2, 7, 9", "2, 5, 9", true, false, 2e-5),
        ("bf16", "64, 256", "256, 128", "64, 128", false, false, 2e-2),
        (
            "bf16",
            "1, 512, 1024",
            "512, 1024",
            "1, 512, 512",
            false,
            true,
            2e-2,
        ),
    ] {
        v.push(Case::new(format!("matmul_add {dt}[{a}] @ [{b}] ta={ta} tb={tb}"), format!("graph \"t\"\n%0: {dt}[{a}] = param {{name=\"a\"}}\n%1: {dt}[{b}] = param {{name=\"b\"}}\n%2: {dt}[{c}] = param {{name=\"c\"}}\n%3: {dt}[{c}] = matmul_add %0, %1, %2 {{transpose_a={ta}, transpose_b={tb}}}\n%4: {dt}[{c}] = matmul %0, %1 {{transpose_a={ta}, transpose_b={tb}}}\n%5: {dt}[{c}] = add %4, %2\nreturn y=%3, unfused=%5\n")).tol(tol));
    }
    // fp8_matmul: cuBLASLt's FP8 GEMM (sizes multiples of 16; operands transposed while
    // quantized where cuBLASLt wants k contiguous), and the quantize-dequantize fallback.
    // The quantized operands are the CPU's bit for bit; the FP8 tensor cores accumulate in
    // less than f32 (about 1e-4 here), hence 1e-3 for the f32 GEMM cases.
    for (dt, a, b, c, ta, tb, fa, fb, tol) in [
        (
            "f32", "64, 128", "96, 128", "64, 96", false, true, "e4m3", "e4m3", 1e-3,
        ),
        (
            "f32", "128, 256", "128, 192", "256, 192", true, false, "e5m2", "e4m3", 1e-3,
        ),
        (
            "bf16", "256, 512", "256, 128", "512, 128", true, false, "e5m2", "e4m3", 2e-2,
        ),
        (
            "bf16",
            "1, 512, 960",
            "320, 960",
            "1, 512, 320",
            false,
            true,
            "e4m3",
            "e4m3",
            2e-2,
        ),
        (
            "bf16",
            "1, 512, 1024",
            "384, 1024",
            "1, 512, 384",
            false,
            true,
            "e4m3",
            "e4m3",
            2e-2,
        ),
        (
            "bf16", "512, 256", "256, 384", "512, 384", false, false, "e5m2", "e4m3", 2e-2,
        ),
        (
            "bf16", "512, 64", "512, 96", "64, 96", true, false, "e5m2", "e4m3", 2e-2,
        ),
        (
            "f32", "5, 7", "9, 7", "5, 9", false, true, "e4m3", "e4m3", 2e-5,
        ),
        (
            "bf16", "2, 5, 7", "2, 7, 9", "2, 5, 9", false, false, "e5m2", "e4m3", 2e-2,
        ),
    ] {
        v.push(Case::new(format!("fp8_matmul {dt}[{a}] @ [{b}] ta={ta} tb={tb} {fa}/{fb}"), format!("graph \"t\"\n%0: {dt}[{a}] = param {{name=\"a\"}}\n%1: {dt}[{b}] = param {{name=\"b\"}}\n%2: {dt}[{c}] = fp8_matmul %0, %1 {{transpose_a={ta}, transpose_b={tb}, format_a={fa}, format_b={fb}}}\nreturn y=%2\n")).tol(tol));
    }
    v
}

// ---------------------------------------------------------------- running

struct Row {
    name: String,
    cpu: String,
    gpu: String,
    err: f64,
    tol: f64,
    ok: bool,
}

#[cfg(feature = "cuda")]
fn gpu_available() -> Result<(), String> {
    weft_runtime::cuda::probe(0)
        .map(|_| ())
        .map_err(|e| e.to_string())
}
#[cfg(not(feature = "cuda"))]
fn gpu_available() -> Result<(), String> {
    Err("built without the `cuda` feature".into())
}

/// Which attention kernels a GPU run uses.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Attn {
    /// Weft's tensor-core flash kernels (bf16, d 64/128), else its generic kernel.
    TensorCore,
    Generic,
    /// cuDNN's fused flash attention (`WEFT_ATTENTION=cudnn`), Weft's kernels elsewhere.
    Cudnn,
}

/// Whether libcudnn loads here (and its version), without panicking.
#[cfg(feature = "cuda")]
fn cudnn_available() -> Result<usize, String> {
    weft_runtime::cuda::cudnn_sdpa::available()
}
#[cfg(not(feature = "cuda"))]
fn cudnn_available() -> Result<usize, String> {
    Err("built without the `cuda` feature".into())
}

/// Outputs, device seconds and how many steps ran cuDNN attention.
type GpuRun = (BTreeMap<String, HostTensor>, f64, usize);

#[cfg(feature = "cuda")]
fn run_gpu(
    g: &Graph,
    plan: &weft_ir::ExecutionPlan,
    w: &BTreeMap<String, HostTensor>,
    x: &BTreeMap<String, HostTensor>,
    attn: Attn,
) -> Result<GpuRun, String> {
    use weft_runtime::cuda::{ExecOptions, Executor};
    let mut o = ExecOptions::from_env();
    o.fast_attention = attn != Attn::Generic;
    o.cudnn_attention = attn == Attn::Cudnn;
    o.nccl = false;
    let mut ex = Executor::new(plan, &o).map_err(|e| e.to_string())?;
    ex.poison_arena().map_err(|e| e.to_string())?;
    ex.load_params(w).map_err(|e| e.to_string())?;
    ex.set_inputs(x).map_err(|e| e.to_string())?;
    let t = ex.run_step().map_err(|e| e.to_string())?;
    let mut out = BTreeMap::new();
    for (name, _) in g.outputs() {
        out.insert(name.clone(), ex.output(name).map_err(|e| e.to_string())?);
    }
    Ok((out, t.device_s, ex.cudnn_attention_steps()))
}
#[cfg(not(feature = "cuda"))]
fn run_gpu(
    _: &Graph,
    _: &weft_ir::ExecutionPlan,
    _: &BTreeMap<String, HostTensor>,
    _: &BTreeMap<String, HostTensor>,
    _: Attn,
) -> Result<GpuRun, String> {
    Err("no cuda".into())
}

fn compare(
    name: &str,
    want: &BTreeMap<String, HostTensor>,
    got: &BTreeMap<String, HostTensor>,
    tol: f64,
) -> (f64, String) {
    let mut worst = 0.0f64;
    let mut what = String::new();
    for (k, w) in want {
        let Some(gt) = got.get(k) else {
            return (f64::INFINITY, format!("{name}: no output {k}"));
        };
        let e = if w.dtype.is_float() {
            gt.l2_rel_err(w)
        } else if gt.to_i64() == w.to_i64() {
            0.0
        } else {
            f64::INFINITY
        };
        if e > worst || e.is_nan() {
            worst = if e.is_nan() { f64::INFINITY } else { e };
            what = k.clone();
        }
    }
    let _ = tol;
    (worst, what)
}

fn run_case(c: &Case, gpu: bool, seed: u64, rows: &mut Vec<Row>) {
    let g = match weft_ir::parse(&c.text) {
        Ok(g) => g,
        Err(e) => {
            rows.push(Row {
                name: c.name.clone(),
                cpu: format!("parse: {e}"),
                gpu: "-".into(),
                err: f64::INFINITY,
                tol: c.tol,
                ok: false,
            });
            return;
        }
    };
    if let Err(e) = weft_ir::verify(&g) {
        rows.push(Row {
            name: c.name.clone(),
            cpu: format!("verify: {e:?}"),
            gpu: "-".into(),
            err: f64::INFINITY,
            tol: c.tol,
            ok: false,
        });
        return;
    }
    let mut rng = Rng(seed);
    let (w, x) = draw(c, &g, &mut rng);
    let plan = match plan_of(&g, 1, 1) {
        Ok(p) => p,
        Err(e) => {
            rows.push(Row {
                name: c.name.clone(),
                cpu: format!("plan: {e}"),
                gpu: "-".into(),
                err: f64::INFINITY,
                tol: c.tol,
                ok: false,
            });
            return;
        }
    };
    let want = match cpu_ref(&g, &w, &x, 1, 1) {
        Ok(o) => o,
        Err(e) => {
            rows.push(Row {
                name: c.name.clone(),
                cpu: format!("cpu: {e}"),
                gpu: "-".into(),
                err: f64::INFINITY,
                tol: c.tol,
                ok: false,
            });
            return;
        }
    };
    if !gpu {
        rows.push(Row {
            name: c.name.clone(),
            cpu: "ok".into(),
            gpu: "skipped".into(),
            err: 0.0,
            tol: c.tol,
            ok: true,
        });
        return;
    }
    let paths: &[Attn] = if c.name.starts_with("attention") && c.name.contains("bf16") {
        &[Attn::TensorCore, Attn::Generic, Attn::Cudnn]
    } else {
        &[Attn::TensorCore]
    };
    for &attn in paths {
        let label = if paths.len() > 1 {
            format!(
                "{} [{}]",
                c.name,
                match attn {
                    Attn::TensorCore => "tensor-core",
                    Attn::Generic => "generic",
                    Attn::Cudnn => "cudnn",
                }
            )
        } else {
            c.name.clone()
        };
        // cuDNN runs bf16 attention with Sq == Sk ("S{n}x{n}" in the name); it falls back
        // to Weft's kernels elsewhere. Without libcudnn the cuDNN rows say so and pass.
        // A causal window of 64 keys or more runs on cuDNN too (its band is the causal
        // mask's left edge); narrower ones run on Weft's generic kernels.
        let narrow_window = c
            .name
            .split_whitespace()
            .find_map(|w| w.strip_prefix("window="))
            .and_then(|w| w.parse::<i64>().ok())
            .is_some_and(|w| w > 0 && w < 64);
        let cudnn_expected = attn == Attn::Cudnn && !c.name.contains("mask") && !narrow_window && {
            let sxs = c
                .name
                .split_whitespace()
                .find_map(|w| w.strip_prefix('S'))
                .and_then(|w| w.split_once('x'));
            sxs.is_some_and(|(a, b)| a == b)
        };
        if attn == Attn::Cudnn {
            if let Err(e) = cudnn_available() {
                rows.push(Row {
                    name: label,
                    cpu: "ok".into(),
                    gpu: format!("skipped: cuDNN absent ({e})"),
                    err: 0.0,
                    tol: c.tol,
                    ok: true,
                });
                continue;
            }
        }
        match run_gpu(&g, &plan, &w, &x, attn) {
            Ok((got, t, cudnn_steps)) => {
                let (e, what) = compare(&c.name, &want, &got, c.tol);
                let mut ok = e <= c.tol.max(1e-6) || (c.tol == 0.0 && e == 0.0);
                let mut note = String::new();
                if attn == Attn::Cudnn {
                    note = format!(" cudnn steps={cudnn_steps}");
                    if cudnn_expected && cudnn_steps == 0 {
                        ok = false;
                        note.push_str(" (cuDNN did not run: see stderr)");
                    }
                }
                rows.push(Row {
                    name: label,
                    cpu: "ok".into(),
                    gpu: format!("{:.3} ms worst={what}{note}", t * 1e3),
                    err: e,
                    tol: c.tol,
                    ok,
                });
            }
            Err(e) => rows.push(Row {
                name: label,
                cpu: "ok".into(),
                gpu: format!("error: {e}"),
                err: f64::INFINITY,
                tol: c.tol,
                ok: false,
            }),
        }
    }
}

/// Tiny HF fixtures: the forward program (one rank), f32 and bf16, and with autodiff the
/// joint program's gradients.
fn model_cases(gpu: bool, rows: &mut Vec<Row>) {
    for (preset, dtype, tol) in [
        ("llama-tiny", None, 2e-4),
        ("qwen3-tiny", None, 2e-4),
        ("mixtral-tiny", None, 2e-4),
        ("qwen3-moe-tiny", None, 2e-4),
        // MoE load-balancing loss (output_router_logits): one_hot, token sums, ce/aux outputs.
        ("tests/fixtures/mixtral_aux", None, 2e-4),
        ("llama-tiny", Some(DType::BF16), 3e-2),
        // Gemma 3 (no attention soft-cap): (1 + w) norms, GELU-tanh, two rope tables,
        // the final-logit soft-cap (scale, tanh, scale).
        ("gemma3-tiny", None, 2e-4),
    ] {
        let name = format!(
            "model {preset}{} forward{}, fused",
            dtype.map(|d| format!(" {d}")).unwrap_or_default(),
            if weft_passes::lookup("autodiff").is_ok() {
                "+backward"
            } else {
                ""
            }
        );
        let model = match weft_frontends::load(preset) {
            Ok(m) => m,
            Err(e) => {
                rows.push(Row {
                    name,
                    cpu: format!("load: {e}"),
                    gpu: "-".into(),
                    err: f64::INFINITY,
                    tol,
                    ok: false,
                });
                continue;
            }
        };
        let mut g = model.graph.clone();
        if let Some(d) = dtype {
            convert(&mut g, d);
        }
        // The program users run: `fuse` last, as every pipeline ends (its kernels then
        // meet each other in a whole model, e.g. the tied embedding's gradient).
        let mut passes = vec!["canonicalize"];
        if weft_passes::lookup("autodiff").is_ok() {
            passes.push("autodiff");
        }
        passes.push("fuse");
        let cx = weft_passes::PassContext::new(weft_ir::Mesh::default());
        if let Err(e) =
            weft_passes::PassManager::default().run(&mut g, &cx, &passes, &mut std::io::sink())
        {
            rows.push(Row {
                name,
                cpu: format!("passes: {e}"),
                gpu: "-".into(),
                err: f64::INFINITY,
                tol,
                ok: false,
            });
            continue;
        }
        let weights = match model
            .dir()
            .map(|d| d.join("model.safetensors"))
            .filter(|p| p.exists())
        {
            Some(p) => weft_frontends::load_weights(&model, &p)
                .unwrap_or_else(|_| weft_frontends::random_weights(&model, 1)),
            None => weft_frontends::random_weights(&model, 1),
        };
        let weights: BTreeMap<String, HostTensor> = weights
            .into_iter()
            .map(|(k, t)| {
                let d = dtype.unwrap_or(t.dtype);
                let v = t.to_f64().into_iter().map(|x| round(d, x)).collect();
                (k, HostTensor::floats(d, t.shape.clone(), v))
            })
            .collect();
        let (b, s) = (2i64, 13i64);
        let mut rng = Rng(7);
        let vocab = model
            .graph
            .nodes()
            .iter()
            .find_map(|&n| match model.graph.node(n).op {
                weft_ir::Op::Embedding { .. } => {
                    model.graph.ty(model.graph.node(n).operands[1]).shape[0].as_const()
                }
                _ => None,
            });
        let vocab = vocab.unwrap_or(2);
        let ids: Vec<i64> = (0..b * s)
            .map(|_| (rng.next() % vocab as u64) as i64)
            .collect();
        let labels: Vec<i64> = ids
            .iter()
            .map(|&t| if rng.next() % 6 == 0 { -100 } else { t })
            .collect();
        let mut x = BTreeMap::new();
        x.insert(
            "input_ids".to_string(),
            HostTensor::ints(DType::I64, vec![b as usize, s as usize], ids),
        );
        x.insert(
            "labels".to_string(),
            HostTensor::ints(DType::I64, vec![b as usize, s as usize], labels),
        );
        let plan = match plan_of(&g, b, s) {
            Ok(p) => p,
            Err(e) => {
                rows.push(Row {
                    name,
                    cpu: format!("plan: {e}"),
                    gpu: "-".into(),
                    err: f64::INFINITY,
                    tol,
                    ok: false,
                });
                continue;
            }
        };
        let want = match cpu_ref(&g, &weights, &x, b, s) {
            Ok(o) => o,
            Err(e) => {
                rows.push(Row {
                    name,
                    cpu: format!("cpu: {e}"),
                    gpu: "-".into(),
                    err: f64::INFINITY,
                    tol,
                    ok: false,
                });
                continue;
            }
        };
        if !gpu {
            rows.push(Row {
                name,
                cpu: "ok".into(),
                gpu: "skipped".into(),
                err: 0.0,
                tol,
                ok: true,
            });
            continue;
        }
        // WEFT_ATTENTION=cudnn: the models' attention runs on cuDNN (where it can).
        let attn = if std::env::var("WEFT_ATTENTION").as_deref() == Ok("cudnn") {
            Attn::Cudnn
        } else {
            Attn::TensorCore
        };
        match run_gpu(&g, &plan, &weights, &x, attn) {
            Ok((got, t, cudnn_steps)) => {
                let (e, what) = compare(&name, &want, &got, tol);
                rows.push(Row {
                    name,
                    cpu: "ok".into(),
                    gpu: format!(
                        "{:.3} ms worst={what}{}",
                        t * 1e3,
                        if attn == Attn::Cudnn {
                            format!(" cudnn steps={cudnn_steps}")
                        } else {
                            String::new()
                        }
                    ),
                    err: e,
                    tol,
                    ok: e <= tol,
                });
            }
            Err(e) => rows.push(Row {
                name,
                cpu: "ok".into(),
                gpu: format!("error: {e}"),
                err: f64::INFINITY,
                tol,
                ok: false,
            }),
        }
    }
}

/// 20 AdamW training steps of the tiny Mistral with a 4-token window over 16 tokens
/// (tests/fixtures/mistral_sw4, HF's weights) on the GPU and on the CPU reference (f64),
/// each step's updated parameters fed back: every step's loss, the first step's
/// gradients and the last step's parameters agree. With `offload_optimizer`, 5 steps
/// with the optimizer on the host (`--offload-optimizer`: gradients copied to pinned
/// host memory, AdamW on host threads, parameters copied back).
fn window_training_steps(gpu: bool, rows: &mut Vec<Row>, offload_optimizer: bool) {
    let steps = if offload_optimizer { 5 } else { 20 };
    let name = if offload_optimizer {
        format!("model mistral_sw4 (window 4 < S 16): {steps} AdamW steps, host optimizer")
    } else {
        format!("model mistral_sw4 (window 4 < S 16): {steps} AdamW steps")
    };
    // (as `weft run --check` for f32: AdamW's normalised steps amplify rounding a little)
    let tol = 1e-3;
    let mut row = |cpu: String, gpu_: String, err: f64| {
        rows.push(Row {
            name: name.clone(),
            ok: cpu == "ok" && err <= tol,
            cpu,
            gpu: gpu_,
            err,
            tol,
        })
    };
    let dir = std::path::Path::new("tests/fixtures/mistral_sw4");
    let prepared = (|| -> Result<_, String> {
        let model = weft_frontends::load(dir.to_str().unwrap()).map_err(|e| e.to_string())?;
        let weights = weft_frontends::load_weights(&model, &dir.join("model.safetensors"))
            .map_err(|e| e.to_string())?;
        let inputs = weft_frontends::read_safetensors(&dir.join("inputs.safetensors"))
            .map_err(|e| e.to_string())?;
        let opts = weft_passes::training::TrainOptions {
            optimizer: Some(weft_passes::training::Optimizer::adamw(1e-3)),
            grad_outputs: true,
            batch: Some(2),
            seq: Some(16),
            offload_optimizer,
            ..Default::default()
        };
        let mesh = weft_ir::Mesh::default();
        let mut cx = weft_passes::PassContext::new(mesh.clone());
        cx.options.train = opts.clone();
        let names: Vec<String> = weft_passes::training::training_pipeline(&mesh, &opts)
            .names()
            .into_iter()
            .map(String::from)
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut g = model.graph.clone();
        weft_passes::PassManager::default()
            .run(&mut g, &cx, &refs, &mut std::io::sink())
            .map_err(|e| e.to_string())?;
        let plan = plan_of(&g, 2, 16)?;
        let host_updates = g
            .nodes()
            .iter()
            .filter(|&&n| matches!(g.node(n).op, weft_ir::Op::HostAdamW { .. }))
            .count();
        if offload_optimizer != (host_updates > 0) {
            return Err(format!(
                "{host_updates} host_adamw updates with offload_optimizer {offload_optimizer}"
            ));
        }
        Ok((g, weights, inputs, plan))
    })();
    let (g, weights, inputs, plan) = match prepared {
        Ok(p) => p,
        Err(e) => return row(format!("compile: {e}"), "-".into(), f64::INFINITY),
    };
    let step_in = |step: usize| {
        let mut x = inputs.clone();
        x.insert(
            "optim.step".into(),
            HostTensor::floats(DType::F32, vec![], vec![(step + 1) as f64]),
        );
        x
    };
    // CPU: the same 20 steps, feeding back the updated parameters and states
    let mut w = weights.clone();
    match weft_passes::optimizer::initial_state(&g, &w) {
        Ok(st) => w.extend(st),
        Err(e) => return row(format!("optimizer state: {e}"), "-".into(), f64::INFINITY),
    }
    let mut cpu_runs = Vec::new();
    for step in 0..steps {
        let opts = RunOptions::new(Precision::F64).bind("B", 2).bind("S", 16);
        let r = match cpu::run(&g, &w, &step_in(step), &opts) {
            Ok(r) => r,
            Err(e) => return row(format!("cpu step {step}: {e}"), "-".into(), f64::INFINITY),
        };
        for (k, t) in &r.outputs {
            if let Some(p) = weft_ir::plan::fed_back_param(k, |n| w.contains_key(n)) {
                w.insert(p.to_string(), t.clone());
            }
        }
        cpu_runs.push(r.outputs);
    }
    if !gpu {
        return row("ok".into(), "skipped".into(), 0.0);
    }
    match window_gpu_steps(&g, &plan, &weights, &step_in, &cpu_runs) {
        Ok((e, what)) => row("ok".into(), format!("worst={what}"), e),
        Err(e) => row("ok".into(), format!("error: {e}"), f64::INFINITY),
    }
}

#[cfg(feature = "cuda")]
fn window_gpu_steps(
    g: &Graph,
    plan: &weft_ir::ExecutionPlan,
    weights: &BTreeMap<String, HostTensor>,
    step_in: &dyn Fn(usize) -> BTreeMap<String, HostTensor>,
    cpu_runs: &[BTreeMap<String, HostTensor>],
) -> Result<(f64, String), String> {
    use weft_runtime::cuda::{ExecOptions, Executor};
    let mut o = ExecOptions::from_env();
    o.nccl = false;
    let mut ex = Executor::new(plan, &o).map_err(|e| e.to_string())?;
    ex.load_params(weights).map_err(|e| e.to_string())?;
    let (mut worst, mut what) = (0.0f64, String::new());
    for (step, want) in cpu_runs.iter().enumerate() {
        ex.set_inputs(&step_in(step)).map_err(|e| e.to_string())?;
        ex.run_step().map_err(|e| e.to_string())?;
        for (name, _) in g.outputs() {
            let check = name == "loss"
                || (step == 0 && name.starts_with("grad."))
                || (step + 1 == cpu_runs.len() && name.starts_with("param."));
            if !check {
                continue;
            }
            let got = ex.output(name).map_err(|e| e.to_string())?;
            let e = got.l2_rel_err(&want[name]);
            if !(e <= worst) {
                worst = e;
                what = format!("step {} {name} {e:.1e}", step + 1);
            }
        }
    }
    // The same steps launched kernel by kernel. The replayed graph runs the same kernels
    // on the same buffers; some kernels accumulate with atomics, so two runs may differ in
    // the last bits, and over the steps: they must agree within the same tolerance.
    // One rank and static shapes: the step must replay a CUDA graph, the host
    // optimizer's host function included.
    let replayed = ex.replays_cuda_graph();
    if !replayed && o.tuning.cuda_graph && !o.tuning.profile {
        return Err(format!(
            "the step was not replayed as a CUDA graph: {}",
            ex.cuda_graph_refusal().unwrap_or_default()
        ));
    }
    let mut graph_vs_eager = 0.0f64;
    if replayed {
        o.tuning.cuda_graph = false;
        let mut eager = Executor::new(plan, &o).map_err(|e| e.to_string())?;
        eager.load_params(weights).map_err(|e| e.to_string())?;
        for step in 0..cpu_runs.len() {
            eager
                .set_inputs(&step_in(step))
                .map_err(|e| e.to_string())?;
            eager.run_step().map_err(|e| e.to_string())?;
        }
        for (name, _) in g.outputs() {
            let (a, b) = (ex.output(name), eager.output(name));
            let (a, b) = (a.map_err(|e| e.to_string())?, b.map_err(|e| e.to_string())?);
            let e = a.l2_rel_err(&b);
            if !(e <= graph_vs_eager) {
                graph_vs_eager = e;
            }
        }
        if !(graph_vs_eager <= worst) {
            worst = graph_vs_eager;
            what = format!(
                "CUDA graph vs eager after {} steps {graph_vs_eager:.1e}",
                cpu_runs.len()
            );
        }
    }
    let graph = match ex.cuda_graph_refusal() {
        Some(why) => format!("no CUDA graph: {why}"),
        None if replayed => format!("CUDA graph vs eager {graph_vs_eager:.1e}"),
        None => "no CUDA graph".to_string(),
    };
    Ok((worst, format!("{what}; {graph}")))
}
#[cfg(not(feature = "cuda"))]
fn window_gpu_steps(
    _: &Graph,
    _: &weft_ir::ExecutionPlan,
    _: &BTreeMap<String, HostTensor>,
    _: &dyn Fn(usize) -> BTreeMap<String, HostTensor>,
    _: &[BTreeMap<String, HostTensor>],
) -> Result<(f64, String), String> {
    Err("built without the `cuda` feature".into())
}

fn convert(g: &mut Graph, d: DType) {
    use weft_ir::Op;
    for n in g.nodes().to_vec() {
        let op = g.node(n).op.clone();
        let new = match op {
            Op::Param { name, ty } if ty.dtype.is_float() => Some(Op::Param {
                name,
                ty: ty.with_dtype(d),
            }),
            Op::Full { value, ty } if ty.dtype.is_float() => Some(Op::Full {
                value,
                ty: ty.with_dtype(d),
            }),
            _ => None,
        };
        if let Some(op) = new {
            g.node_mut(n).op = op;
        }
        g.reinfer(n).expect("dtype conversion re-infers");
    }
}

#[cfg(feature = "cuda")]
fn bench(rows: &mut Vec<String>) {
    use weft_runtime::cuda::{ExecOptions, Executor};
    // Median device seconds of `iters` steps, and how many steps ran cuDNN attention.
    let time = |text: &str, iters: usize, cudnn: bool| -> Result<(f64, usize), String> {
        let g = weft_ir::parse(text).map_err(|e| e.to_string())?;
        let plan = plan_of(&g, 1, 1)?;
        let o = ExecOptions {
            nccl: false,
            fast_attention: true,
            cudnn_attention: cudnn,
            ..ExecOptions::from_env()
        };
        let mut ex = Executor::new(&plan, &o).map_err(|e| e.to_string())?;
        ex.init_params_random(1, 0.5).map_err(|e| e.to_string())?;
        ex.run_step().map_err(|e| e.to_string())?;
        let mut ts = Vec::new();
        for _ in 0..iters {
            ts.push(ex.run_step().map_err(|e| e.to_string())?.device_s);
        }
        ts.sort_by(|a, b| a.total_cmp(b));
        Ok((ts[ts.len() / 2], ex.cudnn_attention_steps()))
    };
    let n = 8192;
    let t = time(&format!("graph \"g\"\n%0: bf16[{n}, {n}] = param {{name=\"x\"}}\n%1: bf16[{n}, {n}] = param {{name=\"w\"}}\n%2: bf16[{n}, {n}] = linear %0, %1\nreturn y=%2\n"), 10, false);
    rows.push(match t {
        Ok((t, _)) => format!(
            "gemm bf16 {n}^3 (cuBLASLt)          {:>8.3} ms  {:>6.0} TFLOP/s",
            t * 1e3,
            2.0 * (n as f64).powi(3) / t / 1e12
        ),
        Err(e) => format!("gemm bf16: error {e}"),
    });
    let cudnn = cudnn_available();
    if let Err(e) = &cudnn {
        rows.push(format!("attention [cudnn]: skipped, cuDNN absent: {e}"));
    }
    for (d, nkv, s) in [
        (64usize, 8usize, 4096usize),
        (128, 8, 4096),
        (64, 8, 16384),
        (128, 8, 16384),
    ] {
        let nq = 32;
        let sc = 1.0 / (d as f64).sqrt();
        let fwd = format!("graph \"a\"\n%0: bf16[1, {nq}, {s}, {d}] = param {{name=\"q\"}}\n%1: bf16[1, {nkv}, {s}, {d}] = param {{name=\"k\"}}\n%2: bf16[1, {nkv}, {s}, {d}] = param {{name=\"v\"}}\n%3: bf16[1, {nq}, {s}, {d}] = attention %0, %1, %2 {{causal=true, scale={sc}}}\nreturn o=%3\n");
        let both = format!("graph \"a\"\n%0: bf16[1, {nq}, {s}, {d}] = param {{name=\"q\"}}\n%1: bf16[1, {nkv}, {s}, {d}] = param {{name=\"k\"}}\n%2: bf16[1, {nkv}, {s}, {d}] = param {{name=\"v\"}}\n%3: bf16[1, {nq}, {s}, {d}] = attention %0, %1, %2 {{causal=true, scale={sc}}}\n%4: bf16[1, {nq}, {s}, {d}] = param {{name=\"do\"}}\n%5: bf16[1, {nq}, {s}, {d}], %6: bf16[1, {nkv}, {s}, {d}], %7: bf16[1, {nkv}, {s}, {d}] = attention_grad %0, %1, %2, %3, %4 {{causal=true, scale={sc}}}\nreturn dq=%5, dk=%6, dv=%7\n");
        let f = 4.0 * nq as f64 * (s as f64).powi(2) * d as f64 / 2.0; // causal forward FLOPs
        let impls: &[bool] = if cudnn.is_ok() {
            &[false, true]
        } else {
            &[false]
        };
        for &use_cudnn in impls {
            let name = if use_cudnn { "cudnn" } else { "weft " };
            match (time(&fwd, 10, use_cudnn), time(&both, 10, use_cudnn)) {
                (Ok((tf, nf)), Ok((tb, nb))) => rows.push(format!(
                    "attention causal bf16 S={s} d={d} 32q/{nkv}kv [{name}]: fwd {:>7.3} ms {:>5.0} TFLOP/s; fwd+bwd {:>7.3} ms {:>5.0} TFLOP/s{}",
                    tf * 1e3,
                    f / tf / 1e12,
                    tb * 1e3,
                    3.5 * f / tb / 1e12,
                    if use_cudnn && (nf == 0 || nb == 0) {
                        format!(" (cuDNN NOT used: {nf} fwd / {nb} fwd+bwd cuDNN steps; see stderr)")
                    } else {
                        String::new()
                    }
                )),
                (a, b) => rows.push(format!(
                    "attention S={s} d={d} [{name}]: error {:?} {:?}",
                    a.err(),
                    b.err()
                )),
            }
        }
    }
    // Sliding window: counting only the band's FLOPs, S=65536 W=4096 must reach at least
    // 70% of the fwd+bwd TFLOP/s of full causal attention at S=4096 (issue 15).
    let attn_text = |s: usize, d: usize, nkv: usize, window: Option<usize>, bwd: bool| {
        let nq = 32;
        let sc = 1.0 / (d as f64).sqrt();
        let w = window.map(|w| format!(", window={w}")).unwrap_or_default();
        let mut t = format!("graph \"a\"\n%0: bf16[1, {nq}, {s}, {d}] = param {{name=\"q\"}}\n%1: bf16[1, {nkv}, {s}, {d}] = param {{name=\"k\"}}\n%2: bf16[1, {nkv}, {s}, {d}] = param {{name=\"v\"}}\n%3: bf16[1, {nq}, {s}, {d}] = attention %0, %1, %2 {{causal=true, scale={sc}{w}}}\n");
        if bwd {
            t += &format!("%4: bf16[1, {nq}, {s}, {d}] = param {{name=\"do\"}}\n%5: bf16[1, {nq}, {s}, {d}], %6: bf16[1, {nkv}, {s}, {d}], %7: bf16[1, {nkv}, {s}, {d}] = attention_grad %0, %1, %2, %3, %4 {{causal=true, scale={sc}{w}}}\nreturn dq=%5, dk=%6, dv=%7\n");
        } else {
            t += "return o=%3\n";
        }
        t
    };
    for d in [64usize, 128] {
        // (query, key) pairs inside the band, per head
        let pairs = |s: usize, w: Option<usize>| -> f64 {
            let w = w.unwrap_or(s).min(s) as f64;
            let s = s as f64;
            s * w - w * (w - 1.0) / 2.0
        };
        let paths: &[bool] = if cudnn.is_ok() {
            &[false, true]
        } else {
            &[false]
        };
        for &use_cudnn in paths {
            let tag = if use_cudnn { "cudnn" } else { "weft " };
            let mut causal_rate = None;
            for (s, w) in [
                (4096usize, None),
                (65536, Some(4096usize)),
                (16384, Some(4096)),
            ] {
                let f = 4.0 * 32.0 * pairs(s, w) * d as f64; // forward FLOPs in the band
                let label = match w {
                    Some(w) => format!("window {w}"),
                    None => "causal".to_string(),
                };
                match (
                    time(&attn_text(s, d, 8, w, false), 5, use_cudnn),
                    time(&attn_text(s, d, 8, w, true), 5, use_cudnn),
                ) {
                    (Ok((tf, nf)), Ok((tb, nb))) => {
                        let both = 3.5 * f / tb / 1e12;
                        if w.is_none() {
                            causal_rate = Some(both);
                        }
                        let ran = if use_cudnn && nf + nb == 0 {
                            " (cuDNN did not run: Weft's kernels)"
                        } else {
                            ""
                        };
                        rows.push(format!(
                            "attention {label} bf16 S={s} d={d} 32q/8kv [{tag}]: fwd {:>7.3} ms {:>5.0} TFLOP/s; fwd+bwd {:>7.3} ms {:>5.0} TFLOP/s (band FLOPs){}{ran}",
                            tf * 1e3,
                            f / tf / 1e12,
                            tb * 1e3,
                            both,
                            match (w, causal_rate) {
                                (Some(_), Some(c)) => format!(
                                    "; {:.0}% of {tag} causal S=4096 (target >= 70%)",
                                    100.0 * both / c
                                ),
                                _ => String::new(),
                            }
                        ));
                    }
                    (a, b) => rows.push(format!(
                        "attention {label} S={s} d={d} [{tag}]: error {:?} {:?}",
                        a.err(),
                        b.err()
                    )),
                }
            }
        }
    }
}
#[cfg(not(feature = "cuda"))]
fn bench(_: &mut Vec<String>) {}

#[test]
fn gpu_suite() {
    // Tests find fixtures relative to the repository root (CARGO_MANIFEST_DIR at build
    // time; the current directory when the binary runs elsewhere).
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    if manifest.join("tests/fixtures").exists() {
        let _ = std::env::set_current_dir(manifest);
    }
    let gpu = gpu_available();
    let has_gpu = gpu.is_ok();
    let mut rows = Vec::new();
    // WEFT_GPU_ONLY / WEFT_GPU_SKIP: comma-separated substrings of case names (models
    // are the cases named "model ..."), so a crash in one family cannot hide the others.
    let list = |k: &str| {
        std::env::var(k).ok().map(|v| {
            v.split(',')
                .map(str::to_string)
                .filter(|x| !x.is_empty())
                .collect::<Vec<_>>()
        })
    };
    let (only, skip) = (list("WEFT_GPU_ONLY"), list("WEFT_GPU_SKIP"));
    let selected = |name: &str| {
        only.as_ref()
            .is_none_or(|o| o.iter().any(|x| name.contains(x.as_str())))
            && !skip
                .as_ref()
                .is_some_and(|s| s.iter().any(|x| name.contains(x.as_str())))
    };
    for (i, c) in op_cases().iter().enumerate() {
        if selected(&c.name) {
            run_case(c, has_gpu, 1000 + i as u64, &mut rows);
        }
    }
    if selected("model") {
        model_cases(has_gpu, &mut rows);
    }
    if selected("model mistral_sw4") {
        window_training_steps(has_gpu, &mut rows, false);
        window_training_steps(has_gpu, &mut rows, true);
    }
    let w = rows
        .iter()
        .map(|r| r.name.len())
        .max()
        .unwrap_or(10)
        .min(80);
    eprintln!(
        "\n{:<w$}  {:>9}  {:>8}  {:<6} {}",
        "case", "rel err", "tol", "status", "gpu"
    );
    for r in &rows {
        eprintln!(
            "{:<w$}  {:>9.2e}  {:>8.0e}  {:<6} {}{}",
            r.name,
            r.err,
            r.tol,
            if r.ok { "ok" } else { "FAIL" },
            r.gpu,
            if r.cpu != "ok" {
                format!(" ({})", r.cpu)
            } else {
                String::new()
            }
        );
    }
    let failed: Vec<&Row> = rows.iter().filter(|r| !r.ok).collect();
    eprintln!(
        "{} cases, {} failed{}",
        rows.len(),
        failed.len(),
        match &gpu {
            Ok(()) => String::new(),
            Err(e) => format!(" (GPU half skipped: {})", e.lines().next().unwrap_or("")),
        }
    );
    if has_gpu && std::env::var("WEFT_GPU_BENCH").is_ok() {
        let mut b = Vec::new();
        bench(&mut b);
        eprintln!("\nbenchmarks (median of 10, device time):");
        for l in b {
            eprintln!("  {l}");
        }
    }
    assert!(
        failed.is_empty(),
        "{} GPU check(s) failed: {}",
        failed.len(),
        failed
            .iter()
            .map(|r| r.name.as_str())
            .collect::<Vec<_>>()
            .join("; ")
    );
}
