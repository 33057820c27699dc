//! Placement as one concept: where a step keeps each decoder layer's weights, activations,
//! AdamW update and optimizer state, and the outer unit's. [`Placement`] is the one type of it:
//! asked for ([`PlacementChoice`], each setting `auto` or fixed: the command line, `TrainConfig`,
//! the planner's input), decided (the plan, the engine's options, the step program's spec, the
//! device pool's spec). Which layers a count picks is decided here too
//! ([`Placement::is_gpu_updated`] and its siblings), and [`Placement::table`] gives one row per
//! layer.
//!
//! It lives in mt-core, below every crate that holds one, as [`crate::StateDtype`] does: mt-pool
//! sizes its buffers from it and sits below mt-sched, which re-exports it (`mt_sched::placement`)
//! and owns what decides it (the planner) and what implements it (the step program's passes).
//! A new setting is a field here (with its line in `PlacementChoice::AUTO`, `map` and, if it keeps
//! state on the device, `with_device_state`), its flag in the CLI's `PlacementArgs`, and the code
//! that implements it (the program's pass, the planner's phase, the pool's buffers).

mod table;

pub use table::{DeviceKind, LayerPlacement, PlacementTable, StateMove, Update, Weights};

/// Where a step places its units, activations and optimizer work: decided (`Placement`, the
/// default form: counts and a flag) or asked for ([`PlacementChoice`]: each `None` = auto, the
/// planner decides). What each costs and saves: ARCHITECTURE.md, "Placement", and the decision
/// each field names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Placement<N = usize, B = bool> {
    /// The outer unit (embedding, final norm, LM head) keeps its fp32 master weights and AdamW
    /// moments on the device and is updated there (`mt_kernels::device_optim`): it never crosses
    /// the bus, and the step boundary no longer waits for its download, host update and upload.
    /// The store's copy is brought up to date by `Engine::sync_store`. Auto: resident when that
    /// costs no extra chunk (0018).
    pub resident_outer: B,
    /// Decoder layers `0..k` live on the device likewise (weights, fp32 gradient, master and
    /// moments, AdamW there): they never cross the bus and cost the host optimizer nothing. The
    /// first layers, because in exact mode the host must finish each streamed layer's update
    /// before its upload, and every resident layer ahead of the first streamed one gives it that
    /// much more time. Auto: as many as fit in what the chosen chunking leaves (0019).
    pub resident_layers: N,
    /// The last `k` decoder layers (streamed ones) are uploaded once a step, for their forward,
    /// into their own device slot, where their backward finds them: no re-cast on the host, no
    /// second upload (`layer.len` weight-dtype elements of device memory each); the rest of their
    /// path (host update, gradient download and land) is a streamed layer's. At most the streamed
    /// layers. Auto: as many streamed layers as fit in what residency leaves (0021).
    pub held_layers: N,
    /// Decoder layers `0..k` keep their forward's activations on the device until their backward
    /// (`DecoderLayer::forward_keep`), which then does not recompute the forward: the same
    /// gradients bit for bit, a quarter fewer GEMM FLOPs for those layers, at
    /// `DecoderLayer::kept_state_bytes` of device memory each. Not with spilled checkpoints. Auto:
    /// as many as fit in what residency and holding leave, of the resident layers (of all, when
    /// every layer is resident or held) (0020).
    pub kept_layers: N,
    /// Of the streamed layers, `k` (spread evenly: [`Placement::is_gpu_updated`]) have exact
    /// mode's pending update applied on the device: their fp32 master, moments and stored
    /// gradient go up from the host record (page-locked in place on a GPU) into a state slot,
    /// AdamW runs there (bitwise the host's) and writes the weights into the layer's slot, and
    /// master and moments go back. Each takes its AdamW pass (28 B/param of host memory traffic
    /// with fp32 moments) off the host for 12 B/param more each way over the bus. Exact mode
    /// only; refused with a file-backed store on a GPU (DMA writes into a file mapping are not
    /// tracked dirty). Auto: in exact mode, the count with the shortest forward window
    /// (`plan::forward_window`), if its state slots fit (0022).
    pub gpu_updated_layers: N,
    /// Of the GPU-updated layers that are also held, `k` (spread evenly:
    /// [`Placement::is_late_download`]) keep their state on the device from their update into
    /// the backward and download it there, spread over it, each before its layer's gradient
    /// lands: host memory traffic and D2H move out of the forward (bound by host memory) into the
    /// backward (whose D2H carries only gradients), for a state slot each and two more gradient
    /// buffers. Auto: as many as the backward's D2H has time for beside the gradients
    /// (`plan::late_download_capacity`) and the device has room for (0023).
    pub late_state_downloads: N,
    /// Of the GPU-updated layers that do not download late, `k` ([`Placement::early_upload_pairs`]:
    /// at most one per late-download layer at least `ring_depth` layers after it) get their
    /// state for the next step in this step's backward: master and moments go up into a state
    /// slot once it is free (at the loss, or right after a late download), the gradient is copied
    /// there on the device after the layer's backward. No device memory of its own: the slot
    /// held another layer's state in between. Needs the device gradient in the store's dtype.
    /// Auto: as many as the backward's H2D and host memory have room for
    /// (`plan::early_upload_capacity`: none unless every streamed layer is held) (0024).
    pub early_state_uploads: N,
    /// Boundaries `0..k` (the inputs of the first layers) go down to page-locked host memory once
    /// their layer's forward has read them and come back up for its backward: device memory for
    /// host memory, the copies on the D2H and H2D streams beside compute. At most the layer
    /// count (the loss's input stays); not with kept activations. Auto: the fewest with which the
    /// plan fits with its smallest workspace (0027).
    pub spilled_checkpoints: N,
}

/// A placement asked for: each setting fixed (`Some`) or left to the planner (`None`, `auto`).
pub type PlacementChoice = Placement<Option<usize>, Option<bool>>;

impl PlacementChoice {
    /// Every setting `auto`.
    pub const AUTO: PlacementChoice = Placement {
        resident_outer: None,
        resident_layers: None,
        held_layers: None,
        kept_layers: None,
        gpu_updated_layers: None,
        late_state_downloads: None,
        early_state_uploads: None,
        spilled_checkpoints: None,
    };

    /// Every setting fixed to `p`'s.
    pub fn exactly(p: Placement) -> Self {
        p.map(Some, Some)
    }

    /// What the planner is asked for on `device`. `auto` places nothing on the CPU backend's
    /// "device" (host memory), and keeps a file-backed store's units streamed and updated on the
    /// host: that file is the live training state, which resident units would leave stale between
    /// checkpoints, and whose pages GPU-updated layers' DMA would not mark dirty.
    pub fn for_run(self, device: DeviceKind, file_backed_store: bool) -> Self {
        match device {
            DeviceKind::Cpu => self.map(|c| c.or(Some(0)), |c| c.or(Some(false))),
            DeviceKind::Gpu if file_backed_store => {
                self.with_device_state(|c| c.or(Some(0)), |c| c.or(Some(false)))
            }
            DeviceKind::Gpu => self,
        }
    }

    /// No optimizer state on the device: data-parallel ranks share one host store, which every
    /// rank's device copy would go stale against.
    pub fn without_device_state(self) -> Self {
        self.with_device_state(|_| Some(0), |_| Some(false))
    }

    /// The settings that keep optimizer state on the device (resident units, GPU-updated layers
    /// and their state moves) through `count` and `flag`; the others as they are.
    fn with_device_state(
        self,
        count: impl Fn(Option<usize>) -> Option<usize>,
        flag: impl FnOnce(Option<bool>) -> Option<bool>,
    ) -> Self {
        Placement {
            resident_outer: flag(self.resident_outer),
            resident_layers: count(self.resident_layers),
            gpu_updated_layers: count(self.gpu_updated_layers),
            late_state_downloads: count(self.late_state_downloads),
            early_state_uploads: count(self.early_state_uploads),
            ..self
        }
    }
}

impl<N, B> Placement<N, B> {
    /// Each layer count through `count`, the outer unit's flag through `flag`.
    pub fn map<M, C>(self, count: impl Fn(N) -> M, flag: impl FnOnce(B) -> C) -> Placement<M, C> {
        Placement {
            resident_outer: flag(self.resident_outer),
            resident_layers: count(self.resident_layers),
            held_layers: count(self.held_layers),
            kept_layers: count(self.kept_layers),
            gpu_updated_layers: count(self.gpu_updated_layers),
            late_state_downloads: count(self.late_state_downloads),
            early_state_uploads: count(self.early_state_uploads),
            spilled_checkpoints: count(self.spilled_checkpoints),
        }
    }
}

/// Which layers the counts pick, for a model of `n_layers` decoder layers (the step program, the
/// planner, the engine's checks and the placement table all ask here).
impl Placement {
    /// Whether decoder `layer` is resident (the first `resident_layers`).
    pub fn is_resident(&self, layer: usize) -> bool {
        layer < self.resident_layers
    }

    /// Whether decoder `layer` is held: one of the last `held_layers` streamed layers.
    pub fn is_held(&self, n_layers: usize, layer: usize) -> bool {
        !self.is_resident(layer) && layer + self.held_layers >= n_layers
    }

    /// Whether decoder `layer` is one of the `gpu_updated_layers`: the streamed layers
    /// `resident_layers..n_layers` picked evenly, one in the middle of each of `gpu_updated_layers`
    /// equal stretches (Bresenham, centred), so that host updates and state transfers alternate
    /// through the forward, and the last streamed layer (whose backward follows its forward at
    /// once, so that a re-cast waiting for its state could not be hidden) is one only when more
    /// than half of them are.
    pub fn is_gpu_updated(&self, n_layers: usize, layer: usize) -> bool {
        if layer < self.resident_layers || layer >= n_layers {
            return false;
        }
        spread(layer - self.resident_layers, n_layers - self.resident_layers, self.gpu_updated_layers)
    }

    /// The GPU-updated layers that are also held (in layer order): the ones whose state may stay
    /// on the device until their backward.
    pub fn held_gpu_updated(&self, n_layers: usize) -> Vec<usize> {
        let first_held = n_layers.saturating_sub(self.held_layers).max(self.resident_layers);
        (first_held..n_layers).filter(|&l| self.is_gpu_updated(n_layers, l)).collect()
    }

    /// Whether decoder `layer` is one of the `late_state_downloads` GPU-updated, held layers whose
    /// state is downloaded in the backward (spread evenly over [`Placement::held_gpu_updated`], so
    /// that their downloads spread over the backward's D2H).
    pub fn is_late_download(&self, n_layers: usize, layer: usize) -> bool {
        let held = self.held_gpu_updated(n_layers);
        held.iter()
            .position(|&l| l == layer)
            .is_some_and(|i| spread(i, held.len(), self.late_state_downloads))
    }

    /// The layers whose state for the next step goes up in this step's backward, in forward
    /// order: the early halves of [`Placement::early_upload_pairs`].
    pub fn early_upload_layers(&self, n_layers: usize, ring_depth: usize) -> Vec<usize> {
        self.early_upload_pairs(n_layers, ring_depth).into_iter().map(|(early, _)| early).collect()
    }

    /// The `early_state_uploads` (early-upload layer, late-download layer) pairs, in the early
    /// layers' order: picked evenly among [`Placement::slot_pairs`]. The pairing is what keeps
    /// the forward within its state slots (see there); which slot a late layer takes is the
    /// step program's free list's business.
    pub fn early_upload_pairs(&self, n_layers: usize, ring_depth: usize) -> Vec<(usize, usize)> {
        let all = self.slot_pairs(n_layers, ring_depth);
        let n = all.len();
        all.into_iter()
            .enumerate()
            .filter(|&(i, _)| spread(i, n, self.early_state_uploads))
            .map(|(_, p)| p)
            .collect()
    }

    /// Every pair (early, late) the placement allows, whatever its `early_state_uploads`, in the
    /// early layers' order: each late-download layer (ascending) takes, of the GPU-updated layers
    /// that do not download late and are not taken yet, the one nearest the middle between the
    /// previous late layer and itself, at least `ring_depth` layers before it; a late layer with
    /// none such has no partner. Why that is enough: the forward fetches a state `ring_depth`
    /// positions ahead of its layer, and an early layer's slot is free once its download (issued
    /// before its forward) is. At the fetch for position q, a late layer held since (before q) has
    /// its early partner at or before `q - ring_depth`, already downloaded; so the early layers
    /// not yet downloaded, the late ones held and the fetches in flight take at most `early +
    /// (late - paired) + ring_depth - 1 <= ring_depth + late - 1` of the `ring_depth + late`
    /// slots, and one is free. (A sufficient condition, not a necessary one: some placements it
    /// refuses would fit.)
    pub fn slot_pairs(&self, n_layers: usize, ring_depth: usize) -> Vec<(usize, usize)> {
        let late: Vec<usize> = (0..n_layers).filter(|&l| self.is_late_download(n_layers, l)).collect();
        let mut free: Vec<usize> =
            (0..n_layers).filter(|&l| self.is_gpu_updated(n_layers, l) && !late.contains(&l)).collect();
        let mut pairs = Vec::new();
        let mut prev = None;
        for &l in &late {
            // Twice the middle, so that it stays an integer.
            let mid2 = prev.map_or(l as i64 - 1, |p: usize| (p + l) as i64);
            let best = (0..free.len())
                .filter(|&i| free[i] + ring_depth <= l)
                .min_by_key(|&i| ((2 * free[i] as i64 - mid2).abs(), free[i]));
            if let Some(i) = best {
                pairs.push((free.remove(i), l));
            }
            prev = Some(l);
        }
        pairs.sort_unstable();
        pairs
    }
}

/// Whether item `i` of `n` is one of `k` picked evenly (Bresenham, centred).
fn spread(i: usize, n: usize, k: usize) -> bool {
    let k = k.min(n);
    ((i + 1) * k + n / 2) / n > (i * k + n / 2) / n
}
