//! Symbolic sizes as export writes them: sympy `srepr` text
//! (`Mul(Integer(2), Symbol('s70', positive=True, integer=True))`), or plain sympy text
//! (`2*s70 + 1`) from older writers. Parsed to a small tree, then turned into a Weft
//! [`Dim`] given what each export symbol stands for (`s70` → `S`).

use std::collections::BTreeMap;
use weft_ir::Dim;

#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    Int(i64),
    Sym(String),
    Add(Vec<Expr>),
    Mul(Vec<Expr>),
    Pow(Box<Expr>, Box<Expr>),
    FloorDiv(Box<Expr>, Box<Expr>),
    Rational(i64, i64),
    /// A function Weft has no dim for (`Mod`, `Max`, `CeilToInt`, ...).
    Call(String, Vec<Expr>),
}

pub fn parse(text: &str) -> Result<Expr, String> {
    let toks = lex(text)?;
    let mut p = P {
        t: toks,
        i: 0,
        depth: 0,
    };
    let e = p.sum()?;
    if p.i != p.t.len() {
        return Err(format!("unexpected `{}` after the expression", p.t[p.i]));
    }
    Ok(e)
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Num(i64),
    Ident(String),
    Str(String),
    Op(&'static str),
}

impl std::fmt::Display for Tok {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tok::Num(n) => write!(f, "{n}"),
            Tok::Ident(s) => write!(f, "{s}"),
            Tok::Str(s) => write!(f, "'{s}'"),
            Tok::Op(o) => write!(f, "{o}"),
        }
    }
}

fn lex(s: &str) -> Result<Vec<Tok>, String> {
    let c: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch.is_ascii_digit() {
            let st = i;
            while i < c.len() && c[i].is_ascii_digit() {
                i += 1;
            }
            let t: String = c[st..i].iter().collect();
            out.push(Tok::Num(
                t.parse()
                    .map_err(|_| format!("integer `{t}` is out of range"))?,
            ));
        } else if ch.is_alphabetic() || ch == '_' {
            let st = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push(Tok::Ident(c[st..i].iter().collect()));
        } else if ch == '\'' || ch == '"' {
            let q = ch;
            let st = i + 1;
            i += 1;
            while i < c.len() && c[i] != q {
                i += 1;
            }
            if i >= c.len() {
                return Err("unterminated string".into());
            }
            out.push(Tok::Str(c[st..i].iter().collect()));
            i += 1;
        } else {
            let two: String = c[i..(i + 2).min(c.len())].iter().collect();
            let op: &'static str = match (two.as_str(), ch) {
                ("//", _) => "//",
                ("**", _) => "**",
                (_, '(') => "(",
                (_, ')') => ")",
                (_, ',') => ",",
                (_, '=') => "=",
                (_, '+') => "+",
                (_, '-') => "-",
                (_, '*') => "*",
                (_, '/') => "/",
                _ => return Err(format!("unexpected character `{ch}`")),
            };
            i += op.len();
            out.push(Tok::Op(op));
        }
    }
    Ok(out)
}

struct P {
    t: Vec<Tok>,
    i: usize,
    depth: usize,
}

impl P {
    fn peek(&self) -> Option<&Tok> {
        self.t.get(self.i)
    }
    fn eat(&mut self, op: &str) -> bool {
        if matches!(self.peek(), Some(Tok::Op(o)) if *o == op) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, op: &str) -> Result<(), String> {
        if self.eat(op) {
            Ok(())
        } else {
            Err(format!(
                "expected `{op}`, found {}",
                self.peek()
                    .map(|t| format!("`{t}`"))
                    .unwrap_or("the end".into())
            ))
        }
    }

    fn sum(&mut self) -> Result<Expr, String> {
        let mut terms = vec![self.product()?];
        loop {
            if self.eat("+") {
                terms.push(self.product()?);
            } else if self.eat("-") {
                let t = self.product()?;
                terms.push(Expr::Mul(vec![Expr::Int(-1), t]));
            } else {
                break;
            }
        }
        Ok(if terms.len() == 1 {
            terms.pop().unwrap()
        } else {
            Expr::Add(terms)
        })
    }

    fn product(&mut self) -> Result<Expr, String> {
        let mut e = self.unary()?;
        loop {
            if self.eat("*") {
                let r = self.unary()?;
                e = match e {
                    Expr::Mul(mut v) => {
                        v.push(r);
                        Expr::Mul(v)
                    }
                    e => Expr::Mul(vec![e, r]),
                };
            } else if self.eat("//") {
                let r = self.unary()?;
                e = Expr::FloorDiv(Box::new(e), Box::new(r));
            } else if self.eat("/") {
                let r = self.unary()?;
                e = Expr::Mul(vec![e, Expr::Pow(Box::new(r), Box::new(Expr::Int(-1)))]);
            } else {
                break;
            }
        }
        Ok(e)
    }

    fn unary(&mut self) -> Result<Expr, String> {
        if self.eat("-") {
            let e = self.unary()?;
            return Ok(Expr::Mul(vec![Expr::Int(-1), e]));
        }
        let base = self.atom()?;
        if self.eat("**") {
            let e = self.unary()?;
            return Ok(Expr::Pow(Box::new(base), Box::new(e)));
        }
        Ok(base)
    }

    fn atom(&mut self) -> Result<Expr, String> {
        self.depth += 1;
        if self.depth > 64 {
            return Err("expression nested too deeply".into());
        }
        let r = self.atom_inner();
        self.depth -= 1;
        r
    }

    fn atom_inner(&mut self) -> Result<Expr, String> {
        match self.peek().cloned() {
            Some(Tok::Num(n)) => {
                self.i += 1;
                Ok(Expr::Int(n))
            }
            Some(Tok::Op("(")) => {
                self.i += 1;
                let e = self.sum()?;
                self.expect(")")?;
                Ok(e)
            }
            Some(Tok::Ident(name)) => {
                self.i += 1;
                if !self.eat("(") {
                    return Ok(Expr::Sym(name));
                }
                // A call: positional expressions and keyword arguments (ignored).
                let mut args = Vec::new();
                let mut strs = Vec::new();
                if !self.eat(")") {
                    loop {
                        if let (Some(Tok::Ident(_)), Some(Tok::Op("="))) =
                            (self.t.get(self.i), self.t.get(self.i + 1))
                        {
                            self.i += 2;
                            self.sum_or_str()?;
                        } else if let Some(Tok::Str(s)) = self.peek().cloned() {
                            self.i += 1;
                            strs.push(s);
                        } else {
                            args.push(self.sum()?);
                        }
                        if self.eat(")") {
                            break;
                        }
                        self.expect(",")?;
                    }
                }
                call(&name, args, strs)
            }
            Some(t) => Err(format!("unexpected `{t}`")),
            None => Err("unexpected end of the expression".into()),
        }
    }

    fn sum_or_str(&mut self) -> Result<(), String> {
        if let Some(Tok::Str(_)) = self.peek() {
            self.i += 1;
            Ok(())
        } else {
            self.sum().map(|_| ())
        }
    }
}

fn call(name: &str, mut args: Vec<Expr>, strs: Vec<String>) -> Result<Expr, String> {
    let two = |args: &mut Vec<Expr>| -> Result<(Expr, Expr), String> {
        if args.len() != 2 {
            return Err(format!("`{name}` takes 2 arguments, got {}", args.len()));
        }
        let b = args.pop().unwrap();
        Ok((args.pop().unwrap(), b))
    };
    match name {
        "Symbol" => strs
            .into_iter()
            .next()
            .map(Expr::Sym)
            .ok_or_else(|| "Symbol without a name".to_string()),
        "Integer" => match args.as_slice() {
            [Expr::Int(n)] => Ok(Expr::Int(*n)),
            [Expr::Mul(v)] if matches!(v.as_slice(), [Expr::Int(-1), Expr::Int(_)]) => match v[1] {
                Expr::Int(n) => Ok(Expr::Int(-n)),
                _ => unreachable!(),
            },
            _ => Err("Integer takes one integer".into()),
        },
        "Rational" => match args.as_slice() {
            [Expr::Int(p), Expr::Int(q)] if *q != 0 => Ok(Expr::Rational(*p, *q)),
            _ => Err("Rational takes two integers".into()),
        },
        "Add" => Ok(Expr::Add(args)),
        "Mul" => Ok(Expr::Mul(args)),
        "Pow" => {
            let (a, b) = two(&mut args)?;
            Ok(Expr::Pow(Box::new(a), Box::new(b)))
        }
        "FloorDiv" => {
            let (a, b) = two(&mut args)?;
            Ok(Expr::FloorDiv(Box::new(a), Box::new(b)))
        }
        "One" => Ok(Expr::Int(1)),
        "Zero" => Ok(Expr::Int(0)),
        "NegativeOne" => Ok(Expr::Int(-1)),
        _ => Ok(Expr::Call(name.to_string(), args)),
    }
}

/// Largest constant accepted in a size (keeps Dim arithmetic far from overflow).
const LIMIT: u64 = 1 << 40;

impl Expr {
    /// Every symbol name the expression mentions.
    #[allow(dead_code)]
    pub fn symbols(&self, out: &mut Vec<String>) {
        match self {
            Expr::Sym(s) => {
                if !out.contains(s) {
                    out.push(s.clone())
                }
            }
            Expr::Add(v) | Expr::Mul(v) | Expr::Call(_, v) => v.iter().for_each(|e| e.symbols(out)),
            Expr::Pow(a, b) | Expr::FloorDiv(a, b) => {
                a.symbols(out);
                b.symbols(out);
            }
            Expr::Int(_) | Expr::Rational(..) => {}
        }
    }

    /// The Weft dim, with export symbols replaced as `map` says.
    pub fn to_dim(&self, map: &BTreeMap<String, Dim>) -> Result<Dim, String> {
        Ok(match self {
            Expr::Int(n) if n.unsigned_abs() > LIMIT => return Err(format!("{n} is out of range")),
            Expr::Int(n) => Dim::from(*n),
            Expr::Rational(p, q) if p.unsigned_abs() > LIMIT || q.unsigned_abs() > LIMIT => {
                return Err("a rational out of range".into())
            }
            Expr::Rational(p, q) => Dim::from(*p) / Dim::from(*q),
            Expr::Sym(s) => map.get(s).cloned().ok_or_else(|| {
                format!("symbol `{s}` is not the batch or sequence size of an input")
            })?,
            Expr::Add(v) => v
                .iter()
                .try_fold(Dim::zero(), |a, e| Ok::<_, String>(a + e.to_dim(map)?))?,
            Expr::Mul(v) => v
                .iter()
                .try_fold(Dim::from(1), |a, e| Ok::<_, String>(a * e.to_dim(map)?))?,
            Expr::Pow(a, b) => {
                let base = a.to_dim(map)?;
                match **b {
                    Expr::Int(n) if (0..=8).contains(&n) => {
                        (0..n).fold(Dim::from(1), |acc, _| acc * base.clone())
                    }
                    Expr::Int(-1) if base.as_const() == Some(0) => {
                        return Err("division by zero".into())
                    }
                    Expr::Int(-1) => Dim::from(1) / base,
                    _ => return Err("only small integer powers are supported".into()),
                }
            }
            Expr::FloorDiv(a, b) => {
                let d = b.to_dim(map)?;
                if d.as_const() == Some(0) {
                    return Err("division by zero".into());
                }
                a.to_dim(map)?.floor_div(&d)
            }
            Expr::Call(f, _) => return Err(format!("`{f}` has no Weft dim form")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s_map() -> BTreeMap<String, Dim> {
        [("s70".to_string(), Dim::sym("S"))].into_iter().collect()
    }

    #[test]
    fn srepr_forms() {
        let e = parse("Mul(Integer(2), Symbol('s70', positive=True, integer=True))").unwrap();
        assert_eq!(e.to_dim(&s_map()).unwrap(), Dim::sym("S") * 2);
        let e = parse("Add(Symbol('s70', positive=True, integer=True), Integer(1))").unwrap();
        assert_eq!(e.to_dim(&s_map()).unwrap(), Dim::sym("S") + 1);
        let e = parse("FloorDiv(Symbol('s70', integer=True), Integer(2))").unwrap();
        assert_eq!(e.to_dim(&s_map()).unwrap().to_string(), "S//2");
        let e = parse("Mod(Symbol('s70'), Integer(2))").unwrap();
        assert!(e.to_dim(&s_map()).unwrap_err().contains("Mod"));
        let e = parse("Symbol('u0', integer=True)").unwrap();
        assert!(e.to_dim(&s_map()).unwrap_err().contains("u0"));
    }

    #[test]
    fn plain_forms() {
        let e = parse("4*s70 - 1").unwrap();
        assert_eq!(e.to_dim(&s_map()).unwrap(), Dim::sym("S") * 4 + (-1));
        assert_eq!(
            parse("(s70 + 2)//2")
                .unwrap()
                .to_dim(&s_map())
                .unwrap()
                .to_string(),
            "(S + 2)//2"
        );
        assert!(parse("s70 +").is_err());
        assert!(parse("Symbol('s70'").is_err());
    }
}
