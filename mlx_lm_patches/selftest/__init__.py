"""What ``python -m mlx_lm_patches check`` and the tests run: ``scenarios`` (a user's call on a
tiny model, compared with the reference path) and the tiny models and model folders they use.
Random weights built from configs, tokenizers built locally: nothing here downloads anything."""
