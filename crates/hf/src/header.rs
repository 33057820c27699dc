//! Reading the header of one safetensors file without reading its data: the 8-byte
//! little-endian header length, the JSON header (validated by the `safetensors` crate's
//! `Metadata`), and a check that the file is exactly as long as the header says.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use safetensors::tensor::Metadata;
use safetensors::Dtype;

use crate::{Error, Result};

/// Largest header the parser accepts (the `safetensors` crate's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Where one tensor lives inside a safetensors file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// The tensor's name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape (row-major).
    pub shape: Vec<usize>,
    /// Absolute file offset of the first data byte.
    pub start: u64,
    /// Length of the data in bytes.
    pub len: u64,
}

impl TensorEntry {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The parsed header of one safetensors file.
#[derive(Debug, Clone)]
pub struct ShardHeader {
    /// The file.
    pub path: PathBuf,
    /// Its tensors, in file (data offset) order.
    pub tensors: Vec<TensorEntry>,
    /// The `__metadata__` string map (empty when absent).
    pub metadata: BTreeMap<String, String>,
    /// Length of the file in bytes (checked against the header).
    pub file_len: u64,
}

impl ShardHeader {
    /// Looks up a tensor by name.
    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// Parses the header of the safetensors file at `path`, reading only the header bytes. Fails
/// with [`Error::BadHeader`] if the header is truncated or invalid (bad JSON, unknown dtype,
/// overlapping or inconsistent `data_offsets`) and with [`Error::ShardSize`] if the file is not
/// exactly as long as the header implies.
pub fn read_header(path: &Path) -> Result<ShardHeader> {
    let mut file = File::open(path).map_err(Error::io(path))?;
    let file_len = file.metadata().map_err(Error::io(path))?.len();
    let n = header_len(path, file_len, |b| file.read_exact(b))?;
    // n <= MAX_HEADER_BYTES, so it fits in usize.
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(Error::io(path))?;
    parse(path, &header, file_len)
}

/// [`read_header`] of a file whose bytes are `bytes` (named `path` in errors): the same checks,
/// from memory (what the fuzz targets run).
pub fn header_from_bytes(path: &Path, bytes: &[u8]) -> Result<ShardHeader> {
    let file_len = bytes.len() as u64;
    let n = header_len(path, file_len, |b| {
        b.copy_from_slice(&bytes[..8]);
        Ok(())
    })?;
    // Checked against the length: 8 + n <= bytes.len().
    parse(path, &bytes[8..8 + n as usize], file_len)
}

/// The header length a file of `file_len` bytes starts with (read by `read8`), checked to fit.
fn header_len(
    path: &Path,
    file_len: u64,
    read8: impl FnOnce(&mut [u8; 8]) -> std::io::Result<()>,
) -> Result<u64> {
    let bad = |msg: String| Error::BadHeader { shard: path.to_owned(), msg };
    if file_len < 8 {
        return Err(bad(format!("the file is {file_len} bytes, shorter than the 8-byte header length")));
    }
    let mut len_bytes = [0u8; 8];
    read8(&mut len_bytes).map_err(Error::io(path))?;
    let n = u64::from_le_bytes(len_bytes);
    if n > MAX_HEADER_BYTES {
        return Err(bad(format!("header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")));
    }
    if 8 + n > file_len {
        return Err(bad(format!(
            "header length {n} runs past the end of the {file_len}-byte file (truncated?)"
        )));
    }
    Ok(n)
}

/// The JSON header `header` of a `file_len`-byte file, checked against that length.
fn parse(path: &Path, header: &[u8], file_len: u64) -> Result<ShardHeader> {
    let bad = |msg: String| Error::BadHeader { shard: path.to_owned(), msg };
    let n = header.len() as u64;
    let text = std::str::from_utf8(header).map_err(|e| bad(format!("header is not UTF-8 ({e})")))?.trim_end();
    if !text.starts_with('{') {
        return Err(bad("header does not start with a JSON object".into()));
    }
    let meta: Metadata = serde_json::from_str(text).map_err(|e| bad(format!("{e}")))?;
    let data_start = 8 + n;
    let expected = data_start + meta.data_len() as u64;
    if expected != file_len {
        return Err(Error::ShardSize { shard: path.to_owned(), expected, found: file_len });
    }
    let mut tensors = Vec::new();
    for name in meta.offset_keys() {
        let info =
            meta.info(&name).ok_or_else(|| bad(format!("tensor `{name}` listed but not described")))?;
        let (s, e) = info.data_offsets;
        tensors.push(TensorEntry {
            dtype: info.dtype,
            shape: info.shape.clone(),
            start: data_start + s as u64,
            len: (e - s) as u64,
            name,
        });
    }
    let metadata = meta.metadata().clone().unwrap_or_default().into_iter().collect();
    Ok(ShardHeader { path: path.to_owned(), tensors, metadata, file_len })
}
