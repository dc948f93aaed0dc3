//! `weft mesh`: the ranks of a mesh, their coordinates and the process groups.

use crate::error::CliResult;

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
    /// coords[rank] = coordinate on each axis, in axis order.
    coords: Vec<Vec<u32>>,
    groups: Vec<(String, Vec<Vec<u32>>)>,
}

pub fn run(a: Args) -> CliResult {
    let m = super::parse_mesh(&a.mesh)?;
    if a.json {
        let r = Report {
            world_size: m.world_size(),
            axes: m.axes.clone(),
            coords: (0..m.world_size()).map(|r| m.coords(r)).collect(),
            groups: m
                .axes
                .iter()
                .map(|(x, _)| (x.clone(), m.groups(x).unwrap_or_default()))
                .collect(),
        };
        print!("{}", super::json(&r));
    } else {
        println!("mesh {} ({} ranks)", m, m.world_size());
        print!("{}", m.rank_table());
    }
    Ok(())
}
