//! The host block pool of the simulator's engines and of the step loops.

use kvwire_connector::BlockId;

/// A pool of blocks `0..size`: a free list. An allocation takes the tail of the list, in
/// ascending order, so a fresh pool hands out runs of adjacent ids (as a fresh vLLM pool
/// does); a release puts the blocks back so that the next allocation of the same size gets
/// them again.
#[derive(Clone, Debug)]
pub struct BlockPool {
    free: Vec<BlockId>,
}

impl BlockPool {
    /// A pool with every one of `size` blocks free.
    pub fn new(size: u32) -> Self {
        BlockPool {
            free: (0..size).rev().collect(),
        }
    }

    /// Takes `n` blocks, or none when fewer are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<BlockId>> {
        let at = self.free.len().checked_sub(n)?;
        let mut blocks = self.free.split_off(at);
        blocks.reverse();
        Some(blocks)
    }

    /// Gives `blocks` back.
    pub fn release(&mut self, blocks: &[BlockId]) {
        self.free.extend(blocks.iter().rev());
    }

    /// Blocks free.
    pub fn free(&self) -> usize {
        self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::BlockPool;

    #[test]
    fn adjacent_runs_and_reuse() {
        let mut p = BlockPool::new(8);
        assert_eq!(p.alloc(3), Some(vec![0, 1, 2]));
        assert_eq!(p.alloc(2), Some(vec![3, 4]));
        assert_eq!(p.alloc(4), None, "only 3 left");
        p.release(&[0, 1, 2]);
        assert_eq!(p.free(), 6);
        assert_eq!(p.alloc(3), Some(vec![0, 1, 2]));
        assert_eq!(p.alloc(0), Some(vec![]));
    }
}
