//! `weft ops`: the op table of the IR.

use crate::error::CliResult;

#[derive(clap::Args)]
pub struct Args {
    /// Print the table as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Row {
    name: &'static str,
    operands: &'static str,
    attrs: Vec<&'static str>,
    collective: bool,
    doc: &'static str,
}

pub fn run(a: Args) -> CliResult {
    let rows: Vec<Row> = weft_ir::OP_TABLE
        .iter()
        .map(|i| Row {
            name: i.name,
            operands: i.operands,
            attrs: i.attrs.iter().copied().filter(|a| *a != "ty").collect(),
            collective: i.collective,
            doc: i.doc.trim(),
        })
        .collect();
    if a.json {
        print!("{}", super::json(&rows));
        return Ok(());
    }
    // One column for the names, as wide as the longest; the doc under the signature.
    let w = rows.iter().map(|r| r.name.len()).max().unwrap_or(0);
    for r in rows {
        let attrs = if r.attrs.is_empty() {
            String::new()
        } else {
            format!(" {{{}}}", r.attrs.join(", "))
        };
        println!("{:<w$}  {}{}", r.name, r.operands, attrs);
        for line in r.doc.lines() {
            println!("{:<w$}  {}", "", line.trim());
        }
    }
    Ok(())
}
