//! Value roles: what a training step's named inputs, parameters and outputs are (a
//! gradient, an updated parameter, an optimizer state, ...), as a type.
//!
//! The printed IR, plan files and safetensors keep the role in the name
//! (`grad.<param>`, `optim.exp_avg.<param>`, ...), so that the names a user sees stay
//! stable; this module is the one place that maps between the name and the role.
//! Everything else asks [`ValueName::parse`] and formats with [`ValueName`]'s `Display`
//! (or the constructors below) instead of matching prefixes itself.

use std::fmt;

/// The role a named value plays in a training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ValueRole {
    /// `grad.<param>`: the gradient of a parameter (autodiff, then grad-sync).
    Grad,
    /// `grad_shard.<param>`: this rank's chunk of a reduce-scattered gradient (ZeRO-2),
    /// handed from grad-sync to the optimizer.
    GradShard,
    /// `param.<param>`: the parameter after the optimizer's update, fed back into
    /// `<param>` by the next step.
    UpdatedParam,
    /// `optim.master.<param>`: the f32 master copy of a low-precision parameter.
    MasterWeight,
    /// `optim.<kind>.<param>`: an optimizer state of a parameter (`exp_avg`,
    /// `exp_avg_sq`, `momentum`, ...).
    OptimizerState,
    /// `optim.step`: the 1-based step number the optimizer reads.
    Step,
    /// `state.<name>`: optimizer state under the name older plans gave it.
    LegacyState,
}

/// A value's name read as its role and the parameter it belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValueName<'a> {
    Grad(&'a str),
    GradShard(&'a str),
    UpdatedParam(&'a str),
    MasterWeight(&'a str),
    OptimizerState {
        kind: &'a str,
        param: &'a str,
    },
    Step,
    LegacyState(&'a str),
    /// A name without a role: a parameter, an input, the loss, logits, ...
    Plain(&'a str),
}

const GRAD: &str = "grad.";
const GRAD_SHARD: &str = "grad_shard.";
const UPDATED: &str = "param.";
const OPTIM: &str = "optim.";
const MASTER: &str = "master.";
const STEP: &str = "optim.step";
const LEGACY_STATE: &str = "state.";

impl<'a> ValueName<'a> {
    /// Reads a printed name. Never fails: a name without a role prefix is `Plain`.
    pub fn parse(name: &'a str) -> ValueName<'a> {
        if name == STEP {
            return ValueName::Step;
        }
        if let Some(p) = name.strip_prefix(GRAD) {
            return ValueName::Grad(p);
        }
        if let Some(p) = name.strip_prefix(GRAD_SHARD) {
            return ValueName::GradShard(p);
        }
        if let Some(p) = name.strip_prefix(UPDATED) {
            return ValueName::UpdatedParam(p);
        }
        if let Some(rest) = name.strip_prefix(OPTIM) {
            if let Some(p) = rest.strip_prefix(MASTER) {
                return ValueName::MasterWeight(p);
            }
            if let Some((kind, param)) = rest.split_once('.') {
                return ValueName::OptimizerState { kind, param };
            }
        }
        if let Some(p) = name.strip_prefix(LEGACY_STATE) {
            return ValueName::LegacyState(p);
        }
        ValueName::Plain(name)
    }

    /// The role, `None` for a plain name.
    pub fn role(&self) -> Option<ValueRole> {
        Some(match self {
            ValueName::Grad(_) => ValueRole::Grad,
            ValueName::GradShard(_) => ValueRole::GradShard,
            ValueName::UpdatedParam(_) => ValueRole::UpdatedParam,
            ValueName::MasterWeight(_) => ValueRole::MasterWeight,
            ValueName::OptimizerState { .. } => ValueRole::OptimizerState,
            ValueName::Step => ValueRole::Step,
            ValueName::LegacyState(_) => ValueRole::LegacyState,
            ValueName::Plain(_) => return None,
        })
    }

    /// The parameter the value belongs to (for `optim.<kind>.<param>` the part after
    /// the kind); `None` for the step number and plain names.
    pub fn param(&self) -> Option<&'a str> {
        match *self {
            ValueName::Grad(p)
            | ValueName::GradShard(p)
            | ValueName::UpdatedParam(p)
            | ValueName::MasterWeight(p)
            | ValueName::OptimizerState { param: p, .. } => Some(p),
            ValueName::Step | ValueName::LegacyState(_) | ValueName::Plain(_) => None,
        }
    }
}

impl ValueRole {
    /// Of a name; `None` for a plain one.
    pub fn of(name: &str) -> Option<ValueRole> {
        ValueName::parse(name).role()
    }

    /// Optimizer memory: moments, master weights, the step number and legacy state.
    pub fn is_optimizer_state(self) -> bool {
        matches!(
            self,
            ValueRole::OptimizerState
                | ValueRole::MasterWeight
                | ValueRole::Step
                | ValueRole::LegacyState
        )
    }

    /// Only a training step returns a value of this role (a forward pass never does).
    pub fn is_training_output(self) -> bool {
        !matches!(self, ValueRole::GradShard)
    }
}

impl fmt::Display for ValueName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueName::Grad(p) => write!(f, "{GRAD}{p}"),
            ValueName::GradShard(p) => write!(f, "{GRAD_SHARD}{p}"),
            ValueName::UpdatedParam(p) => write!(f, "{UPDATED}{p}"),
            ValueName::MasterWeight(p) => write!(f, "{OPTIM}{MASTER}{p}"),
            ValueName::OptimizerState { kind, param } => write!(f, "{OPTIM}{kind}.{param}"),
            ValueName::Step => f.write_str(STEP),
            ValueName::LegacyState(p) => write!(f, "{LEGACY_STATE}{p}"),
            ValueName::Plain(n) => f.write_str(n),
        }
    }
}

/// `grad.<param>`.
pub fn grad_name(param: &str) -> String {
    ValueName::Grad(param).to_string()
}

/// `grad_shard.<param>`.
pub fn grad_shard_name(param: &str) -> String {
    ValueName::GradShard(param).to_string()
}

/// `param.<param>`.
pub fn updated_name(param: &str) -> String {
    ValueName::UpdatedParam(param).to_string()
}

/// `optim.<kind>.<param>` (`optim.master.<param>` when `kind` is `master`).
pub fn optimizer_state_name(kind: &str, param: &str) -> String {
    ValueName::OptimizerState { kind, param }.to_string()
}

/// The step-number input's name, `optim.step`.
pub const STEP_NAME: &str = STEP;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_role_round_trips_through_its_printed_name() {
        let names = [
            ValueName::Grad("model.layers.0.mlp.up_proj.weight"),
            ValueName::GradShard("lm_head.weight"),
            ValueName::UpdatedParam("model.norm.weight"),
            ValueName::MasterWeight("model.embed_tokens.weight"),
            ValueName::OptimizerState {
                kind: "exp_avg_sq",
                param: "model.layers.1.self_attn.q_proj.weight",
            },
            ValueName::Step,
            ValueName::LegacyState("exp_avg.w"),
            ValueName::Plain("loss"),
        ];
        for n in names {
            let printed = n.to_string();
            assert_eq!(ValueName::parse(&printed), n, "{printed}");
        }
    }

    #[test]
    fn printed_forms_are_the_stable_prefixes() {
        assert_eq!(grad_name("w"), "grad.w");
        assert_eq!(grad_shard_name("w"), "grad_shard.w");
        assert_eq!(updated_name("w"), "param.w");
        assert_eq!(optimizer_state_name("exp_avg", "a.b"), "optim.exp_avg.a.b");
        assert_eq!(optimizer_state_name("master", "a.b"), "optim.master.a.b");
        assert_eq!(
            ValueName::parse("optim.master.a.b"),
            ValueName::MasterWeight("a.b")
        );
        assert_eq!(ValueName::parse("optim.step"), ValueName::Step);
        assert_eq!(STEP_NAME, "optim.step");
    }

    #[test]
    fn roles_classify_memory_and_step_kind() {
        assert!(ValueRole::of("optim.exp_avg.w")
            .unwrap()
            .is_optimizer_state());
        assert!(ValueRole::of("optim.master.w")
            .unwrap()
            .is_optimizer_state());
        assert!(!ValueRole::of("grad.w").unwrap().is_optimizer_state());
        assert!(ValueRole::of("param.w").unwrap().is_training_output());
        assert_eq!(ValueRole::of("logits"), None);
        assert_eq!(ValueName::parse("optim.exp_avg.w").param(), Some("w"));
        assert_eq!(ValueName::parse("optim.step").param(), None);
        // A name that is only a prefix's first word is plain.
        assert_eq!(ValueName::parse("gradient"), ValueName::Plain("gradient"));
        assert_eq!(ValueName::parse("optim.x"), ValueName::Plain("optim.x"));
    }
}
