//! What an import recognised and what it could not: the [`ImportReport`] the CLI prints
//! (`weft import --json`). Deterministic: entries are in program order.

use std::fmt;

/// One recognised high-level op (or a pattern that was not recognised).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Recognised {
    /// `attention`, `rms_norm`, `rope`, `rope_table`, `linear`, `moe`.
    pub pattern: String,
    /// HF module path (`model.layers.0.self_attn`).
    pub layer: String,
    /// How: `sdpa + causal mask`, `decomposed softmax(QK^T)V`, `grouped_mm_fallback` ...
    pub detail: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ImportReport {
    /// The torch version that wrote the archive.
    pub torch_version: String,
    /// Export schema version `major.minor`.
    pub schema: String,
    /// `training` (torch.export.export) or `core-aten` (after run_decompositions).
    pub dialect: String,
    /// The export symbol taken as `S` (and `B`), e.g. `s70 -> S`.
    pub symbols: Vec<String>,
    pub exported_nodes: usize,
    pub weft_nodes: usize,
    pub recognised: Vec<Recognised>,
    /// Patterns seen but not turned into Weft's high-level ops: the graph still runs,
    /// these parts stay replicated under sharding.
    pub unrecognised: Vec<Recognised>,
    /// Tied parameters: `alias -> kept name`.
    pub tied: Vec<String>,
    /// Other notes (dropped asserts, functionalized in-place ops, added loss ...).
    pub notes: Vec<String>,
}

impl ImportReport {
    pub(crate) fn recognise(
        &mut self,
        pattern: &str,
        layer: Option<&str>,
        detail: impl Into<String>,
    ) {
        self.recognised.push(Recognised {
            pattern: pattern.into(),
            layer: layer.unwrap_or("").into(),
            detail: detail.into(),
        });
    }

    pub(crate) fn miss(&mut self, pattern: &str, layer: Option<&str>, detail: impl Into<String>) {
        self.unrecognised.push(Recognised {
            pattern: pattern.into(),
            layer: layer.unwrap_or("").into(),
            detail: detail.into(),
        });
    }

    /// Count of recognised patterns of one kind.
    pub fn count(&self, pattern: &str) -> usize {
        self.recognised
            .iter()
            .filter(|r| r.pattern == pattern)
            .count()
    }
}

impl fmt::Display for ImportReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "pt2 import: torch {} (schema {}), {} IR",
            self.torch_version, self.schema, self.dialect
        )?;
        writeln!(
            f,
            "  symbols: {}",
            if self.symbols.is_empty() {
                "none (static shapes)".into()
            } else {
                self.symbols.join(", ")
            }
        )?;
        writeln!(
            f,
            "  nodes: {} exported -> {} weft",
            self.exported_nodes, self.weft_nodes
        )?;
        let mut kinds: Vec<&str> = self.recognised.iter().map(|r| r.pattern.as_str()).collect();
        kinds.dedup();
        let mut seen = Vec::new();
        for k in kinds {
            if seen.contains(&k) {
                continue;
            }
            seen.push(k);
            let details: Vec<&str> = {
                let mut d: Vec<&str> = self
                    .recognised
                    .iter()
                    .filter(|r| r.pattern == k)
                    .map(|r| r.detail.as_str())
                    .collect();
                d.sort();
                d.dedup();
                d
            };
            writeln!(
                f,
                "  recognised {k} x{} ({})",
                self.count(k),
                details.join("; ")
            )?;
        }
        for u in &self.unrecognised {
            writeln!(
                f,
                "  NOT recognised {} in {}: {}",
                u.pattern,
                if u.layer.is_empty() { "-" } else { &u.layer },
                u.detail
            )?;
        }
        for t in &self.tied {
            writeln!(f, "  tied: {t}")?;
        }
        for n in &self.notes {
            writeln!(f, "  note: {n}")?;
        }
        Ok(())
    }
}
