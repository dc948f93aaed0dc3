//! YaRN rope scaling against transformers 5.17 `_compute_yarn_parameters` (values printed
//! by `ROPE_INIT_FUNCTIONS["yarn"]` for the configs below): the f32 inverse frequencies
//! and the attention factor, with gpt-oss's defaults, DeepSeek-V3's mscale /
//! mscale_all_dim, and an mscale_all_dim of 0 (HF's `if mscale and mscale_all_dim`).

use weft_ir::attrs::rope_inv_freq;
use weft_ir::{yarn_attention_factor, Float, RopeScaling};

fn yarn(
    factor: f64,
    fast: f64,
    slow: f64,
    orig: i64,
    attention: f64,
    truncate: bool,
) -> RopeScaling {
    RopeScaling::Yarn {
        factor: Float(factor),
        beta_fast: Float(fast),
        beta_slow: Float(slow),
        original_max_position_embeddings: orig,
        attention_factor: Float(attention),
        truncate,
    }
}

fn assert_freqs(got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-6 * w.abs(),
            "inv_freq[{i}]: {g:e} vs HF {w:e}"
        );
    }
}

#[test]
fn gpt_oss_defaults_match_hf() {
    let a = yarn_attention_factor(32.0, None, None);
    assert_eq!(a, 1.3465735902799727);
    let s = yarn(32.0, 32.0, 1.0, 4096, a, false);
    assert_eq!(s.attention_factor(), a);
    let want = [
        1.0,
        0.6890442967414856,
        0.4747820496559143,
        0.32714587450027466,
        0.22541800141334534,
        0.15532298386096954,
        0.1070244237780571,
        0.07374456524848938,
        0.05081327259540558,
        0.031705696135759354,
        0.019334999844431877,
        0.011592049151659012,
        0.006794959306716919,
        0.0038603590801358223,
        0.002093792660161853,
        0.00105260219424963,
        0.0004564839182421565,
        0.00012931869423482567,
        3.830881178146228e-05,
        2.6396468456368893e-05,
        1.818833698052913e-05,
        1.253256959898863e-05,
        8.635495760245249e-06,
        5.95023948335438e-06,
        4.099978468730114e-06,
        2.8250667583051836e-06,
        1.9465962850517826e-06,
        1.3412909538601525e-06,
        9.242089618055616e-07,
        6.368209142237902e-07,
        4.38797854940276e-07,
        3.023511396804679e-07,
    ];
    assert_freqs(&rope_inv_freq(150000.0, 64, &s, true), &want);
    assert_freqs(&rope_inv_freq(150000.0, 64, &s, false), &want);
}

#[test]
fn deepseek_mscale_matches_hf() {
    // mscale = mscale_all_dim = 1: the factors cancel (HF: exactly 1.0); truncate default
    let a = yarn_attention_factor(40.0, Some(1.0), Some(1.0));
    assert_eq!(a, 1.0);
    let s = yarn(40.0, 32.0, 1.0, 4096, a, true);
    let want = [
        1.0,
        0.7498942017555237,
        0.5623413324356079,
        0.4216965138912201,
        0.3162277638912201,
        0.23713736236095428,
        0.17782793939113617,
        0.1333521455526352,
        0.10000000149011612,
        0.07498941570520401,
        0.05623412877321243,
        0.039006926119327545,
        0.026879360899329185,
        0.01837814413011074,
        0.012447956018149853,
        0.0083345090970397,
        0.005500000435858965,
        0.0035619973205029964,
        0.002249365206807852,
        0.0013705134624615312,
        0.0007905694073997438,
        0.0004149904125370085,
        0.00017782794020604342,
        3.333803397254087e-05,
        2.499999936844688e-05,
        1.8747354260995053e-05,
        1.4058532542549074e-05,
        1.0542412383074407e-05,
        7.905694474175107e-06,
        5.928434347879374e-06,
        4.445698323252145e-06,
        3.3338035336782923e-06,
    ];
    assert_freqs(&rope_inv_freq(10000.0, 64, &s, true), &want);
    // unequal mscales: get_mscale(f, m) / get_mscale(f, m_all)
    let f: f64 = 40.0;
    let want = (0.1 * 0.8 * f.ln() + 1.0) / (0.1 * 0.6 * f.ln() + 1.0);
    assert_eq!(yarn_attention_factor(f, Some(0.8), Some(0.6)), want);
    // a factor of at most 1 scales nothing
    assert_eq!(yarn_attention_factor(1.0, None, None), 1.0);
    assert_eq!(yarn_attention_factor(0.5, Some(2.0), Some(1.0)), 1.0);
}

#[test]
fn zero_mscale_all_dim_falls_back_to_the_factor_alone() {
    let a = yarn_attention_factor(4.0, Some(0.707), Some(0.0));
    assert_eq!(a, 1.138629436111989);
    let s = yarn(4.0, 32.0, 1.0, 64, a, true);
    let want = [
        1.0,
        0.23717081546783447,
        0.04999999701976776,
        0.007905694656074047,
        0.0024999999441206455,
        0.0007905694656074047,
        0.0002500000118743628,
        7.905694656074047e-05,
    ];
    assert_freqs(&rope_inv_freq(10000.0, 16, &s, true), &want);
}

#[test]
fn text_form_round_trips() {
    let s = yarn(32.0, 32.0, 1.0, 4096, 1.3465735902799727, false);
    use weft_ir::attrs::AttrValue;
    let text = s.fmt_attr().unwrap();
    assert_eq!(
        text,
        "yarn(32.0, 32.0, 1.0, 4096, 1.3465735902799727, false)"
    );
    assert_eq!(RopeScaling::parse_attr(&text).unwrap(), s);
    assert!(RopeScaling::parse_attr("yarn(32.0, 32.0)").is_err());
}
