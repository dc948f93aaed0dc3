//! Collectives on a `dp=2,sp=2` mesh (ranks: 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1)), uneven
//! sizes, and a failure on one rank stopping every rank.

use super::*;
use weft_ir::attrs::{Float, ReduceOp};
use weft_ir::{At, Mesh, NodeMeta};

/// x [4, 8] = 0..32; rank (d, s) holds the block rows 2d..2d+2, cols 4s..4s+4.
fn blocked() -> (Graph, Value, Vec<f64>) {
    let mut g = Graph::new("c");
    g.mesh = Mesh::parse("dp=2,sp=2").unwrap();
    let x = input(&mut g, "x", fty(&[4, 8]));
    let r = g
        .add(
            Op::Slice {
                dim: 0,
                start: Dim::coord("dp") * 2,
                len: Dim::from(2),
            },
            &[x],
        )
        .unwrap();
    let b = g
        .add(
            Op::Slice {
                dim: 1,
                start: Dim::coord("sp") * 4,
                len: Dim::from(4),
            },
            &[r],
        )
        .unwrap();
    (g, b, (0..32).map(|v| v as f64).collect())
}

fn run_blocked(g: &Graph, data: &[f64]) -> RunResult {
    let opts = RunOptions {
        keep_rank_outputs: true,
        ..RunOptions::new(Precision::F64)
    };
    run(
        g,
        &BTreeMap::new(),
        &map(vec![("x", hf(&[4, 8], data.to_vec()))]),
        &opts,
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Rows `r0..r0+2`, cols `c0..c0+n` of the 4x8 grid.
fn block(data: &[f64], r0: usize, c0: usize, n: usize) -> Vec<f64> {
    (r0..r0 + 2)
        .flat_map(|r| (c0..c0 + n).map(move |c| data[r * 8 + c]))
        .collect()
}

#[test]
fn all_reduce_sum_avg_max_min_over_sp() {
    for (op, f) in [
        (ReduceOp::Sum, (|a, b| a + b) as fn(f64, f64) -> f64),
        (ReduceOp::Avg, |a, b| (a + b) / 2.0),
        (ReduceOp::Max, f64::max),
        (ReduceOp::Min, f64::min),
    ] {
        let (mut g, b, data) = blocked();
        let y = g
            .add(
                Op::AllReduce {
                    axis: "sp".into(),
                    op,
                },
                &[b],
            )
            .unwrap();
        g.set_output("y", y);
        g.add_output_split("y", 0, "dp");
        let r = run_blocked(&g, &data);
        for rank in 0..4 {
            let d = rank / 2;
            let (l, rr) = (block(&data, 2 * d, 0, 4), block(&data, 2 * d, 4, 4));
            let want: Vec<f64> = l.iter().zip(&rr).map(|(a, b)| f(*a, *b)).collect();
            assert_eq!(
                r.rank_outputs[rank]["y"].to_f64(),
                want,
                "{op:?} on rank {rank}"
            );
        }
        assert_eq!(r.outputs["y"].shape, vec![4, 4]);
    }
}

#[test]
fn all_gather_over_sp_rebuilds_the_rows() {
    let (mut g, b, data) = blocked();
    let y = g
        .add(
            Op::AllGather {
                axis: "sp".into(),
                dim: 1,
            },
            &[b],
        )
        .unwrap();
    g.set_output("y", y);
    g.add_output_split("y", 0, "dp");
    let r = run_blocked(&g, &data);
    assert_eq!(r.outputs["y"].to_f64(), data);
    assert_eq!(r.rank_outputs[3]["y"].to_f64(), block(&data, 2, 0, 8));
}

#[test]
fn reduce_scatter_over_sp() {
    let (mut g, b, data) = blocked();
    let y = g
        .add(
            Op::ReduceScatter {
                axis: "sp".into(),
                dim: 1,
                op: ReduceOp::Sum,
            },
            &[b],
        )
        .unwrap();
    g.set_output("y", y);
    g.add_output_split("y", 0, "dp");
    g.add_output_split("y", 1, "sp");
    let r = run_blocked(&g, &data);
    for rank in 0..4 {
        let (d, s) = (rank / 2, rank % 2);
        let (l, rr) = (
            block(&data, 2 * d, 2 * s, 2),
            block(&data, 2 * d, 4 + 2 * s, 2),
        );
        let want: Vec<f64> = l.iter().zip(&rr).map(|(a, b)| a + b).collect();
        assert_eq!(r.rank_outputs[rank]["y"].to_f64(), want, "rank {rank}");
    }
    let full: Vec<f64> = (0..4)
        .flat_map(|row| (0..4).map(move |c| (row * 8 + c) as f64 * 2.0 + 4.0))
        .collect();
    assert_eq!(r.outputs["y"].to_f64(), full);
}

#[test]
fn broadcast_from_a_root_coordinate() {
    let (mut g, b, data) = blocked();
    let y = g
        .add(
            Op::Broadcast {
                axis: "dp".into(),
                root: 1,
            },
            &[b],
        )
        .unwrap();
    g.set_output("y", y);
    g.add_output_split("y", 1, "sp");
    let r = run_blocked(&g, &data);
    for rank in 0..4 {
        assert_eq!(
            r.rank_outputs[rank]["y"].to_f64(),
            block(&data, 2, 4 * (rank % 2), 4),
            "rank {rank}"
        );
    }
    assert_eq!(r.outputs["y"].to_f64(), block(&data, 2, 0, 8));
}

#[test]
fn all_to_all_scatters_rows_and_gathers_columns() {
    let (mut g, b, data) = blocked();
    // [2, 4] -> [1, 8]: member j gets row j of every member's block, side by side.
    let y = g
        .add(
            Op::AllToAll {
                axis: "sp".into(),
                scatter_dim: 0,
                gather_dim: 1,
            },
            &[b],
        )
        .unwrap();
    g.set_output("y", y);
    g.add_output_split("y", 0, "dp");
    g.add_output_split("y", 0, "sp");
    let r = run_blocked(&g, &data);
    for rank in 0..4 {
        let (d, s) = (rank / 2, rank % 2);
        let row = 2 * d + s;
        assert_eq!(
            r.rank_outputs[rank]["y"].to_f64(),
            data[row * 8..row * 8 + 8].to_vec(),
            "rank {rank}"
        );
    }
    assert_eq!(r.outputs["y"].to_f64(), data);
    // and back: the inverse all_to_all restores each rank's block
    let (mut g, b, data) = blocked();
    let y = g
        .add(
            Op::AllToAll {
                axis: "sp".into(),
                scatter_dim: 0,
                gather_dim: 1,
            },
            &[b],
        )
        .unwrap();
    let z = g
        .add(
            Op::AllToAll {
                axis: "sp".into(),
                scatter_dim: 1,
                gather_dim: 0,
            },
            &[y],
        )
        .unwrap();
    g.set_output("z", z);
    g.add_output_split("z", 0, "dp");
    g.add_output_split("z", 1, "sp");
    assert_eq!(run_blocked(&g, &data).outputs["z"].to_f64(), data);
}

#[test]
fn all_gather_of_uneven_pieces() {
    // 5 entries over sp=2: rank 0 holds 3, rank 1 holds 2 (per-rank size tables).
    let mut g = Graph::new("u");
    g.mesh = Mesh::parse("sp=2").unwrap();
    let x = input(&mut g, "x", fty(&[5, 2]));
    let len = Dim::per_rank("sp", vec![3, 2]);
    let start = Dim::coord("sp") * 3;
    let piece = g.add(Op::Slice { dim: 0, start, len }, &[x]).unwrap();
    // The all_gather shape rule multiplies by the axis size, which is only right for even
    // pieces; a pass gathering uneven pieces gives the true total.
    let full = g.insert_typed(
        At::End,
        Op::AllGather {
            axis: "sp".into(),
            dim: 0,
        },
        &[piece],
        vec![fty(&[5, 2])],
        NodeMeta::default(),
    )[0];
    g.set_output("y", full);
    g.set_output("piece", piece);
    g.add_output_split("piece", 0, "sp");
    let data: Vec<f64> = (0..10).map(|v| v as f64).collect();
    let r = run64(
        &g,
        &BTreeMap::new(),
        &map(vec![("x", hf(&[5, 2], data.clone()))]),
    );
    assert_eq!(r.outputs["y"].to_f64(), data);
    assert_eq!(r.outputs["piece"].to_f64(), data);
}

#[test]
fn all_to_all_of_an_indivisible_dim_is_an_error() {
    let mut g = Graph::new("u");
    g.mesh = Mesh::parse("sp=2").unwrap();
    let x = input(&mut g, "x", fty(&[3, 2]));
    let y = g.insert_typed(
        At::End,
        Op::AllToAll {
            axis: "sp".into(),
            scatter_dim: 0,
            gather_dim: 1,
        },
        &[x],
        vec![fty(&[1, 4])],
        NodeMeta::default(),
    )[0];
    g.set_output("y", y);
    let e = run(
        &g,
        &BTreeMap::new(),
        &map(vec![("x", hf(&[3, 2], vec![0.0; 6]))]),
        &RunOptions::default(),
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("not divisible by the 2 ranks"),
        "{e}"
    );
}

/// Runs `f` on a thread and fails the test if it does not finish in time (a hang).
fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs))
        .expect("the run hung")
}

#[test]
fn a_failure_on_one_rank_stops_every_rank() {
    // Rank (dp=0, sp=1) computes a shape its node's per-rank type denies; the others
    // go on to an all_reduce that rank never reaches. They must stop, not hang.
    let (mut g, b, data) = blocked();
    g.set_scope(Some("model.layers.0.mlp"));
    let wrong_on_sp1 = TensorType::new(
        DType::F32,
        vec![Dim::from(2), Dim::per_rank("sp", vec![4, 3])],
    );
    let n = g.insert_typed(
        At::End,
        Op::Neg {},
        &[b],
        vec![wrong_on_sp1],
        NodeMeta {
            source: Some("model.layers.0.mlp".into()),
            ..Default::default()
        },
    )[0];
    let s = g.insert_typed(
        At::End,
        Op::Sum {
            dims: vec![0, 1],
            keepdim: false,
        },
        &[n],
        vec![fty(&[])],
        NodeMeta::default(),
    )[0];
    let y = g
        .add(
            Op::AllReduce {
                axis: "dp".into(),
                op: ReduceOp::Sum,
            },
            &[s],
        )
        .unwrap();
    let z = g
        .add(
            Op::AllReduce {
                axis: "sp".into(),
                op: ReduceOp::Sum,
            },
            &[y],
        )
        .unwrap();
    g.set_output("z", z);
    let err = within(60, move || {
        run(
            &g,
            &BTreeMap::new(),
            &map(vec![("x", hf(&[4, 8], data))]),
            &RunOptions::default(),
        )
        .unwrap_err()
    });
    match &err {
        RuntimeError::Node {
            rank,
            node,
            op,
            message,
        } => {
            assert!(*rank == 1 || *rank == 3, "{err}");
            assert_eq!(*op, "neg");
            assert!(node.contains("model.layers.0.mlp"), "{err}");
            assert!(
                message.contains("[2, 4] but the node's type says [2, 3]"),
                "{err}"
            );
        }
        other => panic!("unexpected error {other}"),
    }
}

#[test]
fn a_collective_over_a_missing_axis_fails_cleanly() {
    let (mut g, b, data) = blocked();
    let y = g.insert_typed(
        At::End,
        Op::AllReduce {
            axis: "tp".into(),
            op: ReduceOp::Sum,
        },
        &[b],
        vec![fty(&[2, 4])],
        NodeMeta::default(),
    )[0];
    let z = g.add(Op::Scale { factor: Float(1.0) }, &[y]).unwrap();
    g.set_output("z", z);
    let err = within(60, move || {
        run(
            &g,
            &BTreeMap::new(),
            &map(vec![("x", hf(&[4, 8], data))]),
            &RunOptions::default(),
        )
        .unwrap_err()
    });
    assert!(err.to_string().contains("has no axis `tp`"), "{err}");
}

#[test]
fn undeclared_split_outputs_are_caught() {
    let (mut g, b, data) = blocked();
    g.set_output("b", b);
    let e = run(
        &g,
        &BTreeMap::new(),
        &map(vec![("x", hf(&[4, 8], data))]),
        &RunOptions::default(),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("output `b`: rank 1 differs from rank 0"),
        "{e}"
    );
}
