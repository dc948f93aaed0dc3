//! Who this process is among launched ones, and the rendezvous that hands rank 0's
//! NCCL unique id to the others. No CUDA here, so the launcher protocol is tested on
//! any machine.
//!
//! The variables: torchrun's (and `weft launch`'s) `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`, or Slurm's `SLURM_PROCID`, `SLURM_NTASKS`,
//! `SLURM_LOCALID` (with `MASTER_ADDR`/`MASTER_PORT` exported by the batch script); none
//! of them means one rank. Rank 0 serves the id over TCP at `MASTER_ADDR:MASTER_PORT+1`
//! (torchrun's own store holds `MASTER_PORT`). Both sides give up after
//! `WEFT_RENDEZVOUS_TIMEOUT` seconds (default 300) with an error that says who was
//! missing.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// A launch that cannot go on: bad variables, or a rendezvous that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchError(pub String);

impl std::fmt::Display for LaunchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LaunchError {}

/// Who this process is among the launched ones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: u32,
    pub world: u32,
    pub local_rank: u32,
    pub master_addr: String,
    pub master_port: u16,
    /// How long the rendezvous waits for the other side.
    pub timeout: Duration,
    /// Which variables said so ("torchrun", "slurm", "single").
    pub source: &'static str,
}

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

impl LaunchEnv {
    pub fn single() -> LaunchEnv {
        LaunchEnv {
            rank: 0,
            world: 1,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            timeout: DEFAULT_TIMEOUT,
            source: "single",
        }
    }

    pub fn from_env() -> Result<LaunchEnv, LaunchError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the launcher variables through `get` (tests pass a map).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv, LaunchError> {
        let num =
            |k: &str| -> Result<Option<u32>, LaunchError> {
                match get(k) {
                    None => Ok(None),
                    Some(v) => v.trim().parse::<u32>().map(Some).map_err(|_| {
                        LaunchError(format!("{k}={v:?} is not a non-negative integer"))
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
                    return Err(LaunchError(
                        "RANK and WORLD_SIZE must be set together".into(),
                    ));
                }
                return Ok(LaunchEnv::single());
            };
        if world == 0 || rank >= world {
            return Err(LaunchError(format!(
                "rank {rank} is out of range for world size {world}"
            )));
        }
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let master_port = match get("MASTER_PORT") {
            Some(p) => match p.trim().parse::<u16>() {
                Ok(port) if port < u16::MAX => port,
                _ => {
                    return Err(LaunchError(format!(
                        "MASTER_PORT={p:?} is not a port below 65535 (the NCCL id goes on the next one)"
                    )))
                }
            },
            None => 29500,
        };
        if world > 1 && get("MASTER_ADDR").is_none() && source == "slurm" {
            return Err(LaunchError(
                "a Slurm launch of several tasks needs MASTER_ADDR (e.g. `export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)`)".into(),
            ));
        }
        let timeout = match get("WEFT_RENDEZVOUS_TIMEOUT") {
            None => DEFAULT_TIMEOUT,
            Some(t) => match t.trim().parse::<f64>() {
                Ok(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => Duration::from_secs_f64(s),
                _ => {
                    return Err(LaunchError(format!(
                        "WEFT_RENDEZVOUS_TIMEOUT={t:?} is not a number of seconds in (0, 86400]"
                    )))
                }
            },
        };
        Ok(LaunchEnv {
            rank,
            world,
            local_rank: local,
            master_addr,
            master_port,
            timeout,
            source,
        })
    }

    /// The port the NCCL id is exchanged on.
    pub fn id_port(&self) -> u16 {
        self.master_port.saturating_add(1)
    }

    /// Rank 0 hands `id` to every other rank; the others return what they received.
    /// Rank 0 calls it with `Some(id)`, the others with `None`.
    pub fn exchange_id(&self, id: Option<[u8; ID_BYTES]>) -> Result<[u8; ID_BYTES], LaunchError> {
        match (self.rank, id) {
            (0, Some(id)) => {
                if self.world > 1 {
                    let l = TcpListener::bind(("0.0.0.0", self.id_port())).map_err(|e| {
                        LaunchError(format!(
                            "rank 0 cannot listen on port {} (MASTER_PORT + 1): {e}",
                            self.id_port()
                        ))
                    })?;
                    serve_id(&l, &id, self.world - 1, self.timeout)?;
                }
                Ok(id)
            }
            (0, None) => Err(LaunchError("rank 0 must make the id it hands out".into())),
            (rank, _) => fetch_id(
                &format!("{}:{}", self.master_addr, self.id_port()),
                rank,
                self.timeout,
            ),
        }
    }
}

/// Sends `id` to `clients` connections on `l`, or fails once `timeout` has passed
/// naming how many arrived.
pub fn serve_id(
    l: &TcpListener,
    id: &[u8; ID_BYTES],
    clients: u32,
    timeout: Duration,
) -> Result<(), LaunchError> {
    let port = l.local_addr().map(|a| a.port()).unwrap_or(0);
    l.set_nonblocking(true)
        .map_err(|e| LaunchError(format!("rank 0: port {port}: {e}")))?;
    let deadline = Instant::now() + timeout;
    let mut served = 0u32;
    while served < clients {
        match l.accept() {
            Ok((mut s, _)) => {
                let _ = s.set_nonblocking(false);
                let _ = s.set_write_timeout(Some(timeout));
                s.write_all(id)
                    .map_err(|e| LaunchError(format!("rank 0: sending the NCCL id: {e}")))?;
                served += 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(LaunchError(format!(
                        "rendezvous timed out after {:.0} s: {served} of the other {clients} ranks reached rank 0 on port {port} (set WEFT_RENDEZVOUS_TIMEOUT to wait longer; check that every rank was started with the same WORLD_SIZE and MASTER_ADDR)",
                        timeout.as_secs_f64()
                    )));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                return Err(LaunchError(format!(
                    "rank 0: accepting on port {port}: {e}"
                )))
            }
        }
    }
    Ok(())
}

/// Connects to rank 0 at `addr` (retrying until `timeout`) and reads the id.
pub fn fetch_id(addr: &str, rank: u32, timeout: Duration) -> Result<[u8; ID_BYTES], LaunchError> {
    let deadline = Instant::now() + timeout;
    loop {
        match TcpStream::connect(addr) {
            Ok(mut s) => {
                let left = deadline.saturating_duration_since(Instant::now());
                let _ = s.set_read_timeout(Some(left.max(Duration::from_millis(100))));
                let mut b = [0u8; ID_BYTES];
                s.read_exact(&mut b).map_err(|e| {
                    LaunchError(format!("rank {rank}: reading the NCCL id from {addr}: {e}"))
                })?;
                return Ok(b);
            }
            Err(e) if Instant::now() >= deadline => {
                return Err(LaunchError(format!(
                    "rendezvous timed out after {:.0} s: rank {rank} could not reach rank 0 at {addr}: {e} (is rank 0 running, and MASTER_ADDR/MASTER_PORT the same on every rank?)",
                    timeout.as_secs_f64()
                )))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn env(pairs: &[(&str, &str)]) -> Result<LaunchEnv, LaunchError> {
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
            ("WEFT_RENDEZVOUS_TIMEOUT", "2.5"),
        ])
        .unwrap();
        assert_eq!(
            (
                t.rank,
                t.world,
                t.local_rank,
                t.master_addr.as_str(),
                t.id_port(),
                t.source,
                t.timeout
            ),
            (
                3,
                8,
                3,
                "node0",
                1235,
                "torchrun",
                Duration::from_millis(2500)
            )
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
        let bad = [
            vec![("SLURM_PROCID", "5"), ("SLURM_NTASKS", "16")],
            vec![("RANK", "8"), ("WORLD_SIZE", "8")],
            vec![("RANK", "x"), ("WORLD_SIZE", "8")],
            vec![("RANK", "0")],
            vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")],
            vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "65535")],
            vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("WEFT_RENDEZVOUS_TIMEOUT", "-1"),
            ],
            vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("WEFT_RENDEZVOUS_TIMEOUT", "nan"),
            ],
        ];
        for b in bad {
            assert!(env(&b).is_err(), "{b:?}");
        }
    }

    #[test]
    fn rank_zero_hands_its_id_to_every_other_rank() {
        let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let mut id = [0u8; ID_BYTES];
        for (i, b) in id.iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        let clients: Vec<_> = (1..4)
            .map(|r| {
                let a = addr.clone();
                std::thread::spawn(move || fetch_id(&a, r, Duration::from_secs(30)))
            })
            .collect();
        serve_id(&l, &id, 3, Duration::from_secs(30)).unwrap();
        for c in clients {
            assert_eq!(c.join().unwrap().unwrap(), id);
        }
    }

    #[test]
    fn a_missing_rank_times_out_with_a_count() {
        let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let one = std::thread::spawn(move || fetch_id(&addr, 1, Duration::from_secs(30)));
        let err = serve_id(&l, &[9; ID_BYTES], 2, Duration::from_millis(500)).unwrap_err();
        assert!(err.0.contains("1 of the other 2 ranks"), "{err}");
        assert_eq!(one.join().unwrap().unwrap(), [9; ID_BYTES]);
    }

    #[test]
    fn an_absent_rank_zero_times_out_naming_the_address() {
        // A port nobody listens on: bind one, then drop it.
        let port = TcpListener::bind(("127.0.0.1", 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let err = fetch_id(&addr, 2, Duration::from_millis(300)).unwrap_err();
        assert!(
            err.0.contains("rank 2 could not reach rank 0") && err.0.contains(&addr),
            "{err}"
        );
    }
}
