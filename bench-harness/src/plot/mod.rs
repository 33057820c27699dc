//! Figures of a results file, each as PNG and SVG next to the JSON: throughput vs model size,
//! ratio to the baselines, ablation bars, depth scaling, a stream timeline of one step per
//! trace, host bytes per parameter. A figure whose data the suite lacks is not drawn. The loss
//! curves of runs' metrics files ([`draw_curves`]) are drawn the same way.
//!
//! Text in PNGs is rasterised with `ab_glyph` from a DejaVu Sans subset shipped in
//! `assets/` (no fontconfig or freetype needed); SVGs carry text as text.

use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::run::parse_trace;
use crate::schema::{Results, Run, Status};
use crate::Error;

type Area<DB> = DrawingArea<DB, Shift>;
type Draw = std::result::Result<(), String>;

const FONT: &[u8] = include_bytes!("../../assets/DejaVuSans-subset.ttf");
const SIZE: (u32, u32) = (1000, 600);

fn msg<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 6] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
    ];
    C[i % C.len()]
}

/// Draws one figure into `OUT/STEM.png` and `OUT/STEM.svg` (the body is expanded once per
/// backend) and pushes both paths.
macro_rules! render {
    ($out:expr, $stem:expr, $files:expr, |$root:ident| $body:expr) => {{
        for ext in ["png", "svg"] {
            let path = $out.join(format!("{}.{ext}", $stem));
            let drawn: Draw = if ext == "png" {
                let $root = BitMapBackend::new(&path, SIZE).into_drawing_area();
                $root.fill(&WHITE).map_err(msg).and_then(|_| $body).and_then(|_| $root.present().map_err(msg))
            } else {
                let $root = SVGBackend::new(&path, SIZE).into_drawing_area();
                $root.fill(&WHITE).map_err(msg).and_then(|_| $body).and_then(|_| $root.present().map_err(msg))
            };
            drawn.map_err(|msg| Error::Plot { path: path.clone(), msg })?;
            $files.push(path);
        }
    }};
}

mod curves;
pub use curves::draw_curves;

/// A named series of (x, y) points.
type Series = (String, Vec<(f64, f64)>);

/// The series legend, the same on every chart: upper right, on a translucent white box.
fn draw_legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
) -> Draw {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(msg)
}

/// Where a line chart's y axis starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum YAxis {
    /// At zero (throughput, time): the heights compare as ratios.
    FromZero,
    /// Just below the smallest point (losses, ratios near 1): small differences stay visible.
    Data,
}

fn lines<DB: DrawingBackend>(
    root: &Area<DB>,
    title: &str,
    axes: (&str, &str),
    series: &[Series],
    y_axis: YAxis,
) -> Draw {
    let pts = || series.iter().flat_map(|s| s.1.iter());
    let (x0, x1) = pts().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = pts().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let pad = ((x1 - x0) * 0.08).max(x1.abs() * 0.1).max(1e-9);
    let y_range = match y_axis {
        YAxis::FromZero => 0.0..(y1.max(0.0) * 1.2).max(1e-9),
        YAxis::Data => {
            // Room above for the legend; a flat series still gets a visible band.
            let span = (y1 - y0).max(y1.abs() * 1e-3).max(1e-9);
            (y0 - span * 0.05)..(y1 + span * 0.35)
        }
    };
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d((x0 - pad)..(x1 + pad), y_range)
        .map_err(msg)?;
    chart
        .configure_mesh()
        .x_desc(axes.0)
        .y_desc(axes.1)
        .label_style(("sans-serif", 15))
        .draw()
        .map_err(msg)?;
    for (i, (name, points)) in series.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(2)))
            .map_err(msg)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, c.filled()))).map_err(msg)?;
    }
    draw_legend(&mut chart)
}

/// A curve of a chart: its name, a colour key (one colour per distinct key: the system) and a
/// style key (one line style and marker per distinct key: the head layout or variant).
struct Curve {
    name: String,
    colour: String,
    style: String,
    points: Vec<(f64, f64)>,
}

/// The index of `key` among the distinct keys in order of first appearance.
fn key_index<'a>(keys: impl Iterator<Item = &'a str>, key: &str) -> usize {
    let mut seen: Vec<&str> = Vec::new();
    for k in keys {
        if !seen.contains(&k) {
            seen.push(k);
        }
    }
    seen.iter().position(|k| *k == key).unwrap_or(0)
}

/// Curves against a base-2 logarithmic x axis (context lengths): one colour per system, one line
/// style and marker per layout (solid with circles, dashed with triangles, dotted with squares),
/// every point marked so that a curve of one point still shows.
fn log2_curves<DB: DrawingBackend>(
    root: &Area<DB>,
    title: &str,
    axes: (&str, &str),
    curves: &[Curve],
) -> Draw {
    let pts = || curves.iter().flat_map(|c| c.points.iter());
    let (x0, x1) = pts().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let y1 = pts().fold(0.0f64, |a, p| a.max(p.1));
    // Half an octave of room at each end.
    let (lo, hi) = (x0 / std::f64::consts::SQRT_2, x1 * std::f64::consts::SQRT_2);
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d((lo..hi).log_scale().base(2.0), 0.0..(y1 * 1.2).max(1e-9))
        .map_err(msg)?;
    chart
        .configure_mesh()
        .x_desc(axes.0)
        .y_desc(axes.1)
        .x_label_formatter(&|v| format!("{}", v.round()))
        .label_style(("sans-serif", 15))
        .draw()
        .map_err(msg)?;
    for c in curves {
        let colour = color(key_index(curves.iter().map(|c| c.colour.as_str()), &c.colour));
        let style = key_index(curves.iter().map(|c| c.style.as_str()), &c.style) % 3;
        let line = colour.stroke_width(2);
        let pts = c.points.iter().copied();
        let series = match style {
            0 => chart.draw_series(LineSeries::new(pts, line)),
            1 => chart.draw_series(DashedLineSeries::new(pts, 10, 6, line)),
            _ => chart.draw_series(DashedLineSeries::new(pts, 3, 4, line)),
        };
        series.map_err(msg)?.label(c.name.as_str()).legend(move |(x, y)| {
            let mark: DynElement<'static, DB, (i32, i32)> = match style {
                0 => Circle::new((x + 10, y), 4, colour.filled()).into_dyn(),
                1 => TriangleMarker::new((x + 10, y), 5, colour.filled()).into_dyn(),
                _ => Rectangle::new([(x + 6, y - 4), (x + 14, y + 4)], colour.filled()).into_dyn(),
            };
            EmptyElement::at((0, 0)) + PathElement::new(vec![(x, y), (x + 20, y)], line) + mark
        });
        let marks = c.points.iter().map(|&p| -> DynElement<'static, DB, (f64, f64)> {
            match style {
                0 => Circle::new(p, 5, colour.filled()).into_dyn(),
                1 => TriangleMarker::new(p, 6, colour.filled()).into_dyn(),
                _ => Cross::new(p, 5, colour.stroke_width(2)).into_dyn(),
            }
        });
        chart.draw_series(marks).map_err(msg)?;
    }
    draw_legend(&mut chart)
}

/// A bar: its label and stacked segments (value, legend index).
type Bar = (String, Vec<(f64, usize)>);

fn bars<DB: DrawingBackend>(
    root: &Area<DB>,
    title: &str,
    y_desc: &str,
    legend: &[&str],
    items: &[Bar],
    hline: Option<f64>,
) -> Draw {
    let n = items.len();
    let total = |b: &Bar| b.1.iter().map(|s| s.0).sum::<f64>();
    let ymax = items.iter().map(total).chain(hline).fold(0.0f64, f64::max) * 1.4;
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d((0..n.max(2) - 1).into_segmented(), 0.0..ymax.max(1e-9))
        .map_err(msg)?;
    let label = |v: &SegmentValue<usize>| match v {
        SegmentValue::CenterOf(i) => items.get(*i).map_or(String::new(), |b| b.0.clone()),
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&label)
        .y_desc(y_desc)
        .label_style(("sans-serif", if n > 6 { 12 } else { 14 }))
        .draw()
        .map_err(msg)?;
    for (k, name) in legend.iter().enumerate() {
        if !items.iter().any(|b| b.1.iter().any(|s| s.1 == k)) {
            continue;
        }
        let c = color(k);
        chart
            .draw_series(items.iter().enumerate().flat_map(|(i, b)| {
                let below: f64 = b.1.iter().take_while(|s| s.1 != k).map(|s| s.0).sum();
                b.1.iter().filter(|s| s.1 == k).map(move |s| {
                    let mut r = Rectangle::new(
                        [(SegmentValue::Exact(i), below), (SegmentValue::Exact(i + 1), below + s.0)],
                        c.filled(),
                    );
                    r.set_margin(0, 0, 12, 12);
                    r
                })
            }))
            .map_err(msg)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], c.filled()));
    }
    let style = TextStyle::from(("sans-serif", 14).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
    let values = items
        .iter()
        .enumerate()
        .map(|(i, b)| Text::new(short(total(b)), (SegmentValue::CenterOf(i), total(b)), style.clone()));
    chart.draw_series(values).map_err(msg)?;
    if let Some(y) = hline {
        let ends = [(SegmentValue::Exact(0), y), (SegmentValue::Last, y)];
        chart.draw_series(LineSeries::new(ends, BLACK.stroke_width(1))).map_err(msg)?;
    }
    draw_legend(&mut chart)
}

const LANES: [&str; 4] = ["host (CPU optimizer)", "h2d", "compute", "d2h"];

fn timeline<DB: DrawingBackend>(root: &Area<DB>, title: &str, spans: &[crate::run::Span]) -> Draw {
    let end = spans.iter().map(|s| s.start_ms + s.dur_ms).fold(0.0f64, f64::max).max(1e-6);
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(170)
        .build_cartesian_2d(0.0..end * 1.02, (0..LANES.len() - 1).into_segmented())
        .map_err(msg)?;
    let lane = |v: &SegmentValue<usize>| match v {
        SegmentValue::CenterOf(i) => LANES.get(*i).map_or(String::new(), |s| (*s).to_owned()),
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(LANES.len())
        .y_label_formatter(&lane)
        .x_desc("time since the step began (ms)")
        .label_style(("sans-serif", 15))
        .draw()
        .map_err(msg)?;
    let boxes = spans.iter().filter(|s| s.lane < LANES.len()).map(|s| {
        let (y0, y1) = (SegmentValue::Exact(s.lane), SegmentValue::Exact(s.lane + 1));
        // Operations shorter than 0.2% of the step are drawn that wide so they stay visible.
        let dur = s.dur_ms.max(end * 0.002);
        let mut r =
            Rectangle::new([(s.start_ms, y0), (s.start_ms + dur, y1)], color(s.lane).mix(0.7).filled());
        r.set_margin(8, 8, 0, 0);
        r
    });
    chart.draw_series(boxes).map_err(msg)?;
    Ok(())
}

/// Three significant digits, no exponent for the magnitudes plotted here.
fn short(v: f64) -> String {
    match v.abs() {
        a if a >= 100.0 => format!("{v:.0}"),
        a if a >= 10.0 => format!("{v:.1}"),
        a if a >= 1.0 => format!("{v:.2}"),
        _ => format!("{v:.3}"),
    }
}

fn ok(r: &Run) -> bool {
    r.status == Status::Ok
}

fn tokens_label(r: &Run) -> String {
    format!("{}x{}", r.batch_size, r.seq_len)
}

/// Groups points into series named by `name`, sorted by x.
fn group(
    runs: &[&Run],
    name: impl Fn(&Run) -> String,
    point: impl Fn(&Run) -> Option<(f64, f64)>,
) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    for r in runs {
        let Some(p) = point(r) else { continue };
        let n = name(r);
        match out.iter_mut().find(|s| s.0 == n) {
            Some(s) => s.1.push(p),
            None => out.push((n, vec![p])),
        }
    }
    for s in &mut out {
        s.1.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

/// Makes the shipped font the PNG backend's "sans-serif" (once per process).
fn register_font() {
    static FONT_ONCE: Once = Once::new();
    FONT_ONCE.call_once(|| {
        // The font is compiled in and known to parse (tests draw text); nothing to recover.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

/// Draws every figure the results have data for into `out`; returns their paths relative to it.
pub fn draw_all(results: &Results, out: &Path) -> crate::Result<Vec<String>> {
    register_font();
    let mut files: Vec<PathBuf> = Vec::new();
    let part = |p: &str| -> Vec<&Run> { results.runs.iter().filter(|r| ok(r) && r.part == p).collect() };
    let machine = results.machine.gpu.as_ref().map_or(results.machine.hostname.clone(), |g| g.name.clone());

    let tput = part("throughput");
    let billions = tput.iter().any(|r| r.measured.n_params.is_some_and(|n| n >= 1_000_000_000));
    let (unit, x_desc) =
        if billions { (1e9, "parameters (billions)") } else { (1e6, "parameters (millions)") };
    let series = group(
        &tput,
        |r| format!("{} {}", r.system, tokens_label(r)),
        |r| Some((r.measured.n_params? as f64 / unit, r.measured.model_tflops?)),
    );
    if !series.is_empty() {
        let title = format!("Model TFLOP/s vs model size ({machine})");
        render!(out, "throughput", files, |root| lines(
            &root,
            &title,
            (x_desc, "model TFLOP/s (6NT + 6LSHT)"),
            &series,
            YAxis::FromZero
        ));
    }

    let peers = ["deepspeed", "torch"];
    let throughput: Vec<_> = results.ratios.iter().filter(|r| r.part == "throughput").collect();
    // The peer is the bar's colour; the label names the model (when there are several), the
    // tokens per step and our variant (when not the planner's default).
    let one_model = throughput.windows(2).all(|w| w[0].model == w[1].model);
    let ratio_bars: Vec<Bar> = throughput
        .iter()
        .filter_map(|r| {
            let k = peers.iter().position(|p| *p == r.peer)?;
            let model = if one_model { String::new() } else { format!("{} ", r.model) };
            let variant = if r.variant == "default" { String::new() } else { format!(" {}", r.variant) };
            let label = format!("{model}{}x{}{variant}", r.batch_size, r.seq_len);
            Some((label, vec![(r.tokens_per_s_ratio_ours_over_peer, k)]))
        })
        .collect();
    if !ratio_bars.is_empty() {
        let legend = ["ours / DeepSpeed ZeRO-3 offload", "ours / resident PyTorch"];
        let title = match (one_model, throughput.first()) {
            (true, Some(r)) => format!("Throughput ratio, same run ({})", r.model),
            _ => "Throughput ratio, same run".to_owned(),
        };
        render!(out, "ratio", files, |root| bars(
            &root,
            &title,
            "tokens/s ratio",
            &legend,
            &ratio_bars,
            Some(1.0)
        ));
    }

    let ablation: Vec<Bar> = part("ablation")
        .iter()
        .filter_map(|r| Some((r.variant.clone(), vec![(r.measured.tokens_per_s?, 0)])))
        .collect();
    if !ablation.is_empty() {
        let a = part("ablation");
        let title = format!("Ablations: {} {} on {machine}", a[0].model, tokens_label(a[0]));
        render!(out, "ablation", files, |root| bars(
            &root,
            &title,
            "tokens/s",
            &["megatrain"],
            &ablation,
            None
        ));
    }

    let depth = group(
        &part("depth"),
        |r| format!("{} {}", r.system, tokens_label(r)),
        |r| Some((r.measured.num_hidden_layers? as f64, r.measured.step_ms?)),
    );
    if !depth.is_empty() {
        render!(out, "depth", files, |root| lines(
            &root,
            "Depth scaling: time per step vs layers (same width)",
            ("transformer layers", "step time (ms)"),
            &depth,
            YAxis::FromZero
        ));
    }

    for r in results.runs.iter().filter(|r| ok(r)) {
        let Some(trace) = &r.trace_file else { continue };
        let Ok(text) = std::fs::read_to_string(out.join(trace)) else { continue };
        let spans = parse_trace(&text).map_err(|msg| Error::Parse { path: out.join(trace), msg })?;
        if spans.is_empty() {
            continue;
        }
        let stem = format!("timeline-{}-{}-{}-{}", r.part, r.model, tokens_label(r), r.variant);
        let title =
            format!("One step of megatrain: {} {} {} ({machine})", r.model, tokens_label(r), r.variant);
        render!(out, stem, files, |root| timeline(&root, &title, &spans));
    }

    // longctx: step time and model TFLOP/s against context length (published points included,
    // labelled as such), and the attention kernel against each SDPA backend.
    let context: Vec<&Run> = results
        .runs
        .iter()
        .filter(|r| r.part == "context" && (ok(r) || r.status == Status::Published))
        .collect();
    // One colour per system (MegaTrain's published points their own), one style per model.
    let ctx_curves = |y: &dyn Fn(&Run) -> Option<f64>| -> Vec<Curve> {
        let mut curves: Vec<Curve> = Vec::new();
        for r in &context {
            let Some(v) = y(r) else { continue };
            let (colour, name) = match r.status {
                Status::Published => {
                    ("published".to_owned(), format!("MegaTrain {} published (GH200)", r.model))
                }
                _ => (r.system.to_string(), format!("{} {} {}", r.system, r.model, r.variant)),
            };
            let point = (r.seq_len as f64 / 1024.0, v);
            match curves.iter_mut().find(|c| c.name == name) {
                Some(c) => c.points.push(point),
                None => curves.push(Curve { name, colour, style: r.model.clone(), points: vec![point] }),
            }
        }
        for c in &mut curves {
            c.points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        curves
    };
    let steps = ctx_curves(&|r| Some(r.measured.step_ms? / 1e3));
    if !steps.is_empty() {
        let title = format!("Step time vs context length, one sequence a step ({machine})");
        render!(out, "context-step-time", files, |root| log2_curves(
            &root,
            &title,
            ("context length (k tokens, log2)", "seconds per step"),
            &steps
        ));
        let tf = ctx_curves(&|r| r.measured.model_tflops);
        let title = format!("Model TFLOP/s vs context length ({machine})");
        render!(out, "context-tflops", files, |root| log2_curves(
            &root,
            &title,
            ("context length (k tokens, log2)", "model TFLOP/s (6NT + 6LSHT, causal)"),
            &tf
        ));
    }
    if let Some(doc) = &results.attention {
        let curves = attention_curves(doc);
        if !curves.is_empty() {
            let title = format!("Causal attention fwd+bwd, bf16 ({machine})");
            render!(out, "attention-kernel", files, |root| log2_curves(
                &root,
                &title,
                ("sequence length (k tokens, log2)", "TFLOP/s (fwd 2BHS^2D, bwd 2.5x)"),
                &curves
            ));
        }
    }

    let memory: Vec<Bar> = tput
        .iter()
        .filter_map(|r| {
            let total = r.measured.host_rss_peak_bytes_per_param?;
            let store = r.measured.host_store_bytes_per_param.unwrap_or(0.0).min(total);
            let segs = if store > 0.0 { vec![(store, 0), (total - store, 1)] } else { vec![(total, 2)] };
            Some((format!("{} {} {}", r.system, r.model, tokens_label(r)), segs))
        })
        .collect();
    if !memory.is_empty() {
        let legend = [
            "megatrain store (master, AdamW, grads)",
            "other (rings, activations, runtime)",
            "whole process (no breakdown)",
        ];
        render!(out, "host-memory", files, |root| bars(
            &root,
            "Host memory: peak RSS bytes per parameter",
            "bytes / parameter",
            &legend,
            &memory,
            None
        ));
    }
    Ok(files.iter().map(|p| p.strip_prefix(out).unwrap_or(p).display().to_string()).collect())
}

/// The kernel benchmark's fwd+bwd TFLOP/s (`scripts/attention_bench.py`'s document): one curve per
/// system and head layout, coloured by system, styled by layout (`heads/kv_heads d head_dim`).
fn attention_curves(doc: &serde_json::Value) -> Vec<Curve> {
    let mut curves: Vec<Curve> = Vec::new();
    for b in doc["bench"].as_array().into_iter().flatten() {
        let (s, h, kv) = (b["seq_len"].as_f64(), b["heads"].as_u64(), b["kv_heads"].as_u64());
        let (Some(s), Some(h), Some(kv)) = (s, h, kv) else { continue };
        let layout = format!("{h}/{kv} d{}", b["head_dim"].as_u64().unwrap_or(128));
        for (sys, e) in b["systems"].as_object().into_iter().flatten() {
            let Some(tf) = e["fwd_bwd_tflops"].as_f64() else { continue };
            let name = format!("{sys} {layout}");
            match curves.iter_mut().find(|c| c.name == name) {
                Some(c) => c.points.push((s / 1024.0, tf)),
                None => curves.push(Curve {
                    name,
                    colour: sys.clone(),
                    style: layout.clone(),
                    points: vec![(s / 1024.0, tf)],
                }),
            }
        }
    }
    curves
}
