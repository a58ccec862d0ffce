//! Shared-memory transport for peers on the same host (same boot id, pid and mount namespace).
//!
//! Engine-allocated target regions are memfds: the initiator opens the target's fd through
//! `/proc/<pid>/fd/<n>`, checks that it is the announced memfd (inode and size), maps it and
//! copies with `memcpy`. Raw-registered target regions (caller memory) are reached with
//! `process_vm_writev`/`process_vm_readv`. Both need ptrace-level permission over the target
//! (same user; Yama's ptrace_scope permitting), which is the protection here: bounds, generation
//! and access are checked by the initiator only, since the target's CPU is not involved. Only
//! offered regions are announced; a stale announcement cannot redirect a write into another file
//! because the inode is verified after opening.
//!
//! Notifications go over the control connection after the copy, so they arrive after the data.
//! Copies of up to [`INLINE_MAX`] bytes run on the submitting thread (the batch is complete when
//! `write` returns); larger ones on the engine's copy thread.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crossbeam_channel::Sender;
use parking_lot::Mutex;

use super::{Dir, PeerTransport, Posted, Xfer};
use crate::batch::{BatchState, BatchStats, Pending};
use crate::config::TransportKind;
use crate::engine::CtrlWriter;
use crate::error::Error;
use crate::mem::{cma_copy, RegionMem};
use crate::region::RegionId;
use crate::wire::{CtrlMsg, WireRegion};

/// Batches up to this many bytes are copied by the submitting thread.
pub(crate) const INLINE_MAX: u64 = 1 << 20;

/// A job for the engine's copy thread.
pub(crate) type CopyJob = Box<dyn FnOnce() + Send>;

struct Shared {
    pid: i32,
    maps: Mutex<HashMap<RegionId, Option<Arc<RegionMem>>>>,
    ctrl: Arc<CtrlWriter>,
    closed: AtomicBool,
}

/// Per-peer shm state.
pub(crate) struct ShmPeer {
    sh: Arc<Shared>,
    worker: Sender<CopyJob>,
}

impl ShmPeer {
    pub fn new(pid: u32, ctrl: Arc<CtrlWriter>, worker: Sender<CopyJob>) -> ShmPeer {
        ShmPeer {
            sh: Arc::new(Shared {
                pid: pid as i32,
                maps: Mutex::new(HashMap::new()),
                ctrl,
                closed: AtomicBool::new(false),
            }),
            worker,
        }
    }
}

impl Shared {
    /// The mapping of a remote memfd region, or `None` when it must be reached with CMA.
    fn mapping(&self, r: &WireRegion) -> Option<Arc<RegionMem>> {
        if r.fd < 0 {
            return None;
        }
        let mut m = self.maps.lock();
        if let Some(v) = m.get(&r.id) {
            return v.clone();
        }
        let mapped = self.open_map(r);
        if let Err(e) = &mapped {
            tracing::debug!(region = ?r.id, error = %e, "cannot map peer memfd; using process_vm_*");
        }
        let v = mapped.ok().map(Arc::new);
        m.insert(r.id, v.clone());
        v
    }

    fn open_map(&self, r: &WireRegion) -> Result<RegionMem, Error> {
        let path = format!("/proc/{}/fd/{}", self.pid, r.fd);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)?;
        let md = f.metadata()?;
        if md.ino() != r.ino {
            return Err(Error::Protocol(format!(
                "{path} is not the announced memfd"
            )));
        }
        let len = usize::try_from(r.len)
            .map_err(|_| Error::InvalidArgument("region too large".into()))?;
        Ok(RegionMem::map_fd(f.as_fd(), len)?)
    }

    fn copy(&self, dir: Dir, x: &Xfer) -> Result<(), Error> {
        let len =
            usize::try_from(x.len).map_err(|_| Error::InvalidArgument("op too large".into()))?;
        match self.mapping(&x.remote) {
            Some(map) => match dir {
                Dir::Write => RegionMem::copy_between(
                    &x.local.mem,
                    x.local_offset,
                    &map,
                    x.remote_offset,
                    len,
                )?,
                Dir::Read => RegionMem::copy_between(
                    &map,
                    x.remote_offset,
                    &x.local.mem,
                    x.local_offset,
                    len,
                )?,
            },
            None => {
                let addr = x
                    .remote
                    .addr
                    .checked_add(x.remote_offset)
                    .ok_or_else(|| Error::InvalidArgument("remote address overflow".into()))?;
                cma_copy(
                    self.pid,
                    &x.local.mem,
                    x.local_offset,
                    addr,
                    len,
                    dir == Dir::Write,
                )
                .map_err(|e| {
                    if e.raw_os_error() == Some(libc::ESRCH) {
                        Error::PeerDead("peer process is gone".into())
                    } else {
                        Error::Io(e)
                    }
                })?
            }
        }
        Ok(())
    }

    fn run(&self, st: &BatchState, dir: Dir, xfers: &[Xfer], notify: Option<Vec<u8>>) {
        if self.closed.load(Ordering::Acquire) {
            st.fail(Error::PeerDead("peer closed".into()));
            return;
        }
        for x in xfers {
            if st.is_done() {
                return; // timed out or failed meanwhile
            }
            if let Err(e) = self.copy(dir, x) {
                st.fail(e);
                return;
            }
        }
        if let Some(tag) = notify {
            if let Err(e) = self.ctrl.send(&CtrlMsg::Notify(tag)) {
                st.fail(Error::PeerDead(format!("sending notification: {e}")));
                return;
            }
        }
        st.part_done();
    }
}

impl PeerTransport for ShmPeer {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn post(&self, b: Posted, pending: &Arc<Pending>) -> Result<Arc<BatchState>, Error> {
        let stats = BatchStats {
            bytes: b.bytes,
            ops: b.ops,
            writes: b.xfers.len(),
            slices: b.xfers.len(),
            transport: TransportKind::Shm,
        };
        let st = BatchState::new(b.id, 1, stats, b.deadline, Vec::new(), &b.timer).posted_as(&b);
        pending.insert(&st)?;
        if b.bytes <= INLINE_MAX {
            self.sh.run(&st, b.dir, &b.xfers, b.notify);
        } else {
            let (sh, st2) = (self.sh.clone(), st.clone());
            let (dir, xfers, notify) = (b.dir, b.xfers, b.notify);
            self.worker
                .send(Box::new(move || sh.run(&st2, dir, &xfers, notify)))
                .map_err(|_| Error::Shutdown)?;
        }
        Ok(st)
    }

    fn regions_removed(&self, ids: &[RegionId]) {
        let mut m = self.sh.maps.lock();
        for id in ids {
            m.remove(id);
        }
    }

    fn close(&self) {
        self.sh.closed.store(true, Ordering::Release);
        self.sh.maps.lock().clear();
    }
}
