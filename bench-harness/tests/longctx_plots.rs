//! The longctx figures as a reader needs them: context length on a log2 axis, one colour per
//! system and one line style per head layout, a curve of one point still drawn, MegaTrain's
//! published points labelled as such. Drawn from a results document alone (no run).

use bench_harness::schema::Results;
use serde_json::json;

fn run(system: &str, variant: &str, status: &str, seq: usize, step_s: f64, tflops: f64) -> serde_json::Value {
    json!({
        "key": format!("context/{system}/7b/1x{seq}/{variant}"), "part": "context", "system": system,
        "model": "7b", "model_config": null, "batch_size": 1, "seq_len": seq, "tokens_per_step": seq,
        "variant": variant, "device": "cuda", "status": status, "reason": null, "command": [],
        "metrics_file": null, "log_file": null, "trace_file": null, "wall_s": null,
        "step_ms": step_s * 1e3, "model_tflops": tflops,
    })
}

fn bench(seq: usize, heads: (u64, u64, u64), systems: &[(&str, f64)]) -> serde_json::Value {
    let s: serde_json::Map<String, serde_json::Value> = systems
        .iter()
        .map(|(n, tf)| (n.to_string(), json!({"status": "ok", "fwd_bwd_tflops": tf})))
        .collect();
    json!({"seq_len": seq, "heads": heads.0, "kv_heads": heads.1, "head_dim": heads.2, "systems": s})
}

#[test]
fn longctx_figures_have_log2_lengths_a_colour_per_system_and_a_style_per_layout() {
    let doc = json!({
        "schema_version": 1, "suite": "longctx",
        "machine": {"hostname": "test", "cpus": 2, "ram_bytes": null, "gpu": null},
        "commit": null, "date": "2026-11-28T00:00:00Z", "config": {}, "flops_formula": "6NT",
        "runs": [
            run("ours", "lean", "ok", 131072, 46.0, 300.0),
            run("ours", "lean", "ok", 262144, 170.0, 310.0),
            // A system with one point only.
            run("torch", "default", "ok", 32768, 9.0, 250.0),
            run("megatrain_paper", "published", "published", 131072, 26.1, 0.0),
            run("megatrain_paper", "published", "published", 524288, 871.0, 0.0),
        ],
        "ratios": [], "figures": [],
        "attention": {"bench": [
            bench(16384, (28, 4, 128), &[("hopper", 430.0), ("cudnn", 580.0)]),
            bench(131072, (28, 4, 128), &[("hopper", 450.0), ("cudnn", 560.0)]),
            bench(16384, (32, 8, 64), &[("hopper", 300.0), ("cudnn", 430.0)]),
            bench(131072, (32, 8, 64), &[("hopper", 320.0), ("cudnn", 420.0)]),
        ]},
    });
    let results: Results = serde_json::from_value(doc).expect("a results document");
    let out = std::env::temp_dir().join(format!("mt-longctx-plots-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let figures = bench_harness::plot::draw_all(&results, &out).expect("figures drawn");
    for stem in ["context-step-time", "context-tflops", "attention-kernel"] {
        assert!(figures.contains(&format!("{stem}.svg")), "{stem} not in {figures:?}");
    }
    let svg = |stem: &str| std::fs::read_to_string(out.join(format!("{stem}.svg"))).unwrap();
    // The texts of an SVG (plotters writes each on lines of its own).
    let texts = |svg: &str| -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim().to_owned()))
            .collect()
    };
    let steps = svg("context-step-time");
    let t = texts(&steps);
    // log2 axis: the ticks are the powers of two of k tokens, one apart.
    for tick in ["32", "64", "128", "256", "512"] {
        assert!(t.iter().any(|x| x == tick), "tick {tick} missing from {t:?}");
    }
    for name in ["MegaTrain 7b published (GH200)", "torch 7b default", "ours 7b lean"] {
        assert!(t.iter().any(|x| x == name), "{name} missing from {t:?}");
    }
    // The lone torch point is drawn: a marker in torch's colour (the second system's).
    assert!(steps.contains("fill=\"#FF7F0E\""), "the one-point curve has no marker");
    let kernel = svg("attention-kernel");
    let t = texts(&kernel);
    for name in ["hopper 28/4 d128", "hopper 32/8 d64", "cudnn 28/4 d128", "cudnn 32/8 d64"] {
        assert!(t.iter().any(|x| x == name), "{name} not in the legend {t:?}");
    }
    // One colour per system: hopper's (the first colour) draws both of its layouts, the second
    // dashed (many short segments), so far more than its two legend lines and one solid line.
    let hopper_lines = kernel.split("<polyline").filter(|p| p.contains("stroke=\"#1F77B4\"")).count();
    assert!(
        hopper_lines > 6,
        "hopper's layouts are not drawn in one colour with a dashed second: {hopper_lines}"
    );
    let _ = std::fs::remove_dir_all(&out);
}
