"""What a person reads after a run: the report document, plots, publishing into git, history and comparison."""
