"""Scenarios on tiny mlx-vlm models (:mod:`mlx_lm_patches.mechanisms.probing.tiny_vlm`):

* ``api`` – what the installed mlx-vlm offers the scenarios;
* ``batching`` – batched text generation through mlx-vlm's and mlx-lm's ``BatchGenerator``
  against each prompt alone (the ``*-batch-positions`` and padding patches);
* ``batch_generate`` – the user's ``batch_generate`` call, text and images;
* ``prefix_cache`` – mlx-vlm's automatic prefix cache (``mlx-vlm-apc-hybrid-*``);
* ``positions`` – the ``*-prefill-positions`` patches.
"""
