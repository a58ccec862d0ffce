//! [`CtrlWriter`]: the serialized writer of a peer's control connection.
//!
//! Region updates, withdrawals with their fences, shm and RDMA notifications with their fences
//! and the transports' own messages all go out through one writer per peer, each message (or
//! group of messages) in one `write_all` under its lock, so they never interleave.

use std::collections::HashSet;
use std::io::Write;
use std::net::TcpStream;

use parking_lot::Mutex;

use crate::error::Error;
use crate::wire::fence::{EngineMsg, FenceKind};
use crate::wire::CtrlMsg;

/// Serialized writer of a peer's control connection.
pub(crate) struct CtrlWriter {
    s: Mutex<TcpStream>,
    /// Batches whose notification went out and whose delivery the target has not confirmed.
    awaiting: Mutex<HashSet<u64>>,
}

impl CtrlWriter {
    /// A writer of the control connection `s` (a clone of the stream the reader uses).
    pub fn new(s: TcpStream) -> CtrlWriter {
        CtrlWriter {
            s: Mutex::new(s),
            awaiting: Mutex::new(HashSet::new()),
        }
    }

    pub fn send(&self, m: &CtrlMsg) -> Result<(), Error> {
        let buf = m.encode();
        self.s.lock().write_all(&buf)?;
        Ok(())
    }

    /// Writes already encoded messages in one piece (a region withdrawal and its fence).
    pub fn write_encoded(&self, buf: &[u8]) -> std::io::Result<()> {
        self.s.lock().write_all(buf)
    }

    /// Sends the notification of batch `batch` followed by a fence the target answers once it
    /// queued the notification. The caller must leave one part of the batch open: the engine
    /// completes it when the answer arrives (so a completed batch's notification is already
    /// delivered, as over TCP). Transports that notify over the control connection use this.
    pub fn send_notify(&self, batch: u64, tag: Vec<u8>) -> Result<(), Error> {
        let mut buf = CtrlMsg::Notify(tag).encode();
        buf.extend_from_slice(
            &EngineMsg::Fence(FenceKind::Notify, batch)
                .to_ctrl()
                .encode(),
        );
        self.awaiting.lock().insert(batch);
        let r = self.s.lock().write_all(&buf);
        if r.is_err() {
            self.awaiting.lock().remove(&batch);
        }
        Ok(r?)
    }

    /// The target confirmed the notification of `batch`; `false` when none was awaited.
    pub fn confirm(&self, batch: u64) -> bool {
        self.awaiting.lock().remove(&batch)
    }

    /// Forgets every awaited confirmation (the peer is gone).
    pub fn forget_all(&self) {
        self.awaiting.lock().clear();
    }
}
