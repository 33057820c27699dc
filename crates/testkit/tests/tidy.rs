//! Workspace tidiness checks that run with `cargo test` (rust-analyzer's habit): every Rust
//! source file says what it is for in a `//!` header, `unsafe` lives only in the crates
//! ARCHITECTURE.md allows it in, each use with a SAFETY comment, and each placement setting is
//! declared in at most two structs. Long files are listed, as a warning.

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

/// Other spellings a placement setting has had or has in a flag (`--spill-checkpoints`), so that a
/// copy under one of them is counted too.
const PLACEMENT_ALIASES: [(&str, &str); 4] = [
    ("spilled_checkpoints", "spill_checkpoints"),
    ("late_state_downloads", "late_downloads"),
    ("early_state_uploads", "early_uploads"),
    ("gpu_updated_layers", "gpu_updated"),
];

/// The named-field structs of a Rust source, each with its fields' names (comments, attributes
/// and nested braces skipped; tuple and unit structs have none).
fn struct_fields(text: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let mut lines = text.lines().map(|l| l.split("//").next().unwrap_or("").trim());
    while let Some(line) = lines.next() {
        // `struct`, `pub struct` or `pub(crate) struct` at the start of the line.
        let Some((before, rest)) = line.split_once("struct ") else { continue };
        if !(before.is_empty() || before.ends_with("pub ") || before.ends_with(") ")) {
            continue;
        }
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        // The body opens on this line or a later one (a `where` clause), unless a `;` or `(` comes
        // first (a unit or tuple struct).
        let mut header = line.to_string();
        while !header.contains('{') && !header.contains(';') && !header.contains('(') {
            match lines.next() {
                Some(l) => header.push_str(l),
                None => break,
            }
        }
        if !header.contains('{') || header.find('(').is_some_and(|p| p < header.find('{').unwrap_or(0)) {
            continue;
        }
        let mut fields = Vec::new();
        let mut depth = header.matches('{').count() - header.matches('}').count();
        while depth > 0 {
            let Some(l) = lines.next() else { break };
            if depth == 1 && !l.starts_with('#') {
                let decl = l
                    .strip_prefix("pub(crate) ")
                    .or(l.strip_prefix("pub(super) "))
                    .or(l.strip_prefix("pub "));
                let decl = decl.unwrap_or(l);
                if let Some((field, ty)) = decl.split_once(':') {
                    let ident = !field.is_empty() && field.chars().all(|c| c.is_alphanumeric() || c == '_');
                    if ident && !ty.starts_with(':') {
                        fields.push(field.to_string());
                    }
                }
            }
            depth = (depth + l.matches('{').count()).saturating_sub(l.matches('}').count());
        }
        out.push((name, fields));
    }
    out
}

/// The measure of "one placement type": each setting of `mt_core::Placement` (its field
/// names, read from the struct, and the other spellings in [`PLACEMENT_ALIASES`]) is declared as a
/// field of at most two structs in the workspace: `Placement` itself and the CLI's flags
/// (`PlacementArgs`, one field a flag for clap). Every other struct holds a `Placement`. The byte
/// breakdowns (`GpuBytes`, `HostBytes`, `PoolBytes`: structs named `*Bytes`, whose fields are
/// amounts of memory per kind of buffer, some named after the setting that sizes them) are not
/// counted. The count is printed on the test's standard error:
/// `cargo test -p mt-testkit --test tidy placement -- --nocapture`.
#[test]
fn each_placement_setting_is_declared_in_at_most_two_structs() {
    use std::io::Write;
    let root = workspace_root();
    let placement = std::fs::read_to_string(root.join("crates/core/src/placement/mod.rs")).unwrap();
    let settings = struct_fields(&placement)
        .into_iter()
        .find(|(name, _)| name == "Placement")
        .map(|(_, fields)| fields)
        .expect("crates/core/src/placement/mod.rs declares struct Placement");
    assert_eq!(settings.len(), 8, "the settings of Placement: {settings:?}");
    let mut declared: Vec<(String, Vec<String>)> = settings.iter().map(|s| (s.clone(), Vec::new())).collect();
    for p in sources() {
        let rel = p.strip_prefix(&root).unwrap_or(&p).display().to_string();
        let text = std::fs::read_to_string(&p).unwrap_or_default();
        for (name, fields) in struct_fields(&text) {
            if name.ends_with("Bytes") {
                continue;
            }
            for (setting, structs) in &mut declared {
                let alias = PLACEMENT_ALIASES.iter().find(|(s, _)| s == setting).map(|(_, a)| *a);
                if fields.iter().any(|f| f == setting || Some(f.as_str()) == alias) {
                    structs.push(format!("{name} ({rel})"));
                }
            }
        }
    }
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "placement settings, and the structs that declare each:");
    for (setting, structs) in &declared {
        let _ = writeln!(err, "  {setting}: {}: {}", structs.len(), structs.join(", "));
    }
    let over: Vec<String> = declared
        .iter()
        .filter(|(_, s)| s.len() > 2)
        .map(|(setting, s)| format!("{setting} in {} structs: {}", s.len(), s.join(", ")))
        .collect();
    assert!(
        over.is_empty(),
        "a placement setting declared beyond Placement and the CLI's flags (hold a Placement instead):\n{}",
        over.join("\n")
    );
}
