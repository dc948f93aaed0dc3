//! The training step captured once as a CUDA graph and replayed: one `cuGraphLaunch`
//! instead of a launch per kernel, copy and event. A plan is captured when its shapes
//! are static and nothing in the step needs the host to decide what comes next (MoE
//! grouped GEMMs read their row counts back; collectives across ranks are left to
//! NCCL's own scheduling). Host work that only has to run in stream order is captured
//! with the rest: the host optimizer's `cuLaunchHostFunc` becomes a host node, and the
//! copies to and from pinned host memory (activation offload, the optimizer's gradients
//! and parameters, streamed optimizer state) become memcpy nodes. Inputs, the step
//! counter and the parameters live in fixed buffers that are rewritten between
//! replays, so the graph stays valid for every step.

use cudarc::driver::sys;

use super::error::{CudaError, CudaResult};

/// An instantiated graph of one step's work on the executor's streams.
pub struct StepGraph {
    exec: sys::CUgraphExec,
}

// SAFETY: the exec handle is used only by the thread that owns the executor.
unsafe impl Send for StepGraph {}

/// Whether the step may be captured, or why not.
pub enum Capture {
    Yes,
    No(&'static str),
}

impl StepGraph {
    /// Captures what `enqueue` issues on `stream` (and on streams that join it through
    /// events) and instantiates it. The work is recorded, not run: the caller launches
    /// the graph afterwards. An error from `enqueue` or from the capture ends the
    /// capture cleanly and is returned.
    /// With `node_priority`, each kernel keeps the priority of the stream it was
    /// captured from (else the whole graph runs at the launch stream's).
    pub fn capture(
        stream: sys::CUstream,
        node_priority: bool,
        enqueue: impl FnOnce() -> CudaResult<()>,
    ) -> CudaResult<StepGraph> {
        // SAFETY: a live stream; the capture is ended below on every path.
        unsafe {
            sys::cuStreamBeginCapture_v2(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .result()
        .map_err(|e| CudaError::driver("cuStreamBeginCapture", e))?;
        let issued = enqueue();
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above; `graph` receives the result or null.
        let ended = unsafe { sys::cuStreamEndCapture(stream, &mut graph) }.result();
        let destroy = |g: sys::CUgraph| {
            if !g.is_null() {
                // SAFETY: a graph returned by cuStreamEndCapture, destroyed once.
                unsafe { sys::cuGraphDestroy(g) };
            }
        };
        if let Err(e) = issued {
            destroy(graph);
            return Err(e);
        }
        if let Err(e) = ended {
            destroy(graph);
            return Err(CudaError::driver("cuStreamEndCapture", e));
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        let flags = if node_priority {
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY.0 as u64
        } else {
            0
        };
        // SAFETY: `graph` is a complete captured graph; the exec keeps its own copy.
        let made = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, flags) }.result();
        destroy(graph);
        made.map_err(|e| CudaError::driver("cuGraphInstantiate", e))?;
        Ok(StepGraph { exec })
    }

    /// Enqueues one replay of the step on `stream`.
    pub fn launch(&self, stream: sys::CUstream) -> CudaResult<()> {
        // SAFETY: a live instantiated graph and stream.
        unsafe { sys::cuGraphLaunch(self.exec, stream) }
            .result()
            .map_err(|e| CudaError::driver("cuGraphLaunch", e))
    }
}

impl Drop for StepGraph {
    fn drop(&mut self) {
        // SAFETY: instantiated once in `capture`, destroyed once here.
        unsafe { sys::cuGraphExecDestroy(self.exec) };
    }
}
