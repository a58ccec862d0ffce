//! What the connector cores ask their host to do, as typed Python objects (`kvwire.core`):
//! one frozen class per action, fields readable by name, usable in a `match` statement.

use kvwire_connector::{DAction, DownCause, Message, PAction};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::errors::ConnectorError;

/// One action class: a frozen pyclass with read-only fields, `__repr__` and `__match_args__`.
macro_rules! action {
    ($(#[$doc:meta])* $name:ident { $($field:ident : $ty:ty),* $(,)? }) => {
        $(#[$doc])*
        #[pyclass(module = "kvwire.core", frozen, get_all)]
        pub struct $name {
            $(pub $field: $ty,)*
        }

        #[pymethods]
        impl $name {
            #[classattr]
            fn __match_args__(py: Python<'_>) -> PyResult<Py<PyTuple>> {
                // A tuple, as positional class patterns require.
                Ok(PyTuple::new(py, [$(stringify!($field)),*])?.unbind())
            }

            fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
                let parts: Vec<String> = vec![$(
                    format!("{}={}", stringify!($field), self.$field.repr_field(py)?)
                ),*];
                Ok(format!("{}({})", stringify!($name), parts.join(", ")))
            }
        }
    };
}

/// A field as Python would print it.
trait ReprField {
    fn repr_field(&self, py: Python<'_>) -> PyResult<String>;
}
impl ReprField for Py<PyBytes> {
    fn repr_field(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.bind(py).repr()?.to_string())
    }
}
impl ReprField for bool {
    fn repr_field(&self, _: Python<'_>) -> PyResult<String> {
        Ok(if *self { "True" } else { "False" }.to_string())
    }
}
impl ReprField for String {
    fn repr_field(&self, _: Python<'_>) -> PyResult<String> {
        Ok(format!("'{self}'"))
    }
}
macro_rules! debug_repr {
    ($($t:ty),*) => { $(impl ReprField for $t { fn repr_field(&self, _: Python<'_>) -> PyResult<String> { Ok(format!("{self:?}")) } })* };
}
debug_repr!(u64, u32, u16, Vec<u32>);

action!(
    /// Send these encoded message bytes to the peer.
    Send { peer: u32, data: Py<PyBytes> }
);
action!(
    /// D: the request may now reserve `blocks` KV blocks.
    MayReserve { req: u64, blocks: u32 }
);
action!(
    /// D, policy `land`: the request may take `blocks` landing-pool slots (answer with
    /// `DCore.landing` or `DCore.land_fallback`).
    MayLand { req: u64, blocks: u32 }
);
action!(
    /// Free these blocks (D: a reservation that did not become a running request; P: the
    /// request's blocks, vLLM `finished_sending`).
    ReleaseBlocks { req: u64, blocks: Vec<u32> }
);
action!(
    /// D: free these landing-pool slots (no write of P can land in them any more).
    ReleaseLanding { req: u64, slots: Vec<u32> }
);
action!(
    /// D: every layer landed (a `land` request: copy its slots into its blocks first); P:
    /// every layer was sent.
    ReportFinished { req: u64 }
);
action!(
    /// The request failed; on D `blocks` did not load (vLLM's load-error path).
    ReportFailed { req: u64, blocks: Vec<u32>, reason: String }
);
action!(
    /// Tear the connection to this peer down so that none of its writes can land any more;
    /// `cause` says why the core gave it up (for the log); `reported` when the host had
    /// reported it down (the core's own verdict otherwise: silence, a drain timeout).
    DisconnectPeer { peer: u32, cause: String, reported: bool }
);
action!(
    /// P: write layer `layer` from P's blocks `src` into D's `dst` (landing slots when
    /// `landing`), then report it done or failed.
    Transfer { req: u64, peer: u32, layer: u16, src: Vec<u32>, dst: Vec<u32>, landing: bool }
);
action!(
    /// P (with `announce_destination`): D's block ids are known; block `src[i]` goes to
    /// `dst[i]` in every layer; `first` is the index of the request block `src[0]` is.
    Destination { req: u64, peer: u32, first: u32, src: Vec<u32>, dst: Vec<u32>, landing: bool }
);
action!(
    /// P: cancel the request's transfers still in flight (each is still reported).
    CancelTransfers { req: u64 }
);

fn send(py: Python<'_>, peer: u32, msg: &Message) -> PyResult<Py<PyAny>> {
    let b = msg
        .encode()
        .map_err(|e| ConnectorError::new_err(format!("cannot encode message: {e}")))?;
    let data = PyBytes::new(py, &b).unbind();
    Ok(Py::new(py, Send { peer, data })?.into_any())
}

fn report_failed(
    py: Python<'_>,
    req: u64,
    blocks: Vec<u32>,
    r: kvwire_connector::FailReason,
) -> PyResult<Py<PyAny>> {
    let reason = kvwire_connector::metrics::fail_reason_name(r).to_string();
    Ok(Py::new(
        py,
        ReportFailed {
            req,
            blocks,
            reason,
        },
    )?
    .into_any())
}

fn disconnect(py: Python<'_>, peer: u32, cause: DownCause) -> PyResult<Py<PyAny>> {
    let a = DisconnectPeer {
        peer,
        cause: cause.to_string(),
        reported: cause == DownCause::Reported,
    };
    Ok(Py::new(py, a)?.into_any())
}

/// A D core action as its Python object.
pub fn d_action(py: Python<'_>, a: DAction) -> PyResult<Py<PyAny>> {
    Ok(match a {
        DAction::Send { to, msg } => return send(py, to.0, &msg),
        DAction::MayReserve { req, blocks } => {
            Py::new(py, MayReserve { req: req.0, blocks })?.into_any()
        }
        DAction::MayLand { req, blocks } => Py::new(py, MayLand { req: req.0, blocks })?.into_any(),
        DAction::ReleaseBlocks { req, blocks } => {
            Py::new(py, ReleaseBlocks { req: req.0, blocks })?.into_any()
        }
        DAction::ReleaseLanding { req, slots } => {
            Py::new(py, ReleaseLanding { req: req.0, slots })?.into_any()
        }
        DAction::ReportFinished { req } => Py::new(py, ReportFinished { req: req.0 })?.into_any(),
        DAction::ReportFailed {
            req,
            blocks,
            reason: r,
        } => return report_failed(py, req.0, blocks, r),
        DAction::DisconnectPeer { peer, cause } => return disconnect(py, peer.0, cause),
    })
}

/// A P core action as its Python object.
pub fn p_action(py: Python<'_>, a: PAction) -> PyResult<Py<PyAny>> {
    Ok(match a {
        PAction::Send { to, msg } => return send(py, to.0, &msg),
        PAction::Transfer {
            req,
            peer,
            layer,
            src,
            dst,
            landing,
        } => Py::new(
            py,
            Transfer {
                req: req.0,
                peer: peer.0,
                layer,
                src: src.to_vec(),
                dst: dst.to_vec(),
                landing,
            },
        )?
        .into_any(),
        PAction::Destination {
            req,
            peer,
            first,
            src,
            dst,
            landing,
        } => Py::new(
            py,
            Destination {
                req: req.0,
                peer: peer.0,
                first,
                src: src.to_vec(),
                dst: dst.to_vec(),
                landing,
            },
        )?
        .into_any(),
        PAction::CancelTransfers { req } => Py::new(py, CancelTransfers { req: req.0 })?.into_any(),
        PAction::ReleaseBlocks { req, blocks } => {
            Py::new(py, ReleaseBlocks { req: req.0, blocks })?.into_any()
        }
        PAction::ReportFinished { req } => Py::new(py, ReportFinished { req: req.0 })?.into_any(),
        PAction::ReportFailed { req, reason: r } => return report_failed(py, req.0, Vec::new(), r),
        PAction::DisconnectPeer { peer, cause } => return disconnect(py, peer.0, cause),
    })
}

/// Adds the action classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Send>()?;
    m.add_class::<MayReserve>()?;
    m.add_class::<MayLand>()?;
    m.add_class::<ReleaseBlocks>()?;
    m.add_class::<ReleaseLanding>()?;
    m.add_class::<ReportFinished>()?;
    m.add_class::<ReportFailed>()?;
    m.add_class::<DisconnectPeer>()?;
    m.add_class::<Transfer>()?;
    m.add_class::<Destination>()?;
    m.add_class::<CancelTransfers>()?;
    Ok(())
}
