"""Mechanisms the patches share; none of them changes mlx-lm by itself.

* ``caches`` – reading mlx-lm cache objects (offsets, recurrent slots, flattening);
* ``calls`` – binding a wrapped function's arguments by name;
* ``journal`` – exact rollback of a cache list (recurrent states kept by reference);
* ``speculative`` – a supplied prompt cache split between main and draft model;
* ``cache_sync`` – a supplied prompt cache brought to exactly the tokens generated with it;
* ``prefix_reuse`` – recurrent states kept at prefill positions, restored for a shared prefix;
* ``rope_rows`` – length-dependent rotary embeddings computed per batch row;
* ``vlm_positions`` – per-row positions for mlx-vlm's Qwen3 language models;
* ``mtp`` – multi-token-prediction heads: kept at load, built per family, drafted with.
"""
