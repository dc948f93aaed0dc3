//! weft-ir: the typed dataflow IR every other crate speaks.
//!
//! - [`dim`]: symbolic sizes in canonical form; [`types`]: dtypes and tensor types.
//! - [`ops`]: the op table (one declarative list), [`shape`]: the shape rules.
//! - [`graph`]: SSA graph with never-reused ids; [`verify`]: located errors.
//! - [`print`] / [`parse`]: the stable text form, `parse(print(g)) == g`.
//! - [`mesh`]: device meshes and the process groups their axes induce.
//! - [`plan`]: the ExecutionPlan runtimes execute (streams, events, arena buffers).
//! - [`partition`]: how sharded parameters map to their full tensors.
//! - [`tensor`]: host tensors exchanged between crates.
//! - [`files`]: input files, regular files only (never a FIFO or a device).
//! - [`output`]: output files written through a temporary and renamed into place.
//! - [`fp8`]: FP8 formats, scaling and rounding of `fp8_matmul`.
//! - [`role`]: value roles (gradient, updated parameter, optimizer state) and their names.

pub mod attrs;
pub mod dim;
pub mod files;
pub mod flops;
pub mod fp8;
pub mod graph;
pub mod mesh;
pub mod ops;
pub mod output;
pub mod parse;
pub mod partition;
pub mod plan;
pub mod print;
pub mod role;
pub mod shape;
pub mod tensor;
pub mod types;
pub mod verify;

pub use attrs::{
    yarn_attention_factor, CmpOp, Flag, Float, GateAct, HeadLayout, ReduceOp, Reduction, Role,
    RopeScaling,
};
pub use dim::{Bindings, Dim, DimError};
pub use fp8::Fp8Format;
pub use graph::{
    At, BuildError, Derived, DerivedKind, Graph, Node, NodeData, NodeMeta, Provenance, Value,
};
pub use mesh::Mesh;
pub use ops::{Elementwise, ElementwiseInfo, Op, OpInfo, OP_TABLE};
pub use parse::{parse, parse_dim, parse_type, ParseError};
pub use partition::Partition;
pub use plan::{ExecutionPlan, PLAN_VERSION};
pub use print::print;
pub use role::{ValueName, ValueRole};
pub use tensor::{HostData, HostTensor, RawBytes, SharedBytes};
pub use types::{DType, TensorType};
pub use verify::{verify, VerifyError, VerifyReport};
