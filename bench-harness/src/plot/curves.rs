//! Loss curves of megatrain runs that differ in one option (`--optim-states`, say), drawn from
//! their metrics files: the held-out loss and the training loss against the step, one curve per
//! run, and every run's held-out loss relative to the first run's at the same steps.

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde_json::Value;

use super::{lines, msg, register_font, Draw, Series, YAxis, SIZE};
use crate::run::Metrics;
use crate::Error;

/// (step, `key`) of every record that has both, in file order.
fn points(records: &[Value], key: &str) -> Vec<(f64, f64)> {
    records.iter().filter_map(|r| Some((r.get("step")?.as_f64()?, r.get(key)?.as_f64()?))).collect()
}

/// Every run's eval loss divided by the first run's at the steps both logged; the first run's
/// own curve (1.0) comes first, so the others keep their colours of the eval-loss figure.
fn ratios(eval: &[Series]) -> Vec<Series> {
    let Some((base_name, base)) = eval.first() else { return Vec::new() };
    eval.iter()
        .map(|(name, pts)| {
            let ratio = pts
                .iter()
                .filter_map(|&(step, loss)| {
                    let b = base.iter().find(|p| p.0 == step)?.1;
                    (b != 0.0).then_some((step, loss / b))
                })
                .collect();
            (format!("{name} / {base_name}"), ratio)
        })
        .collect()
}

/// Draws `eval-loss`, `eval-loss-ratio` (two runs or more) and `train-loss`, each as PNG and SVG,
/// into `out` from the named runs' metrics; returns their paths relative to `out`. `title` ends
/// each figure's caption (the model and machine, say). A run without a step or eval record is an
/// error naming it; a figure no run has points for is not drawn.
pub fn draw_curves(runs: &[(String, Metrics)], title: &str, out: &Path) -> crate::Result<Vec<String>> {
    if let Some((name, _)) = runs.iter().find(|(_, m)| m.steps.is_empty() && m.evals.is_empty()) {
        return Err(Error::Options(format!("run {name:?} has no step or eval records to draw")));
    }
    register_font();
    let eval: Vec<Series> = runs.iter().map(|(n, m)| (n.clone(), points(&m.evals, "eval_loss"))).collect();
    let train: Vec<Series> = runs.iter().map(|(n, m)| (n.clone(), points(&m.steps, "loss"))).collect();
    let has_points = |s: &[Series]| s.iter().any(|(_, p)| !p.is_empty());
    let mut files: Vec<PathBuf> = Vec::new();
    if has_points(&eval) {
        let caption = format!("Held-out loss: {title}");
        render!(out, "eval-loss", files, |root| lines(
            &root,
            &caption,
            ("step", "eval loss (mean over held-out targets)"),
            &eval,
            YAxis::Data
        ));
        let ratio = ratios(&eval);
        if runs.len() >= 2 && has_points(&ratio[1..]) {
            let caption = format!("Held-out loss relative to {}: {title}", runs[0].0);
            render!(out, "eval-loss-ratio", files, |root| lines(
                &root,
                &caption,
                ("step", &format!("eval loss relative to {}", runs[0].0)),
                &ratio,
                YAxis::Data
            ));
        }
    }
    if has_points(&train) {
        let caption = format!("Training loss: {title}");
        render!(out, "train-loss", files, |root| train_lines(&root, &caption, &train));
    }
    Ok(files.iter().map(|p| p.strip_prefix(out).unwrap_or(p).display().to_string()).collect())
}

/// The training loss of every step: hundreds of points a run, so lines without markers.
fn train_lines<DB: DrawingBackend>(root: &super::Area<DB>, title: &str, series: &[Series]) -> Draw {
    let pts = || series.iter().flat_map(|s| s.1.iter());
    let (x0, x1) = pts().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = pts().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let span = (y1 - y0).max(1e-9);
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(x0..x1.max(x0 + 1.0), (y0 - span * 0.05)..(y1 + span * 0.05))
        .map_err(msg)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("training loss")
        .label_style(("sans-serif", 15))
        .draw()
        .map_err(msg)?;
    for (i, (name, points)) in series.iter().enumerate() {
        let c = super::color(i);
        chart
            .draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(1)))
            .map_err(msg)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    super::draw_legend(&mut chart)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_match_steps_and_keep_the_first_run_first() {
        let eval = vec![
            ("fp32".to_owned(), vec![(0.0, 4.0), (20.0, 2.0), (40.0, 1.0)]),
            ("int8".to_owned(), vec![(0.0, 4.0), (40.0, 1.1)]),
        ];
        let r = ratios(&eval);
        assert_eq!(r[0], ("fp32 / fp32".to_owned(), vec![(0.0, 1.0), (20.0, 1.0), (40.0, 1.0)]));
        assert_eq!(r[1].0, "int8 / fp32");
        assert_eq!(r[1].1.len(), 2);
        assert!((r[1].1[1].1 - 1.1).abs() < 1e-12);
    }
}
