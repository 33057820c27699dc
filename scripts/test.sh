#!/usr/bin/env bash
# The project's test command (README "The two commands"; CI's .ci/run calls it).
# Needs only a Rust toolchain (rustup); installs the rustfmt/clippy components if missing.
# No GPU, no network at test time: every fixture is committed under crates/testkit/fixtures.
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v rustup >/dev/null 2>&1; then
    rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy (warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "== cargo test --workspace"
cargo test --workspace --locked
