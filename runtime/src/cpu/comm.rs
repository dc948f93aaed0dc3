//! In-process collectives between the rank threads.
//!
//! Each collective node is a rendezvous keyed by `(node, group)`: every member of the
//! group deposits its tensor, the last to arrive computes every member's result once
//! (in member order, so the result does not depend on who came last) and the others
//! pick theirs up. The tensors are candle tensors shared between threads, and results
//! are built from them with `cat`/`narrow`/`add`, so autograd flows across ranks.
//!
//! A failing rank calls [`Comm::abort`]; every rank waiting in (or later entering) a
//! rendezvous then returns [`CommError::Aborted`]. Nothing waits without checking the
//! abort flag, so no failure can hang the run.

use candle_core::Tensor;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

pub(crate) enum CommError {
    /// Another rank failed; its error is the one to report.
    Aborted,
    /// Combining the group's tensors failed on this rank (the one that combined them).
    Failed(String),
}

struct Slot {
    inputs: Vec<Option<Tensor>>,
    arrived: usize,
    result: Option<Vec<Tensor>>,
    taken: usize,
}

#[derive(Default)]
pub(crate) struct Comm {
    slots: Mutex<HashMap<(u32, usize), Slot>>,
    cv: Condvar,
    aborted: AtomicBool,
}

impl Comm {
    pub(crate) fn new() -> Comm {
        Comm::default()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<(u32, usize), Slot>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes every rank stop at its next node or rendezvous.
    pub(crate) fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        let _guard = self.lock();
        self.cv.notify_all();
    }

    pub(crate) fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// Deposits `x` as member `member` of a group of `size` for the collective `key`,
    /// waits for the others and returns this member's result. `combine` gets every
    /// member's tensor in member order and returns every member's result; it runs once,
    /// on the last member to arrive, outside the lock.
    pub(crate) fn exchange(
        &self,
        key: (u32, usize),
        member: usize,
        size: usize,
        x: Tensor,
        combine: impl FnOnce(Vec<Tensor>) -> Result<Vec<Tensor>, String>,
    ) -> Result<Tensor, CommError> {
        let mut slots = self.lock();
        if self.is_aborted() {
            return Err(CommError::Aborted);
        }
        let slot = slots.entry(key).or_insert_with(|| Slot {
            inputs: vec![None; size],
            arrived: 0,
            result: None,
            taken: 0,
        });
        if slot.inputs.len() != size || slot.inputs[member].is_some() {
            drop(slots);
            self.abort();
            return Err(CommError::Failed(format!(
                "internal: member {member} of a group of {size} entered the same collective twice"
            )));
        }
        slot.inputs[member] = Some(x);
        slot.arrived += 1;
        if slot.arrived == size {
            let inputs: Vec<Tensor> = slot
                .inputs
                .iter_mut()
                .map(|t| t.take().expect("all arrived"))
                .collect();
            drop(slots);
            let result = match combine(inputs) {
                Ok(r) if r.len() == size => r,
                Ok(r) => {
                    self.abort();
                    return Err(CommError::Failed(format!(
                        "internal: {} results for a group of {size}",
                        r.len()
                    )));
                }
                Err(m) => {
                    self.abort();
                    return Err(CommError::Failed(m));
                }
            };
            slots = self.lock();
            if let Some(slot) = slots.get_mut(&key) {
                slot.result = Some(result);
            }
            self.cv.notify_all();
        }
        loop {
            if self.is_aborted() {
                return Err(CommError::Aborted);
            }
            if let Some(slot) = slots.get_mut(&key) {
                if let Some(result) = &slot.result {
                    let mine = result[member].clone();
                    slot.taken += 1;
                    if slot.taken == size {
                        slots.remove(&key);
                    }
                    return Ok(mine);
                }
            }
            slots = self.cv.wait(slots).unwrap_or_else(|e| e.into_inner());
        }
    }
}
