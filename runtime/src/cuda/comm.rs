//! Ranks and NCCL communicators. The launcher variables say who this process is:
//! torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, or
//! Slurm's `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` (with `MASTER_ADDR`/`MASTER_PORT`
//! exported by the batch script); none of them means one rank. Rank 0 makes the NCCL
//! unique id and hands it to the others over TCP at `MASTER_ADDR:MASTER_PORT+1` (torchrun's
//! own store holds `MASTER_PORT`); the world communicator is then split once per mesh axis
//! into the axis's process groups.

use super::error::{CudaError, CudaResult};
use cudarc::nccl::{result as nr, sys as ns};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// Who this process is among the launched ones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: u32,
    pub world: u32,
    pub local_rank: u32,
    pub master_addr: String,
    pub master_port: u16,
    /// Which variables said so ("torchrun", "slurm", "single").
    pub source: &'static str,
}

impl LaunchEnv {
    pub fn single() -> LaunchEnv {
        LaunchEnv {
            rank: 0,
            world: 1,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            source: "single",
        }
    }

    pub fn from_env() -> CudaResult<LaunchEnv> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the launcher variables through `get` (tests pass a map).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> CudaResult<LaunchEnv> {
        let num = |k: &str| -> CudaResult<Option<u32>> {
            match get(k) {
                None => Ok(None),
                Some(v) => v.trim().parse::<u32>().map(Some).map_err(|_| {
                    CudaError::Launcher(format!("{k}={v:?} is not a non-negative integer"))
                }),
            }
        };
        let (rank, world, local, source) =
            if let (Some(r), Some(w)) = (num("RANK")?, num("WORLD_SIZE")?) {
                (r, w, num("LOCAL_RANK")?.unwrap_or(r), "torchrun")
            } else if let (Some(r), Some(w)) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?) {
                (r, w, num("SLURM_LOCALID")?.unwrap_or(0), "slurm")
            } else {
                if get("RANK").is_some() != get("WORLD_SIZE").is_some() {
                    return Err(CudaError::Launcher(
                        "RANK and WORLD_SIZE must be set together".into(),
                    ));
                }
                return Ok(LaunchEnv::single());
            };
        if world == 0 || rank >= world {
            return Err(CudaError::Launcher(format!(
                "rank {rank} is out of range for world size {world}"
            )));
        }
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let master_port = match get("MASTER_PORT") {
            Some(p) => p
                .trim()
                .parse::<u16>()
                .map_err(|_| CudaError::Launcher(format!("MASTER_PORT={p:?} is not a port")))?,
            None => 29500,
        };
        if world > 1 && get("MASTER_ADDR").is_none() && source == "slurm" {
            return Err(CudaError::Launcher(
                "a Slurm launch of several tasks needs MASTER_ADDR (e.g. `export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)`)".into(),
            ));
        }
        Ok(LaunchEnv {
            rank,
            world,
            local_rank: local,
            master_addr,
            master_port,
            source,
        })
    }

    /// The port the NCCL id is exchanged on.
    pub fn id_port(&self) -> u16 {
        self.master_port.wrapping_add(1)
    }
}

/// Which group of `groups` holds `rank`, and its position there.
pub fn group_of(groups: &[Vec<u32>], rank: u32) -> Option<(usize, usize)> {
    groups
        .iter()
        .enumerate()
        .find_map(|(gi, g)| g.iter().position(|&r| r == rank).map(|p| (gi, p)))
}

/// The world communicator and one per mesh axis.
pub struct Comms {
    pub world: ns::ncclComm_t,
    pub axes: BTreeMap<String, ns::ncclComm_t>,
    pub ranks: u32,
}

// SAFETY: communicators are used from the executor's thread.
unsafe impl Send for Comms {}

impl Drop for Comms {
    fn drop(&mut self) {
        for (_, c) in std::mem::take(&mut self.axes) {
            // SAFETY: created by split, destroyed once.
            let _ = unsafe { nr::comm_destroy(c) };
        }
        // SAFETY: created by init, destroyed once.
        let _ = unsafe { nr::comm_destroy(self.world) };
    }
}

fn exchange_id(env: &LaunchEnv) -> CudaResult<ns::ncclUniqueId> {
    let port = env.id_port();
    if env.rank == 0 {
        let id = nr::get_uniqueid().map_err(|e| CudaError::nccl("ncclGetUniqueId", e))?;
        if env.world == 1 {
            return Ok(id);
        }
        let l = std::net::TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
            CudaError::Launcher(format!("rank 0 cannot listen on port {port}: {e}"))
        })?;
        let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
        for _ in 1..env.world {
            let (mut s, _) = l.accept().map_err(|e| {
                CudaError::Launcher(format!("accepting a rank on port {port}: {e}"))
            })?;
            s.write_all(&bytes)
                .map_err(|e| CudaError::Launcher(format!("sending the NCCL id: {e}")))?;
        }
        Ok(id)
    } else {
        let start = Instant::now();
        let addr = format!("{}:{port}", env.master_addr);
        loop {
            match std::net::TcpStream::connect(&addr) {
                Ok(mut s) => {
                    let mut b = [0u8; 128];
                    s.read_exact(&mut b).map_err(|e| {
                        CudaError::Launcher(format!("reading the NCCL id from {addr}: {e}"))
                    })?;
                    let mut id = ns::ncclUniqueId { internal: [0; 128] };
                    for (d, s) in id.internal.iter_mut().zip(b) {
                        *d = s as std::ffi::c_char;
                    }
                    return Ok(id);
                }
                Err(e) if start.elapsed() < Duration::from_secs(300) => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => {
                    return Err(CudaError::Launcher(format!(
                        "rank {} could not reach rank 0 at {addr}: {e}",
                        env.rank
                    )))
                }
            }
        }
    }
}

impl Comms {
    /// Initialises the world communicator and splits one per axis (`groups[axis]`).
    pub fn new(env: &LaunchEnv, groups: &BTreeMap<String, Vec<Vec<u32>>>) -> CudaResult<Comms> {
        if !super::probe::nccl_present() {
            return Err(CudaError::MissingLibrary {
                lib: "NCCL (libnccl.so.2)",
                help: "install NCCL or add its directory to LD_LIBRARY_PATH".into(),
            });
        }
        let id = exchange_id(env)?;
        let mut world = std::ptr::null_mut();
        // SAFETY: out-parameter; id shared by every rank.
        unsafe { ns::ncclCommInitRank(&mut world, env.world as i32, id, env.rank as i32) }
            .result()
            .map_err(|e| CudaError::nccl("ncclCommInitRank", e))?;
        let mut c = Comms {
            world,
            axes: BTreeMap::new(),
            ranks: env.world,
        };
        for (axis, gs) in groups {
            let (color, key) = group_of(gs, env.rank).ok_or_else(|| {
                CudaError::Plan(format!(
                    "rank {} is in no group of mesh axis `{axis}`",
                    env.rank
                ))
            })?;
            let mut sub = std::ptr::null_mut();
            // SAFETY: world is live; every rank calls split in the same axis order.
            unsafe {
                ns::ncclCommSplit(
                    c.world,
                    color as i32,
                    key as i32,
                    &mut sub,
                    std::ptr::null_mut(),
                )
            }
            .result()
            .map_err(|e| CudaError::nccl(&format!("ncclCommSplit({axis})"), e))?;
            c.axes.insert(axis.clone(), sub);
        }
        Ok(c)
    }

    pub fn axis(&self, axis: &str) -> CudaResult<ns::ncclComm_t> {
        self.axes
            .get(axis)
            .copied()
            .ok_or_else(|| CudaError::Plan(format!("no communicator for mesh axis `{axis}`")))
    }
}

/// NCCL data type of a dtype.
pub fn nccl_type(d: weft_ir::DType) -> CudaResult<ns::ncclDataType_t> {
    use weft_ir::DType as D;
    Ok(match d {
        D::F32 => ns::ncclDataType_t::ncclFloat32,
        D::BF16 => ns::ncclDataType_t::ncclBfloat16,
        D::F16 => ns::ncclDataType_t::ncclFloat16,
        D::F64 => ns::ncclDataType_t::ncclFloat64,
        D::I64 => ns::ncclDataType_t::ncclInt64,
        D::I32 => ns::ncclDataType_t::ncclInt32,
        D::Bool => ns::ncclDataType_t::ncclUint8,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> CudaResult<LaunchEnv> {
        let m: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn launcher_variables() {
        assert_eq!(env(&[]).unwrap(), LaunchEnv::single());
        let t = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(
            (
                t.rank,
                t.world,
                t.local_rank,
                t.master_addr.as_str(),
                t.id_port(),
                t.source
            ),
            (3, 8, 3, "node0", 1235, "torchrun")
        );
        let s = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "n1"),
        ])
        .unwrap();
        assert_eq!(
            (s.rank, s.world, s.local_rank, s.source),
            (5, 16, 1, "slurm")
        );
        assert!(
            env(&[("SLURM_PROCID", "5"), ("SLURM_NTASKS", "16")]).is_err(),
            "slurm needs MASTER_ADDR"
        );
        assert!(env(&[("RANK", "8"), ("WORLD_SIZE", "8")]).is_err());
        assert!(env(&[("RANK", "x"), ("WORLD_SIZE", "8")]).is_err());
        assert!(env(&[("RANK", "0")]).is_err());
        assert!(env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")]).is_err());
    }

    #[test]
    fn groups() {
        let g = vec![vec![0, 2], vec![1, 3]];
        assert_eq!(group_of(&g, 3), Some((1, 1)));
        assert_eq!(group_of(&g, 4), None);
    }
}
