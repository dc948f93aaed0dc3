//! CLI errors in the project's format: `error: <what failed> in <where>: <why>` then
//! `help: <how to fix>`, with the exit code that says whose fault it was.

use std::fmt;

#[derive(Debug)]
pub struct CliError {
    pub message: String,
    pub help: Option<String>,
    /// 1: a check failed; 2: bad usage or bad input.
    pub code: i32,
}

impl CliError {
    /// Bad input (exit code 2).
    pub fn input(message: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            help: None,
            code: 2,
        }
    }
    /// A check that ran and failed (exit code 1).
    pub fn failed(message: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            help: None,
            code: 1,
        }
    }
    pub fn with_help(mut self, help: impl Into<String>) -> CliError {
        self.help = Some(help.into());
        self
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "error: {}", self.message)?;
        if let Some(h) = &self.help {
            write!(f, "\nhelp: {h}")?;
        }
        Ok(())
    }
}

pub type CliResult<T = ()> = Result<T, CliError>;
