//! The figure of a clock run (PNG, drawn with plotters and an embedded DejaVu Sans font, so
//! no system font is needed).
//!
//! Top left: per cell, the mean `decode_sent → first_token` cut into the connector's six
//! segments (stacked bars, ms), with the p50 and p90 of the clock marked. Top right: D
//! block-seconds held while waiting, per cell. Bottom left: TTFT p50 and p90 of every request
//! D serves (P/D and local) and the exposed tail after P's last chunk (p90). Bottom right:
//! preemptions per cell, labelled with TPOT p90, D's prefix-cache hit rate and `land`'s
//! fallbacks.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::FontStyle;

use super::report::{ClockReport, SEGMENTS};
use super::ClockError;

/// The font family the figures are drawn in (embedded, see [`register_font`]).
pub const FONT: &str = "sans-serif";

/// Horizontal offset of the p50/p90 markers from a bar's centre (cells are 1 apart).
const MARK_DX: f64 = 0.2;

/// One colour per segment of the clock.
pub const COLORS: [RGBColor; 6] = [
    RGBColor(0x4c, 0x72, 0xb0),
    RGBColor(0xdd, 0x84, 0x52),
    RGBColor(0xc4, 0x4e, 0x52),
    RGBColor(0x81, 0x72, 0xb2),
    RGBColor(0x93, 0x78, 0x60),
    RGBColor(0x55, 0xa8, 0x68),
];

/// The segments' names as the figures label them.
pub const LABELS: [&str; 6] = [
    "wait for P",
    "reservation wait",
    "exposed transfer",
    "report delay",
    "promotion delay",
    "first step",
];

/// Registers the embedded DejaVu Sans as [`FONT`] (once per process).
pub fn register_font() -> Result<(), ClockError> {
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

/// A plotting error as the benches report it.
pub fn perr<E: std::fmt::Display>(e: E) -> ClockError {
    ClockError::Plot(e.to_string())
}

/// The chart the figures draw bars on.
pub type Chart<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// Stacked bars of the clock's six segments, one bar per cell at x = 0, 1, … `n − 1`,
/// segment `k` of cell `i` `seg(i, k)` high, each segment with its legend entry.
pub fn stacked_segments(
    chart: &mut Chart<'_, '_>,
    n: usize,
    seg: impl Fn(usize, usize) -> f64,
) -> Result<(), ClockError> {
    for (k, label) in LABELS.iter().enumerate() {
        let color = COLORS[k];
        chart
            .draw_series((0..n).map(|i| {
                let below: f64 = (0..k).map(|j| seg(i, j)).sum();
                let x = i as f64;
                Rectangle::new(
                    [(x - 0.35, below), (x + 0.35, below + seg(i, k))],
                    color.filled(),
                )
            }))
            .map_err(perr)?
            .label(*label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 7), (x + 14, y + 7)], color.filled()));
    }
    Ok(())
}

/// The name of the cell whose centre is at `x` (cells are 1 apart from 0), "" between cells:
/// the labels of a bar chart's category axis.
pub fn cell_label(names: &[String], x: f64) -> String {
    let i = x.round();
    if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < names.len() {
        names[i as usize].clone()
    } else {
        String::new()
    }
}

/// Draws `chart`'s legend in the figures' style: upper right, on a light background.
pub fn draw_legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    font_size: u32,
) -> Result<(), ClockError>
where
    DB::ErrorType: 'static,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font((FONT, font_size))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(perr)
}

/// Width and height of the figure.
pub const SIZE: (u32, u32) = (1600, 1250);

/// Draws the figure into `path` (PNG, [`SIZE`]).
pub fn render_png(r: &ClockReport, path: &Path) -> Result<(), ClockError> {
    register_font()?;
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(perr)?;
    let title = format!(
        "decode_sent → first_token by policy × send mode — preset {}, scenario {}, {} P/D + {} local requests/cell, transport {}, link {}",
        r.config.preset.name(),
        r.config.scenario.name(),
        r.requests,
        r.local_requests,
        r.transport,
        r.config
            .link_gbps
            .map_or_else(|| r.config.link_speed.name().to_string(), |g| format!("{g} GB/s"))
    );
    let root = root
        .titled(&title, (FONT, 24).into_font().style(FontStyle::Bold))
        .map_err(perr)?;
    let (top, bottom) = root.split_vertically(780);
    let (left, right) = top.split_horizontally(1060);
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
            .x_label_formatter(&|x| cell_label(&names, *x))
            .x_label_style((FONT, 17))
            .y_label_style((FONT, 17))
            .y_label_formatter(&|v| format!("{v:.0}"))
            .light_line_style(RGBColor(238, 238, 238))
            .y_desc("milliseconds (virtual clock; transfer measured)")
            .x_desc("D reservation policy / P send mode")
            .axis_desc_style((FONT, 18))
            .draw()
            .map_err(perr)?;
        stacked_segments(&mut chart, n, |i, k| mean_of(i, SEGMENTS[k]))?;
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
        draw_legend(&mut chart, 16)?;
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
            .y_label_formatter(&|y| cell_label(&names, n as f64 - 1.0 - y))
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
    draw_d_engine(r, &bottom, &names)?;
    root.present().map_err(perr)?;
    Ok(())
}

/// One figure of a cell.
type Metric = fn(&super::report::CellSummary) -> f64;

/// The bottom row: D as an engine.
fn draw_d_engine<DB: DrawingBackend>(
    r: &ClockReport,
    area: &DrawingArea<DB, plotters::coord::Shift>,
    names: &[String],
) -> Result<(), ClockError>
where
    DB::ErrorType: 'static,
{
    let n = r.summaries.len();
    let (left, right) = area.split_horizontally(1060);
    {
        let ymax = r
            .summaries
            .iter()
            .map(|s| s.served.ttft_ms.p90.max(s.tail_ms.p90))
            .fold(1.0f64, f64::max)
            * 1.3;
        let mut chart = ChartBuilder::on(&left)
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(90)
            .caption(
                "every request D serves: TTFT p50 / p90; tail after P's last chunk p90 (ms)",
                (FONT, 20),
            )
            .build_cartesian_2d(-0.6f64..(n as f64 - 0.4), 0f64..ymax)
            .map_err(perr)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n * 2 + 1)
            .x_label_formatter(&|x| cell_label(names, *x))
            .x_label_style((FONT, 15))
            .y_label_style((FONT, 16))
            .y_label_formatter(&|v| format!("{v:.0}"))
            .light_line_style(RGBColor(238, 238, 238))
            .y_desc("milliseconds")
            .axis_desc_style((FONT, 18))
            .draw()
            .map_err(perr)?;
        let bars: [(&str, f64, RGBColor, Metric); 3] = [
            ("TTFT p50", -0.27, COLORS[0], |s| s.served.ttft_ms.p50),
            ("TTFT p90", 0.0, COLORS[3], |s| s.served.ttft_ms.p90),
            ("tail p90", 0.27, COLORS[2], |s| s.tail_ms.p90),
        ];
        for (label, dx, color, get) in bars {
            chart
                .draw_series((0..n).map(|i| {
                    let x = i as f64 + dx;
                    Rectangle::new(
                        [(x - 0.12, 0.0), (x + 0.12, get(&r.summaries[i]))],
                        color.filled(),
                    )
                }))
                .map_err(perr)?
                .label(label)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 7), (x + 14, y + 7)], color.filled())
                });
        }
        draw_legend(&mut chart, 16)?;
    }
    {
        let pmax = r
            .summaries
            .iter()
            .map(|s| s.preemptions as f64)
            .fold(1.0f64, f64::max)
            * 1.9;
        let mut chart = ChartBuilder::on(&right)
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(140)
            .caption(
                "D preemptions (TPOT p90 · APC · land fallbacks)",
                (FONT, 19),
            )
            .build_cartesian_2d(0f64..pmax, -0.6f64..(n as f64 - 0.4))
            .map_err(perr)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(n * 2 + 1)
            .y_label_formatter(&|y| cell_label(names, n as f64 - 1.0 - y))
            .y_label_style((FONT, 15))
            .x_labels(5)
            .x_label_formatter(&|v| {
                if pmax < 10.0 {
                    format!("{v:.1}")
                } else {
                    format!("{v:.0}")
                }
            })
            .x_label_style((FONT, 15))
            .light_line_style(RGBColor(238, 238, 238))
            .x_desc("running requests preempted")
            .axis_desc_style((FONT, 18))
            .draw()
            .map_err(perr)?;
        let row = |i: usize| (n - 1 - i) as f64;
        chart
            .draw_series((0..n).map(|i| {
                Rectangle::new(
                    [
                        (0.0, row(i) - 0.35),
                        (r.summaries[i].preemptions as f64, row(i) + 0.35),
                    ],
                    COLORS[5].filled(),
                )
            }))
            .map_err(perr)?;
        chart
            .draw_series((0..n).map(|i| {
                let s = &r.summaries[i];
                let apc = s
                    .apc
                    .map_or_else(|| "-".to_string(), |a| format!("{:.0}%", 100.0 * a));
                Text::new(
                    format!(
                        "{} · {:.0} ms · {} · {}",
                        s.preemptions, s.served.tpot_ms.p90, apc, s.land_fallbacks
                    ),
                    (s.preemptions as f64 + pmax * 0.01, row(i) + 0.1),
                    (FONT, 14).into_font(),
                )
            }))
            .map_err(perr)?;
    }
    Ok(())
}

fn diamond(x: f64, y: f64, ymax: f64) -> Vec<(f64, f64)> {
    let dx = 0.06;
    let dy = ymax * 0.012;
    vec![(x - dx, y), (x, y + dy), (x + dx, y), (x, y - dy)]
}
