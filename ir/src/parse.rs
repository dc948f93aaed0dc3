//! The text reader: parses what `print` writes back into an equal graph, keeping value
//! ids. Errors carry line and column. Types are trusted here; run the verifier to check
//! them against the shape rules.

use crate::attrs::{split_top_level, unquote};
use crate::dim::Dim;
use crate::graph::{At, Graph, NodeMeta, Provenance, Value};
use crate::mesh::Mesh;
use crate::ops::Op;
use crate::types::{DType, TensorType};
use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ParseError {
    pub line: usize,
    pub col: usize,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}", self.message)
        } else {
            write!(
                f,
                "line {}, column {}: {}",
                self.line, self.col, self.message
            )
        }
    }
}

fn err(col: usize, message: impl Into<String>) -> ParseError {
    ParseError {
        line: 0,
        col,
        message: message.into(),
    }
}

// ---- dims ----

/// `s`, or its first characters and `...` when it is long (messages quote what they
/// refuse, not a whole line of a hostile file).
fn short(s: &str) -> String {
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Int(i64),
    Ident(String),
    Coord(String),
    Table(String, Vec<i64>),
    Plus,
    Minus,
    Star,
    Slash,
    SlashSlash,
    LParen,
    RParen,
}

fn lex_dim(s: &str) -> Result<Vec<(usize, Tok)>, ParseError> {
    let b = s.as_bytes();
    let mut i = 0;
    let mut out = Vec::new();
    let ident = |i: &mut usize| -> String {
        let st = *i;
        while *i < b.len() && (b[*i].is_ascii_alphanumeric() || b[*i] == b'_') {
            *i += 1;
        }
        s[st..*i].to_string()
    };
    while i < b.len() {
        let c = b[i];
        let at = i;
        match c {
            b' ' | b'\t' => i += 1,
            b'0'..=b'9' => {
                while i < b.len() && b[i].is_ascii_digit() {
                    i += 1;
                }
                let n = s[at..i]
                    .parse()
                    .map_err(|_| err(at, format!("integer `{}` is too large", &s[at..i])))?;
                out.push((at, Tok::Int(n)));
            }
            b'a'..=b'z' | b'A'..=b'Z' | b'_' => {
                let name = ident(&mut i);
                if s[i..].starts_with("?[") {
                    let close = s[i..]
                        .find(']')
                        .ok_or_else(|| err(i, "unterminated per-rank size table"))?
                        + i;
                    let sizes: Result<Vec<i64>, _> = s[i + 2..close]
                        .split_whitespace()
                        .map(|x| x.parse::<i64>())
                        .collect();
                    let sizes = sizes.map_err(|_| {
                        err(i, "per-rank sizes must be integers separated by spaces")
                    })?;
                    out.push((at, Tok::Table(name, sizes)));
                    i = close + 1;
                } else {
                    out.push((at, Tok::Ident(name)));
                }
            }
            b'@' => {
                i += 1;
                let name = ident(&mut i);
                if name.is_empty() {
                    return Err(err(at, "`@` must be followed by a mesh axis name"));
                }
                out.push((at, Tok::Coord(name)));
            }
            b'+' => {
                out.push((at, Tok::Plus));
                i += 1
            }
            b'-' => {
                out.push((at, Tok::Minus));
                i += 1
            }
            b'*' => {
                out.push((at, Tok::Star));
                i += 1
            }
            b'/' if b.get(i + 1) == Some(&b'/') => {
                out.push((at, Tok::SlashSlash));
                i += 2
            }
            b'/' => {
                out.push((at, Tok::Slash));
                i += 1
            }
            b'(' => {
                out.push((at, Tok::LParen));
                i += 1
            }
            b')' => {
                out.push((at, Tok::RParen));
                i += 1
            }
            _ => {
                return Err(err(
                    at,
                    format!(
                        "unexpected `{}` in dim `{s}`",
                        &s[at..].chars().next().unwrap()
                    ),
                ))
            }
        }
    }
    Ok(out)
}

struct DimParser<'a> {
    toks: Vec<(usize, Tok)>,
    pos: usize,
    text: &'a str,
    /// Parentheses and unary minuses open around the current factor.
    depth: usize,
}

/// The deepest nesting of parentheses (and unary minuses) a dim may have: the parser
/// recurses once per level, so a hostile `((((...` must not exhaust the stack.
const MAX_DIM_DEPTH: usize = 64;

/// Refuses a product or sum whose expansion would hold more terms than a dim may
/// (`(a+b+c+d)*(a+b+c+d)*...` doubles its terms at every factor).
fn check_terms(c: usize, a: &Dim, b: &Dim, sum: bool) -> Result<(), ParseError> {
    let n = if sum {
        a.term_count().saturating_add(b.term_count())
    } else {
        a.term_count().saturating_mul(b.term_count())
    };
    if n > crate::dim::MAX_TERMS {
        return Err(err(
            c,
            format!(
                "the dim expands to more than {} terms",
                crate::dim::MAX_TERMS
            ),
        ));
    }
    Ok(())
}

impl DimParser<'_> {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos).map(|(_, t)| t)
    }
    fn col(&self) -> usize {
        self.toks
            .get(self.pos)
            .map(|(c, _)| *c)
            .unwrap_or(self.text.len())
    }
    fn expr(&mut self) -> Result<Dim, ParseError> {
        let mut d = self.term()?;
        loop {
            match self.peek() {
                Some(Tok::Plus) => {
                    self.pos += 1;
                    let c = self.col();
                    let t = self.term()?;
                    check_terms(c, &d, &t, true)?;
                    d = d + t;
                }
                Some(Tok::Minus) => {
                    self.pos += 1;
                    let c = self.col();
                    let t = self.term()?;
                    check_terms(c, &d, &t, true)?;
                    d = d - t;
                }
                _ => return Ok(d),
            }
        }
    }
    fn term(&mut self) -> Result<Dim, ParseError> {
        let mut d = self.factor()?;
        loop {
            match self.peek() {
                Some(Tok::Star) => {
                    self.pos += 1;
                    let c = self.col();
                    let f = self.factor()?;
                    check_terms(c, &d, &f, false)?;
                    d = d * f;
                }
                Some(Tok::Slash) => {
                    self.pos += 1;
                    let c = self.col();
                    let f = self.factor()?;
                    if f.as_const() == Some(0) {
                        return Err(err(c, "division by zero"));
                    }
                    check_terms(c, &d, &f, false)?;
                    d = d.exact_div(&f);
                    if d.nesting() > MAX_DIM_DEPTH {
                        return Err(err(
                            c,
                            format!("the dim nests more than {MAX_DIM_DEPTH} divisions"),
                        ));
                    }
                }
                Some(Tok::SlashSlash) => {
                    self.pos += 1;
                    let c = self.col();
                    let f = self.factor()?;
                    if f.as_const() == Some(0) {
                        return Err(err(c, "division by zero"));
                    }
                    d = d.floor_div(&f);
                    if d.nesting() > MAX_DIM_DEPTH {
                        return Err(err(
                            c,
                            format!("the dim nests more than {MAX_DIM_DEPTH} floor divisions"),
                        ));
                    }
                }
                _ => return Ok(d),
            }
        }
    }
    fn factor(&mut self) -> Result<Dim, ParseError> {
        let c = self.col();
        let t = self.toks.get(self.pos).map(|(_, t)| t.clone());
        self.pos += 1;
        if matches!(t, Some(Tok::Minus | Tok::LParen)) {
            if self.depth >= MAX_DIM_DEPTH {
                return Err(err(
                    c,
                    format!("the dim nests more than {MAX_DIM_DEPTH} levels deep"),
                ));
            }
            self.depth += 1;
            let d = self.nested(t);
            self.depth -= 1;
            return d;
        }
        match t {
            Some(Tok::Int(n)) => Ok(Dim::from(n)),
            Some(Tok::Ident(s)) => Ok(Dim::sym(&s)),
            Some(Tok::Coord(s)) => Ok(Dim::coord(&s)),
            Some(Tok::Table(a, sizes)) => Ok(Dim::per_rank(&a, sizes)),
            Some(t) => Err(err(c, format!("expected a size, found {t:?}"))),
            None => Err(err(c, "expected a size, found the end")),
        }
    }
    /// A negated factor or a parenthesised expression (`t` is `-` or `(`).
    fn nested(&mut self, t: Option<Tok>) -> Result<Dim, ParseError> {
        if t == Some(Tok::Minus) {
            return Ok(Dim::from(0) - self.factor()?);
        }
        let d = self.expr()?;
        if self.peek() != Some(&Tok::RParen) {
            return Err(err(self.col(), "expected `)`"));
        }
        self.pos += 1;
        Ok(d)
    }
}

/// Parses a dim expression such as `S/sp`, `@sp*S/4 + 1`, `(S + 1)//2`, `tp?[51 50]`.
pub fn parse_dim(s: &str) -> Result<Dim, ParseError> {
    let mut p = DimParser {
        toks: lex_dim(s)?,
        pos: 0,
        text: s,
        depth: 0,
    };
    if p.toks.is_empty() {
        return Err(err(0, "empty dim"));
    }
    let d = p.expr()?;
    if p.pos < p.toks.len() {
        return Err(err(p.col(), format!("unexpected text after dim in `{s}`")));
    }
    if d.is_overflow() {
        return Err(err(
            0,
            format!(
                "`{}` overflows: the size is larger than Weft can count",
                short(s)
            ),
        ));
    }
    Ok(d)
}

/// Parses a tensor type such as `bf16[B, S/4, 4096]`.
pub fn parse_type(s: &str) -> Result<TensorType, ParseError> {
    let s_trim = s.trim_end();
    let open = s_trim
        .find('[')
        .ok_or_else(|| err(0, format!("expected a type like `f32[B, S]`, found `{s}`")))?;
    let dt = s_trim[..open].trim();
    let dtype = DType::from_name(dt).ok_or_else(|| {
        err(
            0,
            format!("unknown dtype `{dt}` (expected f64, f32, bf16, f16, i64, i32, bool)"),
        )
    })?;
    let inner = s_trim[open + 1..]
        .strip_suffix(']')
        .ok_or_else(|| err(open, format!("type `{s}` must end with `]`")))?;
    let parts = split_top_level(inner, ',').map_err(|m| err(open + 1, m))?;
    let mut shape = Vec::new();
    let mut off = open + 1;
    for p in parts {
        let rel = inner[off - open - 1..].find(p).unwrap_or(0);
        let col = off + rel;
        shape.push(parse_dim(p).map_err(|e| err(col + e.col, e.message))?);
        off = col + p.len();
    }
    Ok(TensorType::new(dtype, shape))
}

// ---- graph ----

/// Finds `#` that starts a comment (outside quotes).
fn comment_start(line: &str) -> Option<usize> {
    let mut in_str = false;
    let mut esc = false;
    for (i, c) in line.char_indices() {
        if in_str {
            match (esc, c) {
                (true, _) => esc = false,
                (false, '\\') => esc = true,
                (false, '"') => in_str = false,
                _ => {}
            }
        } else if c == '"' {
            in_str = true;
        } else if c == '#' {
            return Some(i);
        }
    }
    None
}

/// The byte offset of `part` in `whole`, where `part` is a slice of `whole` (as the
/// pieces `split_top_level` and `split_whitespace` return): found in constant time, not
/// by searching (a search per piece is quadratic in a line of many pieces).
fn offset_in(whole: &str, part: &str) -> usize {
    (part.as_ptr() as usize)
        .checked_sub(whole.as_ptr() as usize)
        .filter(|&o| o <= whole.len())
        .unwrap_or(0)
}

fn parse_value(s: &str, col: usize) -> Result<Value, ParseError> {
    s.strip_prefix('%')
        .and_then(|n| n.parse::<u32>().ok())
        .map(Value)
        .ok_or_else(|| err(col, format!("expected a value like `%12`, found `{s}`")))
}

/// How value ids in the text become ids in the graph. The graph stores values densely
/// by id, so ids are kept as written (printing round-trips) only when they are about as
/// many as the values defined; sparse ids (`%1000000000` in a small file) are
/// renumbered in order of definition, so memory follows the file, not the numbers in it.
struct Ids {
    renumber: Option<std::collections::HashMap<u32, u32>>,
}

impl Ids {
    fn for_text(text: &str) -> Ids {
        let (mut count, mut max) = (0u64, 0u64);
        for line in text.lines() {
            let lhs = line.split('=').next().unwrap_or("");
            if !lhs.trim_start().starts_with('%') {
                continue;
            }
            for part in lhs.split(',') {
                let id = part.trim().strip_prefix('%').map(|r| {
                    r.chars()
                        .take_while(char::is_ascii_digit)
                        .collect::<String>()
                });
                if let Some(n) = id.and_then(|d| d.parse::<u64>().ok()) {
                    count += 1;
                    max = max.max(n);
                }
            }
        }
        let sparse = max > 4 * count + 4096;
        Ids {
            renumber: sparse.then(std::collections::HashMap::new),
        }
    }

    /// The id of a value the text defines.
    fn define(&mut self, v: Value) -> Value {
        match &mut self.renumber {
            None => v,
            Some(m) => {
                let next = m.len() as u32;
                Value(*m.entry(v.0).or_insert(next))
            }
        }
    }

    /// The id of a value the text uses (`None` when it was never defined).
    fn used(&self, v: Value) -> Option<Value> {
        match &self.renumber {
            None => Some(v),
            Some(m) => m.get(&v.0).copied().map(Value),
        }
    }
}

/// Parses a whole graph. Errors carry line and column (1-based).
pub fn parse(text: &str) -> Result<Graph, ParseError> {
    let mut g = Graph::new("");
    let mut ids = Ids::for_text(text);
    let mut outputs_seen = std::collections::BTreeSet::new();
    // Where each output's splits and each parameter's partitions are in the graph's
    // lists: a file of many `split`/`partition` lines is read in linear time.
    let mut split_index: std::collections::HashMap<String, usize> = Default::default();
    let mut partition_index: std::collections::HashMap<String, usize> = Default::default();
    let mut seen_header = false;
    let mut returned = false;
    for (ln, raw) in text.lines().enumerate() {
        let line_no = ln + 1;
        let locate = |e: ParseError| ParseError {
            line: line_no,
            col: e.col + 1,
            message: e.message,
        };
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with("//") {
            continue;
        }
        let indent = raw.len() - raw.trim_start().len();
        if returned {
            return Err(locate(err(indent, "text after `return`")));
        }
        if let Some(rest) = trimmed.strip_prefix("graph ") {
            g.name = unquote(rest.trim()).map_err(|m| locate(err(indent + 6, m)))?;
            seen_header = true;
            continue;
        }
        if !seen_header {
            return Err(locate(err(indent, "expected `graph \"name\"` first")));
        }
        if let Some(rest) = trimmed.strip_prefix("mesh ") {
            g.mesh =
                Mesh::parse(rest.trim()).map_err(|e| locate(err(indent + 5, e.to_string())))?;
            continue;
        }
        if let Some(rest) = trimmed.strip_prefix("partition ") {
            let rest = rest.trim();
            // byte offsets: `"` is one byte, so the name may hold any UTF-8
            let close = rest
                .strip_prefix('"')
                .and_then(|r| r.find('"'))
                .map(|i| i + 2);
            let close = close.ok_or_else(|| {
                locate(err(
                    indent + 10,
                    "expected `partition \"<param>\" <kind> <axis> dim=<d> [sizes] ...`",
                ))
            })?;
            let name = unquote(&rest[..close]).map_err(|m| locate(err(indent + 10, m)))?;
            let p: crate::partition::Partition = rest[close..]
                .trim()
                .parse()
                .map_err(|m: String| locate(err(indent + 10 + close, m)))?;
            match partition_index.get(&name) {
                Some(&i) => g.param_partitions[i].1.push(p),
                None => {
                    partition_index.insert(name.clone(), g.param_partitions.len());
                    g.param_partitions.push((name, vec![p]));
                }
            }
            continue;
        }
        if let Some(rest) = trimmed.strip_prefix("split ") {
            let mut words = rest.split_whitespace();
            let name = words
                .next()
                .ok_or_else(|| locate(err(indent, "expected `split <output> <dim>:<axis> ...`")))?;
            for w in words {
                let col = offset_in(raw, w);
                let (d, a) = w
                    .split_once(':')
                    .and_then(|(d, a)| d.parse::<usize>().ok().map(|d| (d, a)))
                    .ok_or_else(|| {
                        locate(err(col, format!("expected `<dim>:<axis>`, found `{w}`")))
                    })?;
                let i = *split_index.entry(name.to_string()).or_insert_with(|| {
                    g.output_splits.push((name.to_string(), Vec::new()));
                    g.output_splits.len() - 1
                });
                g.output_splits[i].1.push((d, a.to_string()));
            }
            continue;
        }
        if let Some(rest) = trimmed.strip_prefix("return") {
            for part in split_top_level(rest.trim(), ',').map_err(|m| locate(err(indent, m)))? {
                if part.is_empty() {
                    continue;
                }
                let col = offset_in(raw, part);
                let (name, v) = part.split_once('=').ok_or_else(|| {
                    locate(err(col, format!("expected `name=%v`, found `{part}`")))
                })?;
                let written = parse_value(v.trim(), col).map_err(locate)?;
                let Some(v) = ids.used(written).filter(|v| g.try_value(*v).is_some()) else {
                    return Err(locate(err(
                        col,
                        format!("output `{}` uses undefined value {written}", name.trim()),
                    )));
                };
                if !outputs_seen.insert(name.trim().to_string()) {
                    return Err(locate(err(
                        col,
                        format!("output `{}` is returned twice", name.trim()),
                    )));
                }
                // Each name once (checked above): appended, not searched for.
                g.outputs.push((name.trim().to_string(), v));
            }
            returned = true;
            continue;
        }
        parse_node_line(&mut g, &mut ids, raw).map_err(locate)?;
    }
    if !seen_header {
        return Err(ParseError {
            line: 1,
            col: 1,
            message: "expected `graph \"name\"` first".into(),
        });
    }
    if !returned {
        let n = text.lines().count();
        return Err(ParseError {
            line: n.max(1),
            col: 1,
            message: "missing `return` line".into(),
        });
    }
    Ok(g)
}

fn parse_node_line(g: &mut Graph, ids: &mut Ids, raw: &str) -> Result<(), ParseError> {
    let (body, comment) = match comment_start(raw) {
        Some(i) => (&raw[..i], Some((i, &raw[i + 1..]))),
        None => (raw, None),
    };
    let eq = body
        .find('=')
        .ok_or_else(|| err(0, "expected `%v: type = op ...`"))?;
    let lhs = &body[..eq];
    let rhs = &body[eq + 1..];
    // results
    let mut results = Vec::new();
    let mut result_set = std::collections::HashSet::new();
    let mut tys = Vec::new();
    let mut off = 0;
    for part in split_top_level(lhs, ',').map_err(|m| err(0, m))? {
        let col = lhs[off..].find(part).map(|r| r + off).unwrap_or(0);
        off = col + part.len();
        let (v, t) = part
            .split_once(':')
            .ok_or_else(|| err(col, format!("expected `%v: type`, found `{part}`")))?;
        let written = parse_value(v.trim(), col)?;
        if ids.used(written).is_some_and(|v| g.try_value(v).is_some())
            || result_set.contains(&ids.define(written))
        {
            return Err(err(col, format!("value {written} is defined twice")));
        }
        let v = ids.define(written);
        let tcol = col + part.find(':').unwrap() + 1 + (t.len() - t.trim_start().len());
        let ty = parse_type(t.trim()).map_err(|e| err(tcol + e.col, e.message))?;
        results.push(v);
        result_set.insert(v);
        tys.push(ty);
    }
    // op name
    let rhs_start = eq + 1 + (rhs.len() - rhs.trim_start().len());
    let rhs_t = rhs.trim();
    let name_end = rhs_t
        .find(|c: char| c == ' ' || c == '{')
        .unwrap_or(rhs_t.len());
    let opname = &rhs_t[..name_end];
    if Op::info_by_name(opname).is_none() {
        return Err(err(rhs_start, format!("unknown op `{opname}`")));
    }
    let rest = &rhs_t[name_end..];
    let (ops_text, attrs_text) = match rest.find('{') {
        Some(i) => (&rest[..i], Some(&rest[i..])),
        None => (rest, None),
    };
    let ops_col = rhs_start + name_end;
    let mut operands = Vec::new();
    for part in ops_text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let col = ops_col + offset_in(ops_text, part);
        let written = parse_value(part, col)?;
        let Some(v) = ids.used(written).filter(|v| g.try_value(*v).is_some()) else {
            return Err(err(col, format!("{written} is used before it is defined")));
        };
        operands.push(v);
    }
    let mut attrs: Vec<(String, String)> = Vec::new();
    let mut attr_cols: Vec<usize> = Vec::new();
    if let Some(a) = attrs_text {
        let acol = ops_col + ops_text.len();
        let inner = a
            .trim_end()
            .strip_prefix('{')
            .and_then(|x| x.strip_suffix('}'))
            .ok_or_else(|| err(acol, "attributes must be `{key=value, ...}`"))?;
        for kv in split_top_level(inner, ',').map_err(|m| err(acol, m))? {
            if kv.is_empty() {
                continue;
            }
            let kcol = acol + offset_in(a, kv);
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| err(kcol, format!("expected `key=value`, found `{kv}`")))?;
            attrs.push((k.trim().to_string(), v.trim().to_string()));
            attr_cols.push(kcol);
        }
    }
    let info = Op::info_by_name(opname).unwrap();
    if info.attrs.contains(&"ty") {
        if tys.len() != 1 {
            return Err(err(0, format!("`{opname}` has exactly one result")));
        }
        attrs.push(("ty".into(), tys[0].to_string()));
    }
    let op = Op::from_text(opname, &attrs).map_err(|m| {
        // Point at the attribute the message names, if any.
        let col = attrs
            .iter()
            .zip(&attr_cols)
            .find(|((k, _), _)| m.contains(&format!("`{k}`")))
            .map(|(_, c)| *c)
            .unwrap_or(rhs_start);
        err(col, m)
    })?;
    let mut meta = NodeMeta::default();
    if let Some((_, c)) = comment {
        let c = c.trim();
        let (mut src, prov) = match c.find("<- ") {
            Some(i) => (c[..i].trim(), Some(c[i + 3..].trim())),
            None => (c, None),
        };
        // Trailing `[backward of %12]` / `[micro-batch 2]` tags (anything else in
        // brackets stays part of the source).
        while let Some(open) = src.strip_suffix(']').and_then(|s| s.rfind('[')) {
            let tag = &src[open + 1..src.len() - 1];
            if let Some(n) = tag
                .strip_prefix("micro-batch ")
                .and_then(|n| n.trim().parse::<u32>().ok())
            {
                meta.micro_batch = Some(n);
            } else if let Some((kind, of)) = tag.split_once(" of ") {
                let kind = crate::graph::DerivedKind::from_keyword(kind.trim());
                let of = of
                    .trim()
                    .strip_prefix('%')
                    .and_then(|v| v.parse::<u32>().ok());
                match (kind, of) {
                    (Some(kind), Some(of)) => {
                        meta.derived = ids
                            .used(Value(of))
                            .map(|of| crate::graph::Derived { kind, of })
                    }
                    _ => break,
                }
            } else {
                break;
            }
            src = src[..open].trim_end();
        }
        if !src.is_empty() {
            meta.source = Some(src.to_string());
        }
        if let Some(p) = prov {
            let (pass, reason) = p.split_once(':').unwrap_or((p, ""));
            meta.provenance = Some(Provenance {
                pass: pass.trim().to_string(),
                reason: reason.trim().to_string(),
            });
        }
    }
    g.insert_typed_with_ids(At::End, op, &operands, tys, &results, meta);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dims_round_trip() {
        for s in [
            "S/4",
            "@sp*S/sp",
            "2*B*S + 1",
            "S - 1",
            "(S + 1)//2",
            "tp?[51 50]",
            "-S",
            "S/4/sp",
        ] {
            let d = parse_dim(s).unwrap();
            assert_eq!(d.to_string(), s, "{s}");
            assert_eq!(parse_dim(&d.to_string()).unwrap(), d);
        }
        assert_eq!(parse_dim("S/2/2").unwrap().to_string(), "S/4");
    }

    #[test]
    fn dim_errors_have_columns() {
        let e = parse_dim("S + $").unwrap_err();
        assert_eq!(e.col, 4);
        assert!(parse_dim("S/0")
            .unwrap_err()
            .message
            .contains("division by zero"));
    }

    #[test]
    fn hostile_dims_are_bounded() {
        // Nesting that would exhaust the stack.
        let deep = format!("{}S{}", "(".repeat(100_000), ")".repeat(100_000));
        assert!(parse_dim(&deep)
            .unwrap_err()
            .message
            .contains("nests more than 64"));
        let neg = format!("{}S", "-".repeat(100_000));
        assert!(parse_dim(&neg)
            .unwrap_err()
            .message
            .contains("nests more than 64"));
        let floors = format!("S{}", "//3".repeat(10_000));
        assert!(parse_dim(&floors)
            .unwrap_err()
            .message
            .contains("more than 64 floor divisions"));
        // A product of sums whose expansion would hold 8^30 terms.
        let sums = vec!["(a+b+c+d+e+f+g+h)"; 30].join("*");
        let e = parse_dim(&sums).unwrap_err();
        assert!(e.message.contains("more than 4096 terms"), "{e:?}");
        // Coefficients past 128 bits: named, not printed as `<overflow>`.
        let e = parse_dim("9223372036854775807*9223372036854775807*4").unwrap_err();
        assert!(e.message.contains("overflows"), "{e:?}");
        // What real programs write still parses.
        assert!(parse_dim("((S + 1)//2)*(B + 1)*(B - 1)").is_ok());
    }

    /// Lines of many pieces (outputs, attributes, results, operands, splits) are read in
    /// linear time: each piece used to be located by searching the line from its start,
    /// and each output by searching those before it (a 3 MB `return` line took minutes).
    #[test]
    fn long_lines_parse_in_linear_time() {
        let n = 200_000;
        let head = "graph \"x\"\n%0: f32[2, 2] = param {name=\"w\"}\n";
        let names = |f: &dyn Fn(usize) -> String| (0..n).map(f).collect::<Vec<_>>();
        let cases = [
            format!(
                "{head}return {}\n",
                names(&|i| format!("o{i}=%0")).join(", ")
            ),
            format!(
                "{head}%1: f32[2, 2] = neg %0 {{{}}}\nreturn o=%1\n",
                names(&|i| format!("k{i}=1")).join(", ")
            ),
            format!(
                "{head}{} = neg %0\nreturn o=%0\n",
                names(&|i| format!("%{}: f32[2]", i + 1)).join(", ")
            ),
            format!(
                "{head}{}return o=%0\n",
                names(&|i| format!("split o{i} 0:dp\n")).concat()
            ),
        ];
        let t = std::time::Instant::now();
        for text in &cases {
            // Parsed or refused (errors are fine), in well under the time a quadratic
            // reader took.
            let _ = parse(text);
        }
        let dt = t.elapsed().as_secs_f64();
        assert!(
            dt < 30.0,
            "{dt:.1} s to read {} lines of {n} pieces",
            cases.len()
        );
        let g = parse(&cases[0]).unwrap();
        assert_eq!(g.outputs().len(), n);
        assert!(parse(&cases[1])
            .unwrap_err()
            .message
            .contains("no attribute `k0`"));
    }

    #[test]
    fn type_round_trip() {
        let t = parse_type("bf16[B, S/4, 4096]").unwrap();
        assert_eq!(t.to_string(), "bf16[B, S/4, 4096]");
        assert_eq!(parse_type("f32[]").unwrap().rank(), 0);
        assert!(parse_type("f33[1]")
            .unwrap_err()
            .message
            .contains("unknown dtype"));
    }
}
