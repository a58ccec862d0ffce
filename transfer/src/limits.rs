//! What an engine spends on its peers, bounded: [`Limits`] (part of `EngineConfig`) and the
//! [`Resource`] an `Error::ResourceLimit` names.
//!
//! Every bound holds whatever a peer sends, authenticated or not: handshakes in progress (all
//! and per source address), the time one may take, the peers, the data lanes of a peer, the
//! bytes of notifications a peer has pending, the regions a peer announces, the control bytes
//! queued towards a peer, and the connections of the `/metrics` endpoint.

use std::fmt;
use std::time::Duration;

/// Bounds on what peers (and clients of the metrics endpoint) may make the engine hold.
/// `Limits::default()` is meant for production; tests use small values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The whole handshake (or lane join) of an accepted connection, from accept to its last
    /// message; a connection still handshaking then is closed (with a `Reject` when possible).
    pub handshake_timeout: Duration,
    /// Handshakes (and lane joins) in progress at once. When full, the one that made the least
    /// progress (oldest first) is closed with a `Reject` to admit a new one; a connection that
    /// cannot be admitted gets a `Reject`, never silence.
    pub max_handshakes: usize,
    /// Handshakes in progress at once from one source address (at most `max_handshakes`).
    pub max_handshakes_per_ip: usize,
    /// Failed proofs (wrong secret, bad lane proof) one source address may make per minute;
    /// beyond, its connections are refused at accept until the minute is over.
    pub auth_failures_per_ip: u32,
    /// Connected peers, inbound and outbound (`Error::ResourceLimit` beyond).
    pub max_peers: usize,
    /// Data lanes a peer may open into this engine (and announce in its handshake).
    pub max_peer_lanes: usize,
    /// Bytes of notifications one peer may have pending here: tags whose batch has not landed
    /// yet, and tags delivered but not yet taken by the application (each counted with 64 bytes
    /// of overhead). Beyond, that peer's batches with a notification fail with
    /// `Error::ResourceLimit` (others' are unaffected).
    pub peer_notify_bytes: usize,
    /// Regions one peer may announce (entries of its region table here), and regions it
    /// withdrew that are remembered to tell a stale id from an unknown one. A peer announcing
    /// more is disconnected with `Error::ResourceLimit`.
    pub max_remote_regions: usize,
    /// Control-connection bytes queued towards one peer (region updates, notifications over
    /// shm and rdma, fences). A peer that stops reading is disconnected once this much is
    /// queued; registration never waits for it.
    pub ctrl_queue_bytes: usize,
    /// A control connection silent this long is dead (each side sends a heartbeat every third
    /// of it); TCP keepalive covers the data lanes.
    pub idle_timeout: Duration,
    /// Connections of the `/metrics` endpoint served at once (each on its own thread).
    pub metrics_max_conns: usize,
    /// The whole request and response of one `/metrics` connection.
    pub metrics_conn_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            handshake_timeout: Duration::from_secs(5),
            max_handshakes: 64,
            max_handshakes_per_ip: 16,
            auth_failures_per_ip: 16,
            max_peers: 256,
            max_peer_lanes: 64,
            peer_notify_bytes: 16 << 20,
            max_remote_regions: 1 << 16,
            ctrl_queue_bytes: 64 << 20,
            idle_timeout: Duration::from_secs(30),
            metrics_max_conns: 16,
            metrics_conn_timeout: Duration::from_secs(2),
        }
    }
}

impl Limits {
    /// Checks the values (every bound positive, per-address bound within the total).
    pub(crate) fn validate(&self) -> Result<(), String> {
        let zero = [
            ("handshake_timeout", self.handshake_timeout.is_zero()),
            ("max_handshakes", self.max_handshakes == 0),
            ("max_handshakes_per_ip", self.max_handshakes_per_ip == 0),
            ("auth_failures_per_ip", self.auth_failures_per_ip == 0),
            ("max_peers", self.max_peers == 0),
            ("max_peer_lanes", self.max_peer_lanes == 0),
            ("peer_notify_bytes", self.peer_notify_bytes == 0),
            ("max_remote_regions", self.max_remote_regions == 0),
            ("ctrl_queue_bytes", self.ctrl_queue_bytes == 0),
            ("idle_timeout", self.idle_timeout.is_zero()),
            ("metrics_max_conns", self.metrics_max_conns == 0),
            ("metrics_conn_timeout", self.metrics_conn_timeout.is_zero()),
        ];
        if let Some((name, _)) = zero.iter().find(|(_, z)| *z) {
            return Err(format!("limits.{name} must be > 0"));
        }
        if self.max_handshakes_per_ip > self.max_handshakes {
            return Err("limits.max_handshakes_per_ip must be <= limits.max_handshakes".into());
        }
        if self.max_remote_regions > crate::wire::MAX_REGIONS_PER_MSG as usize {
            return Err(format!(
                "limits.max_remote_regions must be <= {}",
                crate::wire::MAX_REGIONS_PER_MSG
            ));
        }
        Ok(())
    }
}

/// What an `Error::ResourceLimit` ran out of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Resource {
    /// Handshakes in progress ([`Limits::max_handshakes`]).
    Handshakes,
    /// Handshakes in progress from one address ([`Limits::max_handshakes_per_ip`]).
    HandshakesPerAddress,
    /// Failed proofs from one address ([`Limits::auth_failures_per_ip`]).
    AuthFailures,
    /// Connected peers ([`Limits::max_peers`]).
    Peers,
    /// Data lanes of one peer ([`Limits::max_peer_lanes`], or what the peer announced).
    Lanes,
    /// Pending notification bytes of one peer ([`Limits::peer_notify_bytes`]).
    NotifyBytes,
    /// Regions one peer announced ([`Limits::max_remote_regions`]).
    RemoteRegions,
    /// Control bytes queued towards one peer ([`Limits::ctrl_queue_bytes`]).
    CtrlQueue,
    /// Connections of the metrics endpoint ([`Limits::metrics_max_conns`]).
    MetricsConns,
}

/// Every resource, in wire-code order (code = index).
const RESOURCES: [Resource; 9] = [
    Resource::Handshakes,
    Resource::HandshakesPerAddress,
    Resource::AuthFailures,
    Resource::Peers,
    Resource::Lanes,
    Resource::NotifyBytes,
    Resource::RemoteRegions,
    Resource::CtrlQueue,
    Resource::MetricsConns,
];

impl Resource {
    /// Its code on the wire.
    pub(crate) fn code(self) -> u8 {
        RESOURCES.iter().position(|r| *r == self).unwrap_or(0) as u8
    }
    /// The resource of a wire code (`None` for a code this build does not know).
    pub(crate) fn from_code(c: u8) -> Option<Resource> {
        RESOURCES.get(usize::from(c)).copied()
    }
    /// A short name (log fields, metric labels).
    pub fn name(self) -> &'static str {
        match self {
            Resource::Handshakes => "handshakes",
            Resource::HandshakesPerAddress => "handshakes_per_address",
            Resource::AuthFailures => "auth_failures",
            Resource::Peers => "peers",
            Resource::Lanes => "lanes",
            Resource::NotifyBytes => "notify_bytes",
            Resource::RemoteRegions => "remote_regions",
            Resource::CtrlQueue => "ctrl_queue",
            Resource::MetricsConns => "metrics_conns",
        }
    }
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Resource::Handshakes => "handshakes in progress",
            Resource::HandshakesPerAddress => "handshakes in progress from one address",
            Resource::AuthFailures => "failed proofs from one address per minute",
            Resource::Peers => "connected peers",
            Resource::Lanes => "data lanes of a peer",
            Resource::NotifyBytes => "pending notification bytes of a peer",
            Resource::RemoteRegions => "regions announced by a peer",
            Resource::CtrlQueue => "control bytes queued towards a peer",
            Resource::MetricsConns => "metrics connections",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_defaults_validate() {
        for (i, r) in RESOURCES.iter().enumerate() {
            assert_eq!(r.code() as usize, i);
            assert_eq!(Resource::from_code(r.code()), Some(*r));
        }
        assert_eq!(Resource::from_code(200), None);
        assert_eq!(Limits::default().validate(), Ok(()));
        let bad = Limits {
            max_handshakes_per_ip: 65,
            ..Limits::default()
        };
        assert!(bad.validate().is_err());
        let zero = Limits {
            max_peers: 0,
            ..Limits::default()
        };
        assert_eq!(
            zero.validate(),
            Err("limits.max_peers must be > 0".to_string())
        );
    }
}
