"""The model a replica runs: its config, weights, tokenizer, layout, and the MoE transformer."""
