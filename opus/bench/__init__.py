"""``opus bench``: the model under other runtimes and formats, timed side by side in one run (opus.cli.bench)."""
