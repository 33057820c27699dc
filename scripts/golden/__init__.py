"""The golden-fixture generator behind `scripts/make_golden.py` (the entry point; its docstring
is the specification), one module per concern:

- `specs`: the tiny models, the batch and the training recipe every fixture shares;
- `model`: a model built and perturbed as specified, its config.json and RoPE checked;
- `run`: the batch, the loss and the three AdamW steps;
- `checks`: the mixture-of-experts margins (routing, GPT-OSS's clamps, OLMoE's idle expert);
- `fixture`: one fixture written, byte-reproducibly;
- `precision`: the diagnostics `--precision-report` and `--f32-control`.
"""
