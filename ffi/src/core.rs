//! The P/D connector core ([`kvwire_connector`]) for Python: `DCore` (decode side) and `PCore`
//! (prefill side). Sans-IO like the core itself: Python feeds events with a timestamp
//! (`time.monotonic_ns()`), drains actions with `poll_actions()`, and carries them out (sends
//! the encoded messages over kvwire, tells vLLM what finished or failed).
//!
//! Actions are typed objects ([`crate::core_actions`], `kvwire.core`): D `Send`, `MayReserve`,
//! `MayLand`, `ReleaseBlocks`, `ReleaseLanding`, `ReportFinished`, `ReportFailed`,
//! `DisconnectPeer`; P `Send`, `Transfer`, `Destination`, `CancelTransfers`, `ReleaseBlocks`,
//! `ReportFinished`, `ReportFailed`, `DisconnectPeer`.
//!
//! Every timeout of the cores' configurations can be set (keyword arguments, in seconds).
//! Refused events raise `kvwire.ConnectorError` and change nothing.

use kvwire_connector::{
    DConfig, DEvent, DSide, PConfig, PEvent, PSide, PeerId, Policy, RequestId, SendMode,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::core_actions::{d_action, p_action};
use crate::errors::{invalid, ConnectorError};

/// Seconds (a keyword argument) as nanoseconds.
fn secs_to_ns(s: f64) -> PyResult<u64> {
    if !(s.is_finite() && s >= 0.0) {
        return Err(invalid(format!("timeout must be >= 0 seconds, got {s}")));
    }
    Ok((s * 1e9) as u64)
}

/// Decode-side core: when to reserve (policy `eager`, `lazy`, `jit`, `land`), block ids to P, layers
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
    /// `DCore(policy, layers, transport="tcp", incarnation=1, *, heartbeat_interval=None,
    /// peer_timeout=None, wait_for_p_timeout=None, request_timeout=None, drain_timeout=None,
    /// orphan_timeout=None, tombstone_ttl=None)`: policy `eager`, `lazy`, `jit` or `land`;
    /// timeouts in seconds (None: the core's default).
    #[new]
    #[pyo3(signature = (policy, layers, transport="tcp", incarnation=1, *, heartbeat_interval=None, peer_timeout=None, wait_for_p_timeout=None, request_timeout=None, drain_timeout=None, orphan_timeout=None, tombstone_ttl=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        policy: &str,
        layers: u16,
        transport: &str,
        incarnation: u64,
        heartbeat_interval: Option<f64>,
        peer_timeout: Option<f64>,
        wait_for_p_timeout: Option<f64>,
        request_timeout: Option<f64>,
        drain_timeout: Option<f64>,
        orphan_timeout: Option<f64>,
        tombstone_ttl: Option<f64>,
    ) -> PyResult<Self> {
        let policy: Policy = policy.parse().map_err(|_| {
            invalid(format!(
                "unknown policy {policy:?} (eager, lazy, jit, land)"
            ))
        })?;
        if layers == 0 {
            return Err(invalid("layers must be >= 1"));
        }
        let mut cfg = DConfig::new(policy, layers);
        cfg.transport = transport.to_string();
        cfg.incarnation = incarnation;
        for (v, field) in [
            (heartbeat_interval, &mut cfg.heartbeat_interval),
            (peer_timeout, &mut cfg.peer_timeout),
            (wait_for_p_timeout, &mut cfg.wait_for_p_timeout),
            (request_timeout, &mut cfg.request_timeout),
            (drain_timeout, &mut cfg.drain_timeout),
            (orphan_timeout, &mut cfg.orphan_timeout),
            (tombstone_ttl, &mut cfg.tombstone_ttl),
        ] {
            if let Some(s) = v {
                *field = secs_to_ns(s)?;
            }
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
        let req = RequestId(req);
        self.ev(DEvent::Reserved { req, blocks }, now)
    }
    /// D already holds the request's first `blocks` blocks (prefix-cache hit): the
    /// reservation and what P sends cover the others. Before `reserved`/`landing`.
    fn prefix_hit(&mut self, req: u64, blocks: u32, now: u64) -> PyResult<()> {
        let req = RequestId(req);
        self.ev(DEvent::PrefixHit { req, blocks }, now)
    }
    /// Policy `land`: the request took these landing-pool slots (after `MayLand`).
    fn landing(&mut self, req: u64, slots: Vec<u32>, now: u64) -> PyResult<()> {
        let req = RequestId(req);
        self.ev(DEvent::Landing { req, slots }, now)
    }
    /// Policy `land`: the landing pool cannot take the request; it goes `lazy`.
    fn land_fallback(&mut self, req: u64, now: u64) -> PyResult<()> {
        let req = RequestId(req);
        self.ev(DEvent::LandFallback { req }, now)
    }
    /// A layer landed (local engine notification).
    fn layer_landed(&mut self, req: u64, layer: u16, bytes: u64, now: u64) -> PyResult<()> {
        let req = RequestId(req);
        self.ev(DEvent::LayerLanded { req, layer, bytes }, now)
    }
    /// The host reported the request finished to its scheduler.
    fn reported(&mut self, req: u64, now: u64) -> PyResult<()> {
        let req = RequestId(req);
        self.ev(DEvent::Reported { req }, now)
    }
    /// The scheduler promoted the request.
    fn promoted(&mut self, req: u64, now: u64) -> PyResult<()> {
        let req = RequestId(req);
        self.ev(DEvent::Promoted { req }, now)
    }
    /// The request produced its first token.
    fn first_token(&mut self, req: u64, now: u64) -> PyResult<()> {
        let req = RequestId(req);
        self.ev(DEvent::FirstToken { req }, now)
    }
    /// The host aborts the request.
    fn abort(&mut self, req: u64, now: u64) -> PyResult<()> {
        let req = RequestId(req);
        self.ev(DEvent::Abort { req }, now)
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
    /// Layers of `req` fully landed so far, in increasing order.
    fn landed_layers(&self, req: u64) -> Vec<u16> {
        self.core.landed_layers(RequestId(req))
    }
    /// Requests tracked.
    #[getter]
    fn live_requests(&self) -> usize {
        self.core.live_requests()
    }
    /// Drains the pending actions (objects of `kvwire.core`).
    fn poll_actions(&mut self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        std::iter::from_fn(|| self.core.poll_action())
            .map(|a| d_action(py, a))
            .collect()
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
    /// `PCore(send_mode, layers, transport="tcp", incarnation=1, *, heartbeat_interval=None,
    /// peer_timeout=None, request_timeout=None, block_ids_timeout=None, transfer_timeout=None,
    /// drain_timeout=None, orphan_timeout=None, tombstone_ttl=None,
    /// announce_destination=False)`: send mode `whole` or `layerwise`; timeouts in seconds.
    #[new]
    #[pyo3(signature = (send_mode, layers, transport="tcp", incarnation=1, *, heartbeat_interval=None, peer_timeout=None, request_timeout=None, block_ids_timeout=None, transfer_timeout=None, drain_timeout=None, orphan_timeout=None, tombstone_ttl=None, announce_destination=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        send_mode: &str,
        layers: u16,
        transport: &str,
        incarnation: u64,
        heartbeat_interval: Option<f64>,
        peer_timeout: Option<f64>,
        request_timeout: Option<f64>,
        block_ids_timeout: Option<f64>,
        transfer_timeout: Option<f64>,
        drain_timeout: Option<f64>,
        orphan_timeout: Option<f64>,
        tombstone_ttl: Option<f64>,
        announce_destination: bool,
    ) -> PyResult<Self> {
        let mode: SendMode = send_mode.parse().map_err(|_| {
            invalid(format!(
                "unknown send mode {send_mode:?} (whole, layerwise)"
            ))
        })?;
        if layers == 0 {
            return Err(invalid("layers must be >= 1"));
        }
        let mut cfg = PConfig::new(mode, layers);
        cfg.transport = transport.to_string();
        cfg.incarnation = incarnation;
        cfg.announce_destination = announce_destination;
        for (v, field) in [
            (heartbeat_interval, &mut cfg.heartbeat_interval),
            (peer_timeout, &mut cfg.peer_timeout),
            (request_timeout, &mut cfg.request_timeout),
            (block_ids_timeout, &mut cfg.block_ids_timeout),
            (transfer_timeout, &mut cfg.transfer_timeout),
            (drain_timeout, &mut cfg.drain_timeout),
            (orphan_timeout, &mut cfg.orphan_timeout),
            (tombstone_ttl, &mut cfg.tombstone_ttl),
        ] {
            if let Some(s) = v {
                *field = secs_to_ns(s)?;
            }
        }
        Ok(PCore {
            core: PSide::new(cfg),
        })
    }

    /// P's scheduler has the request queued for D `peer` (D stops timing out its wait for P).
    fn queued(&mut self, req: u64, peer: u32, now: u64) -> PyResult<()> {
        self.ev(
            PEvent::Queued {
                req: RequestId(req),
                peer: PeerId(peer),
            },
            now,
        )
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
        let req = RequestId(req);
        self.ev(PEvent::LayerReady { req, layer }, now)
    }
    /// Prefill finished.
    fn prefill_done(&mut self, req: u64, now: u64) -> PyResult<()> {
        let req = RequestId(req);
        self.ev(PEvent::PrefillDone { req }, now)
    }
    /// A layer's transfer completed.
    fn transfer_done(&mut self, req: u64, layer: u16, bytes: u64, now: u64) -> PyResult<()> {
        let req = RequestId(req);
        self.ev(PEvent::TransferDone { req, layer, bytes }, now)
    }
    /// A layer's transfer failed.
    fn transfer_failed(&mut self, req: u64, layer: u16, now: u64) -> PyResult<()> {
        let req = RequestId(req);
        self.ev(PEvent::TransferFailed { req, layer }, now)
    }
    /// The host aborts the request.
    fn abort(&mut self, req: u64, now: u64) -> PyResult<()> {
        let req = RequestId(req);
        self.ev(PEvent::Abort { req }, now)
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
    /// Drains the pending actions (objects of `kvwire.core`).
    fn poll_actions(&mut self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        std::iter::from_fn(|| self.core.poll_action())
            .map(|a| p_action(py, a))
            .collect()
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
