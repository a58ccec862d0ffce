//! The Prometheus text exposition (format 0.0.4) of a [`MetricsSnapshot`].

use std::fmt::Write as _;

use super::counters::transport_label;
use super::snapshot::{MetricsSnapshot, PeerSnapshot, TransportSnapshot};

impl MetricsSnapshot {
    /// The Prometheus text exposition format (version 0.0.4) of this snapshot.
    pub fn to_prometheus_text(&self) -> String {
        let mut o = String::with_capacity(16 << 10);
        let head = |o: &mut String, name: &str, ty: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}");
            let _ = writeln!(o, "# TYPE {name} {ty}");
        };
        type DirGet = fn(&TransportSnapshot) -> (u64, u64);
        type Get = fn(&TransportSnapshot) -> u64;
        let by_dir: [(&str, &str, DirGet); 2] = [
            (
                "kvwire_transfer_bytes_total",
                "Payload bytes of completed batches, by transport and direction.",
                |t| (t.write_bytes, t.read_bytes),
            ),
            (
                "kvwire_batches_total",
                "Completed batches, by transport and direction.",
                |t| (t.write_batches, t.read_batches),
            ),
        ];
        for (name, help, get) in &by_dir {
            head(&mut o, name, "counter", help);
            for t in &self.transports {
                let tl = transport_label(t.transport);
                let (w, r) = get(t);
                let _ = writeln!(o, "{name}{{transport=\"{tl}\",dir=\"write\"}} {w}");
                let _ = writeln!(o, "{name}{{transport=\"{tl}\",dir=\"read\"}} {r}");
            }
        }
        let per_transport: [(&str, &str, Get); 3] = [
            (
                "kvwire_ops_total",
                "Ops (as submitted) of completed batches, by transport.",
                |t| t.ops,
            ),
            (
                "kvwire_slices_total",
                "Wire slices of completed batches, by transport.",
                |t| t.slices,
            ),
            (
                "kvwire_failed_batches_total",
                "Submitted batches that failed, by transport.",
                |t| t.failed_batches,
            ),
        ];
        for (name, help, get) in &per_transport {
            head(&mut o, name, "counter", help);
            for t in &self.transports {
                let _ = writeln!(
                    o,
                    "{name}{{transport=\"{}\"}} {}",
                    transport_label(t.transport),
                    get(t)
                );
            }
        }
        let name = "kvwire_region_bytes_by_kind";
        head(
            &mut o,
            name,
            "gauge",
            "Bytes registered now, by memory: engine (allocated here), host (pageable), pinned.",
        );
        for (kind, n) in &self.region_bytes_by_kind {
            let _ = writeln!(o, "{name}{{kind=\"{kind}\"}} {n}");
        }
        let name = "kvwire_batch_latency_seconds";
        head(
            &mut o,
            name,
            "histogram",
            "Batch latency from submit to completion, by transport and batch size class.",
        );
        for h in &self.latency {
            let l = format!(
                "transport=\"{}\",size=\"{}\"",
                transport_label(h.transport),
                h.size_class
            );
            for (le, c) in &h.buckets {
                let les = if le.is_infinite() {
                    "+Inf".to_string()
                } else {
                    format!("{le}")
                };
                let _ = writeln!(o, "{name}_bucket{{{l},le=\"{les}\"}} {c}");
            }
            let _ = writeln!(o, "{name}_sum{{{l}}} {}", h.sum_seconds);
            let _ = writeln!(o, "{name}_count{{{l}}} {}", h.count);
        }
        let name = "kvwire_errors_total";
        head(
            &mut o,
            name,
            "counter",
            "Errors by stage (submit, batch, connect) and kind.",
        );
        for e in &self.errors {
            let _ = writeln!(
                o,
                "{name}{{stage=\"{}\",kind=\"{}\"}} {}",
                e.stage, e.kind, e.count
            );
        }
        let gauges: [(&str, &str, &str, String); 18] = [
            (
                "kvwire_inflight_bytes",
                "gauge",
                "Bytes of batches in flight.",
                self.inflight_bytes.to_string(),
            ),
            (
                "kvwire_inflight_slices",
                "gauge",
                "Wire slices of batches in flight.",
                self.inflight_slices.to_string(),
            ),
            (
                "kvwire_inflight_batches",
                "gauge",
                "Batches in flight.",
                self.inflight_batches.to_string(),
            ),
            (
                "kvwire_reposts_total",
                "counter",
                "Work requests re-posted on another lane after a lane failed (RDMA).",
                self.reposts.to_string(),
            ),
            (
                "kvwire_lanes_reestablished_total",
                "counter",
                "Data-path lanes re-established after errors (RDMA queue pairs).",
                self.lanes_reestablished.to_string(),
            ),
            (
                "kvwire_region_registrations_total",
                "counter",
                "Regions registered.",
                self.registrations.to_string(),
            ),
            (
                "kvwire_region_registered_bytes_total",
                "counter",
                "Bytes registered.",
                self.registered_bytes.to_string(),
            ),
            (
                "kvwire_region_registration_seconds_total",
                "counter",
                "Time spent registering regions.",
                self.registration_seconds.to_string(),
            ),
            (
                "kvwire_region_unregistrations_total",
                "counter",
                "Regions unregistered.",
                self.unregistrations.to_string(),
            ),
            (
                "kvwire_regions",
                "gauge",
                "Regions registered now.",
                self.regions.to_string(),
            ),
            (
                "kvwire_region_bytes",
                "gauge",
                "Bytes registered now.",
                self.region_bytes.to_string(),
            ),
            (
                "kvwire_connections_outbound_total",
                "counter",
                "Peers set up by connect.",
                self.connections_outbound.to_string(),
            ),
            (
                "kvwire_connections_inbound_total",
                "counter",
                "Peers set up by accepting.",
                self.connections_inbound.to_string(),
            ),
            (
                "kvwire_disconnects_total",
                "counter",
                "Peers closed.",
                self.disconnects.to_string(),
            ),
            (
                "kvwire_peers",
                "gauge",
                "Peers connected now.",
                self.peers_connected.to_string(),
            ),
            (
                "kvwire_notifications_delivered_total",
                "counter",
                "Notifications queued for the application (as a target).",
                self.notifications_delivered.to_string(),
            ),
            (
                "kvwire_notifications_dropped_total",
                "counter",
                "Notifications dropped because the queue was full.",
                self.notifications_dropped.to_string(),
            ),
            (
                "kvwire_notifications_suppressed_total",
                "counter",
                "Notifications not delivered because a slice of their batch was refused.",
                self.notifications_suppressed.to_string(),
            ),
        ];
        for (name, ty, help, v) in gauges.iter().chain(self.guard_series().iter()) {
            head(&mut o, name, ty, help);
            let _ = writeln!(o, "{name} {v}");
        }
        type PGet = fn(&PeerSnapshot) -> u64;
        let per_peer: [(&str, &str, PGet); 11] = [
            (
                "kvwire_peer_write_bytes_total",
                "Bytes written to a peer (completed batches).",
                |p| p.write_bytes,
            ),
            (
                "kvwire_peer_read_bytes_total",
                "Bytes read from a peer (completed batches).",
                |p| p.read_bytes,
            ),
            (
                "kvwire_peer_batches_total",
                "Completed batches towards a peer.",
                |p| p.batches,
            ),
            (
                "kvwire_peer_failed_batches_total",
                "Failed batches towards a peer.",
                |p| p.failed_batches,
            ),
            (
                "kvwire_peer_reposts_total",
                "Work requests towards a peer re-posted on another lane after a lane failed (RDMA).",
                |p| p.reposts,
            ),
            (
                "kvwire_peer_lanes_reestablished_total",
                "Lanes towards a peer re-established after errors.",
                |p| p.lanes_reestablished,
            ),
            (
                "kvwire_peer_notify_bytes",
                "Bytes of a peer's notifications pending here.",
                |p| p.notify_bytes,
            ),
            (
                "kvwire_peer_remote_regions",
                "Entries of a peer's region table here.",
                |p| p.remote_region_entries,
            ),
            (
                "kvwire_peer_removed_regions",
                "Withdrawn regions of a peer remembered here.",
                |p| p.removed_region_entries,
            ),
            (
                "kvwire_peer_lanes_open",
                "Data lanes a peer has open into this engine.",
                |p| p.lanes_open,
            ),
            (
                "kvwire_peer_ctrl_queue_bytes",
                "Control bytes queued towards a peer.",
                |p| p.ctrl_queue_bytes,
            ),
        ];
        for (name, help, get) in &per_peer {
            let ty = if name.ends_with("_total") {
                "counter"
            } else {
                "gauge"
            };
            head(&mut o, name, ty, help);
            for p in &self.peers {
                let _ = writeln!(
                    o,
                    "{name}{{peer=\"{}\",remote=\"{}\",transport=\"{}\"}} {}",
                    p.id,
                    p.remote_addr,
                    transport_label(p.transport),
                    get(p)
                );
            }
        }
        let name = "kvwire_peer_slice_bytes";
        head(
            &mut o,
            name,
            "gauge",
            "The slice size a peer's large batches are cut with now, by direction (RDMA, adaptive).",
        );
        for p in &self.peers {
            let Some(sizes) = p.slice_sizes else {
                continue;
            };
            for (dir, v) in ["write", "read"].iter().zip(sizes) {
                let _ = writeln!(
                    o,
                    "{name}{{peer=\"{}\",remote=\"{}\",transport=\"{}\",dir=\"{dir}\"}} {v}",
                    p.id,
                    p.remote_addr,
                    transport_label(p.transport),
                );
            }
        }
        o
    }
}
