//! The figure of a clock run (PNG, drawn with plotters and an embedded DejaVu Sans font, so
//! no system font is needed).
//!
//! Left: per cell, the mean `decode_sent → first_token` cut into the connector's six
//! segments (stacked bars, ms), with the p50 and p90 of the clock marked. Right: D
//! block-seconds held while waiting, per cell.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::FontStyle;

use super::report::{ClockReport, SEGMENTS};
use super::ClockError;

const FONT: &str = "sans-serif";

/// Horizontal offset of the p50/p90 markers from a bar's centre (cells are 1 apart).
const MARK_DX: f64 = 0.2;

const COLORS: [RGBColor; 6] = [
    RGBColor(0x4c, 0x72, 0xb0),
    RGBColor(0xdd, 0x84, 0x52),
    RGBColor(0xc4, 0x4e, 0x52),
    RGBColor(0x81, 0x72, 0xb2),
    RGBColor(0x93, 0x78, 0x60),
    RGBColor(0x55, 0xa8, 0x68),
];

const LABELS: [&str; 6] = [
    "wait for P",
    "reservation wait",
    "exposed transfer",
    "report delay",
    "promotion delay",
    "first step",
];

fn register_font() -> Result<(), ClockError> {
    static ONCE: Once = Once::new();
    let mut res = Ok(());
    ONCE.call_once(|| {
        for (style, bytes) in [
            (FontStyle::Normal, dejavu::sans::regular()),
            (FontStyle::Bold, dejavu::sans::bold()),
        ] {
            if plotters::style::register_font(FONT, style, bytes).is_err() {
                res = Err(ClockError::Plot("embedded font does not load".into()));
            }
        }
    });
    res
}

fn perr<E: std::fmt::Display>(e: E) -> ClockError {
    ClockError::Plot(e.to_string())
}

/// Draws the figure into `path` (PNG, 1600×800).
pub fn render_png(r: &ClockReport, path: &Path) -> Result<(), ClockError> {
    register_font()?;
    let root = BitMapBackend::new(path, (1600, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(perr)?;
    let title = format!(
        "decode_sent → first_token by policy × send mode — scenario {}, {} requests/cell, transport {}, link speed {}",
        r.config.scenario.name(),
        r.requests,
        r.transport,
        r.config.link_speed.name()
    );
    let root = root
        .titled(&title, (FONT, 24).into_font().style(FontStyle::Bold))
        .map_err(perr)?;
    let (left, right) = root.split_horizontally(1060);
    let n = r.summaries.len();
    let names: Vec<String> = r
        .summaries
        .iter()
        .map(|s| format!("{}/{}", s.policy, s.send_mode))
        .collect();
    let mean_of = |i: usize, k: &str| {
        r.summaries[i]
            .decomposition_ms
            .get(k)
            .map_or(0.0, |q| q.mean)
    };
    let ymax = r
        .summaries
        .iter()
        .map(|s| s.clock_ms.p90.max(s.clock_ms.mean))
        .fold(1.0f64, f64::max)
        * 1.6;
    let label_of = |names: &[String], x: &f64| -> String {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < names.len() {
            names[i as usize].clone()
        } else {
            String::new()
        }
    };
    {
        let mut chart = ChartBuilder::on(&left)
            .margin(20)
            .x_label_area_size(60)
            .y_label_area_size(90)
            .caption(
                "mean clock cut into the connector's segments (p50 ◆, p90 ▲ of the clock)",
                (FONT, 20),
            )
            .build_cartesian_2d(-0.6f64..(n as f64 - 0.4), 0f64..ymax)
            .map_err(perr)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n * 2 + 1)
            .x_label_formatter(&|x| label_of(&names, x))
            .x_label_style((FONT, 17))
            .y_label_style((FONT, 17))
            .y_label_formatter(&|v| format!("{v:.0}"))
            .light_line_style(RGBColor(238, 238, 238))
            .y_desc("milliseconds (virtual clock; transfer measured)")
            .x_desc("D reservation policy / P send mode")
            .axis_desc_style((FONT, 18))
            .draw()
            .map_err(perr)?;
        for (k, seg) in SEGMENTS.iter().enumerate() {
            let color = COLORS[k];
            let bars: Vec<Rectangle<(f64, f64)>> = (0..n)
                .map(|i| {
                    let below: f64 = SEGMENTS[..k].iter().map(|s| mean_of(i, s)).sum();
                    let x = i as f64;
                    Rectangle::new(
                        [(x - 0.35, below), (x + 0.35, below + mean_of(i, seg))],
                        color.filled(),
                    )
                })
                .collect();
            chart
                .draw_series(bars)
                .map_err(perr)?
                .label(LABELS[k])
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 7), (x + 14, y + 7)], color.filled())
                });
        }
        chart
            .draw_series((0..n).map(|i| {
                Polygon::new(
                    diamond(i as f64 + MARK_DX, r.summaries[i].clock_ms.p50, ymax),
                    BLACK.filled(),
                )
            }))
            .map_err(perr)?
            .label("p50 of the clock")
            .legend(|(x, y)| {
                Polygon::new(
                    vec![(x + 1, y), (x + 7, y - 6), (x + 13, y), (x + 7, y + 6)],
                    BLACK.filled(),
                )
            });
        chart
            .draw_series((0..n).map(|i| {
                TriangleMarker::new(
                    (i as f64 + MARK_DX, r.summaries[i].clock_ms.p90),
                    9,
                    BLACK.filled(),
                )
            }))
            .map_err(perr)?
            .label("p90 of the clock")
            .legend(|(x, y)| TriangleMarker::new((x + 7, y), 7, BLACK.filled()));
        chart
            .draw_series((0..n).map(|i| {
                Text::new(
                    format!("mean {:.0}", r.summaries[i].clock_ms.mean),
                    (i as f64 - 0.34, r.summaries[i].clock_ms.mean + ymax * 0.035),
                    (FONT, 16).into_font(),
                )
            }))
            .map_err(perr)?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font((FONT, 16))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(perr)?;
    }
    {
        let bmax = r
            .summaries
            .iter()
            .map(|s| s.d_block_seconds_waiting)
            .fold(1e-9f64, f64::max)
            * 1.25;
        let mut chart = ChartBuilder::on(&right)
            .margin(20)
            .x_label_area_size(60)
            .y_label_area_size(140)
            .caption(
                "D blocks held while waiting (reserved → promoted)",
                (FONT, 20),
            )
            .build_cartesian_2d(0f64..bmax, -0.6f64..(n as f64 - 0.4))
            .map_err(perr)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(n * 2 + 1)
            .y_label_formatter(&|y| label_of(&names, &(n as f64 - 1.0 - y)))
            .y_label_style((FONT, 16))
            .x_labels(5)
            .x_label_formatter(&|v| format!("{v:.0}"))
            .x_label_style((FONT, 16))
            .light_line_style(RGBColor(238, 238, 238))
            .x_desc("block-seconds, summed over requests")
            .axis_desc_style((FONT, 18))
            .draw()
            .map_err(perr)?;
        // Top to bottom in the order of the left panel's bars, left to right.
        let row = |i: usize| (n - 1 - i) as f64;
        chart
            .draw_series((0..n).map(|i| {
                Rectangle::new(
                    [
                        (0.0, row(i) - 0.35),
                        (r.summaries[i].d_block_seconds_waiting, row(i) + 0.35),
                    ],
                    COLORS[0].filled(),
                )
            }))
            .map_err(perr)?;
        chart
            .draw_series((0..n).map(|i| {
                Text::new(
                    format!("{:.0}", r.summaries[i].d_block_seconds_waiting),
                    (
                        r.summaries[i].d_block_seconds_waiting + bmax * 0.01,
                        row(i) + 0.1,
                    ),
                    (FONT, 15).into_font(),
                )
            }))
            .map_err(perr)?;
    }
    root.present().map_err(perr)?;
    Ok(())
}

fn diamond(x: f64, y: f64, ymax: f64) -> Vec<(f64, f64)> {
    let dx = 0.06;
    let dy = ymax * 0.012;
    vec![(x - dx, y), (x, y + dy), (x + dx, y), (x, y - dy)]
}
