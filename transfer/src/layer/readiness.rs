//! When a layer's bytes are complete: readiness is a trait, so the whole layer pipeline runs
//! (and is tested) without CUDA.
//!
//! A [`Readiness`] is handed a [`ReadySignal`] and fires it exactly once, from any thread,
//! when the layer is done (or can never be). Nobody polls: a host flag fires the signal from
//! the thread that sets it; a CUDA event (see `cuda::EventReadiness`) is waited by a worker
//! thread blocked in `cuEventSynchronize`.

use std::sync::Arc;

use parking_lot::Mutex;

type SignalFn = Box<dyn FnOnce(Result<(), String>) + Send>;

/// Fired once when a layer is ready (`Ok`) or will never be (`Err(reason)`). Dropping it
/// without firing fires `Err("readiness dropped")`, so a lost signal fails the layer instead
/// of hanging the stream.
pub struct ReadySignal {
    f: Option<SignalFn>,
}

impl std::fmt::Debug for ReadySignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadySignal")
            .field("fired", &self.f.is_none())
            .finish()
    }
}

impl ReadySignal {
    /// A signal that calls `f` when fired.
    pub fn new(f: impl FnOnce(Result<(), String>) + Send + 'static) -> Self {
        ReadySignal {
            f: Some(Box::new(f)),
        }
    }

    /// Fires the signal.
    pub fn fire(mut self, r: Result<(), String>) {
        if let Some(f) = self.f.take() {
            f(r);
        }
    }
}

impl Drop for ReadySignal {
    fn drop(&mut self) {
        if let Some(f) = self.f.take() {
            f(Err("readiness dropped without firing".into()));
        }
    }
}

/// Tells a layer stream when a layer's bytes are complete.
pub trait Readiness: Send + 'static {
    /// Arranges for `signal` to be fired once the layer is complete. Must not block for long
    /// (it runs on the stream's worker thread).
    fn notify(self: Box<Self>, signal: ReadySignal);

    /// The raw `CUevent` behind this readiness, if there is one. A CUDA stager orders its
    /// device-to-host copies after it on the device (`cuStreamWaitEvent`) instead of waiting
    /// on the host. The event must stay valid until the layer completes.
    fn cuda_event(&self) -> Option<u64> {
        None
    }
}

/// Ready now.
#[derive(Clone, Copy, Debug, Default)]
pub struct Immediate;

impl Readiness for Immediate {
    fn notify(self: Box<Self>, signal: ReadySignal) {
        signal.fire(Ok(()));
    }
}

enum FlagState {
    Pending(Option<ReadySignal>),
    Set,
    Failed(String),
}

/// A host-side flag: whoever computes the layer calls [`HostFlag::set`] (or
/// [`HostFlag::fail`]); the stream learns it at once, with no polling. Cheap to clone; all
/// clones are one flag.
#[derive(Clone)]
pub struct HostFlag {
    st: Arc<Mutex<FlagState>>,
}

impl std::fmt::Debug for HostFlag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostFlag")
            .field("set", &self.is_set())
            .finish()
    }
}

impl Default for HostFlag {
    fn default() -> Self {
        Self::new()
    }
}

impl HostFlag {
    /// A flag not yet set.
    pub fn new() -> Self {
        HostFlag {
            st: Arc::new(Mutex::new(FlagState::Pending(None))),
        }
    }

    /// Marks the layer complete (idempotent; after `fail` it does nothing).
    pub fn set(&self) {
        self.finish(Ok(()));
    }

    /// Marks the layer as never completing (the stream fails).
    pub fn fail(&self, reason: impl Into<String>) {
        self.finish(Err(reason.into()));
    }

    /// Whether [`HostFlag::set`] was called.
    pub fn is_set(&self) -> bool {
        matches!(*self.st.lock(), FlagState::Set)
    }

    fn finish(&self, r: Result<(), String>) {
        let sig = {
            let mut g = self.st.lock();
            match &mut *g {
                FlagState::Pending(s) => {
                    let s = s.take();
                    *g = match &r {
                        Ok(()) => FlagState::Set,
                        Err(e) => FlagState::Failed(e.clone()),
                    };
                    s
                }
                _ => None,
            }
        };
        if let Some(s) = sig {
            s.fire(r);
        }
    }
}

impl Readiness for HostFlag {
    fn notify(self: Box<Self>, signal: ReadySignal) {
        let mut g = self.st.lock();
        match &mut *g {
            FlagState::Pending(s) => *s = Some(signal),
            FlagState::Set => {
                drop(g);
                signal.fire(Ok(()));
            }
            FlagState::Failed(e) => {
                let e = e.clone();
                drop(g);
                signal.fire(Err(e));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn sig() -> (ReadySignal, mpsc::Receiver<Result<(), String>>) {
        let (tx, rx) = mpsc::channel();
        (
            ReadySignal::new(move |r| {
                let _ = tx.send(r);
            }),
            rx,
        )
    }

    #[test]
    fn flag_before_and_after_notify() {
        let f = HostFlag::new();
        let (s, rx) = sig();
        Box::new(f.clone()).notify(s);
        assert!(rx.try_recv().is_err());
        f.set();
        assert_eq!(rx.try_recv(), Ok(Ok(())));
        let (s, rx) = sig();
        Box::new(f.clone()).notify(s);
        assert_eq!(rx.try_recv(), Ok(Ok(())));
    }

    #[test]
    fn failed_flag_and_dropped_signal() {
        let f = HostFlag::new();
        f.fail("boom");
        f.set(); // no effect after fail
        let (s, rx) = sig();
        Box::new(f).notify(s);
        assert_eq!(rx.try_recv(), Ok(Err("boom".into())));
        let (s, rx) = sig();
        drop(s);
        assert!(matches!(rx.try_recv(), Ok(Err(_))));
    }
}
