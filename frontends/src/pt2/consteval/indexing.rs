//! Picking and joining along dims: `slice`, `select`, `cat`, and advanced `index` by
//! integer tensors; with the helpers `take`, `check_cat` and `concat` that `diff`
//! (in `reductions.rs`) shares.

use super::super::fx::FxNode;
use super::super::schema::Arg;
use super::{bshape, for_each_index, norm, numel, one, promote, Eval, Kind, CT, CV, MAX_ELEMS, R};

impl Eval<'_> {
    /// Evaluates one op of this family; `None` for any other op.
    pub(super) fn eval_indexing(&mut self, n: &FxNode) -> Option<R<Vec<CV>>> {
        Some(match n.op.as_str() {
            "aten.slice.Tensor" => self.slice(n),
            "aten.select.int" => self.select(n),
            "aten.cat.default" => self.cat(n),
            "aten.index.Tensor" => self.index_tensor(n),
            _ => return None,
        })
    }

    fn slice(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let x = self.tensor_at(n, 0)?;
        let r = x.shape.len();
        let d = norm(self.int_arg(n.arg_at(1))?, r)?;
        let len = x.shape[d] as i64;
        let fix = |v: i64| -> i64 {
            let v = if v < 0 { v + len } else { v };
            v.clamp(0, len)
        };
        let s = match n.arg_at(2) {
            Arg::None => 0,
            o => fix(self.int_arg(o)?),
        };
        let e = match n.arg_at(3) {
            Arg::None => len,
            o => fix(self.int_arg(o)?),
        };
        let step = self.int_arg(n.arg_at(4))?.max(1);
        let picks: Vec<usize> = (s..e.max(s))
            .step_by(step as usize)
            .map(|v| v as usize)
            .collect();
        one(take(&x, d, &picks))
    }

    fn select(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let x = self.tensor_at(n, 0)?;
        let d = norm(self.int_arg(n.arg_at(1))?, x.shape.len())?;
        let mut i = self.int_arg(n.arg_at(2))?;
        if i < 0 {
            i += x.shape[d] as i64;
        }
        if i < 0 || i as usize >= x.shape[d] {
            return Err("select index out of range".into());
        }
        let mut r = take(&x, d, &[i.max(0) as usize]);
        r.shape.remove(d);
        one(r)
    }

    fn cat(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let Arg::Tensors(names) = n.arg_at(0) else {
            return Err("cat of a non-list".into());
        };
        let parts: Vec<CT> = names
            .iter()
            .map(|nm| self.tensor_arg(&Arg::Tensor(nm.clone())))
            .collect::<R<_>>()?;
        // torch.cat skips 1-d empty parts whatever the other parts' rank.
        let parts: Vec<CT> = parts
            .into_iter()
            .filter(|p| !(p.shape.len() == 1 && p.shape[0] == 0))
            .collect();
        let first = parts.first().ok_or("empty cat")?.clone();
        let d = norm(self.int_arg(n.arg_at(1))?, first.shape.len())?;
        check_cat(&parts, d)?;
        let mut shape = first.shape.clone();
        shape[d] = parts.iter().map(|p| p.shape[d]).sum();
        let mut data = Vec::new();
        let kind = parts.iter().fold(first.kind, |k, p| promote(k, p.kind));
        for_each_index(&shape, |i| {
            let mut k = i[d];
            for p in &parts {
                if k < p.shape[d] {
                    let mut j = i.to_vec();
                    j[d] = k;
                    data.push(p.get(&j));
                    break;
                }
                k -= p.shape[d];
            }
        });
        one(CT { shape, data, kind })
    }

    fn index_tensor(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let x = self.tensor_at(n, 0)?;
        match n.arg_at(1) {
            Arg::OptionalTensors(idx) => self.index(&x, idx),
            Arg::Tensors(v) => {
                let idx: Vec<Option<String>> = v.iter().cloned().map(Some).collect();
                self.index(&x, &idx)
            }
            _ => Err("index without indices".into()),
        }
    }

    /// `x[i0, i1, ...]` for integer index tensors over the leading dims (no `None`s).
    fn index(&mut self, x: &CT, idx: &[Option<String>]) -> R<Vec<CV>> {
        if idx.iter().any(Option::is_none) || idx.len() > x.shape.len() {
            return Err("index with None entries".into());
        }
        let its: Vec<CT> = idx
            .iter()
            .map(|n| self.tensor_arg(&Arg::Tensor(n.clone().unwrap())))
            .collect::<R<_>>()?;
        let mut b: Vec<usize> = vec![];
        for i in &its {
            b = bshape(&b, &i.shape)?;
        }
        let k = its.len();
        let mut shape = b.clone();
        shape.extend_from_slice(&x.shape[k..]);
        if numel(&shape) > MAX_ELEMS {
            return Err("too large".into());
        }
        let mut data = Vec::new();
        let mut err = None;
        for_each_index(&shape, |i| {
            let mut j: Vec<usize> = Vec::with_capacity(x.shape.len());
            for (d, it) in its.iter().enumerate() {
                let mut v = it.get(&i[..b.len()]) as i64;
                if v < 0 {
                    v += x.shape[d] as i64;
                }
                if v < 0 || v as usize >= x.shape[d] {
                    err = Some("index out of range".to_string());
                    v = 0;
                }
                j.push(v as usize);
            }
            j.extend_from_slice(&i[b.len()..]);
            data.push(x.get(&j));
        });
        if let Some(e) = err {
            return Err(e);
        }
        Ok(vec![CV::T(CT {
            shape,
            data,
            kind: x.kind,
        })])
    }
}

/// The entries of `x` at positions `picks` along dim `d`.
pub(super) fn take(x: &CT, d: usize, picks: &[usize]) -> CT {
    let mut shape = x.shape.clone();
    shape[d] = picks.len();
    let mut data = Vec::new();
    for_each_index(&shape, |i| {
        let mut j = i.to_vec();
        j[d] = picks[i[d]];
        data.push(x.get(&j));
    });
    CT {
        shape,
        data,
        kind: x.kind,
    }
}

/// Refuses parts whose ranks, or sizes outside dim `d`, differ.
pub(super) fn check_cat(parts: &[CT], d: usize) -> R<()> {
    let r = parts[0].shape.len();
    for p in parts {
        if p.shape.len() != r || (0..r).any(|k| k != d && p.shape[k] != parts[0].shape[k]) {
            return Err("cat of mismatched shapes".into());
        }
    }
    Ok(())
}

/// `parts` joined along dim `d` (shapes checked by [`check_cat`]).
pub(super) fn concat(parts: &[CT], d: usize) -> R<CT> {
    let mut shape = parts[0].shape.clone();
    shape[d] = parts.iter().map(|p| p.shape[d]).sum();
    let mut data = Vec::new();
    for_each_index(&shape, |i| {
        let mut k = i[d];
        for p in parts {
            if k < p.shape[d] {
                let mut j = i.to_vec();
                j[d] = k;
                data.push(p.get(&j));
                break;
            }
            k -= p.shape[d];
        }
    });
    Ok(CT {
        shape,
        data,
        kind: parts.iter().fold(Kind::Bool, |k, p| promote(k, p.kind)),
    })
}
