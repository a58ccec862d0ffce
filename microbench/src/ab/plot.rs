//! `ab.png`: per arm, TTFT p50 and p90 (left), and for the P/D arms the mean
//! decode_sent → first_token cut into the connector's six segments (right).

use std::path::Path;

use plotters::prelude::*;
use plotters::style::FontStyle;
use serde_json::Value;

use crate::clock::plot::{
    cell_label, draw_legend, perr, register_font, stacked_segments, COLORS, FONT,
};
use crate::clock::ClockError;

/// The timeline segments in `ab.json` (the connector's names), in the order of the figure's.
use kvwire_connector::SEGMENT_NAMES as SEGMENTS;

fn ms(v: &Value) -> f64 {
    v.as_f64().map_or(0.0, |s| s * 1e3)
}

/// Draws the figure of an `ab.json` document into `path`.
pub fn render_png(ab: &Value, path: &Path) -> Result<(), ClockError> {
    register_font()?;
    let arms: Vec<&Value> = ab["arms"]
        .as_array()
        .map(|a| a.iter().filter(|r| r["status"] == "ran").collect())
        .unwrap_or_default();
    if arms.is_empty() {
        return Err(ClockError::Plot("no arm ran".into()));
    }
    let root = BitMapBackend::new(path, (1800, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(perr)?;
    let title = format!(
        "kvwire A/B — {} requests per arm, model {}",
        ab["requests"],
        ab["model"].as_str().unwrap_or("?")
    );
    let root = root
        .titled(&title, (FONT, 24).into_font().style(FontStyle::Bold))
        .map_err(perr)?;
    let (left, right) = root.split_horizontally(900);
    let names: Vec<String> = arms
        .iter()
        .map(|r| r["arm"].as_str().unwrap_or("?").to_string())
        .collect();
    let ttft = |r: &Value, q: &str| ms(&r["replay"]["overall"]["ttft_s"][q]);
    {
        let n = arms.len();
        let ymax = arms.iter().map(|r| ttft(r, "p90")).fold(1.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(&left)
            .margin(20)
            .x_label_area_size(40)
            .y_label_area_size(200)
            .caption("TTFT p50 (dark) and p90 (light), ms", (FONT, 20))
            .build_cartesian_2d(0f64..ymax, -0.6f64..(n as f64 - 0.4))
            .map_err(perr)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(n * 2 + 1)
            .y_label_formatter(&|y| cell_label(&names, n as f64 - 1.0 - y))
            .y_label_style((FONT, 16))
            .x_label_style((FONT, 16))
            .x_label_formatter(&|v| format!("{v:.0}"))
            .draw()
            .map_err(perr)?;
        for (q, color) in [("p90", COLORS[0].mix(0.35)), ("p50", COLORS[0].mix(1.0))] {
            chart
                .draw_series(arms.iter().enumerate().map(|(i, r)| {
                    let y = (n - 1 - i) as f64;
                    Rectangle::new([(0.0, y - 0.35), (ttft(r, q), y + 0.35)], color.filled())
                }))
                .map_err(perr)?;
        }
    }
    let pd: Vec<&Value> = arms
        .iter()
        .copied()
        .filter(|r| r["group"] == "pd")
        .collect();
    if !pd.is_empty() {
        let n = pd.len();
        let pd_names: Vec<String> = pd
            .iter()
            .map(|r| {
                r["arm"]
                    .as_str()
                    .unwrap_or("?")
                    .trim_start_matches("pd-")
                    .to_string()
            })
            .collect();
        let seg = |r: &Value, k: usize| ms(&r["timeline"]["decomposition_mean_s"][SEGMENTS[k]]);
        let total = |r: &Value| (0..SEGMENTS.len()).map(|k| seg(r, k)).sum::<f64>();
        let ymax = pd.iter().map(|r| total(r)).fold(1.0, f64::max) * 1.4;
        let mut chart = ChartBuilder::on(&right)
            .margin(20)
            .x_label_area_size(60)
            .y_label_area_size(70)
            .caption(
                "P/D: mean decode_sent → first_token by segment, ms",
                (FONT, 20),
            )
            .build_cartesian_2d(-0.6f64..(n as f64 - 0.4), 0f64..ymax)
            .map_err(perr)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n * 2 + 1)
            .x_label_formatter(&|x| cell_label(&pd_names, *x))
            .x_label_style((FONT, 14))
            .y_label_style((FONT, 16))
            .y_label_formatter(&|v| format!("{v:.0}"))
            .draw()
            .map_err(perr)?;
        stacked_segments(&mut chart, n, |i, k| seg(pd[i], k))?;
        draw_legend(&mut chart, 15)?;
    }
    root.present().map_err(perr)?;
    Ok(())
}
