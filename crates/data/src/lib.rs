//! Training data for megatrain: JSON Lines files of pre-tokenised, text or chat samples, turned
//! into fixed-length token sequences with next-token targets, offline, exactly and
//! deterministically. The crate knows nothing about the engine: it produces [`TokenBatch`]es.
//!
//! # Formats
//!
//! One JSON object per line, with exactly one key; blank lines are skipped (a UTF-8 BOM before
//! the first line too). The whole file uses one format.
//!
//! * `{"input_ids": [..]}`: pre-tokenised. Every token after the first is a target.
//! * `{"text": "..."}`: tokenised with the model's `tokenizer.json` with special tokens
//!   (so a BOS post-processor applies), then the `eos_token` of `tokenizer_config.json` is
//!   appended. Every token after the first is a target.
//! * `{"messages": [{"role": .., "content": ..}, ..]}`: rendered with the model's chat template
//!   ([`Tokenizer::render_chat`]) and tokenised without added special tokens (the template
//!   writes them). Only assistant turns are trained on: for assistant message `i`, the
//!   characters between `render(messages[..i], add_generation_prompt=true)` and
//!   `render(messages[..=i], add_generation_prompt=false)` are assistant characters (both
//!   renderings must be prefixes of the full rendering, else the template is not prefix-stable
//!   and the line is an error); a token is a target when its first byte lies in an assistant
//!   span. With a ChatML template that is the assistant's content and the `<|im_end|>\n` that
//!   closes it. A conversation without an assistant message is an error.
//!
//! Every token id must be below the model's `vocab_size`. Errors about a line name the file and
//! the line (`data.jsonl:7: ...`).
//!
//! # Sequences
//!
//! * A sample none of whose tokens (after the first) is a target predicts nothing: it is
//!   dropped at load and counted ([`Dataset::n_dropped_samples`]), so no batch is ever empty
//!   of targets.
//! * A sample is a list of tokens, each flagged "target" or not. A sample longer than `seq_len`
//!   is an error, or with [`DataOptions::truncate`] is cut to its first `seq_len` tokens.
//! * Packing ([`DataOptions::pack`], the default): samples, in file order, are packed greedily
//!   into sequences of `seq_len` tokens: a sample that does not fit in the space left in the
//!   current sequence starts a new one (samples are never split). The rest of a sequence is
//!   padding with token id [`PAD_ID`] (0). Without packing every sample has its own sequence.
//! * Targets (HF's labels shifted by one): `targets[t] = ids[t + 1]` when token `t + 1` is a
//!   target of the same sample as token `t`, else [`IGNORE_INDEX`] (-100). So the last position
//!   of a sequence, the last token of every sample and padding are never trained on, and a line
//!   of exactly `seq_len` input ids gives `targets = ids[1..] + [-100]`.
//!
//! # Eval split
//!
//! With `eval_fraction = f > 0` (which needs at least 2 samples), the sample indices `0..n` are
//! shuffled (Fisher–Yates with the crate's SplitMix64 stream for (seed, "split"); see `rng.rs`)
//! and the last `min(ceil(f * n), n - 1)` of them are eval samples (a product within 1e-9 of an
//! integer counts as that integer). The split is made before packing; train and eval samples
//! are each packed in file order.
//!
//! # Order
//!
//! Train sequence `k` is the `k`-th packed train sequence. Step `s` with batch `B` uses the
//! global sequence indices `s*B .. s*B + B`; global index `i` is position `i % n_train` of epoch
//! `i / n_train`. Without shuffling, position `p` of every epoch is sequence `p`; with it,
//! epoch `e` visits the sequences in the order of `0..n_train` shuffled by the SplitMix64 stream
//! for (seed, "epoch", e). A step's batch depends only on (file, options, step, batch). In
//! particular, with `shuffle` off and lines of exactly `seq_len` input ids, step `k` trains on
//! lines `k*B .. k*B + B` in file order (wrapping around at the end of the file).

#![forbid(unsafe_code)]

mod chat;
mod dataset;
mod error;
mod pack;
mod rng;
mod sample;
mod tokenizer;

pub use chat::Message;
pub use dataset::{Cursor, DataOptions, Dataset, TokenBatch};
pub use error::{Error, Result, TokenizersError};
pub use pack::{IGNORE_INDEX, PAD_ID};
pub use sample::{file_format, Format};
pub use tokenizer::{Encoded, Tokenizer};
