"""What production probes run beside the mechanisms: tiny models built in memory, and the
problem builders whose answer a probe returns as evidence.

Side-effect free, as probes must be (``tests/test_probe_traces.py``): nothing downloaded, the
caller's mlx random state and process flags left as they were, scratch files removed. The
self-test kit (``mlx_lm_patches/selftest/``) builds its scenarios on these; nothing here imports
the kit or a patch.

* ``decoded`` – a decoding's tokens and log-probabilities, compared with the reference; the
  deterministic prompts;
* ``random_weights`` – deterministic random weights for tiny models;
* ``tokenizer_files`` – a small real tokenizer written into a folder, built locally;
* ``tiny_vlm`` – tiny mlx-vlm Qwen3.5 / Qwen3-VL models, in memory or as a folder;
* ``vlm_problems`` – what the mlx-vlm patches' probes look for;
* ``vllm_mlx`` – what the vllm-mlx patches' probes look for.
"""
