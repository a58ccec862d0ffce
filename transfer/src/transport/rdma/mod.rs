//! RDMA transport: RC queue pairs over one or several verbs devices per engine, one-sided WRITE
//! and READ.
//!
//! * **Devices**: the engine uses every device it is given
//!   ([`crate::EngineConfig::rdma_devices`], else [`crate::EngineConfig::rdma_device`], else
//!   [`crate::EngineConfig::rdma_device_fallback`], which `EngineConfig::from_env` fills from
//!   `$KVWIRE_RDMA_DEVICE`; the last two may be comma lists) or, when none is named, the active
//!   devices nearest [`crate::EngineConfig::rdma_near`] in the PCI tree (the GPU a vLLM
//!   worker's engine serves), else every device with an active port (in natural name order:
//!   `mlx5_2` before `mlx5_10`). A device is opened **once per process** (`nics`): one context,
//!   PD, CQ with its completion channel, and one completion thread that sleeps on the channel
//!   when idle (a short bounded poll burst first, inside `Cq::wait`), shared by every engine of
//!   the process that uses it; peers have process-wide keys, so a completion reaches its peer
//!   whichever engine it belongs to. See `docs/rdma_hardware_plan.md` for why "all active
//!   devices" is the default without `rdma_near` and when to name devices instead.
//! * **Regions**: every region is registered as an MR on every device when it is added (local
//!   ones with local write only; offered ones with the remote rights their `Access` grants), so
//!   the NIC enforces the region's bounds and rights. The rkey on the first device and the
//!   address travel in the region announcements (`WireRegion::rkey`, `WireRegion::addr`); the
//!   rkeys on the other devices are fetched by the initiator over the control connection the
//!   first time it writes to or reads from the region (a key request and its answer, see
//!   `wire::rdma`); until they arrive, that region's slices use the queue pairs that reach the
//!   remote's first device. The MR holds the region memory alive; an in-flight work request
//!   holds its MR alive. A region longer than a device's `max_mr_size` (or
//!   [`crate::EngineConfig::rdma_mr_chunk`]) is registered in chunks, each its own MR: the
//!   announcement carries the chunk length and the first device's rkey of every chunk
//!   (`WireRegion::chunks`), key answers every device's of every chunk, and slices are cut at
//!   the chunk boundaries of both ends (a piece's lkey is its chunk's).
//! * **Device pairs**: the handshake blob lists our devices (port, GID index, MTU, link class)
//!   and `lanes` fresh RC QPs per device, keyed by a random nonce. Both sides compute the same
//!   pairing of local and remote devices (the side with the smaller nonce's device order
//!   decides; device *i* is matched with the first unmatched remote device of the same link
//!   class, starting at index *i*, so equally ordered rails pair rail to rail), and connect
//!   lane *i* of each pair to the peer's lane *i* of the same pair. Lanes are numbered
//!   interleaved over the pairs (lane 0 on pair 0, lane 1 on pair 1, …) so that round-robin
//!   striping alternates devices. Unclaimed QPs expire. Both sides connect their QPs whenever
//!   both offered RDMA, whatever each chose for its own direction (the other may write into us).
//! * **Posting**: each coalesced transfer is cut into slices of at most the peer's slice size
//!   (`cfg.slice_size` at first; `slice` doubles it, up to
//!   [`crate::EngineConfig::rdma_slice_max`], while doubling raises the rate of the peer's
//!   large batches by 10%, i.e. while the per-WR cost rather than the wire limits it; a
//!   smaller batch is cut into one slice per lane, never below `cfg.slice_size`);
//!   consecutive slices from one local region bound for consecutive remote bytes are gathered
//!   into one work request with a scatter-gather list (`wr`: at most
//!   [`crate::EngineConfig::rdma_max_sge`] pieces, default 16, and the slice size in bytes), so KV
//!   blocks scattered in P's cache and bound for a run of D's blocks cost one WR per 16, not
//!   one each. Work requests are striped round-robin over the healthy lanes (of every device
//!   pair) whose remote device key is known; each lane posts its WRs as one chain, at most the
//!   QP's send depth outstanding (the rest waits in the lane's backlog, posted by the
//!   completion thread as slots free).
//!   Every READ, one WRITE in [`crate::EngineConfig::rdma_signal_every`] (default 16) and the
//!   last WR of every chain are signalled (`signal_plan`); a signalled WR's *successful*
//!   completion also completes the unsignalled WRs before it on its QP (RC completes in order;
//!   failed and flushed WRs always report). When the signalled WR fails or is flushed, the
//!   unsignalled WRs it covers that are still on that QP are not inferred done: they are posted
//!   again like flushed ones (`covered_outcome`; WRITE and READ are idempotent). A completion is
//!   accepted only from the QP its WR is posted on now (`completion_is_current`); one from a QP
//!   the WR left is ignored.
//! * **Completion threads**: one per device per process; after a round that reaped completions, while WRs
//!   are on the NIC, the CQ is polled for up to [`crate::EngineConfig::rdma_poll`] (default 0:
//!   off) before the thread arms it and sleeps on the completion channel (never polled while
//!   idle).
//! * **Completion**: when every WR of a batch completed, its notification (if any) is sent over
//!   the control connection (so it always follows the data) with the engine's fence, and the
//!   batch completes when the target confirms it queued the notification; without one, at once.
//! * **Errors**: a failed WR breaks its lane (the QP is moved to the error state, so its other
//!   WRs flush); flushed WRs of other batches are re-posted on a healthy lane, possibly of
//!   another device pair (bounded retries); the failing batch gets a typed error
//!   (`AccessDenied` for a remote access/bounds violation found by the NIC). A WR the peer did
//!   not answer (transport retries exhausted) is retried on another lane like a flushed one;
//!   when its retries run out the batch fails with `PeerDead`. When every lane is broken the
//!   peer is declared dead (the engine fails its in-flight batches; reconnect to recover).
//! * **Provider-failed queue pairs**: a flush from a QP the engine did not move to the error
//!   state, with no error completion before it, means the provider failed a WR without saying
//!   so. SoftRoCE (Linux 6.1) does this when a READ's response stream is interrupted by packet
//!   drops (a NAK mid-sequence): it reports that READ *successful*, though its data never
//!   landed, and errors the QP. So the WR a lane's QP reported successful last is kept while
//!   its batch is in flight, and posted again on such a flush (`repost_suspect`); the batch
//!   cannot complete before it completes again. If the failed READ was the last WR on its QP
//!   and its batch completed, nothing shows it until the next post there (then logged).
//!
//! Modules, each depending only on the ones listed before it:
//! * `devices`: the devices ([`Dev`](devices::Dev)), their queue pairs, which devices to open
//!   (named, nearest a PCI device, or all), device pairing;
//! * `mrs`: a region's memory registrations on every device;
//! * `signal`: the selective-signalling plan and its completion rules;
//! * `slice`: the slice size of a peer's WRs, adapted to what limits its rate;
//! * `wr`: a work request's scatter-gather list, and slices gathered into one request;
//! * `state`: the transport's shared state and a peer's lanes and work requests;
//! * `lane`: posting, breaking lanes, re-routing, asking to reconnect;
//! * `completion`: completions (re-posting, failing or finishing batches);
//! * `keys`: remote keys on further devices;
//! * `ctrl`: the peer's reconnection messages;
//! * `post`: the per-peer data path (`PeerTransport` for `RdmaPeer`);
//! * `nics`: the devices of the process, each opened once and shared by its engines, their
//!   completion threads, and the process-wide peer keys those threads route by;
//! * `transport`: [`RdmaTransport`] (open, handshake blobs, regions, `establish`).

mod completion;
mod ctrl;
mod devices;
mod keys;
mod lane;
mod mrs;
mod nics;
mod post;
mod signal;
mod slice;
mod state;
mod transport;
mod wr;

pub(crate) use transport::RdmaTransport;
