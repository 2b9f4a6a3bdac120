"""Tasks: prompts, references and rewards."""
