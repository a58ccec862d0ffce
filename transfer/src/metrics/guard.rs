//! The series of the engine's bounds (handshakes, lanes, budgets, threads, fences; see
//! `Limits`) in the exposition; their inputs are `snapshot::GuardExtra`.

use super::snapshot::MetricsSnapshot;

impl MetricsSnapshot {
    /// The series of the engine's bounds (handshakes, lanes, budgets, threads, fences).
    pub(super) fn guard_series(&self) -> [(&'static str, &'static str, &'static str, String); 19] {
        let g = |name, help, v: u64| (name, "gauge", help, v.to_string());
        let c = |name, help, v: u64| (name, "counter", help, v.to_string());
        [
            c(
                "kvwire_notifications_refused_total",
                "Notifications refused because their peer's budget of pending bytes was spent.",
                self.notifications_refused,
            ),
            g(
                "kvwire_handshakes_in_progress",
                "Handshakes and lane joins in progress.",
                self.handshakes_in_progress,
            ),
            c(
                "kvwire_handshakes_admitted_total",
                "Connections admitted to a handshake or lane join.",
                self.handshakes_admitted,
            ),
            c(
                "kvwire_handshakes_evicted_total",
                "Handshakes closed with a Reject to admit newer ones.",
                self.handshakes_evicted,
            ),
            c(
                "kvwire_handshakes_refused_total",
                "Connections refused at accept.",
                self.handshakes_refused,
            ),
            c(
                "kvwire_handshakes_timed_out_total",
                "Handshakes that ran past the handshake timeout.",
                self.handshakes_timed_out,
            ),
            c(
                "kvwire_auth_failures_total",
                "Failed proofs (handshakes and lane joins).",
                self.auth_failures,
            ),
            g(
                "kvwire_lanes_open",
                "Data lanes peers have open into this engine.",
                self.lanes_open,
            ),
            c(
                "kvwire_lanes_refused_total",
                "Lane joins refused after a valid proof.",
                self.lanes_refused,
            ),
            c(
                "kvwire_peers_refused_total",
                "Handshakes refused because the peer limit was reached.",
                self.peers_refused,
            ),
            g(
                "kvwire_notify_bytes",
                "Bytes of notifications pending here, all peers.",
                self.notify_bytes,
            ),
            g(
                "kvwire_remote_region_entries",
                "Entries of peers' region tables here.",
                self.remote_region_entries,
            ),
            g(
                "kvwire_removed_region_entries",
                "Withdrawn regions of peers remembered here.",
                self.removed_region_entries,
            ),
            c(
                "kvwire_remote_table_ops_total",
                "Region-table entries visited handling peers' region messages.",
                self.remote_table_ops,
            ),
            g(
                "kvwire_ctrl_queue_bytes",
                "Control bytes queued towards peers.",
                self.ctrl_queue_bytes,
            ),
            g(
                "kvwire_threads",
                "Threads of this engine running now.",
                self.threads_live,
            ),
            g(
                "kvwire_metrics_connections",
                "Connections of the metrics endpoint being served.",
                self.metrics_conns_live,
            ),
            c(
                "kvwire_metrics_connections_evicted_total",
                "Metrics connections closed with a 503 to admit newer ones.",
                self.metrics_conns_evicted,
            ),
            g(
                "kvwire_fenced_peers",
                "Fenced peer addresses.",
                self.fenced_peers,
            ),
        ]
    }
}
