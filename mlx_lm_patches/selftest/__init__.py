"""The self-test kit: what ``python -m mlx_lm_patches check`` runs (each patch's ``scenario``: a
user's call on a tiny model, compared with the reference path) and what the tests reuse; the
tiny models, model folders and checkpoints those scenarios need. Random weights built from
configs, tokenizers built locally: nothing here downloads anything. Patches import it only
inside their scenarios; mechanisms never do (what a probe runs lives in
``mlx_lm_patches/mechanisms/probing/``)."""
