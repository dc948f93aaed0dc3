//! `weft mesh`: the ranks of a mesh, their coordinates and the process groups. Meshes
//! of more than [`TABLE_RANKS`] ranks print a summary (axes, group sizes and strides),
//! not a row per rank: Weft plans for thousands of GPUs without listing them.

use crate::error::CliResult;

/// The most ranks `weft mesh` lists one by one.
pub const TABLE_RANKS: u32 = 64;

#[derive(clap::Args)]
pub struct Args {
    /// Mesh axes outermost first, e.g. `dp=2,sp=4`.
    mesh: String,
    /// Print {world_size, axes, ranks, groups} as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Report {
    world_size: u32,
    axes: Vec<(String, u32)>,
    /// Per axis: how many groups, of how many ranks, how far apart (derived axes:
    /// `ep` groups are consecutive ranks, `edp` groups every `ep`-th rank).
    summary: Vec<AxisSummary>,
    /// coords[rank] = coordinate on each axis, in axis order (meshes of at most
    /// `TABLE_RANKS` ranks).
    #[serde(skip_serializing_if = "Option::is_none")]
    coords: Option<Vec<Vec<u32>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    groups: Option<Vec<(String, Vec<Vec<u32>>)>>,
}

#[derive(serde::Serialize)]
struct AxisSummary {
    axis: String,
    groups: u32,
    group_size: u32,
    stride: u32,
}

fn summary(m: &weft_ir::Mesh) -> Vec<AxisSummary> {
    let world = m.world_size();
    let ep = m.size_or_one(weft_ir::mesh::EP).max(1);
    m.axes
        .iter()
        .map(|(a, n)| AxisSummary {
            axis: a.clone(),
            groups: world / n.max(&1),
            group_size: *n,
            stride: m
                .stride(a)
                .unwrap_or(if a == weft_ir::mesh::EP { 1 } else { ep }),
        })
        .collect()
}

pub fn run(a: Args) -> CliResult {
    let m = super::parse_mesh(&a.mesh)?;
    let small = m.world_size() <= TABLE_RANKS;
    if a.json {
        let r = Report {
            world_size: m.world_size(),
            axes: m.axes.clone(),
            summary: summary(&m),
            coords: small.then(|| (0..m.world_size()).map(|r| m.coords(r)).collect()),
            groups: small.then(|| {
                m.axes
                    .iter()
                    .map(|(x, _)| (x.clone(), m.groups(x).unwrap_or_default()))
                    .collect()
            }),
        };
        super::print_out(&super::json(&r))
    } else if small {
        super::print_out(&format!(
            "mesh {} ({} ranks)\n{}",
            m,
            m.world_size(),
            m.rank_table()
        ))
    } else {
        let mut out = format!(
            "mesh {} ({} ranks; more than {TABLE_RANKS}, so a summary instead of a table)\n",
            m,
            m.world_size()
        );
        for s in summary(&m) {
            out.push_str(&format!(
                "{} groups: {} groups of {} ranks, {} apart (the group of rank r: r - (r / {} mod {}) * {} + k * {})\n",
                s.axis, s.groups, s.group_size, s.stride, s.stride, s.group_size, s.stride, s.stride
            ));
        }
        super::print_out(&out)
    }
}
