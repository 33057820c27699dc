//! `--suite curves`: loss curves drawn from megatrain metrics files alone (no run): the held-out
//! loss of every run, its ratio to the first run's, the training loss; a run with nothing to draw
//! is refused by name.

use bench_harness::run::parse_metrics;

/// A metrics file of `steps` steps with an eval record every `every` steps whose loss is
/// `scale` times a falling curve.
fn metrics(steps: u32, every: u32, scale: f64) -> String {
    let mut text = String::from("{\"type\":\"run\",\"n_params\":1000,\"tokens_per_step\":1024}\n");
    for step in 0..=steps {
        let loss = scale * 4.0 / f64::from(step + 1).sqrt();
        if step > 0 {
            text.push_str(&format!("{{\"type\":\"step\",\"step\":{step},\"loss\":{loss}}}\n"));
        }
        if step % every == 0 {
            text.push_str(&format!("{{\"type\":\"eval\",\"step\":{step},\"eval_loss\":{loss}}}\n"));
        }
    }
    text
}

fn svg_texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim().to_owned()))
        .collect()
}

#[test]
fn curves_draw_eval_loss_its_ratio_to_the_first_run_and_training_loss() {
    let runs: Vec<_> = [("fp32", 1.0), ("bf16", 1.01), ("int8", 1.03)]
        .into_iter()
        .map(|(name, scale)| (name.to_owned(), parse_metrics(&metrics(100, 20, scale)).expect("parses")))
        .collect();
    let out = std::env::temp_dir().join(format!("mt-curves-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let figures = bench_harness::plot::draw_curves(&runs, "test model", &out).expect("figures drawn");
    for stem in ["eval-loss", "eval-loss-ratio", "train-loss"] {
        for ext in ["png", "svg"] {
            let f = format!("{stem}.{ext}");
            assert!(figures.contains(&f), "{f} not in {figures:?}");
            assert!(std::fs::metadata(out.join(&f)).expect("written").len() > 1000, "{f} is empty");
        }
    }
    let read = |stem: &str| std::fs::read_to_string(out.join(format!("{stem}.svg"))).unwrap();
    let eval = svg_texts(&read("eval-loss"));
    for name in ["fp32", "bf16", "int8", "Held-out loss: test model"] {
        assert!(eval.iter().any(|t| t == name), "{name} missing from {eval:?}");
    }
    let ratio = svg_texts(&read("eval-loss-ratio"));
    for name in ["fp32 / fp32", "bf16 / fp32", "int8 / fp32"] {
        assert!(ratio.iter().any(|t| t == name), "{name} missing from {ratio:?}");
    }
    // The ratio axis spans the data (1.0 to 1.03), not zero to it: ticks half a percent apart.
    assert!(ratio.iter().any(|t| t == "1.005"), "the ratio axis is not the data's: {ratio:?}");
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn a_run_without_records_is_refused_by_name() {
    let runs = vec![
        ("fp32".to_owned(), parse_metrics(&metrics(40, 20, 1.0)).unwrap()),
        ("empty".to_owned(), parse_metrics("{\"type\":\"run\"}\n").unwrap()),
    ];
    let out = std::env::temp_dir().join(format!("mt-curves-empty-{}", std::process::id()));
    let err = bench_harness::plot::draw_curves(&runs, "t", &out).unwrap_err().to_string();
    assert!(err.contains("\"empty\""), "{err}");
}
