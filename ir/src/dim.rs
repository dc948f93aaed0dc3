//! Symbolic dimensions: constants and expressions over named symbols (`B`, `S`, mesh
//! axis sizes such as `sp`, and rank coordinates such as `@sp`), kept in one canonical
//! form so that equal sizes print and compare equal (`S/2/2` is `S/4`).
//!
//! A `Dim` is a sum of terms; each term is a rational coefficient times a monomial, a
//! product of atoms raised to integer powers (negative powers are exact division by a
//! symbol). Atoms are symbols, rank coordinates, floor divisions (kept opaque), and
//! per-rank size tables (uneven shards: each rank on an axis has its own size).
//!
//! Coefficients are exact 128-bit rationals with checked arithmetic: a term whose
//! coefficient would not fit makes the whole dim the opaque [`Atom::Overflow`], which
//! the verifier refuses and which never evaluates (never a wrapped size). Evaluation is
//! checked too and must fit an `i64`.

use std::collections::BTreeMap;
use std::fmt;

/// Values bound to symbols and rank coordinates when a dim is evaluated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bindings {
    pub symbols: BTreeMap<String, i64>,
    /// Rank coordinate on each mesh axis (`@sp`).
    pub coords: BTreeMap<String, i64>,
}

impl Bindings {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn with(mut self, name: &str, value: i64) -> Self {
        self.symbols.insert(name.to_string(), value);
        self
    }
    pub fn with_coord(mut self, axis: &str, value: i64) -> Self {
        self.coords.insert(axis.to_string(), value);
        self
    }
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Atom {
    /// The calling rank's coordinate on a mesh axis: `@sp`.
    Coord(String),
    /// A size symbol: `B`, `S`, `sp`.
    Sym(String),
    /// `floor(num / den)`, kept opaque.
    FloorDiv(Box<Dim>, Box<Dim>),
    /// A size that differs per rank on `axis`: `sizes[coord(axis)]`.
    PerRank { axis: String, sizes: Vec<i64> },
    /// A size whose arithmetic overflowed: absorbs everything it meets, never evaluates.
    Overflow,
}

/// A product of atoms with integer exponents, sorted by atom.
type Monomial = Vec<(Atom, i32)>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Ratio {
    num: i128,
    den: i128,
}

fn gcd(a: i128, b: i128) -> i128 {
    let (mut a, mut b) = (a.unsigned_abs(), b.unsigned_abs());
    while b != 0 {
        let t = a % b;
        a = b;
        b = t;
    }
    // Both magnitudes fit i128 here (coefficients never hold i128::MIN).
    a as i128
}

/// Arithmetic on exact rationals; `None` when a result does not fit 128 bits (or
/// divides by zero).
impl Ratio {
    fn new(num: i128, den: i128) -> Option<Ratio> {
        if den == 0 || num == i128::MIN || den == i128::MIN {
            return None;
        }
        let g = gcd(num, den).max(1);
        let s = if den < 0 { -1 } else { 1 };
        Some(Ratio {
            num: s * num / g,
            den: s * den / g,
        })
    }
    fn int(n: i64) -> Ratio {
        Ratio {
            num: n as i128,
            den: 1,
        }
    }
    fn add(self, o: Ratio) -> Option<Ratio> {
        let n = self
            .num
            .checked_mul(o.den)?
            .checked_add(o.num.checked_mul(self.den)?)?;
        Ratio::new(n, self.den.checked_mul(o.den)?)
    }
    fn mul(self, o: Ratio) -> Option<Ratio> {
        Ratio::new(self.num.checked_mul(o.num)?, self.den.checked_mul(o.den)?)
    }
}

/// The most terms a dim may hold. Sizes have a handful; products of sums multiply
/// their terms (`(a+b+c+d)^k` has thousands at small `k`), so a product or sum that
/// would hold more is [`Dim::overflow`] instead of unbounded work and memory.
pub const MAX_TERMS: usize = 4096;

/// A symbolic size in canonical form. Construct with `Dim::from(n)`, `Dim::sym("S")`
/// and the arithmetic operators; compare with `==`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Dim {
    /// Sorted by monomial, no zero coefficients, no duplicate monomials.
    terms: Vec<(Monomial, (i128, i128))>,
}

/// A dim that cannot be evaluated or divided.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DimError {
    #[error("symbol `{0}` is not bound")]
    Unbound(String),
    #[error("rank coordinate `@{0}` is not bound")]
    UnboundCoord(String),
    #[error("`{dim}` is not an integer (it is {num}/{den})")]
    NotInteger { dim: String, num: i64, den: i64 },
    #[error("division by zero in `{0}`")]
    DivByZero(String),
    #[error("`{dim}` is {value}: a size cannot be negative")]
    Negative { dim: String, value: i64 },
    #[error("`{0}` overflows: the size is larger than Weft can count")]
    Overflow(String),
    #[error("rank {coord} is out of range for the per-rank sizes of axis `{axis}` ({len} ranks)")]
    CoordOutOfRange {
        axis: String,
        coord: i64,
        len: usize,
    },
}

impl Dim {
    pub fn zero() -> Dim {
        Dim { terms: vec![] }
    }
    pub fn constant(n: i64) -> Dim {
        Dim::from_terms(vec![(vec![], Some(Ratio::int(n)))])
    }
    pub fn sym(name: &str) -> Dim {
        Dim::atom(Atom::Sym(name.to_string()))
    }
    /// The calling rank's coordinate on `axis`.
    pub fn coord(axis: &str) -> Dim {
        Dim::atom(Atom::Coord(axis.to_string()))
    }
    pub fn per_rank(axis: &str, sizes: Vec<i64>) -> Dim {
        if !sizes.is_empty() && sizes.iter().all(|&s| s == sizes[0]) {
            return Dim::constant(sizes[0]);
        }
        Dim::atom(Atom::PerRank {
            axis: axis.to_string(),
            sizes,
        })
    }
    /// A size that differs per rank of a group of axes (`axes` with their sizes,
    /// outermost first): `sizes[g]` on the rank of row-major group index `g`. One axis is
    /// [`Dim::per_rank`]; several are spelled with one-axis tables, as a sum over the
    /// distinct tables of the inner axes (in first-seen order) of an outer indicator
    /// table times that inner table: `[2 1 1 1 1 1]` over `dp=2, sp=3` is
    /// `dp?[0 1] + dp?[1 0]*sp?[2 1 1]`. A table the same on every rank is a constant,
    /// one the same on every rank of the inner axes a table of the outer axis.
    /// `None` where `sizes` does not list one size per group rank.
    pub fn per_group_rank(axes: &[(String, i64)], sizes: &[i64]) -> Option<Dim> {
        let total: i64 = axes.iter().map(|(_, n)| *n).product();
        if axes.is_empty() || axes.iter().any(|(_, n)| *n < 1) || sizes.len() as i64 != total {
            return None;
        }
        if !sizes.is_empty() && sizes.iter().all(|&s| s == sizes[0]) {
            return Some(Dim::constant(sizes[0]));
        }
        let [(outer, n), rest @ ..] = axes else {
            return None;
        };
        if rest.is_empty() {
            return Some(Dim::per_rank(outer, sizes.to_vec()));
        }
        let inner = (total / n) as usize;
        let rows: Vec<&[i64]> = sizes.chunks(inner).collect();
        if rows.iter().all(|r| r.iter().all(|&s| s == r[0])) {
            return Some(Dim::per_rank(outer, rows.iter().map(|r| r[0]).collect()));
        }
        let mut out = Dim::zero();
        let mut seen: Vec<&[i64]> = Vec::new();
        for row in &rows {
            if seen.contains(row) {
                continue;
            }
            seen.push(row);
            let which: Vec<i64> = rows.iter().map(|r| i64::from(r == row)).collect();
            out = out + Dim::per_rank(outer, which) * Dim::per_group_rank(rest, row)?;
        }
        Some(out)
    }

    pub fn atom(a: Atom) -> Dim {
        Dim::from_terms(vec![(vec![(a, 1)], Some(Ratio::int(1)))])
    }

    /// The dim of a computation that overflowed.
    pub fn overflow() -> Dim {
        Dim {
            terms: vec![(vec![(Atom::Overflow, 1)], (1, 1))],
        }
    }

    /// How many terms the dim's canonical sum holds (at most [`MAX_TERMS`]).
    pub fn term_count(&self) -> usize {
        self.terms.len()
    }

    /// How deeply floor divisions nest in the dim (`S//3//3` is 2; a plain sum is 0).
    pub fn nesting(&self) -> usize {
        self.terms
            .iter()
            .flat_map(|(m, _)| m.iter())
            .map(|(a, _)| match a {
                Atom::FloorDiv(n, d) => 1 + n.nesting().max(d.nesting()),
                _ => 0,
            })
            .max()
            .unwrap_or(0)
    }

    /// True when this dim's arithmetic overflowed somewhere.
    pub fn is_overflow(&self) -> bool {
        self.terms.iter().any(|(m, _)| {
            m.iter().any(|(a, _)| match a {
                Atom::Overflow => true,
                Atom::FloorDiv(n, d) => n.is_overflow() || d.is_overflow(),
                _ => false,
            })
        })
    }

    /// Sums the terms; a missing coefficient (`None`: it overflowed) or an overflowed
    /// atom makes the result [`Dim::overflow`].
    fn from_terms(terms: Vec<(Monomial, Option<Ratio>)>) -> Dim {
        let mut acc: BTreeMap<Monomial, Ratio> = BTreeMap::new();
        for (m, c) in terms {
            let Some(c) = c else {
                return Dim::overflow();
            };
            if m.iter().any(|(a, _)| *a == Atom::Overflow) {
                return Dim::overflow();
            }
            let e = acc.entry(m).or_insert(Ratio::int(0));
            match e.add(c) {
                Some(sum) => *e = sum,
                None => return Dim::overflow(),
            }
        }
        Dim {
            terms: acc
                .into_iter()
                .filter(|(_, c)| c.num != 0)
                .map(|(m, c)| (m, (c.num, c.den)))
                .collect(),
        }
    }

    fn ratio_terms(&self) -> impl Iterator<Item = (&Monomial, Ratio)> {
        self.terms
            .iter()
            .map(|(m, (n, d))| (m, Ratio { num: *n, den: *d }))
    }

    /// The value if this dim is a constant integer.
    pub fn as_const(&self) -> Option<i64> {
        match self.terms.as_slice() {
            [] => Some(0),
            [(m, (n, 1))] if m.is_empty() => i64::try_from(*n).ok(),
            _ => None,
        }
    }

    pub fn is_const(&self) -> bool {
        self.as_const().is_some()
    }

    /// True when the dim is a constant that is not an integer (e.g. `7/2`).
    pub fn is_fractional_const(&self) -> bool {
        matches!(self.terms.as_slice(), [(m, (_, d))] if m.is_empty() && *d != 1)
    }

    /// Every size symbol this dim mentions (not rank coordinates).
    pub fn symbols(&self) -> Vec<String> {
        let mut out = std::collections::BTreeSet::new();
        self.collect_symbols(&mut out);
        out.into_iter().collect()
    }

    fn collect_symbols(&self, out: &mut std::collections::BTreeSet<String>) {
        for (m, _) in &self.terms {
            for (a, _) in m {
                match a {
                    Atom::Sym(s) => {
                        out.insert(s.clone());
                    }
                    Atom::FloorDiv(n, d) => {
                        n.collect_symbols(out);
                        d.collect_symbols(out);
                    }
                    Atom::Coord(_) | Atom::PerRank { .. } | Atom::Overflow => {}
                }
            }
        }
    }

    /// True if the dim mentions symbol `name` anywhere.
    pub fn mentions(&self, name: &str) -> bool {
        self.symbols().iter().any(|s| s == name)
    }

    /// Mesh axes whose rank coordinate or per-rank table this dim depends on.
    pub fn rank_axes(&self) -> Vec<String> {
        let mut out = std::collections::BTreeSet::new();
        for (m, _) in &self.terms {
            for (a, _) in m {
                match a {
                    Atom::Coord(x) | Atom::PerRank { axis: x, .. } => {
                        out.insert(x.clone());
                    }
                    Atom::FloorDiv(n, d) => {
                        out.extend(n.rank_axes());
                        out.extend(d.rank_axes());
                    }
                    Atom::Sym(_) | Atom::Overflow => {}
                }
            }
        }
        out.into_iter().collect()
    }

    /// Every per-rank size table in this dim, as `(axis, number of ranks listed)`.
    pub fn per_rank_tables(&self) -> Vec<(String, usize)> {
        let mut out = Vec::new();
        for (m, _) in &self.terms {
            for (a, _) in m {
                match a {
                    Atom::PerRank { axis, sizes } => out.push((axis.clone(), sizes.len())),
                    Atom::FloorDiv(n, d) => {
                        out.extend(n.per_rank_tables());
                        out.extend(d.per_rank_tables());
                    }
                    _ => {}
                }
            }
        }
        out
    }

    /// Replaces every occurrence of symbol `name` by `by`, re-canonicalizing.
    pub fn substitute(&self, name: &str, by: &Dim) -> Dim {
        let mut out = Dim::zero();
        for (m, c) in self.ratio_terms() {
            let mut t = Dim::from_terms(vec![(vec![], Some(c))]);
            for (a, e) in m {
                let base = match a {
                    Atom::Sym(s) if s == name => by.clone(),
                    Atom::FloorDiv(n, d) => {
                        n.substitute(name, by).floor_div(&d.substitute(name, by))
                    }
                    other => Dim::atom(other.clone()),
                };
                t = t * base.pow(*e);
            }
            out = out + t;
        }
        out
    }

    fn pow(&self, e: i32) -> Dim {
        if e >= 0 {
            let mut r = Dim::constant(1);
            for _ in 0..e {
                r = r * self.clone();
            }
            r
        } else {
            let inv = self.recip();
            let mut r = Dim::constant(1);
            for _ in 0..(-e) {
                r = r * inv.clone();
            }
            r
        }
    }

    /// `1/self`. A single term inverts exactly; a sum becomes an opaque atom
    /// `(sum)//1` (equal to the sum for integers) raised to the power -1.
    fn recip(&self) -> Dim {
        match self.terms.as_slice() {
            [(m, (n, d))] => {
                let mono: Monomial = m.iter().map(|(a, e)| (a.clone(), -e)).collect();
                Dim::from_terms(vec![(mono, Ratio::new(*d, *n))])
            }
            _ => {
                let a = Atom::FloorDiv(Box::new(self.clone()), Box::new(Dim::constant(1)));
                Dim::from_terms(vec![(vec![(a, -1)], Some(Ratio::int(1)))])
            }
        }
    }

    /// Exact division (`S/sp`): the result must be an integer at evaluation time.
    pub fn exact_div(&self, by: &Dim) -> Dim {
        self.clone() * by.recip()
    }

    /// Floor division (`S//3`), folded when both sides are constants or when the
    /// division is exact term by term with integer coefficients.
    pub fn floor_div(&self, by: &Dim) -> Dim {
        if let (Some(a), Some(b)) = (self.as_const(), by.as_const()) {
            if let Some(q) = floor_div_int(a, b) {
                return Dim::constant(q);
            }
        }
        if let Some(b) = by.as_const() {
            if b != 0
                && self
                    .terms
                    .iter()
                    .all(|(_, (n, d))| *d == 1 && n % b as i128 == 0)
            {
                return self.exact_div(by);
            }
        }
        Dim::atom(Atom::FloorDiv(Box::new(self.clone()), Box::new(by.clone())))
    }

    /// Evaluates to an integer with the given bindings.
    pub fn eval(&self, b: &Bindings) -> Result<i64, DimError> {
        // Accumulate exactly as checked rationals, then require an i64 integer.
        let overflow = || DimError::Overflow(self.to_string());
        let mut total = Ratio::int(0);
        for (m, c) in self.ratio_terms() {
            let mut t = c;
            for (a, e) in m {
                let v = eval_atom(a, b)?;
                for _ in 0..e.unsigned_abs() {
                    t = if *e > 0 {
                        t.mul(Ratio::int(v)).ok_or_else(overflow)?
                    } else {
                        if v == 0 {
                            return Err(DimError::DivByZero(self.to_string()));
                        }
                        t.mul(Ratio::new(1, v as i128).ok_or_else(overflow)?)
                            .ok_or_else(overflow)?
                    };
                }
            }
            total = total.add(t).ok_or_else(overflow)?;
        }
        let (num, den) = (
            i64::try_from(total.num).map_err(|_| overflow())?,
            i64::try_from(total.den).map_err(|_| overflow())?,
        );
        if den != 1 {
            return Err(DimError::NotInteger {
                dim: self.to_string(),
                num,
                den,
            });
        }
        Ok(num)
    }

    /// Evaluates in floating point, for counts that are only reported (FLOPs): never
    /// wraps, whatever the sizes (a coordinate or table still needs its binding).
    pub fn eval_f64(&self, b: &Bindings) -> Result<f64, DimError> {
        let mut total = 0.0;
        for (m, c) in self.ratio_terms() {
            let mut t = c.num as f64 / c.den as f64;
            for (a, e) in m {
                t *= (eval_atom(a, b)? as f64).powi(*e);
            }
            total += t;
        }
        Ok(total)
    }

    /// Evaluates what can be evaluated: binds the given symbols and coordinates and
    /// leaves the rest symbolic.
    pub fn bind(&self, b: &Bindings) -> Dim {
        let mut out = Dim::zero();
        for (m, c) in self.ratio_terms() {
            let mut t = Dim::from_terms(vec![(vec![], Some(c))]);
            for (a, e) in m {
                let base = match eval_atom(a, b) {
                    Ok(v) => Dim::constant(v),
                    Err(_) => match a {
                        Atom::FloorDiv(n, d) => n.bind(b).floor_div(&d.bind(b)),
                        other => Dim::atom(other.clone()),
                    },
                };
                t = t * base.pow(*e);
            }
            out = out + t;
        }
        out
    }
}

fn eval_atom(a: &Atom, b: &Bindings) -> Result<i64, DimError> {
    match a {
        Atom::Sym(s) => b
            .symbols
            .get(s)
            .copied()
            .ok_or_else(|| DimError::Unbound(s.clone())),
        Atom::Coord(x) => b
            .coords
            .get(x)
            .copied()
            .ok_or_else(|| DimError::UnboundCoord(x.clone())),
        Atom::FloorDiv(n, d) => {
            let (n, dv) = (n.eval(b)?, d.eval(b)?);
            if dv == 0 {
                return Err(DimError::DivByZero(format!("{n}//0")));
            }
            floor_div_int(n, dv).ok_or_else(|| DimError::Overflow(format!("{n}//{dv}")))
        }
        Atom::Overflow => Err(DimError::Overflow("a size".into())),
        Atom::PerRank { axis, sizes } => {
            let c = b
                .coords
                .get(axis)
                .copied()
                .ok_or_else(|| DimError::UnboundCoord(axis.clone()))?;
            sizes
                .get(c as usize)
                .copied()
                .ok_or(DimError::CoordOutOfRange {
                    axis: axis.clone(),
                    coord: c,
                    len: sizes.len(),
                })
        }
    }
}

impl From<i64> for Dim {
    fn from(n: i64) -> Dim {
        Dim::constant(n)
    }
}
impl From<usize> for Dim {
    fn from(n: usize) -> Dim {
        Dim::constant(n as i64)
    }
}
impl From<i32> for Dim {
    fn from(n: i32) -> Dim {
        Dim::constant(n as i64)
    }
}

impl std::ops::Add for Dim {
    type Output = Dim;
    fn add(self, o: Dim) -> Dim {
        if self.terms.len().saturating_add(o.terms.len()) > MAX_TERMS {
            return Dim::overflow();
        }
        let mut t: Vec<(Monomial, Option<Ratio>)> = self
            .ratio_terms()
            .map(|(m, c)| (m.clone(), Some(c)))
            .collect();
        t.extend(o.ratio_terms().map(|(m, c)| (m.clone(), Some(c))));
        Dim::from_terms(t)
    }
}
impl std::ops::Sub for Dim {
    type Output = Dim;
    fn sub(self, o: Dim) -> Dim {
        self + o * Dim::constant(-1)
    }
}
impl std::ops::Mul for Dim {
    type Output = Dim;
    fn mul(self, o: Dim) -> Dim {
        if self.terms.len().saturating_mul(o.terms.len()) > MAX_TERMS {
            return Dim::overflow();
        }
        let mut out = Vec::new();
        for (m1, c1) in self.ratio_terms() {
            for (m2, c2) in o.ratio_terms() {
                let mut acc: BTreeMap<Atom, i32> = BTreeMap::new();
                for (a, e) in m1.iter().chain(m2.iter()) {
                    *acc.entry(a.clone()).or_insert(0) += e;
                }
                let mono: Monomial = acc.into_iter().filter(|(_, e)| *e != 0).collect();
                out.push((mono, c1.mul(c2)));
            }
        }
        Dim::from_terms(out)
    }
}
impl std::ops::Add<i64> for Dim {
    type Output = Dim;
    fn add(self, o: i64) -> Dim {
        self + Dim::constant(o)
    }
}
impl std::ops::Mul<i64> for Dim {
    type Output = Dim;
    fn mul(self, o: i64) -> Dim {
        self * Dim::constant(o)
    }
}
impl std::ops::Div<i64> for Dim {
    type Output = Dim;
    /// Exact division by a constant.
    fn div(self, o: i64) -> Dim {
        self.exact_div(&Dim::constant(o))
    }
}
impl std::ops::Div for Dim {
    type Output = Dim;
    fn div(self, o: Dim) -> Dim {
        self.exact_div(&o)
    }
}

/// Python's `//`: the quotient rounded toward negative infinity for either sign of the
/// divisor (`div_euclid` is that only for a positive one: `7 // -2` is -4, not -3);
/// `None` for a zero divisor or an overflow.
fn floor_div_int(a: i64, b: i64) -> Option<i64> {
    let q = a.checked_div(b)?;
    Some(if a % b != 0 && (a < 0) != (b < 0) {
        q - 1
    } else {
        q
    })
}

fn fmt_atom(a: &Atom, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    match a {
        Atom::Sym(s) => write!(f, "{s}"),
        Atom::Coord(x) => write!(f, "@{x}"),
        Atom::FloorDiv(n, d) => {
            if n.terms.len() > 1 || n.has_division() {
                write!(f, "({n})")?;
            } else {
                write!(f, "{n}")?;
            }
            if d.terms.len() > 1 || !d.is_simple_product() {
                write!(f, "//({d})")
            } else {
                write!(f, "//{d}")
            }
        }
        Atom::Overflow => write!(f, "<overflow>"),
        Atom::PerRank { axis, sizes } => {
            write!(f, "{axis}?[")?;
            for (i, s) in sizes.iter().enumerate() {
                if i > 0 {
                    write!(f, " ")?;
                }
                write!(f, "{s}")?;
            }
            write!(f, "]")
        }
    }
}

impl Dim {
    fn has_division(&self) -> bool {
        self.terms
            .iter()
            .any(|(m, (_, d))| *d != 1 || m.iter().any(|(_, e)| *e < 0))
    }
    fn is_simple_product(&self) -> bool {
        self.terms.len() <= 1 && !self.has_division()
    }
}

/// Writes one term with a positive coefficient magnitude.
fn fmt_term(m: &Monomial, num: i128, den: i128, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let pos: Vec<&(Atom, i32)> = m.iter().filter(|(_, e)| *e > 0).collect();
    let neg: Vec<&(Atom, i32)> = m.iter().filter(|(_, e)| *e < 0).collect();
    let mut first = true;
    if num != 1 || pos.is_empty() {
        write!(f, "{num}")?;
        first = false;
    }
    for (a, e) in pos {
        for _ in 0..*e {
            if !first {
                write!(f, "*")?;
            }
            fmt_atom(a, f)?;
            first = false;
        }
    }
    if den != 1 {
        write!(f, "/{den}")?;
    }
    for (a, e) in neg {
        for _ in 0..(-e) {
            write!(f, "/")?;
            fmt_atom(a, f)?;
        }
    }
    Ok(())
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.terms.is_empty() {
            return write!(f, "0");
        }
        // Constant term last, as people write `S + 1`.
        let mut order: Vec<&(Monomial, (i128, i128))> =
            self.terms.iter().filter(|(m, _)| !m.is_empty()).collect();
        order.extend(self.terms.iter().filter(|(m, _)| m.is_empty()));
        for (i, (m, (n, d))) in order.into_iter().enumerate() {
            if i == 0 {
                if *n < 0 {
                    write!(f, "-")?;
                }
            } else if *n < 0 {
                write!(f, " - ")?;
            } else {
                write!(f, " + ")?;
            }
            fmt_term(m, n.unsigned_abs() as i128, *d, f)?;
        }
        Ok(())
    }
}

impl fmt::Debug for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Dim({self})")
    }
}

impl serde::Serialize for Dim {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> serde::Deserialize<'de> for Dim {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Dim, D::Error> {
        let s = String::deserialize(d)?;
        crate::parse::parse_dim(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s() -> Dim {
        Dim::sym("S")
    }

    /// Floor division rounds toward negative infinity whatever the divisor's sign,
    /// folded and evaluated alike.
    #[test]
    fn floor_division_is_pythons() {
        for (a, b, q) in [
            (7, 2, 3),
            (-7, 2, -4),
            (7, -2, -4),
            (-7, -2, 3),
            (6, -3, -2),
        ] {
            assert_eq!(
                Dim::constant(a).floor_div(&Dim::constant(b)),
                Dim::constant(q)
            );
            let d = s().floor_div(&Dim::constant(b));
            assert_eq!(
                d.eval(&Bindings::new().with("S", a)).unwrap(),
                q,
                "{a}//{b}"
            );
        }
        assert!(s()
            .floor_div(&Dim::constant(-1))
            .eval(&Bindings::new().with("S", i64::MIN))
            .is_err());
    }

    #[test]
    fn canonical_division() {
        assert_eq!((s() / 2) / 2, s() / 4);
        assert_eq!(((s() / 2) / 2).to_string(), "S/4");
        let sp = Dim::sym("sp");
        assert_eq!((s() / sp.clone()).to_string(), "S/sp");
        assert_eq!((s() / sp.clone() * sp.clone()), s());
        assert_eq!((s() / 4 / sp.clone()).to_string(), "S/4/sp");
    }

    #[test]
    fn sums_and_products() {
        let b = Dim::sym("B");
        let d = b.clone() * s() + s() * b.clone();
        assert_eq!(d.to_string(), "2*B*S");
        assert_eq!((s() + 1 - s()).as_const(), Some(1));
        assert_eq!((s() - Dim::from(1)).to_string(), "S - 1");
        assert_eq!((Dim::from(0) - s()).to_string(), "-S");
    }

    #[test]
    fn eval_checks_exactness() {
        let b = Bindings::new().with("S", 10).with("sp", 4);
        let d = s() / Dim::sym("sp");
        assert!(matches!(d.eval(&b), Err(DimError::NotInteger { .. })));
        let b = b.with("S", 12);
        assert_eq!(d.eval(&b), Ok(3));
        assert_eq!(s().floor_div(&Dim::from(5)).eval(&b), Ok(2));
        assert!(matches!(
            s().eval(&Bindings::new()),
            Err(DimError::Unbound(_))
        ));
    }

    #[test]
    fn coords_and_tables() {
        let start = Dim::coord("sp") * (s() / Dim::sym("sp"));
        assert_eq!(start.to_string(), "@sp*S/sp");
        let b = Bindings::new()
            .with("S", 16)
            .with("sp", 4)
            .with_coord("sp", 2);
        assert_eq!(start.eval(&b), Ok(8));
        let t = Dim::per_rank("tp", vec![51, 50]);
        assert_eq!(t.to_string(), "tp?[51 50]");
        assert_eq!(t.eval(&Bindings::new().with_coord("tp", 1)), Ok(50));
        assert_eq!(Dim::per_rank("tp", vec![4, 4]), Dim::from(4));
    }

    #[test]
    fn tables_over_a_group_of_axes() {
        let axes = [("dp".to_string(), 2), ("sp".to_string(), 3)];
        let sizes = [2, 1, 1, 1, 1, 1];
        let d = Dim::per_group_rank(&axes, &sizes).unwrap();
        assert_eq!(d.to_string(), "dp?[0 1] + dp?[1 0]*sp?[2 1 1]");
        for (g, want) in sizes.iter().enumerate() {
            let b = Bindings::new()
                .with_coord("dp", g as i64 / 3)
                .with_coord("sp", g as i64 % 3);
            assert_eq!(d.eval(&b), Ok(*want), "group rank {g}");
        }
        assert_eq!(
            crate::parse::parse_dim(&d.to_string()).unwrap(),
            d,
            "round trip"
        );
        assert_eq!(Dim::per_group_rank(&axes, &[3; 6]), Some(Dim::from(3)));
        assert_eq!(
            Dim::per_group_rank(&axes, &[2, 2, 2, 1, 1, 1]),
            Some(Dim::per_rank("dp", vec![2, 1]))
        );
        assert_eq!(Dim::per_group_rank(&axes, &[1, 2]), None);
        // Three axes: 11 over 2 x 2 x 2 ranks.
        let axes3 = [
            ("dp".to_string(), 2),
            ("sp".to_string(), 2),
            ("cp".to_string(), 2),
        ];
        let sizes = [2, 2, 2, 1, 1, 1, 1, 1];
        let d = Dim::per_group_rank(&axes3, &sizes).unwrap();
        for (g, want) in sizes.iter().enumerate() {
            let g = g as i64;
            let b = Bindings::new()
                .with_coord("dp", g / 4)
                .with_coord("sp", g / 2 % 2)
                .with_coord("cp", g % 2);
            assert_eq!(d.eval(&b), Ok(*want), "{d}: group rank {g}");
        }
    }

    #[test]
    fn substitute_symbol() {
        let d = Dim::sym("B") * s() * 32;
        let r = d.substitute("S", &(s() / Dim::sym("sp")));
        assert_eq!(r.to_string(), "32*B*S/sp");
        assert_eq!(
            s().floor_div(&Dim::from(2)).substitute("S", &Dim::from(9)),
            Dim::from(4)
        );
    }
}
