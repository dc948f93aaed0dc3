//! `weft`: compile transformer models into parallel training programs, and check them.
//! Each subcommand lives in its own module under `cmd/`; this file is the argument
//! grammar and the error/exit-code convention (0 ok, 1 check failed, 2 bad input).

mod cmd;
mod error;
mod progress;

use clap::{Parser, Subcommand};
use error::CliError;

#[derive(Parser)]
#[command(
    name = "weft",
    version,
    about = "Compile transformer models into parallel training plans, and prove the rewrites right"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the built-in model presets with their parameter counts.
    ///
    /// Example: weft models --json
    Models(cmd::models::Args),
    /// Print (or write) a model's IR as text.
    ///
    /// Example: weft import llama3-8b -o llama3-8b.weft
    Import(cmd::import::Args),
    /// Parameter count, nodes by op, FLOPs per token and parameter bytes (of a model or a plan's model).
    ///
    /// Example: weft stats mixtral-8x7b --seq 4096 --json
    Stats(cmd::stats::Args),
    /// List every pass with its summary, and the default pipeline for a mesh.
    ///
    /// Example: weft passes --mesh dp=2,sp=4
    Passes(cmd::passes::Args),
    /// Show a mesh's ranks, coordinates and process groups.
    ///
    /// Example: weft mesh dp=2,sp=4
    Mesh(cmd::mesh::Args),
    /// List the IR's ops with their operands, attributes and docs.
    ///
    /// Example: weft ops
    Ops(cmd::ops::Args),
    /// Compile a model's training step (--forward-only: its forward pass) for a mesh and
    /// write the program's text or, with -o plan.json, its ExecutionPlan.
    ///
    /// Training options left out are chosen to fit the device memory when a plan is
    /// made, and printed.
    ///
    /// Example: weft compile llama3-8b --mesh sp=8 --seq 131072 --stats -o plan.json
    Compile(cmd::compile::Args),
    /// Search meshes, ZeRO stage, checkpointing, offload and micro-batches for the
    /// fastest training plan that fits a cluster; compile the finalists.
    ///
    /// Example: weft plan llama3-70b --gpus 64 --seq 32768 --device h100
    Plan(cmd::plan::Args),
    /// Summarize a plan: what it holds (training step or forward), peak memory, predicted time, communication; --explain, --trace, --memory.
    ///
    /// Example: weft inspect plan.json --explain --trace trace.json
    Inspect(cmd::inspect::Args),
    /// Run a model (after the passes its mesh implies) on the CPU reference runtime.
    ///
    /// Example: weft eval tests/fixtures/llama --inputs tests/fixtures/llama/inputs.safetensors --mesh sp=2 --grads -o out.safetensors
    Eval(cmd::eval::Args),
    /// Compare the parallel program with the unsharded model on the same inputs.
    ///
    /// Example: weft check tests/fixtures/qwen3 --mesh dp=2,sp=2 --train --json
    Check(cmd::check::Args),
    /// Cut a full checkpoint into per-rank shards for a mesh (and back with --unshard).
    ///
    /// Example: weft shard tests/fixtures/llama --mesh tp=4 -o shards/
    Shard(cmd::shard::Args),
    /// Train (or with --forward-only evaluate) a model or plan for --steps steps on a backend (cpu, cuda).
    ///
    /// Example: weft run tests/fixtures/llama --inputs tests/fixtures/llama/inputs.safetensors --steps 20 --lr 1e-2
    Run(cmd::run::Args),
    /// Start one process per GPU of this node with torchrun's variables (RANK, WORLD_SIZE,
    /// LOCAL_RANK, MASTER_ADDR, MASTER_PORT); when one rank fails the others are stopped.
    ///
    /// Example: weft launch --nproc-per-node 8 -- weft run plan.json --backend cuda --steps 20
    Launch(cmd::launch::Args),
}

fn main() {
    install_panic_hook();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Models(a) => cmd::models::run(a),
        Command::Import(a) => cmd::import::run(a),
        Command::Stats(a) => cmd::stats::run(a),
        Command::Passes(a) => cmd::passes::run(a),
        Command::Mesh(a) => cmd::mesh::run(a),
        Command::Ops(a) => cmd::ops::run(a),
        Command::Compile(a) => cmd::compile::run(a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Eval(a) => cmd::eval::run(a),
        Command::Check(a) => cmd::check::run(a),
        Command::Shard(a) => cmd::shard::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Launch(a) => cmd::launch::run(a),
    };
    if let Err(e) = result {
        eprintln!("{e}");
        std::process::exit(e.code);
    }
}

/// No `panicked at` reaches a user. A rank thread's panic is reported by the runtime as
/// an error naming the rank, so other threads stay silent here. On the main thread, a
/// write to a closed stdout (`weft import ... | head -1`) ends quietly; a failed one
/// (`> /dev/full`) and anything else is an error line (a bug, but said as an error).
fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        if std::thread::current().name() != Some("main") {
            return;
        }
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        if message.starts_with("failed printing to stdout") {
            if message.contains("Broken pipe") {
                std::process::exit(0);
            }
            eprintln!(
                "error: cannot write to stdout: {}",
                message.trim_start_matches("failed printing to stdout: ")
            );
            std::process::exit(2);
        }
        let at = info
            .location()
            .map(|l| format!(" ({}:{})", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!("error: internal error: {message}{at}\nhelp: this is a bug in weft; please report it with the command that caused it");
        std::process::exit(101);
    }));
}

/// Used by commands to print errors of the libraries in the CLI's format.
pub fn fail(e: impl std::fmt::Display) -> CliError {
    CliError::input(e.to_string())
}
