//! Shape changes: `view`/`reshape`, `unsqueeze`, `squeeze`, `expand` (materialised), and
//! the dim permutations `transpose`, `permute`, `t`.

use super::super::fx::FxNode;
use super::{for_each_index, norm, numel, one, strides, Eval, CT, CV, MAX_ELEMS, R};

impl Eval<'_> {
    /// Evaluates one op of this family; `None` for any other op.
    pub(super) fn eval_layout(&mut self, n: &FxNode) -> Option<R<Vec<CV>>> {
        Some(match n.op.as_str() {
            "aten.view.default" | "aten.reshape.default" | "aten._unsafe_view.default" => {
                self.view(n)
            }
            "aten.unsqueeze.default" => self.unsqueeze(n),
            "aten.squeeze.dim" | "aten.squeeze.dims" | "aten.squeeze.default" => self.squeeze(n),
            "aten.expand.default" => self.expand(n),
            "aten.transpose.int" | "aten.permute.default" | "aten.t.default" => self.permute(n),
            _ => return None,
        })
    }

    fn view(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let x = self.tensor_at(n, 0)?;
        let want = self.ints_arg(n.arg_at(1))?;
        let known: i64 = want.iter().filter(|&&d| d >= 0).product();
        let total = numel(&x.shape) as i64;
        let shape: Vec<usize> = want
            .iter()
            .map(|&d| {
                if d < 0 {
                    (if known == 0 { 0 } else { total / known }) as usize
                } else {
                    d as usize
                }
            })
            .collect();
        if numel(&shape) != numel(&x.shape) {
            return Err(format!("view {:?} -> {shape:?}", x.shape));
        }
        one(CT { shape, ..x })
    }

    fn unsqueeze(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let mut x = self.tensor_at(n, 0)?;
        let d = self.int_arg(n.arg_at(1))?;
        let d = norm(d, x.shape.len() + 1)?;
        x.shape.insert(d, 1);
        one(x)
    }

    fn squeeze(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let mut x = self.tensor_at(n, 0)?;
        let r = x.shape.len();
        let dims: Vec<usize> = match n.op.as_str() {
            "aten.squeeze.default" => (0..r).collect(),
            _ => self
                .ints_arg(n.arg_at(1))?
                .into_iter()
                .map(|d| norm(d, r))
                .collect::<R<_>>()?,
        };
        let mut keep = Vec::new();
        for (i, &s) in x.shape.iter().enumerate() {
            if !(dims.contains(&i) && s == 1) {
                keep.push(s);
            }
        }
        x.shape = keep;
        one(x)
    }

    fn expand(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let x = self.tensor_at(n, 0)?;
        let want = self.ints_arg(n.arg_at(1))?;
        if want.len() < x.shape.len() {
            return Err("expand to fewer dims".into());
        }
        let off = want.len() - x.shape.len();
        let mut shape = Vec::with_capacity(want.len());
        for (i, &d) in want.iter().enumerate() {
            let src = if i >= off {
                Some(x.shape[i - off])
            } else {
                None
            };
            let v = match (d < 0, src) {
                (true, Some(s)) => s,
                (true, None) => return Err("expand with -1 in a new dim".into()),
                (false, _) => d as usize,
            };
            if let Some(s) = src {
                if s != 1 && s != v {
                    return Err(format!("cannot expand {s} to {v}"));
                }
            }
            shape.push(v);
        }
        let mut data = Vec::new();
        if numel(&shape) > MAX_ELEMS {
            return Err("too large".into());
        }
        for_each_index(&shape, |i| data.push(x.get(i)));
        one(CT {
            shape,
            data,
            kind: x.kind,
        })
    }

    /// `permute`, and `transpose`/`t` as the permutation that swaps two dims.
    fn permute(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let x = self.tensor_at(n, 0)?;
        let r = x.shape.len();
        let perm: Vec<usize> = match n.base() {
            "permute" => self
                .ints_arg(n.arg_at(1))?
                .into_iter()
                .map(|d| norm(d, r))
                .collect::<R<_>>()?,
            _ => {
                let (d0, d1) = if n.base() == "t" {
                    (0, 1)
                } else {
                    (
                        norm(self.int_arg(n.arg_at(1))?, r)?,
                        norm(self.int_arg(n.arg_at(2))?, r)?,
                    )
                };
                let mut p: Vec<usize> = (0..r).collect();
                p.swap(d0, d1);
                p
            }
        };
        let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
        let st = strides(&x.shape);
        let mut data = Vec::new();
        for_each_index(&shape, |i| {
            let off: usize = i.iter().zip(&perm).map(|(&k, &p)| k * st[p]).sum();
            data.push(x.data[off]);
        });
        one(CT {
            shape,
            data,
            kind: x.kind,
        })
    }
}
