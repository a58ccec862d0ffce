//! The engine: regions, peers (handshake, control connection), batches.
//!
//! [`Engine`] is a handle to a shared `Core`. Its public methods are defined next to what they
//! do, in the modules below (each using only the ones listed before it):
//! * `peer`: [`Peer`], a peer's state and its view of the remote's regions;
//! * `fence`: region withdrawals awaiting same-host peers' answers;
//! * `fenced`: the fenced peer addresses and the processes refused there;
//! * `core`: [`Engine`], [`Descriptor`], `Core`; tearing down peers and the engine;
//! * `regions`: registering, unregistering, local copies;
//! * `handshake`: transport choice and the engine's side of the handshake (protocol 4);
//! * `control`: a peer's control connection (region updates, notifications, fences);
//! * `connect`: [`Engine::connect`] and the per-peer state built after a handshake;
//! * `listener`: accepted connections (admission, handshakes, data lane joins);
//! * `peer_fence`: [`Engine::fence`] and [`Engine::unfence`];
//! * `submit`: [`Engine::write`] and [`Engine::read`];
//! * `start`: [`Engine::new`].

mod connect;
mod control;
mod core;
mod fence;
mod fenced;
mod handshake;
mod listener;
mod peer;
mod peer_fence;
mod regions;
mod start;
mod submit;

pub use self::core::{Descriptor, Engine};
pub use peer::Peer;
