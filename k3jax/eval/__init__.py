"""Evaluation of trained runs: the run's model and tokenizer, and an lm-eval adapter (`harness`)."""
