"""The one training loop (finetune, distill, QAT): the step, checkpoints and telemetry."""
