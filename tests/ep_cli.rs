//! The `weft` binary with expert parallelism: `weft mesh` prints DeepSpeed's expert
//! groups, `weft check --train` passes on the MoE fixtures for ep meshes, and bad ep
//! degrees are errors (exit code 2) that say what would work.

mod common;
use common::*;

#[test]
fn mesh_prints_deepspeed_expert_groups() {
    let (code, out, err) = weft(&["mesh", "dp=4,tp=2,ep=4", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v = json(&out);
    assert_eq!(v["world_size"], 8);
    let groups = |axis: &str| -> String {
        let g = v["groups"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x[0] == axis)
            .unwrap_or_else(|| panic!("no {axis} groups in {v}"));
        g[1].to_string()
    };
    assert_eq!(groups("tp"), "[[0,1],[2,3],[4,5],[6,7]]");
    assert_eq!(groups("dp"), "[[0,2,4,6],[1,3,5,7]]");
    assert_eq!(groups("ep"), "[[0,1,2,3],[4,5,6,7]]");
    assert_eq!(groups("edp"), "[[0,4],[1,5],[2,6],[3,7]]");
    let (code, out, _) = weft(&["mesh", "edp=2,ep=4"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("mesh dp=8,ep=4,edp=2 (8 ranks)"), "{out}");
    assert!(
        out.contains("ep groups: (0,1,2,3) (4,5,6,7)\nedp groups: (0,4) (1,5) (2,6) (3,7)\n"),
        "{out}"
    );
}

#[test]
fn check_train_passes_on_moe_fixtures() {
    for model in ["tests/fixtures/mixtral", "tests/fixtures/qwen3_moe"] {
        for mesh in ["ep=2", "ep=4", "dp=2,sp=2,ep=4", "dp=4,tp=2,ep=4"] {
            let (code, out, err) = weft(&["check", model, "--mesh", mesh, "--train", "--json"]);
            assert_eq!(code, 0, "{model} {mesh}: {out}{err}");
            let v = json(&out);
            assert_eq!(v["ok"], true, "{model} {mesh}: {v}");
            assert!(
                v["max_rel_err_grads"].as_f64().unwrap() < 1e-12,
                "{model} {mesh}: {v}"
            );
        }
    }
}

#[test]
fn check_train_passes_on_imported_moe() {
    // torch.export archives: the importer's MoE blocks are split the same way.
    for model in [
        "tests/fixtures/pt2/mixtral_decomposed.pt2",
        "tests/fixtures/pt2/qwen3_moe_batched.pt2",
    ] {
        let (code, out, err) = weft(&["check", model, "--mesh", "dp=2,ep=2", "--train", "--json"]);
        assert_eq!(code, 0, "{model}: {out}{err}");
        assert_eq!(json(&out)["ok"], true, "{model}: {out}");
    }
}

#[test]
fn bad_ep_is_a_clear_error() {
    let (code, _, err) = weft(&["check", "tests/fixtures/mixtral", "--mesh", "dp=3,ep=3"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("error: `expert-parallel` cannot split 4 experts over ep=3 in node %"),
        "{err}"
    );
    assert!(
        err.contains("help: use an ep that divides the 4 experts: 2, 4"),
        "{err}"
    );
    let (code, _, err) = weft(&["compile", "mixtral-tiny", "--mesh", "dp=2,ep=4"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("ep=4 must divide the 2 ranks of `dp=2`"),
        "{err}"
    );
}

#[test]
fn plans_size_received_rows_at_their_bound() {
    let dir = std::env::temp_dir().join(format!("weft-ep-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("plan.json");
    let (code, out, err) = weft(&[
        "compile",
        "mixtral-tiny",
        "--mesh",
        "ep=2",
        "--batch",
        "4",
        "--seq",
        "16",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let v = json(&std::fs::read_to_string(&plan).unwrap());
    // The data-dependent row counts stay unbound in the plan (the runtime binds them).
    let bound: Vec<&String> = v["bindings"].as_object().unwrap().keys().collect();
    assert!(bound.iter().all(|k| !k.starts_with('R')), "{bound:?}");
    assert!(v["program"].as_str().unwrap().contains("all_to_all_v"));
    std::fs::remove_dir_all(&dir).ok();
}
