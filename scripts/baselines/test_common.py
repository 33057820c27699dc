"""Tests of the torch-free parts of common.py (stdlib only; no GPU, no torch):

    python3 -m unittest discover -s scripts/baselines -p 'test_*.py'
"""

import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA_3_6B = os.path.join(ROOT, "bench-harness", "configs", "llama3-3.6b.json")


def llama_n_params(c: dict) -> int:
    """Parameter count of an untied Llama, by hand."""
    h, i, v, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    hd = c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    return 2 * v * h + layers * layer + h


class ActiveParams(unittest.TestCase):
    """The MoE shapes' active parameters and FLOPs, as `megatrain estimate` prints them."""

    def config(self, name):
        return common.read_config(os.path.join(ROOT, "bench-harness", "configs", name))

    def test_dense_counts_every_parameter(self):
        self.assertEqual(common.active_params(common.read_config(LLAMA_3_6B), 123), 123)

    def test_olmoe_counts_8_of_64_experts(self):
        c = self.config("olmoe-1b-7b.json")
        # megatrain estimate: 6919161856 parameters, 1.6578e13 FLOPs at 1 x 2048.
        n = common.active_params(c, 6_919_161_856)
        self.assertEqual(n, 6_919_161_856 - 16 * 56 * 3 * 2048 * 1024)
        f = common.model_flops_per_step(n, 1, 2048, 16, 2048)
        self.assertAlmostEqual(f / 1.6578e13, 1.0, places=4)

    def test_qwen3_30b_a3b_counts_8_of_128_experts(self):
        c = self.config("qwen3-30b-a3b.json")
        n = common.active_params(c, 30_532_122_624)
        self.assertEqual(n, 3_353_032_704)
        f = common.model_flops_per_step(n, 1, 2048, 48, 2048)
        self.assertAlmostEqual(f / 4.3676e13, 1.0, places=4)

    def test_dense_layers_among_moe_ones_are_refused(self):
        c = dict(self.config("qwen3-30b-a3b.json"), mlp_only_layers=[0])
        with self.assertRaises(ValueError):
            common.active_params(c, 1)


class Flops(unittest.TestCase):
    def test_formula(self):
        # 6*N*T + 6*L*S*H*T with T = B*S
        self.assertEqual(common.model_flops_per_step(100, 2, 8, 3, 4), 6 * 100 * 16 + 6 * 3 * 8 * 4 * 16)

    def test_llama_3_6b_matches_the_device_run(self):
        c = common.read_config(LLAMA_3_6B)
        d = common.model_dims(c)
        n = llama_n_params(c)
        self.assertEqual(n, 3_606_752_256)  # what HF reported on the H200
        f = common.model_flops_per_step(n, 4, 2048, d["num_hidden_layers"], d["hidden_size"])
        self.assertEqual(f, 185937740955648.0)


class Config(unittest.TestCase):
    def test_dims(self):
        d = common.model_dims(common.read_config(LLAMA_3_6B))
        self.assertEqual(
            (d["hidden_size"], d["num_hidden_layers"], d["num_key_value_heads"], d["head_dim"], d["vocab_size"]),
            (3072, 28, 8, 128, 128256),
        )

    def test_defaults_and_missing_type(self):
        with tempfile.TemporaryDirectory() as t:
            p = os.path.join(t, "c.json")
            cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                   "vocab_size": 256}
            with open(p, "w") as f:
                json.dump(cfg, f)
            d = common.model_dims(common.read_config(p))
            self.assertEqual((d["head_dim"], d["num_key_value_heads"], d["intermediate_size"]), (16, 4, None))
            del cfg["model_type"]
            with open(p, "w") as f:
                json.dump(cfg, f)
            with self.assertRaises(ValueError):
                common.read_config(p)


class Args(unittest.TestCase):
    base = ["--config", "c.json", "--batch-size", "8", "--seq-len", "16", "--steps", "3", "--metrics", "m.jsonl"]

    def test_micro_batch_default_and_accumulation(self):
        a = common.parse_args("t", self.base)
        self.assertEqual((a.micro_batch, a.grad_accum, a.device, a.lr), (8, 1, "cuda", 1e-5))
        a = common.parse_args("t", self.base + ["--micro-batch", "2"])
        self.assertEqual((a.micro_batch, a.grad_accum), (2, 4))

    def test_rejects_non_divisor(self):
        with self.assertRaises(SystemExit):
            common.parse_args("t", self.base + ["--micro-batch", "3"])


class Writer(unittest.TestCase):
    def test_records(self):
        with tempfile.TemporaryDirectory() as t:
            p = os.path.join(t, "sub", "m.jsonl")
            w = common.MetricsWriter(p, echo=False)
            a = common.parse_args("t", Args.base)
            c = {"model_type": "llama", "hidden_size": 4, "num_attention_heads": 1, "num_hidden_layers": 3,
                 "vocab_size": 10, "intermediate_size": 8}
            run = common.run_record("sys", a, c, 100, extra_field=1)
            w.write(run)
            w.write(common.step_record(1, 2.5, 0.5, 128, 1e12, 7, 9))
            w.write(common.error_record("sys", "out of GPU memory: x", step=2))
            w.close()
            with open(p) as f:
                recs = [json.loads(line) for line in f]
        self.assertEqual([r["type"] for r in recs], ["run", "step", "error"])
        r, s, e = recs
        self.assertEqual((r["system"], r["schema_version"], r["n_params"], r["tokens_per_step"]), ("sys", 1, 100, 128))
        self.assertEqual(r["model_flops_per_step"], common.model_flops_per_step(100, 8, 16, 3, 4))
        self.assertEqual((r["flops_formula"], r["extra_field"], r["model"]["num_hidden_layers"]),
                         ("6*N*T + 6*L*S*H*T", 1, 3))
        self.assertEqual((s["step"], s["loss"], s["step_ms"], s["tokens_per_s"], s["model_tflops"]),
                         (1, 2.5, 500.0, 256.0, 2.0))
        self.assertEqual((s["gpu_peak_bytes"], s["gpu_reserved_peak_bytes"], s["warmup"]), (7, 9, True))
        if sys.platform.startswith("linux"):
            self.assertGreater(s["rss_bytes"], 0)
            self.assertGreaterEqual(s["rss_peak_bytes"], s["rss_bytes"])
        self.assertEqual((e["reason"], e["step"]), ("out of GPU memory: x", 2))


if __name__ == "__main__":
    unittest.main()


class PeftBaseline(unittest.TestCase):
    """The peft baseline's command line and its adapters' targets, without torch or peft."""

    def test_targets_follow_megatrains_defaults(self):
        import peft_lora

        dense = common.read_config(LLAMA_3_6B)
        self.assertEqual(
            peft_lora.lora_targets(dense, None),
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )
        olmoe = common.read_config(os.path.join(ROOT, "bench-harness", "configs", "olmoe-1b-7b.json"))
        self.assertEqual(peft_lora.lora_targets(olmoe, None), ["q_proj", "k_proj", "v_proj", "o_proj"])
        self.assertEqual(peft_lora.lora_targets(dense, "q_proj, v_proj"), ["q_proj", "v_proj"])

    def test_extra_options_parse_beside_the_shared_ones(self):
        argv = ["--config", LLAMA_3_6B, "--batch-size", "4", "--seq-len", "16", "--steps", "2"]
        argv += ["--metrics", "m.jsonl", "--lora-rank", "8"]
        a = common.parse_args("t", argv, [("--lora-rank", dict(type=int, default=16))])
        self.assertEqual((a.lora_rank, a.batch_size, a.grad_accum), (8, 4, 1))
        import contextlib
        import io

        with self.assertRaises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            common.parse_args("t", argv)
