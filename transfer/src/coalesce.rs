//! Coalescing: ops adjacent on both sides become one write.

use crate::types::Op;

/// Merges ops that are adjacent on both sides (same local and remote region, and
/// `local_offset + len == next.local_offset`, `remote_offset + len == next.remote_offset`),
/// after sorting by (remote region, remote offset). Zero-length ops are dropped.
pub fn coalesce(ops: &[Op]) -> Vec<Op> {
    let mut v: Vec<Op> = ops.iter().copied().filter(|o| o.len > 0).collect();
    // Already sorted is the common case (KV blocks in order); skip the sort then.
    let sorted = v.windows(2).all(|w| {
        (
            w[0].remote.index,
            w[0].remote.generation,
            w[0].remote_offset,
        ) <= (
            w[1].remote.index,
            w[1].remote.generation,
            w[1].remote_offset,
        )
    });
    if !sorted {
        v.sort_by_key(|o| (o.remote.index, o.remote.generation, o.remote_offset));
    }
    let mut out: Vec<Op> = Vec::with_capacity(v.len());
    for op in v {
        if let Some(last) = out.last_mut() {
            if last.local == op.local
                && last.remote == op.remote
                && last.local_offset.checked_add(last.len) == Some(op.local_offset)
                && last.remote_offset.checked_add(last.len) == Some(op.remote_offset)
            {
                if let Some(n) = last.len.checked_add(op.len) {
                    last.len = n;
                    continue;
                }
            }
        }
        out.push(op);
    }
    out
}
