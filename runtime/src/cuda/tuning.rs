//! Tuning knobs of the CUDA runtime. They are read from the environment once, by
//! [`Tuning::from_env`] (which `ExecOptions::from_env` calls), and carried to lowering and
//! the executor in `ExecOptions`: no code below reads the environment itself, and
//! `ExecOptions::default()` is the same on every machine.

/// Kernel variants and instrumentation that measurements chose defaults for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// `WEFT_FA_WARPS=8`: 8 warps (128 query rows) per tensor-core forward block, not 4.
    pub fa_fwd_warps: usize,
    /// `WEFT_FA_FWD=m1`: one 16-row m-tile per warp in the head-dim-64 forward (default two).
    pub fa_fwd_one_mtile: bool,
    /// `WEFT_FA_BWD_WARPS=4|8`: warps per tensor-core backward block (default: 4 for head
    /// dim 64, 8 for 128, as measured on an H200).
    pub fa_bwd_warps: Option<usize>,
    /// `WEFT_FA_BWD=plain`: the head-dim-64 backward without K/V/dS held in registers.
    pub fa_bwd_plain: bool,
    /// `WEFT_PROFILE` (any value): device time per instruction of each step.
    pub profile: bool,
    /// `WEFT_CUDA_GRAPH=0`: launch every kernel of every step instead of replaying the
    /// step captured as a CUDA graph (on by default where the plan allows capture).
    pub cuda_graph: bool,
    /// `WEFT_FP8_FAST_ACCUM=1`: the forward FP8 GEMMs (e4m3 x e4m3) accumulate without
    /// cuBLASLt's periodic promotion to f32 (faster, less accurate; off by default).
    pub fp8_fast_accum: bool,
    /// `WEFT_GEMM_TUNE=1`: time cuBLASLt's top candidates for each large GEMM shape on
    /// its first (eager) use and keep the fastest, instead of the heuristic's first.
    pub gemm_tune: bool,
    /// `WEFT_CUDNN_ENGINE_FWD=n` / `WEFT_CUDNN_ENGINE_BWD=n`: cuDNN attention takes the
    /// n-th execution plan that finalizes (heuristics order) instead of the first, and
    /// `WEFT_CUDNN_ENGINE_LIST=1` lists them with their engines (measuring cuDNN's
    /// engines against each other).
    pub cudnn_engine_fwd: usize,
    pub cudnn_engine_bwd: usize,
    pub cudnn_engine_list: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            fa_fwd_warps: 4,
            fa_fwd_one_mtile: false,
            fa_bwd_warps: None,
            fa_bwd_plain: false,
            profile: false,
            cuda_graph: true,
            fp8_fast_accum: false,
            gemm_tune: false,
            cudnn_engine_fwd: 0,
            cudnn_engine_bwd: 0,
            cudnn_engine_list: false,
        }
    }
}

impl Tuning {
    /// The knobs from `WEFT_FA_WARPS`, `WEFT_FA_FWD`, `WEFT_FA_BWD_WARPS`, `WEFT_FA_BWD`,
    /// `WEFT_PROFILE`, `WEFT_CUDA_GRAPH`, `WEFT_FP8_FAST_ACCUM`, `WEFT_GEMM_TUNE` and
    /// `WEFT_CUDNN_ENGINE_*`; unknown values keep the default.
    pub fn from_env() -> Tuning {
        Tuning::from_vars(|k| std::env::var(k).ok())
    }

    fn from_vars(get: impl Fn(&str) -> Option<String>) -> Tuning {
        let d = Tuning::default();
        Tuning {
            fa_fwd_warps: match get("WEFT_FA_WARPS").as_deref() {
                Some("8") => 8,
                _ => d.fa_fwd_warps,
            },
            fa_fwd_one_mtile: get("WEFT_FA_FWD").as_deref() == Some("m1"),
            fa_bwd_warps: match get("WEFT_FA_BWD_WARPS").as_deref() {
                Some("4") => Some(4),
                Some("8") => Some(8),
                _ => None,
            },
            fa_bwd_plain: get("WEFT_FA_BWD").as_deref() == Some("plain"),
            profile: get("WEFT_PROFILE").is_some(),
            cuda_graph: get("WEFT_CUDA_GRAPH").as_deref() != Some("0"),
            fp8_fast_accum: get("WEFT_FP8_FAST_ACCUM").as_deref() == Some("1"),
            gemm_tune: get("WEFT_GEMM_TUNE").as_deref() == Some("1"),
            cudnn_engine_fwd: get("WEFT_CUDNN_ENGINE_FWD")
                .and_then(|v| v.parse().ok())
                .unwrap_or(d.cudnn_engine_fwd),
            cudnn_engine_bwd: get("WEFT_CUDNN_ENGINE_BWD")
                .and_then(|v| v.parse().ok())
                .unwrap_or(d.cudnn_engine_bwd),
            cudnn_engine_list: get("WEFT_CUDNN_ENGINE_LIST").is_some(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knobs_parse_and_unknown_values_keep_defaults() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(Tuning::from_vars(vars(&[])), Tuning::default());
        let t = Tuning::from_vars(vars(&[
            ("WEFT_FA_WARPS", "8"),
            ("WEFT_FA_FWD", "m1"),
            ("WEFT_FA_BWD_WARPS", "4"),
            ("WEFT_FA_BWD", "plain"),
            ("WEFT_PROFILE", "1"),
            ("WEFT_CUDA_GRAPH", "0"),
            ("WEFT_GEMM_TUNE", "1"),
            ("WEFT_CUDNN_ENGINE_BWD", "2"),
            ("WEFT_CUDNN_ENGINE_LIST", "1"),
        ]));
        assert_eq!(
            t,
            Tuning {
                fa_fwd_warps: 8,
                fa_fwd_one_mtile: true,
                fa_bwd_warps: Some(4),
                fa_bwd_plain: true,
                profile: true,
                cuda_graph: false,
                fp8_fast_accum: false,
                gemm_tune: true,
                cudnn_engine_fwd: 0,
                cudnn_engine_bwd: 2,
                cudnn_engine_list: true,
            }
        );
        let t = Tuning::from_vars(vars(&[
            ("WEFT_FA_WARPS", "5"),
            ("WEFT_FA_BWD_WARPS", "x"),
            ("WEFT_CUDNN_ENGINE_FWD", "-1"),
        ]));
        assert_eq!(t.fa_fwd_warps, 4);
        assert_eq!(t.cudnn_engine_fwd, 0);
        assert_eq!(t.fa_bwd_warps, None);
    }
}
