//! Lowering: from a program to an execution plan.
//!
//! [`convert_dtype`] (the model's float dtype), [`fuse`] (fused elementwise and norm ops), [`plan`] (schedule, memory plan, cost model, device profiles), [`memory`] (the
//! per-rank memory estimate) and [`bindings`] (plan-time check that concrete sizes
//! divide); [`search`] (`weft plan`'s analytic search over meshes and options).

pub mod bindings;
pub mod convert_dtype;
pub mod fuse;
mod head_layout;
pub mod loss_with_grad;
pub mod memory;
pub mod plan;
pub mod search;
