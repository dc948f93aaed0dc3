//! Matrix products (`matmul`, `bmm`, `mm`) with broadcast batch dims, accumulated in
//! f32 as torch computes a rotary table's `inv_freq @ positions`.

use super::super::fx::FxNode;
use super::{bshape, for_each_index, one, promote, Eval, CT, CV, R};

impl Eval<'_> {
    /// Evaluates one op of this family; `None` for any other op.
    pub(super) fn eval_linear(&mut self, n: &FxNode) -> Option<R<Vec<CV>>> {
        Some(match n.op.as_str() {
            "aten.matmul.default" | "aten.bmm.default" | "aten.mm.default" => self.matmul(n),
            _ => return None,
        })
    }

    fn matmul(&mut self, n: &FxNode) -> R<Vec<CV>> {
        let (x, y) = (self.tensor_at(n, 0)?, self.tensor_at(n, 1)?);
        if x.shape.len() < 2 || y.shape.len() < 2 {
            return Err("matmul of vectors".into());
        }
        let (m, k) = (x.shape[x.shape.len() - 2], x.shape[x.shape.len() - 1]);
        let (k2, nn) = (y.shape[y.shape.len() - 2], y.shape[y.shape.len() - 1]);
        if k != k2 {
            return Err("matmul shapes".into());
        }
        let batch = bshape(&x.shape[..x.shape.len() - 2], &y.shape[..y.shape.len() - 2])?;
        let mut shape = batch.clone();
        shape.extend([m, nn]);
        let mut data = Vec::new();
        for_each_index(&shape, |i| {
            let mut acc = 0f32;
            for kk in 0..k {
                let mut xi = i.to_vec();
                let r = xi.len();
                xi[r - 1] = kk;
                let mut yi = i.to_vec();
                yi[r - 2] = kk;
                acc += (x.get(&xi) as f32) * (y.get(&yi) as f32);
            }
            data.push(acc as f64);
        });
        one(CT {
            shape,
            data,
            kind: promote(x.kind, y.kind),
        })
    }
}
