//! The peer's RDMA control messages: queue pair re-establishment (both sides may ask at once;
//! the larger nonce wins) and the dispatch of key messages.

use std::sync::atomic::Ordering;

use super::state::{PeerShared, WR_TRACE};
use crate::error::Error;
use crate::wire::rdma::{LaneOp, RdmaMsg};
use crate::wire::ProtocolError;

impl PeerShared {
    pub(super) fn on_msg(&self, d: &[u8]) -> Result<(), Error> {
        let (op, lane, nonce, ep) = match RdmaMsg::decode(d, self.lanes.len(), self.remote_devs)? {
            RdmaMsg::KeysReq(ids) => return self.on_keys_req(&ids),
            RdmaMsg::Keys { entries, .. } => {
                self.on_keys(entries);
                return Ok(());
            }
            RdmaMsg::Lane {
                op,
                lane,
                nonce,
                ep,
            } => (op, lane, nonce, ep),
        };
        if self.closed() {
            return Ok(());
        }
        match op {
            LaneOp::Reconnect => {
                let mut st = self.lanes[lane].st.lock();
                if let Some((_, _, mine)) = &st.pending {
                    if *mine > nonce {
                        return Ok(()); // both asked: the larger nonce wins, the peer answers ours
                    }
                }
                st.pending = None;
                let made = self.new_qp(lane).and_then(|(qp, psn, my_ep)| {
                    self.connect_qp(lane, &qp, psn, ep).map(|()| (qp, my_ep))
                });
                let (qp, my_ep) = match made {
                    Ok(x) => x,
                    Err(e) => {
                        // The peer's lane stays broken; its batches go to the other lanes.
                        tracing::warn!(lane, error = %e, "cannot re-establish a queue pair");
                        return Ok(());
                    }
                };
                st.last_ok = None;
                let old = std::mem::replace(&mut st.qp, qp);
                let _ = old.set_error(); // whatever was posted on it flushes and is re-posted
                st.outstanding = 0;
                st.broken = false;
                if let Err(e) = self.pump(lane, &mut st) {
                    tracing::warn!(lane, error = %e, "rdma post failed; lane broken");
                    self.break_lane(lane, &mut st);
                }
                drop(st);
                self.lanes[lane]
                    .reestablished
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(target: WR_TRACE, lane, "rdma lane re-established (peer's request)");
                self.send_msg(LaneOp::ReconnectAck, lane, nonce, &my_ep)
            }
            LaneOp::ReconnectAck => {
                let mut st = self.lanes[lane].st.lock();
                let Some((qp, psn, mine)) = st.pending.take() else {
                    return Ok(()); // stale answer
                };
                if mine != nonce {
                    st.pending = Some((qp, psn, mine));
                    return Ok(());
                }
                if let Err(e) = self.connect_qp(lane, &qp, psn, ep) {
                    tracing::warn!(lane, error = %e, "cannot re-establish a queue pair");
                    return Ok(());
                }
                st.qp = qp;
                st.last_ok = None;
                st.outstanding = 0;
                st.broken = false;
                if let Err(e) = self.pump(lane, &mut st) {
                    tracing::warn!(lane, error = %e, "rdma post failed; lane broken");
                    self.break_lane(lane, &mut st);
                }
                self.lanes[lane]
                    .reestablished
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(target: WR_TRACE, lane, "rdma lane re-established");
                Ok(())
            }
            LaneOp::Unknown(op) => Err(ProtocolError::UnknownRdmaOp { op }.into()),
        }
    }
}
