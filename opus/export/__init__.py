"""The optimized model leaving Opus: export formats, and loading an export back."""
