//! `weft launch` on the CPU machine, without NCCL: the variables each rank gets, exit
//! codes, a failing rank stopping the others, and bad arguments.

use std::path::PathBuf;
use std::process::{Command, Output};

fn weft(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(args)
        .output()
        .unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("weft-launch-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn every_rank_gets_torchrun_variables_and_multicast_off() {
    let d = scratch("env");
    let script = format!(
        "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR:$MASTER_PORT $NCCL_NVLS_ENABLE $TORCH_SYMM_MEM_DISABLE_MULTICAST $NVSHMEM_DISABLE_NVLS\" > {}/r$RANK",
        d.display()
    );
    let o = weft(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--nnodes",
        "3",
        "--node-rank",
        "1",
        "--master-addr",
        "10.1.2.3",
        "--master-port",
        "4000",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    for (rank, local) in [(2, 0), (3, 1)] {
        let got = std::fs::read_to_string(d.join(format!("r{rank}"))).unwrap();
        assert_eq!(
            got.trim(),
            format!("{rank} 6 {local} 2 1 10.1.2.3:4000 0 1 1")
        );
    }
    assert!(!d.join("r0").exists() && !d.join("r4").exists());
}

#[test]
fn a_failing_rank_stops_the_others_and_names_itself() {
    // Rank 1 fails at once; the others would sleep for 10 minutes unless stopped (a
    // rank the launcher did not stop keeps the output pipe open, and this test hangs).
    let o = weft(&[
        "launch",
        "--nproc-per-node",
        "3",
        "--grace",
        "5",
        "--",
        "sh",
        "-c",
        "if [ \"$RANK\" = 1 ]; then exit 7; fi; exec sleep 600",
    ]);
    assert_eq!(o.status.code(), Some(7), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("rank 1 (local rank 1) exited with code 7"),
        "{e}"
    );
}

#[test]
fn ranks_that_ignore_sigterm_are_killed_after_the_grace_period() {
    let o = weft(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--grace",
        "0.2",
        "--",
        "sh",
        "-c",
        "if [ \"$RANK\" = 0 ]; then exit 3; fi; trap '' TERM; exec sleep 600",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
}

#[test]
fn success_is_exit_zero_and_weft_means_this_binary() {
    let o = weft(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--",
        "weft",
        "mesh",
        "dp=2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Both ranks printed the mesh.
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(out.matches("dp=2").count() >= 2, true, "{out}");
}

#[test]
fn bad_arguments_are_refused() {
    for args in [
        vec!["launch", "--nproc-per-node", "0", "--", "true"],
        vec!["launch", "--nnodes", "2", "--node-rank", "2", "--", "true"],
        vec![
            "launch",
            "--nproc-per-node",
            "1024",
            "--nnodes",
            "4096",
            "--",
            "true",
        ],
        vec!["launch", "--master-port", "65535", "--", "true"],
        vec!["launch", "--master-port", "0", "--", "true"],
        vec!["launch", "--grace", "nan", "--", "true"],
        vec!["launch", "--", "/nonexistent/program"],
    ] {
        let o = weft(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).starts_with("error: "),
            "{args:?}: {}",
            stderr(&o)
        );
        assert!(!stderr(&o).contains("panicked"), "{args:?}");
    }
}
