"""The model runtime: generation (engine), measurement (metrics, noise, choose), profiling, data and export."""
