//! Cleanup passes: [`simplify`] (egg rewrites) and [`canonicalize`] (fold, CSE, DCE).

pub mod canonicalize;
pub mod simplify;
