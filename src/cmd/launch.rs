//! `weft launch`: one process per GPU of this node, with the variables torchrun sets
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`) and NVLink multicast kept off (`NCCL_NVLS_ENABLE=0`,
//! `TORCH_SYMM_MEM_DISABLE_MULTICAST=1`, `NVSHMEM_DISABLE_NVLS=1`). When one rank fails,
//! the others get SIGTERM, then SIGKILL after `--grace` seconds, and the launcher exits
//! with the failed rank's code, naming it. `weft` as the command means this binary.

use crate::error::{CliError, CliResult};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// Far above any real node; guards the spawn loop against a typo.
const MAX_PROCS_PER_NODE: u32 = 1024;
/// Ranks in the whole launch (the project's limit for meshes).
const MAX_WORLD: u64 = 1 << 20;

#[derive(clap::Args)]
pub struct Args {
    /// Processes (GPUs) on this node.
    #[arg(long, default_value_t = 1)]
    pub nproc_per_node: u32,
    /// Nodes in the launch.
    #[arg(long, default_value_t = 1)]
    pub nnodes: u32,
    /// This node's index in [0, nnodes).
    #[arg(long, default_value_t = 0)]
    pub node_rank: u32,
    /// Address of the node that runs rank 0.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of rank 0's rendezvous (the NCCL id is served on the next port).
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,
    /// Seconds the other ranks get to exit after one fails, before they are killed.
    #[arg(long, default_value_t = 10.0)]
    pub grace: f64,
    /// The command each rank runs, after `--` (e.g. `-- weft run llama-tiny --backend cuda`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    pub command: Vec<String>,
}

/// The environment of one rank.
pub fn rank_env(a: &Args, local: u32) -> Vec<(String, String)> {
    let rank = u64::from(a.node_rank) * u64::from(a.nproc_per_node) + u64::from(local);
    let world = u64::from(a.nnodes) * u64::from(a.nproc_per_node);
    [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", local.to_string()),
        ("LOCAL_WORLD_SIZE", a.nproc_per_node.to_string()),
        ("GROUP_RANK", a.node_rank.to_string()),
        ("NODE_RANK", a.node_rank.to_string()),
        ("MASTER_ADDR", a.master_addr.clone()),
        ("MASTER_PORT", a.master_port.to_string()),
        ("NCCL_NVLS_ENABLE", "0".into()),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1".into()),
        ("NVSHMEM_DISABLE_NVLS", "1".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn validate(a: &Args) -> CliResult {
    if a.nproc_per_node == 0 || a.nproc_per_node > MAX_PROCS_PER_NODE {
        return Err(CliError::input(format!(
            "--nproc-per-node {} is outside [1, {MAX_PROCS_PER_NODE}]",
            a.nproc_per_node
        )));
    }
    if a.nnodes == 0 || a.node_rank >= a.nnodes {
        return Err(CliError::input(format!(
            "--node-rank {} is outside [0, --nnodes {})",
            a.node_rank, a.nnodes
        )));
    }
    let world = u64::from(a.nnodes) * u64::from(a.nproc_per_node);
    if world > MAX_WORLD {
        return Err(CliError::input(format!(
            "{} nodes x {} processes = {world} ranks, above the limit of {MAX_WORLD}",
            a.nnodes, a.nproc_per_node
        )));
    }
    if a.master_port == 0 {
        return Err(CliError::input(
            "--master-port 0 names no port: every rank must connect to the same one, so give it (torchrun's default is 29500)",
        ));
    }
    if a.master_port == u16::MAX {
        return Err(CliError::input(
            "--master-port 65535 leaves no port for the NCCL id (it goes on MASTER_PORT + 1)",
        ));
    }
    if !(a.grace.is_finite() && a.grace >= 0.0 && a.grace <= 3600.0) {
        return Err(CliError::input(format!(
            "--grace {} is not a number of seconds in [0, 3600]",
            a.grace
        )));
    }
    if a.command.is_empty() || a.command[0].is_empty() {
        return Err(CliError::input("no command to launch (give it after `--`)"));
    }
    Ok(())
}

fn program(name: &str) -> CliResult<std::path::PathBuf> {
    if name == "weft" {
        return std::env::current_exe()
            .map_err(|e| CliError::input(format!("cannot find this weft binary: {e}")));
    }
    Ok(name.into())
}

fn describe(status: ExitStatus) -> (String, i32) {
    if let Some(c) = status.code() {
        return (format!("exited with code {c}"), c.clamp(1, 255));
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return (format!("was killed by signal {sig}"), 128 + sig);
        }
    }
    ("ended abnormally".into(), 1)
}

#[cfg(unix)]
fn terminate(c: &Child) {
    // SAFETY: plain kill(2) on a child we spawned and have not reaped.
    unsafe {
        libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
    }
}

#[cfg(not(unix))]
fn terminate(c: &mut Child) {
    let _ = c.kill();
}

pub fn run(a: Args) -> CliResult {
    validate(&a)?;
    let exe = program(&a.command[0])?;
    let mut children: Vec<(u32, Option<Child>)> = Vec::new();
    for local in 0..a.nproc_per_node {
        let mut cmd = Command::new(&exe);
        cmd.args(&a.command[1..]).envs(rank_env(&a, local));
        match cmd.spawn() {
            Ok(c) => children.push((local, Some(c))),
            Err(e) => {
                for (_, c) in children.iter_mut() {
                    if let Some(c) = c.as_mut() {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                }
                return Err(CliError::input(format!(
                    "cannot start `{}` for local rank {local}: {e}",
                    a.command[0]
                )));
            }
        }
    }
    let base = u64::from(a.node_rank) * u64::from(a.nproc_per_node);
    let mut failure: Option<CliError> = None;
    let mut stop_deadline: Option<Instant> = None;
    loop {
        let mut running = 0;
        for (local, slot) in children.iter_mut() {
            let Some(c) = slot.as_mut() else { continue };
            match c.try_wait() {
                Ok(Some(status)) => {
                    *slot = None;
                    if !status.success() && failure.is_none() {
                        let (what, code) = describe(status);
                        let mut e = CliError::failed(format!(
                            "rank {} (local rank {local}) {what}; the other ranks were stopped",
                            base + u64::from(*local)
                        ));
                        e.code = code;
                        failure = Some(e);
                    }
                }
                Ok(None) => running += 1,
                Err(e) => {
                    return Err(CliError::failed(format!(
                        "waiting for local rank {local}: {e}"
                    )))
                }
            }
        }
        if running == 0 {
            break;
        }
        if failure.is_some() {
            match stop_deadline {
                None => {
                    for c in children.iter_mut().filter_map(|(_, c)| c.as_mut()) {
                        terminate(c);
                    }
                    stop_deadline = Some(Instant::now() + Duration::from_secs_f64(a.grace));
                }
                Some(t) if Instant::now() >= t => {
                    for c in children.iter_mut().filter_map(|(_, c)| c.as_mut()) {
                        let _ = c.kill();
                    }
                }
                Some(_) => {}
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
