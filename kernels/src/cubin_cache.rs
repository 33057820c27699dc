//! CUBINs kept between processes, only ones whose compile was checked.
//!
//! The Hopper kernels are compiled by NVRTC with its own cache off (`--no-cache`: a compile it
//! serves from its cache comes back without ptxas's report, and that report is how a kernel that
//! lost its Hopper features is refused; decision 0040). A fresh compile of
//! `flash_attn_hopper.cu` takes ~16 s on an H200 machine, at every process's first step. This
//! cache takes that back: a CUBIN is written here only after a compile whose log carried ptxas's
//! report and passed the check, under the SHA-256 of everything that made it (source, file name,
//! architecture, options, NVRTC's version, the list of ptxas's words it was checked against), so
//! a later process loads exactly what was checked.
//!
//! The directory is `MEGATRAIN_CUBIN_CACHE` if set (empty or `off`: no cache), else
//! `$XDG_CACHE_HOME/megatrain/cubin` or `$HOME/.cache/megatrain/cubin`. The cache is best effort:
//! a file that cannot be read, written or is not an ELF image is compiled again; a write goes to a
//! temporary file renamed into place, so two processes never see half a CUBIN.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// Where checked CUBINs are kept, if anywhere.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CubinCache {
    dir: Option<PathBuf>,
}

impl CubinCache {
    /// The cache the environment names (module docs).
    #[cfg(feature = "cuda")]
    pub(crate) fn from_env() -> Self {
        Self::from_lookup(|k| std::env::var_os(k))
    }

    /// The cache the variables `var` gives name (module docs).
    fn from_lookup(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> Self {
        let set = |k: &str| var(k).filter(|v| !v.is_empty());
        let dir = match var("MEGATRAIN_CUBIN_CACHE") {
            Some(v) if v.is_empty() || v == "off" => None,
            Some(v) => Some(PathBuf::from(v)),
            None => set("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| set("HOME").map(|h| Path::new(&h).join(".cache")))
                .map(|d| d.join("megatrain").join("cubin")),
        };
        CubinCache { dir }
    }

    /// A cache in `dir`, or none.
    #[cfg(test)]
    pub(crate) fn at(dir: Option<PathBuf>) -> Self {
        CubinCache { dir }
    }

    /// The file of the CUBIN made from `parts` (each hashed with its length, so no two lists of
    /// parts give the same key).
    fn path(&self, parts: &[&[u8]]) -> Option<PathBuf> {
        let mut h = Sha256::new();
        for p in parts {
            h.update((p.len() as u64).to_le_bytes());
            h.update(p);
        }
        let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        self.dir.as_ref().map(|d| d.join(format!("{hex}.cubin")))
    }

    /// The CUBIN made from `parts`: the cached one if there is one, else `compile()`'s, which is
    /// written to the cache when `compile` says it was checked (`Ok((cubin, true))`).
    pub(crate) fn get_or_compile(
        &self,
        parts: &[&[u8]],
        compile: impl FnOnce() -> Result<(Vec<u8>, bool), String>,
    ) -> Result<Vec<u8>, String> {
        let path = self.path(parts);
        if let Some(bytes) = path.as_deref().and_then(|p| std::fs::read(p).ok()) {
            if bytes.starts_with(b"\x7fELF") {
                return Ok(bytes);
            }
        }
        let (cubin, checked) = compile()?;
        if let (Some(path), true) = (path, checked) {
            store(&path, &cubin);
        }
        Ok(cubin)
    }
}

/// Writes `bytes` to `path` through a temporary file renamed into place; any failure leaves no
/// file at `path` (the next process compiles again).
fn store(path: &Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let ok = std::fs::create_dir_all(dir).is_ok()
        && std::fs::write(&tmp, bytes).is_ok()
        && std::fs::rename(&tmp, path).is_ok();
    if !ok {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ELF: &[u8] = b"\x7fELF and the rest of a CUBIN";

    /// A checked CUBIN is compiled once and then read back by any later call with the same
    /// parts; other parts compile again; an unchecked one is never kept; a file that is not an
    /// ELF image is compiled over; no cache directory keeps nothing; an error is passed on.
    #[test]
    fn only_checked_cubins_are_kept_and_each_under_what_made_it() {
        let dir = std::env::temp_dir().join(format!("mt-cubin-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cache = CubinCache::at(Some(dir.clone()));
        let mut compiles = 0;
        let mut get = |parts: &[&[u8]], checked: bool| {
            cache
                .get_or_compile(parts, || {
                    compiles += 1;
                    Ok((ELF.to_vec(), checked))
                })
                .unwrap()
        };
        assert_eq!(get(&[b"src", b"sm_90a"], true), ELF);
        assert_eq!(get(&[b"src", b"sm_90a"], true), ELF);
        get(&[b"sr", b"csm_90a"], true);
        get(&[b"other", b"sm_90a"], false);
        get(&[b"other", b"sm_90a"], false);
        assert_eq!(compiles, 4, "one compile for the first parts, one for the second, two unchecked");
        let kept: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(kept.len(), 2, "{kept:?}");
        assert!(kept.iter().all(|p| p.extension().is_some_and(|e| e == "cubin")), "{kept:?}");
        // A damaged file is compiled over.
        let path = cache.path(&[b"src", b"sm_90a"]).unwrap();
        std::fs::write(&path, b"half a CUBIN").unwrap();
        let mut again = 0;
        let got = cache.get_or_compile(&[b"src", b"sm_90a"], || {
            again += 1;
            Ok((ELF.to_vec(), true))
        });
        assert_eq!((got.unwrap(), again), (ELF.to_vec(), 1));
        assert_eq!(std::fs::read(&path).unwrap(), ELF);
        let e = cache.get_or_compile(&[b"bad"], || Err("ptxas: C7508".into())).unwrap_err();
        assert_eq!(e, "ptxas: C7508");
        let none = CubinCache::at(None);
        assert_eq!(none.path(&[b"src"]), None);
        let mut n = 0;
        for _ in 0..2 {
            none.get_or_compile(&[b"src"], || {
                n += 1;
                Ok((ELF.to_vec(), true))
            })
            .unwrap();
        }
        assert_eq!(n, 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `MEGATRAIN_CUBIN_CACHE` names the directory, `off` or empty turns the cache off, and
    /// without it the user's cache directory is used (`XDG_CACHE_HOME`, else `HOME/.cache`).
    #[test]
    fn the_environment_names_the_directory() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            CubinCache::from_lookup(move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.into())).dir
        };
        let some = |d: &str| Some(PathBuf::from(d));
        assert_eq!(env(&[("MEGATRAIN_CUBIN_CACHE", "/some/dir"), ("HOME", "/h")]), some("/some/dir"));
        assert_eq!(env(&[("MEGATRAIN_CUBIN_CACHE", "off"), ("HOME", "/h")]), None);
        assert_eq!(env(&[("MEGATRAIN_CUBIN_CACHE", ""), ("HOME", "/h")]), None);
        assert_eq!(env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]), some("/x/megatrain/cubin"));
        assert_eq!(env(&[("XDG_CACHE_HOME", ""), ("HOME", "/h")]), some("/h/.cache/megatrain/cubin"));
        assert_eq!(env(&[]), None);
    }
}
