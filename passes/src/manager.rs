//! The pass manager: runs a pipeline and does all instrumentation around the passes
//! (verify-each, print-before/after, print-changes, statistics, stop-after, bisect).
//! Passes never print, time or verify themselves.
//!
//! Printed text goes to a caller-provided sink (`&mut dyn Write`): the CLI passes
//! stderr, tests a `Vec<u8>`. Dumps are prefixed by `//` header lines, which the text
//! reader skips, so a dump parses back.

use crate::pass::{Pass, PassContext, PassError};
use crate::registry::lookup;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::time::Instant;
use weft_ir::{print, verify, Graph, Node};

/// Which passes an option applies to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PassFilter {
    #[default]
    None,
    All,
    Only(Vec<String>),
}

impl PassFilter {
    /// `all`, or pass names separated by commas.
    pub fn parse(text: &str) -> Result<PassFilter, PassError> {
        let t = text.trim();
        if t == "all" {
            return Ok(PassFilter::All);
        }
        let names = crate::registry::parse_pass_names(t)?;
        Ok(if names.is_empty() {
            PassFilter::None
        } else {
            PassFilter::Only(names)
        })
    }

    pub fn matches(&self, pass: &str) -> bool {
        match self {
            PassFilter::None => false,
            PassFilter::All => true,
            PassFilter::Only(v) => v.iter().any(|p| p == pass),
        }
    }

    fn names(&self) -> &[String] {
        match self {
            PassFilter::Only(v) => v,
            _ => &[],
        }
    }
}

/// What the manager does around each pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instrumentation {
    /// Verify the input graph and the graph after every pass (default: on in debug
    /// builds and tests, off in release builds).
    pub verify_each: bool,
    /// Print the graph before these passes.
    pub print_before: PassFilter,
    /// Print the graph after these passes (`All` for every pass).
    pub print_after: PassFilter,
    /// Print a unified diff of the graph text for every pass that changed it.
    pub print_changes: bool,
    /// Print the statistics table (without times? see `stats_times`) at the end.
    pub stats: bool,
    /// Include wall times in the printed statistics table.
    pub stats_times: bool,
    /// Stop after this pass (it must be in the pipeline).
    pub stop_after: Option<String>,
    /// Run only the first `n` passes of the pipeline (bisecting a miscompile).
    pub bisect_limit: Option<usize>,
    /// Check that each pass's prerequisites come earlier in the pipeline. Turn off to
    /// run single passes on a graph prepared earlier (e.g. a `.weft` file).
    pub check_requires: bool,
}

impl Default for Instrumentation {
    fn default() -> Self {
        Instrumentation {
            verify_each: cfg!(debug_assertions),
            print_before: PassFilter::None,
            print_after: PassFilter::None,
            print_changes: false,
            stats: false,
            stats_times: true,
            stop_after: None,
            bisect_limit: None,
            check_requires: true,
        }
    }
}

/// Statistics of one pass run.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PassStats {
    pub pass: String,
    pub changed: bool,
    pub nodes_before: usize,
    pub nodes_after: usize,
    pub nodes_added: usize,
    pub nodes_removed: usize,
    /// Collective nodes among the added ones.
    pub collectives_added: usize,
    pub wall_time_us: u64,
    /// The pass's own counters.
    pub counters: BTreeMap<String, u64>,
}

/// What a pipeline run did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RunReport {
    pub mesh: String,
    pub passes: Vec<PassStats>,
    /// Set when `stop_after` or `bisect_limit` ended the run early.
    pub stopped_after: Option<String>,
}

impl RunReport {
    /// The statistics as an aligned table; `with_time: false` for snapshots.
    pub fn table(&self, with_time: bool) -> String {
        let mut head = vec![
            "pass",
            "changed",
            "nodes",
            "added",
            "removed",
            "collectives",
        ];
        if with_time {
            head.push("time");
        }
        head.push("counters");
        let mut rows: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
        for p in &self.passes {
            let mut r = vec![
                p.pass.clone(),
                if p.changed { "yes" } else { "no" }.to_string(),
                p.nodes_after.to_string(),
                format!("+{}", p.nodes_added),
                format!("-{}", p.nodes_removed),
                p.collectives_added.to_string(),
            ];
            if with_time {
                r.push(format!("{:.3} ms", p.wall_time_us as f64 / 1000.0));
            }
            r.push(
                p.counters
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" "),
            );
            rows.push(r);
        }
        let ncol = rows[0].len();
        let widths: Vec<usize> = (0..ncol)
            .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
            .collect();
        let mut out = String::new();
        for r in &rows {
            let mut line = String::new();
            for (c, cell) in r.iter().enumerate() {
                if c > 0 {
                    line.push_str("  ");
                }
                // Names and counters left-aligned, numbers right-aligned.
                if c == 0 || c == 1 || c == ncol - 1 {
                    line.push_str(&format!(
                        "{cell:<w$}",
                        w = if c == ncol - 1 { 0 } else { widths[c] }
                    ));
                } else {
                    line.push_str(&format!("{cell:>w$}", w = widths[c]));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }

    /// The report as pretty JSON: snake_case keys in declaration order, counters sorted.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a run report serializes")
    }

    /// Sets every wall time to 0, for deterministic snapshots.
    pub fn without_times(mut self) -> RunReport {
        for p in &mut self.passes {
            p.wall_time_us = 0;
        }
        self
    }

    /// Total of counter `key` over all passes.
    pub fn counter(&self, key: &str) -> u64 {
        self.passes.iter().filter_map(|p| p.counters.get(key)).sum()
    }
}

/// Runs pipelines with instrumentation.
#[derive(Clone, Debug, Default)]
pub struct PassManager {
    pub instrumentation: Instrumentation,
}

fn header(sink: &mut dyn Write, what: &str) {
    let _ = writeln!(sink, "// ----- {what} ----- //");
}

impl PassManager {
    pub fn new(instrumentation: Instrumentation) -> Self {
        PassManager { instrumentation }
    }

    /// Runs `pipeline` (pass names) on `g` for the mesh of `cx`. A graph without a mesh
    /// takes the context's; a different non-empty mesh is an error.
    pub fn run(
        &self,
        g: &mut Graph,
        cx: &PassContext,
        pipeline: &[&str],
        sink: &mut dyn Write,
    ) -> Result<RunReport, PassError> {
        let passes = pipeline
            .iter()
            .map(|n| lookup(n))
            .collect::<Result<Vec<_>, _>>()?;
        self.run_passes(g, cx, &passes, sink)
    }

    /// Like [`run`](Self::run), with pass objects (passes outside the registry too).
    pub fn run_passes(
        &self,
        g: &mut Graph,
        cx: &PassContext,
        passes: &[&dyn Pass],
        sink: &mut dyn Write,
    ) -> Result<RunReport, PassError> {
        let ins = &self.instrumentation;
        let pipeline: Vec<&str> = passes.iter().map(|p| p.name()).collect();
        let names: Vec<String> = pipeline.iter().map(|s| s.to_string()).collect();
        if ins.check_requires {
            for (i, p) in passes.iter().enumerate() {
                if let Some(req) = p.requires().iter().find(|r| !pipeline[..i].contains(r)) {
                    return Err(PassError::Prerequisite {
                        pass: p.name().to_string(),
                        required: req.to_string(),
                        pipeline: names,
                    });
                }
            }
        }
        for n in ins
            .print_before
            .names()
            .iter()
            .chain(ins.print_after.names())
        {
            if !pipeline.contains(&n.as_str()) {
                lookup(n)?;
            }
        }
        if let Some(stop) = &ins.stop_after {
            if !pipeline.contains(&stop.as_str()) {
                lookup(stop)?;
                return Err(PassError::NotInPipeline {
                    option: "--stop-after".into(),
                    pass: stop.clone(),
                    pipeline: names,
                });
            }
        }
        if g.mesh.axes.is_empty() {
            g.mesh = cx.mesh.clone();
        } else if g.mesh != cx.mesh {
            return Err(PassError::MeshMismatch {
                graph: g.mesh.clone(),
                context: cx.mesh.clone(),
            });
        }
        if ins.verify_each {
            verify(g).map_err(|report| PassError::Verify {
                pass: String::new(),
                report: Box::new(report),
            })?;
        }
        let mut report = RunReport {
            mesh: cx.mesh.to_string(),
            ..Default::default()
        };
        for (i, pass) in passes.iter().enumerate() {
            let name = pass.name();
            if ins.bisect_limit.is_some_and(|lim| i >= lim) {
                report.stopped_after = i.checked_sub(1).map(|j| passes[j].name().to_string());
                break;
            }
            pass.mesh_axes()
                .check(&cx.mesh)
                .map_err(|axes| PassError::MissingAxis {
                    pass: name.to_string(),
                    axes,
                    mesh: cx.mesh.clone(),
                })?;
            if ins.print_before.matches(name) {
                header(sink, &format!("IR before {name}"));
                let _ = sink.write_all(print(g).as_bytes());
            }
            let before_text = if ins.print_changes {
                Some(print(g))
            } else {
                None
            };
            let before: BTreeSet<Node> = g.nodes().iter().copied().collect();
            let t0 = Instant::now();
            let result = pass.run(g, cx)?;
            let wall = t0.elapsed();
            let after: BTreeSet<Node> = g.nodes().iter().copied().collect();
            let added: Vec<Node> = after.difference(&before).copied().collect();
            let collectives = added
                .iter()
                .filter(|&&n| g.node(n).op.is_collective())
                .count();
            if ins.verify_each {
                verify(g).map_err(|report| PassError::Verify {
                    pass: name.to_string(),
                    report: Box::new(report),
                })?;
            }
            if let Some(before_text) = before_text {
                let after_text = print(g);
                if after_text != before_text {
                    let diff = similar::TextDiff::from_lines(&before_text, &after_text)
                        .unified_diff()
                        .context_radius(2)
                        .header(&format!("before {name}"), &format!("after {name}"))
                        .to_string();
                    header(sink, &format!("IR changes of {name}"));
                    let _ = sink.write_all(diff.as_bytes());
                }
            }
            if ins.print_after.matches(name) {
                header(sink, &format!("IR after {name}"));
                let _ = sink.write_all(print(g).as_bytes());
            }
            report.passes.push(PassStats {
                pass: name.to_string(),
                changed: result.changed,
                nodes_before: before.len(),
                nodes_after: after.len(),
                nodes_added: added.len(),
                nodes_removed: before.difference(&after).count(),
                collectives_added: collectives,
                wall_time_us: wall.as_micros() as u64,
                counters: result.counters,
            });
            if ins.stop_after.as_deref() == Some(name) {
                report.stopped_after = Some(name.to_string());
                break;
            }
        }
        if ins.stats {
            header(
                sink,
                &format!(
                    "pass statistics (mesh {})",
                    if report.mesh.is_empty() {
                        "one rank"
                    } else {
                        &report.mesh
                    }
                ),
            );
            let _ = sink.write_all(report.table(ins.stats_times).as_bytes());
        }
        Ok(report)
    }
}

/// Runs `pipeline` with default instrumentation, discarding printed output.
pub fn run_pipeline(
    g: &mut Graph,
    cx: &PassContext,
    pipeline: &[&str],
) -> Result<RunReport, PassError> {
    PassManager::default().run(g, cx, pipeline, &mut std::io::sink())
}
