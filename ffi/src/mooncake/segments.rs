//! Peers' segments (Mooncake's name for a peer's registered memory): the connection to each
//! peer and its address map, read over kvwire itself and refreshed when it went stale.

use std::time::Duration;

use kvwire_transfer::{Access, Error, Op, Peer, RegionId};
use parking_lot::RwLock;
use std::sync::Arc;

use super::addrmap::{lookup, parse_entries, parse_header, MapEntry, ENTRY, HEADER, META_LEN};
use super::inner::{Inner, MError};
use crate::engine::resolve_addr;

/// 1 ms polls waiting for the peer's region announcements to catch up with its address map.
const REGION_SYNC_POLLS: usize = 2000;
/// Snapshot attempts before giving up on a peer's address map (it is being rewritten).
const META_RETRIES: usize = 50;

/// A peer we transfer to, with its address map.
pub(super) struct Remote {
    pub(super) peer: Peer,
    pub(super) map: RwLock<Vec<MapEntry>>,
}

impl Inner {
    /// The peer named `host:port`, connected on first use (or after it died).
    pub(super) fn remote(&self, target: &str) -> Result<Arc<Remote>, MError> {
        if let Some(r) = self.remotes.lock().get(target) {
            if r.peer.is_alive() {
                return Ok(r.clone());
            }
        }
        let addr = resolve_addr(target).map_err(MError::Other)?;
        let peer = self.engine.connect(addr)?;
        let r = Arc::new(Remote {
            peer,
            map: RwLock::new(Vec::new()),
        });
        r.map.write().clone_from(&self.fetch_map(&r.peer)?);
        self.remotes.lock().insert(target.to_string(), r.clone());
        Ok(r)
    }

    /// Reads the peer's address map, then waits (bounded) until the engine's view of the
    /// peer's regions includes every region the map names: the map and the region
    /// announcements travel separately, so a buffer the peer registered just now may be in
    /// its map before its announcement reached us.
    pub(super) fn fetch_map(&self, peer: &Peer) -> Result<Vec<MapEntry>, MError> {
        let map = self.read_map(peer)?;
        for _ in 0..REGION_SYNC_POLLS {
            let known: std::collections::HashSet<RegionId> =
                peer.regions().into_iter().map(|r| r.id).collect();
            if map.iter().all(|e| known.contains(&e.id)) || !peer.is_alive() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(map)
    }

    /// Reads a consistent snapshot of the peer's address map.
    pub(super) fn read_map(&self, peer: &Peer) -> Result<Vec<MapEntry>, MError> {
        let meta = peer
            .regions()
            .into_iter()
            .find(|r| r.access == Access::ReadOnly && r.len == META_LEN as u64)
            .ok_or_else(|| {
                MError::Other(
                    "peer offers no kvwire address map (not a kvwire mooncake engine?)".into(),
                )
            })?;
        let mut scratch = self.scratch.lock();
        let s = match *scratch {
            Some(s) => s,
            None => {
                let s = self.engine.alloc_region(META_LEN, Access::Local)?;
                *scratch = Some(s);
                s
            }
        };
        let read = |len: u64| -> Result<Vec<u8>, MError> {
            let op = Op {
                local: s,
                local_offset: 0,
                remote: meta.id,
                remote_offset: 0,
                len,
            };
            self.engine.read(peer, &[op], Some(self.timeout))?.wait()?;
            let mut out = vec![0u8; len as usize];
            self.engine.local_read(s, 0, &mut out)?;
            Ok(out)
        };
        for _ in 0..META_RETRIES {
            let (seq, count) = parse_header(&read(HEADER as u64)?).map_err(MError::Other)?;
            if seq % 2 == 1 {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            let all = read((HEADER + count * ENTRY) as u64)?;
            let (seq2, count2) = parse_header(&all).map_err(MError::Other)?;
            let (seq3, _) = parse_header(&read(HEADER as u64)?).map_err(MError::Other)?;
            if seq2 == seq && seq3 == seq && count2 == count {
                return parse_entries(&all[HEADER..], count).map_err(MError::Other);
            }
        }
        Err(MError::Engine(Error::Timeout))
    }

    /// Maps a peer address range to `(region id, offset)`, refreshing the map once on a miss.
    pub(super) fn remote_op(
        &self,
        r: &Remote,
        addr: u64,
        len: u64,
    ) -> Result<(RegionId, u64), MError> {
        if let Some((e, off)) = lookup(&r.map.read(), addr, len) {
            return Ok((e.id, off));
        }
        let fresh = self.fetch_map(&r.peer)?;
        let found = lookup(&fresh, addr, len);
        *r.map.write() = fresh;
        found.map(|(e, off)| (e.id, off)).ok_or_else(|| {
            MError::Engine(Error::InvalidArgument(format!(
                "peer address {addr:#x}+{len} is not inside a buffer the peer registered"
            )))
        })
    }
}
