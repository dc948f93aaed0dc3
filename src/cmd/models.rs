//! `weft models`: the built-in presets with their parameter counts.

use crate::error::CliResult;

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON array of {name, family, params, source}.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Row {
    name: &'static str,
    family: String,
    params: u64,
    source: &'static str,
}

pub fn run(a: Args) -> CliResult {
    let rows: Vec<Row> = weft_frontends::presets()
        .into_iter()
        .map(|p| Row {
            name: p.name,
            family: p.family.as_str().to_string(),
            params: p.params,
            source: p.source,
        })
        .collect();
    if a.json {
        print!("{}", super::json(&rows));
        return Ok(());
    }
    println!(
        "{:<18} {:<10} {:>18}  source",
        "preset", "family", "parameters"
    );
    for r in rows {
        println!(
            "{:<18} {:<10} {:>18}  {}",
            r.name,
            r.family,
            group_digits(r.params),
            r.source
        );
    }
    Ok(())
}

/// `8030261248` -> `8,030,261,248`.
pub fn group_digits(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}
