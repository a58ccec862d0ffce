//! kvwire-verbs-loopback: a software RDMA device inside one process, built as a shared library
//! that exports the libibverbs entry points kvwire loads (`KVWIRE_IBVERBS_PATH` names it).
//!
//! What it is for: running the engine's whole RDMA path — device pairing, memory registration,
//! queue pairs, the signalling plan, the completion thread, lane repair — on a machine without
//! a NIC, in the ordinary test run, and measuring the CPU that path costs per work request with
//! nothing of a NIC's own cost in it (`kvwire-bench wr-cost`). It is not a transport: every
//! peer must be in this process (a queue pair's remote end is found by its number in this
//! library's tables), which is where tests and the bench put both engines.
//!
//! Semantics, as an RC queue pair on a real NIC shows them to its user:
//! * a work request executes when it is posted (the bytes move in `ibv_post_send`), in order;
//! * every local scatter entry is checked against the region its `lkey` names, and the remote
//!   range against the region of the `rkey` and its access flags; a violation completes with
//!   `LOC_PROT_ERR` / `REM_ACCESS_ERR` and moves the queue pair (and, for a remote violation,
//!   the responder's) to the error state;
//! * a queue pair whose remote end is gone or not ready completes with `RETRY_EXC_ERR`;
//! * on a queue pair in the error state every request completes with `WR_FLUSH_ERR`, signalled
//!   or not; errors are reported whatever the signalling; a success only when signalled;
//! * WRITE_WITH_IMM consumes a receive posted on the responder (none: `RNR_RETRY_EXC_ERR`);
//! * a completion queue with a completion channel raises one event per arming.
//!
//! Devices: `KVWIRE_LOOPBACK_DEVICES` (default 1) named `loop0`, `loop1`, ...; one port each,
//! active, InfiniBand link layer (LID = index + 1), GID `fe80::<guid>`. Setting
//! `KVWIRE_LOOPBACK_NOCOPY=1` (or `kvwire_loopback_copy(0)`) checks every request as above but
//! moves no byte, for measuring the posting path alone; `kvwire_loopback_hold` holds requests
//! in flight until a test releases them.
//!
//! Modules: `device` (the device list, port and GID queries), `context` (device contexts and
//! their operations table), `memory` (protection
//! domains, memory regions), `cq` (completion channels and queues), `qp` (queue pairs, their
//! states, receives), `send` (send requests: checked, held or executed, completed; the
//! hold, copy and counter controls), `state` (the tables every entry point shares).
//!
//! Every entry point takes raw pointers from its caller, as libibverbs does: all of this crate
//! is the verbs boundary, and each `unsafe` block says what the caller guarantees.

mod context;
mod cq;
mod device;
mod memory;
mod qp;
mod send;
mod state;

/// Environment variable: how many devices the library lists.
pub const DEVICES_ENV: &str = "KVWIRE_LOOPBACK_DEVICES";
/// Environment variable: `1` = check every request but move no byte.
pub const NOCOPY_ENV: &str = "KVWIRE_LOOPBACK_NOCOPY";
/// Largest memory region a device registers, in bytes (`ibv_query_device`'s `max_mr_size`;
/// `ibv_reg_mr` refuses a longer one with `EINVAL`); unset or not a number: 2^46.
pub const MAX_MR_ENV: &str = "KVWIRE_LOOPBACK_MAX_MR";

/// Scatter entries per request the device accepts.
const MAX_SGE: usize = 16;
