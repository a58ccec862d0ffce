//! Remote keys on further devices: the peer's rkeys per device (and per chunk of a region
//! registered in chunks), asked for the first time a region is used and cached; our answers to
//! the peer's requests.

use std::sync::Arc;

use super::state::PeerShared;
use crate::error::Error;
use crate::types::RegionId;
use crate::wire::rdma::{keys_entry_len, RdmaMsg, KEYS_REQ_PER_MSG, KEYS_ROOM};

/// Remote key entries kept per peer (beyond: the table is cleared and refilled on demand).
const MAX_KEYS: usize = 1 << 16;

impl PeerShared {
    /// The region's rkey per remote device for its chunk `chunk` (0 unless it is registered
    /// in chunks): index 0 from the announcement (`first`), the others from the key table (0 =
    /// not known yet; asked for once).
    pub(super) fn rkeys_for(
        &self,
        id: RegionId,
        chunk: usize,
        first: u32,
        ask: &mut Vec<RegionId>,
    ) -> Arc<[u32]> {
        if self.remote_devs <= 1 {
            return Arc::from(vec![first]);
        }
        if let Some(k) = self.keys.read().get(&id).and_then(|k| k.get(chunk)) {
            if k.first() == Some(&first) {
                return k.clone();
            }
            let mut v = k.to_vec();
            v[0] = first;
            return Arc::from(v);
        }
        if self.lanes.iter().any(|l| l.rdev != 0) {
            let mut asked = self.asked.lock();
            if asked.len() >= MAX_KEYS {
                asked.clear();
            }
            if asked.insert(id) {
                ask.push(id);
            }
        }
        let mut v = vec![0u32; self.remote_devs];
        v[0] = first;
        Arc::from(v)
    }

    /// Asks the peer for the rkeys of its regions on every device.
    pub(super) fn request_keys(&self, ids: &[RegionId]) {
        for chunk in ids.chunks(KEYS_REQ_PER_MSG) {
            let sent = self.ctrl.send(&RdmaMsg::KeysReq(chunk.to_vec()).to_ctrl());
            if let Err(e) = sent {
                tracing::debug!(error = %e, "rdma key request not sent");
                let mut asked = self.asked.lock();
                for id in chunk {
                    asked.remove(id);
                }
            }
        }
    }

    /// The peer asks for our rkeys of some regions: answer with every device's key of every
    /// chunk (zeros for a region that is not offered), in as many messages as they take.
    pub(super) fn on_keys_req(&self, ids: &[RegionId]) -> Result<(), Error> {
        let Some(t) = self.tr.upgrade() else {
            return Ok(());
        };
        let ndev = t.devs.len();
        let entries: Vec<(RegionId, Vec<u32>)> = {
            let mrs = t.mrs.read();
            ids.iter()
                .map(|id| {
                    let set = mrs.get(id).filter(|m| m.offered);
                    let chunks = set.map_or(1, |m| m.mrs.chunks_on(0).len().max(1));
                    let keys = (0..chunks)
                        .flat_map(|c| (0..ndev).map(move |d| (c, d)))
                        .map(|(c, d)| set.and_then(|m| m.mrs.get(d, c)).map_or(0, |mr| mr.rkey()))
                        .collect();
                    (*id, keys)
                })
                .collect()
        };
        let mut batch: Vec<(RegionId, Vec<u32>)> = Vec::new();
        let mut room = KEYS_ROOM;
        for e in entries {
            let len = keys_entry_len(e.1.len());
            if len > room || batch.len() == usize::from(u16::MAX) {
                self.send_keys(ndev, std::mem::take(&mut batch))?;
                room = KEYS_ROOM;
            }
            room -= len;
            batch.push(e);
        }
        if !batch.is_empty() {
            self.send_keys(ndev, batch)?;
        }
        Ok(())
    }

    fn send_keys(&self, ndev: usize, entries: Vec<(RegionId, Vec<u32>)>) -> Result<(), Error> {
        let m = RdmaMsg::Keys {
            ndev: ndev as u8,
            entries,
        };
        self.ctrl.send(&m.to_ctrl())
    }

    /// The peer's rkeys for some of its regions (per chunk, one per device). Only regions we
    /// asked for are kept: a peer cannot fill the table with keys nobody will use.
    pub(super) fn on_keys(&self, entries: Vec<(RegionId, Vec<u32>)>) {
        let ndev = self.remote_devs.max(1);
        let mut keys = self.keys.write();
        for (id, v) in entries {
            if !self.asked.lock().contains(&id) {
                continue;
            }
            if v.iter().all(|k| *k == 0) {
                keys.remove(&id);
                continue;
            }
            if keys.len() >= MAX_KEYS && !keys.contains_key(&id) {
                keys.clear();
                self.asked.lock().clear();
            }
            let chunks: Vec<Arc<[u32]>> = v.chunks(ndev).map(Arc::from).collect();
            keys.insert(id, Arc::from(chunks));
        }
    }

    /// The peer withdrew regions: forget their keys.
    pub(super) fn forget_keys(&self, ids: &[RegionId]) {
        let mut keys = self.keys.write();
        let mut asked = self.asked.lock();
        for id in ids {
            keys.remove(id);
            asked.remove(id);
        }
    }
}
