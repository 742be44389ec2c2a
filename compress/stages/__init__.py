"""Stage kinds: configs in `configs.py` (torch-free), one `run(state, cfg, ctx)` module each."""
