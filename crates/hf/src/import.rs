//! Opening a Hugging Face model directory (config.json, single or sharded safetensors) and
//! streaming its weights into the host store, one tensor at a time.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};

use half::{bf16, f16};
use mt_core::{names, ModelConfig, ModelLayout};
use mt_store::HostStore;
use safetensors::Dtype;
use serde_json::Value;

use crate::header::{read_header, ShardHeader, TensorEntry};
use crate::{Error, Result};

/// Name of the single-file weights.
pub(crate) const SINGLE_FILE: &str = "model.safetensors";
/// Name of the shard index.
pub(crate) const INDEX_FILE: &str = "model.safetensors.index.json";
/// Bytes read per `read` call while importing (a multiple of every element size).
const READ_CHUNK: usize = 8 << 20;

/// A Hugging Face model directory whose config and shard headers have been read and checked
/// (no tensor data is read until [`import_weights`]).
#[derive(Debug, Clone)]
pub struct HfModelDir {
    /// The directory.
    pub dir: PathBuf,
    /// The validated model config.
    pub config: ModelConfig,
    /// `config.json` as written (kept to write it back on export).
    pub config_json: Value,
    shards: Vec<ShardHeader>,
    /// Tensor name -> (shard index, tensor index in that shard).
    where_is: HashMap<String, (usize, usize)>,
}

/// What a tensor found in the weights is, for the model of config.json.
enum Kind {
    /// A parameter of the layout.
    Param,
    /// A buffer saved by some exporters that is not a parameter (skipped).
    Ignored,
    /// Anything else: the config does not match the weights.
    Unexpected,
}

fn classify(cfg: &ModelConfig, layout: &ModelLayout, name: &str) -> Kind {
    if name.ends_with("rotary_emb.inv_freq") || (cfg.tie_word_embeddings && name == names::LM_HEAD) {
        Kind::Ignored
    } else if layout.resolve_piece(name).is_ok() {
        Kind::Param
    } else {
        Kind::Unexpected
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(Error::io(path))?;
    serde_json::from_str(&text).map_err(|source| Error::Json { path: path.to_owned(), source })
}

/// The shard file names of an index, in sorted order, after checking its structure.
fn index_shards(index: &Path, doc: &Value) -> Result<BTreeMap<String, String>> {
    let bad = |msg: String| Error::BadIndex { path: index.to_owned(), msg };
    let map = doc
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("missing `weight_map` object".into()))?;
    if map.is_empty() {
        return Err(bad("`weight_map` is empty".into()));
    }
    let mut out = BTreeMap::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("`weight_map[{name:?}]` is {file}, expected a file name string")))?;
        let p = Path::new(file);
        if file.is_empty() || !p.components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(bad(format!(
                "`weight_map[{name:?}]` = {file:?} is not a relative path inside the model directory"
            )));
        }
        out.insert(name.clone(), file.to_owned());
    }
    Ok(out)
}

impl HfModelDir {
    /// Reads `dir/config.json` (an unknown architecture is an error naming its `model_type`),
    /// finds the weights (`model.safetensors`, else `model.safetensors.index.json` and every
    /// shard it names) and parses every shard header. No tensor data is read.
    pub fn open(dir: &Path) -> Result<Self> {
        let config_path = dir.join("config.json");
        let config_json = read_json(&config_path)?;
        let config = ModelConfig::from_json(&config_json)
            .map_err(|source| Error::Config { path: config_path.clone(), source })?;

        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        let mut shards = Vec::new();
        let mut where_is: HashMap<String, (usize, usize)> = HashMap::new();
        if single.is_file() {
            let h = read_header(&single)?;
            for (j, t) in h.tensors.iter().enumerate() {
                where_is.insert(t.name.clone(), (0, j));
            }
            shards.push(h);
        } else if index.is_file() {
            let weight_map = index_shards(&index, &read_json(&index)?)?;
            let files: BTreeSet<&String> = weight_map.values().collect();
            let mut shard_of_file = HashMap::new();
            for file in files {
                let path = dir.join(file);
                if !path.is_file() {
                    return Err(Error::MissingShard { index: index.clone(), shard: file.clone(), path });
                }
                let h = read_header(&path)?;
                let s = shards.len();
                for (j, t) in h.tensors.iter().enumerate() {
                    if let Some(&(other, _)) = where_is.get(&t.name) {
                        return Err(Error::IndexMismatch {
                            index: index.clone(),
                            msg: format!(
                                "tensor `{}` is stored twice, in {} and in {}",
                                t.name,
                                shards[other].path.display(),
                                path.display()
                            ),
                        });
                    }
                    where_is.insert(t.name.clone(), (s, j));
                }
                shard_of_file.insert(file.clone(), s);
                shards.push(h);
            }
            for (name, file) in &weight_map {
                let s = shard_of_file[file];
                if where_is.get(name).map(|w| w.0) != Some(s) {
                    return Err(Error::IndexMismatch {
                        index: index.clone(),
                        msg: format!(
                            "the index puts tensor `{name}` in {file}, but that shard does not hold it"
                        ),
                    });
                }
            }
        } else {
            let has_bin =
                dir.join("pytorch_model.bin").exists() || dir.join("pytorch_model.bin.index.json").exists();
            let hint = if has_bin {
                "; only PyTorch .bin weights are present: convert them to safetensors first \
                 (e.g. load and save_pretrained with transformers)"
            } else {
                ""
            };
            return Err(Error::NoWeights { dir: dir.to_owned(), hint: hint.into() });
        }
        Ok(HfModelDir { dir: dir.to_owned(), config, config_json, shards, where_is })
    }

    /// Number of parameters the weights hold: the sum of the element counts of the tensors that
    /// map to parameters of the store (ignored buffers and a tied `lm_head.weight` excluded).
    pub fn n_params(&self) -> usize {
        let layout = ModelLayout::new(&self.config);
        self.tensors()
            .filter(|(_, t)| matches!(classify(&self.config, &layout, &t.name), Kind::Param))
            .map(|(_, t)| t.numel())
            .sum()
    }

    /// The safetensors files holding the weights, in the order they were read.
    pub fn shard_paths(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|s| s.path.as_path())
    }

    /// Every tensor in the weights with its shard, in shard then file order.
    fn tensors(&self) -> impl Iterator<Item = (&ShardHeader, &TensorEntry)> {
        self.shards.iter().flat_map(|s| s.tensors.iter().map(move |t| (s, t)))
    }

    fn find(&self, name: &str) -> Option<(usize, &TensorEntry)> {
        self.where_is.get(name).map(|&(s, j)| (s, &self.shards[s].tensors[j]))
    }
}

/// What [`import_weights`] read.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ImportReport {
    /// Tensors written into the store.
    pub n_tensors: usize,
    /// Parameters (elements) written into the store.
    pub n_params: usize,
    /// Tensor data bytes read from the shards.
    pub bytes_read: u64,
    /// Number of imported tensors per source dtype (`"BF16"`, `"F32"`, ...).
    pub source_dtypes: BTreeMap<String, usize>,
}

/// The element types the importer converts to f32.
#[derive(Clone, Copy)]
enum SrcDtype {
    F32,
    Bf16,
    F16,
}

impl SrcDtype {
    fn of(dtype: Dtype) -> Option<Self> {
        match dtype {
            Dtype::F32 => Some(SrcDtype::F32),
            Dtype::BF16 => Some(SrcDtype::Bf16),
            Dtype::F16 => Some(SrcDtype::F16),
            _ => None,
        }
    }

    /// Appends the little-endian `bytes` of elements of this type to `out` as f32.
    fn decode(self, bytes: &[u8], out: &mut Vec<f32>) {
        let u16s = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
        match self {
            SrcDtype::F32 => {
                out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            }
            SrcDtype::Bf16 => out.extend(bytes.chunks_exact(2).map(|b| bf16::from_bits(u16s(b)).to_f32())),
            SrcDtype::F16 => out.extend(bytes.chunks_exact(2).map(|b| f16::from_bits(u16s(b)).to_f32())),
        }
    }
}

/// Streams every parameter of `src` into `store`, which must have been created for
/// `src.config`'s layout. Everything that can be checked from the headers (missing and
/// unexpected tensors, shapes, dtypes) is checked before any data is read or written, so a
/// refused import leaves the store unchanged. Tensors are then read one at a time (in file
/// order), converted from F32/BF16/F16 to f32 and written with [`HostStore::write_param`] (which
/// zeroes the optimizer moments); peak extra memory is one tensor in f32 plus an 8 MiB buffer.
///
/// Ignored: tensors named `*rotary_emb.inv_freq`, and `lm_head.weight` when the config ties the
/// embeddings (with a warning).
///
/// A mixture-of-experts layer's experts may be stored packed (transformers 5's
/// `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) or expert by expert (what
/// `save_pretrained` writes: `mlp.experts.{e}.gate_proj.weight`, ..., Mixtral's
/// `block_sparse_moe.experts.{e}.w1.weight`, ...; [`ModelLayout::hf_pieces`]), not both.
pub fn import_weights(src: &HfModelDir, store: &HostStore) -> Result<ImportReport> {
    let _span = tracing::info_span!("hf_import", dir = %src.dir.display()).entered();
    let layout = ModelLayout::new(&src.config);
    if *store.layout() != layout {
        return Err(Error::ConfigMismatch(format!(
            "{} has {} parameters in {} layers, the store was built for {} in {} layers",
            src.dir.join("config.json").display(),
            layout.n_params(),
            layout.n_layers,
            store.layout().n_params(),
            store.layout().n_layers
        )));
    }

    // Pass 1: headers only. Each layout tensor whole, or else as its checkpoint pieces.
    let mut plan = Vec::new();
    for (name, unit, spec) in layout.all_params() {
        let pieces = match src.find(&name) {
            Some(_) => vec![(name, spec.shape.clone())],
            None => layout.hf_pieces(unit, spec).into_iter().map(|p| (p.name, p.shape)).collect(),
        };
        for (name, shape) in pieces {
            let (s, t) = src
                .find(&name)
                .ok_or_else(|| Error::MissingTensor { name: name.clone(), dir: src.dir.clone() })?;
            let shard = &src.shards[s].path;
            if t.shape != shape {
                return Err(Error::Shape {
                    name,
                    shard: shard.clone(),
                    expected: shape,
                    found: t.shape.clone(),
                });
            }
            let Some(dtype) = SrcDtype::of(t.dtype) else {
                return Err(Error::Dtype { name, shard: shard.clone(), dtype: t.dtype.to_string() });
            };
            plan.push((s, t, dtype));
        }
    }
    let planned: BTreeSet<&str> = plan.iter().map(|(_, t, _)| t.name.as_str()).collect();
    for (shard, t) in src.tensors() {
        match classify(&src.config, &layout, &t.name) {
            // An expert stored both packed and expert by expert: one of them would be ignored.
            Kind::Param if !planned.contains(t.name.as_str()) => {
                return Err(Error::UnexpectedTensor { name: t.name.clone(), shard: shard.path.clone() })
            }
            Kind::Param => {}
            Kind::Ignored if t.name == names::LM_HEAD => tracing::warn!(
                shard = %shard.path.display(),
                "ignoring lm_head.weight: config.json ties the word embeddings, so the head is the embedding matrix"
            ),
            Kind::Ignored => tracing::debug!(tensor = %t.name, "ignoring non-parameter buffer"),
            Kind::Unexpected => {
                return Err(Error::UnexpectedTensor { name: t.name.clone(), shard: shard.path.clone() })
            }
        }
    }

    // Pass 2: data, in file order.
    plan.sort_by_key(|&(s, t, _)| (s, t.start));
    let mut files: Vec<Option<File>> = src.shards.iter().map(|_| None).collect();
    let mut buf = vec![0u8; 0];
    let mut report = ImportReport::default();
    let mut written: Vec<(String, usize)> = Vec::new();
    for (s, t, dtype) in plan {
        let shard = &src.shards[s].path;
        let read_err = |source| Error::ReadTensor { name: t.name.clone(), shard: shard.clone(), source };
        let file = match &mut files[s] {
            Some(f) => f,
            slot => slot.insert(File::open(shard).map_err(Error::io(shard))?),
        };
        file.seek(SeekFrom::Start(t.start)).map_err(read_err)?;
        let mut values = Vec::with_capacity(t.numel());
        let mut left = usize::try_from(t.len)
            .map_err(|_| read_err(std::io::Error::other("tensor larger than the address space")))?;
        while left > 0 {
            let k = left.min(READ_CHUNK);
            buf.resize(k, 0);
            file.read_exact(&mut buf[..k]).map_err(read_err)?;
            dtype.decode(&buf[..k], &mut values);
            left -= k;
        }
        if let Some(index) = values.iter().position(|x| !x.is_finite()) {
            // Refused: what was written (whole tensors or a MoE layer's expert pieces) goes
            // back to zero (the store is as it was).
            for (name, numel) in &written {
                store.write_param(name, &vec![0.0; *numel])?;
            }
            let value = values[index];
            return Err(Error::NonFinite { name: t.name.clone(), shard: shard.clone(), index, value });
        }
        store.write_param(&t.name, &values)?;
        written.push((t.name.clone(), values.len()));
        report.n_tensors += 1;
        report.n_params += values.len();
        report.bytes_read += t.len;
        *report.source_dtypes.entry(t.dtype.to_string()).or_default() += 1;
    }
    tracing::info!(
        tensors = report.n_tensors,
        params = report.n_params,
        bytes = report.bytes_read,
        "imported weights from {}",
        src.dir.display()
    );
    Ok(report)
}
