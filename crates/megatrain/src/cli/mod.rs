//! The command line: clap structures for `megatrain` and its `train` subcommand, with the value
//! parsers that refuse nonsense (zero sizes, negative rates) before anything is allocated.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

mod config_file;
mod lora_args;
mod placement_args;
mod train_args;
mod values;
pub use config_file::{command, config_file_options, config_text_options, parse_args, ArgsError};
pub use lora_args::LoraArgs;
pub use mt_train::{DataKind, DataSource};
pub use placement_args::PlacementArgs;
pub use train_args::{default_grad_dtype, TrainArgs};
use values::{at_least_one, mlp_rows, positive_f64, tflops_pair};
pub use values::{
    AttentionArg, DeviceKind, ExportDtypeArg, GradDtypeArg, LayerCount, MlpRows, MoeKernelsArg, OptimModeArg,
    OptimStatesArg, Precision, ResidentOuter, RopeAnglesArg, ScheduleKind,
};

/// Train LLMs larger than GPU memory on one GPU by streaming layers through it.
#[derive(Debug, Parser)]
#[command(name = "megatrain", version, about, propagate_version = true, args_override_self = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once per process; boxing would only add noise
pub enum Command {
    /// Train a model. With no arguments: the built-in tiny Llama on built-in text, on the CPU.
    #[command(disable_help_flag = true)]
    Train(TrainArgs),
    /// Estimate host RAM, pinned RAM, GPU memory, PCIe bytes and step time of a training run
    /// without running it.
    Estimate(EstimateArgs),
    /// Write a seeded random initialisation of a model config as a Hugging Face directory.
    Init(InitArgs),
    /// Check every checkpoint in a directory against the hashes its manifest records.
    Verify(crate::verify::VerifyArgs),
    /// Print this process's place in a job of several processes, as torchrun's or Slurm's
    /// variables give it (rank, world size, rank 0's address); starts nothing.
    LaunchInfo,
}

/// Options of `megatrain estimate`.
#[derive(Debug, Clone, Args)]
pub struct EstimateArgs {
    /// Hugging Face model directory (only config.json and the safetensors headers are read).
    #[arg(long, value_name = "DIR", conflicts_with = "config")]
    pub model: Option<PathBuf>,
    /// Hugging Face config.json [default: the built-in tiny Llama].
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Sequences per step.
    #[arg(long, default_value_t = 16, value_parser = at_least_one)]
    pub batch_size: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64, value_parser = at_least_one)]
    pub seq_len: usize,
    /// Token chunks per step [default: the fewest that fit].
    #[arg(long, value_parser = at_least_one)]
    pub chunks: Option<usize>,
    /// Device weight slots.
    #[arg(long, default_value_t = 2, value_parser = at_least_one)]
    pub ring_depth: usize,
    /// Weight dtype on the device.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,
    /// Optimizer placement.
    #[arg(long, value_enum, default_value_t = OptimModeArg::Exact)]
    pub optim_mode: OptimModeArg,
    /// Gradient buffer dtype of the store [default: as `megatrain train`: f32 with --precision
    /// fp32, bf16 with bf16].
    #[arg(long, value_enum)]
    pub grad_dtype: Option<GradDtypeArg>,
    /// As `megatrain train --optim-states`: the AdamW moments in fp32, bf16 or int8.
    #[arg(long, value_enum, default_value_t = OptimStatesArg::Fp32)]
    pub optim_states: OptimStatesArg,
    /// The device the run would use: on `cpu` the device buffers are host memory too.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// The placement overrides.
    #[command(flatten)]
    pub placement: PlacementArgs,
    /// As `megatrain train`'s: the run trains LoRA adapters on a frozen base.
    #[command(flatten)]
    pub lora: LoraArgs,
    /// As `megatrain train --attention`.
    #[arg(long, value_enum, default_value_t = AttentionArg::Auto)]
    pub attention: AttentionArg,
    /// As `megatrain train --mlp-rows`.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = mlp_rows)]
    pub mlp_rows: MlpRows,
    /// As `megatrain train --moe-kernels` (what a mixture of experts' workspace is priced as).
    #[arg(long, value_enum, default_value_t = MoeKernelsArg::Device, value_name = "device|portable")]
    pub moe_kernels: MoeKernelsArg,
    /// GPU memory in GiB (for --device cuda) [default: 139.8, one H200].
    #[arg(long, value_name = "GIB", value_parser = positive_f64)]
    pub gpu_mem: Option<f64>,
    /// Host memory in GiB [default: MemAvailable of this machine].
    #[arg(long, value_name = "GIB", value_parser = positive_f64)]
    pub host_mem: Option<f64>,
    /// As `megatrain train --store`: a store that does not fit --host-mem is paged from this file
    /// (the disk tier). Nothing is created or read here.
    #[arg(long, value_name = "FILE")]
    pub store: Option<PathBuf>,
    /// Compute capability of the GPU the estimate is for (`major.minor`, e.g. `8.0` for an A100).
    /// At 8.0 and above bf16 runs through the fused kernels, whose transient memory the planner
    /// counts smaller than candle's ops' (bf16 scores and logits); `megatrain train` reads the
    /// real device instead.
    #[arg(long, default_value_t = 9.0, value_name = "MAJOR.MINOR", value_parser = positive_f64)]
    pub compute_capability: f64,
    /// Sustained TFLOP/s of the device's compute stream for everything but the attention core
    /// (the GEMMs, norms, activations, the loss; recompute included) [default on cuda: 600, which
    /// fits the H200 runs of the 3.6B at 4 x 2048 and the 7B at 32k-256k with the attention
    /// priced apart (docs/decisions/0041); on the CPU none: measure yours (a short `megatrain
    /// train` prints it)].
    #[arg(long, value_parser = positive_f64)]
    pub tflops: Option<f64>,
    /// The flash attention kernel's forward and backward TFLOP/s (causal FLOPs, the backward as
    /// 2.5x the forward), e.g. `250,195` [default: our kernels' measured rates at the sequence
    /// length: the Hopper kernels' (compute capability 9.0) 302,202 at 4k to 519,472 at 128k on an
    /// H100; the portable kernels' 175,116 to 257,196 on an H200].
    #[arg(long, value_name = "FWD,BWD", value_parser = tflops_pair)]
    pub attention_tflops: Option<(f64, f64)>,
    /// TFLOP/s of a mixture of experts' expert FLOPs (forward, backward and recompute of the
    /// active experts' projections, the routing, grouping and combining around them) [default on
    /// cuda: 220 on the device MoE kernels, 19 on the portable path: the OLMoE-1B-7B shape's H200
    /// runs at 4 and 16 x 2048 (docs/decisions/0049); on the CPU: `--tflops`].
    #[arg(long, value_parser = positive_f64)]
    pub moe_tflops: Option<f64>,
    /// PCIe bandwidth per direction in GB/s with both directions busy (H200 machine: 50.9).
    #[arg(long, default_value_t = 50.0, value_parser = positive_f64)]
    pub pcie_gbs: f64,
    /// Host memory bandwidth in GB/s that the optimizer's passes sustain (AdamW, the casts into
    /// staging, the gradient land; each priced by its bytes read and written per parameter)
    /// [default on cuda: 140, measured on the 16-core H200 machine: the fused AdamW pass at 5.0
    /// Gparam/s x 28 B inside a streamed step (the backward's casts and land, under concurrent
    /// DMA, run at ~60% of it but hide behind the GPU's backward); on the CPU none].
    #[arg(long, value_parser = positive_f64)]
    pub host_gbs: Option<f64>,
    /// GPUs of one host, data parallel (as `megatrain train --gpus`): each plans for its share of
    /// the batch; NCCL's all-reduce of every gradient, the host's casts once per GPU.
    #[arg(long, default_value_t = 1, value_parser = at_least_one, value_name = "N")]
    pub gpus: usize,
    /// NCCL all-reduce bus bandwidth in GB/s between the GPUs (--gpus above 1).
    #[arg(long, default_value_t = 150.0, value_parser = positive_f64)]
    pub nccl_gbs: f64,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Options of `megatrain init`.
#[derive(Debug, Clone, Args)]
pub struct InitArgs {
    /// Hugging Face config.json of the model.
    #[arg(long, value_name = "PATH")]
    pub config: PathBuf,
    /// Output directory (Hugging Face format).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Seed of the initialisation (the same as `megatrain train --config PATH --seed N`).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Weight dtype of the safetensors.
    #[arg(long, value_enum, default_value_t = ExportDtypeArg::Bf16)]
    pub export_dtype: ExportDtypeArg,
}

impl Cli {
    /// Refuses options that the options around them make meaningless (a LoRA option without
    /// adapters), naming them: clap checks each option alone.
    pub fn check(&self) -> Result<(), String> {
        match &self.command {
            Command::Train(a) => a.check_lora(),
            Command::Estimate(a) => a.lora.refuse_without_adapters(None, &[]),
            Command::Init(_) | Command::Verify(_) | Command::LaunchInfo => Ok(()),
        }
    }
}

impl Default for TrainArgs {
    /// The defaults of `megatrain train` with no arguments.
    fn default() -> Self {
        match Cli::try_parse_from(["megatrain", "train"]) {
            Ok(Cli { command: Command::Train(a) }) => a,
            Ok(other) => unreachable!("`megatrain train` parsed as {other:?}"),
            Err(e) => unreachable!("the default command line parses: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    /// The library's defaults are the command line's: a program and `megatrain train` with no
    /// options run the same thing.
    #[test]
    fn the_command_lines_defaults_are_the_librarys() {
        assert_eq!(TrainArgs::default().to_config(), mt_train::TrainConfig::default());
    }

    /// `--moe-kernels portable` reaches the trainer's configuration; the default is the device
    /// kernels; the help names the flag under the device options.
    #[test]
    fn moe_kernels_parse_into_the_config() {
        let parse = |extra: &[&str]| {
            let mut v = vec!["megatrain", "train"];
            v.extend(extra);
            let Command::Train(a) = parse_args(v).unwrap().command else { panic!("train") };
            a.to_config().moe_kernels
        };
        assert_eq!(parse(&[]), mt_layers::MoeKernels::Device);
        assert_eq!(parse(&["--moe-kernels", "portable"]), mt_layers::MoeKernels::Portable);
        assert!(parse_args(["megatrain", "train", "--moe-kernels", "host"]).is_err());
        let help = Cli::command().find_subcommand_mut("train").unwrap().render_help().to_string();
        assert!(help.contains("--moe-kernels <device|portable>"), "{help}");
    }

    #[test]
    fn defaults_parse() {
        let a = TrainArgs::default();
        assert_eq!((a.steps, a.batch_size, a.seq_len, a.chunks), (60, 16, 64, None));
        assert!(a.config.is_none() && a.store.is_none());
    }

    #[test]
    fn a_config_file_sets_options_and_the_command_line_wins() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("run.toml");
        std::fs::write(
            &f,
            "batch_size = 3\nseq-len = 32\nlr = 0.002\nno-shuffle = true\ndata = \"synthetic\"\nout = \"-odd\"\n",
        )
        .unwrap();
        let argv = |extra: &[&str]| {
            let mut v: Vec<String> =
                ["megatrain", "train", "--config-file", f.to_str().unwrap()].map(String::from).to_vec();
            v.extend(extra.iter().map(|s| s.to_string()));
            v
        };
        let Command::Train(a) = parse_args(argv(&[])).unwrap().command else { panic!("train") };
        assert_eq!((a.batch_size, a.seq_len, a.lr, a.no_shuffle), (3, 32, Some(0.002), true));
        assert_eq!(a.data, DataSource::Builtin(DataKind::Synthetic));
        assert_eq!(a.out, Some(PathBuf::from("-odd")));
        let Command::Train(a) = parse_args(argv(&["--seq-len", "8"])).unwrap().command else {
            panic!("train")
        };
        assert_eq!((a.batch_size, a.seq_len), (3, 8));
    }

    #[test]
    fn a_config_file_with_unknown_keys_or_bad_values_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("run.toml");
        for (text, needle) in [
            ("batchsize = 3", "unknown option \"batchsize\""),
            ("no-shuffle = 1", "no-shuffle is a switch"),
            ("seq-len = 0", "--seq-len"),
            ("lr = [1]", "expected a string"),
            ("lr = ", "not valid TOML"),
        ] {
            std::fs::write(&f, text).unwrap();
            let e = parse_args(["megatrain", "train", "--config-file", f.to_str().unwrap()])
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
        let e =
            parse_args(["megatrain", "train", "--config-file", "/nonexistent.toml"]).unwrap_err().to_string();
        assert!(e.contains("cannot read"), "{e}");
    }

    #[test]
    fn zero_sizes_and_negative_rates_are_refused() {
        for bad in [["--seq-len", "0"], ["--steps", "0"], ["--lr", "-1"], ["--clip", "nan"]] {
            let r = Cli::try_parse_from(["megatrain", "train", bad[0], bad[1]]);
            let e = r.expect_err("must be refused").to_string();
            assert!(e.contains(bad[0]), "{e}");
        }
    }
}
