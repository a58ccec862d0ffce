//! Where a request's KV blocks live on both sides, and how one layer's blocks turn into few
//! writes.
//!
//! vLLM keeps, per layer, a K cache and a V cache of `[num_blocks, block_size_tokens, heads,
//! head_dim]` each (or one joint `[2, num_blocks, ...]` tensor, which is the same thing with
//! V right after K). Block `b` of part `p` (K = 0, V = 1) of layer `l` therefore starts at
//! `base[l][p] + b * block_stride`. A [`KvPlacement`] describes exactly that for one side;
//! a [`KvLayout`] pairs the source (P) and destination (D) placements.
//!
//! [`KvLayout::layer_extents`] turns a layer's `(src, dst)` block lists into [`Extent`]s:
//! runs of blocks contiguous on both sides become one extent per part, and extents adjacent on
//! both sides (e.g. K and V of a block in a `[num_blocks, 2, ...]` layout) merge as well.

use crate::layer::error::LayerError;
use crate::types::{RegionHandle, RegionId};

/// Where the source bytes of a layer live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SrcSpace {
    /// Host memory registered with the engine: posted as is (offsets are region offsets).
    Region(RegionHandle),
    /// Memory the engine cannot send from directly (CUDA device memory), identified by the
    /// stager's id for it; offsets are relative to that memory. Needs a stager.
    Device(u32),
}

/// How a layer's K and V parts are ordered inside one allocation (for [`KvPlacement::packed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvOrder {
    /// `[2, num_blocks, ...]` per layer (vLLM's joint layout, or separate K and V tensors laid
    /// back to back): the whole K plane, then the whole V plane; block stride = block bytes.
    KvMajor,
    /// `[num_blocks, 2, ...]` per layer: K and V of one block side by side; block stride =
    /// 2 × block bytes.
    BlockMajor,
}

/// One side's placement of the KV cache: per layer, per part, `(location, base offset)`, the
/// distance between consecutive blocks, and the number of blocks (block ids are checked
/// against it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvPlacement<L> {
    /// `layers[l][p]` = where part `p` of layer `l` starts.
    pub layers: Vec<Vec<(L, u64)>>,
    /// Bytes from block `b` to block `b + 1` within one part.
    pub block_stride: u64,
    /// Blocks per part; a block id `>= num_blocks` is rejected.
    pub num_blocks: u32,
}

impl<L: Copy> KvPlacement<L> {
    /// All layers packed one after another in one allocation starting at `base`, each layer
    /// holding K and V of `num_blocks` blocks of `block_bytes` in the given order.
    pub fn packed(
        loc: L,
        base: u64,
        num_layers: usize,
        num_blocks: u32,
        block_bytes: u64,
        order: KvOrder,
    ) -> Result<Self, LayerError> {
        let overflow = || LayerError::InvalidArgument("KV placement overflows u64".into());
        let part = block_bytes
            .checked_mul(u64::from(num_blocks))
            .ok_or_else(overflow)?;
        let layer_bytes = part.checked_mul(2).ok_or_else(overflow)?;
        let mut layers = Vec::with_capacity(num_layers);
        for l in 0..num_layers as u64 {
            let b = l
                .checked_mul(layer_bytes)
                .and_then(|x| x.checked_add(base))
                .ok_or_else(overflow)?;
            let v = match order {
                KvOrder::KvMajor => b.checked_add(part),
                KvOrder::BlockMajor => b.checked_add(block_bytes),
            }
            .ok_or_else(overflow)?;
            layers.push(vec![(loc, b), (loc, v)]);
        }
        let block_stride = match order {
            KvOrder::KvMajor => block_bytes,
            KvOrder::BlockMajor => block_bytes.checked_mul(2).ok_or_else(overflow)?,
        };
        Ok(KvPlacement {
            layers,
            block_stride,
            num_blocks,
        })
    }

    /// Bytes one side spans for [`KvPlacement::packed`] (what to allocate).
    pub fn packed_len(num_layers: usize, num_blocks: u32, block_bytes: u64) -> Option<u64> {
        block_bytes
            .checked_mul(u64::from(num_blocks))?
            .checked_mul(2)?
            .checked_mul(num_layers as u64)
    }
}

/// A contiguous copy of `len` bytes from the source to the destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Source memory.
    pub src: SrcSpace,
    /// Offset in the source memory.
    pub src_offset: u64,
    /// Destination region (as the peer offers it).
    pub dst: RegionId,
    /// Offset in the destination region.
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Source and destination placement of one request's KV cache, with the bytes of one block of
/// one part (`block_size_tokens × heads × head_dim × dtype bytes`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    src: KvPlacement<SrcSpace>,
    dst: KvPlacement<RegionId>,
    block_bytes: u64,
}

impl KvLayout {
    /// Pairs the two placements; they must have the same layers and parts per layer, and a
    /// block stride of at least `block_bytes` (blocks must not overlap).
    pub fn new(
        src: KvPlacement<SrcSpace>,
        dst: KvPlacement<RegionId>,
        block_bytes: u64,
    ) -> Result<Self, LayerError> {
        if block_bytes == 0 {
            return Err(LayerError::InvalidArgument("block_bytes is 0".into()));
        }
        if src.layers.len() != dst.layers.len() {
            return Err(LayerError::InvalidArgument(format!(
                "source has {} layers, destination {}",
                src.layers.len(),
                dst.layers.len()
            )));
        }
        for (l, (s, d)) in src.layers.iter().zip(&dst.layers).enumerate() {
            if s.len() != d.len() || s.is_empty() {
                return Err(LayerError::InvalidArgument(format!(
                    "layer {l}: source has {} parts, destination {}",
                    s.len(),
                    d.len()
                )));
            }
        }
        if src.block_stride < block_bytes || dst.block_stride < block_bytes {
            return Err(LayerError::InvalidArgument(format!(
                "block stride (src {}, dst {}) smaller than block bytes {block_bytes}",
                src.block_stride, dst.block_stride
            )));
        }
        Ok(KvLayout {
            src,
            dst,
            block_bytes,
        })
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.src.layers.len()
    }

    /// Bytes of one block of one part.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// The source placement.
    pub fn src(&self) -> &KvPlacement<SrcSpace> {
        &self.src
    }

    /// The destination placement.
    pub fn dst(&self) -> &KvPlacement<RegionId> {
        &self.dst
    }

    /// The coalesced extents of layer `layer` for blocks `src_blocks[i] → dst_blocks[i]`:
    /// block runs contiguous on both sides become one extent per part, then extents adjacent
    /// on both sides merge. Sorted by destination. Block ids are bounds-checked.
    pub fn layer_extents(
        &self,
        layer: usize,
        src_blocks: &[u32],
        dst_blocks: &[u32],
    ) -> Result<Vec<Extent>, LayerError> {
        let (Some(sp), Some(dp)) = (self.src.layers.get(layer), self.dst.layers.get(layer)) else {
            return Err(LayerError::InvalidArgument(format!(
                "layer {layer} out of range ({} layers)",
                self.num_layers()
            )));
        };
        if src_blocks.len() != dst_blocks.len() {
            return Err(LayerError::InvalidArgument(format!(
                "layer {layer}: {} source blocks but {} destination blocks",
                src_blocks.len(),
                dst_blocks.len()
            )));
        }
        for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
            if s >= self.src.num_blocks || d >= self.dst.num_blocks {
                return Err(LayerError::InvalidArgument(format!(
                    "layer {layer}: block {s} -> {d} out of range (source has {}, destination {} blocks)",
                    self.src.num_blocks, self.dst.num_blocks
                )));
            }
        }
        let overflow = || LayerError::InvalidArgument("block offset overflows u64".into());
        let contiguous_src = self.src.block_stride == self.block_bytes;
        let contiguous_dst = self.dst.block_stride == self.block_bytes;
        let mut out = Vec::new();
        for (&(sloc, sbase), &(dloc, dbase)) in sp.iter().zip(dp) {
            let mut i = 0;
            while i < src_blocks.len() {
                // a run: both sides advance by one block
                let mut j = i + 1;
                if contiguous_src && contiguous_dst {
                    while j < src_blocks.len()
                        && src_blocks[j].checked_sub(src_blocks[j - 1]) == Some(1)
                        && dst_blocks[j].checked_sub(dst_blocks[j - 1]) == Some(1)
                    {
                        j += 1;
                    }
                }
                let n = (j - i) as u64;
                let so = u64::from(src_blocks[i])
                    .checked_mul(self.src.block_stride)
                    .and_then(|x| x.checked_add(sbase))
                    .ok_or_else(overflow)?;
                let d_o = u64::from(dst_blocks[i])
                    .checked_mul(self.dst.block_stride)
                    .and_then(|x| x.checked_add(dbase))
                    .ok_or_else(overflow)?;
                out.push(Extent {
                    src: sloc,
                    src_offset: so,
                    dst: dloc,
                    dst_offset: d_o,
                    len: n.checked_mul(self.block_bytes).ok_or_else(overflow)?,
                });
                i = j;
            }
        }
        Ok(coalesce_extents(out))
    }

    /// Extents of every layer (what a whole request sends), for counting writes.
    pub fn request_extents(
        &self,
        src_blocks: &[u32],
        dst_blocks: &[u32],
    ) -> Result<Vec<Vec<Extent>>, LayerError> {
        (0..self.num_layers())
            .map(|l| self.layer_extents(l, src_blocks, dst_blocks))
            .collect()
    }
}

/// Sorts extents by destination and merges those adjacent on both sides (same source memory
/// and destination region, each continuing where the previous one ends). Empty extents are
/// dropped.
pub fn coalesce_extents(mut v: Vec<Extent>) -> Vec<Extent> {
    v.retain(|e| e.len > 0);
    let key = |e: &Extent| (e.dst.index, e.dst.generation, e.dst_offset);
    if !v.windows(2).all(|w| key(&w[0]) <= key(&w[1])) {
        v.sort_by_key(key);
    }
    let mut out: Vec<Extent> = Vec::with_capacity(v.len());
    for e in v {
        if let Some(last) = out.last_mut() {
            if last.src == e.src
                && last.dst == e.dst
                && last.src_offset.checked_add(last.len) == Some(e.src_offset)
                && last.dst_offset.checked_add(last.len) == Some(e.dst_offset)
            {
                if let Some(n) = last.len.checked_add(e.len) {
                    last.len = n;
                    continue;
                }
            }
        }
        out.push(e);
    }
    out
}

/// Synthetic block tables for tests and benches: `n` source blocks drawn from a used pool of
/// `src_pool` blocks (runs of 1..=`max_src_run` contiguous ids at random places, as a pool
/// that has been allocating and freeing for a while hands out), and `n` destination blocks
/// from a fresh pool of `dst_pool` blocks (contiguous, with a gap of a few blocks every
/// `dst_run` blocks on average, as other requests interleave). Deterministic for a `seed`.
/// Ids are unique on each side.
pub fn synthetic_block_tables(
    n: usize,
    src_pool: u32,
    max_src_run: u32,
    dst_pool: u32,
    dst_run: u32,
    seed: u64,
) -> Option<(Vec<u32>, Vec<u32>)> {
    let mut rng = SplitMix(seed);
    let mut used = vec![false; src_pool as usize];
    let mut src = Vec::with_capacity(n);
    let mut guard = 0usize;
    while src.len() < n {
        guard += 1;
        if guard > 64 * n + 1024 {
            return None; // pool too full
        }
        let run = 1 + rng.below(max_src_run.max(1)) as usize;
        let start = rng.below(src_pool.max(1));
        for b in start..(start + run as u32).min(src_pool) {
            if src.len() == n || used[b as usize] {
                break;
            }
            used[b as usize] = true;
            src.push(b);
        }
    }
    let mut dst = Vec::with_capacity(n);
    let mut next = rng.below(4);
    while dst.len() < n {
        if next >= dst_pool {
            return None;
        }
        dst.push(next);
        next += 1;
        if rng.below(dst_run.max(1)) == 0 {
            next += 1 + rng.below(4);
        }
    }
    Some((src, dst))
}

/// A tiny deterministic generator (splitmix64), so the library needs no rand dependency.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u32) -> u32 {
        if n == 0 {
            0
        } else {
            (self.next() % u64::from(n)) as u32
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rid(i: u32) -> RegionId {
        RegionId {
            index: i,
            generation: 1,
        }
    }

    fn layout(order: KvOrder, layers: usize, nb: u32, bb: u64) -> KvLayout {
        let src = KvPlacement::packed(SrcSpace::Device(0), 0, layers, nb, bb, order).unwrap();
        let dst = KvPlacement::packed(rid(3), 0, layers, nb, bb, order).unwrap();
        KvLayout::new(src, dst, bb).unwrap()
    }

    #[test]
    fn contiguous_runs_become_one_extent_per_part() {
        let l = layout(KvOrder::KvMajor, 2, 100, 16);
        let e = l
            .layer_extents(1, &[10, 11, 12, 40], &[0, 1, 2, 3])
            .unwrap();
        // K: [10..13)->[0..3), 40->3 ; V likewise: dst of K run and block 3 are adjacent on
        // dst but not on src, so 4 extents.
        assert_eq!(e.len(), 4);
        let base = 2 * 100 * 16; // layer 1
        assert_eq!(
            e[0],
            Extent {
                src: SrcSpace::Device(0),
                src_offset: base + 10 * 16,
                dst: rid(3),
                dst_offset: base,
                len: 48
            }
        );
        assert_eq!(e[1].src_offset, base + 40 * 16);
        assert_eq!(e[1].dst_offset, base + 3 * 16);
        assert_eq!(e[2].dst_offset, base + 100 * 16); // V plane
        assert_eq!(e.iter().map(|x| x.len).sum::<u64>(), 8 * 16);
    }

    #[test]
    fn block_major_merges_k_and_v() {
        let l = layout(KvOrder::BlockMajor, 1, 100, 16);
        let e = l.layer_extents(0, &[5, 6, 7], &[20, 21, 22]).unwrap();
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].len, 3 * 32);
        assert_eq!(e[0].dst_offset, 20 * 32);
    }

    #[test]
    fn bad_blocks_are_typed_errors() {
        let l = layout(KvOrder::KvMajor, 1, 8, 16);
        assert!(matches!(
            l.layer_extents(0, &[8], &[0]),
            Err(LayerError::InvalidArgument(_))
        ));
        assert!(matches!(
            l.layer_extents(0, &[1], &[0, 1]),
            Err(LayerError::InvalidArgument(_))
        ));
        assert!(matches!(
            l.layer_extents(1, &[1], &[0]),
            Err(LayerError::InvalidArgument(_))
        ));
        assert!(KvPlacement::packed(rid(1), u64::MAX - 10, 2, 8, 16, KvOrder::KvMajor).is_err());
    }

    #[test]
    fn realistic_tables_give_ten_times_fewer_writes() {
        // Qwen3-30B-A3B-like: 48 layers, 16-token blocks; a 20k-token prompt = 1250 blocks.
        let (s, d) = synthetic_block_tables(1250, 20_000, 64, 20_000, 200, 7).unwrap();
        let l = layout(KvOrder::KvMajor, 48, 20_000, 16 * 1024);
        let writes: usize = l
            .request_extents(&s, &d)
            .unwrap()
            .iter()
            .map(Vec::len)
            .sum();
        let naive = 1250 * 48 * 2;
        assert!(writes * 10 <= naive, "writes {writes} vs naive {naive}");
        // and the extents cover exactly the blocks' bytes
        let bytes: u64 = l
            .request_extents(&s, &d)
            .unwrap()
            .iter()
            .flatten()
            .map(|e| e.len)
            .sum();
        assert_eq!(bytes, 1250 * 48 * 2 * 16 * 1024);
    }

    #[test]
    fn synthetic_tables_are_unique() {
        let (s, d) = synthetic_block_tables(500, 2000, 16, 1000, 50, 1).unwrap();
        let mut s2 = s.clone();
        s2.sort_unstable();
        s2.dedup();
        let mut d2 = d.clone();
        d2.sort_unstable();
        d2.dedup();
        assert_eq!((s2.len(), d2.len()), (500, 500));
        assert!(synthetic_block_tables(500, 100, 16, 1000, 50, 1).is_none());
    }
}
