//! Opening a Hugging Face model directory (config.json, single or sharded safetensors) and
//! streaming its weights into the host store, one tensor at a time.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};

use half::{bf16, f16};
use mt_core::{names, ModelConfig, ModelLayout};
use mt_store::{HostStore, ParamSink};
use safetensors::Dtype;
use serde_json::Value;

use crate::header::{read_header, ShardHeader, TensorEntry};
use crate::{mxfp4, Error, Result};

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
    /// A parameter of the layout (or a piece of one).
    Param,
    /// The blocks of an MXFP4 parameter (two values a byte).
    Mxfp4Blocks,
    /// The scales of an MXFP4 parameter.
    Mxfp4Scales,
    /// A buffer saved by some exporters that is not a parameter (skipped).
    Ignored,
    /// Anything else: the config does not match the weights.
    Unexpected,
}

/// What `name` is; `mxfp4`: config.json declares MXFP4 weights, whose `NAME_blocks` and
/// `NAME_scales` stand for the layout's `NAME`.
fn classify(cfg: &ModelConfig, layout: &ModelLayout, mxfp4: bool, name: &str) -> Kind {
    let stored_as = |suffix: &str| {
        mxfp4
            && name
                .strip_suffix(suffix)
                .is_some_and(|n| layout.resolve(n).is_ok_and(|(_, spec)| spec.shape.len() == 3))
    };
    if name.ends_with("rotary_emb.inv_freq") || (cfg.tie_word_embeddings && name == names::LM_HEAD) {
        Kind::Ignored
    } else if layout.resolve_piece(name).is_ok() {
        Kind::Param
    } else if stored_as(mxfp4::BLOCKS_SUFFIX) {
        Kind::Mxfp4Blocks
    } else if stored_as(mxfp4::SCALES_SUFFIX) {
        Kind::Mxfp4Scales
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
    /// map to parameters of the store (ignored buffers and a tied `lm_head.weight` excluded; an
    /// MXFP4 matrix counts its values, two a byte of its blocks).
    pub fn n_params(&self) -> usize {
        let layout = ModelLayout::new(&self.config);
        let mx = mxfp4::declared(&self.config_json);
        self.tensors()
            .map(|(_, t)| match classify(&self.config, &layout, mx, &t.name) {
                Kind::Param => t.numel(),
                Kind::Mxfp4Blocks => 2 * t.numel(),
                Kind::Mxfp4Scales | Kind::Ignored | Kind::Unexpected => 0,
            })
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

/// One tensor to read in pass 2.
enum Item<'a> {
    /// A tensor (or one expert's piece) stored as floats.
    Float { shard: usize, t: &'a TensorEntry, dtype: SrcDtype },
    /// A layout matrix `name` `[E, in, out]` stored as MXFP4 blocks and scales.
    Mxfp4 { name: String, n_experts: usize, shape: mxfp4::ExpertShape, stored: mxfp4::Stored<'a> },
}

impl Item<'_> {
    /// Where its bytes start: (shard, offset) of the tensor or of the blocks.
    fn position(&self) -> (usize, u64) {
        match self {
            Item::Float { shard, t, .. } => (*shard, t.start),
            Item::Mxfp4 { stored, .. } => (stored.blocks.0, stored.blocks.1.start),
        }
    }
}

/// Streams every parameter of `src` into `store`, which must have been created for
/// `src.config`'s layout. Everything that can be checked from the headers (missing and
/// unexpected tensors, shapes, dtypes) is checked before any data is read or written, so a
/// refused import leaves the store unchanged. Tensors are then read one at a time (in file
/// order), converted from F32/BF16/F16 to f32 and written with [`ParamSink::write_param`] (which
/// zeroes the optimizer moments); peak extra memory is one tensor in f32 plus an 8 MiB buffer.
///
/// Ignored: tensors named `*rotary_emb.inv_freq`, and `lm_head.weight` when the config ties the
/// embeddings (with a warning).
///
/// A mixture-of-experts layer's experts may be stored packed (transformers 5's
/// `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) or expert by expert (what
/// `save_pretrained` writes: `mlp.experts.{e}.gate_proj.weight`, ..., Mixtral's
/// `block_sparse_moe.experts.{e}.w1.weight`, ...; [`ModelLayout::hf_pieces`]), not both. When
/// config.json declares MXFP4 weights (the released GPT-OSS checkpoints), an expert matrix may
/// be stored as its `_blocks` and `_scales` (`crate::mxfp4`): it is dequantised exactly, one
/// expert at a time (peak extra memory: one expert's matrix in f32).
pub fn import_weights(src: &HfModelDir, store: &HostStore) -> Result<ImportReport> {
    import_weights_into(src, store)
}

/// [`import_weights`] into any [`ParamSink`] of the model's layout: the host store, or a LoRA
/// run's frozen base (`mt_store::FrozenBase`).
pub fn import_weights_into(src: &HfModelDir, store: &dyn ParamSink) -> Result<ImportReport> {
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
    let mx = mxfp4::declared(&src.config_json);

    // Pass 1: headers only. Each layout tensor whole, as MXFP4 blocks and scales, or else as its
    // checkpoint pieces.
    let mut plan = Vec::new();
    let mut planned: BTreeSet<&str> = BTreeSet::new();
    for (name, unit, spec) in layout.all_params() {
        let blocks = src.find(&format!("{name}{}", mxfp4::BLOCKS_SUFFIX));
        if let (None, Some((s, t)), false) = (src.find(&name), blocks, mx) {
            return Err(Error::Mxfp4 {
                name: t.name.clone(),
                shard: src.shards[s].path.clone(),
                msg: "config.json declares no MXFP4 weights (quantization_config.quant_method \"mxfp4\", as the \
                      released GPT-OSS checkpoints do)"
                    .into(),
            });
        }
        if src.find(&name).is_none() && blocks.is_some() {
            let item = plan_mxfp4(src, &name, &spec.shape)?;
            if let Item::Mxfp4 { stored, .. } = &item {
                planned.extend([stored.blocks.1.name.as_str(), stored.scales.1.name.as_str()]);
            }
            plan.push(item);
            continue;
        }
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
            planned.insert(t.name.as_str());
            plan.push(Item::Float { shard: s, t, dtype });
        }
    }
    for (shard, t) in src.tensors() {
        match classify(&src.config, &layout, mx, &t.name) {
            // An expert stored both packed and expert by expert (or also as MXFP4): one of them
            // would be ignored.
            Kind::Param | Kind::Mxfp4Blocks | Kind::Mxfp4Scales if !planned.contains(t.name.as_str()) => {
                return Err(Error::UnexpectedTensor { name: t.name.clone(), shard: shard.path.clone() })
            }
            Kind::Param | Kind::Mxfp4Blocks | Kind::Mxfp4Scales => {}
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

    // Pass 2: data, in file order. A refused value sets what was written (whole tensors, a MoE
    // layer's expert pieces, the experts of an MXFP4 tensor so far) back to zero: the store is
    // as it was.
    plan.sort_by_key(Item::position);
    let mut reader = Reader { src, files: src.shards.iter().map(|_| None).collect(), buf: Vec::new() };
    let mut report = ImportReport::default();
    let mut written: Vec<(String, usize)> = Vec::new();
    for item in plan {
        let done = match item {
            Item::Float { shard, t, dtype } => read_float(&mut reader, store, shard, t, dtype, &mut written),
            Item::Mxfp4 { name, n_experts, shape, stored } => {
                read_mxfp4(&mut reader, store, &name, n_experts, shape, stored, &mut written)
            }
        };
        let (bytes, dtype) = match done {
            Ok(d) => d,
            Err(e) => {
                for (name, numel) in &written {
                    zero_param(store, name, *numel)?;
                }
                return Err(e);
            }
        };
        let (_, numel) = written.last().expect("a read tensor is recorded as written");
        report.n_tensors += 1;
        report.n_params += numel;
        report.bytes_read += bytes;
        *report.source_dtypes.entry(dtype).or_default() += 1;
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

/// Checks the MXFP4 blocks and scales of the layout matrix `name` of shape `shape` (the
/// headers: both present, U8, the shapes `crate::mxfp4` gives).
fn plan_mxfp4<'a>(src: &'a HfModelDir, name: &str, shape: &[usize]) -> Result<Item<'a>> {
    let find = |suffix: &str| -> Result<(usize, &'a TensorEntry)> {
        let n = format!("{name}{suffix}");
        src.find(&n).ok_or_else(|| Error::MissingTensor { name: n, dir: src.dir.clone() })
    };
    let (blocks, scales) = (find(mxfp4::BLOCKS_SUFFIX)?, find(mxfp4::SCALES_SUFFIX)?);
    let bad = |(s, t): (usize, &TensorEntry), msg: String| Error::Mxfp4 {
        name: t.name.clone(),
        shard: src.shards[s].path.clone(),
        msg,
    };
    let Some((blocks_shape, scales_shape)) = mxfp4::stored_shapes(shape) else {
        return Err(bad(
            blocks,
            format!(
                "`{name}` has shape {shape:?}; MXFP4 stores only expert matrices [E, in, out] with in a multiple of {}",
                mxfp4::BLOCK
            ),
        ));
    };
    for (stored, want) in [(blocks, blocks_shape), (scales, scales_shape)] {
        let t = stored.1;
        if t.dtype != Dtype::U8 {
            return Err(bad(stored, format!("dtype {}, expected U8", t.dtype)));
        }
        if t.shape != want {
            return Err(Error::Shape {
                name: t.name.clone(),
                shard: src.shards[stored.0].path.clone(),
                expected: want,
                found: t.shape.clone(),
            });
        }
    }
    Ok(Item::Mxfp4 {
        name: name.to_owned(),
        n_experts: shape[0],
        shape: mxfp4::ExpertShape { inp: shape[1], out: shape[2] },
        stored: mxfp4::Stored { blocks, scales },
    })
}

/// The shards' files, opened on first use, and a read buffer.
struct Reader<'a> {
    src: &'a HfModelDir,
    files: Vec<Option<File>>,
    buf: Vec<u8>,
}

impl Reader<'_> {
    /// Reads `len` bytes of tensor `t` of shard `s` from byte `at` of its data into the buffer.
    fn read(&mut self, s: usize, t: &TensorEntry, at: u64, len: usize) -> Result<&[u8]> {
        let shard = &self.src.shards[s].path;
        let read_err = |source| Error::ReadTensor { name: t.name.clone(), shard: shard.clone(), source };
        let file = match &mut self.files[s] {
            Some(f) => f,
            slot => slot.insert(File::open(shard).map_err(Error::io(shard))?),
        };
        file.seek(SeekFrom::Start(t.start + at)).map_err(read_err)?;
        self.buf.resize(len, 0);
        file.read_exact(&mut self.buf).map_err(read_err)?;
        Ok(&self.buf)
    }
}

/// Reads a float tensor in chunks into f32 and writes it; returns its bytes and dtype name.
fn read_float(
    reader: &mut Reader<'_>,
    store: &dyn ParamSink,
    s: usize,
    t: &TensorEntry,
    dtype: SrcDtype,
    written: &mut Vec<(String, usize)>,
) -> Result<(u64, String)> {
    let too_large = || Error::ReadTensor {
        name: t.name.clone(),
        shard: reader.src.shards[s].path.clone(),
        source: std::io::Error::other("tensor larger than the address space"),
    };
    let len = usize::try_from(t.len).map_err(|_| too_large())?;
    let mut values = Vec::with_capacity(t.numel());
    let mut at = 0;
    while at < len {
        let k = (len - at).min(READ_CHUNK);
        dtype.decode(reader.read(s, t, at as u64, k)?, &mut values);
        at += k;
    }
    if let Some(index) = values.iter().position(|x| !x.is_finite()) {
        let shard = reader.src.shards[s].path.clone();
        return Err(Error::NonFinite { name: t.name.clone(), shard, index, value: values[index] });
    }
    store.write_param(&t.name, &values)?;
    written.push((t.name.clone(), values.len()));
    Ok((t.len, t.dtype.to_string()))
}

/// Dequantises an MXFP4 matrix expert by expert into the layout tensor `name`; returns the
/// bytes read and `"MXFP4"`.
fn read_mxfp4(
    reader: &mut Reader<'_>,
    store: &dyn ParamSink,
    name: &str,
    n_experts: usize,
    shape: mxfp4::ExpertShape,
    stored: mxfp4::Stored<'_>,
    written: &mut Vec<(String, usize)>,
) -> Result<(u64, String)> {
    let (block_bytes, scale_bytes) = shape.bytes();
    let per_expert = shape.inp * shape.out;
    // Recorded first: a refusal half-way zeroes the experts already written.
    written.push((name.to_owned(), n_experts * per_expert));
    let mut values = vec![0f32; per_expert];
    let (bs, bt) = stored.blocks;
    let (ss, st) = stored.scales;
    for e in 0..n_experts {
        let scales = reader.read(ss, st, (e * scale_bytes) as u64, scale_bytes)?.to_vec();
        let blocks = reader.read(bs, bt, (e * block_bytes) as u64, block_bytes)?;
        if let Err(bad) = mxfp4::decode_expert(shape, blocks, &scales, &mut values) {
            let g = shape.inp / mxfp4::BLOCK;
            let (tensor, s, msg) = match bad {
                mxfp4::Bad::NanScale { block } => (
                    st,
                    ss,
                    format!(
                        "expert {e}, row {}, block {}: scale 255 (NaN in E8M0); the weights are corrupt",
                        block / g,
                        block % g
                    ),
                ),
                mxfp4::Bad::Overflow { index, value } => (
                    bt,
                    bs,
                    format!(
                        "expert {e}, row {}, column {}: {value} is past the range of f32; the weights are corrupt",
                        index / shape.inp,
                        index % shape.inp
                    ),
                ),
            };
            return Err(Error::Mxfp4 {
                name: tensor.name.clone(),
                shard: reader.src.shards[s].path.clone(),
                msg,
            });
        }
        store.write_param_part(name, e * per_expert, &values)?;
    }
    Ok((bt.len + st.len, "MXFP4".into()))
}

/// Sets the parameter `name` of `numel` elements back to zero, a chunk at a time.
fn zero_param(store: &dyn ParamSink, name: &str, numel: usize) -> Result<()> {
    let zeros = vec![0f32; numel.min(READ_CHUNK)];
    let mut at = 0;
    while at < numel {
        let k = (numel - at).min(zeros.len());
        store.write_param_part(name, at, &zeros[..k])?;
        at += k;
    }
    Ok(())
}
