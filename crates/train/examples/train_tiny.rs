//! Trains the built-in tiny Llama on the built-in text from Rust, printing the loss every 5 steps:
//! `cargo run --release -p mt-train --example train_tiny`. `cargo test` runs it too.
#![allow(clippy::print_stdout)]

use mt_train::{Observer, ObserverResult, StepEvent, TrainConfig, Trainer};

/// Prints every fifth step's loss and keeps all of them.
#[derive(Default)]
struct Losses(Vec<f64>);

impl Observer for Losses {
    fn step(&mut self, s: &StepEvent<'_>) -> ObserverResult {
        self.0.push(s.report.loss);
        if s.step.is_multiple_of(5) {
            println!("step {:>3}  loss {:.4}  {:.0} tokens/s", s.step, s.report.loss, s.tokens_per_s());
        }
        Ok(())
    }
}

fn main() -> mt_train::Result<()> {
    let config = TrainConfig { steps: 20, batch_size: 8, seq_len: 32, ..TrainConfig::default() };
    let mut trainer = Trainer::new(config, Losses::default())?;
    println!("{}", trainer.plan().placement_table().display_on(mt_train::DeviceKind::Cpu));
    while trainer.global_step() < trainer.end_step() {
        trainer.step()?;
    }
    let losses = std::mem::take(&mut trainer.observer().0);
    let summary = trainer.finish()?;
    println!("{summary}");
    assert!(losses.len() == 20 && losses[19] < losses[0] - 1.0, "the loss fell: {losses:?}");
    Ok(())
}

#[test]
fn the_example_trains_the_tiny_model() {
    main().unwrap();
}
