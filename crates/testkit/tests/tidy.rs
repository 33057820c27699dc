//! Workspace tidiness checks that run with `cargo test` (rust-analyzer's habit): every Rust
//! source file says what it is for in a `//!` header, and `unsafe` lives only in the crates
//! ARCHITECTURE.md allows it in, each use with a SAFETY comment. Long files are listed, as a
//! warning.

use std::path::{Path, PathBuf};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("crates/testkit is two levels down")
        .to_owned()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() && name != "target" && !name.starts_with('.') {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn sources() -> Vec<PathBuf> {
    let root = workspace_root();
    let mut files = Vec::new();
    for d in ["crates", "bench-harness", "kernels"] {
        rust_files(&root.join(d), &mut files);
    }
    assert!(files.len() > 20, "found only {} Rust files under {}", files.len(), root.display());
    files
}

#[test]
fn every_source_file_starts_with_a_doc_header() {
    let missing: Vec<String> = sources()
        .into_iter()
        .filter(|p| {
            let text = std::fs::read_to_string(p).unwrap_or_default();
            !text.trim_start().starts_with("//!")
        })
        .map(|p| p.display().to_string())
        .collect();
    assert!(
        missing.is_empty(),
        "files without a `//!` header saying what they are for:\n{}",
        missing.join("\n")
    );
}

/// A Rust source this long is a prompt to look at it: a reader can no longer hold it, and it may
/// hold two responsibilities (STYLE.md says ~600 lines).
const LONG_LINES: usize = 600;

/// Lists the long sources on the test's standard error, past the harness's capture (`print!` is
/// captured, a write to the stream itself is not), so every `cargo test` shows them. A warning,
/// never a failure: a long file is split by responsibility into a directory module when that
/// reads better, never trimmed of comments or squeezed to pass a count.
#[test]
fn long_source_files_are_listed_as_a_warning() {
    use std::io::Write;
    let long: Vec<String> = sources()
        .into_iter()
        .filter_map(|p| {
            let n = std::fs::read_to_string(&p).unwrap_or_default().lines().count();
            (n >= LONG_LINES).then(|| format!("{}: {n} lines", p.display()))
        })
        .collect();
    if !long.is_empty() {
        let mut err = std::io::stderr().lock();
        let _ = writeln!(err, "warning: {} source files of {LONG_LINES} lines or more:", long.len());
        for l in &long {
            let _ = writeln!(err, "  {l}");
        }
    }
}

/// Where `unsafe` may appear: the store (mmap, page-locked host buffers), the CUDA FFI module, the
/// kernel launches of mt-kernels and the optimizer's CPU intrinsics (streaming stores, vector kernels).
const UNSAFE_CRATES: [&str; 4] =
    ["crates/store/", "crates/sched/src/cuda_ffi.rs", "kernels/src/ops/", "crates/optim/src/simd/"];

#[test]
fn unsafe_only_in_allowed_crates_and_always_explained() {
    let root = workspace_root();
    let mut problems = Vec::new();
    for p in sources() {
        let rel = p.strip_prefix(&root).unwrap_or(&p).display().to_string();
        if rel.ends_with("testkit/tests/tidy.rs") {
            continue; // this file names the patterns it looks for
        }
        let text = std::fs::read_to_string(&p).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if !(code.contains("unsafe {") || code.contains("unsafe impl") || code.contains("unsafe fn")) {
                continue;
            }
            if !UNSAFE_CRATES.iter().any(|c| rel.starts_with(c)) {
                problems.push(format!("{rel}:{}: unsafe outside {UNSAFE_CRATES:?}", i + 1));
            }
            let explained =
                lines[i.saturating_sub(8)..i].iter().any(|l| l.contains("SAFETY:") || l.contains("# Safety"));
            if !explained {
                problems.push(format!("{rel}:{}: unsafe without a SAFETY comment just above", i + 1));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn safe_crates_forbid_unsafe_code() {
    let root = workspace_root();
    let mut missing = Vec::new();
    for p in sources() {
        let rel = p.strip_prefix(&root).unwrap_or(&p).display().to_string();
        let is_root = rel.ends_with("src/lib.rs") || rel.ends_with("src/main.rs");
        if is_root && !UNSAFE_CRATES.iter().any(|c| rel.starts_with(c)) {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            // mt-sched, mt-kernels and mt-optim hold one such module each: the crate root denies unsafe and
            // allows it only there.
            let ffi_ok = |root: &str, module: &str| {
                rel == root
                    && text.contains("#![deny(unsafe_code)]")
                    && text.contains(&format!("#[allow(unsafe_code)]\nmod {module};"))
                    && text.matches("allow(unsafe_code)").count() == 1
            };
            let ffi_ok = ffi_ok("crates/sched/src/lib.rs", "cuda_ffi")
                || ffi_ok("kernels/src/lib.rs", "ops")
                || ffi_ok("crates/optim/src/lib.rs", "simd");
            if !text.contains("#![forbid(unsafe_code)]") && !ffi_ok {
                missing.push(rel);
            }
        }
    }
    assert!(missing.is_empty(), "crate roots without #![forbid(unsafe_code)]:\n{}", missing.join("\n"));
}
