//! The 120B case of the paper suite: the full model's step time, parameters, model FLOPs and
//! host memory extrapolated from measured slices (a few layers of the same shape).

use std::path::PathBuf;

use serde_json::Value;

use crate::schema::{Measured, Run, Status};
use crate::{io_err, Error, Result};

/// Fills the `largest/ours/120b/.../extrapolated` entry from the measured `slice` runs of the
/// same token shape: step time, parameters, model FLOPs and host RSS are each linear in the
/// layer count (every layer streams the same way, the outer unit's cost is fixed), so a
/// least-squares line through the slices gives the full model's (`num_hidden_layers` of its
/// config). Left `not_run` with the reason when fewer than two slices succeeded.
pub fn extrapolate_120b(runs: &mut [Run], machine_ram: Option<u64>) -> Result<()> {
    let Some(i) = runs.iter().position(|r| r.part == "largest" && r.variant == "extrapolated") else {
        return Ok(());
    };
    if runs[i].status != Status::NotRun || runs[i].reason.as_deref() != Some("computed after the slices ran")
    {
        return Ok(());
    }
    let target = &runs[i];
    let full_layers = match &target.model_config {
        Some(p) => {
            let path = PathBuf::from(p);
            let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
            let cfg: Value = serde_json::from_str(&text)
                .map_err(|e| Error::Parse { path: path.clone(), msg: e.to_string() })?;
            cfg["num_hidden_layers"]
                .as_u64()
                .ok_or_else(|| Error::Parse { path, msg: "no num_hidden_layers".into() })? as f64
        }
        None => return Ok(()),
    };
    struct Point {
        layers: f64,
        step_s: f64,
        params: f64,
        flops: f64,
        rss: f64,
        label: String,
    }
    let points: Vec<Point> = runs
        .iter()
        .filter(|r| r.part == "slice" && r.status == Status::Ok && r.batch_size == target.batch_size)
        .filter(|r| r.seq_len == target.seq_len)
        .filter_map(|r| {
            let m = &r.measured;
            let step_s = m.step_ms? / 1e3;
            Some(Point {
                layers: m.num_hidden_layers? as f64,
                step_s,
                params: m.n_params? as f64,
                flops: m.model_tflops? * 1e12 * step_s,
                rss: m.host_rss_peak_bytes? as f64,
                label: format!("{} ({:.1} ms)", r.model, m.step_ms?),
            })
        })
        .collect();
    let distinct = points.iter().map(|p| p.layers as u64).collect::<std::collections::BTreeSet<_>>();
    if distinct.len() < 2 {
        runs[i].reason = Some(format!(
            "fewer than two slices with different layer counts succeeded ({} ok): nothing to extrapolate from",
            points.len()
        ));
        return Ok(());
    }
    // Least squares y = a + b·L over the slices; exact for two.
    let fit = |y: &dyn Fn(&Point) -> f64| {
        let n = points.len() as f64;
        let (sx, sy) = (points.iter().map(|p| p.layers).sum::<f64>(), points.iter().map(y).sum::<f64>());
        let sxx = points.iter().map(|p| p.layers * p.layers).sum::<f64>();
        let sxy = points.iter().map(|p| p.layers * y(p)).sum::<f64>();
        let b = (n * sxy - sx * sy) / (n * sxx - sx * sx);
        let a = (sy - b * sx) / n;
        (a, b)
    };
    let at = |(a, b): (f64, f64)| a + b * full_layers;
    let (step_fit, params, flops, rss) =
        (fit(&|p| p.step_s), at(fit(&|p| p.params)), at(fit(&|p| p.flops)), at(fit(&|p| p.rss)));
    let step_s = at(step_fit);
    let tokens = (target.batch_size * target.seq_len) as f64;
    // With three or more slices, how far the measured steps are from the line.
    let residual = (points.len() > 2).then(|| {
        let worst = points
            .iter()
            .map(|p| (p.step_s - (step_fit.0 + step_fit.1 * p.layers)).abs())
            .fold(0.0, f64::max);
        format!(" (largest residual of the step-time fit: {:.1} ms)", worst * 1e3)
    });
    let fits = match machine_ram {
        Some(ram) if (ram as f64) < rss => format!("more than this machine's {:.0} GB", ram as f64 / 1e9),
        Some(ram) => format!("within this machine's {:.0} GB", ram as f64 / 1e9),
        None => "this machine's memory is unknown".into(),
    };
    let r = &mut runs[i];
    r.status = Status::Extrapolated;
    r.reason = Some(format!(
        "not run: extrapolated to {full_layers} layers from the measured slices {} (every decoder layer \
         streamed, outer unit resident, as the full model's plan places them): step time {:.1} ms + \
         {:.1} ms per layer{}; parameters, model FLOPs and host RSS likewise linear in the layer count. \
         The slices ran with the planner's chunking for their size; the extrapolation assumes the full \
         model's plan chunks the same. The full model needs {:.0} GB of host memory ({fits})",
        points.iter().map(|p| p.label.as_str()).collect::<Vec<_>>().join(", "),
        step_fit.0 * 1e3,
        step_fit.1 * 1e3,
        residual.unwrap_or_default(),
        rss / 1e9
    ));
    r.measured = Measured {
        n_params: Some(params.round() as u64),
        num_hidden_layers: Some(full_layers as u64),
        step_ms: Some(step_s * 1e3),
        tokens_per_s: Some(tokens / step_s),
        model_tflops: Some(flops / step_s / 1e12),
        host_rss_peak_bytes: Some(rss.round() as u64),
        host_rss_peak_bytes_per_param: Some(rss / params),
        ..Measured::default()
    };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Measured;
    use crate::suites::model_config_path;

    fn run(part: &str, model: &str, status: Status, m: Measured) -> Run {
        Run::for_test(part, "ours", model, "default", status, m)
    }

    fn slice(layers: u64, step_ms: f64) -> Run {
        // 3.15e9 outer + 1.5e9 per layer; FLOPs 6·N·8192; RSS 14 B/param + 10 GB.
        let n = 3.15e9 + 1.5e9 * layers as f64;
        let m = Measured {
            num_hidden_layers: Some(layers),
            n_params: Some(n as u64),
            step_ms: Some(step_ms),
            model_tflops: Some(6.0 * n * 8192.0 / (step_ms / 1e3) / 1e12),
            host_rss_peak_bytes: Some((14.0 * n + 10e9) as u64),
            ..Measured::default()
        };
        run("slice", &format!("120b-L{layers}"), Status::Ok, m)
    }

    #[test]
    fn the_120b_entry_is_extrapolated_linearly_from_the_slices_and_says_so() {
        let target = || {
            let mut t = run("largest", "120b", Status::NotRun, Measured::default());
            t.variant = "extrapolated".into();
            t.model_config = Some(model_config_path("120b").unwrap().display().to_string());
            t.reason = Some("computed after the slices ran".into());
            t
        };
        let mut runs = vec![slice(1, 1500.0), slice(2, 2000.0), target()];
        extrapolate_120b(&mut runs, Some(128 << 30)).unwrap();
        let r = &runs[2];
        assert_eq!(r.status, Status::Extrapolated);
        let m = &r.measured;
        // 76 layers: 1000 ms + 500 ms per layer; N = 3.15e9 + 76 · 1.5e9.
        assert!((m.step_ms.unwrap() - 39_000.0).abs() < 1e-6, "{m:?}");
        let n = 3.15e9 + 76.0 * 1.5e9;
        assert!((m.n_params.unwrap() as f64 - n).abs() < 2.0);
        assert!((m.model_tflops.unwrap() - 6.0 * n * 8192.0 / 39.0 / 1e12).abs() < 1e-6);
        assert!((m.host_rss_peak_bytes_per_param.unwrap() - (14.0 + 10e9 / n)).abs() < 1e-6);
        assert_eq!(m.num_hidden_layers, Some(76));
        let why = r.reason.as_deref().unwrap();
        assert!(why.starts_with("not run: extrapolated to 76 layers") && why.contains("120b-L1"), "{why}");
        assert!(why.contains("more than this machine's 137 GB") && !why.contains("residual"), "{why}");
        // Three slices on a line: the residual is reported (0).
        let mut runs = vec![slice(1, 1500.0), slice(2, 2000.0), slice(3, 2500.0), target()];
        extrapolate_120b(&mut runs, None).unwrap();
        let why = runs[3].reason.as_deref().unwrap();
        assert!(why.contains("largest residual of the step-time fit: 0.0 ms"), "{why}");
        assert!((runs[3].measured.step_ms.unwrap() - 39_000.0).abs() < 1e-6);
        // One failed slice: nothing to extrapolate from, and it says so.
        let mut failed = slice(2, 2000.0);
        failed.status = Status::Failed;
        let mut runs = vec![slice(1, 1500.0), failed, target()];
        extrapolate_120b(&mut runs, None).unwrap();
        assert_eq!(runs[2].status, Status::NotRun);
        assert!(runs[2].reason.as_deref().unwrap().contains("fewer than two slices"));
    }
}
