//! Non-negative least squares (Lawson–Hanson) on the normal equations of the fit's
//! [`NF`] features.

pub(super) const NF: usize = 10;

/// Solves `G x = h` restricted to the indices in `idx` (Gaussian elimination with partial
/// pivoting); `None` when the restricted system is (numerically) singular.
pub(super) fn solve_sub(g: &[[f64; NF]; NF], h: &[f64; NF], idx: &[usize]) -> Option<[f64; NF]> {
    let k = idx.len();
    let mut a = vec![vec![0.0; k + 1]; k];
    let mut scale: f64 = 0.0;
    for (r, &i) in idx.iter().enumerate() {
        for (c, &j) in idx.iter().enumerate() {
            a[r][c] = g[i][j];
        }
        a[r][k] = h[i];
        scale = scale.max(g[i][i].abs());
    }
    for col in 0..k {
        let piv = (col..k).max_by(|&x, &y| a[x][col].abs().total_cmp(&a[y][col].abs()))?;
        if a[piv][col].abs() <= 1e-12 * scale.max(f64::MIN_POSITIVE) {
            return None;
        }
        a.swap(col, piv);
        let (upper, lower) = a.split_at_mut(col + 1);
        let pivot_row = &upper[col];
        for row in lower.iter_mut() {
            let f = row[col] / pivot_row[col];
            for (v, p) in row.iter_mut().zip(pivot_row).skip(col) {
                *v -= f * p;
            }
        }
    }
    let mut x = [0.0; NF];
    for r in (0..k).rev() {
        let mut v = a[r][k];
        for c in r + 1..k {
            v -= a[r][c] * x[idx[c]];
        }
        x[idx[r]] = v / a[r][r];
    }
    Some(x)
}

/// Non-negative least squares `min ‖A x − b‖, x ≥ 0` from the normal equations `G = AᵀA`,
/// `h = Aᵀb` (Lawson–Hanson active set). Variables with `allowed[j] == false` stay zero.
pub(super) fn nnls(g: &[[f64; NF]; NF], h: &[f64; NF], allowed: &[bool; NF]) -> [f64; NF] {
    let mut x = [0.0; NF];
    let mut passive = [false; NF];
    let mut banned = [false; NF];
    let tol = 1e-12 * h.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-300);
    for _outer in 0..(3 * NF + 10) {
        let mut w = [0.0; NF];
        for j in 0..NF {
            w[j] = h[j] - (0..NF).map(|k| g[j][k] * x[k]).sum::<f64>();
        }
        let cand = (0..NF)
            .filter(|&j| allowed[j] && !passive[j] && !banned[j] && w[j] > tol)
            .max_by(|&a, &b| w[a].total_cmp(&w[b]));
        let Some(t) = cand else { break };
        passive[t] = true;
        for _inner in 0..(3 * NF + 10) {
            let idx: Vec<usize> = (0..NF).filter(|&j| passive[j]).collect();
            let Some(z) = solve_sub(g, h, &idx) else {
                // The new column is collinear with the passive ones: it adds nothing.
                passive[t] = false;
                banned[t] = true;
                break;
            };
            if idx.iter().all(|&j| z[j] > 0.0) {
                x = z;
                break;
            }
            let mut alpha = f64::INFINITY;
            for &j in &idx {
                if z[j] <= 0.0 {
                    let d = x[j] - z[j];
                    if d > 0.0 {
                        alpha = alpha.min(x[j] / d);
                    } else {
                        alpha = 0.0;
                    }
                }
            }
            if !alpha.is_finite() {
                alpha = 0.0;
            }
            for &j in &idx {
                x[j] += alpha * (z[j] - x[j]);
                if x[j] <= 1e-15 * (1.0 + z[j].abs()) && z[j] <= 0.0 {
                    x[j] = 0.0;
                    passive[j] = false;
                }
            }
            if !passive[t] {
                break;
            }
        }
    }
    for v in x.iter_mut() {
        if !v.is_finite() || *v < 0.0 {
            *v = 0.0;
        }
    }
    x
}
