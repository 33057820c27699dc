//! The optimizer-state precision (`--optim-states`) across runs: a `--store` or a checkpoint written
//! with another precision is refused in a sentence naming both, and the precision joins a
//! checkpoint's defining options when it is not the default.

use std::path::Path;

use mt_core::StateDtype;
use mt_store::HostStore;
use serde_json::Value;

use crate::checkpoint::Manifest;
use crate::error::{Error, Result};

/// Refuses a reopened `--store` whose moments are not `want`.
pub(crate) fn check_store(path: &Path, store: &HostStore, want: StateDtype) -> Result<()> {
    let have = store.state_dtype();
    if have == want {
        return Ok(());
    }
    Err(Error::Options(format!(
        "--store {} keeps {have} optimizer states and this run asks for {want} (--optim-states): \
         continue it with --optim-states {have}, or start a new store",
        path.display()
    )))
}

/// Why a checkpoint whose moments are not `want` cannot be resumed, if they are not (a checkpoint
/// from before the option counts as fp32).
pub(crate) fn checkpoint_refusal(m: &Manifest, want: StateDtype) -> Option<String> {
    let have = m.defining.get("optim_states").and_then(Value::as_str).unwrap_or(StateDtype::F32.name());
    (have != want.name()).then(|| {
        format!(
            "the checkpoint at step {} keeps {have} optimizer states and this run asks for {want} \
             (--optim-states); resume with --optim-states {have}",
            m.step
        )
    })
}

/// Adds the precision to a checkpoint's defining options, only when it is not fp32, so that
/// checkpoints from before the option still hash the same.
pub(crate) fn define(defining: &mut Value, states: StateDtype) {
    if states != StateDtype::F32 {
        defining["optim_states"] = Value::from(states.name());
    }
}
