//! Defects found by the differential fuzz of the `.pt2` importer
//! (tests/fixtures/fuzz_pt2.py): each archive in tests/fixtures/pt2/fuzz (written by
//! `fuzz_pt2.py --regressions`) imports and reproduces the eager module's output at
//! sizes other than the export's example, or is refused by name.

mod common;
use common::*;

use std::collections::BTreeMap;
use weft_frontends::pt2::{import, Pt2Options};
use weft_ir::{DType, HostTensor};
use weft_runtime::cpu::{run, Precision, RunOptions};

/// The archive's logits at the stored `input_ids`, and torch's.
fn logits(name: &str) -> (HostTensor, HostTensor) {
    let dir = fixture("pt2/fuzz");
    let im = import(&dir.join(format!("{name}.pt2")), &Pt2Options::default())
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let st = weft_frontends::read_safetensors(&dir.join(format!("{name}.safetensors"))).unwrap();
    let ids = st["input_ids"].clone();
    let (b, s) = (ids.shape[0], ids.shape[1]);
    let labels = HostTensor::ints(DType::I64, vec![b, s], vec![0; b * s]);
    let ins = BTreeMap::from([
        ("input_ids".to_string(), ids),
        ("labels".to_string(), labels),
    ]);
    let o = RunOptions::new(Precision::F64)
        .bind("B", b as i64)
        .bind("S", s as i64);
    let r = run(&im.graph, &im.weights, &ins, &o).unwrap_or_else(|e| panic!("{name}: {e}"));
    (r.outputs["logits"].clone(), st["logits"].clone())
}

fn assert_reproduces(name: &str) {
    let (got, want) = logits(name);
    assert_eq!(got.shape, want.shape, "{name}: shape");
    let e = rel_err(&got, &want);
    assert!(e < 1e-5, "{name}: logits rel err {e}");
}

/// `i ** 2`, `i ** 0`, `-i` and `relu(i)` of int64 tensors: the runtime's unary ops
/// are float ops (it panicked); lowered as products, `0 - i` and `max(i, 0)`.
#[test]
fn integer_pow_neg_relu() {
    assert_reproduces("int_math");
}

/// `bool + bool` is `or` and `bool * bool` is `and` in torch; Weft added the bools
/// as numbers (True + True = 2, read back as 2.0): silently wrong.
#[test]
fn bool_arithmetic_is_logic() {
    assert_reproduces("bool_add");
}

/// SDPA with a causal-and-data bool mask whose some query rows keep no key: torch
/// gives 0 there, Weft's attention gave the mean of v (HF's eager convention).
#[test]
fn sdpa_fully_masked_rows_are_zero() {
    assert_reproduces("sdpa_mask_and_data");
}

/// A static export at S = 6 slicing the hidden size to 6 (`x[..., :6]`): the slice
/// keeps 6 at another sequence length (it became S: a [3, 9, 9] result for [3, 9, 6]).
#[test]
fn static_export_slice_of_a_model_dim_keeps_its_length() {
    assert_reproduces("static_slice_hidden");
}

/// ... and `arange(6)` beside it, which a static export cannot tell from the
/// positions, is refused by node rather than read as either.
#[test]
fn static_export_ambiguous_constant_is_refused() {
    let p = fixture("pt2/fuzz").join("static_arange_hidden.pt2");
    let e = import(&p, &Pt2Options::default()).unwrap_err().to_string();
    assert!(
        e.contains("node `add`") && e.contains("aten.add.Tensor"),
        "{e}"
    );
}

/// `w[arange(3) - 1]`: torch's advanced indexing counts -1 from the end; the runtime's
/// range check refused it (exit 2 on a program torch runs).
#[test]
fn a_negative_index_counts_from_the_end() {
    assert_reproduces("negative_index");
}

/// `gather` with an index smaller than x in a dim it does not gather along (an
/// expand-and-slice view): the CPU runtime narrowed x to the index's extent and
/// candle's gather refused the strided view.
#[test]
fn a_gather_index_smaller_than_its_input_reads_the_narrowed_input() {
    assert_reproduces("gather_smaller_index");
}

/// A rotary table from float32 frequencies is recognised (theta 10000, fitted) and
/// reproduces torch at another length ...
#[test]
fn a_rotary_table_from_f32_frequencies_is_recognised() {
    assert_reproduces("rope_f32_freqs");
}

/// ... but from bf16 ones (a model `.to(torch.bfloat16)`'d with its `inv_freq`) it is
/// refused, naming the buffer: a theta fitted through the probed positions (9961 here)
/// drifts from the rounded frequencies over a long sequence.
#[test]
fn a_rotary_table_from_bf16_frequencies_is_refused() {
    let p = fixture("pt2/fuzz").join("rope_bf16_freqs.pt2");
    let e = import(&p, &Pt2Options::default()).unwrap_err().to_string();
    assert!(
        e.contains("node `cos`") && e.contains("(bf16)") && e.contains("rounded to 16 bits"),
        "{e}"
    );
}
