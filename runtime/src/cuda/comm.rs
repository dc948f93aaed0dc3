//! NCCL communicators. Who this process is, and how rank 0's unique id reaches the
//! others, is [`crate::launch`] (CPU-testable); the world communicator is then split
//! once per mesh axis into the axis's process groups.

use super::error::{CudaError, CudaResult};
pub use crate::launch::LaunchEnv;
use cudarc::nccl::{result as nr, sys as ns};
use std::collections::BTreeMap;

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
    let mine = if env.rank == 0 {
        let id = nr::get_uniqueid().map_err(|e| CudaError::nccl("ncclGetUniqueId", e))?;
        let mut b = [0u8; crate::launch::ID_BYTES];
        for (d, &c) in b.iter_mut().zip(id.internal.iter()) {
            *d = c as u8;
        }
        Some(b)
    } else {
        None
    };
    let bytes = env
        .exchange_id(mine)
        .map_err(|e| CudaError::Launcher(e.0))?;
    let mut id = ns::ncclUniqueId { internal: [0; 128] };
    for (d, s) in id.internal.iter_mut().zip(bytes) {
        *d = s as std::ffi::c_char;
    }
    Ok(id)
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

/// A point-to-point exchange within one axis communicator.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Exchange {
    /// Member `j`'s `count / size` elements go to member `j`; member `i`'s arrive at
    /// offset `i`.
    AllToAll,
    /// Everything to the member `shift` places after this one, from the one `shift`
    /// places before it (ring attention's step).
    Shift(i64),
}

/// One send or receive of an exchange: the peer, and the element range of the buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Transfer {
    pub peer: usize,
    pub offset: usize,
    pub count: usize,
}

/// The sends and receives of member `me` of `size` for `count` elements.
pub fn transfers(
    x: Exchange,
    me: usize,
    size: usize,
    count: usize,
) -> (Vec<Transfer>, Vec<Transfer>) {
    match x {
        Exchange::AllToAll => {
            let chunk = count / size.max(1);
            let each: Vec<Transfer> = (0..size)
                .map(|j| Transfer {
                    peer: j,
                    offset: j * chunk,
                    count: chunk,
                })
                .collect();
            (each.clone(), each)
        }
        Exchange::Shift(shift) => {
            let n = size.max(1) as i64;
            let to = (me as i64 + shift).rem_euclid(n) as usize;
            let from = (me as i64 - shift).rem_euclid(n) as usize;
            let all = |peer| Transfer {
                peer,
                offset: 0,
                count,
            };
            (vec![all(to)], vec![all(from)])
        }
    }
}

/// Runs `x` on `stream` as one NCCL group of sends and receives (a transfer to this
/// member itself is a device copy inside the group, which NCCL allows).
pub fn send_recv(
    comm: ns::ncclComm_t,
    x: Exchange,
    send: u64,
    recv: u64,
    count: usize,
    dtype: weft_ir::DType,
    stream: ns::cudaStream_t,
) -> Result<nr::NcclStatus, nr::NcclError> {
    let (mut size, mut me) = (0i32, 0i32);
    // SAFETY: out-parameters of a live communicator.
    unsafe {
        ns::ncclCommCount(comm, &mut size).result()?;
        ns::ncclCommUserRank(comm, &mut me).result()?;
    }
    let ty = nccl_type(dtype).map_err(|_| nr::NcclError(ns::ncclResult_t::ncclInvalidArgument))?;
    let esz = dtype.size_bytes() as usize;
    let (sends, recvs) = transfers(x, me as usize, size as usize, count);
    // SAFETY: the buffers hold `count` elements (sized by the plan); group calls pair up.
    unsafe {
        ns::ncclGroupStart().result()?;
        for t in &sends {
            let p = (send as usize + t.offset * esz) as *const std::ffi::c_void;
            if let Err(e) = ns::ncclSend(p, t.count, ty, t.peer as i32, comm, stream).result() {
                let _ = ns::ncclGroupEnd();
                return Err(e);
            }
        }
        for t in &recvs {
            let p = (recv as usize + t.offset * esz) as *mut std::ffi::c_void;
            if let Err(e) = ns::ncclRecv(p, t.count, ty, t.peer as i32, comm, stream).result() {
                let _ = ns::ncclGroupEnd();
                return Err(e);
            }
        }
        ns::ncclGroupEnd().result()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups() {
        let g = vec![vec![0, 2], vec![1, 3]];
        assert_eq!(group_of(&g, 3), Some((1, 1)));
        assert_eq!(group_of(&g, 4), None);
    }

    /// Every send of every member meets the receive its peer posts, with the same count
    /// and the data the CPU reference moves (`ring_shift`: member r's block reaches
    /// r + shift; `all_to_all`: member i's chunk j reaches member j's slot i).
    #[test]
    fn sends_and_receives_pair_up() {
        for size in 1..=5 {
            for x in [
                Exchange::AllToAll,
                Exchange::Shift(1),
                Exchange::Shift(-1),
                Exchange::Shift(3),
            ] {
                let count = 12 * size;
                let all: Vec<_> = (0..size).map(|r| transfers(x, r, size, count)).collect();
                for (r, (sends, _)) in all.iter().enumerate() {
                    for s in sends {
                        let matching: Vec<_> =
                            all[s.peer].1.iter().filter(|t| t.peer == r).collect();
                        assert_eq!(matching.len(), 1, "{x:?} size {size} member {r}");
                        assert_eq!(matching[0].count, s.count);
                        match x {
                            Exchange::AllToAll => {
                                assert_eq!(s.offset, s.peer * count / size);
                                assert_eq!(matching[0].offset, r * count / size);
                            }
                            Exchange::Shift(k) => {
                                assert_eq!(s.peer, (r as i64 + k).rem_euclid(size as i64) as usize);
                                assert_eq!((s.offset, s.count), (0, count));
                            }
                        }
                    }
                }
            }
        }
    }
}
