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
    /// `unary`, `binary` or `select` for an elementwise op.
    elementwise: Option<&'static str>,
    /// FLOPs per output element of an elementwise op (the cost model's count).
    flops_per_element: Option<u32>,
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
            elementwise: i.elementwise.map(|e| match e.class {
                weft_ir::Elementwise::Unary => "unary",
                weft_ir::Elementwise::Binary => "binary",
                weft_ir::Elementwise::Select => "select",
            }),
            flops_per_element: i.elementwise.map(|e| e.flops),
            doc: i.doc.trim(),
        })
        .collect();
    if a.json {
        print!("{}", super::json(&rows));
        return Ok(());
    }
    // One column for the names, as wide as the longest; the signature (operands, then
    // attributes) after it, then the op's class; the doc under the signature.
    let w = rows.iter().map(|r| r.name.len()).max().unwrap_or(0);
    for r in rows {
        let mut sig: Vec<String> = Vec::new();
        if !r.operands.is_empty() {
            sig.push(r.operands.to_string());
        }
        if !r.attrs.is_empty() {
            sig.push(format!("{{{}}}", r.attrs.join(", ")));
        }
        let mut sig = sig.join(" ");
        if r.collective {
            sig.push_str("  [collective]");
        }
        if let (Some(class), Some(f)) = (r.elementwise, r.flops_per_element) {
            sig.push_str(&format!("  [elementwise {class}, {f} FLOP/element]"));
        }
        println!("{:<w$}  {}", r.name, sig.trim_start());
        for line in r.doc.lines() {
            println!("{:<w$}  {}", "", line.trim());
        }
    }
    Ok(())
}
