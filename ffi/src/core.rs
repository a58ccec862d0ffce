//! The P/D connector core ([`kvwire_connector`]) for Python: `DCore` (decode side) and `PCore`
//! (prefill side). Sans-IO like the core itself: Python feeds events with a timestamp
//! (`time.monotonic_ns()`), drains actions with `poll_actions()`, and carries them out (sends
//! the encoded messages over kvwire, tells vLLM what finished or failed).
//!
//! Actions are tuples whose first item names them:
//! * D: `("send", peer, bytes)`, `("may_reserve", req, blocks)`, `("release", req, [blocks])`,
//!   `("finished", req)`, `("failed", req, [blocks], reason)`, `("disconnect", peer)`;
//! * P: `("send", peer, bytes)`, `("transfer", req, peer, layer, [src], [dst])`,
//!   `("cancel", req)`, `("release", req, [blocks])`, `("finished", req)`,
//!   `("failed", req, reason)`, `("disconnect", peer)`.
//!
//! Refused events raise `kvwire.ConnectorError` and change nothing.

use kvwire_connector::{
    DAction, DConfig, DEvent, DSide, Message, PAction, PConfig, PEvent, PSide, PeerId, Policy,
    RequestId, SendMode,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::errors::{invalid, ConnectorError};

fn encode(py: Python<'_>, m: &Message) -> PyResult<Py<PyAny>> {
    let b = m
        .encode()
        .map_err(|e| ConnectorError::new_err(format!("cannot encode message: {e}")))?;
    Ok(PyBytes::new(py, &b).into_any().unbind())
}

fn tuple<'py>(py: Python<'py>, items: Vec<Bound<'py, PyAny>>) -> PyResult<Py<PyAny>> {
    Ok(PyTuple::new(py, items)?.into_any().unbind())
}

macro_rules! obj {
    ($py:expr, $v:expr) => {
        $v.into_pyobject($py)?.into_any()
    };
}

/// Applies the timeouts given as keyword seconds to a config field.
fn secs_to_ns(s: f64) -> PyResult<u64> {
    if !(s.is_finite() && s >= 0.0) {
        return Err(invalid(format!("timeout must be >= 0 seconds, got {s}")));
    }
    Ok((s * 1e9) as u64)
}

/// Decode-side core: when to reserve (policy `eager`, `lazy`, `jit`), block ids to P, layers
/// landing, finished/failed reports, reservations released exactly once.
#[pyclass(module = "kvwire", name = "DCore")]
pub struct DCore {
    core: DSide,
}

impl DCore {
    fn ev(&mut self, ev: DEvent, now: u64) -> PyResult<()> {
        self.core
            .handle(ev, now)
            .map_err(|e| ConnectorError::new_err(e.to_string()))
    }
}

#[pymethods]
impl DCore {
    /// `DCore(policy="lazy", layers, transport="tcp", incarnation=1, peer_timeout=None,
    /// wait_for_p_timeout=None, request_timeout=None, drain_timeout=None)` (timeouts in s).
    #[new]
    #[pyo3(signature = (policy, layers, transport="tcp", incarnation=1, peer_timeout=None, wait_for_p_timeout=None, request_timeout=None, drain_timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        policy: &str,
        layers: u16,
        transport: &str,
        incarnation: u64,
        peer_timeout: Option<f64>,
        wait_for_p_timeout: Option<f64>,
        request_timeout: Option<f64>,
        drain_timeout: Option<f64>,
    ) -> PyResult<Self> {
        let policy = match policy {
            "eager" => Policy::Eager,
            "lazy" => Policy::Lazy,
            "jit" => Policy::Jit,
            p => return Err(invalid(format!("unknown policy {p:?} (eager, lazy, jit)"))),
        };
        if layers == 0 {
            return Err(invalid("layers must be >= 1"));
        }
        let mut cfg = DConfig::new(policy, layers);
        cfg.transport = transport.to_string();
        cfg.incarnation = incarnation;
        if let Some(s) = peer_timeout {
            cfg.peer_timeout = secs_to_ns(s)?;
        }
        if let Some(s) = wait_for_p_timeout {
            cfg.wait_for_p_timeout = secs_to_ns(s)?;
        }
        if let Some(s) = request_timeout {
            cfg.request_timeout = secs_to_ns(s)?;
        }
        if let Some(s) = drain_timeout {
            cfg.drain_timeout = secs_to_ns(s)?;
        }
        Ok(DCore {
            core: DSide::new(cfg),
        })
    }

    /// A request arrived on D (`tokens` to receive into `blocks` blocks) from P `peer`.
    fn arrived(&mut self, req: u64, peer: u32, tokens: u32, blocks: u32, now: u64) -> PyResult<()> {
        let ev = DEvent::Arrived {
            req: RequestId(req),
            peer: PeerId(peer),
            tokens,
            blocks,
        };
        self.ev(ev, now)
    }
    /// The host reserved these blocks (after `may_reserve`).
    fn reserved(&mut self, req: u64, blocks: Vec<u32>, now: u64) -> PyResult<()> {
        self.ev(
            DEvent::Reserved {
                req: RequestId(req),
                blocks,
            },
            now,
        )
    }
    /// A layer landed (local engine notification).
    fn layer_landed(&mut self, req: u64, layer: u16, bytes: u64, now: u64) -> PyResult<()> {
        self.ev(
            DEvent::LayerLanded {
                req: RequestId(req),
                layer,
                bytes,
            },
            now,
        )
    }
    /// The host reported the request finished to its scheduler.
    fn reported(&mut self, req: u64, now: u64) -> PyResult<()> {
        self.ev(
            DEvent::Reported {
                req: RequestId(req),
            },
            now,
        )
    }
    /// The scheduler promoted the request.
    fn promoted(&mut self, req: u64, now: u64) -> PyResult<()> {
        self.ev(
            DEvent::Promoted {
                req: RequestId(req),
            },
            now,
        )
    }
    /// The request produced its first token.
    fn first_token(&mut self, req: u64, now: u64) -> PyResult<()> {
        self.ev(
            DEvent::FirstToken {
                req: RequestId(req),
            },
            now,
        )
    }
    /// The host aborts the request.
    fn abort(&mut self, req: u64, now: u64) -> PyResult<()> {
        self.ev(
            DEvent::Abort {
                req: RequestId(req),
            },
            now,
        )
    }
    /// Bytes of a message from P (undecodable bytes raise and change nothing).
    fn message(&mut self, peer: u32, data: &[u8], now: u64) -> PyResult<()> {
        self.core
            .handle_bytes(PeerId(peer), data, now)
            .map_err(|e| ConnectorError::new_err(e.to_string()))
    }
    /// The transport connected to P `peer`.
    fn peer_up(&mut self, peer: u32, now: u64) -> PyResult<()> {
        self.ev(DEvent::PeerUp { peer: PeerId(peer) }, now)
    }
    /// The transport lost P `peer`.
    fn peer_down(&mut self, peer: u32, now: u64) -> PyResult<()> {
        self.ev(DEvent::PeerDown { peer: PeerId(peer) }, now)
    }
    /// Handles deadlines due at `now`.
    fn handle_timeout(&mut self, now: u64) {
        self.core.handle_timeout(now)
    }
    /// When `handle_timeout` is due next (ns), or None.
    fn poll_timeout(&self) -> Option<u64> {
        self.core.poll_timeout()
    }
    /// Whether the host may reserve for `req` now (O(1)).
    fn may_reserve(&self, req: u64) -> bool {
        self.core.may_reserve(RequestId(req))
    }
    /// Blocks reserved for `req`.
    fn reserved_blocks(&self, req: u64) -> Vec<u32> {
        self.core.reserved_blocks(RequestId(req)).to_vec()
    }
    /// Requests tracked.
    #[getter]
    fn live_requests(&self) -> usize {
        self.core.live_requests()
    }
    /// Drains the pending actions.
    fn poll_actions(&mut self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        let mut out = Vec::new();
        while let Some(a) = self.core.poll_action() {
            out.push(match a {
                DAction::Send { to, msg } => tuple(
                    py,
                    vec![
                        obj!(py, "send"),
                        obj!(py, to.0),
                        encode(py, &msg)?.into_bound(py),
                    ],
                )?,
                DAction::MayReserve { req, blocks } => tuple(
                    py,
                    vec![obj!(py, "may_reserve"), obj!(py, req.0), obj!(py, blocks)],
                )?,
                DAction::ReleaseBlocks { req, blocks } => tuple(
                    py,
                    vec![obj!(py, "release"), obj!(py, req.0), obj!(py, blocks)],
                )?,
                DAction::ReportFinished { req } => {
                    tuple(py, vec![obj!(py, "finished"), obj!(py, req.0)])?
                }
                DAction::ReportFailed {
                    req,
                    blocks,
                    reason,
                } => tuple(
                    py,
                    vec![
                        obj!(py, "failed"),
                        obj!(py, req.0),
                        obj!(py, blocks),
                        obj!(py, kvwire_connector::metrics::fail_reason_name(reason)),
                    ],
                )?,
                DAction::DisconnectPeer { peer } => {
                    tuple(py, vec![obj!(py, "disconnect"), obj!(py, peer.0)])?
                }
            });
        }
        Ok(out)
    }
    /// Drains finished timeline records as JSON lines.
    fn poll_timeline(&mut self) -> Vec<String> {
        std::iter::from_fn(|| self.core.poll_timeline())
            .map(|r| r.to_json_line())
            .collect()
    }
    /// Cumulative metrics and, as of `now` (ns, the same clock as the events), requests by
    /// state and the blocks their reservations hold: a dict (see `docs/metrics.md`).
    fn metrics<'py>(&self, py: Python<'py>, now: u64) -> PyResult<Bound<'py, PyDict>> {
        crate::core_metrics::d_dict(py, self.core.metrics(), &self.core.gauges(now))
    }
}

/// Prefill-side core: layers held until D's block ids arrive, sent layerwise or whole, P's
/// blocks released exactly once.
#[pyclass(module = "kvwire", name = "PCore")]
pub struct PCore {
    core: PSide,
}

impl PCore {
    fn ev(&mut self, ev: PEvent, now: u64) -> PyResult<()> {
        self.core
            .handle(ev, now)
            .map_err(|e| ConnectorError::new_err(e.to_string()))
    }
}

#[pymethods]
impl PCore {
    /// `PCore(send_mode="whole"|"layerwise", layers, transport="tcp", incarnation=1,
    /// peer_timeout=None, request_timeout=None, block_ids_timeout=None, drain_timeout=None)`.
    #[new]
    #[pyo3(signature = (send_mode, layers, transport="tcp", incarnation=1, peer_timeout=None, request_timeout=None, block_ids_timeout=None, drain_timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        send_mode: &str,
        layers: u16,
        transport: &str,
        incarnation: u64,
        peer_timeout: Option<f64>,
        request_timeout: Option<f64>,
        block_ids_timeout: Option<f64>,
        drain_timeout: Option<f64>,
    ) -> PyResult<Self> {
        let mode = match send_mode {
            "whole" => SendMode::Whole,
            "layerwise" => SendMode::Layerwise,
            m => {
                return Err(invalid(format!(
                    "unknown send mode {m:?} (whole, layerwise)"
                )))
            }
        };
        if layers == 0 {
            return Err(invalid("layers must be >= 1"));
        }
        let mut cfg = PConfig::new(mode, layers);
        cfg.transport = transport.to_string();
        cfg.incarnation = incarnation;
        if let Some(s) = peer_timeout {
            cfg.peer_timeout = secs_to_ns(s)?;
        }
        if let Some(s) = request_timeout {
            cfg.request_timeout = secs_to_ns(s)?;
        }
        if let Some(s) = block_ids_timeout {
            cfg.block_ids_timeout = secs_to_ns(s)?;
        }
        if let Some(s) = drain_timeout {
            cfg.drain_timeout = secs_to_ns(s)?;
        }
        Ok(PCore {
            core: PSide::new(cfg),
        })
    }

    /// P scheduled the request; `blocks` hold its KV, for D `peer`.
    fn scheduled(
        &mut self,
        req: u64,
        peer: u32,
        tokens: u32,
        blocks: Vec<u32>,
        now: u64,
    ) -> PyResult<()> {
        let ev = PEvent::Scheduled {
            req: RequestId(req),
            peer: PeerId(peer),
            tokens,
            blocks,
        };
        self.ev(ev, now)
    }
    /// Layer `layer` is computed.
    fn layer_ready(&mut self, req: u64, layer: u16, now: u64) -> PyResult<()> {
        self.ev(
            PEvent::LayerReady {
                req: RequestId(req),
                layer,
            },
            now,
        )
    }
    /// Prefill finished.
    fn prefill_done(&mut self, req: u64, now: u64) -> PyResult<()> {
        self.ev(
            PEvent::PrefillDone {
                req: RequestId(req),
            },
            now,
        )
    }
    /// A layer's transfer completed.
    fn transfer_done(&mut self, req: u64, layer: u16, bytes: u64, now: u64) -> PyResult<()> {
        self.ev(
            PEvent::TransferDone {
                req: RequestId(req),
                layer,
                bytes,
            },
            now,
        )
    }
    /// A layer's transfer failed.
    fn transfer_failed(&mut self, req: u64, layer: u16, now: u64) -> PyResult<()> {
        self.ev(
            PEvent::TransferFailed {
                req: RequestId(req),
                layer,
            },
            now,
        )
    }
    /// The host aborts the request.
    fn abort(&mut self, req: u64, now: u64) -> PyResult<()> {
        self.ev(
            PEvent::Abort {
                req: RequestId(req),
            },
            now,
        )
    }
    /// Bytes of a message from D.
    fn message(&mut self, peer: u32, data: &[u8], now: u64) -> PyResult<()> {
        self.core
            .handle_bytes(PeerId(peer), data, now)
            .map_err(|e| ConnectorError::new_err(e.to_string()))
    }
    /// The transport connected to D `peer`.
    fn peer_up(&mut self, peer: u32, now: u64) -> PyResult<()> {
        self.ev(PEvent::PeerUp { peer: PeerId(peer) }, now)
    }
    /// The transport lost D `peer`.
    fn peer_down(&mut self, peer: u32, now: u64) -> PyResult<()> {
        self.ev(PEvent::PeerDown { peer: PeerId(peer) }, now)
    }
    /// Handles deadlines due at `now`.
    fn handle_timeout(&mut self, now: u64) {
        self.core.handle_timeout(now)
    }
    /// When `handle_timeout` is due next (ns), or None.
    fn poll_timeout(&self) -> Option<u64> {
        self.core.poll_timeout()
    }
    /// Whether D's block ids for `req` are known.
    fn has_destination(&self, req: u64) -> bool {
        self.core.has_destination(RequestId(req))
    }
    /// Requests tracked.
    #[getter]
    fn live_requests(&self) -> usize {
        self.core.live_requests()
    }
    /// Drains the pending actions.
    fn poll_actions(&mut self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        let mut out = Vec::new();
        while let Some(a) = self.core.poll_action() {
            out.push(match a {
                PAction::Send { to, msg } => tuple(
                    py,
                    vec![
                        obj!(py, "send"),
                        obj!(py, to.0),
                        encode(py, &msg)?.into_bound(py),
                    ],
                )?,
                PAction::Transfer {
                    req,
                    peer,
                    layer,
                    src,
                    dst,
                } => tuple(
                    py,
                    vec![
                        obj!(py, "transfer"),
                        obj!(py, req.0),
                        obj!(py, peer.0),
                        obj!(py, layer),
                        obj!(py, src.to_vec()),
                        obj!(py, dst.to_vec()),
                    ],
                )?,
                PAction::CancelTransfers { req } => {
                    tuple(py, vec![obj!(py, "cancel"), obj!(py, req.0)])?
                }
                PAction::ReleaseBlocks { req, blocks } => tuple(
                    py,
                    vec![obj!(py, "release"), obj!(py, req.0), obj!(py, blocks)],
                )?,
                PAction::ReportFinished { req } => {
                    tuple(py, vec![obj!(py, "finished"), obj!(py, req.0)])?
                }
                PAction::ReportFailed { req, reason } => tuple(
                    py,
                    vec![
                        obj!(py, "failed"),
                        obj!(py, req.0),
                        obj!(py, kvwire_connector::metrics::fail_reason_name(reason)),
                    ],
                )?,
                PAction::DisconnectPeer { peer } => {
                    tuple(py, vec![obj!(py, "disconnect"), obj!(py, peer.0)])?
                }
            });
        }
        Ok(out)
    }
    /// Drains finished timeline records as JSON lines.
    fn poll_timeline(&mut self) -> Vec<String> {
        std::iter::from_fn(|| self.core.poll_timeline())
            .map(|r| r.to_json_line())
            .collect()
    }
    /// Cumulative metrics: a dict (see `docs/metrics.md`).
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        crate::core_metrics::p_dict(py, self.core.metrics())
    }
}

/// Adds the connector-core classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DCore>()?;
    m.add_class::<PCore>()?;
    m.add(
        "CONNECTOR_BUCKET_BOUNDS",
        crate::core_metrics::bucket_bounds(),
    )?;
    Ok(())
}
