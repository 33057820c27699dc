//! Writing the store's master weights as a Hugging Face model directory that
//! `transformers.AutoModelForCausalLM.from_pretrained` loads: config.json, one or more
//! safetensors shards (+ index), and the tokenizer files copied from the source model.
//!
//! Streaming: each shard is written tensor by tensor from [`HostStore::read_param`], so at most
//! one tensor is held in memory. Crash safety: every file is first written as `NAME.tmp` and
//! fsynced; only when all of them are complete is the old `config.json` removed, the new files
//! renamed into place, stale shards removed and `config.json` — the completeness marker —
//! renamed in last. An error removes every file the call wrote.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use half::bf16;
use mt_core::{ModelConfig, ModelLayout};
use mt_store::HostStore;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;
use serde_json::{json, Value};

use crate::import::{INDEX_FILE, SINGLE_FILE};
use crate::{Error, Result};

/// Default largest shard, in bytes: Hugging Face's `"5GB"` (5·10⁹ bytes, as
/// `huggingface_hub` splits state dicts). A tensor larger than this gets a shard of its own.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Files copied from [`ExportOptions::copy_files_from`] when present there: the tokenizer and
/// generation settings that make the output directory usable on its own.
pub const COPIED_FILES: [&str; 10] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
];

/// Element type of the exported weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExportDtype {
    /// The fp32 master weights, bit for bit.
    #[default]
    F32,
    /// bf16, rounded to nearest even: half the size, what most checkpoints ship in.
    Bf16,
}

impl ExportDtype {
    fn safetensors(self) -> Dtype {
        match self {
            ExportDtype::F32 => Dtype::F32,
            ExportDtype::Bf16 => Dtype::BF16,
        }
    }

    fn size(self) -> u64 {
        match self {
            ExportDtype::F32 => 4,
            ExportDtype::Bf16 => 2,
        }
    }

    /// The name transformers uses in config.json's `torch_dtype` / `dtype`.
    pub fn torch_name(self) -> &'static str {
        match self {
            ExportDtype::F32 => "float32",
            ExportDtype::Bf16 => "bfloat16",
        }
    }

    /// Appends `src` encoded little-endian in this type to `out`.
    fn encode(self, src: &[f32], out: &mut Vec<u8>) {
        match self {
            ExportDtype::F32 => out.extend(src.iter().flat_map(|x| x.to_le_bytes())),
            ExportDtype::Bf16 => {
                out.extend(src.iter().flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes()))
            }
        }
    }
}

/// How [`export`] writes the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportOptions {
    /// Element type of the weights.
    pub dtype: ExportDtype,
    /// Largest shard in bytes of tensor data; more weights than this are split into
    /// `model-0000i-of-0000N.safetensors` files with an index.
    pub max_shard_bytes: u64,
    /// Directory to copy the [`COPIED_FILES`] from (usually the `--model` directory).
    pub copy_files_from: Option<PathBuf>,
    /// Test hook: the weights' writes fail with "no space left on device" once this many bytes
    /// of them are written (a disk that fills during the export).
    #[doc(hidden)]
    pub fail_after_bytes: Option<u64>,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            dtype: ExportDtype::F32,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            copy_files_from: None,
            fail_after_bytes: None,
        }
    }
}

/// What [`export`] wrote.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ExportReport {
    /// Every file written in the output directory (final names), config.json last.
    pub files: Vec<PathBuf>,
    /// Number of safetensors files.
    pub n_shards: usize,
    /// Bytes written, all files together.
    pub bytes_written: u64,
}

/// One tensor of a shard plan.
struct Planned {
    name: String,
    shape: Vec<usize>,
    bytes: u64,
}

/// Splits the tensors, in order, into shards of at most `max` bytes (a larger tensor alone).
fn plan_shards(tensors: Vec<Planned>, max: u64) -> Vec<Vec<Planned>> {
    let mut shards: Vec<Vec<Planned>> = Vec::new();
    let mut size = 0;
    for t in tensors {
        match shards.last_mut() {
            Some(cur) if size + t.bytes <= max => {
                size += t.bytes;
                cur.push(t);
            }
            _ => {
                size = t.bytes;
                shards.push(vec![t]);
            }
        }
    }
    shards
}

fn shard_name(i: usize, n: usize) -> String {
    if n == 1 {
        SINGLE_FILE.to_owned()
    } else {
        format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
    }
}

/// Whether `name` looks like a shard of a sharded export (`model-XXXXX-of-YYYYY.safetensors`).
fn is_shard_name(name: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    name.strip_prefix("model-")
        .and_then(|r| r.strip_suffix(".safetensors"))
        .and_then(|r| r.split_once("-of-"))
        .is_some_and(|(a, b)| digits(a) && digits(b))
}

/// Files this call has created; removed on drop unless disarmed (the error path).
struct Written {
    paths: Vec<PathBuf>,
    armed: bool,
}

impl Drop for Written {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        for p in &self.paths {
            if let Err(e) = std::fs::remove_file(p) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!("export failed and {} could not be removed: {e}", p.display());
                }
            }
        }
    }
}

/// Creates `path` (replacing any file there), registers it for removal on error, lets `fill`
/// write it, flushes and fsyncs it. Returns the bytes written.
fn write_file(
    path: &Path,
    written: &mut Written,
    fill: impl FnOnce(&mut BufWriter<File>) -> Result<()>,
) -> Result<u64> {
    let file = File::create(path).map_err(Error::io(path))?;
    written.paths.push(path.to_owned());
    let mut w = BufWriter::with_capacity(1 << 20, file);
    fill(&mut w)?;
    let file = w.into_inner().map_err(|e| Error::Io { path: path.to_owned(), source: e.into_error() })?;
    file.sync_all().map_err(Error::io(path))?;
    Ok(file.metadata().map_err(Error::io(path))?.len())
}

/// Writes one safetensors shard: header (with `__metadata__ = {"format": "pt"}`, which
/// transformers requires), padded with spaces to a multiple of 8, then each tensor's data.
fn write_shard(
    store: &HostStore,
    tensors: &[Planned],
    dtype: ExportDtype,
    path: &Path,
    written: &mut Written,
    room: &mut Option<u64>,
) -> Result<u64> {
    let mut infos = Vec::with_capacity(tensors.len());
    let mut at = 0usize;
    for t in tensors {
        let len = usize::try_from(t.bytes).map_err(|_| Error::Options("tensor too large".into()))?;
        infos.push((
            t.name.clone(),
            TensorInfo { dtype: dtype.safetensors(), shape: t.shape.clone(), data_offsets: (at, at + len) },
        ));
        at += len;
    }
    let format = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    let meta = Metadata::new(Some(format), infos)
        .map_err(|e| Error::Options(format!("cannot describe shard {}: {e}", path.display())))?;
    let mut header = serde_json::to_vec(&meta)
        .map_err(|e| Error::Options(format!("cannot serialise the header of {}: {e}", path.display())))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    write_file(path, written, |w| {
        let mut put = |bytes: &[u8]| {
            if let Some(left) = room {
                if (bytes.len() as u64) > *left {
                    let full = std::io::Error::new(
                        std::io::ErrorKind::StorageFull,
                        "No space left on device (injected)",
                    );
                    return Err(Error::Io { path: path.to_owned(), source: full });
                }
                *left -= bytes.len() as u64;
            }
            w.write_all(bytes).map_err(Error::io(path))
        };
        put(&(header.len() as u64).to_le_bytes())?;
        put(&header)?;
        let mut buf = Vec::new();
        for t in tensors {
            let values = store.read_param(&t.name)?;
            for chunk in values.chunks(1 << 20) {
                buf.clear();
                dtype.encode(chunk, &mut buf);
                put(&buf)?;
            }
        }
        Ok(())
    })
}

fn to_json_bytes(v: &Value) -> Result<Vec<u8>> {
    let mut text = serde_json::to_string_pretty(v)
        .map_err(|e| Error::Options(format!("cannot serialise JSON: {e}")))?
        .into_bytes();
    text.push(b'\n');
    Ok(text)
}

fn rename(from: &Path, to: &Path) -> Result<()> {
    std::fs::rename(from, to).map_err(|source| Error::Io {
        path: to.to_owned(),
        source: std::io::Error::new(
            source.kind(),
            format!("renaming {} into place: {source}", from.display()),
        ),
    })
}

fn remove_if_present(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(Error::Io { path: path.to_owned(), source: e })
        }
        _ => Ok(()),
    }
}

/// Makes the renames and removals done in `dir` so far durable before the next step.
fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(Error::io(dir))
}

fn tmp_name(name: &str) -> String {
    format!("{name}.tmp")
}

/// Writes a Hugging Face model directory at `out` (created if missing) from the store's master
/// weights: `config.json` (`config_json` with `torch_dtype` — and `dtype`, if present — set to
/// the export dtype, and no `quantization_config`), `model.safetensors` or
/// `model-0000i-of-0000N.safetensors` shards plus `model.safetensors.index.json`, tensors in
/// [`ModelLayout::hf_tensors`] order (a tied model has no `lm_head.weight`, as transformers saves
/// it; a mixture of experts' experts one by one, under the family's per-expert names, except
/// GPT-OSS's, whose packed tensors are transformers' own parameters), and the [`COPIED_FILES`]
/// found in `opts.copy_files_from` (GPT-OSS's harmony chat format travels in its
/// `chat_template.jinja`).
///
/// `config_json` must describe the store's model ([`Error::ConfigMismatch`] otherwise). Files of
/// the same names in `out` are replaced; shards of an earlier export that the new one does not
/// use are removed. On error no `config.json` is left that would make a partial output look
/// complete, and every file this call wrote is removed; an error before the commit (e.g. a full
/// disk while writing shards) leaves an earlier export in `out` intact.
pub fn export(
    store: &HostStore,
    config_json: &Value,
    out: &Path,
    opts: &ExportOptions,
) -> Result<ExportReport> {
    let _span = tracing::info_span!("hf_export", out = %out.display()).entered();
    if opts.max_shard_bytes == 0 {
        return Err(Error::Options("max_shard_bytes must be greater than zero".into()));
    }
    let cfg = ModelConfig::from_json(config_json)
        .map_err(|source| Error::Config { path: PathBuf::from("config.json (passed to export)"), source })?;
    let layout = ModelLayout::new(&cfg);
    if layout != *store.layout() {
        return Err(Error::ConfigMismatch(format!(
            "the config implies {} parameters in {} layers, the store holds {} in {} layers",
            layout.n_params(),
            layout.n_layers,
            store.layout().n_params(),
            store.layout().n_layers
        )));
    }
    let mut config_out = config_json.clone();
    if let Some(obj) = config_out.as_object_mut() {
        // The weights leave as plain floats (an MXFP4 import was dequantised): a
        // `quantization_config` would make transformers look for packed tensors.
        obj.remove("quantization_config");
        obj.insert("torch_dtype".into(), json!(opts.dtype.torch_name()));
        if obj.contains_key("dtype") {
            obj.insert("dtype".into(), json!(opts.dtype.torch_name()));
        }
    }

    // A MoE layer's experts expert by expert, as transformers' save_pretrained writes them.
    let planned = layout
        .hf_tensors()
        .into_iter()
        .map(|p| Planned { bytes: p.numel() as u64 * opts.dtype.size(), name: p.name, shape: p.shape })
        .collect();
    let shards = plan_shards(planned, opts.max_shard_bytes);
    let n_shards = shards.len();

    std::fs::create_dir_all(out).map_err(Error::io(out))?;
    let mut written = Written { paths: Vec::new(), armed: true };
    let mut bytes_written = 0;
    // (tmp, final) pairs, renamed in this order at commit.
    let mut commits: Vec<(PathBuf, PathBuf)> = Vec::new();
    let mut weight_map = BTreeMap::new();
    let mut total_size = 0u64;
    let mut shard_names = BTreeSet::new();
    let mut room = opts.fail_after_bytes;
    for (i, tensors) in shards.iter().enumerate() {
        let name = shard_name(i, n_shards);
        let tmp = out.join(tmp_name(&name));
        bytes_written += write_shard(store, tensors, opts.dtype, &tmp, &mut written, &mut room)?;
        tracing::debug!(shard = %name, tensors = tensors.len(), "wrote shard");
        for t in tensors {
            weight_map.insert(t.name.clone(), name.clone());
            total_size += t.bytes;
        }
        commits.push((tmp, out.join(&name)));
        shard_names.insert(name);
    }
    if n_shards > 1 {
        let index = json!({
            "metadata": { "total_parameters": layout.n_params(), "total_size": total_size },
            "weight_map": weight_map,
        });
        let text = to_json_bytes(&index)?;
        let tmp = out.join(tmp_name(INDEX_FILE));
        bytes_written += write_file(&tmp, &mut written, |w| w.write_all(&text).map_err(Error::io(&tmp)))?;
        commits.push((tmp, out.join(INDEX_FILE)));
    }
    if let Some(src) = &opts.copy_files_from {
        for name in COPIED_FILES {
            let from = src.join(name);
            if !from.is_file() {
                continue;
            }
            let tmp = out.join(tmp_name(name));
            bytes_written += write_file(&tmp, &mut written, |w| {
                let mut f = File::open(&from).map_err(Error::io(&from))?;
                std::io::copy(&mut f, w).map_err(Error::io(&tmp))?;
                Ok(())
            })?;
            commits.push((tmp, out.join(name)));
        }
    }
    let config_text = to_json_bytes(&config_out)?;
    let config_tmp = out.join(tmp_name("config.json"));
    bytes_written +=
        write_file(&config_tmp, &mut written, |w| w.write_all(&config_text).map_err(Error::io(&config_tmp)))?;

    // Commit. From here on the old export (if any) is no longer complete: remove its marker first.
    remove_if_present(&out.join("config.json"))?;
    sync_dir(out)?;
    let mut files = Vec::new();
    for (tmp, fin) in commits {
        rename(&tmp, &fin)?;
        written.paths.push(fin.clone());
        files.push(fin);
    }
    let stale = |name: &str| {
        (is_shard_name(name) && !shard_names.contains(name))
            || (n_shards > 1 && name == SINGLE_FILE)
            || (n_shards == 1 && name == INDEX_FILE)
    };
    for entry in std::fs::read_dir(out).map_err(Error::io(out))? {
        let entry = entry.map_err(Error::io(out))?;
        if let Some(name) = entry.file_name().to_str().filter(|n| stale(n)) {
            tracing::info!("removing stale {name} of an earlier export");
            remove_if_present(&entry.path())?;
        }
    }
    sync_dir(out)?;
    let config_path = out.join("config.json");
    rename(&config_tmp, &config_path)?;
    written.paths.push(config_path.clone());
    files.push(config_path);
    sync_dir(out)?;
    written.armed = false;
    tracing::info!(shards = n_shards, bytes = bytes_written, "exported to {}", out.display());
    Ok(ExportReport { files, n_shards, bytes_written })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(sizes: &[u64]) -> Vec<Planned> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &b)| Planned { name: format!("t{i}"), shape: vec![], bytes: b })
            .collect()
    }

    #[test]
    fn shards_fill_greedily_and_a_big_tensor_gets_its_own() {
        let sizes = |s: &[Vec<Planned>]| {
            s.iter().map(|v| v.iter().map(|t| t.bytes).collect()).collect::<Vec<Vec<u64>>>()
        };
        assert_eq!(sizes(&plan_shards(planned(&[4, 4, 4, 4]), 8)), vec![vec![4, 4], vec![4, 4]]);
        assert_eq!(sizes(&plan_shards(planned(&[4, 20, 4]), 8)), vec![vec![4], vec![20], vec![4]]);
        assert_eq!(sizes(&plan_shards(planned(&[3, 3, 3]), 100)), vec![vec![3, 3, 3]]);
    }

    #[test]
    fn shard_names_follow_transformers() {
        assert_eq!(shard_name(0, 1), "model.safetensors");
        assert_eq!(shard_name(1, 12), "model-00002-of-00012.safetensors");
        assert!(is_shard_name("model-00002-of-00012.safetensors"));
        assert!(!is_shard_name("model-0000a-of-00012.safetensors"));
        assert!(!is_shard_name("model.safetensors"));
        assert!(!is_shard_name("model-00001-of-00002.safetensors.tmp"));
    }

    #[test]
    fn bf16_encoding_rounds_to_nearest_even() {
        // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1 + 2^-7: ties go to the even 1.0;
        // 1 + 3*2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
        let mut out = Vec::new();
        ExportDtype::Bf16.encode(&[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0], &mut out);
        assert_eq!(out, [0x80, 0x3f, 0x82, 0x3f]);
    }
}
